// The weight-streaming dots every GEMV-family body shares: one warp per weight row (or two rows at
// once), 16-byte non-allocating loads (kRowBatch in flight per lane) against up to kMaxGroup token
// rows staged as fp32 in shared memory, fp32 accumulate. Included by ops/gemv.cuh (the op bodies) and
// moe_gemm.cu (the expert GEMV between megakernel segments); no op bodies here, so both translation
// units may include it.
#pragma once

#include "runtime/cuda/device.cuh"
#include "runtime/cuda/ops/half8.cuh"

namespace plow::cuda {

inline constexpr int kMaxGroup = 8;  // token rows per pass over a weight row

// 16-byte loads a lane keeps in flight on one weight row (lane_dot), all issued before the first is
// used, the last batch of a row predicated: a 2,304-wide bf16 row is 9 loads a lane, one DRAM latency
// where batches of 4 (and a tail of 1) waited three. One block of 512 threads an SM streams at most
// (bytes in flight) / (latency): with 4 loads a lane (≤ 32 KB an SM) the batch-1 lm_head streamed
// 755 MB in 302 µs (2.5 TB/s), with 12 or 18 in ~197 µs (3.8 TB/s). Fewer with more token rows: their
// accumulators and operands share the 128 registers (8 at G ≥ 4 spilled gate_up_act's bodies).
template <int G>
inline constexpr int kRowBatch = G == 1 ? 18 : G == 2 ? 8 : 4;
// lane_dot2's, on each of its two rows (9 a row at G = 1 did not speed moe_gate_up up and slowed moe_down).
template <int G>
inline constexpr int kPairBatch = G == 1 ? 6 : 4;

__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
#ifndef PLOW_CUDA_EMU
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
  std::memcpy(&v, p, sizeof v);  // the host emulator's plain load
#endif
  return v;
}

__device__ __forceinline__ void unpack8(uint4 v, int32_t type, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  unpack_half8(w, type, f);
}

// ---- MXFP4 (spec/MODEL.md §7.7) ----
// An E2M1 code as fp16 bits: its sign to bit 15, its three magnitude bits (e1 e0 m) to bits 11–9, the
// exponent field's low two bits and the top mantissa bit. That half is the code's value × 2⁻¹⁴ for every
// code, e = 0 included (the subnormal 0 or 2⁻¹⁵ for 0 or 0.5), so a block's 32 products are taken on
// the halves and the block's sum is scaled once by 2¹⁴ and the block's E8M0 scale, both powers of
// two. Two codes a step: elements j and j + 4 of a 32-bit word (bits 4j and 4j + 16, low nibble the
// even element) land in one half2 by two shifts and a masked or; the decode was ~10 instructions a code
// (e2m1 by compares and selects, then a multiply by the scale).
template <int J>
__device__ __forceinline__ void e2m1_pair(uint32_t w, float& lo, float& hi) {
  constexpr int kMag = 9 - 4 * J, kSign = 12 - 4 * J;
  uint32_t mag;
  if constexpr (kMag >= 0) {
    mag = w << kMag;
  } else {
    mag = w >> -kMag;
  }
  const uint32_t h = (mag & 0x0E000E00u) | ((w << kSign) & 0x80008000u);
  lo = __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xffffu)));
  hi = __half2float(__ushort_as_half(static_cast<unsigned short>(h >> 16)));
}

// acc + the pair's codes (e2m1_pair<J>) times x_lo, then x_hi.
template <int J>
__device__ __forceinline__ float e2m1_pair_fma(uint32_t w, float x_lo, float x_hi, float acc) {
  float lo, hi;
  e2m1_pair<J>(w, lo, hi);
  return fmaf(hi, x_hi, fmaf(lo, x_lo, acc));
}

// Σ_j e2m1(code j)·2⁻¹⁴·x[j] over one 16-byte block of 32 codes (element 8q + j in word q at bits 4j);
// x 16-byte aligned. Two accumulators, for the chains' latency.
__device__ __forceinline__ float mx_block_dot(uint4 v, const float* x) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float s[2] = {0.0f, 0.0f};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 a = *reinterpret_cast<const float4*>(x + 8 * q);
    const float4 b = *reinterpret_cast<const float4*>(x + 8 * q + 4);
    float& acc = s[q & 1];
    acc = e2m1_pair_fma<0>(w[q], a.x, b.x, acc);
    acc = e2m1_pair_fma<1>(w[q], a.y, b.y, acc);
    acc = e2m1_pair_fma<2>(w[q], a.z, b.z, acc);
    acc = e2m1_pair_fma<3>(w[q], a.w, b.w, acc);
  }
  return s[0] + s[1];
}

// acc + a block's dot (mx_block_dot) times 2¹⁴ (exact) and its scale.
__device__ __forceinline__ float mx_block_add(float acc, uint4 v, uint32_t e, const float* x) {
  return fmaf(mx_block_dot(v, x) * 16384.0f, e8m0_value_dev(e), acc);
}

// One MXFP4 weight row and the staged row it is dotted with.
struct MxRow {
  const uint8_t* codes;   // cols / 2 bytes: 16 a block
  const uint8_t* scales;  // cols / 32 bytes: one a block
  const float* x;         // cols floats, 16-byte aligned
};

__device__ __forceinline__ MxRow mx_row(const DeviceWeight& w, int64_t part, int64_t row, const float* x) {
  return {w.data + part * w.part_bytes + static_cast<size_t>(row) * static_cast<size_t>(w.cols / 2),
          w.scales + part * w.scale_part_bytes + static_cast<size_t>(row) * static_cast<size_t>(w.cols / 32), x};
}

// 16-byte blocks a lane keeps in flight on each of its MXFP4 rows.
inline constexpr int kMxBatch = 4;

// The lanes that share an MXFP4 row of `blocks` blocks: the fewest (a power of two, ≤ 32) that take
// it in one round of kMxBatch blocks a lane. K3's routed down rows (384 columns, 12 blocks) take 4, so a
// warp streams 8 rows at once where one row a warp kept 12 of its lanes busy with one load each.
__device__ __forceinline__ int mx_row_lanes(int blocks) {
  int lanes = 1;
  while (lanes < 32 && lanes * kMxBatch < blocks) lanes <<= 1;
  return lanes;
}

// This lane's share of the NR rows' dots, added to acc: the lane is `sub` of the `lanes` lanes that
// share the rows and takes blocks sub, sub + lanes, …, a round of kMxBatch a row at a time. The caller
// reduces acc over the lanes (an xor butterfly within aligned groups). ptxas issues a round's first
// block, sums it, then issues the rest; forcing all the loads first (predicated volatile loads and a
// __syncwarp) was measured 2% slower on K3 (H100), so the loop stays as written.
template <int NR>
__device__ __forceinline__ void mx_lane_dots(const MxRow (&rows)[NR], int blocks, int sub, int lanes, float (&acc)[NR]) {
  for (int b0 = sub; b0 < blocks; b0 += lanes * kMxBatch) {
    uint4 v[NR][kMxBatch];
    uint32_t e[NR][kMxBatch];
#pragma unroll
    for (int u = 0; u < kMxBatch; ++u) {
      const int b = b0 + lanes * u;
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        v[i][u] = b < blocks ? load_stream(rows[i].codes + static_cast<size_t>(b) * 16) : uint4{};
        e[i][u] = b < blocks ? static_cast<uint32_t>(__ldg(rows[i].scales + b)) : 0u;
      }
    }
#pragma unroll
    for (int u = 0; u < kMxBatch; ++u) {
      const int b = b0 + lanes * u;
      if (b >= blocks) break;
#pragma unroll
      for (int i = 0; i < NR; ++i) acc[i] = mx_block_add(acc[i], v[i][u], e[i][u], rows[i].x + b * 32);
    }
  }
}

template <int G>
__device__ __forceinline__ void fma8(const float (&f)[8], const float* xs, int ld, int k, float (&acc)[G]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float4 a = *reinterpret_cast<const float4*>(xs + g * ld + k);
    const float4 b = *reinterpret_cast<const float4*>(xs + g * ld + k + 4);
    acc[g] += f[0] * a.x + f[1] * a.y + f[2] * a.z + f[3] * a.w + f[4] * b.x + f[5] * b.y + f[6] * b.z + f[7] * b.w;
  }
}

// This lane's share of dot(row `row` of part `part`, xs[g·ld + k] for k < n), added to acc[g]. The
// caller reduces acc over the warp. xs: shared (or scratch) memory, ld a multiple of 4.
// U: the loads a lane keeps in flight (kRowBatch<G>; a body that only falls back here passes fewer,
// since the batch's registers count against the whole body).
template <int G, int U = kRowBatch<G>>
__device__ __forceinline__ void lane_dot(const DeviceWeight& w, int64_t part, int64_t row, const float* xs, int ld, int n, float (&acc)[G]) {
  const int lane = threadIdx.x & 31;
  const uint8_t* base = w.data + part * w.part_bytes;
  if (w.type == kWBF16 || w.type == kWF16) {
    const uint8_t* r = base + static_cast<size_t>(row) * static_cast<size_t>(w.cols) * 2;
    int k0 = 0;
    if (((reinterpret_cast<uintptr_t>(r) | reinterpret_cast<uintptr_t>(xs)) & 15) == 0) {
      const int chunks = n / 8;
      for (int c = lane; c < chunks; c += 32 * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = c + 32 * u < chunks ? load_stream(r + static_cast<size_t>(c + 32 * u) * 16) : uint4{};
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (c + 32 * u >= chunks) break;
          float f[8];
          unpack8(v[u], w.type, f);
          fma8<G>(f, xs, ld, (c + 32 * u) * 8, acc);
        }
      }
      k0 = chunks * 8;
    }
    for (int k = k0 + lane; k < n; k += 32) {
      const uint16_t bits = reinterpret_cast<const uint16_t*>(r)[k];
      const float f = w.type == kWBF16 ? __uint_as_float(static_cast<uint32_t>(bits) << 16) : __half2float(__ushort_as_half(bits));
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] += f * xs[g * ld + k];
    }
    return;
  }
  if (w.type == kWMXFP4) {  // cols a multiple of 32: mx_lane_dots over the whole warp, once a staged row
    // (the MXFP4 passes of gemv.cuh take the routed experts; this is the fallback for rows staged in
    // the global scratch, so reading the codes again for each of G rows is no cost that matters)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const MxRow one[1] = {mx_row(w, part, row, xs + g * ld)};
      float sum[1] = {acc[g]};
      mx_lane_dots<1>(one, n / 32, lane, 32, sum);
      acc[g] = sum[0];
    }
    return;
  }
  // fp32 weights
  const float* r = reinterpret_cast<const float*>(base) + static_cast<size_t>(row) * static_cast<size_t>(w.cols);
  for (int k = lane; k < n; k += 32) {
    const float f = __ldg(r + k);
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] += f * xs[g * ld + k];
  }
}

// Row `row` of part `part` of w when lane_dot2 can stream it: half-precision weights, the row and the
// staged rows xs 16-byte aligned, n a multiple of 8; else null (lane_dot's general path).
__device__ __forceinline__ const uint8_t* half_row(const DeviceWeight& w, int64_t part, int64_t row, const float* xs, int n) {
  if ((w.type != kWBF16 && w.type != kWF16) || n % 8 != 0) return nullptr;
  const uint8_t* r = w.data + part * w.part_bytes + static_cast<size_t>(row) * static_cast<size_t>(w.cols) * 2;
  return ((reinterpret_cast<uintptr_t>(r) | reinterpret_cast<uintptr_t>(xs)) & 15) == 0 ? r : nullptr;
}

// Lane's share of two dots at once, rows a and b of one half-precision type (half_row's pointers)
// against their staged rows xa and xb (G rows each, row stride ld): both rows' loads in flight
// together, one DRAM latency for the pair where two lane_dot calls wait two. Each row's sum runs in
// lane_dot's order, so the dots are bit-identical to its.
template <int G>
__device__ __forceinline__ void lane_dot2(int32_t type, const uint8_t* a, const float* xa, const uint8_t* b, const float* xb, int ld, int n,
                                          float (&acc_a)[G], float (&acc_b)[G]) {
  const int lane = threadIdx.x & 31;
  const int chunks = n / 8;
  constexpr int U = kPairBatch<G>;
  for (int c = lane; c < chunks; c += 32 * U) {
    uint4 va[U], vb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool in = c + 32 * u < chunks;
      va[u] = in ? load_stream(a + static_cast<size_t>(c + 32 * u) * 16) : uint4{};
      vb[u] = in ? load_stream(b + static_cast<size_t>(c + 32 * u) * 16) : uint4{};
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c + 32 * u >= chunks) break;
      float f[8];
      unpack8(va[u], type, f);
      fma8<G>(f, xa, ld, (c + 32 * u) * 8, acc_a);
      unpack8(vb[u], type, f);
      fma8<G>(f, xb, ld, (c + 32 * u) * 8, acc_b);
    }
  }
}

}  // namespace plow::cuda
