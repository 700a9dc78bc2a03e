// Block Attention Residuals (spec/MODEL.md §7.2 A1–A3; cpu: ops/attn_res.cpp, fused.cpp
// cpu_attn_res_norm). The softmax over depth needs whole-row reductions of every value (and the fused
// norm one of the mixed row), so the op's tasks share them through the ops' workspace instead of each
// task reducing every whole row for its column slice: at K3's width (7,168 columns, 9 values) that
// redundancy cost ~170 µs a task and half of a TP8 rank's batch-1 decode step (docs/cuda.md).
//
// Work items: groups of kAttnResItemRows rows × chunks of columns (attn_res_schedule), dealt in phases
// from a ticket counter (sync[0]) as split-KV MLA deals its items (mla.cuh):
//   1. sums: (Σ v², Σ w_q·(w_n ⊙ v)) of every (row, value) over the chunk, into the workspace; counted
//      done on sync[1];
//   2. mix: once every sum is in, each item adds a row's chunk sums (in chunk order) into its scores,
//      takes the softmax over depth and mixes its chunk; the mix writes it out, the norm writes Σ m²
//      of the rounded mix over the chunk (and the chunk-0 item the weights α); counted on sync[2];
//   3. (norm) once every Σ m² is in: the row's total gives the norm's scale; the item mixes its chunk
//      again (the same α, the same order: the same m) and writes w ⊙ round(m · scale).
// A phase's item waits only for items of earlier phases, which went out first and only to running
// blocks, so the waits cannot deadlock (one launch an op or the megakernel). The last task to leave
// resets the counters (sync[3]). Steps whose rows give one chunk an item (long prefill steps) run each
// group of whole rows in one item, without workspace or waits.
#pragma once

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/limits.h"

namespace plow::cuda {

struct AttnResSchedule {
  int groups, chunks;  // items of a phase: groups × chunks
  int chunk;           // columns of an item's chunk (a multiple of 8; the last one may be shorter)
};

// Enough chunks that a phase has about one item a task, of at least 8 columns, or of at least
// min_chunk (attr 2, CudaOptions::attn_res_min_chunk; fewer chunks only, so the workspace bound holds).
__device__ __forceinline__ AttnResSchedule attn_res_schedule(int rows, int64_t width, int tasks, int min_chunk) {
  const int groups = (rows + kAttnResItemRows - 1) / kAttnResItemRows;
  const int most = static_cast<int>((width + 7) / 8);
  int chunks = (tasks + groups - 1) / groups;
  chunks = chunks < 1 ? 1 : chunks > most ? most : chunks;
  int chunk = static_cast<int>(((width + chunks - 1) / chunks + 7) / 8 * 8);
  if (min_chunk > chunk) chunk = (min_chunk + 7) / 8 * 8;
  return {groups, static_cast<int>((width + chunk - 1) / chunk), chunk};
}

// The two sums of value j of row t over columns [c0, c1), by one warp (lanes strided, then the warp's
// sum): Σ v² and w_q·(w_n ⊙ v).
__device__ __forceinline__ Operands attn_res_sums(const TaskCtx& ctx, int j, int64_t t, int64_t c0, int64_t c1) {
  const DeviceWeight norm = ctx.weight(0);   // w_n [H]
  const DeviceWeight query = ctx.weight(1);  // w_q [1, H]
  const float* v = ctx.in(j, t);
  struct Loaded {
    float x, wq, wn;
  };
  const Operands sums = strided_sum(
      c0 + lane_id(), c1, 32, [&](int64_t i) { return Loaded{v[i], weight_flat(query, i), weight_flat(norm, i)}; },
      [](Operands s, Loaded e) { return Operands{s.a + e.x * e.x, s.b + e.wq * (e.wn * e.x)}; }, Operands{0.0f, 0.0f});
  return {warp_sum(sums.a), warp_sum(sums.b)};
}

// Softmax over depth of the scores alpha[r·J + j] of rows r < n, in place, one thread a row in the CPU's
// order (max, exp, sequential total, α = e/total). Block-uniform; starts and ends synchronized.
__device__ __forceinline__ void attn_res_softmax(int n, int values, float* alpha) {
  __syncthreads();
  for (int r = static_cast<int>(threadIdx.x); r < n; r += kThreads) {
    float* s = alpha + r * values;
    float max_score = -INFINITY;
    for (int j = 0; j < values; ++j) max_score = fmaxf(max_score, s[j]);
    float total = 0.0f;
    for (int j = 0; j < values; ++j) total += (s[j] = expf(s[j] - max_score));
    for (int j = 0; j < values; ++j) s[j] = s[j] / total;
  }
  __syncthreads();
}

// Σ_j α_j · V_j[t][i], summed in input order as the CPU does, rounded to the activation dtype (the
// unfused mix's output).
__device__ __forceinline__ float attn_res_mixed(const TaskCtx& ctx, const float* alpha_row, int64_t t, int64_t i) {
  float mixed = 0.0f;
  for (int j = 0; j < ctx.op->num_inputs; ++j) mixed += alpha_row[j] * ctx.in(j, t)[i];
  return round_act(ctx.op->act, mixed);
}

// Σ m² of row t's rounded mix over columns [c0, c1), by one warp.
__device__ __forceinline__ float attn_res_mix_sumsq(const TaskCtx& ctx, const float* alpha_row, int64_t t, int64_t c0, int64_t c1) {
  float sum = 0.0f;
  for (int64_t i = c0 + lane_id(); i < c1; i += 32) {
    const float m = attn_res_mixed(ctx, alpha_row, t, i);
    sum += m * m;
  }
  return warp_sum(sum);
}

// Writes rows [t0, t0 + n) × columns [c0, c1) of the output: the mix, or with the norm (kNorm)
// w ⊙ round(m · scale[r]).
template <bool kNorm>
__device__ __forceinline__ void attn_res_store(const TaskCtx& ctx, int t0, int n, int64_t c0, int64_t c1, const float* alpha,
                                               [[maybe_unused]] const float* scale) {
  const int values = ctx.op->num_inputs;
  for_each_row_col(n, c0, static_cast<int>(c1 - c0), [&](int r, int64_t c) {
    const float m = attn_res_mixed(ctx, alpha + r * values, t0 + r, c);
    if constexpr (kNorm) {
      const DeviceWeight& w = ctx.weight(2);
      ctx.out(t0 + r)[c] = round_out(ctx, weight_flat(w, c) * round_act(ctx.op->act, m * scale[r]));
    } else {
      ctx.out(t0 + r)[c] = round_out(ctx, m);
    }
  });
}

// One item of whole rows [t0, t0 + n): scores, softmax, mix (and norm) with no hand-off.
template <bool kNorm>
__device__ void attn_res_rows_item(const TaskCtx& ctx, int t0, int n, float* alpha, float* scale) {
  const int values = ctx.op->num_inputs;
  const int64_t width = ctx.op->width;
  for (int u = warp_id(); u < n * values; u += kWarps) {
    const Operands s = attn_res_sums(ctx, u % values, t0 + u / values, 0, width);
    if (lane_id() == 0) alpha[u] = s.b * inv_rms(s.a, width, ctx.attr(0));
  }
  attn_res_softmax(n, values, alpha);
  if constexpr (kNorm) {
    for (int r = warp_id(); r < n; r += kWarps) {
      const float total = attn_res_mix_sumsq(ctx, alpha + r * values, t0 + r, 0, width);
      if (lane_id() == 0) scale[r] = inv_rms(total, width, ctx.attr(1));
    }
    __syncthreads();
  }
  attn_res_store<kNorm>(ctx, t0, n, 0, width, alpha, scale);
  __syncthreads();  // alpha and scale are rewritten by the next item
}

// kAttnResMix (kNorm false): out = Σ_j softmax_j(s)·V_j. kAttnResNorm (kNorm true): rms_norm of that
// mix (rounded to the activation dtype) with weight w. attrs: [0] eps (the mix), [1] norm_eps, [2] the
// least columns of an item's chunk (0: attn_res_schedule's).
// Weights w_n [H], w_q [1,H] (and w [H]). Inputs: the J values [T, H] (variadic).
template <bool kNorm>
__device__ void attn_res_body(const TaskCtx& ctx) {
  const int rows = ctx.rows(), values = ctx.op->num_inputs;
  const int64_t width = ctx.op->width;
  const AttnResSchedule sch = attn_res_schedule(rows, width, ctx.op->tasks, static_cast<int>(ctx.attr(2)));
  float* const alpha = smem_floats(ctx) + 32;                // after the ticket: [kAttnResItemRows][J]
  float* const scale = alpha + kAttnResItemRows * values;   // [kAttnResItemRows]
  if (sch.chunks == 1) {  // whole rows an item: the task's own items, no counters
    for (int g = ctx.task; g < sch.groups; g += ctx.op->tasks) {
      const int t0 = g * kAttnResItemRows;
      attn_res_rows_item<kNorm>(ctx, t0, rows - t0 < kAttnResItemRows ? rows - t0 : kAttnResItemRows, alpha, scale);
    }
    return;
  }
  if (ctx.op->sync == nullptr || attn_res_workspace_floats(rows, values, sch.chunks) > ctx.op->workspace_floats) {
    if (threadIdx.x == 0) report_error(ctx, kErrWorkspace);
    return;  // every task sees the same step
  }
  // Workspace: sums [T][chunks][J] (two floats each), α [T][J], Σ m² [T][chunks].
  float* const sums = ctx.op->workspace;
  float* const weights = sums + static_cast<int64_t>(rows) * sch.chunks * values * 2;
  float* const squares = weights + static_cast<int64_t>(rows) * values;
  unsigned* const sync = ctx.op->sync;
  const int items = sch.groups * sch.chunks, phases = kNorm ? 3 : 2;
  for (;;) {
    const int ticket = take_ticket(ctx, sync);
    if (ticket >= phases * items) break;  // block-uniform
    const int phase = ticket / items, item = ticket % items;
    const int g = item / sch.chunks, k = item % sch.chunks, t0 = g * kAttnResItemRows;
    const int n = rows - t0 < kAttnResItemRows ? rows - t0 : kAttnResItemRows;
    const int64_t c0 = static_cast<int64_t>(k) * sch.chunk, c1 = c0 + sch.chunk < width ? c0 + sch.chunk : width;
    if (phase == 0) {
      for (int u = warp_id(); u < n * values; u += kWarps) {
        const Operands s = attn_res_sums(ctx, u % values, t0 + u / values, c0, c1);
        if (lane_id() == 0) {
          float* at = sums + ((static_cast<int64_t>(t0 + u / values) * sch.chunks + k) * values + u % values) * 2;
          at[0] = s.a, at[1] = s.b;
        }
      }
      block_arrive(sync + 1);
    } else if (phase == 1) {
      block_wait(sync + 1, items);
      for (int u = warp_id(); u < n * values; u += kWarps) {  // the row's chunk sums, lanes strided over chunks
        const int64_t t = t0 + u / values;
        float sq = 0.0f, dot = 0.0f;
        for (int c = lane_id(); c < sch.chunks; c += 32) {
          const float* at = sums + ((t * sch.chunks + c) * values + u % values) * 2;
          sq += __ldcg(at), dot += __ldcg(at + 1);
        }
        sq = warp_sum(sq), dot = warp_sum(dot);
        if (lane_id() == 0) alpha[u] = dot * inv_rms(sq, width, ctx.attr(0));
      }
      attn_res_softmax(n, values, alpha);
      if constexpr (kNorm) {
        if (k == 0) {
          for (int u = static_cast<int>(threadIdx.x); u < n * values; u += kThreads) weights[static_cast<int64_t>(t0) * values + u] = alpha[u];
        }
        for (int r = warp_id(); r < n; r += kWarps) {
          const float partial = attn_res_mix_sumsq(ctx, alpha + r * values, t0 + r, c0, c1);
          if (lane_id() == 0) squares[static_cast<int64_t>(t0 + r) * sch.chunks + k] = partial;
        }
        block_arrive(sync + 2);
      } else {
        attn_res_store<false>(ctx, t0, n, c0, c1, alpha, scale);
        __syncthreads();  // alpha is rewritten by the next item
      }
    } else {
      block_wait(sync + 2, items);
      for (int r = warp_id(); r < n; r += kWarps) {
        float total = 0.0f;
        for (int c = lane_id(); c < sch.chunks; c += 32) total += __ldcg(squares + static_cast<int64_t>(t0 + r) * sch.chunks + c);
        total = warp_sum(total);
        if (lane_id() == 0) scale[r] = inv_rms(total, width, ctx.attr(1));
      }
      for (int u = static_cast<int>(threadIdx.x); u < n * values; u += kThreads) alpha[u] = __ldcg(weights + static_cast<int64_t>(t0) * values + u);
      __syncthreads();
      attn_res_store<kNorm>(ctx, t0, n, c0, c1, alpha, scale);
      __syncthreads();
    }
  }
  op_leave(ctx, sync + 3);
}

__device__ __noinline__ void op_attn_res_mix(const TaskCtx& ctx) { attn_res_body<false>(ctx); }
__device__ __noinline__ void op_attn_res_norm(const TaskCtx& ctx) { attn_res_body<true>(ctx); }

}  // namespace plow::cuda
