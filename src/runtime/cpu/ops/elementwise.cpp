// Elementwise ops: a + b, SiLU(a) ⊙ b (SiLU rounded first, as HF's bf16 path does), σ(x) in fp32,
// SiTU(a, b) with one rounding, and the sigmoid output gate a ⊙ σ(g).
#include "runtime/cpu/op_context.h"

namespace plow {

namespace {
// Sets out[t][c] = fn(a[t][c], b[t][c]) for every element of the call's column slice; inputs share the
// output's width (each with its own row stride). Unary ops pass a twice.
template <typename Fn>
void for_each_element(const OpContext& ctx, size_t b, Fn fn) {
  for (int64_t t = 0; t < ctx.rows; ++t) {
    const float* x = ctx.in(0, t);
    const float* y = ctx.in(b, t);
    float* out = ctx.out_row(t);
    for (int64_t c = ctx.begin(); c < ctx.end(); ++c) out[c] = ctx.round_out(fn(x[c], y[c]));
  }
}
}  // namespace

void cpu_add(OpContext& ctx) {
  for_each_element(ctx, 1, [](float a, float b) { return a + b; });
}

void cpu_silu_mul(OpContext& ctx) {
  for_each_element(ctx, 1, [&](float a, float b) { return ctx.round_act(silu(a)) * b; });
}

void cpu_sigmoid(OpContext& ctx) {
  for_each_element(ctx, 0, [](float a, float) { return sigmoid(a); });
}

void cpu_situ_mul(OpContext& ctx) {
  const float beta = ctx.node.attrs.f("beta"), linear_beta = ctx.node.attrs.f("linear_beta");
  for_each_element(ctx, 1, [&](float a, float b) { return situ(a, b, beta, linear_beta); });
}

void cpu_sigmoid_mul(OpContext& ctx) {
  for_each_element(ctx, 1, [](float a, float b) { return a * sigmoid(b); });
}

}  // namespace plow
