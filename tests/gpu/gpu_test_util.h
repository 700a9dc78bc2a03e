// Shared by the GPU tests that run checkpoint fixtures: where the fixtures are (PLOW_TEST_DATA in the
// environment overrides the compiled-in path: the GPU machine runs a copy), which of them carry
// weights, a deterministic prompt, and the fixture × workers × mode case table with its test names.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace plow::gpu_test {

inline std::string data_dir() {
  const char* env = std::getenv("PLOW_TEST_DATA");
  return env != nullptr ? env : PLOW_TEST_DATA;
}

// Directories of tests/data with a config.json and safetensors (not tokenizer-only fixtures), sorted.
inline std::vector<std::string> fixtures() {
  namespace fs = std::filesystem;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(data_dir())) {
    if (!fs::exists(entry.path() / "config.json") || fs::exists(entry.path() / "tokenizer_config.json.only")) continue;
    bool has_weights = false;
    for (const auto& file : fs::directory_iterator(entry.path())) has_weights |= file.path().extension() == ".safetensors";
    if (has_weights) names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// `length` token ids below `vocab`, the same for the same seed (xorshift).
inline std::vector<int32_t> prompt(int seed, int64_t vocab, int64_t length) {
  std::vector<int32_t> ids;
  uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(seed + 1);
  for (int64_t i = 0; i < length; ++i) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    ids.push_back(static_cast<int32_t>((x * 0x2545F4914F6CDD1Dull >> 33) % static_cast<uint64_t>(vocab)));
  }
  return ids;
}

struct FixtureCase {
  std::string fixture;
  int workers;
  bool eager;
};

// Every fixture with 7 and 132 megakernel workers and 7 eager.
inline std::vector<FixtureCase> fixture_cases() {
  std::vector<FixtureCase> all;
  for (const std::string& f : fixtures()) {
    all.push_back({f, 7, false});
    all.push_back({f, 132, false});
    all.push_back({f, 7, true});
  }
  return all;
}

inline std::string case_name(const FixtureCase& c) {
  std::string name = c.fixture + "_w" + std::to_string(c.workers) + (c.eager ? "_eager" : "_mega");
  for (char& ch : name) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return name;
}

}  // namespace plow::gpu_test
