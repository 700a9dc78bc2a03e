#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

namespace plow {
namespace {

using nlohmann::json;

// spec/MODEL.md §8 tiny-kimi-linear, in the Moonshot form.
json tiny_config() {
  return json::parse(R"({"model_type":"kimi_linear","vocab_size":256,"hidden_size":64,"intermediate_size":96,
    "moe_intermediate_size":32,"num_hidden_layers":5,"num_attention_heads":2,"num_key_value_heads":2,"q_lora_rank":null,
    "kv_lora_rank":16,"qk_nope_head_dim":16,"qk_rope_head_dim":8,"v_head_dim":16,"mla_use_nope":true,
    "num_experts":8,"num_experts_per_token":2,"num_shared_experts":1,"moe_router_activation_func":"sigmoid",
    "moe_renormalize":true,"routed_scaling_factor":2.446,"use_grouped_topk":true,"num_expert_group":1,
    "topk_group":1,"first_k_dense_replace":1,"moe_layer_freq":1,"rms_norm_eps":1e-5,"hidden_act":"silu",
    "tie_word_embeddings":false,"bos_token_id":0,"eos_token_id":1,"pad_token_id":2,
    "linear_attn_config":{"num_heads":2,"head_dim":16,"short_conv_kernel_size":4,"kda_layers":[1,2,3,5],"full_attn_layers":[4]}})");
}

std::string error_of(const json& config) {
  try {
    parse_model_config(config, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, ParsesMoonshotNames) {
  const ModelConfig c = parse_model_config(tiny_config(), "config.json");
  EXPECT_EQ(c.num_layers, 5);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.experts_per_token, 2);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.446f);
  EXPECT_EQ(c.kda.head_dim, 16);
  const std::vector<MixerKind> expected = {MixerKind::kKda, MixerKind::kKda, MixerKind::kKda, MixerKind::kMla, MixerKind::kKda};
  EXPECT_EQ(c.mixers, expected);  // 1-based list [4] is the 0-based layer 3
  const std::vector<FfnKind> ffns = {FfnKind::kDense, FfnKind::kMoe, FfnKind::kMoe, FfnKind::kMoe, FfnKind::kMoe};
  EXPECT_EQ(c.ffns, ffns);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{1});
}

TEST(Config, ParsesHfAliasesAndExplicitLayerTypes) {
  json config = tiny_config();
  config.erase("num_experts");
  config.erase("num_experts_per_token");
  config.erase("linear_attn_config");
  config["num_local_experts"] = 8;
  config["num_experts_per_tok"] = 2;
  config["linear_num_heads"] = 2;
  config["linear_head_dim"] = 16;
  config["linear_conv_kernel_dim"] = 4;
  config["layer_types"] = {"linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"};
  const ModelConfig c = parse_model_config(config, "config.json");
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.mixers[1], MixerKind::kMla);
  EXPECT_EQ(c.mixers[4], MixerKind::kMla);
}

TEST(Config, RejectsInconsistentLayerLists) {
  json overlap = tiny_config();
  overlap["linear_attn_config"]["kda_layers"] = {1, 2, 3, 4, 5};
  EXPECT_NE(error_of(overlap).find("layer 4 (1-based) is in both"), std::string::npos) << error_of(overlap);

  json gap = tiny_config();
  gap["linear_attn_config"]["kda_layers"] = {1, 2, 5};
  EXPECT_NE(error_of(gap).find("layer 3 (1-based) is in neither"), std::string::npos) << error_of(gap);

  json zero_based = tiny_config();  // the 0-based reading of the same schedule
  zero_based["linear_attn_config"]["kda_layers"] = {0, 1, 2, 4};
  zero_based["linear_attn_config"]["full_attn_layers"] = {3};
  EXPECT_NE(error_of(zero_based).find("holds layer 0, expected 1-based numbers in 1..5"), std::string::npos) << error_of(zero_based);

  json contradiction = tiny_config();
  contradiction["layer_types"] = {"linear_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention"};
  EXPECT_NE(error_of(contradiction).find("'layer_types' contradicts"), std::string::npos) << error_of(contradiction);

  json wrong_length = tiny_config();
  wrong_length["mlp_layer_types"] = {"dense", "sparse"};
  EXPECT_NE(error_of(wrong_length).find("'mlp_layer_types' must be a list of 5 entries"), std::string::npos);

  json no_schedule = tiny_config();
  no_schedule.erase("linear_attn_config");
  no_schedule["linear_num_heads"] = 2;
  no_schedule["linear_head_dim"] = 16;
  no_schedule["linear_conv_kernel_dim"] = 4;
  EXPECT_NE(error_of(no_schedule).find("no layer schedule"), std::string::npos) << error_of(no_schedule);
}

TEST(Config, RejectsBadFields) {
  json missing = tiny_config();
  missing.erase("hidden_size");
  EXPECT_EQ(error_of(missing), "config.json: required field 'hidden_size' is missing");

  json wrong_type = tiny_config();
  wrong_type["num_experts"] = "eight";
  EXPECT_EQ(error_of(wrong_type), "config.json: field 'num_experts' must be an integer, found \"eight\"");

  json negative = tiny_config();
  negative["vocab_size"] = -3;
  EXPECT_EQ(error_of(negative), "config.json: field 'vocab_size' must be >= 1, found -3");

  json aliases_disagree = tiny_config();
  aliases_disagree["num_local_experts"] = 16;
  EXPECT_NE(error_of(aliases_disagree).find("'num_experts' and 'num_local_experts' disagree"), std::string::npos);

  json rope = tiny_config();
  rope["mla_use_nope"] = false;
  EXPECT_NE(error_of(rope).find("'mla_use_nope' is false"), std::string::npos);

  json other_model = tiny_config();
  other_model["model_type"] = "llama";
  EXPECT_NE(error_of(other_model).find("'model_type' is \"llama\""), std::string::npos);

  json too_many_experts = tiny_config();
  too_many_experts["num_experts_per_token"] = 9;
  EXPECT_NE(error_of(too_many_experts).find("exceeds 'num_experts'=8"), std::string::npos);

  EXPECT_NE(error_of(json::array()).find("expected a JSON object"), std::string::npos);
}

}  // namespace
}  // namespace plow
