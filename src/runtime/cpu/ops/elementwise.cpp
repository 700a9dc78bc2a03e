// Elementwise ops: a + b, SiLU(a) ⊙ b (SiLU rounded first, as HF's bf16 path does), σ(x) in fp32,
// SiTU(a, b) with one rounding, and the sigmoid output gate a ⊙ σ(g).
#include "runtime/cpu/op_context.h"

namespace plow {

void cpu_add(OpContext& ctx) {
  const int64_t n = ctx.rows * ctx.node.width;
  for (int64_t i = 0; i < n; ++i) ctx.out[i] = ctx.round_out(ctx.inputs[0].data[i] + ctx.inputs[1].data[i]);
}

void cpu_silu_mul(OpContext& ctx) {
  const int64_t n = ctx.rows * ctx.node.width;
  for (int64_t i = 0; i < n; ++i) ctx.out[i] = ctx.round_out(ctx.round_act(silu(ctx.inputs[0].data[i])) * ctx.inputs[1].data[i]);
}

void cpu_sigmoid(OpContext& ctx) {
  const int64_t n = ctx.rows * ctx.node.width;
  for (int64_t i = 0; i < n; ++i) ctx.out[i] = ctx.round_out(sigmoid(ctx.inputs[0].data[i]));
}

void cpu_situ_mul(OpContext& ctx) {
  const float beta = ctx.node.attrs.f("beta"), linear_beta = ctx.node.attrs.f("linear_beta");
  const int64_t n = ctx.rows * ctx.node.width;
  for (int64_t i = 0; i < n; ++i) ctx.out[i] = ctx.round_out(situ(ctx.inputs[0].data[i], ctx.inputs[1].data[i], beta, linear_beta));
}

void cpu_sigmoid_mul(OpContext& ctx) {
  const int64_t n = ctx.rows * ctx.node.width;
  for (int64_t i = 0; i < n; ++i) ctx.out[i] = ctx.round_out(ctx.inputs[0].data[i] * sigmoid(ctx.inputs[1].data[i]));
}

}  // namespace plow
