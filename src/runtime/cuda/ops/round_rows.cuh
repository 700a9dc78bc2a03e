// The task of an op the host ran (a prefill GEMM, prefill_gemm.h): its columns of the fp32 output,
// every row of the step, rounded in place to the activation dtype, as the GEMV body rounds its dots.
#pragma once

#include "runtime/cuda/device.cuh"

namespace plow::cuda {

__device__ __noinline__ void op_round_rows(const TaskCtx& ctx) {
  if (!ctx.op->round_out || ctx.op->act == kAF32) return;
  const int64_t cols = ctx.col_end - ctx.col_begin;
  const int64_t n = static_cast<int64_t>(ctx.rows()) * cols;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    float* v = ctx.out(i / cols) + ctx.col_begin + i % cols;
    *v = round_act(ctx.op->act, *v);
  }
}

}  // namespace plow::cuda
