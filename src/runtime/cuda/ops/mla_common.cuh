// What the MLA decode items share (spec/MODEL.md §4.3): the op's shape from its attributes, and one
// latent row against a query, lane-strided over a warp (mla.cuh's SIMT B item).
#pragma once

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/limits.h"

namespace plow::cuda {

inline constexpr int kMlaLatentPerLane = kMlaMaxLatent / 32;

struct MlaShape {
  int heads, nope, rope, dv, rank, latent, qk, per_head;
  float eps, scale;
};

__device__ __forceinline__ MlaShape mla_shape(const TaskCtx& ctx) {
  MlaShape s;
  s.heads = static_cast<int>(ctx.attr(0));
  s.nope = static_cast<int>(ctx.attr(1));
  s.rope = static_cast<int>(ctx.attr(2));
  s.dv = static_cast<int>(ctx.attr(3));
  s.rank = static_cast<int>(ctx.attr(4));
  s.eps = ctx.attr(5);
  s.latent = s.rank + s.rope;
  s.qk = s.nope + s.rope;
  s.per_head = s.nope + s.dv;
  s.scale = 1.0f / sqrtf(static_cast<float>(s.qk));  // (d_n + d_r)^(−1/2), no mscale
  return s;
}

// One cache row (global or shared memory), lane-strided: x[e] = row[lane + 32e] (0 past the latent width).
__device__ __forceinline__ void mla_load_row(const float* row, int latent, int lane, float (&x)[kMlaLatentPerLane]) {
#pragma unroll
  for (int e = 0; e < kMlaLatentPerLane; ++e) {
    const int idx = lane + 32 * e;
    x[e] = idx < latent ? row[idx] : 0.0f;
  }
}

// The scaled score of one query against the row in x (every lane gets it).
__device__ __forceinline__ float mla_score(const float (&x)[kMlaLatentPerLane], const float* qvec, int latent, int lane, float scale) {
  float partial = 0.0f;
#pragma unroll
  for (int e = 0; e < kMlaLatentPerLane; ++e) {
    const int idx = lane + 32 * e;
    if (idx < latent) partial += x[e] * qvec[idx];
  }
  return warp_sum(partial) * scale;
}

}  // namespace plow::cuda
