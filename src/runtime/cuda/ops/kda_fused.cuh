// The KDA mixer's core in one op (kKdaFusedCore; op_table.h; cpu: cpu_kda_fused_core): the convs, the
// gate with its f_b projection, β, the delta rule and (with a sixth input) the gated output norm, a
// task per (sequence, head) pair, or a part of a one-token pair's value columns. Split from kda.cuh,
// whose staging (KdaLayout, kda_tokens, conv_history, by_head_dim) it reuses; one-token pairs (decode)
// take their own paths below.
#pragma once

#include "runtime/cuda/ops/kda.cuh"

namespace plow::cuda {

// ---- kKdaFusedCore: the KDA mixer's core in one op (op_table.h; cpu: cpu_kda_fused_core) ----------------

// The slot's buffer of state `id` of the step's state table (kda_fused_core's conv windows, attrs).
__device__ __forceinline__ float* state_by_id(const TaskCtx& ctx, int id, int slot) {
  const DeviceState& state = ctx.step->states[id];
  return static_cast<float*>(state.base) + static_cast<int64_t>(slot) * state.slot_elems;
}

// Σ_c W[h·d + j][c]·x[c] for the rows j ∈ [0, d) of head h, W = weight `wi`, x = input `in` of step row
// `row` (rounded to its in_act as loaded); emit(j, dot) from lane 0 of the warp owning row j. A warp takes
// rows j = warp + kWarps·i, its lanes four columns of x at a time (bf16 rows: one 8-byte load a row),
// x loaded once for all of its rows: the f_b projection of the gate, g_b of the output gate.
template <int D, class Emit>
__device__ __forceinline__ void head_rows_dot(const TaskCtx& ctx, int wi, int in, int64_t row, int64_t h, int d, Emit emit) {
  constexpr int kRowsPerWarp = (D + kWarps - 1) / kWarps;
  const DeviceWeight& w = ctx.weight(wi);
  const int64_t n = ctx.in_width(in);
  const float* x = ctx.in(in, row);
  const int32_t x_act = ctx.in_act(in);
  const int lane = lane_id(), warp = warp_id();
  float acc[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) acc[i] = 0.0f;
  if (w.type == kWBF16 && n % 4 == 0) {
    const auto* rows = reinterpret_cast<const __nv_bfloat16*>(w.data) + h * d * n;
    for (int64_t c = 4 * lane; c < n; c += 128) {
      const float x0 = round_act(x_act, x[c]), x1 = round_act(x_act, x[c + 1]), x2 = round_act(x_act, x[c + 2]), x3 = round_act(x_act, x[c + 3]);
      uint2 raw[kRowsPerWarp];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int j = warp + kWarps * i;
        raw[i] = j < d ? *reinterpret_cast<const uint2*>(rows + j * n + c) : uint2{0, 0};
      }
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        acc[i] += __uint_as_float(raw[i].x << 16) * x0;
        acc[i] += __uint_as_float(raw[i].x & 0xffff0000u) * x1;
        acc[i] += __uint_as_float(raw[i].y << 16) * x2;
        acc[i] += __uint_as_float(raw[i].y & 0xffff0000u) * x3;
      }
    }
  } else {
    for (int64_t c = lane; c < n; c += 32) {
      const float xc = round_act(x_act, x[c]);
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int j = warp + kWarps * i;
        if (j < d) acc[i] += weight_at(w, 0, h * d + j, c) * xc;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const float dot = warp_sum(acc[i]);
    const int j = warp + kWarps * i;
    if (lane == 0 && j < d) emit(j, dot);
  }
}

// Conv + SiLU of one channel for tokens [t0, t0 + n) of a sequence (history position t0 + t + k of
// token t, kernel K at compile time): its taps and the K − 1 history values before the first token
// loaded together, then sliding down the tokens; outputs at dst[t·D]. The same sum term by term as
// op_short_conv_silu's (ascending taps from 0).
template <int K, int D>
__device__ __forceinline__ void fused_conv_channel(const DeviceWeight& taps, Rows<const float> x, int32_t x_act, int32_t act, const float* window,
                                                   int first, int t0, int n, int64_t channel, float* dst) {
  constexpr int keep = K - 1;
  float w[K], hist[keep];
#pragma unroll
  for (int k = 0; k < K; ++k) w[k] = weight_flat(taps, channel * K + k);
#pragma unroll
  for (int k = 0; k < keep; ++k) hist[k] = conv_history(window, x, x_act, first, keep, t0 + k, channel);
  for (int t = 0; t < n; ++t) {
    const float v = round_act(x_act, x[first + t0 + t][channel]);  // history position t0 + t + keep
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < keep; ++k) sum += w[k] * hist[k];
    sum += w[keep] * v;
    dst[t * D] = round_act(act, siluf_(sum));
#pragma unroll
    for (int k = 0; k + 1 < keep; ++k) hist[k] = hist[k + 1];
    hist[keep - 1] = v;
  }
}

// A warp's l2 normalization of a staged row of d ≤ D values in place, times `scale` (kda_stage's
// arithmetic: ε = 1e−6 on the sum inside the root, divide then scale; lane l sums l, l + 32, … in order).
template <int D>
__device__ __forceinline__ void normalize_row(float* row, int d, float scale) {
  constexpr int kPerLane = D >= 32 ? D / 32 : 1;
  const int lane = lane_id();
  float v[kPerLane];
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) v[i] = lane + 32 * i < d ? row[lane + 32 * i] : 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (lane + 32 * i < d) sum += v[i] * v[i];
  }
  const float norm = sqrtf(warp_sum(sum) + 1e-6f);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (lane + 32 * i < d) row[lane + 32 * i] = v[i] / norm * scale;
  }
}

// One (sequence, head) pair: tiles of at most kTile tokens staged as kda_stage stages them (the convs of
// the head's q/k/v channels from their windows and input rows, q and k then normalized in place, exp of
// the gate, β), the delta rule over every value group of the head with the tile's tokens, then the
// head's new conv windows. A thread owns a (conv, channel) pair throughout: it reads the old window
// while staging and writes the new one last, and no other task touches this sequence's channels of h.
template <int D>
__device__ void fused_core_pair(const TaskCtx& ctx, int s, int64_t h, int d) {
  using L = KdaLayout<D>;
  const StepView& step = *ctx.step;
  const int first = step.seq_first_row[s], tokens = step.seq_tokens[s], slot = step.seq_slot[s];
  const int kernel = static_cast<int>(ctx.attr(3)), keep = kernel - 1;
  const int32_t act = ctx.op->act;
  const int tid = static_cast<int>(threadIdx.x);
  float* sq = smem_floats(ctx);
  float* sk = sq + L::kTile * D;
  float* sdecay = sk + L::kTile * D;
  float* sv = sdecay + L::kTile * D;
  float* sbeta = sv + L::kTile * D;
  float* windows[3];
  for (int i = 0; i < 3; ++i) windows[i] = state_by_id(ctx, static_cast<int>(ctx.attr(4 + i)), slot);
  float* S_base = state_of(ctx, slot) + h * d * d;  // [d, d]: S[j][c]
  const int c = tid / L::kPerCol, r = tid % L::kPerCol;
  for (int t0 = 0; t0 < tokens; t0 += L::kTile) {
    const int n = tokens - t0 < L::kTile ? tokens - t0 : L::kTile;
    // The convs: q and k raw (normalized below), v final; padded channels zero.
    for (int u = tid; u < 3 * D; u += kThreads) {
      const int which = u / D, j = u % D;
      float* dst = which == 0 ? sq : which == 1 ? sk : sv;
      if (j >= d) {
        for (int t = 0; t < n; ++t) dst[t * D + j] = 0.0f;
        continue;
      }
      const int64_t channel = h * d + j;
      const DeviceWeight& taps = ctx.weight(which);
      const Rows<const float> x = ctx.in_rows(which);
      const int32_t x_act = ctx.in_act(which);
      if (kernel == 4) {  // Kimi Linear, K3
        fused_conv_channel<4, D>(taps, x, x_act, act, windows[which], first, t0, n, channel, dst + j);
        continue;
      }
      for (int t = 0; t < n; ++t) {
        float sum = 0.0f;
        for (int k = 0; k < kernel; ++k) sum += weight_flat(taps, channel * kernel + k) * conv_history(windows[which], x, x_act, first, keep, t0 + t + k, channel);
        dst[t * D + j] = round_act(act, siluf_(sum));
      }
    }
    for (int t = tid; t < n; t += kThreads) sbeta[t] = sigmoidf_(round_act(ctx.in_act(4), ctx.in(4, first + t0 + t)[h]));
    // The gate: z = round(f·W_fbᵀ) + dt_bias, g as kda_gate, staged as exp(g) (kda_stage).
    const float rate = expf(weight_flat(ctx.weight(4), h));
    const bool bounded = ctx.attr(1) != 0.0f;
    const float lower_bound = ctx.attr(2);
    for (int t = 0; t < n; ++t) {
      head_rows_dot<D>(ctx, 3, 3, first + t0 + t, h, d, [&](int j, float dot) {
        sdecay[t * D + j] = expf(kda_gate_rate(round_act(act, dot) + weight_flat(ctx.weight(5), h * d + j), rate, bounded, lower_bound));
      });
      for (int j = d + tid; j < D; j += kThreads) sdecay[t * D + j] = 1.0f;
    }
    __syncthreads();
    // q̂ = l2n(q)/√d, k̂ = l2n(k) in place, a warp a (token, q|k) row.
    {
      const float q_scale = 1.0f / sqrtf(static_cast<float>(d));
      for (int u = warp_id(); u < 2 * n; u += kWarps) normalize_row<D>((u % 2 == 0 ? sq : sk) + (u / 2) * D, d, u % 2 == 0 ? q_scale : 1.0f);
    }
    __syncthreads();
    // Every value group of the head over the tile; the next group's state slice loads meanwhile.
    auto load = [&](int c0, float (&S)[L::kRows]) {
#pragma unroll
      for (int i = 0; i < L::kRows; ++i) {
        const int j = r + L::kPerCol * i;
        S[i] = c < L::kCols && c0 + c < d && j < d ? S_base[j * d + c0 + c] : 0.0f;
      }
    };
    float S[L::kRows];
    load(0, S);
    for (int c0 = 0; c0 < d; c0 += L::kCols) {
      const int cols = d - c0 < L::kCols ? d - c0 : L::kCols;
      float S_next[L::kRows] = {};
      if (c0 + L::kCols < d) load(c0 + L::kCols, S_next);
      kda_tokens<D>(ctx, first + t0, 0, n, h, d, c0, cols, S);
#pragma unroll
      for (int i = 0; i < L::kRows; ++i) {
        const int j = r + L::kPerCol * i;
        if (c < cols && j < d) S_base[j * d + c0 + c] = S[i];
        S[i] = S_next[i];
      }
    }
    __syncthreads();  // the staged tile is overwritten next (and the tile's outputs are all written)
    if (ctx.op->num_inputs == 6) {
      // The output norm over the tile's outputs in place (rounded as the core's, gated_rms_norm's
      // arithmetic): z = round(g·W_gbᵀ) staged where exp(g) was, then a unit a token.
      for (int t = 0; t < n; ++t) head_rows_dot<D>(ctx, 6, 5, first + t0 + t, h, d, [&](int j, float dot) { sdecay[t * D + j] = round_act(act, dot); });
      __syncthreads();
      gated_norm_units(ctx.weight(7), d, ctx.attr(7), ctx.out_act(), kAF32, kAF32, n, [&](int64_t u) {
        float* o = ctx.out(first + t0 + u) + h * d;
        return GatedUnit{o, sdecay + u * D, o};
      });
      __syncthreads();
    }
  }
  // New windows = history[tokens, tokens + keep), by the thread that read the old ones (ascending i
  // reads position tokens + i ≥ i + 1, never an entry already rewritten).
  for (int u = tid; u < 3 * D; u += kThreads) {
    const int which = u / D, j = u % D;
    if (j >= d) continue;
    const int64_t channel = h * d + j;
    const Rows<const float> x = ctx.in_rows(which);
    for (int i = 0; i < keep; ++i) windows[which][channel * keep + i] = conv_history(windows[which], x, ctx.in_act(which), first, keep, tokens + i, channel);
  }
}

// ---- kda_fused_core's one-token pairs (decode) ------------------------------------------------------

// Eight bf16 weights (one 16-byte load) times x[0..8) into acc, x rounded to x_act as loaded (kRound;
// without it x is used as it is: an input whose values are already rounded, TaskCtx::in_act kAF32).
template <bool kRound>
__device__ __forceinline__ void dot8_bf16(float& acc, uint4 raw, const float* x, int32_t x_act) {
  const float4 lo = load4f(x), hi = load4f(x + 4);
  const float xs[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    acc += __uint_as_float(words[e] << 16) * (kRound ? round_act(x_act, xs[2 * e]) : xs[2 * e]);
    acc += __uint_as_float(words[e] & 0xffff0000u) * (kRound ? round_act(x_act, xs[2 * e + 1]) : xs[2 * e + 1]);
  }
}

// Projections of the pair's head, kJobs at once: Σ_c W_k[h·d + j][c]·x_k[c] for the rows j < d of head
// h, W_k = weight wi[k], x_k = input in[k] of step row `row` (rounded to its in_act as loaded).
// kThreads / D adjacent threads a row, each a strided share of the row's columns (bf16 rows: eight
// columns a 16-byte load, the first kBatch loads of every job in flight together), then an
// xor-shuffle sum over the row's threads; emit(k, j, dot) from the row's first thread. head_rows_dot
// gave a warp D / kWarps rows and lane 0 each row's reduction and epilogue in turn (eight of each at
// D = 128), one projection after the other.
template <int D, int kJobs, class Emit>
__device__ __forceinline__ void head_rows_dots(const TaskCtx& ctx, const int (&wi)[kJobs], const int (&in)[kJobs], int64_t row, int64_t h, int d, Emit emit) {
  constexpr int kLanes = kThreads / D, kBatch = 4;
  static_assert(kLanes <= 32 && 32 % kLanes == 0, "a row's threads share a warp");
  const int tid = static_cast<int>(threadIdx.x), j = tid / kLanes, q = tid % kLanes;
  const bool live = j < d;
  const float* x[kJobs];
  const uint4* wrow[kJobs];
  int chunks[kJobs];  // 16-byte units of a row; 0: the scalar path
  int32_t x_act[kJobs];
  float acc[kJobs];
  uint4 raw[kJobs][kBatch];
#pragma unroll
  for (int k = 0; k < kJobs; ++k) {
    const DeviceWeight& w = ctx.weight(wi[k]);
    const int n = static_cast<int>(ctx.in_width(in[k]));
    x[k] = ctx.in(in[k], row);
    x_act[k] = ctx.in_act(in[k]);
    const bool vec = w.type == kWBF16 && n % 8 == 0 && ((reinterpret_cast<uintptr_t>(w.data) | reinterpret_cast<uintptr_t>(x[k])) & 15) == 0;
    chunks[k] = vec ? n / 8 : 0;
    wrow[k] = reinterpret_cast<const uint4*>(w.data) + (vec && live ? (static_cast<int>(h) * d + j) * (n / 8) : 0);
    acc[k] = 0.0f;
  }
#pragma unroll
  for (int k = 0; k < kJobs; ++k) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) raw[k][b] = live && q + kLanes * b < chunks[k] ? wrow[k][q + kLanes * b] : uint4{0, 0, 0, 0};
  }
#pragma unroll
  for (int k = 0; k < kJobs; ++k) {
    if (!live) continue;
    const bool round = x_act[k] != kAF32;
    for (int m0 = q;; m0 += kLanes * kBatch) {
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int m = m0 + kLanes * b;
        if (m >= chunks[k]) break;
        if (round) {
          dot8_bf16<true>(acc[k], raw[k][b], x[k] + 8 * m, x_act[k]);
        } else {
          dot8_bf16<false>(acc[k], raw[k][b], x[k] + 8 * m, x_act[k]);
        }
      }
      if (m0 + kLanes * kBatch >= chunks[k]) break;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int m = m0 + kLanes * (kBatch + b);
        raw[k][b] = m < chunks[k] ? wrow[k][m] : uint4{0, 0, 0, 0};
      }
    }
    if (chunks[k] == 0) {  // other dtypes, widths or alignments
      const DeviceWeight& w = ctx.weight(wi[k]);
      const int n = static_cast<int>(ctx.in_width(in[k]));
      for (int c = q; c < n; c += kLanes) acc[k] += weight_at(w, 0, h * d + j, c) * round_act(x_act[k], x[k][c]);
    }
  }
#pragma unroll
  for (int k = 0; k < kJobs; ++k) {
    for (int o = 1; o < kLanes; o <<= 1) acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], o);
    if (q == 0 && live) emit(k, j, acc[k]);
  }
}

// A conv window of `keep` values after a one-token step: the oldest value out, the token's `v` in.
__device__ __forceinline__ void push_window(float* win, int keep, float v) {
  for (int k = 0; k + 1 < keep; ++k) win[k] = win[k + 1];
  if (keep > 0) win[keep - 1] = v;
}

// Conv + SiLU of one channel for a one-token step (its window's K − 1 values, then the token's input):
// the same sum term by term as fused_conv_channel. The new window (the last K − 1 of those values) is
// written back at once, this thread being the channel's only reader in the step; not with
// !write_window (a split pair's q and k channels, which every part reads: fused_core_token_part).
__device__ __forceinline__ float conv_one_token(const DeviceWeight& taps, int kernel, const float* x, int32_t x_act, int32_t act, float* window,
                                                int64_t channel, bool write_window = true) {
  const int keep = kernel - 1;
  float* win = window + channel * keep;
  const float v = round_act(x_act, x[channel]);
  float sum = 0.0f;
  if (kernel == 4) {  // Kimi Linear, K3
    float w[4], hist[3];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = weight_flat(taps, channel * 4 + k);
#pragma unroll
    for (int k = 0; k < 3; ++k) hist[k] = win[k];
#pragma unroll
    for (int k = 0; k < 3; ++k) sum += w[k] * hist[k];
    sum += w[3] * v;
    if (write_window) {
      win[0] = hist[1];
      win[1] = hist[2];
      win[2] = v;
    }
  } else {
    for (int k = 0; k < keep; ++k) sum += weight_flat(taps, channel * kernel + k) * win[k];
    sum += weight_flat(taps, channel * kernel + keep) * v;
    if (write_window) push_window(win, keep, v);
  }
  return round_act(act, siluf_(sum));
}

// A one-token pair's gates over the head's rows j < d: exp(g) into sdecay[j], g = kda_gate_rate of
// round(f·W_fbᵀ) + dt_bias; with the output norm, the output gate's z = round(g·W_gbᵀ) into sz[j] in
// the same pass (head_rows_dots).
template <int D>
__device__ __forceinline__ void stage_token_gates(const TaskCtx& ctx, int first, int64_t h, int d, bool norm, float* sdecay, float* sz) {
  const int32_t act = ctx.op->act;
  const float rate = expf(weight_flat(ctx.weight(4), h));
  const bool bounded = ctx.attr(1) != 0.0f;
  const float lower_bound = ctx.attr(2);
  const DeviceWeight& dt_bias = ctx.weight(5);
  const auto emit = [&](int k, int j, float dot) {
    if (k == 0) {
      sdecay[j] = expf(kda_gate_rate(round_act(act, dot) + weight_flat(dt_bias, h * d + j), rate, bounded, lower_bound));
    } else {
      sz[j] = round_act(act, dot);
    }
  };
  if (norm) {
    head_rows_dots<D, 2>(ctx, {3, 6}, {3, 5}, first, h, d, emit);
  } else {
    head_rows_dots<D, 1>(ctx, {3}, {3}, first, h, d, emit);
  }
}

// Shared memory of fused_core_token: the head's state [D][kStride] (rows padded so that a warp's reads
// in the delta rule fall in distinct banks), then q, k, v, exp(g), z and o [D] each.
template <int D>
struct KdaTokenLayout {
  static constexpr int kPerCol = kThreads / D;             // threads a value column (4 at D = 128)
  static constexpr int kRows = D / kPerCol;                // state rows a thread (32 at D = 128)
  static constexpr int kStride = D + (32 / kPerCol > 4 ? 32 / kPerCol : 4);
  static constexpr int kState = D * kStride;
  static constexpr int kFloats = kState + 6 * D;
  static_assert(kPerCol <= 32 && 32 % kPerCol == 0 && kRows >= 1, "a column's threads share a warp");
  static_assert(kStride % 4 == 0, "16-byte rows for cp.async");
  static_assert(kFloats * 4 <= kSharedBytes, "the head's state fits shared memory");
};

// One (sequence, head) pair whose sequence brings one token to the step (decode), D ≥ 32. The task's
// loads are issued together where they do not depend on each other: the head's state [d, d] by
// cp.async into shared memory as the pair starts, the convs (a thread a (conv, channel): window, taps,
// input; its new window stored at once), the gate's and the output gate's projections (kThreads / D
// threads a row); then q̂, k̂ (a warp each, kda_stage's arithmetic), and the delta rule over every value
// column at once from shared memory (kPerCol threads a column, kRows state rows each: S ← diag(e^g)S,
// e = β(v − Sᵀk̂), S ← S + k̂eᵀ, o = Sᵀq̂; the new state straight to global memory), then the gated norm
// (one warp). The general path (fused_core_pair) stages tiles of tokens and walks the value columns in
// four passes, each waiting for its state slice; it took ~38 µs a pair on an H100.
template <int D>
__device__ __noinline__ void fused_core_token(const TaskCtx& ctx, int s, int64_t h, int d) {
  using L = KdaTokenLayout<D>;
  const StepView& step = *ctx.step;
  const int first = step.seq_first_row[s], slot = step.seq_slot[s];
  const int kernel = static_cast<int>(ctx.attr(3));
  const int32_t act = ctx.op->act;
  const int tid = static_cast<int>(threadIdx.x);
  float* sS = smem_floats(ctx);
  float* sq = sS + L::kState;
  float* sk = sq + D;
  float* sv = sk + D;
  float* sdecay = sv + D;
  float* sz = sdecay + D;
  float* so = sz + D;
  float* S_base = state_of(ctx, slot) + h * d * d;  // [d, d]: S[j][c]
  // The state: 16-byte copies when rows are whole 16-byte units, else plain loads; padding zero.
  if (d % 4 == 0 && (reinterpret_cast<uintptr_t>(S_base) & 15) == 0) {
    const int per_row = d / 4;
    for (int i = tid; i < d * per_row; i += kThreads) {
      const int j = d == D ? i / (D / 4) : i / per_row, c4 = i - j * per_row;
      cp_async16(sS + j * L::kStride + 4 * c4, S_base + j * d + 4 * c4);
    }
    cp_async_commit();
  } else {
    for (int i = tid; i < d * d; i += kThreads) sS[(i / d) * L::kStride + i % d] = S_base[i];
  }
  if (d < D) {
    for (int i = tid; i < D * D; i += kThreads) {
      const int j = i / D, c = i % D;
      if (j >= d || c >= d) sS[j * L::kStride + c] = 0.0f;
    }
  }
  // The convs: q and k raw (normalized below), v final; padded channels zero.
  for (int u = tid; u < 3 * D; u += kThreads) {
    const int which = u / D, j = u % D;
    float* dst = which == 0 ? sq : which == 1 ? sk : sv;
    dst[j] = j < d ? conv_one_token(ctx.weight(which), kernel, ctx.in(which, first), ctx.in_act(which), act,
                                    state_by_id(ctx, static_cast<int>(ctx.attr(4 + which)), slot), h * d + j)
                   : 0.0f;
  }
  // The gate: z = round(f·W_fbᵀ) + dt_bias, staged as exp(g) (padded rows decay by 1); with the output
  // norm, its gate's z = round(g·W_gbᵀ) in the same pass.
  const bool norm = ctx.op->num_inputs == 6;
  stage_token_gates<D>(ctx, first, h, d, norm, sdecay, sz);
  for (int j = d + tid; j < D; j += kThreads) sdecay[j] = 1.0f;
  const float beta = sigmoidf_(round_act(ctx.in_act(4), ctx.in(4, first)[h]));
  __syncthreads();
  // q̂ = l2n(q)/√d, k̂ = l2n(k) in place: warp 0 q, warp 1 k.
  if (warp_id() < 2) normalize_row<D>(warp_id() == 0 ? sq : sk, d, warp_id() == 0 ? 1.0f / sqrtf(static_cast<float>(d)) : 1.0f);
  cp_async_wait<0>();
  __syncthreads();
  // The delta rule, a value column c per kPerCol threads, state rows j = r + kPerCol·i.
  {
    const int c = tid / L::kPerCol, r = tid % L::kPerCol;
    const float* Sc = sS + c;
    float predicted = 0.0f;
#pragma unroll 8
    for (int i = 0; i < L::kRows; ++i) {
      const int j = r + L::kPerCol * i;
      predicted += Sc[j * L::kStride] * sdecay[j] * sk[j];
    }
    for (int o = 1; o < L::kPerCol; o <<= 1) predicted += __shfl_xor_sync(0xffffffffu, predicted, o);
    const float error = (sv[c] - predicted) * beta;
    float out = 0.0f;
    const bool store = c < d;
    float* S_out = S_base + r * d + c;  // row j = r + kPerCol·i, a step of kPerCol rows an i
    const int step_rows = L::kPerCol * d;
#pragma unroll 8
    for (int i = 0; i < L::kRows; ++i, S_out += step_rows) {
      const int j = r + L::kPerCol * i;
      const float updated = Sc[j * L::kStride] * sdecay[j] + sk[j] * error;
      out += updated * sq[j];
      if (store && j < d) *S_out = updated;
    }
    for (int o = 1; o < L::kPerCol; o <<= 1) out += __shfl_xor_sync(0xffffffffu, out, o);
    if (r == 0 && store) {
      const float o_c = round_out(ctx, out);
      if (norm) {
        so[c] = o_c;
      } else {
        ctx.out(first)[h * d + c] = o_c;
      }
    }
  }
  if (norm) {
    __syncthreads();
    gated_norm_units(ctx.weight(7), d, ctx.attr(7), ctx.out_act(), kAF32, kAF32, 1, [&](int64_t) { return GatedUnit{so, sz, ctx.out(first) + h * d}; });
  }
  __syncthreads();  // the next pair overwrites shared memory
}

// Shared memory of fused_core_token_part: the part's columns of the head's state [D][kCols], then q, k,
// exp(g), z, o [D], v [kCols] and the two column sums' partials [kGroups][kCols] each, then the last
// part's flag.
template <int D, int kParts>
struct KdaPartLayout {
  static constexpr int kCols = D / kParts;          // value columns a part (32 at D = 128, 4 parts)
  static constexpr int kGroups = kThreads / kCols;  // row groups: thread (tid / kCols, tid % kCols)
  static constexpr int kRows = D / kGroups;         // state rows a thread (8 at D = 128, 4 parts)
  static constexpr int kState = D * kCols;
  static constexpr int kFloats = kState + 5 * D + kCols + 2 * kThreads + 1;
  static_assert((kCols % 32 == 0 || 32 % kCols == 0) && kThreads % kCols == 0 && D % kGroups == 0, "a warp reads 32 adjacent floats of the part's state");
  static_assert(kFloats * 4 <= kSharedBytes, "the part's state fits shared memory");
};

// A part of a one-token (sequence, head) pair split by value columns, d = D: columns
// [part·kCols, (part + 1)·kCols) of the head's state, v and o. Every part computes the q and k convs,
// q̂, k̂, the gate and (with the output norm) the output gate's z over all D rows, fused_core_token's
// arithmetic; v's conv over its own columns, whose windows it writes. A warp takes 32 adjacent floats
// of the part's state, 32 / kCols rows of kCols columns or 32 columns of one row (conflict-free shared
// reads, whole 64- or 128-byte global stores); the column sums go through shared memory, in a fixed
// order. Each part stores its o columns and counts itself out on `done` (a counter a pair, 0 between
// steps: the last part resets it). The last part, once every part has read the q and k windows and
// stored its o, pushes the token into those windows and, with the norm, reads the other parts' o back
// (L2) and writes the head's gated norm over its own.
template <int D, int kParts>
__device__ __noinline__ void fused_core_token_part(const TaskCtx& ctx, int s, int64_t h, int part, unsigned* done) {
  using L = KdaPartLayout<D, kParts>;
  const StepView& step = *ctx.step;
  const int first = step.seq_first_row[s], slot = step.seq_slot[s];
  const int kernel = static_cast<int>(ctx.attr(3));
  const int32_t act = ctx.op->act;
  const bool norm = ctx.op->num_inputs == 6;
  const int tid = static_cast<int>(threadIdx.x), c0 = part * L::kCols;
  float* sS = smem_floats(ctx);
  float* sq = sS + L::kState;
  float* sk = sq + D;
  float* sdecay = sk + D;
  float* sz = sdecay + D;
  float* so = sz + D;
  float* sv = so + D;
  float* red = sv + L::kCols;
  float* red_out = red + kThreads;
  int* last_flag = reinterpret_cast<int*>(red_out + kThreads);
  float* S_base = state_of(ctx, slot) + h * D * D;  // [D, D]: S[j][c]
  float* out = ctx.out(first) + h * D;
  if ((reinterpret_cast<uintptr_t>(S_base) & 15) == 0) {
    for (int i = tid; i < D * (L::kCols / 4); i += kThreads) {
      const int j = i / (L::kCols / 4), c4 = i % (L::kCols / 4);
      cp_async16(sS + j * L::kCols + 4 * c4, S_base + j * D + c0 + 4 * c4);
    }
    cp_async_commit();
  } else {
    for (int i = tid; i < D * L::kCols; i += kThreads) sS[i] = S_base[(i / L::kCols) * D + c0 + i % L::kCols];
  }
  const auto window = [&](int which) { return state_by_id(ctx, static_cast<int>(ctx.attr(4 + which)), slot); };
  for (int u = tid; u < 2 * D + L::kCols; u += kThreads) {
    const int which = u < 2 * D ? u / D : 2;
    const int j = which < 2 ? u % D : c0 + u - 2 * D;
    float* dst = which == 0 ? sq + j : which == 1 ? sk + j : sv + (j - c0);
    *dst = conv_one_token(ctx.weight(which), kernel, ctx.in(which, first), ctx.in_act(which), act, window(which), h * D + j, which == 2);
  }
  stage_token_gates<D>(ctx, first, h, D, norm, sdecay, sz);
  const float beta = sigmoidf_(round_act(ctx.in_act(4), ctx.in(4, first)[h]));
  __syncthreads();
  if (warp_id() < 2) normalize_row<D>(warp_id() == 0 ? sq : sk, D, warp_id() == 0 ? 1.0f / sqrtf(static_cast<float>(D)) : 1.0f);
  cp_async_wait<0>();
  __syncthreads();
  // The delta rule over the part's columns: column c = tid % kCols, state rows j = g + kGroups·i.
  const int c = tid % L::kCols, g = tid / L::kCols;
  float predicted = 0.0f;
#pragma unroll
  for (int i = 0; i < L::kRows; ++i) {
    const int j = g + L::kGroups * i;
    predicted += sS[j * L::kCols + c] * sdecay[j] * sk[j];
  }
  red[g * L::kCols + c] = predicted;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int k = 0; k < L::kGroups; ++k) total += red[k * L::kCols + c];
  const float error = (sv[c] - total) * beta;
  float o_part = 0.0f;
  float* S_out = S_base + g * D + c0 + c;
#pragma unroll
  for (int i = 0; i < L::kRows; ++i) {
    const int j = g + L::kGroups * i;
    const float updated = sS[j * L::kCols + c] * sdecay[j] + sk[j] * error;
    o_part += updated * sq[j];
    S_out[static_cast<int64_t>(L::kGroups) * D * i] = updated;
  }
  red_out[g * L::kCols + c] = o_part;
  __syncthreads();
  if (tid < L::kCols) {
    float o = 0.0f;
#pragma unroll
    for (int k = 0; k < L::kGroups; ++k) o += red_out[k * L::kCols + tid];
    const float o_c = round_out(ctx, o);
    so[c0 + tid] = o_c;
    out[c0 + tid] = o_c;  // the norm's input until the last part overwrites it
  }
  __syncthreads();  // this part has read the q and k windows and stored its o
  if (tid == 0) {
    __threadfence();
    const bool last = atomicAdd(done, 1u) == static_cast<unsigned>(kParts - 1);
    if (last) {
      __threadfence();
      atomicExch(done, 0u);
    }
    *last_flag = last ? 1 : 0;
  }
  __syncthreads();
  if (*last_flag == 0) return;
  const int keep = kernel - 1;
  for (int u = tid; u < 2 * D; u += kThreads) {
    const int which = u / D;
    const int64_t channel = h * D + u % D;
    push_window(window(which) + channel * keep, keep, round_act(ctx.in_act(which), ctx.in(which, first)[channel]));
  }
  if (norm) {
    for (int j = tid; j < D; j += kThreads) {
      if (j < c0 || j >= c0 + L::kCols) so[j] = __ldcg(out + j);  // the other parts' (L2: another SM wrote them)
    }
    __syncthreads();
    gated_norm_units(ctx.weight(7), D, ctx.attr(7), ctx.out_act(), kAF32, kAF32, 1, [&](int64_t) { return GatedUnit{so, sz, out}; });
  }
  __syncthreads();  // the block's next task overwrites shared memory
}

// The parts a one-token pair is split into (fused_core_token_part, head dims of 64 and 128 unpadded): 4
// or 2 where the op has that many tasks a pair (spread_tasks: 4 or 2 a pair where the workers hold them), else 1.
template <int D>
__device__ __forceinline__ int kda_split_parts(int d, int64_t pairs, int64_t tasks) {
  if (D < 64 || d != D || pairs > kKdaPairCounters) return 1;
  return tasks >= 4 * pairs ? 4 : tasks >= 2 * pairs ? 2 : 1;
}

// kKdaFusedCore: kda_delta_rule(conv_q(x_q), conv_k(x_k), conv_v(x_v), kda_gate(f·W_fbᵀ), σ(b)) for the
// step's (sequence, head) pairs, a task a contiguous share of them (sequence-major), or with 2 or 4
// tasks a pair (kda_split_parts) a part of one (spread_tasks: the plan's column slices are not used,
// its consumers and overwriters wait for every task). inputs x_q, x_k, x_v [T, P], f [T, F], b [T,
// heads] (act), and g [T, G] when the output norm is in (six inputs); weights C_q, C_k, C_v [P, 1, K], W_fb [P, F], A_log
// [heads], dt_bias [P], then W_gb [P, G] and the norm's w [d]; attrs [0] head_dim, [1] bounded, [2]
// lower_bound, [3] kernel K, [4..6] the conv windows' states (conv_q, conv_k, conv_v), [7] the norm's ε.
// State: the recurrent one, fp32 [heads, d, d] per slot.
template <int D>
__device__ __noinline__ void kda_fused_core(const TaskCtx& ctx) {
  const int d = static_cast<int>(ctx.attr(0));
  const int heads = static_cast<int>(ctx.op->width / d);
  const int64_t pairs = static_cast<int64_t>(ctx.step->num_seqs) * heads, tasks = ctx.op->tasks;
  if constexpr (D >= 64) {
    const int parts = kda_split_parts<D>(d, pairs, tasks);
    if (parts > 1) {  // a task a part of a pair: pair task / parts, part task % parts
      if (ctx.task >= pairs * parts) return;
      const int64_t p = ctx.task / parts;
      const int s = static_cast<int>(p / heads), part = static_cast<int>(ctx.task % parts);
      unsigned* const done = ctx.op->sync + kOpSyncCounters + p;
      if (ctx.step->seq_tokens[s] != 1) {
        if (part == 0) fused_core_pair<D>(ctx, s, p % heads, d);
      } else if (parts == 4) {
        fused_core_token_part<D, 4>(ctx, s, p % heads, part, done);
      } else {
        fused_core_token_part<D, 2>(ctx, s, p % heads, part, done);
      }
      return;
    }
  }
  for (int64_t p = pairs * ctx.task / tasks; p < pairs * (ctx.task + 1) / tasks; ++p) {
    const int s = static_cast<int>(p / heads);
    if constexpr (D >= 32) {
      if (ctx.step->seq_tokens[s] == 1) {  // decode
        fused_core_token<D>(ctx, s, p % heads, d);
        continue;
      }
    }
    fused_core_pair<D>(ctx, s, p % heads, d);
  }
}

__device__ __noinline__ void op_kda_fused_core(const TaskCtx& ctx) {
  by_head_dim(ctx, [&](auto padded) { kda_fused_core<decltype(padded)::value>(ctx); });
}

}  // namespace plow::cuda
