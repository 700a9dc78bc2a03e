// RMSNorm family (cpu: ops/norm.cpp, fused.cpp cpu_add_norm): kRmsNorm (input row whole, output
// slice), kGatedRmsNorm (whole heads, one warp per (row, head); plans of many rows give it tasks past
// its heads, graph/op_table spread_tasks) and kAddNorm (the sum's whole row is reduced; the slice
// covers either half of the [sum | norm(sum)] output). Steps of many rows give each task whole rows
// instead of its slice (common.cuh row_share).
// Roundings as the CPU: RMSNorm casts x·scale to the activation dtype before the weight multiply.
#pragma once

#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda {

// kRmsNorm: out = act(w ⊙ act(x · rsqrt(mean(x²) + ε))). attrs: [0] eps. Weight w [F].
__device__ __noinline__ void op_rms_norm(const TaskCtx& ctx) {
  const DeviceWeight& w = ctx.weight(0);
  const int64_t n = ctx.op->width;
  const float eps = ctx.attr(0);
  const int32_t act = ctx.op->act;
  const RowShare share = row_share(ctx);
  for_each_row_sum(
      ctx.rows(), smem_floats(ctx),
      [&](int t, int first, int stride) {
        const float* x = ctx.in(0, t);
        float sum = 0.0f;
        for (int64_t i = first; i < n; i += stride) sum += x[i] * x[i];
        return sum;
      },
      [&](int t, float total, int first, int stride) {
        const float scale = inv_rms(total, n, eps);
        const float* x = ctx.in(0, t);
        float* out = ctx.out(t);
        for (int64_t i = share.col_begin + first; i < share.col_end; i += stride) out[i] = round_out(ctx, weight_flat(w, i) * round_act(act, x[i] * scale));
      },
      share.first_row, share.row_stride);
}

// kGatedRmsNorm (KDA output norm, §4.2 K7): per head of d channels, out = act(w ⊙ (o·rsqrt(mean(o²)+ε)) ⊙ σ(z)),
// fp32 throughout, one rounding. attrs: [0] head_dim, [1] eps. Inputs o, z [T, heads·d]; weight w [d].
// Units of the task's row_share (its heads of every row, or every head of its rows; a task past the
// heads has none in the first form), one warp each: a unit's sum is the same whichever task owns it.
__device__ __noinline__ void op_gated_rms_norm(const TaskCtx& ctx) {
  const DeviceWeight& w = ctx.weight(0);
  const auto d = static_cast<int64_t>(ctx.attr(0));
  const float eps = ctx.attr(1);
  const RowShare share = row_share(ctx);
  const int64_t first_head = share.col_begin / d, heads = (share.col_end - share.col_begin) / d;
  const int rows = ctx.rows();
  const int64_t share_rows = share.first_row < rows ? (rows - share.first_row + share.row_stride - 1) / share.row_stride : 0;
  const int64_t units = share_rows * heads;
  const int lane = lane_id();
  for (int64_t u = warp_id(); u < units; u += kWarps) {
    const int64_t t = share.first_row + u / heads * share.row_stride, h = first_head + u % heads;
    const float* o = ctx.in(0, t) + h * d;
    const float* z = ctx.in(1, t) + h * d;
    float* out = ctx.out(t) + h * d;
    float sum = 0.0f;
    for (int64_t j = lane; j < d; j += 32) sum += o[j] * o[j];
    const float scale = inv_rms(warp_sum(sum), d, eps);
    for (int64_t j = lane; j < d; j += 32) out[j] = round_out(ctx, weight_flat(w, j) * (o[j] * scale) * sigmoidf_(z[j]));
  }
}

// kAddNorm: [T, 2F] = concat(s, rms_norm(s; w)) with s = act(a + b). attrs: [0] eps. Weight w [F].
__device__ __noinline__ void op_add_norm(const TaskCtx& ctx) {
  const DeviceWeight& w = ctx.weight(0);
  const int64_t half = ctx.op->width / 2;
  const float eps = ctx.attr(0);
  const int32_t act = ctx.op->act;
  const RowShare share = row_share(ctx);
  for_each_row_sum(
      ctx.rows(), smem_floats(ctx),
      [&](int t, int first, int stride) {
        const float* a = ctx.in(0, t);
        const float* b = ctx.in(1, t);
        float sum = 0.0f;
        for (int64_t i = first; i < half; i += stride) {
          const float s = round_act(act, a[i] + b[i]);
          sum += s * s;
        }
        return sum;
      },
      [&](int t, float total, int first, int stride) {
        const float scale = inv_rms(total, half, eps);
        const float* a = ctx.in(0, t);
        const float* b = ctx.in(1, t);
        float* out = ctx.out(t);
        for (int64_t c = share.col_begin + first; c < share.col_end; c += stride) {
          const int64_t i = c < half ? c : c - half;
          const float s = round_act(act, a[i] + b[i]);
          out[c] = c < half ? s : round_act(act, weight_flat(w, i) * round_act(act, s * scale));
        }
      },
      share.first_row, share.row_stride);
}

}  // namespace plow::cuda
