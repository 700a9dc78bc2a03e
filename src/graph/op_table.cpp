#include "graph/op_table.h"

#include <algorithm>
#include <array>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "graph/graph.h"

namespace plow {

Attrs& Attrs::set(std::string key, double value) {
  for (auto& [k, v] : values_) {
    if (k == key) {
      v = value;
      return *this;
    }
  }
  values_.emplace_back(std::move(key), value);
  return *this;
}

double Attrs::get(std::string_view key) const {
  for (const auto& [k, v] : values_) {
    if (k == key) return v;
  }
  PLOW_CHECK(false, "attribute '{}' missing", key);
}

bool Attrs::has(std::string_view key) const {
  for (const auto& [k, v] : values_) {
    if (k == key) return true;
  }
  return false;
}

namespace {

using Widths = std::span<const int64_t>;
using Weights = std::span<const WeightDecl* const>;

int64_t numel(const WeightDecl* w) {
  int64_t n = 1;
  for (int64_t d : w->shape) n *= d;
  return n;
}

void expect_shape(const Node& node, const WeightDecl* w, std::vector<int64_t> shape) {
  PLOW_CHECK(w->shape == shape, "{}: weight '{}' declared with the wrong shape", node.label, w->name);
}

int64_t tokens_rule(const Node&, Widths, Weights) { return 1; }

int64_t embedding_rule(const Node& node, Widths in, Weights w) {
  PLOW_CHECK(in[0] == 1 && w[0]->shape.size() == 2, "{}: embedding of token ids by a [V,H] table", node.label);
  return w[0]->shape[1];
}

int64_t rms_norm_rule(const Node& node, Widths in, Weights w) {
  expect_shape(node, w[0], {in[0]});
  return in[0];
}

int64_t linear_rule(const Node& node, Widths in, Weights w) {
  PLOW_CHECK(w[0]->shape.size() == 2 && w[0]->shape[1] == in[0], "{}: linear input width {} vs weight '{}'", node.label, in[0], w[0]->name);
  return w[0]->shape[0];
}

int64_t short_conv_rule(const Node& node, Widths in, Weights w) {
  expect_shape(node, w[0], {in[0], 1, node.attrs.i("kernel")});
  return in[0];
}

int64_t kda_gate_rule(const Node& node, Widths in, Weights w) {
  const int64_t heads = node.attrs.i("heads");
  const int64_t width = heads * node.attrs.i("head_dim");
  PLOW_CHECK(in[0] == width && numel(w[0]) == heads && numel(w[1]) == width, "{}: KDA gate shapes", node.label);
  return width;
}

// The composition's rules: the projection's, then the gate's over the projected width.
int64_t linear_kda_gate_rule(const Node& node, Widths in, Weights w) {
  const int64_t projected = linear_rule(node, in, w.first(1));
  return kda_gate_rule(node, Widths(&projected, 1), w.subspan(1));
}

int64_t same_width_rule(const Node& node, Widths in, Weights) {
  for (int64_t width : in) PLOW_CHECK(width == in[0], "{}: input widths differ", node.label);
  return in[0];
}

int64_t delta_rule_rule(const Node& node, Widths in, Weights) {
  const int64_t heads = node.attrs.i("heads");
  const int64_t width = heads * node.attrs.i("head_dim");
  PLOW_CHECK(in[0] == width && in[1] == width && in[2] == width && in[3] == width && in[4] == heads,
             "{}: KDA core expects q,k,v,g of width {} and β of width {}", node.label, width, heads);
  return width;
}

// kda_fused_core: the three convs', the gate projection's and the delta rule's rules on their inputs;
// with a sixth input g, the output gate's projection W_gb [P, G] and the gated norm's weight [d].
int64_t kda_fused_core_rule(const Node& node, Widths in, Weights w) {
  const int64_t heads = node.attrs.i("heads"), d = node.attrs.i("head_dim"), width = heads * d, kernel = node.attrs.i("kernel");
  const bool gated = in.size() == 6;
  PLOW_CHECK((in.size() == 5 && w.size() == 6) || (gated && w.size() == 8), "{}: the fused KDA core takes 5 inputs and 6 weights, or 6 and 8",
             node.label);
  PLOW_CHECK(in[0] == width && in[1] == width && in[2] == width && in[4] == heads,
             "{}: the fused KDA core expects x_q, x_k, x_v of width {} and b of width {}", node.label, width, heads);
  for (int i = 0; i < 3; ++i) expect_shape(node, w[i], {width, 1, kernel});
  expect_shape(node, w[3], {width, in[3]});
  PLOW_CHECK(numel(w[4]) == heads && numel(w[5]) == width, "{}: KDA gate shapes", node.label);
  if (gated) {
    expect_shape(node, w[6], {width, in[5]});
    expect_shape(node, w[7], {d});
    PLOW_CHECK(node.attrs.has("eps"), "{}: the gated norm needs eps", node.label);
  }
  for (const char* conv : {"conv_q", "conv_k", "conv_v"}) PLOW_CHECK(node.attrs.i(conv) >= 0, "{}: {} names no state", node.label, conv);
  return width;
}

int64_t gated_norm_rule(const Node& node, Widths in, Weights w) {
  const int64_t d = node.attrs.i("head_dim");
  PLOW_CHECK(in[0] == in[1] && in[0] == node.attrs.i("heads") * d, "{}: gated norm widths", node.label);
  expect_shape(node, w[0], {d});
  return in[0];
}

int64_t mla_rule(const Node& node, Widths in, Weights w) {
  const int64_t heads = node.attrs.i("heads"), nope = node.attrs.i("nope"), rope = node.attrs.i("rope");
  const int64_t v = node.attrs.i("v"), rank = node.attrs.i("rank");
  PLOW_CHECK(in[0] == heads * (nope + rope) && in[1] == rank + rope, "{}: MLA q/kv_a widths", node.label);
  expect_shape(node, w[0], {rank});
  expect_shape(node, w[1], {heads * (nope + v), rank});
  return heads * v;
}

int64_t attn_res_rule(const Node& node, Widths in, Weights w) {
  for (int64_t width : in) PLOW_CHECK(width == in[0], "{}: AttnRes values differ in width", node.label);
  expect_shape(node, w[0], {in[0]});
  expect_shape(node, w[1], {1, in[0]});
  return in[0];
}

int64_t input_rule(const Node& node, Widths, Weights) { return node.attrs.i("width"); }

int64_t linear_out(const Node& node, int64_t in, const WeightDecl* w) {
  PLOW_CHECK(w->shape.size() == 2 && w->shape[1] == in, "{}: linear input width {} vs weight '{}'", node.label, in, w->name);
  return w->shape[0];
}

int64_t norm_linear_rule(const Node& node, Widths in, Weights w) {
  expect_shape(node, w[0], {in[0]});
  return linear_out(node, in[0], w[1]);
}

int64_t multi_linear_rule(const Node& node, Widths in, Weights w) {
  int64_t total = 0;
  for (const WeightDecl* weight : w) total += linear_out(node, in[0], weight);
  return total;
}

int64_t norm_multi_linear_rule(const Node& node, Widths in, Weights w) {
  expect_shape(node, w[0], {in[0]});
  return multi_linear_rule(node, in, w.subspan(1));
}

int64_t slice_rule(const Node& node, Widths in, Weights) {
  const int64_t offset = node.attrs.i("offset"), width = node.attrs.i("width");
  PLOW_CHECK(offset >= 0 && width > 0 && offset + width <= in[0], "{}: slice [{}, +{}) of width {}", node.label, offset, width, in[0]);
  return width;
}

int64_t linear_add_rule(const Node& node, Widths in, Weights w) {
  const int64_t out = linear_out(node, in[0], w[0]);
  PLOW_CHECK(in[1] == out, "{}: residual width {} vs linear output {}", node.label, in[1], out);
  return out;
}

int64_t gate_up_rule(const Node& node, Widths in, Weights w) {
  const int64_t out = linear_out(node, in[0], w[0]);
  PLOW_CHECK(linear_out(node, in[0], w[1]) == out, "{}: gate/up widths differ", node.label);
  return out;
}

int64_t act_linear_rule(const Node& node, Widths in, Weights w) {
  PLOW_CHECK(in[0] == in[1], "{}: activation input widths differ", node.label);
  return linear_out(node, in[0], w[0]);
}

int64_t moe_down_rule(const Node& node, Widths in, Weights w);

int64_t moe_down_add_rule(const Node& node, Widths in, Weights w) {
  const int64_t out = moe_down_rule(node, in.subspan(0, 2), w);
  PLOW_CHECK(in[2] == out, "{}: shared width {} vs experts output {}", node.label, in[2], out);
  return out;
}

int64_t gated_norm_linear_rule(const Node& node, Widths in, Weights w) {
  gated_norm_rule(node, in, w.subspan(0, 1));
  return linear_out(node, in[0], w[1]);
}

int64_t add_norm_rule(const Node& node, Widths in, Weights w) {
  PLOW_CHECK(in[0] == in[1], "{}: add widths differ", node.label);
  expect_shape(node, w[0], {in[0]});
  return 2 * in[0];
}

int64_t add_norm_multi_linear_rule(const Node& node, Widths in, Weights w) {
  PLOW_CHECK(in[0] == in[1], "{}: add widths differ", node.label);
  return norm_multi_linear_rule(node, in.first(1), w);
}

int64_t attn_res_norm_rule(const Node& node, Widths in, Weights w) {
  const int64_t width = attn_res_rule(node, in, w.subspan(0, 2));
  expect_shape(node, w[2], {width});
  return width;
}

int64_t moe_topk_rule(const Node& node, Widths in, Weights w) {
  const int64_t experts = node.attrs.i("experts");
  PLOW_CHECK(in[0] == experts, "{}: {} logits for {} experts", node.label, in[0], experts);
  expect_shape(node, w[0], {experts});
  return 2 * node.attrs.i("top_k");
}

// The expert ops read routes [T, 2k] and a stack of `experts` parts per weight.
void expect_routed(const Node& node, int64_t routes_width, Weights w) {
  PLOW_CHECK(node.attrs.i("top_k") >= 1, "{}: top_k {}", node.label, node.attrs.i("top_k"));
  PLOW_CHECK(routes_width == 2 * node.attrs.i("top_k"), "{}: routes width {} for top_k {}", node.label, routes_width, node.attrs.i("top_k"));
  for (const WeightDecl* stack : w) {
    PLOW_CHECK(stack->shape.size() == 2 && static_cast<int64_t>(stack->parts.size()) == node.attrs.i("experts"),
               "{}: expert stack '{}' of {} parts for {} experts", node.label, stack->name, stack->parts.size(), node.attrs.i("experts"));
  }
}

int64_t moe_gate_up_rule(const Node& node, Widths in, Weights w) {
  expect_routed(node, in[1], w);
  const int64_t inter = w[0]->shape[0];
  expect_shape(node, w[0], {inter, in[0]});
  expect_shape(node, w[1], {inter, in[0]});
  PLOW_CHECK(inter <= std::numeric_limits<int64_t>::max() / node.attrs.i("top_k"), "{}: top_k × {} overflows", node.label, inter);
  return node.attrs.i("top_k") * inter;
}

int64_t moe_down_rule(const Node& node, Widths in, Weights w) {
  expect_routed(node, in[1], w);
  const int64_t top_k = node.attrs.i("top_k"), inter = w[0]->shape[1];  // w2 [W, I]
  PLOW_CHECK(inter <= std::numeric_limits<int64_t>::max() / top_k && in[0] == top_k * inter,
             "{}: input width {} is not top_k × the expert width ({} × {})", node.label, in[0], top_k, inter);
  return w[0]->shape[0];
}

constexpr std::array<OpInfo, static_cast<size_t>(Op::kCount)> kOps = {{
    {Op::kTokens, "tokens", 0, 0, OutDType::kF32, false, tokens_rule, Slicing::kWhole, ""},
    {Op::kEmbedding, "embedding", 1, 1, OutDType::kAct, false, embedding_rule, Slicing::kColumns, ""},
    {Op::kRmsNorm, "rms_norm", 1, 1, OutDType::kAct, false, rms_norm_rule, Slicing::kColumns, ""},
    {Op::kLinear, "linear", 1, 1, OutDType::kAct, false, linear_rule, Slicing::kColumns, ""},
    {Op::kShortConvSilu, "short_conv_silu", 1, 1, OutDType::kAct, true, short_conv_rule, Slicing::kColumns, ""},
    {Op::kKdaGate, "kda_gate", 1, 2, OutDType::kF32, false, kda_gate_rule, Slicing::kColumns, ""},
    {Op::kSigmoid, "sigmoid", 1, 0, OutDType::kF32, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kKdaDeltaRule, "kda_delta_rule", 5, 0, OutDType::kAct, true, delta_rule_rule, Slicing::kHeadColumns, "head_dim"},
    {Op::kGatedRmsNorm, "gated_rms_norm", 2, 1, OutDType::kAct, false, gated_norm_rule, Slicing::kHeads, "head_dim"},
    {Op::kMlaAttention, "mla_attention", 2, 2, OutDType::kAct, true, mla_rule, Slicing::kHeads, "v"},
    {Op::kSiluMul, "silu_mul", 2, 0, OutDType::kAct, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kAdd, "add", 2, 0, OutDType::kAct, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kRouterLogits, "router_logits", 1, 1, OutDType::kF32, false, linear_rule, Slicing::kColumns, ""},
    {Op::kMoeTopK, "moe_topk", 1, 1, OutDType::kF32, false, moe_topk_rule, Slicing::kWhole, ""},
    {Op::kMoeGateUp, "moe_gate_up", 2, 2, OutDType::kAct, false, moe_gate_up_rule, Slicing::kColumns, ""},
    {Op::kMoeDown, "moe_down", 2, 1, OutDType::kAct, false, moe_down_rule, Slicing::kColumns, ""},
    {Op::kSituMul, "situ_mul", 2, 0, OutDType::kAct, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kSigmoidMul, "sigmoid_mul", 2, 0, OutDType::kAct, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kAttnResMix, "attn_res_mix", -1, 2, OutDType::kAct, false, attn_res_rule, Slicing::kColumns, ""},
    {Op::kInput, "input", 0, 0, OutDType::kAct, false, input_rule, Slicing::kWhole, ""},
    {Op::kNormLinear, "norm_linear", 1, 2, OutDType::kAct, false, norm_linear_rule, Slicing::kColumns, ""},
    {Op::kMultiLinear, "multi_linear", 1, -1, OutDType::kAct, false, multi_linear_rule, Slicing::kColumns, ""},
    {Op::kNormMultiLinear, "norm_multi_linear", 1, -1, OutDType::kAct, false, norm_multi_linear_rule, Slicing::kColumns, ""},
    {Op::kSlice, "slice", 1, 0, OutDType::kAct, false, slice_rule, Slicing::kColumns, ""},
    {Op::kLinearAdd, "linear_add", 2, 1, OutDType::kAct, false, linear_add_rule, Slicing::kColumns, ""},
    {Op::kGateUpAct, "gate_up_act", 1, 2, OutDType::kAct, false, gate_up_rule, Slicing::kColumns, ""},
    {Op::kActLinear, "act_linear", 2, 1, OutDType::kAct, false, act_linear_rule, Slicing::kColumns, ""},
    {Op::kMoeDownAdd, "moe_down_add", 3, 1, OutDType::kAct, false, moe_down_add_rule, Slicing::kColumns, ""},
    {Op::kGatedNormLinear, "gated_norm_linear", 2, 2, OutDType::kAct, false, gated_norm_linear_rule, Slicing::kColumns, ""},
    {Op::kAddNorm, "add_norm", 2, 1, OutDType::kAct, false, add_norm_rule, Slicing::kColumns, ""},
    {Op::kAttnResNorm, "attn_res_norm", -1, 3, OutDType::kAct, false, attn_res_norm_rule, Slicing::kColumns, ""},
    {Op::kAllReduce, "all_reduce", 1, 0, OutDType::kAct, false, same_width_rule, Slicing::kWhole, ""},
    {Op::kLinearKdaGate, "linear_kda_gate", 1, 3, OutDType::kF32, false, linear_kda_gate_rule, Slicing::kColumns, ""},
    {Op::kAddNormMultiLinear, "add_norm_multi_linear", 2, -1, OutDType::kAct, false, add_norm_multi_linear_rule, Slicing::kColumns, ""},
    {Op::kAddNormRouterLogits, "add_norm_router_logits", 2, 2, OutDType::kF32, false, add_norm_multi_linear_rule, Slicing::kColumns, ""},
    {Op::kKdaFusedCore, "kda_fused_core", -1, -1, OutDType::kAct, true, kda_fused_core_rule, Slicing::kHeads, "head_dim"},
}};

constexpr bool table_in_enum_order() {
  for (size_t i = 0; i < kOps.size(); ++i) {
    if (static_cast<size_t>(kOps[i].op) != i) return false;
  }
  return true;
}
static_assert(table_in_enum_order(), "op table rows must follow the Op enum order");

}  // namespace

const OpInfo& op_info(Op op) {
  PLOW_CHECK(op < Op::kCount, "unknown op {}", static_cast<int>(op));
  return kOps[static_cast<size_t>(op)];
}

std::string_view op_name(Op op) { return op_info(op).name; }

OutDType out_dtype_of(Op op, const Attrs& attrs) {
  return attrs.has("partial") && attrs.get("partial") != 0 ? OutDType::kF32 : op_info(op).out_dtype;
}

bool reads_routed_experts(Op op) { return op == Op::kMoeGateUp || op == Op::kMoeDown || op == Op::kMoeDownAdd; }

bool spreads_over_workers(Op op) { return op == Op::kMlaAttention; }

int64_t spread_tasks(const Node& node, int64_t workers, int64_t max_tokens) {
  const auto by_rows = [&](int64_t rows_per_task) { return std::min(workers, (max_tokens + rows_per_task - 1) / rows_per_task); };
  if (spreads_over_workers(node.op)) return workers;
  if (node.op == Op::kMoeTopK) return by_rows(kMoeTopkRowsPerTask);
  if (node.op == Op::kGatedRmsNorm) return by_rows(kGatedRmsNormRowsPerTask);
  if (node.op == Op::kKdaFusedCore) {
    const int64_t pairs = node.width / node.attrs.i("head_dim") * max_tokens;
    for (int64_t parts = kKdaSplitParts; parts > 1; parts /= 2) {
      if (pairs * parts <= workers) return pairs * parts;
    }
    return std::min(workers, pairs);
  }
  return 0;
}

int64_t slice_granularity(const Node& node) {
  const OpInfo& info = op_info(node.op);
  switch (info.slicing) {
    case Slicing::kColumns: return 1;
    case Slicing::kHeads: return node.attrs.i(info.head_attr);
    case Slicing::kHeadColumns: return std::gcd(node.attrs.i(info.head_attr), kHeadColumnGroup);
    case Slicing::kWhole: return node.width;
  }
  PLOW_CHECK(false, "unknown slicing of {}", info.name);
}

}  // namespace plow
