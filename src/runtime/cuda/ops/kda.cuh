// KDA op bodies (spec/MODEL.md §4.2, §5; cpu: ops/kda.cpp): the causal short conv + SiLU over the conv
// window, the forget gate (both forms), and the gated delta rule: token by token for sequences of fewer
// than kKdaChunkedMinTokens tokens of the step, in the chunked form (§6, kda_chunked.cuh) for longer ones.
// The two forms agree to fp32 rounding (MODEL.md §6 derivation, tests/unit/kda_test.cpp).
// The KDA mixer's fused decode op (kda_fused_core) lives in kda_fused.cuh, over the staging here.
#pragma once

#include <type_traits>

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/limits.h"
#include "runtime/cuda/ops/norm.cuh"

namespace plow::cuda {

// Sequences of at least this many tokens of the step (prefill) run by rows, short_conv_silu_rows;
// shorter ones (decode) by columns, each output straight from the window and the input rows.
inline constexpr int kShortConvRowsMinTokens = 16;

// History position q of column c of the sequence whose first row is `first`: the conv window for
// q < keep, else input row first + q − keep rounded to x_act (TaskCtx::in_act: a prefill GEMM's
// unrounded output; the window holds rounded values).
__device__ __forceinline__ float conv_history(const float* window, Rows<const float> x, int32_t x_act, int first, int keep, int64_t q, int64_t c) {
  return q < keep ? window[c * keep + q] : round_act(x_act, x[first + q - keep][c]);
}

// Where the row share of task i of `tasks` starts among the step's `rows` rows: rows·i/tasks, moved
// down to a prefill sequence's first row where it would split the sequence's first keep rows (the ones
// that read its window), so that one task reads a sequence's window and writes its new one.
__device__ __forceinline__ int short_conv_row_bound(const StepView& step, int rows, int i, int tasks, int keep) {
  int b = static_cast<int>(static_cast<int64_t>(rows) * i / tasks);
  for (int s = 0; s < step.num_seqs; ++s) {
    const int first = step.seq_first_row[s], tokens = step.seq_tokens[s];
    if (tokens >= kShortConvRowsMinTokens && first < b && b < first + (keep < tokens ? keep : tokens)) b = first;
  }
  return b;
}

// Rows of column c in [lo, hi) of a prefill sequence for kernel K (compile time): the column's taps
// and its last K − 1 history values in registers, sliding down the rows; kRows rows' inputs loaded
// before their sums. One load, K FMAs, the SiLU and a store an output.
template <int K>
__device__ __forceinline__ void short_conv_column(const DeviceWeight& taps, Rows<const float> x, int32_t x_act, Rows<float> out, int32_t act, int first, int lo,
                                                  int hi, int64_t c, const float* window) {
  static_assert(K >= 2, "a history of at least one value");
  constexpr int keep = K - 1, kRows = 2 * kLoadBatch;
  float w[K], h[keep];
#pragma unroll
  for (int k = 0; k < K; ++k) w[k] = weight_flat(taps, c * K + k);
#pragma unroll
  for (int k = 0; k < keep; ++k) h[k] = conv_history(window, x, x_act, first, keep, lo - first + k, c);  // the window, else the rows before lo
  for (int t0 = lo; t0 < hi; t0 += kRows) {
    float v[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) v[i] = t0 + i < hi ? x[t0 + i][c] : 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) v[i] = round_act(x_act, v[i]);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if (t0 + i >= hi) break;
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < keep; ++k) sum += w[k] * h[k];
      sum += w[keep] * v[i];
      out[t0 + i][c] = round_act(act, siluf_(sum));
#pragma unroll
      for (int k = 0; k + 1 < keep; ++k) h[k] = h[k + 1];
      h[keep - 1] = v[i];
    }
  }
}

// Four adjacent columns c..c+3 of short_conv_column at once (c a multiple of 4, the rows 16-byte
// aligned): each row's four inputs one 16-byte load, the four outputs one store, kLoadBatch rows in
// flight; each column's sum term by term as short_conv_column's, so the same values. A thread a column
// moved 4 bytes an access: an 8K prompt's conv took 131 µs a launch on the H200, 40% of DRAM.
template <int K>
__device__ __forceinline__ void short_conv_column4(const DeviceWeight& taps, Rows<const float> x, int32_t x_act, Rows<float> out, int32_t act, int first,
                                                   int lo, int hi, int64_t c, const float* window) {
  static_assert(K >= 2, "a history of at least one value");
  constexpr int keep = K - 1, kRows = kLoadBatch;
  float w[4][K], h[4][keep];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int k = 0; k < K; ++k) w[j][k] = weight_flat(taps, (c + j) * K + k);
#pragma unroll
    for (int k = 0; k < keep; ++k) h[j][k] = conv_history(window, x, x_act, first, keep, lo - first + k, c + j);
  }
  for (int t0 = lo; t0 < hi; t0 += kRows) {
    float4 v[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) v[i] = t0 + i < hi ? load4f(x[t0 + i] + c) : float4{};
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if (t0 + i >= hi) break;
      const float in[4] = {round_act(x_act, v[i].x), round_act(x_act, v[i].y), round_act(x_act, v[i].z), round_act(x_act, v[i].w)};
      float o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < keep; ++k) sum += w[j][k] * h[j][k];
        sum += w[j][keep] * in[j];
        o[j] = round_act(act, siluf_(sum));
#pragma unroll
        for (int k = 0; k + 1 < keep; ++k) h[j][k] = h[j][k + 1];
        h[j][keep - 1] = in[j];
      }
      store4f(out[t0 + i] + c, float4{o[0], o[1], o[2], o[3]});
    }
  }
}

// The prefill sequences of the step by rows: each task a contiguous range of the step's rows, every
// column (as element_share: legal whatever the plan's slices say, since consumers and the op's
// overwriters wait for all of its tasks; the windows stay each sequence's own, read and rewritten by
// the one task holding its first keep rows, short_conv_row_bound). The same sum term by term as the
// column form (ascending taps from 0). K = 4 (Kimi Linear, K3): a thread per column, sliding down its
// rows (short_conv_column); other kernels: each output reads its K history values, kLoadBatch
// outputs in flight a thread. The column form this replaces gave each task ~31 columns of every row
// (124-byte pieces of 16 KB rows through a shared-memory tile): 27 ms of the 48B's 8K prompt on the
// H200; by rows with K loads an output, 42 ms (instruction-bound).
template <int K>
__device__ __forceinline__ void short_conv_silu_rows(const TaskCtx& ctx, const DeviceWeight& taps, int kernel_, Rows<const float> x, int32_t x_act,
                                                     Rows<float> out, int32_t act) {
  const int kernel = K > 0 ? K : kernel_;
  const StepView& step = *ctx.step;
  const int keep = kernel - 1, rows = ctx.rows(), tasks = static_cast<int>(ctx.op->tasks), task = static_cast<int>(ctx.task);
  const int64_t width = ctx.op->width;
  const int r0 = short_conv_row_bound(step, rows, task, tasks, keep), r1 = short_conv_row_bound(step, rows, task + 1, tasks, keep);
  for (int s = 0; s < step.num_seqs; ++s) {
    const int first = step.seq_first_row[s], tokens = step.seq_tokens[s];
    const int lo = r0 > first ? r0 : first, hi = r1 < first + tokens ? r1 : first + tokens;
    if (tokens < kShortConvRowsMinTokens || lo >= hi) continue;  // block-uniform
    float* window = state_of(ctx, step.seq_slot[s]);
    if constexpr (K > 0) {
      const uintptr_t bits = reinterpret_cast<uintptr_t>(x.base) | reinterpret_cast<uintptr_t>(out.base) | static_cast<uintptr_t>(x.stride * 4) |
                             static_cast<uintptr_t>(out.stride * 4) | static_cast<uintptr_t>(width * 4);
      if ((bits & 15) == 0) {
        for (int64_t c = 4 * static_cast<int64_t>(threadIdx.x); c < width; c += 4 * kThreads) {
          short_conv_column4<K>(taps, x, x_act, out, act, first, lo, hi, c, window);
        }
      } else {
        for (int64_t c = threadIdx.x; c < width; c += kThreads) short_conv_column<K>(taps, x, x_act, out, act, first, lo, hi, c, window);
      }
    } else {
      for_each_element(
          lo, hi, 0, static_cast<int>(width),
          [&](int t, int64_t c) {
            float sum = 0.0f;
            for (int k = 0; k < kernel; ++k) sum += weight_flat(taps, c * kernel + k) * conv_history(window, x, x_act, first, keep, t - first + k, c);
            return sum;
          },
          [&](int t, int64_t c, float sum) { out[t][c] = round_act(act, siluf_(sum)); });
    }
    if (r0 <= first) {  // the task holding the sequence's first rows: new window = history[tokens, tokens + keep)
      __syncthreads();  // every thread's reads of the old window first
      for (int64_t c = threadIdx.x; c < width; c += kThreads) {
        // Reads position tokens + j ≥ j + 1: not yet rewritten.
        for (int j = 0; j < keep; ++j) window[c * keep + j] = conv_history(window, x, x_act, first, keep, tokens + j, c);
      }
    }
  }
}

// kShortConvSilu: out[t,c] = act(SiLU(Σ_j C[c,0,j]·hist[t+j])), hist = window[c] ++ this step's inputs of
// channel c, per sequence. attrs: [0] kernel K. Weight C [P,1,K]. State: window [P, K−1] per slot,
// oldest column first (the last K−1 pre-conv inputs).
__device__ __noinline__ void op_short_conv_silu(const TaskCtx& ctx) {
  const DeviceWeight taps = ctx.weight(0);
  const int kernel = static_cast<int>(ctx.attr(0)), keep = kernel - 1;
  const int64_t cols = ctx.col_end - ctx.col_begin;
  const Rows<const float> x = ctx.in_rows(0);
  const Rows<float> out = ctx.out_rows();
  const int32_t act = ctx.out_act(), x_act = ctx.in_act(0);
  const StepView& step = *ctx.step;
  if (kernel == 4) {
    short_conv_silu_rows<4>(ctx, taps, kernel, x, x_act, out, act);
  } else {
    short_conv_silu_rows<0>(ctx, taps, kernel, x, x_act, out, act);
  }
  // Short sequences (decode), over the task's column slice: one pass over every (sequence, channel)
  // pair of the step, each thread its pairs' outputs and then their new windows. A pass per sequence
  // with a block barrier between its outputs and its window update waited two DRAM latencies a
  // sequence: 3.96 ms of a 28.6 ms batch-32 decode step on the H200. Only the pair's own thread reads
  // or writes its window, so no barrier: the outputs read the old window first; then new window =
  // history[tokens .. tokens + keep), ascending j reading position tokens + j ≥ j + 1, never an entry
  // already overwritten.
  const int64_t pairs = static_cast<int64_t>(step.num_seqs) * cols;
  for (int64_t i = threadIdx.x; i < pairs; i += kThreads) {
    const int s = static_cast<int>(i / cols);
    const int64_t c = ctx.col_begin + i % cols;
    const int first = step.seq_first_row[s], tokens = step.seq_tokens[s];
    if (tokens >= kShortConvRowsMinTokens) continue;
    float* window = state_of(ctx, step.seq_slot[s]);
    for (int t = 0; t < tokens; ++t) {
      float sum = 0.0f;
      for (int j = 0; j < kernel; ++j) sum += weight_flat(taps, c * kernel + j) * conv_history(window, x, x_act, first, keep, t + j, c);
      out[first + t][c] = round_act(act, siluf_(sum));
    }
    for (int j = 0; j < keep; ++j) window[c * keep + j] = conv_history(window, x, x_act, first, keep, tokens + j, c);
  }
}

// kKdaGate, fp32 output: g = kda_gate_value(f + dt_bias, A_log[h]) (device.cuh; K3: bounded, §7.5).
// attrs: [0] head_dim, [1] bounded (0/1), [2] lower_bound. Weights A_log [heads], dt_bias [P] (fp32
// in checkpoints).
// Over the task's element_share (four columns at a time in steps of many rows), f loaded in the batched
// loop's load phase, dt_bias (small, cached) as the value is computed; exp(A_log[h]) is taken
// once a head into shared memory (it was an expf an element beside softplus's expf and logf: an 8K
// prompt's [8,192, 4,096] gate took 364 µs a layer on the H200, 0.68 TB/s, the special-function unit
// its bound). The same values: expf of the same argument.
__device__ __noinline__ void op_kda_gate(const TaskCtx& ctx) {
  const DeviceWeight a_log = ctx.weight(0), dt_bias = ctx.weight(1);
  const auto d = static_cast<int>(ctx.attr(0));
  const bool bounded = ctx.attr(1) != 0.0f;
  const float lower_bound = ctx.attr(2);
  const int32_t act = ctx.out_act(), f_act = ctx.in_act(0);
  const Rows<const float> f = ctx.in_rows(0);
  const Rows<float> out = ctx.out_rows();
  const int64_t heads = (ctx.op->width + d - 1) / d;
  if (heads > kSharedBytes / static_cast<int64_t>(sizeof(float))) {  // no plan has that many heads; kept correct anyway
    for_each_share_element(
        ctx, [&](int t, int64_t c) { return Operands{round_act(f_act, f[t][c]) + weight_flat(dt_bias, c), weight_flat(a_log, static_cast<int>(c) / d)}; },
        [&](int t, int64_t c, Operands v) { out[t][c] = round_act(act, kda_gate_value(v.a, v.b, bounded, lower_bound)); });
    return;
  }
  float* rate = smem_floats(ctx);
  for (int64_t h = threadIdx.x; h < heads; h += kThreads) rate[h] = expf(weight_flat(a_log, h));
  __syncthreads();
  const auto one = [&](float fv, int64_t c) {
    return round_act(act, kda_gate_rate(round_act(f_act, fv) + weight_flat(dt_bias, c), rate[static_cast<int>(c) / d], bounded, lower_bound));
  };
  const Rows<const float> rows[2] = {{out.base, out.stride}, f};
  for_each_share_element4(
      ctx, rows, [&](int t, int64_t c) { return load4f(f[t] + c); },
      [&](int t, int64_t c, float4 v) { store4f(out[t] + c, float4{one(v.x, c), one(v.y, c + 1), one(v.z, c + 2), one(v.w, c + 3)}); },
      [&](int t, int64_t c) { return f[t][c]; }, [&](int t, int64_t c, float v) { out[t][c] = one(v, c); });
}

// The delta rule for one head over the tokens of one sequence, state on chip, one pass per group of at
// most kCols value columns (the plan slices this op by such groups: slice_granularity, kHeadColumns;
// each value column of the state evolves on its own). D (16, 32, 64, 128) is the head dim rounded up;
// padded rows/columns hold zeros and are never stored. Thread layout: thread tid owns the pass's value
// column c = tid / kPerCol and the kRows key rows j = r + kPerCol·i (r = tid mod kPerCol); the kPerCol
// threads of a column are adjacent lanes, so Σ_j reductions are xor shuffles. Threads past kCols·kPerCol
// (D = 16) idle.
template <int D>
struct KdaLayout {
  static constexpr int kCols = D < 32 ? D : 32;      // value columns per pass (kHeadColumnGroup)
  static constexpr int kPerCol = D < 16 ? D : 16;    // threads per value column
  static constexpr int kRows = D / kPerCol;          // state rows per thread
  // Tokens staged per tile in shared memory: q̂, k̂, exp(g), v [D] each and β.
  static constexpr int kTile = (kSharedBytes / 4) / (4 * D + 1) < 64 ? (kSharedBytes / 4) / (4 * D + 1) : 64;
  static_assert(kPerCol <= 32 && 32 % kPerCol == 0, "a column's threads must share a warp");
  static_assert(kCols * kPerCol <= kThreads && kCols * kPerCol % 32 == 0, "a pass's columns take whole warps of the block");
};

}  // namespace plow::cuda

#include "runtime/cuda/ops/kda_chunked.cuh"  // uses KdaLayout

namespace plow::cuda {

// Stages tokens [t0, t0 + n) of head h (rows first + t): q̂ = l2n(q)/√d, k̂ = l2n(k) (ε = 1e−6 on the
// SUM, inside the root; divide then scale as the CPU), exp(g), v, β. One warp per (token, q|k) norm,
// a lane's D/32 elements loaded together and kept in registers (a loop bounded by d at run time
// waited an L2 latency per element while the other warps waited at the barrier below: 22% of a
// decode launch's warp samples at that barrier, ncu); lane l sums l, l + 32, … in order as before.
template <int D>
__device__ void kda_stage(const TaskCtx& ctx, int first, int t0, int n, int64_t h, int64_t d, float* sq, float* sk, float* sdecay, float* sv,
                          float* sbeta) {
  constexpr int kPerLane = D >= 32 ? D / 32 : 1;
  const float q_scale = 1.0f / sqrtf(static_cast<float>(d));
  const int lane = lane_id();
  for (int u = warp_id(); u < 2 * n; u += kWarps) {
    const int t = u / 2, which = u % 2;  // 0: q, 1: k
    const float* x = ctx.in(which, first + t0 + t) + h * d;
    float v[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v[i] = lane + 32 * i < d ? x[lane + 32 * i] : 0.0f;
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (lane + 32 * i < d) sum += v[i] * v[i];
    }
    const float norm = sqrtf(warp_sum(sum) + 1e-6f);
    const float scale = which == 0 ? q_scale : 1.0f;
    float* dst = (which == 0 ? sq : sk) + t * D;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int j = lane + 32 * i;
      if (j < D) dst[j] = j < d ? v[i] / norm * scale : 0.0f;
    }
  }
  for (int i = static_cast<int>(threadIdx.x); i < n * D; i += kThreads) {
    const int t = i / D, j = i % D;
    const int row = first + t0 + t;
    sdecay[i] = j < d ? expf(ctx.in(3, row)[h * d + j]) : 1.0f;
    sv[i] = j < d ? ctx.in(2, row)[h * d + j] : 0.0f;
  }
  for (int t = static_cast<int>(threadIdx.x); t < n; t += kThreads) sbeta[t] = ctx.in(4, first + t0 + t)[h];
  __syncthreads();
}

// Staged tokens [ta, tb) of the tile (tile token t is step row row0 + t) of one sequence, token by token
// (§4.2 K6), for value columns [c0, c0 + cols), state S in registers (KdaLayout). Block-uniform; no
// barrier (warps past kCols·kPerCol threads idle).
template <int D>
__device__ __forceinline__ void kda_tokens(const TaskCtx& ctx, int row0, int ta, int tb, int64_t h, int64_t d, int c0, int cols,
                                           float (&S)[KdaLayout<D>::kRows]) {
  using L = KdaLayout<D>;
  const int tid = static_cast<int>(threadIdx.x);
  const int c = tid / L::kPerCol, r = tid % L::kPerCol;
  if (c >= L::kCols) return;  // whole warps
  const float* sq = smem_floats(ctx);
  const float* sk = sq + L::kTile * D;
  const float* sdecay = sk + L::kTile * D;
  const float* sv = sdecay + L::kTile * D;
  const float* sbeta = sv + L::kTile * D;
  for (int t = ta; t < tb; ++t) {
    const float* q = sq + t * D;
    const float* k = sk + t * D;
    const float* decay = sdecay + t * D;
    // S ← diag(exp g)·S; prediction Sᵀk with the decayed S (§4.2 K6, §9.8).
    float predicted = 0.0f;
#pragma unroll
    for (int i = 0; i < L::kRows; ++i) {
      const int j = r + L::kPerCol * i;
      S[i] *= decay[j];
      predicted += S[i] * k[j];
    }
    for (int o = 1; o < L::kPerCol; o <<= 1) predicted += __shfl_xor_sync(0xffffffffu, predicted, o);
    const float error = ((c < cols ? sv[t * D + c0 + c] : 0.0f) - predicted) * sbeta[t];
    // S ← S + k ⊗ β·e; o = Sᵀq reads the updated S.
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < L::kRows; ++i) {
      const int j = r + L::kPerCol * i;
      S[i] += k[j] * error;
      out += S[i] * q[j];
    }
    for (int o = 1; o < L::kPerCol; o <<= 1) out += __shfl_xor_sync(0xffffffffu, out, o);
    if (r == 0 && c < cols) ctx.out(row0 + t)[h * d + c0 + c] = round_out(ctx, out);
  }
}

// Value columns [c0, c0 + cols) of head h for every sequence of fewer than kKdaChunkedMinTokens tokens
// (decode), state S in registers (KdaLayout<D>). Runs of consecutive such sequences (contiguous rows,
// at most kTile of them) are staged together, one kda_stage for the run; then each sequence in turn
// loads its state slice, runs its tokens and stores the slice back, the next one's slice already
// loading meanwhile. Staging each sequence alone waited its loads and a barrier per sequence: at batch
// 32 the op took 283 µs a layer on the H200 (5.5 ms of a 25 ms step), stalled first on that barrier
// (ncu). Not inlined, so its register allocation is not shared with the chunked path's temporaries.
template <int D>
__device__ __noinline__ void kda_short_seqs(const TaskCtx& ctx, int64_t h, int64_t d, int c0, int cols) {
  using L = KdaLayout<D>;
  const StepView& step = *ctx.step;
  const int tid = static_cast<int>(threadIdx.x);
  const int c = tid / L::kPerCol, r = tid % L::kPerCol;
  const bool active = c < cols;
  float* sq = smem_floats(ctx);
  float* sk = sq + L::kTile * D;
  float* sdecay = sk + L::kTile * D;
  float* sv = sdecay + L::kTile * D;
  float* sbeta = sv + L::kTile * D;
  auto is_short = [&](int s) { return step.seq_tokens[s] < kKdaChunkedMinTokens; };
  auto next_short = [&](int s) {
    while (s < step.num_seqs && !is_short(s)) ++s;
    return s;
  };
  auto state = [&](int s) { return state_of(ctx, step.seq_slot[s]) + h * d * d; };  // [d, d]: S[j][c]
  auto load = [&](int s, float (&S)[L::kRows]) {
    const float* S_global = state(s);
#pragma unroll
    for (int i = 0; i < L::kRows; ++i) {
      const int j = r + L::kPerCol * i;
      S[i] = active && j < d ? S_global[j * d + c0 + c] : 0.0f;
    }
  };
  static_assert(kKdaChunkedMinTokens - 1 <= L::kTile, "a short sequence fits one staged tile");
  int s = next_short(0);
  float S[L::kRows] = {};
  if (s < step.num_seqs) load(s, S);
  while (s < step.num_seqs) {
    // The run: short sequences s .. e−1, rows [row0, row0 + n).
    const int row0 = step.seq_first_row[s];
    int e = s, n = 0;
    while (e < step.num_seqs && is_short(e) && n + step.seq_tokens[e] <= L::kTile) n += step.seq_tokens[e++];
    kda_stage<D>(ctx, row0, 0, n, h, d, sq, sk, sdecay, sv, sbeta);  // ends with a barrier
    for (int q = s; q < e; ++q) {
      const int next = q + 1 < e ? q + 1 : next_short(e);
      float S_next[L::kRows] = {};
      if (next < step.num_seqs) load(next, S_next);  // consumed after this sequence: in flight meanwhile
      const int ta = step.seq_first_row[q] - row0;
      kda_tokens<D>(ctx, row0, ta, ta + step.seq_tokens[q], h, d, c0, cols, S);
      float* S_global = state(q);
#pragma unroll
      for (int i = 0; i < L::kRows; ++i) {
        const int j = r + L::kPerCol * i;
        if (active && j < d) S_global[j * d + c0 + c] = S[i];
        S[i] = S_next[i];
      }
    }
    __syncthreads();  // the staged tile is overwritten next
    s = next_short(e);
  }
}

// Sequences of at least kKdaChunkedMinTokens tokens in the step run chunked: first every task takes
// prep items (kda_chunked.cuh), then each walks its slices; shorter ones run token by token. Every task
// of the op runs the prep phase and counts itself out (sync[2]) when the step has chunked sequences.
template <int D>
__device__ __noinline__ void kda_delta_rule(const TaskCtx& ctx) {
  const auto d = static_cast<int64_t>(ctx.attr(0));
  const int heads = static_cast<int>(ctx.op->width / d);
  const StepView& step = *ctx.step;
  const int chunks = kda_chunks(step, step.num_seqs);
  if (chunks > 0 && !kda_prep_all<D>(ctx, d, heads, chunks)) return;
  // The slice's heads and their groups of at most kCols value columns: fn(h, c0, cols).
  auto for_each_group = [&](auto fn) {
    for (int64_t h = ctx.col_begin / d; h * d < ctx.col_end; ++h) {  // the heads the slice touches
      const int64_t begin = ctx.col_begin - h * d > 0 ? ctx.col_begin - h * d : 0;
      const int64_t end = ctx.col_end - h * d < d ? ctx.col_end - h * d : d;
      for (int64_t c0 = begin; c0 < end; c0 += KdaLayout<D>::kCols) {
        fn(h, static_cast<int>(c0), static_cast<int>(end - c0 < KdaLayout<D>::kCols ? end - c0 : KdaLayout<D>::kCols));
      }
    }
  };
  int chunk_base = 0;  // the sequence's first chunk among the step's
  for (int s = 0; s < step.num_seqs; ++s) {
    const int first = step.seq_first_row[s], tokens = step.seq_tokens[s];
    if (tokens < kKdaChunkedMinTokens) continue;  // below, with the other short sequences
    float* state = state_of(ctx, step.seq_slot[s]);  // [heads, d, d]: S[j][c] = row key j, column value c
    for_each_group([&](int64_t h, int c0, int cols) {
      const float* records = ctx.op->workspace + (static_cast<int64_t>(chunk_base) * heads + h) * KdaRecord<D>::kFloats;
      kda_scan<D>(ctx, records, heads, first, tokens, h, d, c0, cols, state + h * d * d);
    });
    chunk_base += (tokens + kKdaChunk - 1) / kKdaChunk;
  }
  for_each_group([&](int64_t h, int c0, int cols) { kda_short_seqs<D>(ctx, h, d, c0, cols); });
  if (chunks > 0) op_leave(ctx, ctx.op->sync + 2);
}

// fn(std::integral_constant<int, D>) for the op's head dim (attr 0) rounded up to 16, 32, 64 or 128, the
// bodies' instantiations; a larger one reports kErrOpcode (pack_misc_attrs refuses it on the host).
template <typename Fn>
__device__ __forceinline__ void by_head_dim(const TaskCtx& ctx, Fn fn) {
  static_assert(kKdaMaxHeadDim == 128, "the largest instantiation below");
  const int d = static_cast<int>(ctx.attr(0));
  if (d <= 16) {
    fn(std::integral_constant<int, 16>{});
  } else if (d <= 32) {
    fn(std::integral_constant<int, 32>{});
  } else if (d <= 64) {
    fn(std::integral_constant<int, 64>{});
  } else if (d <= kKdaMaxHeadDim) {
    fn(std::integral_constant<int, 128>{});
  } else if (threadIdx.x == 0) {
    report_error(ctx, kErrOpcode);
  }
}

// kKdaDeltaRule (head columns): q, k, v [T, P] (act), g [T, P] fp32 log-decay, β [T, heads] fp32 → o [T, P].
// attrs: [0] head_dim (≤ 128; pack_misc_attrs refuses larger). State fp32 [heads, d, d] per slot.
__device__ __noinline__ void op_kda_delta_rule(const TaskCtx& ctx) {
  by_head_dim(ctx, [&](auto padded) { kda_delta_rule<decltype(padded)::value>(ctx); });
}

}  // namespace plow::cuda
