// Shared by the tokenizer tests: the committed fixtures and expected.json (written by
// tests/data/tokenizers/make_tokenizer_fixtures.py from HF tokenizers and tiktoken), and scratch model
// directories for variants and malformed inputs.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>

namespace plow::test {

inline std::filesystem::path tokenizer_data() { return std::filesystem::path(PLOW_TEST_DATA) / "tokenizers"; }

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline const nlohmann::json& expected() {
  static const nlohmann::json e = nlohmann::json::parse(read_text(tokenizer_data() / "expected.json"));
  return e;
}

// A corpus entry: a string, or {"prefix" (optional), "repeat", "count", "suffix"} for a long one.
inline std::string corpus_string(const nlohmann::json& entry) {
  if (entry.is_string()) return entry.get<std::string>();
  std::string s = entry.value("prefix", "");
  for (int64_t i = 0; i < entry["count"].get<int64_t>(); ++i) s += entry["repeat"].get<std::string>();
  return s + entry["suffix"].get<std::string>();
}

// A fresh directory under the system temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("plow_tokenizer_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  void write(const std::string& name, const std::string& content) const {
    std::ofstream out(path_ / name, std::ios::binary);
    out << content;
  }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace plow::test
