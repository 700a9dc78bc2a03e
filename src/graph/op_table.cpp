#include "graph/op_table.h"

#include <array>

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

int64_t router_rule(const Node& node, Widths in, Weights w) {
  const int64_t experts = node.attrs.i("experts");
  expect_shape(node, w[0], {experts, in[0]});
  expect_shape(node, w[1], {experts});
  return 2 * node.attrs.i("top_k");
}

int64_t experts_rule(const Node& node, Widths in, Weights w) {
  const int64_t hidden = in[0];
  PLOW_CHECK(in[1] == 2 * node.attrs.i("top_k"), "{}: routes width", node.label);
  const int64_t inter = w[0]->shape.at(0);
  expect_shape(node, w[0], {inter, hidden});
  expect_shape(node, w[1], {inter, hidden});
  expect_shape(node, w[2], {hidden, inter});
  PLOW_CHECK(static_cast<int64_t>(w[0]->parts.size()) == node.attrs.i("experts"), "{}: expert stack size", node.label);
  return hidden;
}

constexpr std::array<OpInfo, static_cast<size_t>(Op::kCount)> kOps = {{
    {Op::kTokens, "tokens", 0, 0, OutDType::kF32, false, tokens_rule, Slicing::kWhole, ""},
    {Op::kEmbedding, "embedding", 1, 1, OutDType::kAct, false, embedding_rule, Slicing::kColumns, ""},
    {Op::kRmsNorm, "rms_norm", 1, 1, OutDType::kAct, false, rms_norm_rule, Slicing::kColumns, ""},
    {Op::kLinear, "linear", 1, 1, OutDType::kAct, false, linear_rule, Slicing::kColumns, ""},
    {Op::kShortConvSilu, "short_conv_silu", 1, 1, OutDType::kAct, true, short_conv_rule, Slicing::kColumns, ""},
    {Op::kKdaGate, "kda_gate", 1, 2, OutDType::kF32, false, kda_gate_rule, Slicing::kColumns, ""},
    {Op::kSigmoid, "sigmoid", 1, 0, OutDType::kF32, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kKdaDeltaRule, "kda_delta_rule", 5, 0, OutDType::kAct, true, delta_rule_rule, Slicing::kHeads, "head_dim"},
    {Op::kGatedRmsNorm, "gated_rms_norm", 2, 1, OutDType::kAct, false, gated_norm_rule, Slicing::kHeads, "head_dim"},
    {Op::kMlaAttention, "mla_attention", 2, 2, OutDType::kAct, true, mla_rule, Slicing::kHeads, "v"},
    {Op::kSiluMul, "silu_mul", 2, 0, OutDType::kAct, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kAdd, "add", 2, 0, OutDType::kAct, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kMoeRouter, "moe_router", 1, 2, OutDType::kF32, false, router_rule, Slicing::kWhole, ""},
    {Op::kMoeExperts, "moe_experts", 2, 3, OutDType::kAct, false, experts_rule, Slicing::kColumns, ""},
    {Op::kSituMul, "situ_mul", 2, 0, OutDType::kAct, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kSigmoidMul, "sigmoid_mul", 2, 0, OutDType::kAct, false, same_width_rule, Slicing::kColumns, ""},
    {Op::kAttnResMix, "attn_res_mix", -1, 2, OutDType::kAct, false, attn_res_rule, Slicing::kColumns, ""},
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

int64_t slice_granularity(const Node& node) {
  const OpInfo& info = op_info(node.op);
  switch (info.slicing) {
    case Slicing::kColumns: return 1;
    case Slicing::kHeads: return node.attrs.i(info.head_attr);
    case Slicing::kWhole: return node.width;
  }
  PLOW_CHECK(false, "unknown slicing of {}", info.name);
}

}  // namespace plow
