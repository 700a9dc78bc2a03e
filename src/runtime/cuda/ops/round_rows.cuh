// The task of an op the host ran (a prefill GEMM, prefill_gemm.h): its columns of the fp32 output,
// every row of the step, rounded in place to the activation dtype, as the GEMV body rounds its dots.
#pragma once

#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda {

__device__ __noinline__ void op_round_rows(const TaskCtx& ctx) {
  if (!ctx.op->round_out || ctx.op->act == kAF32) return;
  for_each_slice_element(ctx, [&](int t, int64_t c) {
    float* v = ctx.out(t) + c;
    *v = round_act(ctx.op->act, *v);
  });
}

}  // namespace plow::cuda
