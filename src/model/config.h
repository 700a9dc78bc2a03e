// ModelConfig: the validated contents of a Kimi Linear config.json (spec/MODEL.md §2–3).
// Accepts the Moonshot field names and the HF aliases; the layer schedule comes from the 1-based
// linear_attn_config lists and/or the explicit layer_types lists, which must agree with each other.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace plow {

enum class MixerKind { kKda, kMla };
enum class FfnKind { kDense, kMoe };
enum class RouterActivation { kSigmoid, kSoftmax };
enum class FfnActivation { kSilu, kSitu };

struct KdaConfig {
  int64_t num_heads = 0;
  int64_t head_dim = 0;
  int64_t conv_kernel = 0;
  std::optional<float> gate_lower_bound;  // K3: g = lb·σ(exp(A_log)·(f + dt_bias)) (§7.5)
  bool full_rank_gate = false;            // K3: output gate z = x·g_projᵀ instead of g_a/g_b
};

// SiTU(a, b) = β·tanh(a/β)·σ(a) · β_lin·tanh(b/β_lin) (§7.6); no linear_beta: the up branch is b.
struct SituConfig {
  float beta = 4.0f;
  std::optional<float> linear_beta = 25.0f;
};

struct ModelConfig {
  std::string source;  // the file the config came from, for error messages
  std::string model_type;

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t intermediate_size = 0;
  float rms_norm_eps = 1e-5f;
  bool tie_word_embeddings = false;
  FfnActivation activation = FfnActivation::kSilu;  // hidden_act: "silu" or "situ"
  SituConfig situ;

  // MoE (§4.5)
  int64_t moe_intermediate_size = 0;
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t num_shared_experts = 0;
  RouterActivation router_activation = RouterActivation::kSigmoid;
  bool moe_renormalize = true;
  float routed_scaling_factor = 1.0f;
  int64_t num_expert_group = 1;
  int64_t topk_group = 1;

  // MLA (§4.3)
  int64_t num_attention_heads = 0;
  std::optional<int64_t> q_lora_rank;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  bool mla_output_gate = false;  // K3 gated MLA (§7.4)

  KdaConfig kda;

  // K3 extensions (§7): absent for Kimi Linear.
  std::optional<int64_t> latent_moe_size;  // routed_expert_hidden_size: LatentMoE latent width (§7.3)
  bool latent_moe_norm = false;            // latent_moe_use_norm
  std::optional<int64_t> attn_res_block_size;  // Block AttnRes, in decoder layers (§7.2)
  bool experts_mxfp4 = false;              // routed experts stored as compressed-tensors MXFP4 (§7.7)

  std::vector<MixerKind> mixers;  // per layer, 0-based
  std::vector<FfnKind> ffns;      // per layer, 0-based

  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> pad_token_id;

  std::string wrapper_type;   // "kimi_k3" when the text model sits under text_config
  std::string tensor_prefix;  // "" for kimi_linear; K3 checkpoints prefix "language_model."
  std::optional<std::string> torch_dtype;

  int64_t mla_qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t kda_width() const { return kda.num_heads * kda.head_dim; }
  int64_t num_layers_of(MixerKind kind) const;
  int64_t moe_io_width() const { return latent_moe_size.value_or(hidden_size); }  // what routed experts read and write
};

// Parses and validates; throws plow::Error naming `source`, the field, the value and what was expected.
ModelConfig parse_model_config(const nlohmann::json& root, const std::string& source);
ModelConfig load_model_config(const std::string& path);

}  // namespace plow
