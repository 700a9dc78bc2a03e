// Sampling on the device: a block of kSampleThreads draws one row's token from its logits with the
// host sampler's controls (engine/sampler.h: temperature, top-k, top-p, min-p; penalties and logprobs
// stay on the host) and a uniform the host drew, so a step downloads an id instead of the row.
//
// The kept set is the specification's (reference_distribution: the sampler's order, larger logit
// first and the lower id on equal ones), found without sorting: a logit's order key is its float bits
// made monotone, top-k's boundary key by a radix select of counts, top-p's by a radix select of masses
// over the top-k set (the prefix of the order whose mass first reaches top_p of it), ties on a
// boundary key taken in id order. Masses are weights w = exp((ℓ − max ℓ) / T) in fixed point (2^40 for
// w = 1, a weight below 2^−40 counts 0): integer sums are exact in any order, so shared-memory atomics
// leave the result the same run to run, and the kept set differs from the specification's double sums
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
constexpr int kMaxTiles = 2048;   // id-order tiles of a row: a warp sums one at a time
constexpr int kFixedBits = 40;    // w = 1 is 2^40 in the masses

struct Shared {
  uint64_t hist[256];            // a radix pass's counts or masses per digit
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

// The row in tiles of consecutive ids (a multiple of 32, at most kMaxTiles of them).
struct Tiling {
  int vocab, tile, tiles;
};
__device__ __forceinline__ Tiling tiling(int vocab) {
  int tile = (vocab + kMaxTiles - 1) / kMaxTiles;
  tile = (tile + 31) / 32 * 32;
  return {vocab, tile, (vocab + tile - 1) / tile};
}

// The first id at which the running sum of value(id) in id order exceeds `target` (values ≥ 0), or −1
// when the whole sum does not. Every thread calls it and gets the answer.
template <class Value>
__device__ int first_crossing(const Tiling& t, uint64_t target, Value value, Shared& s) {
  // Each tile's sum, a warp a tile.
  for (int k = warp_id(); k < t.tiles; k += kWarps) {
    uint64_t sum = 0;
    for (int i = k * t.tile + lane_id(); i < min((k + 1) * t.tile, t.vocab); i += 32) sum += value(i);
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
      const uint64_t v = i < t.vocab ? value(i) : 0;
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

// Radix select from the top: the key K with Σ{value(i) : key(i) > K} < goal ≤ Σ{value(i) : key(i) ≥ K}
// over the ids `eligible` admits (goal ≥ 1, at most their whole sum); `remaining` gets goal minus the
// first sum. Four passes of 8 bits, integer atomics in shared memory.
template <class Key, class Value>
__device__ uint32_t radix_select(int vocab, uint64_t goal, Key key, Value value, uint64_t& remaining, Shared& s) {
  uint32_t prefix = 0, mask = 0;
  uint64_t left = goal;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kThreads) s.hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t k = key(i);
      if ((k & mask) != prefix) continue;
      const uint64_t v = value(i);
      if (v != 0) atomicAdd(reinterpret_cast<unsigned long long*>(&s.hist[k >> shift & 0xFFu]), static_cast<unsigned long long>(v));
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
  for (int i = threadIdx.x; i < vocab; i += kThreads) m = row[i] > m ? row[i] : m;
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  __syncthreads();
  if (lane_id() == 0) s.warp_total[warp_id()] = __float_as_uint(m);
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, __uint_as_float(static_cast<uint32_t>(s.warp_total[w])));
  const uint32_t top_key = order_key(m);
  if (!(c.temperature > 0.0f) || c.top_k == 1 || !(m < INFINITY)) {  // the first id holding the maximum
    const int id = first_crossing(t, 0, [&](int i) -> uint64_t { return order_key(row[i]) == top_key ? 1 : 0; }, s);
    return id >= 0 ? id : 0;  // a row of NaNs
  }
  const float temperature = c.temperature;
  auto weight = [&](int i) {
    const float w = expf((row[i] - m) / temperature);
    return w >= 0.0f ? w : 0.0f;  // NaN: never drawn
  };
  // top-k: the keys above K_k and, of those equal to it, the first `ties` by id.
  uint32_t k_key = 0;
  int k_tie_last = vocab;  // ids ≤ this among key == k_key are in
  if (c.top_k > 0 && c.top_k < vocab) {
    uint64_t ties = 0;
    k_key = radix_select(vocab, static_cast<uint64_t>(c.top_k), [&](int i) { return order_key(row[i]); }, [](int) -> uint64_t { return 1; }, ties, s);
    k_tie_last = first_crossing(t, ties - 1, [&](int i) -> uint64_t { return order_key(row[i]) == k_key ? 1 : 0; }, s);
  }
  auto in_top_k = [&](int i, uint32_t key) { return key > k_key || (key == k_key && i <= k_tie_last); };
  // top-p over the top-k set: the keys above K_p and, of those equal to it, the first by id until the
  // mass reaches P = ⌈top_p · (the set's mass)⌉.
  uint32_t p_key = 0;
  int p_tie_last = vocab;
  if (c.top_p < 1.0f) {
    uint64_t total = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) total += in_top_k(i, order_key(row[i])) ? fixed_weight(weight(i)) : 0;
    total = block_sum_u64(total, s);
    const auto goal = static_cast<uint64_t>(ceil(static_cast<double>(c.top_p) * static_cast<double>(total)));
    if (goal >= 1 && goal <= total) {
      uint64_t need = 0;
      p_key = radix_select(
          vocab, goal, [&](int i) { return order_key(row[i]); },
          [&](int i) -> uint64_t {
            const uint32_t key = order_key(row[i]);
            return in_top_k(i, key) ? fixed_weight(weight(i)) : 0;
          },
          need, s);
      p_tie_last = first_crossing(
          t, need - 1,
          [&](int i) -> uint64_t {
            const uint32_t key = order_key(row[i]);
            return key == p_key && in_top_k(i, key) ? fixed_weight(weight(i)) : 0;
          },
          s);
    }
  }
  auto kept_weight = [&](int i) -> uint64_t {
    const uint32_t key = order_key(row[i]);
    if (!in_top_k(i, key) || key < p_key || (key == p_key && i > p_tie_last)) return 0;
    const float w = weight(i);
    return w >= c.min_p ? fixed_weight(w) : 0;
  };
  uint64_t kept = 0;
  for (int i = threadIdx.x; i < vocab; i += kThreads) kept += kept_weight(i);
  kept = block_sum_u64(kept, s);
  const auto target = static_cast<uint64_t>(static_cast<double>(c.u) * static_cast<double>(kept));
  const int id = first_crossing(t, target < kept ? target : kept - 1, kept_weight, s);
  return id >= 0 ? id : 0;
}

}  // namespace plow::cuda::sampling
