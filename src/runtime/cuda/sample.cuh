// Sampling on the device: a block of kSampleThreads draws one row's token from its logits with the
// host sampler's controls (engine/sampler.h: temperature, top-k, top-p, min-p; penalties and logprobs
// stay on the host) and a uniform the host drew, so a step downloads an id instead of the row.
//
// The kept set is the specification's (reference_distribution: the sampler's order, larger logit
// first and the lower id on equal ones), found without sorting: a logit's order key is its float bits
// made monotone, top-k's boundary key by a radix select of counts, top-p's by a radix select of masses
// over the top-k set (the prefix of the order whose mass first reaches top_p of it), ties on a
// boundary key taken in id order. Masses are weights w = exp((ℓ − max ℓ) / T) in fixed point (2^40 for
// w = 1, a weight below 2^−40 counts 0): integer sums are exact in any order, so the result is the
// same run to run, and the kept set differs from the specification's double sums
// only where the boundary's mass lies within ~vocab·2^−40 of top_p. The draw walks the kept tokens in
// id order to the first whose running mass exceeds u · (kept mass). Every pass recomputes the weights
// from the row (an exp a logit): nothing vocabulary-sized is stored.
// The emulator test (tests/gpu/emu/sample_emu_test.cpp) runs this block on the host.
#pragma once

#include <cstdint>

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/sample.h"

namespace plow::cuda::sampling {

constexpr int kThreads = kSampleThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTiles = 1024;   // id-order tiles of a row: a warp sums one at a time
constexpr int kFixedBits = 40;    // w = 1 is 2^40 in the masses

struct Shared {
  uint64_t hist[256];            // a radix pass's counts or masses per digit
  uint64_t warp_hist[kWarps][256];  // the same, a warp's own (summed into hist)
  uint64_t tiles[kMaxTiles];     // per tile: the sum of a pass's values, then their scan
  uint64_t warp_total[kWarps];
  uint64_t scalar[4];            // broadcasts: [0] a pass's result, [1] the remaining goal
  int32_t id;                    // first_crossing's answer
  float max_logit;
};

// Larger logit ⇒ larger key (NaN and −∞ below every number).
__device__ __forceinline__ uint32_t order_key(float x) {
  if (!(x == x)) return 0u;
  const uint32_t b = __float_as_uint(x == 0.0f ? 0.0f : x);  // −0 is +0: equal logits, as the host compares them
  return (b & 0x80000000u) != 0 ? ~b : b | 0x80000000u;
}

__device__ __forceinline__ uint64_t fixed_weight(float w) { return static_cast<uint64_t>(w * static_cast<float>(1ull << kFixedBits)); }

__device__ __forceinline__ uint64_t shfl_u64(uint64_t v, int src) {
  const auto lo = static_cast<uint32_t>(v), hi = static_cast<uint32_t>(v >> 32);
  return static_cast<uint64_t>(__shfl_sync(0xffffffffu, hi, src)) << 32 | __shfl_sync(0xffffffffu, lo, src);
}

__device__ __forceinline__ uint64_t warp_sum_u64(uint64_t v) {
  for (int o = 16; o > 0; o >>= 1) {
    const auto lo = static_cast<uint32_t>(v), hi = static_cast<uint32_t>(v >> 32);
    v += static_cast<uint64_t>(__shfl_xor_sync(0xffffffffu, hi, o)) << 32 | __shfl_xor_sync(0xffffffffu, lo, o);
  }
  return v;
}

// The block's sum of each thread's v (every thread gets it).
__device__ __forceinline__ uint64_t block_sum_u64(uint64_t v, Shared& s) {
  v = warp_sum_u64(v);
  __syncthreads();  // warp_total's last readers are done
  if (lane_id() == 0) s.warp_total[warp_id()] = v;
  __syncthreads();
  uint64_t total = 0;
  for (int w = 0; w < kWarps; ++w) total += s.warp_total[w];
  return total;
}

// Calls f(i, row[i]) for the ids begin, begin + step, … below end, with kInFlight loads issued before
// the first use: a pass over a row is a chain of L2 reads (the row is larger than an SM's L1), and one
// block a row has too few warps to hide a read's latency one load at a time.
constexpr int kInFlight = 8;
template <class F>
__device__ __forceinline__ void for_each_logit(const float* row, int begin, int end, int step, F f) {
  for (int base = begin; base < end; base += kInFlight * step) {
    float x[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) x[j] = base + j * step < end ? row[base + j * step] : 0.0f;
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (base + j * step < end) f(base + j * step, x[j]);
  }
}

// The row in tiles of consecutive ids (a multiple of 32, at most kMaxTiles of them).
struct Tiling {
  int vocab, tile, tiles;
};
__device__ __forceinline__ Tiling tiling(int vocab) {
  int tile = (vocab + kMaxTiles - 1) / kMaxTiles;
  tile = (tile + 31) / 32 * 32;
  return {vocab, tile, (vocab + tile - 1) / tile};
}

// The first id at which the running sum of value(id, row[id]) in id order exceeds `target` (values
// ≥ 0), or −1 when the whole sum does not. Every thread calls it and gets the answer.
template <class Value>
__device__ int first_crossing(const float* row, const Tiling& t, uint64_t target, Value value, Shared& s) {
  // Each tile's sum, a warp a tile.
  for (int k = warp_id(); k < t.tiles; k += kWarps) {
    uint64_t sum = 0;
    for_each_logit(row, k * t.tile + lane_id(), min((k + 1) * t.tile, t.vocab), 32, [&](int i, float x) { sum += value(i, x); });
    sum = warp_sum_u64(sum);
    if (lane_id() == 0) s.tiles[k] = sum;
  }
  if (threadIdx.x == 0) s.id = -1;
  __syncthreads();
  // The tile where the running sum crosses: thread 0 walks the tile sums (at most kMaxTiles adds).
  if (threadIdx.x == 0) {
    uint64_t before = 0;
    int found = -1;
    for (int k = 0; k < t.tiles; ++k) {
      if (before + s.tiles[k] > target) {
        found = k;
        break;
      }
      before += s.tiles[k];
    }
    s.scalar[0] = static_cast<uint64_t>(found + 1);
    s.scalar[1] = before;
  }
  __syncthreads();
  const int k = static_cast<int>(s.scalar[0]) - 1;
  if (k >= 0 && warp_id() == 0) {  // inside the tile, 32 ids at a time: a warp scan
    uint64_t before = s.scalar[1];
    for (int base = k * t.tile; base < min((k + 1) * t.tile, t.vocab); base += 32) {
      const int i = base + lane_id();
      const uint64_t v = i < t.vocab ? value(i, row[i]) : 0;
      uint64_t scan = v;
      for (int o = 1; o < 32; o <<= 1) {
        const uint64_t up = shfl_u64(scan, lane_id() >= o ? lane_id() - o : lane_id());
        if (lane_id() >= o) scan += up;
      }
      const bool crosses = before + scan > target && before + scan - v <= target;
      const unsigned hit = __ballot_sync(0xffffffffu, crosses);
      if (hit != 0) {
        if (lane_id() == 0) s.id = base + __ffs(static_cast<int>(hit)) - 1;
        break;
      }
      before += shfl_u64(scan, 31);
    }
  }
  __syncthreads();
  const int id = s.id;
  __syncthreads();  // s.id and s.scalar may be written by the next pass
  return id;
}

// The block's sum of value(i, row[i]) over the row (every thread gets it).
template <class Value>
__device__ uint64_t row_sum(const float* row, int vocab, Value value, Shared& s) {
  uint64_t sum = 0;
  for_each_logit(row, static_cast<int>(threadIdx.x), vocab, kThreads, [&](int i, float x) { sum += value(i, x); });
  return block_sum_u64(sum, s);
}

// Radix select from the top over the order keys: the key K with
// Σ{value(i) : key(i) > K} < goal ≤ Σ{value(i) : key(i) ≥ K} (goal ≥ 1, at most the whole sum);
// `remaining` gets goal minus the first sum. Four passes of 8 bits, integer sums in shared memory
// (values at most 2^40).
template <class Value>
__device__ uint32_t radix_select(const float* row, int vocab, uint64_t goal, Value value, uint64_t& remaining, Shared& s) {
  uint32_t prefix = 0, mask = 0;
  uint64_t left = goal;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < kWarps * 256; b += kThreads) s.warp_hist[b / 256][b % 256] = 0;
    __syncthreads();
    uint64_t* const mine = s.warp_hist[warp_id()];
    for (int base = 0; base < vocab; base += kInFlight * kThreads) {  // every lane runs every round: the warp votes below
      float x[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        const int i = base + j * kThreads + static_cast<int>(threadIdx.x);
        x[j] = i < vocab ? row[i] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        const int i = base + j * kThreads + static_cast<int>(threadIdx.x);
        uint32_t digit = 256;  // no value
        uint64_t v = 0;
        if (i < vocab) {
          const uint32_t k = order_key(x[j]);
          if ((k & mask) == prefix) v = value(i, x[j]);
          if (v != 0) digit = k >> shift & 0xFFu;
        }
        if (__ballot_sync(0xffffffffu, digit < 256) == 0) continue;
        // A logit's top digits are shared by most of the row: the lanes of one digit sum their values
        // (at most 2^40: 32 lanes' 20-bit halves fit 32 bits) and the lowest of them adds the sum to
        // the warp's histogram, which no other warp writes.
        const unsigned group = __match_any_sync(0xffffffffu, digit);
        const uint32_t lo = __reduce_add_sync(group, static_cast<uint32_t>(v & 0xFFFFFu));
        const uint32_t hi = __reduce_add_sync(group, static_cast<uint32_t>(v >> 20));
        if (digit < 256 && lane_id() == __ffs(static_cast<int>(group)) - 1) mine[digit] += (static_cast<uint64_t>(hi) << 20) + lo;
      }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += kThreads) {
      uint64_t sum = 0;
      for (int w = 0; w < kWarps; ++w) sum += s.warp_hist[w][b];
      s.hist[b] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int b = 255;
      while (b > 0 && s.hist[b] < left) left -= s.hist[b--];
      s.scalar[0] = static_cast<uint64_t>(b);
      s.scalar[1] = left;
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(s.scalar[0]) << shift;
    mask |= 0xFFu << shift;
    left = s.scalar[1];
    __syncthreads();  // scalar is rewritten by the next pass
  }
  remaining = left;
  return prefix;
}

// One row: the drawn token id (the argmax when temperature ≤ 0 or top_k is 1, or the row's maximum is
// not finite). Every thread of the block calls it; thread 0's return value is the answer (all agree).
__device__ int sample_row(const float* row, int vocab, const RowSampling c, Shared& s) {
  const Tiling t = tiling(vocab);
  float m = -INFINITY;
  for_each_logit(row, static_cast<int>(threadIdx.x), vocab, kThreads, [&](int, float x) { m = x > m ? x : m; });
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  __syncthreads();
  if (lane_id() == 0) s.warp_total[warp_id()] = __float_as_uint(m);
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, __uint_as_float(static_cast<uint32_t>(s.warp_total[w])));
  const uint32_t top_key = order_key(m);
  if (!(c.temperature > 0.0f) || c.top_k == 1 || !(m < INFINITY)) {  // the first id holding the maximum
    const int id = first_crossing(row, t, 0, [&](int, float x) -> uint64_t { return order_key(x) == top_key ? 1 : 0; }, s);
    return id >= 0 ? id : 0;  // a row of NaNs
  }
  const float temperature = c.temperature;
  auto weight = [&](float x) {
    const float w = expf((x - m) / temperature);
    return w >= 0.0f ? w : 0.0f;  // NaN: never drawn
  };
  // top-k: the keys above K_k and, of those equal to it, the first `ties` by id.
  uint32_t k_key = 0;
  int k_tie_last = vocab;  // ids ≤ this among key == k_key are in
  if (c.top_k > 0 && c.top_k < vocab) {
    uint64_t ties = 0;
    k_key = radix_select(row, vocab, static_cast<uint64_t>(c.top_k), [](int, float) -> uint64_t { return 1; }, ties, s);
    k_tie_last = first_crossing(row, t, ties - 1, [&](int, float x) -> uint64_t { return order_key(x) == k_key ? 1 : 0; }, s);
  }
  auto in_top_k = [&](int i, uint32_t key) { return key > k_key || (key == k_key && i <= k_tie_last); };
  // top-p over the top-k set: the keys above K_p and, of those equal to it, the first by id until the
  // mass reaches P = ⌈top_p · (the set's mass)⌉.
  uint32_t p_key = 0;
  int p_tie_last = vocab;
  if (c.top_p < 1.0f) {
    auto top_k_weight = [&](int i, float x) -> uint64_t { return in_top_k(i, order_key(x)) ? fixed_weight(weight(x)) : 0; };
    const uint64_t total = row_sum(row, vocab, top_k_weight, s);
    const auto goal = static_cast<uint64_t>(ceil(static_cast<double>(c.top_p) * static_cast<double>(total)));
    if (goal >= 1 && goal <= total) {
      uint64_t need = 0;
      p_key = radix_select(row, vocab, goal, top_k_weight, need, s);
      p_tie_last = first_crossing(
          row, t, need - 1, [&](int i, float x) -> uint64_t { return order_key(x) == p_key ? top_k_weight(i, x) : 0; }, s);
    }
  }
  auto kept_weight = [&](int i, float x) -> uint64_t {
    const uint32_t key = order_key(x);
    if (!in_top_k(i, key) || key < p_key || (key == p_key && i > p_tie_last)) return 0;
    const float w = weight(x);
    return w >= c.min_p ? fixed_weight(w) : 0;
  };
  const uint64_t kept = row_sum(row, vocab, kept_weight, s);
  const auto target = static_cast<uint64_t>(static_cast<double>(c.u) * static_cast<double>(kept));
  const int id = first_crossing(row, t, target < kept ? target : kept - 1, kept_weight, s);
  return id >= 0 ? id : 0;
}

}  // namespace plow::cuda::sampling
