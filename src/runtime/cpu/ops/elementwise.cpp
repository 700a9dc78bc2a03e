// Elementwise ops: a + b, SiLU(a) ⊙ b (SiLU rounded first, as HF's bf16 path does), σ(x) in fp32,
// SiTU(a, b) with one rounding, and the sigmoid output gate a ⊙ σ(g).
#include "runtime/cpu/op_context.h"

namespace plow {

namespace {
// Calls fn(flat index) for every element of the call's column slice; inputs share the output's width.
template <typename Fn>
void for_each_element(const OpContext& ctx, Fn fn) {
  for (int64_t t = 0; t < ctx.rows; ++t) {
    for (int64_t c = ctx.begin(); c < ctx.end(); ++c) fn(t * ctx.node.width + c);
  }
}
}  // namespace

void cpu_add(OpContext& ctx) {
  for_each_element(ctx, [&](int64_t i) { ctx.out[i] = ctx.round_out(ctx.inputs[0].data[i] + ctx.inputs[1].data[i]); });
}

void cpu_silu_mul(OpContext& ctx) {
  for_each_element(ctx, [&](int64_t i) { ctx.out[i] = ctx.round_out(ctx.round_act(silu(ctx.inputs[0].data[i])) * ctx.inputs[1].data[i]); });
}

void cpu_sigmoid(OpContext& ctx) {
  for_each_element(ctx, [&](int64_t i) { ctx.out[i] = ctx.round_out(sigmoid(ctx.inputs[0].data[i])); });
}

void cpu_situ_mul(OpContext& ctx) {
  const float beta = ctx.node.attrs.f("beta"), linear_beta = ctx.node.attrs.f("linear_beta");
  for_each_element(ctx, [&](int64_t i) { ctx.out[i] = ctx.round_out(situ(ctx.inputs[0].data[i], ctx.inputs[1].data[i], beta, linear_beta)); });
}

void cpu_sigmoid_mul(OpContext& ctx) {
  for_each_element(ctx, [&](int64_t i) { ctx.out[i] = ctx.round_out(ctx.inputs[0].data[i] * sigmoid(ctx.inputs[1].data[i])); });
}

}  // namespace plow
