// MLA decode and prefill over short contexts, one task per head slice (the body before split-KV; see
// mla.cuh, which calls it for steps of at most kMlaHeadsMaxRows rows whose sequences hold at most
// kMlaHeadsMaxContext positions):
// per head, the task absorbs its queries, sweeps the latent cache twice (the softmax's max and total,
// then P rounded to the activation dtype exactly as the CPU rounds it, times the latents) and projects
// through W_UV. Every task with heads appends the step's fresh latent rows (identical values: benign)
// before any of its reads of them. At short contexts this beats split-KV: no cross-block phases, and
// the 32 heads' weight walks run side by side (48B shape on the H200, context 0: batch 1 8.57 ms a step
// against 9.43 with split-KV; batch 8 30.2 against 28.3, hence the row limit). Tasks past the heads
// return at once.
#pragma once

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/limits.h"
#include "runtime/cuda/ops/mla_common.cuh"

namespace plow::cuda::mla_heads {

inline constexpr int kMlaRankPerLane = kMlaMaxRank / 32;
inline constexpr int kMlaQueries = 4;      // (token, head) queries per sweep: u accumulators live in registers

// Writes rows [context, context + tokens) of the cache: c = act(w ⊙ act(c̃·rsqrt(mean(c̃²)+ε))), k_r raw.
__device__ inline void mla_append_latents(const TaskCtx& ctx, const MlaShape& sh, int first, int tokens, int context, float* cache, float* red) {
  const DeviceWeight& norm = ctx.weight(0);
  const int32_t act = ctx.op->act;
  for_each_row_sum(
      tokens, red,
      [&](int t, int begin, int stride) {
        const float* kv = ctx.in(1, first + t);
        float sum = 0.0f;
        for (int i = begin; i < sh.rank; i += stride) sum += kv[i] * kv[i];
        return sum;
      },
      [&](int t, float total, int begin, int stride) {
        const float inv = inv_rms(total, sh.rank, sh.eps);
        const float* kv = ctx.in(1, first + t);
        float* row = cache + static_cast<int64_t>(context + t) * sh.latent;
        for (int i = begin; i < sh.latent; i += stride) row[i] = i < sh.rank ? round_act(act, weight_flat(norm, i) * round_act(act, kv[i] * inv)) : kv[i];
      });
}

// qvec[j] = [q_nope·W_UK,h | q_rope] (latent wide) for queries q0 + j, j < nq; query qi is token qi / hs
// of the sequence and head first_head + qi % hs.
__device__ inline void mla_absorb_queries(const TaskCtx& ctx, const MlaShape& sh, int first, int q0, int nq, int hs, int first_head, float* qvec) {
  const DeviceWeight& kv_b = ctx.weight(1);  // [heads·(nope+v), rank]
  for (int idx = static_cast<int>(threadIdx.x); idx < nq * sh.latent; idx += kThreads) {
    const int j = idx / sh.latent, e = idx % sh.latent, qi = q0 + j;
    const int h = first_head + qi % hs;
    const float* q = ctx.in(0, first + qi / hs) + static_cast<int64_t>(h) * sh.qk;
    float acc = 0.0f;
    if (e < sh.rank) {
      const int64_t row0 = static_cast<int64_t>(h) * sh.per_head;
      for (int i = 0; i < sh.nope; ++i) acc += q[i] * weight_flat(kv_b, (row0 + i) * sh.rank + e);
    } else {
      acc = q[sh.nope + e - sh.rank];
    }
    qvec[j * sh.latent + e] = acc;
  }
  __syncthreads();
}


// One sweep over the positions a tile can see: warps split the positions, each cache row is loaded once
// and scored against every query; fn(j, visible, score, row) runs per (position, query), visible =
// position ≤ the query token's (causal).
template <typename Fn>
__device__ __forceinline__ void mla_sweep(const MlaShape& sh, const float* cache, int context, int q0, int nq, int hs, const float* qvec, Fn fn) {
  const int lane = lane_id();
  const int visible_max = context + (q0 + nq - 1) / hs + 1;
  for (int tau = warp_id(); tau < visible_max; tau += kWarps) {
    float x[kMlaLatentPerLane];
    mla_load_row(cache + static_cast<int64_t>(tau) * sh.latent, sh.latent, lane, x);
#pragma unroll
    for (int j = 0; j < kMlaQueries; ++j) {
      if (j >= nq) continue;
      fn(j, tau < context + (q0 + j) / hs + 1, mla_score(x, qvec + j * sh.latent, sh.latent, lane, sh.scale), x);
    }
  }
}

// Sweep 1: stat[j] = (max, Σ exp(s − max)) of query j over its visible positions.
__device__ inline void mla_softmax_stats(const MlaShape& sh, const float* cache, int context, int q0, int nq, int hs, const float* qvec,
                                         float* warp_stat, float* stat) {
  const int lane = lane_id(), warp = warp_id();
  float m[kMlaQueries], l[kMlaQueries];
#pragma unroll
  for (int j = 0; j < kMlaQueries; ++j) m[j] = -INFINITY, l[j] = 0.0f;
  mla_sweep(sh, cache, context, q0, nq, hs, qvec, [&](int j, bool visible, float s, const float(&)[kMlaLatentPerLane]) {
    if (!visible) return;
    const float m_new = fmaxf(m[j], s);
    l[j] = l[j] * expf(m[j] - m_new) + expf(s - m_new);
    m[j] = m_new;
  });
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kMlaQueries; ++j) warp_stat[(warp * kMlaQueries + j) * 2] = m[j], warp_stat[(warp * kMlaQueries + j) * 2 + 1] = l[j];
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < nq) {
    const int j = static_cast<int>(threadIdx.x);
    float max_score = -INFINITY;
    for (int w = 0; w < kWarps; ++w) max_score = fmaxf(max_score, warp_stat[(w * kMlaQueries + j) * 2]);
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) total += warp_stat[(w * kMlaQueries + j) * 2 + 1] * expf(warp_stat[(w * kMlaQueries + j) * 2] - max_score);
    stat[2 * j] = max_score;
    stat[2 * j + 1] = total;
  }
  __syncthreads();
}

// Sweep 2: usum[j] = Σ_τ act(exp(s − max)/total)·c_τ (rank wide) for the tile's queries.
__device__ inline void mla_accumulate(const TaskCtx& ctx, const MlaShape& sh, const float* cache, int context, int q0, int nq, int hs,
                                      const float* qvec, const float* stat, float* upart, float* usum) {
  const int lane = lane_id(), warp = warp_id();
  const int32_t act = ctx.op->act;
  float u[kMlaQueries][kMlaRankPerLane];
#pragma unroll
  for (int j = 0; j < kMlaQueries; ++j) {
#pragma unroll
    for (int e = 0; e < kMlaRankPerLane; ++e) u[j][e] = 0.0f;
  }
  mla_sweep(sh, cache, context, q0, nq, hs, qvec, [&](int j, bool visible, float s, const float (&x)[kMlaLatentPerLane]) {
    const float p = visible ? round_act(act, expf(s - stat[2 * j]) / stat[2 * j + 1]) : 0.0f;
#pragma unroll
    for (int e = 0; e < kMlaRankPerLane; ++e) u[j][e] += p * x[e];  // slots past the rank are never read
  });
#pragma unroll
  for (int j = 0; j < kMlaQueries; ++j) {
    if (j >= nq) continue;  // block-uniform
#pragma unroll
    for (int e = 0; e < kMlaRankPerLane; ++e) {
      const int idx = lane + 32 * e;
      if (idx < sh.rank) upart[warp * sh.rank + idx] = u[j][e];
    }
    __syncthreads();
    for (int idx = static_cast<int>(threadIdx.x); idx < sh.rank; idx += kThreads) {
      float sum = 0.0f;
      for (int w = 0; w < kWarps; ++w) sum += upart[w * sh.rank + idx];
      usum[j * sh.rank + idx] = sum;
    }
    __syncthreads();
  }
}

// out[token][h·dv + i] = act(W_UV,h[i]·u) for the tile's queries: one warp per output column.
__device__ inline void mla_project_out(const TaskCtx& ctx, const MlaShape& sh, int first, int q0, int nq, int hs, int first_head, const float* usum) {
  const DeviceWeight& kv_b = ctx.weight(1);
  const int lane = lane_id();
  for (int unit = warp_id(); unit < nq * sh.dv; unit += kWarps) {
    const int j = unit / sh.dv, i = unit % sh.dv, qi = q0 + j;
    const int h = first_head + qi % hs;
    const int64_t row = static_cast<int64_t>(h) * sh.per_head + sh.nope + i;
    float acc = 0.0f;
    for (int e = lane; e < sh.rank; e += 32) acc += weight_flat(kv_b, row * sh.rank + e) * usum[j * sh.rank + e];
    acc = warp_sum(acc);
    if (lane == 0) ctx.out(first + qi / hs)[static_cast<int64_t>(h) * sh.dv + i] = round_out(ctx, acc);
  }
  __syncthreads();  // qvec and usum are rewritten by the next tile
}

// kMlaAttention (heads, sliced by v columns). Inputs q [T, heads·(nope+rope)], kv_a [T, rank+rope];
// weights kv_a_layernorm [rank], kv_b [heads·(nope+v), rank]. State: latent cache rows [max_context,
// rank+rope] per slot (DeviceState.depth = max_context rows; past it: kErrContext, sequence skipped).
// attrs: [0] heads, [1] nope, [2] rope, [3] v, [4] rank, [5] eps (kv_a norm). Requires rank ≤ 512 and
// rank + rope ≤ 576 (pack_misc_attrs refuses others).
__device__ __noinline__ void run(const TaskCtx& ctx) {
  const MlaShape sh = mla_shape(ctx);
  const DeviceState& state = ctx.step->states[ctx.op->state];
  const int first_head = static_cast<int>(ctx.col_begin / sh.dv), hs = static_cast<int>((ctx.col_end - ctx.col_begin) / sh.dv);
  if (hs == 0) return;  // a task past the heads (the op has one task per worker): the others append the rows
  float* qvec = smem_floats(ctx);                       // [kMlaQueries][latent]
  float* warp_stat = qvec + kMlaQueries * sh.latent;    // [kWarps][kMlaQueries][2]
  float* stat = warp_stat + kWarps * kMlaQueries * 2;   // [kMlaQueries][2]
  float* upart = stat + kMlaQueries * 2;                // [kWarps][rank]
  float* usum = upart + kWarps * sh.rank;               // [kMlaQueries][rank]
  float* red = usum + kMlaQueries * sh.rank;            // 32
  const StepView& step = *ctx.step;
  for (int s = 0; s < step.num_seqs; ++s) {
    const int first = step.seq_first_row[s], tokens = step.seq_tokens[s], context = step.seq_context[s];
    if (static_cast<int64_t>(context) + tokens > state.depth) {
      if (threadIdx.x == 0) report_error(ctx, kErrContext);
      continue;  // block-uniform
    }
    float* cache = state_of(ctx, step.seq_slot[s]);
    mla_append_latents(ctx, sh, first, tokens, context, cache, red);
    const int queries = tokens * hs;
    for (int q0 = 0; q0 < queries; q0 += kMlaQueries) {
      const int nq = queries - q0 < kMlaQueries ? queries - q0 : kMlaQueries;
      mla_absorb_queries(ctx, sh, first, q0, nq, hs, first_head, qvec);
      mla_softmax_stats(sh, cache, context, q0, nq, hs, qvec, warp_stat, stat);
      mla_accumulate(ctx, sh, cache, context, q0, nq, hs, qvec, stat, upart, usum);
      mla_project_out(ctx, sh, first, q0, nq, hs, first_head, usum);
    }
  }
}

}  // namespace plow::cuda::mla_heads
