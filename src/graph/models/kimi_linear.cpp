// Kimi Linear (spec/MODEL.md §4) and its K3 extensions (§7): embedding, per layer [KDA | MLA] +
// [dense FFN | MoE], final norm, lm_head; K3 adds Block AttnRes, gated MLA, SiTU, LatentMoE, the
// bounded/full-rank KDA gates and MXFP4 experts. Weight names are the on-disk names of §4.6 / §7.8.
//
// Built for one rank of a tensor-parallel group (DESIGN.md §5, Megatron splits): KDA and MLA heads,
// the FFN and expert intermediate columns and the lm_head rows are divided among the ranks; the
// row-parallel projections (o_proj, down, expert down) give partial sums that one all_reduce per
// sublayer adds up; router, norms, AttnRes, the embedding and the low-rank waists (f_a, g_a, q_a,
// kv_a, the latent MoE projections) are replicated, and so is the MLA latent cache.
#include <fmt/format.h>

#include "core/error.h"
#include "graph/models/registry.h"

namespace plow {

namespace {

class KimiLinearBuilder {
 public:
  KimiLinearBuilder(const ModelConfig& config, TpShard shard) : c_(config), tp_(shard) {
    if (tp_.size < 1 || tp_.rank < 0 || tp_.rank >= tp_.size) fail("tensor parallelism: rank {} of {} is not a rank of the group", tp_.rank, tp_.size);
  }

  Graph build() {
    const std::string model = c_.tensor_prefix + "model.";
    const int tokens = g_.add(Op::kTokens, {}, {}, {}, "tokens");
    // h is the residual stream; with Block AttnRes (K3, §7.2) it is the partial block sum P, and
    // `blocks` holds the completed block values b₀ = e, b₁, … that every sublayer input mixes over.
    int h = g_.add(Op::kEmbedding, {tokens}, {weight(model + "embed_tokens.weight", {c_.vocab_size, c_.hidden_size})}, {}, "embed");
    const bool attn_res = c_.attn_res_block_size.has_value();
    std::vector<int> blocks;
    for (int64_t i = 0; i < c_.num_layers; ++i) {
      const std::string p = fmt::format("{}layers.{}.", model, i);
      const std::string label = fmt::format("layers.{}", i);
      const bool block_start = attn_res && i % *c_.attn_res_block_size == 0;
      int u = attn_res ? mix(blocks, h, p + "self_attention_res_", label + ".attn_res") : h;
      if (block_start) blocks.push_back(h);
      int x = norm(u, p + "input_layernorm.weight", c_.hidden_size, c_.rms_norm_eps, label + ".input_norm");
      const bool kda = c_.mixers[static_cast<size_t>(i)] == MixerKind::kKda;
      const int a = kda ? kda_mixer(x, p + "self_attn.", label + ".kda") : mla_mixer(x, p + "self_attn.", label + ".mla");
      h = block_start ? a : g_.add(Op::kAdd, {h, a}, {}, {}, label + ".attn_residual");
      u = attn_res ? mix(blocks, h, p + "mlp_res_", label + ".mlp_res") : h;
      x = norm(u, p + "post_attention_layernorm.weight", c_.hidden_size, c_.rms_norm_eps, label + ".post_attn_norm");
      const int m = c_.ffns[static_cast<size_t>(i)] == FfnKind::kMoe
                        ? moe(x, p + "block_sparse_moe.", label + ".moe")
                        : all_reduce(mlp(x, p + "mlp.", c_.intermediate_size, "intermediate_size", label + ".mlp"), label + ".mlp");
      h = g_.add(Op::kAdd, {h, m}, {}, {}, label + ".ffn_residual");
    }
    if (attn_res) h = mix(blocks, h, model + "output_attn_res_", "output_attn_res");
    h = norm(h, model + "norm.weight", c_.hidden_size, c_.rms_norm_eps, "final_norm");
    const std::string head = c_.tie_word_embeddings ? model + "embed_tokens.weight" : c_.tensor_prefix + "lm_head.weight";
    // Column-parallel: each rank's logits are its block of the vocabulary (the engine gathers them).
    // Plans bind weights by name: a tied head's block of the table gets a name of its own.
    const std::string head_name = c_.tie_word_embeddings && tp_.size > 1 ? c_.tensor_prefix + "lm_head.weight (tied to " + head + ")" : head;
    const int logits = linear_col(h, head, c_.vocab_size, "vocab_size", "lm_head", head_name);
    g_.set_output(logits);
    g_.verify();
    return std::move(g_);
  }

 private:
  int weight(const std::string& name, std::vector<int64_t> shape, bool reshape_ok = false) {
    return g_.add_weight({name, {name}, std::move(shape), reshape_ok});
  }

  // `full` divided among the ranks; `field` names the config value it comes from (for the error).
  int64_t per_rank(int64_t full, const char* field, int64_t multiple = 1) const {
    if (full % (tp_.size * multiple) != 0) {
      fail("{}: {} = {} does not divide among {} tensor-parallel ranks{}", c_.source, field, full, tp_.size,
           multiple > 1 ? fmt::format(" in blocks of {}", multiple) : "");
    }
    return full / tp_.size;
  }

  // This rank's block of `decl` along `axis` (the caller already divided decl.shape[axis]).
  void shard(WeightDecl& decl, int axis) const {
    if (tp_.size == 1) return;
    decl.shard_axis = axis;
    decl.shard_rank = tp_.rank;
    decl.shard_count = tp_.size;
  }

  // A weight cut along `axis` (0: rows, 1: columns); `shape` is the whole tensor's. `decl_name`, when
  // set, names the declaration apart from the checkpoint tensor it reads.
  int sharded_weight(const std::string& name, std::vector<int64_t> shape, int axis, const char* field, bool reshape_ok = false,
                     const std::string& decl_name = "") {
    shape[static_cast<size_t>(axis)] = per_rank(shape[static_cast<size_t>(axis)], field);
    WeightDecl decl{decl_name.empty() ? name : decl_name, {name}, std::move(shape), reshape_ok};
    shard(decl, axis);
    return g_.add_weight(std::move(decl));
  }

  int linear(int x, const std::string& name, int64_t out, const std::string& label) {
    const int64_t in = g_.node(x).width;
    return g_.add(Op::kLinear, {x}, {weight(name, {out, in})}, {}, label);
  }

  // Column-parallel: this rank's block of the `out` rows.
  int linear_col(int x, const std::string& name, int64_t out, const char* field, const std::string& label, const std::string& decl_name = "") {
    return g_.add(Op::kLinear, {x}, {sharded_weight(name, {out, g_.node(x).width}, 0, field, false, decl_name)}, {}, label);
  }

  // Row-parallel: x is this rank's block of the input columns; the result is a partial sum.
  int linear_row(int x, const std::string& name, int64_t out, const char* field, const std::string& label) {
    return g_.add(Op::kLinear, {x}, {sharded_weight(name, {out, g_.node(x).width * tp_.size}, 1, field)}, partial(), label);
  }

  // Attributes of a partial sum: with more than one rank it stays fp32 until its all_reduce.
  Attrs partial(Attrs attrs = {}) const {
    if (tp_.size > 1) attrs.set("partial", 1);
    return attrs;
  }

  // The sum of the ranks' partial results (a no-op on one rank).
  int all_reduce(int partial, const std::string& label) {
    return tp_.size == 1 ? partial : g_.add(Op::kAllReduce, {partial}, {}, {}, label + ".all_reduce");
  }

  int norm(int x, const std::string& name, int64_t width, float eps, const std::string& label) {
    return g_.add(Op::kRmsNorm, {x}, {weight(name, {width})}, {{"eps", eps}}, label);
  }

  // AttnRes over the completed blocks and the current partial sum (one value: the identity).
  int mix(const std::vector<int>& blocks, int partial, const std::string& p, const std::string& label) {
    std::vector<int> values = blocks;
    values.push_back(partial);
    return g_.add(Op::kAttnResMix, values,
                  {weight(p + "norm.weight", {c_.hidden_size}), weight(p + "proj.weight", {1, c_.hidden_size})},
                  {{"eps", c_.rms_norm_eps}}, label);
  }

  Attrs activation_attrs() const {
    return {{"situ", c_.activation == FfnActivation::kSitu ? 1.0 : 0.0},
            {"beta", c_.situ.beta},
            {"linear_beta", c_.situ.linear_beta.value_or(0.0f)}};
  }

  int activation(int gate, int up, const std::string& label) {
    if (c_.activation == FfnActivation::kSitu) return g_.add(Op::kSituMul, {gate, up}, {}, activation_attrs(), label);
    return g_.add(Op::kSiluMul, {gate, up}, {}, {}, label);
  }

  // KDA (§5) over this rank's heads; returns the whole sublayer output (all-reduced).
  int kda_mixer(int x, const std::string& p, const std::string& label) {
    const char* heads_field = "linear_attn_config.num_heads";
    const int64_t d = c_.kda.head_dim, width = c_.kda_width(), kernel = c_.kda.conv_kernel;
    const int64_t heads = per_rank(c_.kda.num_heads, heads_field), rank_width = heads * d;
    const Attrs shape = {{"heads", static_cast<double>(heads)}, {"head_dim", static_cast<double>(d)}};
    int qkv[3];
    const char* names[3] = {"q", "k", "v"};
    for (int j = 0; j < 3; ++j) {
      const int projected = linear_col(x, p + names[j] + "_proj.weight", width, heads_field, label + "." + names[j] + "_proj");
      const int window = g_.add_state({StateKind::kConvWindow, rank_width, kernel - 1, label + "." + names[j] + "_conv"});
      qkv[j] = g_.add(Op::kShortConvSilu, {projected}, {sharded_weight(p + names[j] + "_conv1d.weight", {width, 1, kernel}, 0, heads_field)},
                      {{"kernel", static_cast<double>(kernel)}}, label + "." + names[j] + "_conv", window);
    }
    const int f = linear_col(linear(x, p + "f_a_proj.weight", d, label + ".f_a"), p + "f_b_proj.weight", width, heads_field, label + ".f_b");
    Attrs gate_attrs = shape;
    if (c_.kda.gate_lower_bound) gate_attrs.set("lower_bound", *c_.kda.gate_lower_bound);
    const int gate = g_.add(Op::kKdaGate, {f},
                            {sharded_weight(p + "A_log", {c_.kda.num_heads}, 0, heads_field, true),
                             sharded_weight(p + "dt_bias", {width}, 0, heads_field, true)},
                            gate_attrs, label + ".gate");
    const int beta = g_.add(Op::kSigmoid, {linear_col(x, p + "b_proj.weight", c_.kda.num_heads, heads_field, label + ".b_proj")}, {}, {},
                            label + ".beta");
    const int state = g_.add_state({StateKind::kKdaRecurrent, rank_width, heads, label + ".state"});
    const int core = g_.add(Op::kKdaDeltaRule, {qkv[0], qkv[1], qkv[2], gate, beta}, {}, shape, label + ".core", state);
    const int z = c_.kda.full_rank_gate
                      ? linear_col(x, p + "g_proj.weight", width, heads_field, label + ".g_proj")
                      : linear_col(linear(x, p + "g_a_proj.weight", d, label + ".g_a"), p + "g_b_proj.weight", width, heads_field, label + ".g_b");
    Attrs norm_attrs = shape;
    norm_attrs.set("eps", c_.rms_norm_eps);
    const int y = g_.add(Op::kGatedRmsNorm, {core, z}, {weight(p + "o_norm.weight", {d})}, norm_attrs, label + ".o_norm");
    return all_reduce(linear_row(y, p + "o_proj.weight", c_.hidden_size, heads_field, label + ".o_proj"), label);
  }

  int mla_mixer(int x, const std::string& p, const std::string& label) {
    constexpr float kLatentNormEps = 1e-6f;  // kv_a/q_a layernorms use the module default (MODEL.md §9.4)
    const char* heads_field = "num_attention_heads";
    const int64_t all_heads = c_.num_attention_heads, heads = per_rank(all_heads, heads_field), qk = c_.mla_qk_head_dim();
    int q;
    if (c_.q_lora_rank) {
      const int qa = linear(x, p + "q_a_proj.weight", *c_.q_lora_rank, label + ".q_a");
      q = linear_col(norm(qa, p + "q_a_layernorm.weight", *c_.q_lora_rank, kLatentNormEps, label + ".q_a_norm"),
                     p + "q_b_proj.weight", all_heads * qk, heads_field, label + ".q_b");
    } else {
      q = linear_col(x, p + "q_proj.weight", all_heads * qk, heads_field, label + ".q_proj");
    }
    const int kv_a = linear(x, p + "kv_a_proj_with_mqa.weight", c_.kv_lora_rank + c_.qk_rope_head_dim, label + ".kv_a");
    const int cache = g_.add_state({StateKind::kMlaLatent, c_.kv_lora_rank + c_.qk_rope_head_dim, 0, label + ".latent"});
    // K3 (§7.4): the output gate σ(x·W_gᵀ), computed before the attention so that a backend may apply it
    // in the attention's epilogue (the cuda prefill GEMM path does).
    const int gate = c_.mla_output_gate ? linear_col(x, p + "g_proj.weight", all_heads * c_.v_head_dim, heads_field, label + ".g_proj") : -1;
    const Attrs attrs = {{"heads", static_cast<double>(heads)},         {"nope", static_cast<double>(c_.qk_nope_head_dim)},
                         {"rope", static_cast<double>(c_.qk_rope_head_dim)}, {"v", static_cast<double>(c_.v_head_dim)},
                         {"rank", static_cast<double>(c_.kv_lora_rank)}, {"eps", kLatentNormEps}};
    int o = g_.add(Op::kMlaAttention, {q, kv_a},
                         {weight(p + "kv_a_layernorm.weight", {c_.kv_lora_rank}),
                          sharded_weight(p + "kv_b_proj.weight", {all_heads * (c_.qk_nope_head_dim + c_.v_head_dim), c_.kv_lora_rank}, 0, heads_field)},
                         attrs, label + ".attention", cache);
    if (gate >= 0) o = g_.add(Op::kSigmoidMul, {o, gate}, {}, {}, label + ".output_gate");  // elementwise on the head outputs, before o_proj
    return all_reduce(linear_row(o, p + "o_proj.weight", c_.hidden_size, heads_field, label + ".o_proj"), label);
  }

  // Gate/up column-parallel, down row-parallel: this rank's partial sum of the FFN output.
  int mlp(int x, const std::string& p, int64_t inter, const char* field, const std::string& label) {
    const int gate = linear_col(x, p + "gate_proj.weight", inter, field, label + ".gate_proj");
    const int up = linear_col(x, p + "up_proj.weight", inter, field, label + ".up_proj");
    const int act = activation(gate, up, label + ".act");
    return linear_row(act, p + "down_proj.weight", c_.hidden_size, field, label + ".down_proj");
  }

  int moe(int x, const std::string& p, const std::string& label) {
    const int64_t experts = c_.num_experts, inter = c_.moe_intermediate_size, hidden = c_.hidden_size;
    const Attrs router_attrs = {{"experts", static_cast<double>(experts)},
                                {"top_k", static_cast<double>(c_.experts_per_token)},
                                {"groups", static_cast<double>(c_.num_expert_group)},
                                {"topk_groups", static_cast<double>(c_.topk_group)},
                                {"renormalize", c_.moe_renormalize ? 1.0 : 0.0},
                                {"scale", c_.routed_scaling_factor},
                                {"softmax", c_.router_activation == RouterActivation::kSoftmax ? 1.0 : 0.0}};
    // Logits sliced over all workers, then top-k over whole rows (R1, then R2–R7).
    const int logits = g_.add(Op::kRouterLogits, {x}, {weight(p + "gate.weight", {experts, hidden})}, {}, label + ".router_logits");
    const int routes = g_.add(Op::kMoeTopK, {logits}, {weight(p + "gate.e_score_correction_bias", {experts})}, router_attrs, label + ".router");
    // LatentMoE (§7.3): experts read and write the latent width; the router and shared experts see x.
    const int64_t io = c_.moe_io_width();
    const int expert_input = c_.latent_moe_size ? linear(x, p + "routed_expert_down_proj.weight", io, label + ".latent_down") : x;
    // Each expert's intermediate columns are divided among the ranks: w1/w3 by rows, w2 by columns
    // (in whole 32-element MXFP4 blocks).
    const int64_t rank_inter = per_rank(inter, "moe_intermediate_size", c_.experts_mxfp4 ? 32 : 1);
    int stacks[3];
    const char* names[3] = {"w1", "w3", "w2"};  // gate, up, down (MODEL.md §9.13)
    for (int j = 0; j < 3; ++j) {
      WeightDecl decl;
      for (int64_t e = 0; e < experts; ++e) decl.parts.push_back(fmt::format("{}experts.{}.{}.weight", p, e, names[j]));
      decl.name = decl.parts.front();
      decl.shape = j == 2 ? std::vector<int64_t>{io, rank_inter} : std::vector<int64_t>{rank_inter, io};
      decl.mxfp4 = c_.experts_mxfp4;
      shard(decl, j == 2 ? 1 : 0);
      stacks[j] = g_.add_weight(std::move(decl));
    }
    // Two ops, so a plan slices the gate/up rows and the down columns separately and no slice
    // recomputes another's activations: [T, k·I] activations of the k routed experts, then down.
    const Attrs routing = {{"experts", static_cast<double>(experts)}, {"top_k", static_cast<double>(c_.experts_per_token)}};
    Attrs gate_up_attrs = activation_attrs();
    gate_up_attrs.set("experts", static_cast<double>(experts)).set("top_k", static_cast<double>(c_.experts_per_token));
    const int acts = g_.add(Op::kMoeGateUp, {expert_input, routes}, {stacks[0], stacks[1]}, gate_up_attrs, label + ".experts_gate_up");
    int routed = g_.add(Op::kMoeDown, {acts, routes}, {stacks[2]}, partial(routing), label + ".experts_down");
    if (c_.latent_moe_size) {  // the latent norm needs the whole sum: the routed path is reduced on its own
      routed = all_reduce(routed, label + ".experts");
      if (c_.latent_moe_norm) routed = norm(routed, p + "routed_expert_norm.weight", io, c_.rms_norm_eps, label + ".latent_norm");
      routed = linear(routed, p + "routed_expert_up_proj.weight", hidden, label + ".latent_up");
      if (c_.num_shared_experts == 0) return routed;
      const int shared = all_reduce(mlp(x, p + "shared_experts.", c_.num_shared_experts * inter, "num_shared_experts × moe_intermediate_size", label + ".shared"),
                                    label + ".shared");
      return g_.add(Op::kAdd, {routed, shared}, {}, {}, label + ".combine");
    }
    if (c_.num_shared_experts == 0) return all_reduce(routed, label);
    const int shared = mlp(x, p + "shared_experts.", c_.num_shared_experts * inter, "num_shared_experts × moe_intermediate_size", label + ".shared");
    return all_reduce(g_.add(Op::kAdd, {routed, shared}, {}, partial(), label + ".combine"), label);
  }

  const ModelConfig& c_;
  TpShard tp_;
  Graph g_;
};

}  // namespace

Graph build_kimi_linear(const ModelConfig& config, TpShard shard) { return KimiLinearBuilder(config, shard).build(); }

}  // namespace plow
