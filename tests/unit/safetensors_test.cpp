#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "model/safetensors.h"

namespace plow {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("plow_st_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes header length (or `claimed_length`), header text and `data_bytes` bytes of payload.
  std::string write(const std::string& name, const std::string& header, size_t data_bytes, int64_t claimed_length = -1) {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path, std::ios::binary);
    const uint64_t length = claimed_length >= 0 ? static_cast<uint64_t>(claimed_length) : header.size();
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << header;
    const std::string data(data_bytes, '\x11');
    out << data;
    return path;
  }

  std::string error_opening(const std::string& path) {
    try {
      SafetensorsFile file(path);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, ReadsValidFile) {
  const auto path = write("ok.safetensors",
                          R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                          R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}})", 22);
  SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), 2u);
  const TensorView& b = file.tensors().at("b");
  EXPECT_EQ(b.dtype, DType::BF16);
  EXPECT_EQ(b.numel(), 3);
  EXPECT_EQ(b.nbytes, 6u);
}

TEST_F(SafetensorsTest, RejectsTruncatedFile) {
  const auto path = (dir_ / "short.safetensors").string();
  std::ofstream(path, std::ios::binary) << "abc";
  EXPECT_NE(error_opening(path).find("truncated: 3 bytes"), std::string::npos);
}

TEST_F(SafetensorsTest, RejectsHeaderLengthBeyondFile) {
  const auto path = write("long.safetensors", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4, 1 << 20);
  EXPECT_NE(error_opening(path).find("header length 1048576 runs past the end of the file"), std::string::npos);
}

TEST_F(SafetensorsTest, RejectsOffsetsOutsideData) {
  const auto path = write("out.safetensors", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  EXPECT_NE(error_opening(path).find("tensor 'a': data_offsets [0, 16] lie outside the data section of 8 bytes"), std::string::npos)
      << error_opening(path);
}

TEST_F(SafetensorsTest, RejectsOverlap) {
  const auto path = write("overlap.safetensors",
                          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  EXPECT_NE(error_opening(path).find("tensors 'a' and 'b' overlap"), std::string::npos) << error_opening(path);
}

TEST_F(SafetensorsTest, RejectsByteCountMismatch) {
  const auto path = write("count.safetensors", R"({"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", 8);
  EXPECT_NE(error_opening(path).find("tensor 'a': 8 bytes stored, but dtype BF16 × shape [3] needs 6"), std::string::npos)
      << error_opening(path);
}

TEST_F(SafetensorsTest, RejectsBadHeaders) {
  EXPECT_NE(error_opening(write("json.safetensors", R"({"a": {)", 0)).find("malformed JSON header"), std::string::npos);
  EXPECT_NE(error_opening(write("dtype.safetensors", R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", 1))
                .find("unsupported dtype 'Q4'"),
            std::string::npos);
  EXPECT_NE(error_opening(write("shape.safetensors", R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4))
                .find("shape entry -1"),
            std::string::npos);
  EXPECT_NE(error_opening(write("huge.safetensors",
                                R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}})", 4))
                .find("overflows"),
            std::string::npos);
}

TEST_F(SafetensorsTest, ShardedCheckpoint) {
  write("s1.safetensors", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4);
  write("s2.safetensors", R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4);
  std::ofstream(dir_ / "model.safetensors.index.json") << R"({"metadata":{},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})";
  Checkpoint checkpoint = Checkpoint::open(dir_.string());
  EXPECT_EQ(checkpoint.tensors().size(), 2u);
  ASSERT_NE(checkpoint.find("b"), nullptr);
  EXPECT_EQ(checkpoint.find("c"), nullptr);

  std::ofstream(dir_ / "model.safetensors.index.json", std::ios::trunc)
      << R"({"weight_map":{"a":"s1.safetensors","b":"s3.safetensors"}})";
  try {
    Checkpoint::open(dir_.string());
    FAIL() << "missing shard accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shard 's3.safetensors' (for tensor 'b') does not exist"), std::string::npos) << e.what();
  }

  std::ofstream(dir_ / "model.safetensors.index.json", std::ios::trunc) << R"({"weight_map":{"a":"s1.safetensors"}})";
  EXPECT_EQ(Checkpoint::open(dir_.string()).tensors().size(), 1u);  // shards the index never names are not read

  write("s1.safetensors", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"c":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8);
  try {
    Checkpoint::open(dir_.string());
    FAIL() << "tensor missing from the index accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'c' is not listed"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace plow
