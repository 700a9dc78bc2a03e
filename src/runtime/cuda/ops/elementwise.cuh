// Elementwise op bodies (cpu: ops/elementwise.cpp): one thread per element of the task's share (its
// column slice [col_begin, col_end) × all rows, or whole rows in steps of many rows: element_share);
// inputs share the output's width (each with its own row stride). fp32 math, one rounding per output
// (SiLU·mul also rounds SiLU first, as the CPU does).
#pragma once

#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda {

// Two inputs' four elements (for_each_share_element4's operands).
struct Operands4 {
  float4 a, b;
};

// out = round(f(a, b)) over the task's share; a unary f ignores b (input 0 is read twice then, from L1).
// Inputs are rounded as they load where OpDesc::round_in says so (a prefill GEMM's unrounded output).
template <typename F>
__device__ __forceinline__ void map_elements(const TaskCtx& ctx, F f) {
  const int ib = ctx.op->num_inputs > 1 ? 1 : 0;
  const Rows<const float> a = ctx.in_rows(0), b = ctx.in_rows(ib);
  const Rows<float> out = ctx.out_rows();
  const int32_t act = ctx.out_act(), a_act = ctx.in_act(0), b_act = ctx.in_act(ib);
  const auto one = [&](float x, float y) { return round_act(act, f(round_act(a_act, x), round_act(b_act, y))); };
  const Rows<const float> rows[3] = {{out.base, out.stride}, a, b};
  for_each_share_element4(
      ctx, rows, [&](int t, int64_t c) { return Operands4{load4f(a[t] + c), load4f(b[t] + c)}; },
      [&](int t, int64_t c, Operands4 v) { store4f(out[t] + c, float4{one(v.a.x, v.b.x), one(v.a.y, v.b.y), one(v.a.z, v.b.z), one(v.a.w, v.b.w)}); },
      [&](int t, int64_t c) { return Operands{a[t][c], b[t][c]}; }, [&](int t, int64_t c, Operands v) { out[t][c] = one(v.a, v.b); });
}

// Rounds the task's share of the output in place: fp32 values the host wrote there (an NCCL sum, a
// prefill GEMM's output). Nothing to do when the output stays fp32.
__device__ __forceinline__ void round_in_place(const TaskCtx& ctx) {
  const int32_t act = ctx.out_act();
  if (act == kAF32) return;
  const Rows<float> out = ctx.out_rows();
  const Rows<const float> rows[1] = {{out.base, out.stride}};
  for_each_share_element4(
      ctx, rows, [&](int t, int64_t c) { return load4f(out[t] + c); },
      [&](int t, int64_t c, float4 v) { store4f(out[t] + c, float4{round_act(act, v.x), round_act(act, v.y), round_act(act, v.z), round_act(act, v.w)}); },
      [&](int t, int64_t c) { return out[t][c]; }, [&](int t, int64_t c, float v) { out[t][c] = round_act(act, v); });
}

// kAdd: a + b. attrs: none.
__device__ __noinline__ void op_add(const TaskCtx& ctx) {
  map_elements(ctx, [](float a, float b) { return a + b; });
}

// kAllReduce: NCCL has written the ranks' fp32 sum into the output buffer before this task runs (the
// host calls it between megakernel segments); the task rounds it in place. attrs: none.
__device__ __noinline__ void op_all_reduce_round(const TaskCtx& ctx) { round_in_place(ctx); }

// kSiluMul: act(SiLU(a)) · b. attrs: none.
__device__ __noinline__ void op_silu_mul(const TaskCtx& ctx) {
  const int32_t act = ctx.op->act;
  map_elements(ctx, [act](float a, float b) { return round_act(act, siluf_(a)) * b; });
}

// kSigmoid: σ(x), fp32 output. attrs: none.
__device__ __noinline__ void op_sigmoid(const TaskCtx& ctx) {
  map_elements(ctx, [](float a, float) { return sigmoidf_(a); });
}

// kSituMul: SiTU(a, b), one rounding. attrs: [0] beta, [1] linear_beta (≤ 0: the up branch is b).
__device__ __noinline__ void op_situ_mul(const TaskCtx& ctx) {
  const float beta = ctx.attr(0), linear_beta = ctx.attr(1);
  map_elements(ctx, [beta, linear_beta](float a, float b) { return situf_(a, b, beta, linear_beta); });
}

// kSigmoidMul: a · σ(g) (the K3 MLA output gate). attrs: none.
__device__ __noinline__ void op_sigmoid_mul(const TaskCtx& ctx) {
  map_elements(ctx, [](float a, float g) { return a * sigmoidf_(g); });
}

}  // namespace plow::cuda
