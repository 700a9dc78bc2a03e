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
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void unpack8(uint4 v, int32_t type, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  unpack_half8(w, type, f);
}

// E2M1 code → value, branch-free: sign, 2 exponent bits (bias 1), 1 mantissa bit; e = 0 is 0 or 0.5.
__device__ __forceinline__ float e2m1_bits(uint32_t code) {
  const uint32_t e = (code >> 1) & 3, m = code & 1;
  const uint32_t bits = e != 0 ? ((e + 126) << 23) | (m << 22) : (m != 0 ? 126u << 23 : 0u);
  return __uint_as_float(bits | ((code & 8) << 28));
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
  if (w.type == kWMXFP4) {  // 16 bytes = 32 codes = one scale block (cols is a multiple of 32)
    const uint8_t* r = base + static_cast<size_t>(row) * static_cast<size_t>(w.cols / 2);
    const uint8_t* s = w.scales + part * w.scale_part_bytes + static_cast<size_t>(row) * static_cast<size_t>(w.cols / 32);
    constexpr int B = 4;  // 16-byte blocks a lane in flight
    const int blocks = n / 32;
    for (int c = lane; c < blocks; c += 32 * B) {
      uint4 v[B];
      uint8_t e[B];
#pragma unroll
      for (int u = 0; u < B; ++u) {
        const bool in = c + 32 * u < blocks;
        v[u] = in ? load_stream(r + static_cast<size_t>(c + 32 * u) * 16) : uint4{};
        e[u] = in ? __ldg(s + c + 32 * u) : uint8_t{0};
      }
#pragma unroll
      for (int u = 0; u < B; ++u) {
        if (c + 32 * u >= blocks) break;
        const float scale = e8m0_value_dev(e[u]);
        const uint32_t words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          float f[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) f[j] = e2m1_bits((words[q] >> (4 * j)) & 0xF) * scale;
          fma8<G>(f, xs, ld, (c + 32 * u) * 32 + q * 8, acc);
        }
      }
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
