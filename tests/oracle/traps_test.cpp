// The silent traps of spec/MODEL.md §9, reintroduced the way they usually arrive — a config or a
// checkpoint read the wrong way — each must either be rejected at load or move the logits beyond
// the oracle tolerance (1e-3) on the fixture, so the oracle test would fail. docs/traps.md lists them.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "core/error.h"
#include "core/npy.h"
#include "engine/generate.h"
#include "engine/model.h"

namespace plow {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class Trap : public ::testing::Test {
 protected:
  // Copies a fixture to a temp dir, applies `edit_config` / `edit_tensor`, and returns the max
  // |logit − oracle| of the len80 case teacher-forced, or the load error.
  struct Outcome {
    double max_error = 0;
    std::string error;
  };

  Outcome run(const std::string& fixture, const std::function<void(json&)>& edit_config,
              const std::function<void(const std::string& name, uint8_t* data, size_t bytes)>& edit_tensor = nullptr) {
    const fs::path dir = fs::temp_directory_path() / ("plow_trap_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir);
    fs::copy(fs::path(PLOW_TEST_DATA) / fixture, dir, fs::copy_options::recursive);
    json config = json::parse(std::ifstream(dir / "config.json"));
    edit_config(config);
    std::ofstream(dir / "config.json", std::ios::trunc) << config.dump();
    if (edit_tensor) rewrite_tensors(dir / "model.safetensors", edit_tensor);
    Outcome outcome;
    try {
      const auto model = LoadedModel::load(dir.string());
      const json manifest = json::parse(std::ifstream(dir / "oracle.json"));
      const json* found = nullptr;
      for (const json& c : manifest.at("cases")) {
        if (c.at("name") == "len80") found = &c;
      }
      GenerateOptions options;
      options.prompt = found->at("prompt_ids").get<std::vector<int32_t>>();
      options.forced_tokens = found->at("runs").at("float32").at("greedy_ids").get<std::vector<int32_t>>();
      options.max_new_tokens = static_cast<int64_t>(options.forced_tokens.size());
      options.keep_logits = true;
      ReferenceBackend backend(model->graph, *model->weights, DType::F32, 1);
      const GenerateResult result = generate(backend, 0, options);
      const NpyArray oracle = read_npy_f32((dir / found->at("runs").at("float32").at("logits").get<std::string>()).string());
      for (size_t i = 0; i < oracle.data.size(); ++i) {
        const double d = std::fabs(static_cast<double>(result.logits[i]) - oracle.data[i]);
        outcome.max_error = std::isnan(d) ? INFINITY : std::max(outcome.max_error, d);
      }
    } catch (const Error& e) {
      outcome.error = e.what();
    }
    fs::remove_all(dir);
    std::printf("%s: %s\n", ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                outcome.error.empty() ? fmt::format("max |logit − oracle| = {:.3g}", outcome.max_error).c_str() : outcome.error.c_str());
    return outcome;
  }

  static void rewrite_tensors(const fs::path& path, const std::function<void(const std::string&, uint8_t*, size_t)>& edit) {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    uint64_t length = 0;
    std::memcpy(&length, bytes.data(), 8);
    const json header = json::parse(bytes.substr(8, length));
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") continue;
      const auto begin = entry.at("data_offsets")[0].get<size_t>(), end = entry.at("data_offsets")[1].get<size_t>();
      edit(name, reinterpret_cast<uint8_t*>(bytes.data()) + 8 + length + begin, end - begin);
    }
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }

  static void expect_caught(const Outcome& outcome) {
    EXPECT_TRUE(!outcome.error.empty() || outcome.max_error > 1e-3) << "trap not caught: max error " << outcome.max_error;
  }
};

TEST_F(Trap, Baseline) {  // the untouched fixture passes, so every failure below is the trap's doing
  const Outcome ok = run("tiny-k3", [](json&) {});
  EXPECT_EQ(ok.error, "");
  EXPECT_LT(ok.max_error, 1e-3);
}

TEST_F(Trap, ZeroBasedLayerLists) {  // §9.3
  expect_caught(run("tiny-kimi-linear", [](json& c) {
    c["linear_attn_config"]["kda_layers"] = {0, 1, 2, 4};
    c["linear_attn_config"]["full_attn_layers"] = {3};
  }));
}

TEST_F(Trap, EveryFourthLayerRule) {  // §9.3: no lists at all must not fall back to a rule
  expect_caught(run("tiny-kimi-linear", [](json& c) {
    c["linear_attn_config"].erase("kda_layers");
    c["linear_attn_config"].erase("full_attn_layers");
  }));
}

TEST_F(Trap, SiluInsteadOfSitu) {  // §9.19
  expect_caught(run("tiny-k3", [](json& c) { c["text_config"]["hidden_act"] = "silu"; }));
}

TEST_F(Trap, UnboundedKdaGateInK3) {  // §9.7
  expect_caught(run("tiny-k3", [](json& c) { c["text_config"]["linear_attn_config"].erase("gate_lower_bound"); }));
}

TEST_F(Trap, AttnResBlockCountedInSublayers) {  // §9.14: S counts decoder layers
  expect_caught(run("tiny-k3", [](json& c) { c["text_config"]["attn_res_block_size"] = 6; }));
}

TEST_F(Trap, AttnResIgnored) {  // §9.14: plain residuals instead of AttnRes
  expect_caught(run("tiny-k3", [](json& c) { c["text_config"].erase("attn_res_block_size"); }));
}

TEST_F(Trap, LatentNormDropped) {  // §9.12
  expect_caught(run("tiny-k3", [](json& c) { c["text_config"]["latent_moe_use_norm"] = false; }));
}

TEST_F(Trap, MlaOutputGateDropped) {  // §9.18
  expect_caught(run("tiny-k3", [](json& c) { c["text_config"]["mla_use_output_gate"] = false; }));
}

TEST_F(Trap, Mxfp4NibbleOrderSwapped) {  // §9.17: high nibble read as the even element
  expect_caught(run("tiny-k3", [](json&) {}, [](const std::string& name, uint8_t* data, size_t bytes) {
    if (!name.ends_with("weight_packed")) return;
    for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>((data[i] << 4) | (data[i] >> 4));
  }));
}

TEST_F(Trap, Mxfp4ScaleBiasOffByOne) {  // §9.17: 2^(e−127), not 2^(e−128)
  expect_caught(run("tiny-k3", [](json&) {}, [](const std::string& name, uint8_t* data, size_t bytes) {
    if (!name.ends_with("weight_scale")) return;
    for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(data[i] - 1);
  }));
}

TEST_F(Trap, WithoutTheLanguageModelPrefix) {  // §9.20: K3 tensors live under language_model.
  expect_caught(run("tiny-k3", [](json& c) {
    const json text = c["text_config"];
    c = text;  // read as a plain kimi_linear checkpoint
  }));
}

TEST_F(Trap, TiedEmbeddingsAssumed) {  // §9.20: tie_word_embeddings is false
  expect_caught(run("tiny-kimi-linear", [](json& c) { c["tie_word_embeddings"] = true; }));
}

TEST_F(Trap, GateUpSwapped) {  // §9.13: w1 = gate, w3 = up; reading them the other way round
  std::map<std::string, std::pair<uint8_t*, size_t>> gates;
  expect_caught(run("tiny-kimi-linear", [](json&) {}, [&gates](const std::string& name, uint8_t* data, size_t bytes) {
    if (name.find(".experts.") == std::string::npos) return;
    const std::string expert = name.substr(0, name.size() - std::string(".w1.weight").size());
    if (name.ends_with(".w1.weight")) gates[expert] = {data, bytes};  // header keys are sorted: w1 comes before w3
    if (name.ends_with(".w3.weight")) std::swap_ranges(data, data + bytes, gates.at(expert).first);
  }));
}

}  // namespace
}  // namespace plow
