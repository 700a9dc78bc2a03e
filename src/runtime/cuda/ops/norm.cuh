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
  const DeviceWeight w = ctx.weight(0);
  const int64_t n = ctx.op->width;
  const float eps = ctx.attr(0);
  const int32_t act = ctx.op->act, out_act = ctx.out_act();
  const Rows<const float> x = ctx.in_rows(0);
  const Rows<float> out = ctx.out_rows();
  const RowShare share = row_share(ctx);
  for_each_row_sum(
      ctx.rows(), smem_floats(ctx),
      [&](int t, int first, int stride) {
        const float* xt = x[t];
        return strided_sum(first, n, stride, [&](int64_t i) { return xt[i]; }, [](float sum, float v) { return sum + v * v; });
      },
      [&](int t, float total, int first, int stride) {
        const float scale = inv_rms(total, n, eps);
        const float* xt = x[t];
        float* ot = out[t];
        for_each_strided(
            share.col_begin + first, share.col_end, stride, [&](int64_t i) { return Operands{xt[i], weight_flat(w, i)}; },
            [&](int64_t i, Operands v) { ot[i] = round_act(out_act, v.b * round_act(act, v.a * scale)); });
      },
      share.first_row, share.row_stride);
}

// Elements of a head a lane holds in gated_rms_norm's batched form (d ≤ 128: every KDA head), and
// the units a warp loads before reducing any: one unit at a time waited a DRAM latency per unit (16
// units a warp at 1024 rows × 32 heads on 132 workers).
inline constexpr int kGatedNormPerLane = 4, kGatedNormUnits = 4;

// One unit of a gated RMSNorm: a head (d channels) of o and z, and where its output goes.
struct GatedUnit {
  const float* o;
  const float* z;
  float* out;
};

// The gated RMSNorm of units 0..units-1 (unit u's pointers: at(u)): out = act(w ⊙ (o·rsqrt(mean(o²)+ε))
// ⊙ σ(z)), fp32 throughout, one rounding. One warp a unit, lane l summing channels l, l + 32, … in
// order, so a unit's sum is the same whichever body, task or form computes it. For d ≤ 128 a warp
// loads kGatedNormUnits units before reducing any (one unit at a time waited a DRAM latency per unit).
// o and z are rounded to o_act and z_act as they load (TaskCtx::in_act; kAF32: as they are).
template <class At>
__device__ __forceinline__ void gated_norm_units(const DeviceWeight w, int64_t d, float eps, int32_t act, int32_t o_act, int32_t z_act, int64_t units, At at) {
  const int lane = lane_id();
  if (d > 32 * kGatedNormPerLane) {
    for (int64_t u = warp_id(); u < units; u += kWarps) {
      const GatedUnit p = at(u);
      float sum = 0.0f;
      for (int64_t j = lane; j < d; j += 32) {
        const float o = round_act(o_act, p.o[j]);
        sum += o * o;
      }
      const float scale = inv_rms(warp_sum(sum), d, eps);
      for (int64_t j = lane; j < d; j += 32) {
        p.out[j] = round_act(act, weight_flat(w, j) * (round_act(o_act, p.o[j]) * scale) * sigmoidf_(round_act(z_act, p.z[j])));
      }
    }
    return;
  }
  float wj[kGatedNormPerLane];
#pragma unroll
  for (int i = 0; i < kGatedNormPerLane; ++i) wj[i] = lane + 32 * i < d ? weight_flat(w, lane + 32 * i) : 0.0f;
  for (int64_t u0 = warp_id(); u0 < units; u0 += kGatedNormUnits * kWarps) {
    float o[kGatedNormUnits][kGatedNormPerLane] = {}, z[kGatedNormUnits][kGatedNormPerLane] = {};
    float* outs[kGatedNormUnits] = {};  // at(u) once a unit: its index arithmetic is per lane
#pragma unroll
    for (int k = 0; k < kGatedNormUnits; ++k) {
      const int64_t u = u0 + k * kWarps;
      if (u >= units) break;
      const GatedUnit p = at(u);
      outs[k] = p.out;
#pragma unroll
      for (int i = 0; i < kGatedNormPerLane; ++i) {
        if (lane + 32 * i < d) o[k][i] = round_act(o_act, p.o[lane + 32 * i]), z[k][i] = round_act(z_act, p.z[lane + 32 * i]);
      }
    }
#pragma unroll
    for (int k = 0; k < kGatedNormUnits; ++k) {
      const int64_t u = u0 + k * kWarps;  // the same for the whole warp: warp_sum below is uniform
      if (u >= units) break;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kGatedNormPerLane; ++i) {
        if (lane + 32 * i < d) sum += o[k][i] * o[k][i];
      }
      const float scale = inv_rms(warp_sum(sum), d, eps);
      float* out = outs[k];
#pragma unroll
      for (int i = 0; i < kGatedNormPerLane; ++i) {
        if (lane + 32 * i < d) out[lane + 32 * i] = round_act(act, wj[i] * (o[k][i] * scale) * sigmoidf_(z[k][i]));
      }
    }
  }
}

// kGatedRmsNorm (KDA output norm, §4.2 K7): gated_norm_units over the task's row_share (its heads of
// every row, or every head of its rows; a task past the heads has none in the first form). attrs: [0]
// head_dim, [1] eps. Inputs o, z [T, heads·d]; weight w [d].
__device__ __noinline__ void op_gated_rms_norm(const TaskCtx& ctx) {
  const auto d = static_cast<int64_t>(ctx.attr(0));
  const Rows<const float> o_rows = ctx.in_rows(0), z_rows = ctx.in_rows(1);
  const Rows<float> out = ctx.out_rows();
  const RowShare share = row_share(ctx);
  const int64_t first_head = share.col_begin / d, heads = (share.col_end - share.col_begin) / d;
  const int rows = ctx.rows();
  const int64_t share_rows = share.first_row < rows ? (rows - share.first_row + share.row_stride - 1) / share.row_stride : 0;
  // Unit u: head first_head + u mod heads of row first_row + (u / heads)·row_stride, at column offset h·d.
  // In 32 bits (a step's rows × heads are far below 2³¹): a 64-bit division and remainder a unit were
  // ~140 instructions a lane, about as many as the unit's 4 channels a lane of arithmetic.
  const int heads32 = static_cast<int>(heads);
  gated_norm_units(ctx.weight(0), d, ctx.attr(1), ctx.out_act(), ctx.in_act(0), ctx.in_act(1), share_rows * heads, [&](int64_t u) {
    const int q = static_cast<int>(u) / heads32, h = static_cast<int>(u) - q * heads32;
    const int64_t row = share.first_row + static_cast<int64_t>(q) * share.row_stride, col = (first_head + h) * d;
    return GatedUnit{o_rows[row] + col, z_rows[row] + col, out[row] + col};
  });
}

// kAddNorm: [T, 2F] = concat(s, rms_norm(s; w)) with s = act(a + b). attrs: [0] eps. Weight w [F].
__device__ __noinline__ void op_add_norm(const TaskCtx& ctx) {
  const DeviceWeight w = ctx.weight(0);
  const int64_t half = ctx.op->width / 2;
  const float eps = ctx.attr(0);
  const int32_t act = ctx.op->act;
  const Rows<const float> a = ctx.in_rows(0), b = ctx.in_rows(1);
  const Rows<float> out = ctx.out_rows();
  const RowShare share = row_share(ctx);
  for_each_row_sum(
      ctx.rows(), smem_floats(ctx),
      [&](int t, int first, int stride) {
        const float *at = a[t], *bt = b[t];
        return strided_sum(
            first, half, stride, [&](int64_t i) { return round_act(act, at[i] + bt[i]); }, [](float sum, float s) { return sum + s * s; });
      },
      [&](int t, float total, int first, int stride) {
        const float scale = inv_rms(total, half, eps);
        const float *at = a[t], *bt = b[t];
        float* ot = out[t];
        // Column c < half is s[c]; c ≥ half is the norm of s[c − half].
        for_each_strided(
            share.col_begin + first, share.col_end, stride,
            [&](int64_t c) {
              const int64_t i = c < half ? c : c - half;
              return Operands{round_act(act, at[i] + bt[i]), c < half ? 0.0f : weight_flat(w, i)};
            },
            [&](int64_t c, Operands v) { ot[c] = c < half ? v.a : round_act(act, v.b * round_act(act, v.a * scale)); });
      },
      share.first_row, share.row_stride);
}

}  // namespace plow::cuda
