// Elementwise ops: a + b, SiLU(a) ⊙ b (SiLU rounded first, as HF's bf16 path does), σ(x) in fp32.
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

}  // namespace plow
