// Elementwise op bodies (cpu: ops/elementwise.cpp): one thread per element of the task's slice
// [col_begin, col_end) × all rows; inputs share the output's width (each with its own row stride).
// fp32 math, one rounding per output (SiLU·mul also rounds SiLU first, as the CPU does).
#pragma once

#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda {

// kAdd: a + b. attrs: none.
__device__ __noinline__ void op_add(const TaskCtx& ctx) {
  for_each_slice_element(ctx, [&](int64_t t, int64_t c) { ctx.out(t)[c] = round_out(ctx, ctx.in(0, t)[c] + ctx.in(1, t)[c]); });
}

// kAllReduce: NCCL has written the ranks' fp32 sum into the output buffer before this task runs (the
// host calls it between megakernel segments); the task rounds it in place. attrs: none.
__device__ __noinline__ void op_all_reduce_round(const TaskCtx& ctx) {
  for_each_slice_element(ctx, [&](int64_t t, int64_t c) { ctx.out(t)[c] = round_out(ctx, ctx.out(t)[c]); });
}

// kSiluMul: act(SiLU(a)) · b. attrs: none.
__device__ __noinline__ void op_silu_mul(const TaskCtx& ctx) {
  const int32_t act = ctx.op->act;
  for_each_slice_element(ctx, [&](int64_t t, int64_t c) {
    ctx.out(t)[c] = round_out(ctx, round_act(act, siluf_(ctx.in(0, t)[c])) * ctx.in(1, t)[c]);
  });
}

// kSigmoid: σ(x), fp32 output. attrs: none.
__device__ __noinline__ void op_sigmoid(const TaskCtx& ctx) {
  for_each_slice_element(ctx, [&](int64_t t, int64_t c) { ctx.out(t)[c] = round_out(ctx, sigmoidf_(ctx.in(0, t)[c])); });
}

// kSituMul: SiTU(a, b), one rounding. attrs: [0] beta, [1] linear_beta (≤ 0: the up branch is b).
__device__ __noinline__ void op_situ_mul(const TaskCtx& ctx) {
  const float beta = ctx.attr(0), linear_beta = ctx.attr(1);
  for_each_slice_element(ctx, [&](int64_t t, int64_t c) {
    ctx.out(t)[c] = round_out(ctx, situf_(ctx.in(0, t)[c], ctx.in(1, t)[c], beta, linear_beta));
  });
}

// kSigmoidMul: a · σ(g) (the K3 MLA output gate). attrs: none.
__device__ __noinline__ void op_sigmoid_mul(const TaskCtx& ctx) {
  for_each_slice_element(ctx, [&](int64_t t, int64_t c) { ctx.out(t)[c] = round_out(ctx, ctx.in(0, t)[c] * sigmoidf_(ctx.in(1, t)[c])); });
}

}  // namespace plow::cuda
