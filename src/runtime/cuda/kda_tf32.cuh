// The 3xTF32 products of the planned KDA prefill kernels (kda_prefill.cuh): an fp32 operand split into a
// TF32 head and rest, three products (lo·hi, hi·lo, hi·hi) accumulated in fp32 — on mma.sync m16n8k8
// for the prep, on wgmma m64n32k8 for the scan — with the host emulator's stand-ins for both (the
// emulator test runs the kernels' blocks on the host).
#pragma once

#include <cstdint>

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/wgmma_layout.h"
#ifndef PLOW_CUDA_EMU
#include "runtime/cuda/wgmma.cuh"
#else
#include <cstring>

namespace plow::cuda {
// wgmma.cuh's fences, commit and waits: the emulator runs each product at issue.
inline const char* emu_wg_smem = nullptr;  // the block's shared memory: wg_smem's addresses are offsets from it
inline uint32_t wg_smem(const void* p) { return static_cast<uint32_t>(static_cast<const char*>(p) - emu_wg_smem); }
inline void wg_fence() {}
inline void wg_commit() {}
inline void wg_wait() {}
inline void wg_wait_prior() {}
inline void wg_fence_proxy() {}
template <int N>
inline void wg_fence_operand(float (&)[N]) {}
}  // namespace plow::cuda
#endif

namespace plow::cuda::kda_planned {

// 3xTF32: an operand as its TF32 head (rounded to nearest, ties away: the bits' add and mask) and the
// rest truncated to TF32 (|rest| ≤ 2⁻¹¹|x|, so the split loses at most 2⁻²¹|x|). Four integer and float
// instructions. With cvt.rna.tf32.f32 instead the scan issued ~1.8× the instructions counted as if the
// cvt were one (ncu); this form and the B operands stored split took the mma.sync scans of an 8K
// prompt 24.5 → 18.2 ms.
__device__ __forceinline__ void tf32_split(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u;
}
struct FragA {  // m16n8k8 A: (g, t), (g+8, t), (g, t+4), (g+8, t+4); g = lane / 4, t = lane mod 4
  uint32_t hi[4], lo[4];
  __device__ __forceinline__ void set(float a0, float a1, float a2, float a3) {
    tf32_split(a0, hi[0], lo[0]);
    tf32_split(a1, hi[1], lo[1]);
    tf32_split(a2, hi[2], lo[2]);
    tf32_split(a3, hi[3], lo[3]);
  }
};
struct FragB {  // m16n8k8 B: (t, g), (t+4, g)
  uint32_t hi[2], lo[2];
  __device__ __forceinline__ void set(float b0, float b1) {
    tf32_split(b0, hi[0], lo[0]);
    tf32_split(b1, hi[1], lo[1]);
  }
};
#ifndef PLOW_CUDA_EMU
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
// The emulator's m16n8k8: the warp's fragments through a per-warp exchange (two warp barriers, not a
// shuffle per element), products of the TF32 values in fp32.
inline uint32_t emu_mma_a[16][32][4], emu_mma_b[16][32][2];
inline void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) emu_mma_a[warp][lane][i] = a[i];
  for (int i = 0; i < 2; ++i) emu_mma_b[warp][lane][i] = b[i];
  __syncwarp();
  const auto at = [&](int row, int k) {  // A(row, k): lane 4·(row mod 8) + k mod 4, register 2·(k / 4) + row / 8
    return __uint_as_float(emu_mma_a[warp][4 * (row % 8) + k % 4][2 * (k / 4) + row / 8]);
  };
  const auto bt = [&](int k, int col) { return __uint_as_float(emu_mma_b[warp][4 * col + k % 4][k / 4]); };  // B(k, col)
  for (int q = 0; q < 4; ++q) {
    const int row = g + 8 * (q / 2), col = 2 * t + q % 2;
    float sum = d[q];
    for (int k = 0; k < 8; ++k) sum += at(row, k) * bt(k, col);
    d[q] = sum;
  }
  __syncwarp();
}
#endif
// d += a·b to about fp32's accuracy, the small terms first. d: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
__device__ __forceinline__ void mma_3x(float (&d)[4], const FragA& a, const FragB& b) {
  mma_tf32(d, a.lo, b.hi);
  mma_tf32(d, a.hi, b.lo);
  mma_tf32(d, a.hi, b.hi);
}
// The A fragment of rows [m0, m0 + 16), columns [k0, k0 + 8) from shared memory: A(m, k) at a[m·ld + k]
// (rows) or at a[k·ld + m] (columns: the matrix stored transposed).
__device__ __forceinline__ FragA frag_a_rows(const float* a, int ld, int m0, int k0) {
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4;
  FragA f;
  f.set(a[(m0 + g) * ld + k0 + t4], a[(m0 + g + 8) * ld + k0 + t4], a[(m0 + g) * ld + k0 + t4 + 4], a[(m0 + g + 8) * ld + k0 + t4 + 4]);
  return f;
}
__device__ __forceinline__ FragA frag_a_cols(const float* a, int ld, int m0, int k0) {
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4;
  FragA f;
  f.set(a[(k0 + t4) * ld + m0 + g], a[(k0 + t4) * ld + m0 + g + 8], a[(k0 + t4 + 4) * ld + m0 + g], a[(k0 + t4 + 4) * ld + m0 + g + 8]);
  return f;
}
// acc[nt] += a·B over k in [k0, k0 + 8) for four n8 tiles at columns n0 + 8·nt: B(k, n) at b[k·ld + n].
__device__ __forceinline__ void mma_n4(float (&acc)[4][4], const FragA& a, const float* b, int ld, int k0, int n0) {
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    FragB f;
    f.set(b[(k0 + t4) * ld + n0 + 8 * nt + g], b[(k0 + t4 + 4) * ld + n0 + 8 * nt + g]);
    mma_3x(acc[nt], a, f);
  }
}
// ---- wgmma (the scan) ---------------------------------------------------------------------------------

// The scan's products run on Hopper's warpgroup MMA: wgmma m64n32k8 in TF32, fp32 accumulation, A (64
// rows × 8 k) in registers — each warp the m16n8k8 A fragment of its 16 rows, split hi + lo here —
// and B (32 columns × 8 k) in shared memory, K-major in the 128-byte-swizzled layout (wgmma.cuh's, 32
// TF32 of k a 128-byte row, chunk c of row n at c ^ (n mod 8), 8-row atoms of 1,024 bytes), its hi and
// lo planes written split by the block. Three products a k-step (lo·hi, hi·lo, hi·hi) as 3xTF32.
// The accumulator of thread t: rows 16·(t/32 mod 4) + g (+ 8), columns 8j + 2·t4 (+ 1) at d[4j…4j+3].
struct WgFrag {  // a k-step's A fragment of the warp, split
  uint32_t hi[4], lo[4];
};
// The byte offset of B(k, n) in a swizzled operand of 32 columns: K tiles of 32, 4,096 bytes each (in
// each, wg_swizzle's chunk (k mod 32) / 4 of row n; signed arithmetic, as measured).
__device__ __forceinline__ int wg_b_offset(int k, int n) { return (k / 32) * 4096 + n * 128 + ((((k % 32) / 4) ^ (n % 8)) << 4) + (k % 4) * 4; }
// The descriptor of k-step s (k = 8s … 8s + 7) of such an operand at shared address `at` (1,024-aligned):
// the K tile, then 32 bytes a step inside its rows.
__device__ __forceinline__ uint64_t wg_b_desc(uint32_t at, int s) { return wg_desc(at + static_cast<uint32_t>((s / 4) * 4096 + (s % 4) * 32)); }
#ifndef PLOW_CUDA_EMU
// d += A·B, one m64n32k8 TF32 product (a: four registers of the warp's fragment; b: B's descriptor).
__device__ __forceinline__ void wg_mma_tf32(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// A fragment an in-flight wgmma reads, pinned in its registers until this point (after a wait); the
// accumulator takes wgmma.cuh's wg_fence_operand.
__device__ __forceinline__ void wg_pin(WgFrag& f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(f.hi[i]), "+r"(f.lo[i])::"memory");
}
#else
// The emulator's wgmma: the warpgroup's fragments and accumulators through an exchange, B read from the
// emulated shared memory through the descriptor and the swizzle as the hardware reads it (the address's
// bits 4–6 XOR bits 7–9), the product in fp32 at issue (wgmma.cuh's fences, commit and waits are the
// no-ops below the namespace, which also holds wg_smem's stand-in).
inline uint32_t emu_wg_a[4][128][4];
inline float emu_wg_d[4][128][16];
inline void wg_pin(WgFrag&) {}
inline void wg_mma_tf32(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  const int t = static_cast<int>(threadIdx.x), wg = t / 128, i = t % 128;
  for (int r = 0; r < 4; ++r) emu_wg_a[wg][i][r] = a[r];
  for (int r = 0; r < 16; ++r) emu_wg_d[wg][i][r] = d[r];
  named_sync(12 + wg, 128);
  const uint32_t start = static_cast<uint32_t>(b & 0x3FFF) << 4, stride = static_cast<uint32_t>((b >> 32) & 0x3FFF) << 4;
  const auto at = [&](int row, int k) {  // A(row, k): warp row / 16, lane 4·(row mod 8) + k mod 4, register 2·(k / 4) + (row mod 16) / 8
    return __uint_as_float(emu_wg_a[wg][32 * (row / 16) + 4 * (row % 8) + k % 4][2 * (k / 4) + (row % 16) / 8]);
  };
  const auto bt = [&](int k, int n) {
    const uint32_t logical = start + static_cast<uint32_t>(n / 8) * stride + static_cast<uint32_t>(n % 8) * 128 + static_cast<uint32_t>(k) * 4;
    const uint32_t physical = logical ^ (((logical >> 7) & 7) << 4);
    float x;
    std::memcpy(&x, emu_wg_smem + physical, 4);
    return x;
  };
  const int lane = i % 32, g = lane / 4, t4 = lane % 4, row0 = 16 * (i / 32);
  for (int j = 0; j < 4; ++j) {
    for (int q = 0; q < 4; ++q) {
      const int row = row0 + g + 8 * (q / 2), col = 8 * j + 2 * t4 + q % 2;
      float sum = emu_wg_d[wg][i][4 * j + q];
      for (int k = 0; k < 8; ++k) sum += at(row, k) * bt(k, col);
      d[4 * j + q] = sum;
    }
  }
  named_sync(12 + wg, 128);
}
#endif
// d += A·B to about fp32's accuracy in one k-step: B's hi and lo planes at b_hi / b_lo (descriptors).
__device__ __forceinline__ void wg_mma_3x(float (&d)[16], const WgFrag& a, uint64_t b_hi, uint64_t b_lo) {
  wg_mma_tf32(d, a.lo, b_hi);
  wg_mma_tf32(d, a.hi, b_lo);
  wg_mma_tf32(d, a.hi, b_hi);
}
// The warp's A fragment of k-step s from fp32 rows: A(m, k) at a[(m0 + m)·ld + k] (rows) or
// a[k·ld + m0 + m] (columns: stored transposed), m the warp's 16 rows.
__device__ __forceinline__ WgFrag wg_frag_rows(const float* a, int ld, int m0, int s) {
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4, k0 = 8 * s;
  const float* r = a + (m0 + g) * ld + k0 + t4;
  WgFrag f;
  tf32_split(r[0], f.hi[0], f.lo[0]);
  tf32_split(r[8 * ld], f.hi[1], f.lo[1]);
  tf32_split(r[4], f.hi[2], f.lo[2]);
  tf32_split(r[8 * ld + 4], f.hi[3], f.lo[3]);
  return f;
}
__device__ __forceinline__ WgFrag wg_frag_cols(const float* a, int ld, int m0, int s) {
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4, k0 = 8 * s;
  const float* c = a + (k0 + t4) * ld + m0 + g;
  WgFrag f;
  tf32_split(c[0], f.hi[0], f.lo[0]);
  tf32_split(c[8], f.hi[1], f.lo[1]);
  tf32_split(c[4 * ld], f.hi[2], f.lo[2]);
  tf32_split(c[4 * ld + 8], f.hi[3], f.lo[3]);
  return f;
}
// d += A·B over k-steps [0, steps) (a multiple of 2·kWgGroup), A's fragments from frag(s), B's planes
// at b_hi / b_lo: kWgGroup k-steps a group in flight while the next group's fragments are formed, each
// group's fragment registers held until the group is done (wgmma reads them asynchronously).
constexpr int kWgGroup = 1;
template <class Frag>
__device__ __forceinline__ void wg_product(float (&d)[16], int steps, Frag frag, uint32_t b_hi, uint32_t b_lo) {
  WgFrag f[2][kWgGroup] = {};
#pragma unroll 1
  for (int s0 = 0; s0 < steps; s0 += 2 * kWgGroup) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int s1 = s0 + kWgGroup * half;
#pragma unroll
      for (int x = 0; x < kWgGroup; ++x) f[half][x] = frag(s1 + x);
      wg_fence();  // the fragments' (and the accumulator's) registers written before wgmma reads them
#pragma unroll
      for (int x = 0; x < kWgGroup; ++x) wg_mma_3x(d, f[half][x], wg_b_desc(b_hi, s1 + x), wg_b_desc(b_lo, s1 + x));
      wg_commit();
      wg_wait_prior();  // the group before this one is done: its fragments may be rewritten
#pragma unroll
      for (int x = 0; x < kWgGroup; ++x) wg_pin(f[1 - half][x]);
    }
  }
  wg_wait();
#pragma unroll
  for (int x = 0; x < kWgGroup; ++x) wg_pin(f[0][x]), wg_pin(f[1][x]);
  wg_fence_operand(d);
}

}  // namespace plow::cuda::kda_planned
