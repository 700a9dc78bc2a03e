// The op table: every op plow knows is one row here (name, arity, weight count, shape rule).
// Backends implement ops by this enum; a backend that lacks one reports it at load, never at run.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace plow {

enum class Op : uint8_t {
  kTokens,        // the step's token ids [T] (graph input)
  kEmbedding,     // [T,H] = W[ids]                                   weights: table [V,H]
  kRmsNorm,       // [T,F] RMSNorm over F, weight applied after the cast back        weights: w [F]
  kLinear,        // [T,out] = x·Wᵀ, fp32 accumulate                  weights: W [out,in]
  kShortConvSilu, // [T,P] depthwise causal conv over the sequence + SiLU (stateful)  weights: C [P,1,K]
  kKdaGate,       // [T,P] fp32 g = −exp(A_log[h])·softplus(f + dt_bias), or with attr lower_bound (K3)
                  //       lb·σ(exp(A_log[h])·(f + dt_bias))      weights: A_log (n_k), dt_bias (P)
  kSigmoid,       // [T,F] fp32 σ(x)
  kKdaDeltaRule,  // [T,P] KDA core: l2norm(q)/√d, l2norm(k), gated delta rule over the state (stateful)
  kGatedRmsNorm,  // [T,P] per-head RMSNorm(o)·w ⊙ σ(z)               weights: w [d]
  kMlaAttention,  // [T,n_h·d_v] NoPE MLA over the latent cache (stateful)  weights: kv_a norm [r], kv_b [n_h(d_n+d_v), r]
  kSiluMul,       // [T,F] SiLU(a) ⊙ b
  kAdd,           // [T,F] a + b
  kRouterLogits,  // [T,E] fp32 router logits x·Wᵀ, fp32 accumulate, never rounded   weights: W [E,H]
  kMoeTopK,       // [T,2k] fp32 from the logits [T,E]: k routing weights, then k expert ids   weights: bias [E]
  kMoeGateUp,     // [T,k·I] column k·I+i = act(w1_e[i]·x, w3_e[i]·x) of the k-th routed expert e; act = SiLU·mul
                  //       or SiTU (attr situ), both dots rounded      inputs: x [T,W], routes   weights: w1, w3 stacks [I,W]
  kMoeDown,       // [T,W] Σ_k w_k·(w2_e·h[kI, (k+1)I)), each dot rounded, fp32 sum in k order; W = H or the latent
                  //       width                                       inputs: h = moe_gate_up, routes   weights: w2 stack [W,I]
  kSituMul,       // [T,F] SiTU(a, b) = β·tanh(a/β)·σ(a)·β_lin·tanh(b/β_lin), one rounding (K3)
  kSigmoidMul,    // [T,F] a ⊙ σ(g): the K3 MLA output gate
  kAttnResMix,    // [T,H] Block AttnRes: softmax over depth of the inputs (variadic)  weights: norm [H], proj [1,H]
  kInput,         // [T,width] an activation supplied by the caller (rule certificates; not in model graphs)
  // Fused ops, produced by the compiler's rewrite rules (src/compiler/rules). Each computes exactly
  // the composition it replaces, intermediate roundings included, so certificates demand equality.
  kNormLinear,       // linear(rms_norm(x; w); W)                          weights: w, W
  kMultiLinear,      // [T, Σ out_i] concat_i linear(x; W_i) (variadic weights)
  kNormMultiLinear,  // multi_linear(rms_norm(x; w); W_1..W_n)             weights: w, W_1..W_n
  kSlice,            // [T,width] columns [offset, offset+width) of the input
  kLinearAdd,        // r + linear(y; W)  (residual add in the epilogue)   inputs: y, r
  kGateUpAct,        // act(linear(x; W_gate), linear(x; W_up)), act = SiLU·mul or SiTU
  kActLinear,        // linear(act(a, b); W), act = SiLU·mul, SiTU or a·σ(b) (MLA output gate)
  kMoeDownAdd,       // moe_down(h, routes) + shared                       inputs: h, routes, shared   weights: w2 stack
  kGatedNormLinear,  // linear(gated_rms_norm(o, z; w); W)                 weights: w, W
  kAddNorm,          // [T,2F] concat(a + b, rms_norm(a + b; w))
  kAttnResNorm,      // rms_norm(attn_res_mix(values; w_n, w_q); w)        weights: w_n, w_q, w
  // Tensor parallelism (DESIGN.md §5), in graphs built for a rank of a group of more than one.
  kAllReduce,        // [T,F] the sum over the group's ranks of x (fp32, rank order), rounded once. Its input is a
                     //       partial sum: a linear, moe_down or add with attr partial = 1, whose output stays fp32
                     //       (moe_down then also leaves each expert's dot unrounded)
  // Fused, after kAllReduce so that the op codes above keep their values.
  kLinearKdaGate,    // [T,P] fp32 kda_gate(linear(f; W)): the KDA gate in the f_b projection's epilogue
                     //       weights: W [P, in], A_log (n_k), dt_bias (P)
  // A norm of a residual sum read by its consumer directly: the consumer no longer waits for the
  // add_norm (a light op of a few tasks) that it would otherwise read, one dependency hop a layer.
  kAddNormMultiLinear,  // multi_linear(rms_norm(a + b; w); W_1..W_n), a + b rounded as kAdd   weights: w, W_1..W_n
  kAddNormRouterLogits, // [T,E] fp32 router_logits(rms_norm(a + b; w); W)                     weights: w, W [E,H]
  // The KDA mixer's core in one op (decode plans): kda_delta_rule(conv_q(x_q), conv_k(x_k), conv_v(x_v),
  // kda_gate(linear(f; W_fb)), σ(b)), and with a sixth input g its output norm too:
  // gated_rms_norm(core, linear(g; W_gb); w) (attr eps). Stateful over four states: `state` the
  // recurrent one, attrs conv_q / conv_k / conv_v the three conv windows (state ids). Sliced by heads: a
  // task owns every channel of its heads, so the windows of its q/k channels are its own to rewrite.
  kKdaFusedCore,     // [T,P] inputs x_q, x_k, x_v [T,P], f [T,F], b [T,heads][, g [T,G]]
                     //       weights: C_q, C_k, C_v [P,1,K], W_fb [P,F], A_log, dt_bias[, W_gb [P,G], w [d]]
  kCount,
};

// Attributes of a node: a short list of named numbers (sizes, epsilons, flags, state slots).
class Attrs {
 public:
  Attrs() = default;
  Attrs(std::initializer_list<std::pair<std::string, double>> values) : values_(values) {}
  Attrs& set(std::string key, double value);
  double get(std::string_view key) const;    // missing key: InternalError
  int64_t i(std::string_view key) const { return static_cast<int64_t>(get(key)); }
  float f(std::string_view key) const { return static_cast<float>(get(key)); }
  bool has(std::string_view key) const;
  const std::vector<std::pair<std::string, double>>& values() const { return values_; }

 private:
  std::vector<std::pair<std::string, double>> values_;
};

struct Node;
struct WeightDecl;

// Infers the output width from the input widths, the weights' declared shapes and the attributes;
// throws InternalError when the builder wired something inconsistent.
using ShapeRule = int64_t (*)(const Node& node, std::span<const int64_t> input_widths,
                              std::span<const WeightDecl* const> weights);

enum class OutDType : uint8_t { kAct, kF32 };  // kAct: the model's activation dtype (bf16, f16 or f32)

// How a plan splits an op over workers: by output columns, by whole heads (the columns of one head
// stay together; `head_attr` names the attribute holding a head's output width), by groups of a head's
// columns (kHeadColumns: gcd(head width, kHeadColumnGroup) columns, for ops whose output columns are
// independent within a head, as KDA's value columns), or not at all.
enum class Slicing : uint8_t { kColumns, kHeads, kHeadColumns, kWhole };
inline constexpr int64_t kHeadColumnGroup = 32;

struct OpInfo {
  Op op;
  std::string_view name;
  int num_inputs;  // −1: variadic (at least one)
  int num_weights; // −1: variadic (at least one)
  OutDType out_dtype;
  bool stateful;
  ShapeRule shape_rule;
  Slicing slicing;
  std::string_view head_attr;
};

const OpInfo& op_info(Op op);
// A node's output dtype: the op table's, except fp32 for a tensor-parallel partial sum (attr partial).
OutDType out_dtype_of(Op op, const Attrs& attrs);
// Ops whose weights are expert stacks of which a token reads only the top_k experts its router
// (input 1) chose: weight traffic counts top_k parts, not all of them.
bool reads_routed_experts(Op op);
// Output columns per indivisible unit of work: 1 for column-sliced ops, a head's width for per-head
// ops, gcd(head width, 32) for head-column ops, the whole width for ops that run as one task.
int64_t slice_granularity(const Node& node);
// Whether the op's tasks cooperate across blocks (one task per worker, a shared workspace): MLA, whose
// GPU body splits the latent cache over all of its tasks (split-KV).
bool spreads_over_workers(Op op);
// Rows per moe_topk task: its GPU body runs one warp per row, 16 warps a block.
inline constexpr int64_t kMoeTopkRowsPerTask = 16;
// Rows per gated_rms_norm task: its GPU body runs one warp per (row, head), so 8 rows of ≥ 2 heads
// still give each of a block's 16 warps a unit, and a 1024-row step of the 48B (32 heads) spreads over
// 128 of the H200's 132 workers (16 rows a task would leave half of them idle).
inline constexpr int64_t kGatedRmsNormRowsPerTask = 8;
// The tasks a plan of `workers` workers and `max_tokens` rows gives the op beyond its column slices, or 0:
// those tasks own the empty slice [width, width) and divide the op's work otherwise on the GPU. MLA:
// one per worker (spreads_over_workers); moe_topk (whole): one per kMoeTopkRowsPerTask rows, up to the
// workers, each taking a share of the step's rows (1 for plans of ≤ 16 rows: decode keeps one task);
// gated_rms_norm: one per kGatedRmsNormRowsPerTask rows, up to the workers (tasks past its heads only
// when that is more than the heads), each taking whole rows in steps of many rows; kda_fused_core:
// kKdaSplitParts per (head, row) where the workers hold that many, else 2, else one up to the workers,
// each taking a share of the step's (sequence, head) pairs, or on the GPU a part of a one-token pair's
// value columns where it has 2 or 4 tasks a pair (ops/kda_fused.cuh; the CPU runs the op's head
// slices, and the tasks past them own the empty slice). Parts that would leave a worker idle but not
// split every pair are not taken: a batch-4 step of the 48B (128 pairs) keeps 128 tasks of 132.
inline constexpr int64_t kKdaSplitParts = 4;
struct Node;
int64_t spread_tasks(const Node& node, int64_t workers, int64_t max_tokens);
std::string_view op_name(Op op);

}  // namespace plow
