// Block Attention Residuals (spec/MODEL.md §7.2 A1–A3; cpu: ops/attn_res.cpp, fused.cpp
// cpu_attn_res_norm). The softmax over depth needs whole-row reductions of every value, so every
// column-slice task computes them for its rows (redundant across slices, cheap next to the GEMVs);
// the mix itself is computed for the slice only. Rows go in tiles so the scores fit in shared memory.
#pragma once

#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda {

// Depth weights α[r·J + j] for rows [t0, t0 + rows) of the J = num_inputs values: one warp per (row,
// value) computes Σv² and w_q·(w_n ⊙ v) in one pass; s = dot·rsqrt(mean(v²)+ε) (the CPU applies the
// rsqrt inside each term: fp32 reassociation only); then one thread per row runs the softmax in the
// CPU's order (max, exp, sequential total, α = e/total). Block-uniform; ends synchronized.
// A lane loads kSumBatch elements of v, w_q and w_n before it adds any (strided_sum, in the same
// order): one element at a time waited a memory latency per 32 elements (a K3 rank's attn_res_norm:
// 39.7 → 33.6 ms a decode step; still ~180 µs an op, barrier-bound, docs/cuda.md).
__device__ inline void attn_res_weights(const TaskCtx& ctx, int t0, int rows, float eps, float* alpha) {
  const DeviceWeight norm = ctx.weight(0);   // w_n [H]
  const DeviceWeight query = ctx.weight(1);  // w_q [1, H]
  const int values = ctx.op->num_inputs;
  const int64_t width = ctx.in_width(0);
  const int lane = lane_id();
  for (int u = warp_id(); u < rows * values; u += kWarps) {
    const int r = u / values, j = u % values;
    const float* v = ctx.in(j, t0 + r);
    struct Loaded {
      float x, wq, wn;
    };
    const Operands sums = strided_sum(
        lane, width, 32, [&](int64_t i) { return Loaded{v[i], weight_flat(query, i), weight_flat(norm, i)}; },
        [](Operands s, Loaded e) { return Operands{s.a + e.x * e.x, s.b + e.wq * (e.wn * e.x)}; }, Operands{0.0f, 0.0f});
    const float sum_sq = warp_sum(sums.a), dot = warp_sum(sums.b);
    if (lane == 0) alpha[u] = dot * inv_rms(sum_sq, width, eps);
  }
  __syncthreads();
  for (int r = static_cast<int>(threadIdx.x); r < rows; r += kThreads) {
    float* s = alpha + r * values;
    float max_score = -INFINITY;
    for (int j = 0; j < values; ++j) max_score = fmaxf(max_score, s[j]);
    float total = 0.0f;
    for (int j = 0; j < values; ++j) total += (s[j] = expf(s[j] - max_score));
    for (int j = 0; j < values; ++j) s[j] = s[j] / total;
  }
  __syncthreads();
}

// Σ_j α_j · V_j[t][i], summed in input order as the CPU does.
__device__ __forceinline__ float attn_res_mixed(const TaskCtx& ctx, const float* alpha_row, int t, int64_t i) {
  float mixed = 0.0f;
  for (int j = 0; j < ctx.op->num_inputs; ++j) mixed += alpha_row[j] * ctx.in(j, t)[i];
  return mixed;
}

// Rows per tile: the scores of a tile (rows × values floats) plus 32 floats of reduction space fit in
// shared memory.
__device__ __forceinline__ int attn_res_tile_rows(const TaskCtx& ctx) {
  const int by_smem = (kSharedBytes / 4 - 32) / ctx.op->num_inputs;
  return by_smem < 256 ? by_smem : 256;
}

// kAttnResMix: out = act(Σ_j softmax_j(s)·V_j) over the slice. attrs: [0] eps. Weights w_n [H], w_q [1,H].
// Inputs: the J values [T, H] (variadic).
__device__ __noinline__ void op_attn_res_mix(const TaskCtx& ctx) {
  float* alpha = smem_floats(ctx);
  const int tile = attn_res_tile_rows(ctx), rows = ctx.rows(), values = ctx.op->num_inputs;
  const int64_t cols = ctx.col_end - ctx.col_begin;
  for (int t0 = 0; t0 < rows; t0 += tile) {
    const int n = rows - t0 < tile ? rows - t0 : tile;
    attn_res_weights(ctx, t0, n, ctx.attr(0), alpha);
    for_each_row_col(n, ctx.col_begin, static_cast<int>(cols), [&](int r, int64_t c) {
      ctx.out(t0 + r)[c] = round_out(ctx, attn_res_mixed(ctx, alpha + r * values, t0 + r, c));
    });
    __syncthreads();  // alpha is rewritten by the next tile
  }
}

// kAttnResNorm: rms_norm(attn_res_mix(values; w_n, w_q); w) over the slice; the mix is rounded to the
// activation dtype (the unfused mix's output) and its whole row is reduced for the norm.
// attrs: [0] eps (the mix), [1] norm_eps. Weights w_n [H], w_q [1,H], w [H].
__device__ __noinline__ void op_attn_res_norm(const TaskCtx& ctx) {
  const DeviceWeight& w = ctx.weight(2);
  const int32_t act = ctx.op->act;
  const float norm_eps = ctx.attr(1);
  const int64_t width = ctx.op->width;
  float* alpha = smem_floats(ctx);
  const int tile = attn_res_tile_rows(ctx), rows = ctx.rows(), values = ctx.op->num_inputs;
  float* red = alpha + tile * values;
  for (int t0 = 0; t0 < rows; t0 += tile) {
    const int n = rows - t0 < tile ? rows - t0 : tile;
    attn_res_weights(ctx, t0, n, ctx.attr(0), alpha);
    for_each_row_sum(
        n, red,
        [&](int r, int first, int stride) {  // kLoadBatch elements' mixes at a time, each over j in order
          const float* alpha_row = alpha + r * values;
          float sum = 0.0f;
          for (int64_t i0 = first; i0 < width; i0 += static_cast<int64_t>(kLoadBatch) * stride) {
            float m[kLoadBatch] = {};
            for (int j = 0; j < values; ++j) {
              const float* v = ctx.in(j, t0 + r);
#pragma unroll
              for (int k = 0; k < kLoadBatch; ++k) {
                if (i0 + k * stride < width) m[k] += alpha_row[j] * v[i0 + k * stride];
              }
            }
#pragma unroll
            for (int k = 0; k < kLoadBatch; ++k) {
              if (i0 + k * stride < width) {
                const float mk = round_act(act, m[k]);
                sum += mk * mk;
              }
            }
          }
          return sum;
        },
        [&](int r, float total, int first, int stride) {
          const float scale = inv_rms(total, width, norm_eps);
          float* out = ctx.out(t0 + r);
          for (int64_t i = ctx.col_begin + first; i < ctx.col_end; i += stride) {
            const float m = round_act(act, attn_res_mixed(ctx, alpha + r * values, t0 + r, i));
            out[i] = round_out(ctx, weight_flat(w, i) * round_act(act, m * scale));
          }
        });
  }
}

}  // namespace plow::cuda
