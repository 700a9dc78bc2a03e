// KDA's chunked delta rule (spec/MODEL.md §6, C = 64) of a prefill step in two launches (kda_prefill.cu;
// the emulator test runs the same blocks on the host), as fla's chunk_kda splits it: everything a chunk needs that does not depend on the state is computed for
// every (chunk, head) at once, so the sequential part per chunk is two levels of products.
//  1. prep, a block per (chunk, head), two blocks an SM: q̂, k̂ (l2-normalized, q̂ times 1/√d), γ (the
//     CPU's sequential sum per channel), A(r, j) = β_r Σ_c k̂_r k̂_j e^{γ_r−γ_j} (j < r) and
//     M(r, j) = Σ_c q̂_r k̂_j e^{γ_r−γ_j} (j ≤ r), T' = (I + A)⁻¹·diag(β), then W = T'·(K⊙e^γ) and
//     U = T'·V; the record (kda_prefill_kernels.h) holds Q⊙e^γ, K⊙e^{γ_n−γ}, W, U, M and e^{γ_n}. The
//     channels go through shared memory in two halves of 64 (A and M accumulate in registers across
//     them), which keeps a block at 89 KB.
//  2. scan, a block per (32 value columns, head, sequence), chunk after chunk with the state slice S₀
//     in shared memory: level 1, V_new = U − W·S₀ and O = (Q⊙e^γ)·S₀ side by side; level 2, O += M·V_new
//     and S ← diag(e^{γ_n})·S₀ + (K⊙e^{γ_n−γ})ᵀ·V_new side by side. The next chunk's W and Q⊙e^γ load
//     (cp.async) during level 2, its other rows during level 1.
// Pairwise decays are never factored over a whole chunk (the K3 gate takes γ to −320): the diagonal
// 16×16 blocks take e^{γ_r−γ_j} per (pair, channel), the blocks below them factor through the block
// row's first position (both factors ≤ 1), as the op body (ops/kda_chunked.cuh), whose numerics this
// keeps: products in 3xTF32 (each operand split hi + lo, three mma.sync, fp32 accumulation).
#pragma once

#include "runtime/cuda/kda_prefill_kernels.h"
#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda::kda_planned {

constexpr int kC = kKdaChunk;
constexpr int kD = kKdaMaxHeadDim;
constexpr int kHalf = kD / 2;  // channels a prep pass stages
constexpr int kBlockThreads = 256;
constexpr int kBlockWarps = kBlockThreads / 32;
constexpr int kCols = 32;  // value columns of a scan block
constexpr int kKdaPrefillThreads = kBlockThreads;
constexpr int kKdaScanCols = kCols;
static_assert(kC == 64 && kD == 128, "the tilings below assume C = 64, d ≤ 128");

// 3xTF32: an operand as its TF32 head (rounded to nearest, ties away: the bits' add and mask) and the
// rest truncated to TF32 (|rest| ≤ 2⁻¹¹|x|, so the split loses at most 2⁻²¹|x|). Four integer and float
// instructions. With cvt.rna.tf32.f32 instead the scan issued ~1.8× the instructions counted as if the
// cvt were one (ncu); this form and the B operands stored split (mma_n4_split) took the scans of an 8K
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
// The same with B stored already split: its TF32 heads at hi, the rests at lo (SplitRows).
__device__ __forceinline__ void mma_n4_split(float (&acc)[4][4], const FragA& a, const uint32_t* hi, const uint32_t* lo, int ld, int k0, int n0) {
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int at0 = (k0 + t4) * ld + n0 + 8 * nt + g, at1 = at0 + 4 * ld;
    FragB f;
    f.hi[0] = hi[at0];
    f.hi[1] = hi[at1];
    f.lo[0] = lo[at0];
    f.lo[1] = lo[at1];
    mma_3x(acc[nt], a, f);
  }
}
// Stores x split for mma_n4_split.
__device__ __forceinline__ void store_split(uint32_t* hi, uint32_t* lo, int at, float x) {
  uint32_t h, l;
  tf32_split(x, h, l);
  hi[at] = h;
  lo[at] = l;
}

// ---- prep --------------------------------------------------------------------------------------------

// Shared memory of a prep block, floats. Channel-major [c][t] arrays have row stride kLd ≡ 8 (mod 32):
// a warp reading 32 positions of a channel, and the mma fragments (8 positions × 4 channels), hit 32
// banks. The staging region later holds the products' B operand [t][kBld] and T' [r][kTpld], and the
// inverse's scratch before them.
struct PrepSmem {
  static constexpr int kLd = kC + 8;
  static constexpr int kAld = kC + 1;
  static constexpr int kBld = kD + 8;
  static constexpr int kTpld = kC + 4;
  static constexpr int kQ = 0;  // q̂ [kHalf][kLd]
  static constexpr int kK = kQ + kHalf * kLd;
  static constexpr int kG = kK + kHalf * kLd;  // γ
  static constexpr int kB = 0;                 // [C][kBld], after the channels
  static constexpr int kTp = kB + kC * kBld;   // T' [C][kTpld]
  static constexpr int kAm = kG + kHalf * kLd;  // M(r, j) at [r][j] (j ≤ r), A(r, j) at [j][r] (j < r)
  static constexpr int kT = kAm + kC * kAld;    // (I + A)⁻¹ at [r][c]
  static constexpr int kBeta = kT + kC * kAld;
  static constexpr int kRq = kBeta + kC;  // q's and k's row scales
  static constexpr int kRk = kRq + kC;
  static constexpr int kFloats = kRk + kC;
  static_assert(kTp + kC * kTpld <= kAm, "B and T' fit the staging region");
  static_assert(kB % 4 == 0 && kBld % 4 == 0, "16-byte rows of B");
};
constexpr int kKdaPrepBytes = PrepSmem::kFloats * 4;
constexpr int kDiagRounds = (kC / 16 * 136 * 4 + kBlockThreads - 1) / kBlockThreads;  // (pair, channel quarter) units

// Diagonal-block unit u: quarter u mod 4 of pair u / 4, pair q of block b = q / 136 in row order.
__device__ __forceinline__ void diag_pair(int u, int& r, int& j, int& quarter, bool& in_block) {
  quarter = u % 4;
  const int q = u / 4, b = q / 136, w = q % 136;
  int rr = static_cast<int>((sqrtf(8.0f * static_cast<float>(w) + 1.0f) - 1.0f) * 0.5f);
  while (rr * (rr + 1) / 2 > w) --rr;  // exact whatever sqrtf's rounding
  while ((rr + 1) * (rr + 2) / 2 <= w) ++rr;
  r = 16 * b + rr;
  j = 16 * b + w - rr * (rr + 1) / 2;
  in_block = b < kC / 16;
}

// Below-diagonal unit u < 12: block row R (rows 16R…16R+15), 8-column tile nt of columns [0, 16R).
__device__ __forceinline__ void below_unit(int u, int& R, int& nt) {
  R = u < 2 ? 1 : u < 6 ? 2 : 3;
  nt = u < 2 ? u : u < 6 ? u - 2 : u - 6;
}

// out = T'·B over [C][kD] (T' at kTp, B at kB), to rec + at: warp w takes row tiles w mod 2 and
// 3 − w mod 2 (balanced: T' is lower triangular) and 32 columns, four n8 tiles sharing each A fragment.
__device__ __forceinline__ void prep_product(const float* sm, float* rec_out) {
  using P = PrepSmem;
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4, warp = warp_id();
  const float *tp = sm + P::kTp, *b = sm + P::kB;
  const int n_base = 32 * (warp / 2);
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int m0 = 16 * (s == 0 ? warp % 2 : 3 - warp % 2);
    float acc[4][4] = {};
    for (int k0 = 0; k0 < m0 + 16; k0 += 8) mma_n4(acc, frag_a_rows(tp, P::kTpld, m0, k0), b, P::kBld, k0, n_base);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = n_base + 8 * nt + 2 * t4;
      reinterpret_cast<float2*>(rec_out + (m0 + g) * kD + col)[0] = make_float2(acc[nt][0], acc[nt][1]);
      reinterpret_cast<float2*>(rec_out + (m0 + g + 8) * kD + col)[0] = make_float2(acc[nt][2], acc[nt][3]);
    }
  }
}

// One prep block: item = chunk · heads + head of the batch; sm: kKdaPrepBytes of shared memory.
__device__ __forceinline__ void kda_prep_block(const KdaPrefillArgs& a, float* sm, int item) {
  using P = PrepSmem;
  const int chunk = item / a.heads, h = item % a.heads, d = a.d;
  const int row0 = a.chunk_row0[chunk], n = a.chunk_len[chunk];
  float* rec = a.records + static_cast<int64_t>(item) * kKdaRecFloats;
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id(), g = lane / 4, t4 = lane % 4;
  float *sq = sm + P::kQ, *sk = sm + P::kK, *sg = sm + P::kG, *am = sm + P::kAm, *T = sm + P::kT, *beta = sm + P::kBeta;
  const int64_t col0 = static_cast<int64_t>(h) * d;

  // Row scales (ε = 1e−6 on the sum, inside the root; q also times 1/√d) and β: a warp takes 8 rows,
  // lane l channels l, l + 32, … (whole 128-byte lines), every load of the thread in flight at once (a
  // loop over rows waited a DRAM latency per row).
  {
    constexpr int kRows = kC / kBlockWarps;
    float qv[kRows][kD / 32], kv[kRows][kD / 32];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int t = warp * kRows + r;
#pragma unroll
      for (int i = 0; i < kD / 32; ++i) {
        const int c = lane + 32 * i;
        const bool real = t < n && c < d;
        qv[r][i] = real ? a.q[(row0 + t) * a.q_stride + col0 + c] : 0.0f;
        kv[r][i] = real ? a.k[(row0 + t) * a.k_stride + col0 + c] : 0.0f;
      }
    }
    const int tb = warp * kRows + lane;
    const float b = lane < kRows && tb < n ? a.beta[(row0 + tb) * a.beta_stride + h] : 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int t = warp * kRows + r;
      float sum_q = 0.0f, sum_k = 0.0f;
#pragma unroll
      for (int i = 0; i < kD / 32; ++i) {
        sum_q += qv[r][i] * qv[r][i];
        sum_k += kv[r][i] * kv[r][i];
      }
      sum_q = warp_sum(sum_q);
      sum_k = warp_sum(sum_k);
      if (lane == 0) {
        sm[P::kRq + t] = t < n ? (1.0f / sqrtf(static_cast<float>(d))) / sqrtf(sum_q + 1e-6f) : 0.0f;
        sm[P::kRk + t] = t < n ? 1.0f / sqrtf(sum_k + 1e-6f) : 0.0f;
      }
    }
    if (lane < kRows) beta[tb] = b;
  }
  __syncthreads();

  float diag_k[kDiagRounds] = {}, diag_q[kDiagRounds] = {};  // A's and M's diagonal blocks, per unit
  float below_k[2][4] = {}, below_q[2][4] = {};               // and the blocks below them, per warp unit
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    const int c0 = half * kHalf;
    // q̂, k̂, g of channels [c0, c0 + 64) into [c][t]: tiles of 8 positions × 4 channels (lane
    // 8·(c mod 4) + t mod 8), eight tiles' loads in flight a thread.
#pragma unroll 1
    for (int round = 0; round < 2; ++round) {
      float vq[8], vk[8], vg[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int tile = warp + kBlockWarps * (8 * round + i), t = tile % 8 * 8 + lane % 8, c = tile / 8 * 4 + lane / 8;
        const bool real = t < n && c0 + c < d;
        vq[i] = real ? a.q[(row0 + t) * a.q_stride + col0 + c0 + c] : 0.0f;
        vk[i] = real ? a.k[(row0 + t) * a.k_stride + col0 + c0 + c] : 0.0f;
        vg[i] = real ? a.g[(row0 + t) * a.g_stride + col0 + c0 + c] : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int tile = warp + kBlockWarps * (8 * round + i), t = tile % 8 * 8 + lane % 8, c = tile / 8 * 4 + lane / 8;
        sq[c * P::kLd + t] = vq[i] * sm[P::kRq + t];
        sk[c * P::kLd + t] = vk[i] * sm[P::kRk + t];
        sg[c * P::kLd + t] = vg[i];
      }
    }
    static_assert(kC / 8 * (kHalf / 4) == 16 * kBlockWarps, "two rounds of eight tiles a warp");
    __syncthreads();
    if (tid < kHalf) {  // γ of channel tid: the CPU's order
      float sum = 0.0f;
      for (int t = 0; t < kC; ++t) sg[tid * P::kLd + t] = (sum += sg[tid * P::kLd + t]);
    }
    __syncthreads();
    // Diagonal blocks on SIMT: channels ≡ quarter (mod 4) of this half.
#pragma unroll
    for (int m = 0; m < kDiagRounds; ++m) {
      int r, j, quarter;
      bool in_block;
      diag_pair(tid + kBlockThreads * m, r, j, quarter, in_block);
      if (in_block && r < n) {
#pragma unroll 4
        for (int c = quarter; c < kHalf; c += 4) {
          const float* gc = sg + c * P::kLd;
          const float kj = sk[c * P::kLd + j] * __expf(gc[r] - gc[j]);  // ≤ 1: fast exp's error is absolute ≲ 1e−7
          diag_k[m] += sk[c * P::kLd + r] * kj;
          diag_q[m] += sq[c * P::kLd + r] * kj;
        }
      }
    }
    // Below the diagonal on tensor cores, through the block row's first position (both factors ≤ 1).
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int u = warp + kBlockWarps * s;
      int R, nt;
      below_unit(u, R, nt);
      if (u < 12 && 16 * R < n) {  // warp-uniform
        const int ref = 16 * R, top = ref + g, bottom = top + 8, j = 8 * nt + g;
#pragma unroll 2
        for (int k0 = 0; k0 < kHalf; k0 += 8) {
          const int lo = (k0 + t4) * P::kLd, hi = lo + 4 * P::kLd;  // channels k0 + t4 and k0 + t4 + 4
          const float e0 = __expf(sg[lo + top] - sg[lo + ref]), e1 = __expf(sg[lo + bottom] - sg[lo + ref]);
          const float e2 = __expf(sg[hi + top] - sg[hi + ref]), e3 = __expf(sg[hi + bottom] - sg[hi + ref]);
          FragA fk, fq;
          fk.set(sk[lo + top] * e0, sk[lo + bottom] * e1, sk[hi + top] * e2, sk[hi + bottom] * e3);
          fq.set(sq[lo + top] * e0, sq[lo + bottom] * e1, sq[hi + top] * e2, sq[hi + bottom] * e3);
          FragB fb;
          fb.set(sk[lo + j] * __expf(sg[lo + ref] - sg[lo + j]), sk[hi + j] * __expf(sg[hi + ref] - sg[hi + j]));
          mma_3x(below_k[s], fk, fb);
          mma_3x(below_q[s], fq, fb);
        }
      }
    }
    // This half's record rows: Q⊙e^γ, K⊙e^{γ_n−γ}, and K⊙e^γ into W's place (the product below reads
    // it back). 16-byte stores of 4 channels of a position; lanes take consecutive positions.
    for (int i = tid; i < kC * kHalf / 4; i += kBlockThreads) {
      const int t = i % kC, c = 4 * (i / kC);
      float qv[4], ev[4], kv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float* gc = sg + (c + e) * P::kLd;
        const float decayed = __expf(gc[t]), to_end = __expf(gc[n - 1] - gc[t]);  // arguments ≤ 0
        const float k = sk[(c + e) * P::kLd + t];
        qv[e] = sq[(c + e) * P::kLd + t] * decayed;
        ev[e] = k * to_end;
        kv[e] = k * decayed;
      }
      const int64_t at = static_cast<int64_t>(t) * kD + c0 + c;
      *reinterpret_cast<float4*>(rec + kKdaRecQg + at) = make_float4(qv[0], qv[1], qv[2], qv[3]);
      *reinterpret_cast<float4*>(rec + kKdaRecKe + at) = make_float4(ev[0], ev[1], ev[2], ev[3]);
      *reinterpret_cast<float4*>(rec + kKdaRecW + at) = make_float4(kv[0], kv[1], kv[2], kv[3]);
    }
    if (tid < kHalf) rec[kKdaRecDecay + c0 + tid] = c0 + tid < d ? __expf(sg[tid * P::kLd + n - 1]) : 0.0f;
    __syncthreads();  // the next half restages the channels
  }

  // A and M into shared memory: the diagonal units' quarters (adjacent lanes) summed, the rest as is.
#pragma unroll
  for (int m = 0; m < kDiagRounds; ++m) {
    int r, j, quarter;
    bool in_block;
    diag_pair(tid + kBlockThreads * m, r, j, quarter, in_block);
    float dk = diag_k[m], dq = diag_q[m];
    dk += __shfl_xor_sync(0xffffffffu, dk, 1);
    dq += __shfl_xor_sync(0xffffffffu, dq, 1);
    dk += __shfl_xor_sync(0xffffffffu, dk, 2);
    dq += __shfl_xor_sync(0xffffffffu, dq, 2);
    if (in_block && r < n && quarter == 0) {
      am[r * P::kAld + j] = dq;
      if (j < r) am[j * P::kAld + r] = beta[r] * dk;
    }
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int u = warp + kBlockWarps * s;
    int R, nt;
    below_unit(u, R, nt);
    if (u < 12 && 16 * R < n) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = 16 * R + g + 8 * (q / 2), col = 8 * nt + 2 * t4 + q % 2;
        if (r < n) {
          am[r * P::kAld + col] = below_q[s][q];
          am[col * P::kAld + r] = beta[r] * below_k[s][q];
        }
      }
    }
  }
  __syncthreads();

  // T = (I + A)⁻¹ by 16-position blocks (rows past n are left undefined; T' zeroes them): the diagonal
  // blocks by forward substitution, four lanes a column (a warp's 8 columns share a block); then the
  // blocks below by distance, T_ij = −T_ii·Σ_{j≤k<i} A_ik T_kj, X in the staging region.
  {
    const int c = tid / 4, part = tid % 4, first = c / 16 * 16;
    const int end = n < first + 16 ? n : first + 16;
    if (part == 0) T[c * P::kAld + c] = 1.0f;
    __syncwarp();
    for (int t = first + 1; t < end; ++t) {
      float sum = 0.0f;
      if (t > c) {
        for (int j = c + part; j < t; j += 4) sum += am[j * P::kAld + t] * T[j * P::kAld + c];
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (part == 0 && t > c) T[t * P::kAld + c] = -sum;
      __syncwarp();  // row t is read by the column's lanes from the next row on
    }
    static_assert(kBlockThreads == 4 * kC, "four lanes a column");
  }
  __syncthreads();
  constexpr int kXld = 17;
  float* scratch = sm;  // [3][16][kXld]
  for (int distance = 1; distance < kC / 16; ++distance) {
    const int outputs = (kC / 16 - distance) * 256;
    for (int o = tid; o < outputs; o += kBlockThreads) {
      const int bi = o / 256, i = distance + bi, r = o / 16 % 16, cc = o % 16;
      const int row = 16 * i + r, col = 16 * (i - distance) + cc;
      float sum = 0.0f;
      if (row < n) {
        for (int k = col; k < 16 * i; ++k) sum += am[k * P::kAld + row] * T[k * P::kAld + col];  // T(k, col) = 0 for k < col
      }
      scratch[(bi * 16 + r) * kXld + cc] = sum;
    }
    __syncthreads();
    for (int o = tid; o < outputs; o += kBlockThreads) {
      const int bi = o / 256, i = distance + bi, r = o / 16 % 16, cc = o % 16;
      const int row = 16 * i + r, col = 16 * (i - distance) + cc;
      if (row >= n) continue;
      float sum = scratch[(bi * 16 + r) * kXld + cc];  // T_ii's unit diagonal
      for (int m = 0; m < r; ++m) sum += T[row * P::kAld + 16 * i + m] * scratch[(bi * 16 + m) * kXld + cc];
      T[row * P::kAld + col] = -sum;
    }
    __syncthreads();
  }

  // T' = T·diag(β) (zero above the diagonal and past n) for the products; M to the record.
  for (int i = tid; i < kC * kC / 4; i += kBlockThreads) {
    const int r = i / (kC / 4), j0 = 4 * (i % (kC / 4));
    float tv[4], mv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + e;
      const bool lower = r < n && j <= r;
      tv[e] = lower ? T[r * P::kAld + j] * beta[j] : 0.0f;
      mv[e] = lower ? am[r * P::kAld + j] : 0.0f;
    }
    *reinterpret_cast<float4*>(sm + P::kTp + r * P::kTpld + j0) = make_float4(tv[0], tv[1], tv[2], tv[3]);
    *reinterpret_cast<float4*>(rec + kKdaRecM + r * kC + j0) = make_float4(mv[0], mv[1], mv[2], mv[3]);
  }
  // W = T'·(K⊙e^γ): the rows written above, back from global memory (this block's own stores: visible
  // after the barrier), every load of the thread in flight before its stores.
  {
    constexpr int kPer = kC * kD / 4 / kBlockThreads;
    float4 rows[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = tid + kBlockThreads * e, t = i / (kD / 4), c = 4 * (i % (kD / 4));
      rows[e] = *reinterpret_cast<const float4*>(rec + kKdaRecW + t * kD + c);
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = tid + kBlockThreads * e, t = i / (kD / 4), c = 4 * (i % (kD / 4));
      *reinterpret_cast<float4*>(sm + P::kB + t * P::kBld + c) = rows[e];
    }
  }
  __syncthreads();
  prep_product(sm, rec + kKdaRecW);
  __syncthreads();
  // U = T'·V (zero past n and d): lanes over a row's channels, 32 loads of the thread in flight.
  {
    constexpr int kPer = kC * kD / kBlockThreads;
    float vals[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = tid + kBlockThreads * e, t = i / kD, c = i % kD;
      vals[e] = t < n && c < d ? a.v[(row0 + t) * a.v_stride + col0 + c] : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = tid + kBlockThreads * e, t = i / kD, c = i % kD;
      sm[P::kB + t * P::kBld + c] = vals[e];
    }
  }
  __syncthreads();
  prep_product(sm, rec + kKdaRecU);
}

// ---- scan --------------------------------------------------------------------------------------------

// Shared memory of a scan block, floats. Strides: ≡ 4 (mod 32) for A operands read row-major (W, Q⊙e^γ,
// M), ≡ 8 for B operands and for K⊙e^{γ_n−γ}, which the update reads transposed.
struct ScanSmem {
  static constexpr int kSld = kCols + 8;
  static constexpr int kAld = kD + 4;
  static constexpr int kKld = kD + 8;
  static constexpr int kMld = kC + 4;
  static constexpr int kS = 0;                     // S₀ [kD][kSld]: key rows × the block's value columns
  static constexpr int kW = kS + kD * kSld;        // W [C][kAld]
  static constexpr int kQ = kW + kC * kAld;        // Q⊙e^γ [C][kAld]
  static constexpr int kKe = kQ + kC * kAld;       // K⊙e^{γ_n−γ} [C][kKld]
  static constexpr int kM = kKe + kC * kKld;       // M [C][kMld]
  static constexpr int kU = kM + kC * kMld;        // U's columns [C][kSld]
  static constexpr int kDecay = kU + kC * kSld;    // e^{γ_n} [kD]
  static constexpr int kSHi = kDecay + kD;         // S₀ split for level 1's B operand (store_split)
  static constexpr int kSLo = kSHi + kD * kSld;
  static constexpr int kVHi = kSLo + kD * kSld;    // V_new split for level 2's [C][kSld]
  static constexpr int kVLo = kVHi + kC * kSld;
  static constexpr int kFloats = kVLo + kC * kSld;
  static_assert(kW % 4 == 0 && kQ % 4 == 0 && kKe % 4 == 0 && kM % 4 == 0 && kU % 4 == 0 && kDecay % 4 == 0, "cp.async rows of 16 bytes");
};
constexpr int kKdaScanBytes = ScanSmem::kFloats * 4;

// Starts copying rows [C][width] of a record (row stride src_ld) into shared rows of stride ld.
template <int kWidth>
__device__ __forceinline__ void copy_rows(float* dst, int ld, const float* src, int src_ld) {
  constexpr int kVec = kWidth / 4;
  for (int i = static_cast<int>(threadIdx.x); i < kC * kVec; i += kBlockThreads) cp_async16(dst + i / kVec * ld + 4 * (i % kVec), src + i / kVec * src_ld + 4 * (i % kVec));
}

// One scan block: value columns [kKdaScanCols·group, …) of head h over sequence seq's chunks; sm:
// kKdaScanBytes of shared memory.
__device__ __forceinline__ void kda_scan_block(const KdaPrefillArgs& a, float* sm, int group, int h, int seq) {
  using S = ScanSmem;
  const int c0 = kCols * group, d = a.d;
  const int cols = d - c0 < kCols ? d - c0 : kCols;
  const int chunk0 = a.seq_chunk0[seq], chunks = a.seq_chunks[seq];
  float* state = a.state + a.seq_slot[seq] * a.state_slot_floats + static_cast<int64_t>(h) * d * d;
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id(), g = lane / 4, t4 = lane % 4;
  float *st = sm + S::kS, *wb = sm + S::kW, *qb = sm + S::kQ, *kb = sm + S::kKe, *mb = sm + S::kM, *ub = sm + S::kU, *decay = sm + S::kDecay;
  uint32_t *s_hi = reinterpret_cast<uint32_t*>(sm + S::kSHi), *s_lo = reinterpret_cast<uint32_t*>(sm + S::kSLo);
  uint32_t *v_hi = reinterpret_cast<uint32_t*>(sm + S::kVHi), *v_lo = reinterpret_cast<uint32_t*>(sm + S::kVLo);
  const auto record = [&](int k) { return a.records + (static_cast<int64_t>(chunk0 + k) * a.heads + h) * kKdaRecFloats; };
  const auto load_level1 = [&](int k) {  // W and Q⊙e^γ
    copy_rows<kD>(wb, S::kAld, record(k) + kKdaRecW, kD);
    copy_rows<kD>(qb, S::kAld, record(k) + kKdaRecQg, kD);
  };
  const auto load_level2 = [&](int k) {  // K⊙e^{γ_n−γ}, M, U's columns, e^{γ_n}
    const float* rec = record(k);
    copy_rows<kD>(kb, S::kKld, rec + kKdaRecKe, kD);
    copy_rows<kC>(mb, S::kMld, rec + kKdaRecM, kC);
    copy_rows<kCols>(ub, S::kSld, rec + kKdaRecU + c0, kD);
    if (tid < kD / 4) cp_async16(decay + 4 * tid, rec + kKdaRecDecay + 4 * tid);
  };
  for (int i = tid; i < kD * kCols; i += kBlockThreads) {
    const int j = i / kCols, c = i % kCols;
    const float x = j < d && c < cols ? state[static_cast<int64_t>(j) * d + c0 + c] : 0.0f;
    st[j * S::kSld + c] = x;
    store_split(s_hi, s_lo, j * S::kSld + c, x);
  }
  load_level1(0);
  cp_async_commit();
  load_level2(0);
  cp_async_commit();

  const int mt = warp % 4, m0 = 16 * mt;  // level 1 and M·V_new: this warp's 16 positions
  for (int k = 0; k < chunks; ++k) {
    const int row0 = a.chunk_row0[chunk0 + k], n = a.chunk_len[chunk0 + k];
    cp_async_wait<1>();  // W, Q⊙e^γ (the newest group, level 2's rows, may still be in flight)
    __syncthreads();
    // Level 1: warps 0–3 W·S₀, warps 4–7 (Q⊙e^γ)·S₀, 16 positions × the 32 columns each.
    float acc[4][4] = {};
    {
      const float* A = warp < 4 ? wb : qb;
#pragma unroll 2
      for (int k0 = 0; k0 < kD; k0 += 8) mma_n4_split(acc, frag_a_rows(A, S::kAld, m0, k0), s_hi, s_lo, S::kSld, k0, 0);
    }
    cp_async_wait<0>();  // level 2's rows
    __syncthreads();     // and every warp done with W and Q⊙e^γ
    if (warp < 4) {  // V_new = U − W·S₀, split for level 2
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int at = (m0 + g + 8 * (q / 2)) * S::kSld + 8 * nt + 2 * t4 + q % 2;
          store_split(v_hi, v_lo, at, ub[at] - acc[nt][q]);
        }
      }
    }
    __syncthreads();
    if (k + 1 < chunks) load_level1(k + 1);
    cp_async_commit();  // possibly empty: the waits count groups
    // Level 2: warps 4–7 O += M·V_new and the output; every warp 16 key rows of the state update.
    if (warp >= 4) {
      for (int k0 = 0; k0 < m0 + 16; k0 += 8) mma_n4_split(acc, frag_a_rows(mb, S::kMld, m0, k0), v_hi, v_lo, S::kSld, k0, 0);  // M is lower triangular
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int t = m0 + g + 8 * (q / 2), c = 8 * nt + 2 * t4 + q % 2;
          if (t < n && c < cols) a.out[(row0 + t) * a.out_stride + static_cast<int64_t>(h) * d + c0 + c] = round_act(a.out_act, acc[nt][q]);
        }
      }
    }
    {
      const int j0 = 16 * warp;  // key rows
      float upd[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int j = j0 + g + 8 * (q / 2);
          upd[nt][q] = st[j * S::kSld + 8 * nt + 2 * t4 + q % 2] * decay[j];
        }
      }
#pragma unroll 2
      for (int k0 = 0; k0 < kC; k0 += 8) mma_n4_split(upd, frag_a_cols(kb, S::kKld, j0, k0), v_hi, v_lo, S::kSld, k0, 0);  // (K⊙e^{γ_n−γ})ᵀ: A(j, p) = Ke[p][j]
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int at = (j0 + g + 8 * (q / 2)) * S::kSld + 8 * nt + 2 * t4 + q % 2;
          st[at] = upd[nt][q];
          store_split(s_hi, s_lo, at, upd[nt][q]);
        }
      }
    }
    __syncthreads();  // S updated; K⊙e^{γ_n−γ}, M, V_new and e^{γ_n} free
    if (k + 1 < chunks) load_level2(k + 1);
    cp_async_commit();
  }
  cp_async_wait<0>();  // the trailing (empty) groups
  for (int i = tid; i < kD * kCols; i += kBlockThreads) {
    const int j = i / kCols, c = i % kCols;
    if (j < d && c < cols) state[static_cast<int64_t>(j) * d + c0 + c] = st[j * S::kSld + c];
  }
}

}  // namespace plow::cuda::kda_planned
