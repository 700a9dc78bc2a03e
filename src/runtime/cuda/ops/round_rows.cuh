// The task of an op the host ran (a prefill GEMM, prefill_gemm.h): its share of the fp32 output (its
// columns of every row, or whole rows in long steps: element_share), rounded in place to the activation
// dtype, as the GEMV body rounds its dots.
#pragma once

#include "runtime/cuda/ops/elementwise.cuh"

namespace plow::cuda {

__device__ __noinline__ void op_round_rows(const TaskCtx& ctx) { round_in_place(ctx); }

}  // namespace plow::cuda
