// Bad input through the real `plow` binary: each case must exit non-zero, print nothing on stdout and
// exactly one line on stderr naming the problem. CI also runs these under ASan/UBSan.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "cli_test_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const char* kFixture = "tiny-kimi-linear";

using plow::test::Outcome;
using plow::test::slurp;

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / (std::string("plow_bad_") + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    model_ = dir_ / "model";
    fs::create_directories(dir_);
    ASSERT_TRUE(fs::exists(fs::path(PLOW_TEST_DATA) / kFixture / "model.safetensors")) << "fixture missing";
    fs::copy(fs::path(PLOW_TEST_DATA) / kFixture, model_, fs::copy_options::recursive);
  }
  void TearDown() override { fs::remove_all(dir_); }

  Outcome run(const std::string& args) { return plow::test::run_plow(args, dir_); }

  Outcome generate() { return run("generate --model " + model_.string() + " --prompt-ids 5,17,42 --max-new-tokens 2"); }

  // Rewrites model.safetensors with an edited header; the data section is kept (plus `extra` bytes).
  void edit_header(const std::function<void(json&, uint64_t data_size)>& edit, size_t extra = 0) {
    const fs::path path = model_ / "model.safetensors";
    const std::string bytes = slurp(path);
    uint64_t length = 0;
    std::memcpy(&length, bytes.data(), 8);
    json header = json::parse(bytes.substr(8, length));
    std::string data = bytes.substr(8 + length);
    edit(header, data.size());
    data.append(extra, '\0');
    const std::string text = header.dump();
    const uint64_t new_length = text.size();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&new_length), 8);
    out << text << data;
  }

  void edit_config(const std::function<void(json&)>& edit) {
    json config = json::parse(slurp(model_ / "config.json"));
    edit(config);
    std::ofstream(model_ / "config.json", std::ios::trunc) << config.dump(2);
  }

  void expect_rejected(const Outcome& outcome, const std::string& needle) {
    EXPECT_NE(outcome.exit_code, 0);
    EXPECT_LT(outcome.exit_code, 128) << "killed by a signal or timed out";
    EXPECT_EQ(outcome.out, "") << "printed output on failure";
    EXPECT_EQ(outcome.err.rfind("plow: error: ", 0), 0u) << outcome.err;
    EXPECT_EQ(std::count(outcome.err.begin(), outcome.err.end(), '\n'), 1) << outcome.err;
    EXPECT_NE(outcome.err.find(needle), std::string::npos) << "expected '" << needle << "' in: " << outcome.err;
  }

  fs::path dir_, model_;
};

TEST_F(BadInput, ValidFixtureRuns) {
  const Outcome ok = generate();
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.out.find("\"generated_ids\""), std::string::npos);
}

TEST_F(BadInput, MissingModelDirectory) {
  expect_rejected(run("generate --model " + (dir_ / "nowhere").string() + " --prompt-ids 1"), "does not exist");
}

TEST_F(BadInput, TruncatedFile) {
  fs::resize_file(model_ / "model.safetensors", 4);
  expect_rejected(generate(), "truncated: 4 bytes");
}

TEST_F(BadInput, TruncatedData) {
  fs::resize_file(model_ / "model.safetensors", fs::file_size(model_ / "model.safetensors") - 16);
  expect_rejected(generate(), "lie outside the data section");
}

TEST_F(BadInput, HeaderLengthBeyondFile) {
  std::fstream file(model_ / "model.safetensors", std::ios::binary | std::ios::in | std::ios::out);
  const uint64_t huge = uint64_t{1} << 40;
  file.write(reinterpret_cast<const char*>(&huge), 8);
  file.close();
  expect_rejected(generate(), "header length 1099511627776 runs past the end of the file");
}

TEST_F(BadInput, OffsetsOutsideFile) {
  edit_header([](json& header, uint64_t data_size) {
    header["model.norm.weight"]["data_offsets"] = {data_size + 8, data_size + 8 + 256};
  });
  expect_rejected(generate(), "tensor 'model.norm.weight': data_offsets");
}

TEST_F(BadInput, OverlappingTensors) {
  edit_header([](json& header, uint64_t) {
    header["model.layers.0.input_layernorm.weight"]["data_offsets"] = header["model.norm.weight"]["data_offsets"];
  });
  expect_rejected(generate(), "overlap in the data section");
}

TEST_F(BadInput, ShapeDisagreesWithByteCount) {
  edit_header([](json& header, uint64_t) { header["model.norm.weight"]["shape"] = {65}; });
  expect_rejected(generate(), "tensor 'model.norm.weight': 256 bytes stored, but dtype F32 × shape [65] needs 260");
}

TEST_F(BadInput, DtypeDisagreesWithByteCount) {
  edit_header([](json& header, uint64_t) { header["model.norm.weight"]["dtype"] = "BF16"; });
  expect_rejected(generate(), "tensor 'model.norm.weight': 256 bytes stored, but dtype BF16 × shape [64] needs 128");
}

TEST_F(BadInput, MissingTensor) {
  edit_header([](json& header, uint64_t) { header.erase("model.layers.3.self_attn.kv_b_proj.weight"); });
  expect_rejected(generate(), "required tensor 'model.layers.3.self_attn.kv_b_proj.weight'");
}

TEST_F(BadInput, ExtraUnclaimedTensor) {
  edit_header([](json& header, uint64_t data_size) {
    header["model.layers.1.self_attn.rotary_emb.inv_freq"] = {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {data_size, data_size + 16}}};
  }, 16);
  expect_rejected(generate(), "tensor 'model.layers.1.self_attn.rotary_emb.inv_freq' (shape [4]) is not used");
}

TEST_F(BadInput, MalformedConfigJson) {
  std::ofstream(model_ / "config.json", std::ios::trunc) << "{\"model_type\": \"kimi_linear\", ";
  expect_rejected(generate(), "config.json: malformed JSON");
}

TEST_F(BadInput, MalformedHeaderJson) {
  std::fstream file(model_ / "model.safetensors", std::ios::binary | std::ios::in | std::ios::out);
  file.seekp(8);
  file.write("[[[", 3);
  file.close();
  expect_rejected(generate(), "malformed JSON header");
}

TEST_F(BadInput, ConfigContradictsTensors) {
  edit_config([](json& config) { config["moe_intermediate_size"] = 48; });
  expect_rejected(generate(), "has shape [32,64], but config.json implies [48,64]");
}

TEST_F(BadInput, InconsistentLayerLists) {
  edit_config([](json& config) {
    config.erase("layer_types");
    config["linear_attn_config"]["kda_layers"] = {1, 2, 3, 4, 5};
  });
  expect_rejected(generate(), "layer 4 (1-based) is in both");
}

TEST_F(BadInput, PromptIdOutsideVocabulary) {
  expect_rejected(run("generate --model " + model_.string() + " --prompt-ids 5,256 --max-new-tokens 2"),
                  "id 256 at position 1 is outside the vocabulary (vocab_size 256");
  expect_rejected(run("generate --model " + model_.string() + " --prompt-ids 5,-1 --max-new-tokens 2"), "id -1 at position 1");
}

TEST_F(BadInput, TextPromptWithoutTokenizer) {
  expect_rejected(run("generate --model " + model_.string() + " --prompt 'def f(x):' --max-new-tokens 2"), "has no tokenizer.json or tiktoken.model");
}

TEST_F(BadInput, TextPromptThatTheModelCannotTake) {
  // A tokenizer with a larger vocabulary than the model: the encoded prompt is rejected by id.
  fs::copy_file(fs::path(PLOW_TEST_DATA) / "tokenizers/hf_merges_pairs/tokenizer.json", model_ / "tokenizer.json");
  expect_rejected(run("generate --model " + model_.string() + " --prompt 'while True: print(42)' --max-new-tokens 2"),
                  "is outside the vocabulary (vocab_size 256");
}

TEST_F(BadInput, MalformedTokenizer) {
  std::ofstream(model_ / "tokenizer.json") << "{\"model\": {\"type\": \"Unigram\"";
  expect_rejected(generate(), "tokenizer.json");
}

TEST_F(BadInput, ServeChatAndBenchServeOptions) {
  const std::string m = " --model " + model_.string();
  expect_rejected(run("serve" + m + " --port 0 --prefix-cache-mb -1"), "--prefix-cache-mb must be >= 0");
  expect_rejected(run("serve" + m + " --port 0 --backend tpu"), "--backend 'tpu': expected cpu, cpu-plan, cuda or cuda-eager");
  expect_rejected(run("serve" + m + " --port 0 --backend cpu-plan --workers -2"), "--workers must be >= 1");
  expect_rejected(run("serve" + m + " --port 0 --max-num-batched-tokens -5"), "--max-num-batched-tokens must be >= 1 (0: the backend's default), found -5");
  expect_rejected(run("serve" + m + " --port 0 --max-prefill-chunk 512"), "--max-prefill-chunk 512 exceeds the step's 256 tokens");
  expect_rejected(run("chat" + m + " </dev/null"), "has no tokenizer.json");
  expect_rejected(run("chat" + m + " --max-tokens 0 </dev/null"), "--max-tokens must be >= 1");
  expect_rejected(run("bench serve"), "exactly one of --model DIR");
  expect_rejected(run("bench serve" + m + " --concurrency 4,0"), "--concurrency: levels must be >= 1, found 0");
  expect_rejected(run("bench serve" + m + " --turns 0"), "--turns must be >= 1, found 0");
}

// `bench kda` checks its options before it asks for a GPU; a build without the cuda backend says that
// it has none instead.
TEST_F(BadInput, BenchKdaOptions) {
  const auto expect = [&](const std::string& args, const std::string& needle) {
    expect_rejected(run("bench kda " + args), PLOW_TEST_CUDA ? needle : std::string("this build of plow has no cuda backend"));
  };
  expect("--tokens 1024,0", "--tokens 0: expected 1..1048576");
  expect("--dim 200", "--dim 200: expected 1..128");
  expect("--heads 0", "--heads 0: expected 1..256");
  expect("--gate logsigmoid,steep", "--gate steep: expected logsigmoid or kimi-form");
  expect("--reps 0", "--reps must be >= 1, found 0");
}

TEST_F(BadInput, InspectRejectsTheSameWay) {
  fs::remove(model_ / "config.json");
  expect_rejected(run("inspect --model " + model_.string()), "cannot open config file");
}

}  // namespace
