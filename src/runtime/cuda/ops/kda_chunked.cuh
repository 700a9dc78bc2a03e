// KDA's gated delta rule in the chunked form (spec/MODEL.md §6, C = 64; cpu: ops/kda.cpp chunk_head) for
// the sequences of a step that bring at least kKdaChunkedMinTokens tokens. Everything of a chunk except
// the state is independent of the other chunks, so the op runs in two phases, its tasks cooperating
// through the op's workspace and counters (OpDesc::sync) as split-KV MLA does (mla.cuh):
//  1. prep: each (chunk, head) of those sequences is a work item, taken from a ticket counter (sync[0])
//     by whichever task is free. It stages the chunk's q, k and g, normalizes q and k, sums γ (the CPU's
//     order), forms A(r, j) = β_r Σ_c k̂_r k̂_j e^{γ_r−γ_j} (j < r) and M(r, j) = Σ_c q̂_r k̂_j e^{γ_r−γ_j}
//     (j ≤ r), T' = (I + A)⁻¹·diag(β), and writes them with Q⊙e^γ, K⊙e^γ, K⊙e^{γ_C−γ} and e^{γ_C} to the
//     item's record in the workspace (KdaRecord), then counts itself done (sync[1]).
//  2. scan: once every item is done, each task walks its own slices (a head's group of ≤ kCols value
//     columns) chunk by chunk, the pass's state in shared memory: U = T'·(V − (K⊙e^γ)S₀),
//     O = (Q⊙e^γ)S₀ + M·U, S ← diag(e^{γ_C})S₀ + (K⊙e^{γ_C−γ})ᵀU — four products on tensor cores a
//     chunk, the next chunk's record loaded by cp.async behind them.
// The CPU solves (I + A)U = diag(β)(V − (K⊙e^γ)S₀) by substitution; T'·(…) is the same product with the
// inverse formed first (fp32 rounding apart). Pairwise decays are never factored as e^{γ_r}·e^{−γ_j},
// so the K3 gate (γ to −320 in a chunk) and strong Kimi decays cannot overflow (kda_prep_pairs).
// A task that waits (scan) holds no ticket, and tickets are taken only by running blocks that finish
// their item without waiting: no deadlock, in the megakernel or in eager mode (the argument of mla.cuh).
// The last task to leave resets the counters (sync[2] counts leavers).
//
// The matrix products run as mma.sync m16n8k8 TF32 in the 3xTF32 split (a = a_hi + a_lo, a·b ≈
// a_hi·b_hi + a_hi·b_lo + a_lo·b_hi, fp32 accumulation): about fp32's accuracy, which the KDA core keeps
// (MODEL.md §2), where plain TF32 would lose three decimal digits. Emulator builds (PLOW_CUDA_EMU) run the
// same fragments through shuffles with fp32 products.
#pragma once

#include <cstdint>

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/limits.h"

namespace plow::cuda {

// d += a·b for one m16n8k8 tile: a the row-major 16×8 fragment (a0 (g, t), a1 (g+8, t), a2 (g, t+4),
// a3 (g+8, t+4)), b the 8×8 fragment (b0 (t, g), b1 (t+4, g)), d the 16×8 accumulator (d0 (g, 2t),
// d1 (g, 2t+1), d2 (g+8, 2t), d3 (g+8, 2t+1)); g = lane / 4, t = lane mod 4. Whole warps.
__device__ __forceinline__ void kda_mma(float (&d)[4], const float (&a)[4], const float (&b)[2]) {
#ifndef PLOW_CUDA_EMU
  uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(ah[i]) : "f"(a[i]));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(al[i]) : "f"(a[i] - __uint_as_float(ah[i])));
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bh[i]) : "f"(b[i]));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bl[i]) : "f"(b[i] - __uint_as_float(bh[i])));
  }
  // The small terms first.
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(al[0]), "r"(al[1]), "r"(al[2]), "r"(al[3]), "r"(bh[0]), "r"(bh[1]));
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(ah[0]), "r"(ah[1]), "r"(ah[2]), "r"(ah[3]), "r"(bl[0]), "r"(bl[1]));
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(ah[0]), "r"(ah[1]), "r"(ah[2]), "r"(ah[3]), "r"(bh[0]), "r"(bh[1]));
#else
  const int lane = lane_id(), g = lane / 4, t = lane % 4;
  for (int k = 0; k < 8; ++k) {  // every lane joins every shuffle
    const float a_top = __shfl_sync(0xffffffffu, a[2 * (k / 4)], g * 4 + k % 4);
    const float a_bottom = __shfl_sync(0xffffffffu, a[2 * (k / 4) + 1], g * 4 + k % 4);
    const float b_left = __shfl_sync(0xffffffffu, b[k / 4], (2 * t) * 4 + k % 4);
    const float b_right = __shfl_sync(0xffffffffu, b[k / 4], (2 * t + 1) * 4 + k % 4);
    d[0] += a_top * b_left;
    d[1] += a_top * b_right;
    d[2] += a_bottom * b_left;
    d[3] += a_bottom * b_right;
  }
#endif
}

// acc += A·B over k in [0, k_end) (a multiple of 8) for the 16×8 tile at rows m0, columns n0: A row-major
// (element (m, k) at a[m·lda + k]), B row-major (element (k, n) at b[k·ldb + n]). Whole warps.
__device__ __forceinline__ void kda_tile_product(float (&acc)[4], const float* a, int lda, const float* b, int ldb, int m0, int n0, int k_end) {
  const int lane = lane_id(), g = lane / 4, t = lane % 4;
#pragma unroll 4
  for (int k0 = 0; k0 < k_end; k0 += 8) {
    const float af[4] = {a[(m0 + g) * lda + k0 + t], a[(m0 + g + 8) * lda + k0 + t], a[(m0 + g) * lda + k0 + t + 4], a[(m0 + g + 8) * lda + k0 + t + 4]};
    const float bf[2] = {b[(k0 + t) * ldb + n0 + g], b[(k0 + t + 4) * ldb + n0 + g]};
    kda_mma(acc, af, bf);
  }
}

// The workspace record of one (chunk, head), floats (limits.h kda_record_floats): rows past the chunk's
// length, channels past the head dim and entries above the diagonal are zero.
template <int D>
struct KdaRecord {
  static constexpr int64_t kT = 0;                                 // T' = (I + A)⁻¹·diag(β) [C][C]
  static constexpr int64_t kM = kT + kKdaChunk * kKdaChunk;        // M [C][C]
  static constexpr int64_t kQ = kM + kKdaChunk * kKdaChunk;        // Q⊙e^γ [C][D]
  static constexpr int64_t kK = kQ + kKdaChunk * D;                // K⊙e^γ [C][D]
  static constexpr int64_t kKEnd = kK + kKdaChunk * D;             // K⊙e^{γ_C−γ} [C][D]
  static constexpr int64_t kDecay = kKEnd + kKdaChunk * D;         // e^{γ_C} [D]
  static constexpr int64_t kFloats = kDecay + D;
  static_assert(kFloats == kda_record_floats(D), "the host sizes the workspace by limits.h");
};

// Shared memory of a prep item, in floats after the ticket (32 floats). Channel-major [c][t] arrays have
// row stride kLd ≡ 8 (mod 32): a warp reading one channel of 32 positions, the mma fragments (8
// positions × 4 channels) and the staging's tiles (the same) all hit 32 banks.
//   γ, k̂, q̂ [D][kLd]   cumulative log-decay, normalized k and q (q times 1/√d); zero past n and d
//   AM [C][kAld]        M(r, j) at [r][j] (j ≤ r), A(r, j) at [j][r] (j < r)
//   T [C][kAld]         (I + A)⁻¹ at [r][c] (c ≤ r)
//   β [C], norm partial sums [4][2][C], then the q and k scales [2][C]
template <int D>
struct KdaPrepLayout {
  static constexpr int kLd = kKdaChunk + 8;
  static constexpr int kAld = kKdaChunk + 1;
  static constexpr int kGamma = 32;
  static constexpr int kK = kGamma + D * kLd;
  static constexpr int kQ = kK + D * kLd;
  static constexpr int kAm = kQ + D * kLd;
  static constexpr int kT = kAm + kKdaChunk * kAld;
  static constexpr int kBeta = kT + kKdaChunk * kAld;
  static constexpr int kNorm = kBeta + kKdaChunk;
  static constexpr int kScale = kNorm + 8 * kKdaChunk;
  static constexpr int kFloats = kScale + 2 * kKdaChunk;
  static_assert(kFloats * 4 <= kSharedBytes, "a prep item's tiles must fit the block's shared memory");
};

// Stages positions [row0, row0 + n) of head h: q, k and g into [c][t], β; then the norms (ε = 1e−6 on the
// sum, inside the root; q also times 1/√d: times scale / norm where the CPU divides, then scales — a few
// ulps, far inside the op's bound), and γ as a sequential sum per channel (the CPU's order). Ends with
// the block synchronized.
template <int D>
__device__ void kda_prep_stage(const TaskCtx& ctx, int row0, int n, int64_t h, int64_t d) {
  using PL = KdaPrepLayout<D>;
  float* sm = smem_floats(ctx);
  float *gamma = sm + PL::kGamma, *kh = sm + PL::kK, *qh = sm + PL::kQ;
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id();
  {  // a warp takes tiles of 8 positions × 4 channels (lane 8·(c mod 4) + t mod 8: global rows read in
     // 16-byte pieces), every load of the thread in flight before its first store
    constexpr int kPerWarp = kKdaChunk / 8 * (D / 4) / kWarps;
    const Rows<const float> q = ctx.in_rows(0), k = ctx.in_rows(1), g = ctx.in_rows(3);
    float vq[kPerWarp], vk[kPerWarp], vg[kPerWarp];
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int tile = warp_id() + kWarps * i, t = tile % 8 * 8 + lane % 8, c = tile / 8 * 4 + lane / 8;
      const bool real = t < n && c < d;
      vq[i] = real ? q[row0 + t][h * d + c] : 0.0f;
      vk[i] = real ? k[row0 + t][h * d + c] : 0.0f;
      vg[i] = real ? g[row0 + t][h * d + c] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int tile = warp_id() + kWarps * i, t = tile % 8 * 8 + lane % 8, c = tile / 8 * 4 + lane / 8;
      qh[c * PL::kLd + t] = vq[i];
      kh[c * PL::kLd + t] = vk[i];
      gamma[c * PL::kLd + t] = vg[i];
    }
    static_assert(kKdaChunk / 8 * (D / 4) % kWarps == 0, "whole rounds of tiles");
  }
  for (int t = tid; t < kKdaChunk; t += kThreads) sm[PL::kBeta + t] = t < n ? ctx.in(4, row0 + t)[h] : 0.0f;
  __syncthreads();
  {  // thread (which, part, t): Σ x_c² over c ≡ part (mod 4)
    const int t = tid % kKdaChunk, part = tid / kKdaChunk % 4, which = tid / (4 * kKdaChunk);
    const float* x = which == 0 ? qh : kh;
    float sum = 0.0f;
    for (int c = part; c < D; c += 4) sum += x[c * PL::kLd + t] * x[c * PL::kLd + t];
    sm[PL::kNorm + (part * 2 + which) * kKdaChunk + t] = sum;
  }
  __syncthreads();
  if (tid < D) {  // γ of channel tid
    float sum = 0.0f;
    for (int t = 0; t < kKdaChunk; ++t) gamma[tid * PL::kLd + t] = (sum += gamma[tid * PL::kLd + t]);
  } else if (tid >= 256 && tid < 256 + 2 * kKdaChunk) {  // the scale of (which, t)
    const int which = (tid - 256) / kKdaChunk, t = (tid - 256) % kKdaChunk;
    const float* part = sm + PL::kNorm + which * kKdaChunk + t;
    const float sum = (part[0] + part[2 * kKdaChunk]) + (part[4 * kKdaChunk] + part[6 * kKdaChunk]);
    sm[PL::kScale + which * kKdaChunk + t] = (which == 0 ? 1.0f / sqrtf(static_cast<float>(d)) : 1.0f) / sqrtf(sum + 1e-6f);
  }
  __syncthreads();
  for (int i = tid; i < 2 * D * kKdaChunk; i += kThreads) {
    const int which = i / (D * kKdaChunk), c = i / kKdaChunk % D, t = i % kKdaChunk;
    (which == 0 ? qh : kh)[c * PL::kLd + t] *= sm[PL::kScale + which * kKdaChunk + t];
  }
  __syncthreads();
}

// A and M by 16-position blocks (rows r, columns j ≤ r of the chunk), in two parts:
//  - the diagonal blocks (r, j in one block) on SIMT, the decays exp(γ_r − γ_j) per (pair, channel);
//  - the blocks below them on tensor cores, factored through a reference position: for block row R
//    (rows 16R…16R+15) and any j < 16R, e^{γ_r − γ_j} = e^{γ_r − γ_16R} · e^{γ_16R − γ_j} with both
//    factors ≤ 1 (γ falls with the position), so neither can overflow whatever the gate (a factor that
//    underflows has a product below it); A(r, j) = β_r Σ_c (k̂_r e^{γ_r−γ_16R})_c (k̂_j e^{γ_16R−γ_j})_c,
//    M likewise with q̂_r: warp w < 12 takes block row R and one 8-column tile of it, the factors formed
//    as its fragments load.
// Ends with the block synchronized.
template <int D>
__device__ void kda_prep_pairs(const TaskCtx& ctx, int n) {
  using PL = KdaPrepLayout<D>;
  constexpr int kBlock = 16, kBlockPairs = kBlock * (kBlock + 1) / 2;
  const float* sm = smem_floats(ctx);
  const float *gamma = sm + PL::kGamma, *kh = sm + PL::kK, *qh = sm + PL::kQ, *beta = sm + PL::kBeta;
  float* am = smem_floats(ctx) + PL::kAm;
  const int tid = static_cast<int>(threadIdx.x);
  // Diagonal blocks: unit u is quarter u mod 4 (channels ≡ it mod 4) of pair u / 4, pair q of block
  // b = q / 136 in row order inside the block; the quarters of a pair are adjacent lanes, summed by
  // shuffles (the 544 pairs alone left 480 threads idle through a second round of every channel).
  constexpr int kRounds = (kKdaChunk / kBlock * kBlockPairs * 4 + kThreads - 1) / kThreads;
#pragma unroll 1
  for (int m = 0; m < kRounds; ++m) {
    const int u = tid + kThreads * m, quarter = u % 4, q = u / 4, b = q / kBlockPairs, w = q % kBlockPairs;
    int rr = static_cast<int>((sqrtf(8.0f * static_cast<float>(w) + 1.0f) - 1.0f) * 0.5f);
    while (rr * (rr + 1) / 2 > w) --rr;  // exact whatever sqrtf's rounding
    while ((rr + 1) * (rr + 2) / 2 <= w) ++rr;
    const int r = kBlock * b + rr, j = kBlock * b + w - rr * (rr + 1) / 2;
    const bool real = b < kKdaChunk / kBlock && r < n;
    float acc_k = 0.0f, acc_q = 0.0f;
    if (real) {
#pragma unroll 4
      for (int c = quarter; c < D; c += 4) {
        const float* g = gamma + c * PL::kLd;
        const float kj = kh[c * PL::kLd + j] * __expf(g[r] - g[j]);  // ≤ 1: fast exp's error is absolute ≲ 1e−7
        acc_k += kh[c * PL::kLd + r] * kj;
        acc_q += qh[c * PL::kLd + r] * kj;
      }
    }
    acc_k += __shfl_xor_sync(0xffffffffu, acc_k, 1);
    acc_q += __shfl_xor_sync(0xffffffffu, acc_q, 1);
    acc_k += __shfl_xor_sync(0xffffffffu, acc_k, 2);
    acc_q += __shfl_xor_sync(0xffffffffu, acc_q, 2);
    if (real && quarter == 0) {
      am[r * PL::kAld + j] = acc_q;
      if (j < r) am[j * PL::kAld + r] = beta[r] * acc_k;
    }
  }
  // Below the diagonal.
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4, warp = warp_id();
  const int R = warp < 2 ? 1 : warp < 6 ? 2 : 3, nt = warp < 2 ? warp : warp < 6 ? warp - 2 : warp - 6;
  if (warp < 12 && kBlock * R < n) {  // warp-uniform
    const int ref = kBlock * R, top = ref + g, bottom = top + 8, j = 8 * nt + g;
    float acc_k[4] = {}, acc_q[4] = {};
#pragma unroll 2
    for (int k0 = 0; k0 < D; k0 += 8) {
      const int lo = (k0 + t4) * PL::kLd, hi = lo + 4 * PL::kLd;  // channels k0 + t4 and k0 + t4 + 4
      const float e[4] = {__expf(gamma[lo + top] - gamma[lo + ref]), __expf(gamma[lo + bottom] - gamma[lo + ref]), __expf(gamma[hi + top] - gamma[hi + ref]),
                          __expf(gamma[hi + bottom] - gamma[hi + ref])};
      const float ak[4] = {kh[lo + top] * e[0], kh[lo + bottom] * e[1], kh[hi + top] * e[2], kh[hi + bottom] * e[3]};
      const float aq[4] = {qh[lo + top] * e[0], qh[lo + bottom] * e[1], qh[hi + top] * e[2], qh[hi + bottom] * e[3]};
      const float b[2] = {kh[lo + j] * __expf(gamma[lo + ref] - gamma[lo + j]), kh[hi + j] * __expf(gamma[hi + ref] - gamma[hi + j])};
      kda_mma(acc_k, ak, b);
      kda_mma(acc_q, aq, b);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = top + 8 * (q / 2), col = 8 * nt + 2 * t4 + q % 2;
      if (r < n) {
        am[r * PL::kAld + col] = acc_q[q];
        am[col * PL::kAld + r] = beta[r] * acc_k[q];
      }
    }
  }
  __syncthreads();
}

// T = (I + A)⁻¹ (unit lower triangular) by 16-position blocks (rows past n are left undefined; nothing
// reads them):
//  1. the four diagonal blocks T_bb = (I + A_bb)⁻¹ side by side, by forward substitution: column c by 8
//     adjacent lanes, T(c, c) = 1, T(t, c) = −Σ_{c≤j<t} A(t, j) T(j, c) for t up to the block's end;
//  2. the blocks below by distance from the diagonal (L = 1, 2, 3), from (I + A)T = I:
//     T_ij = −T_ii·X with X = Σ_{j≤k<i} A_ik T_kj (blocks j = i − L, all of one distance at once), on
//     SIMT, X in `scratch` ([3][16][17] floats).
// The one substitution over 64 rows ran a 63-step chain on the warp of column 0 (~20% of an item's
// samples with the barrier waiting on it); the diagonal blocks' chains are 15 steps. Ends with the block
// synchronized.
template <int D>
__device__ void kda_prep_inverse(const TaskCtx& ctx, int n, float* scratch) {
  using PL = KdaPrepLayout<D>;
  constexpr int kBlock = 16, kXld = kBlock + 1;
  const float* am = smem_floats(ctx) + PL::kAm;  // A(r, j) at [j][r]
  float* T = smem_floats(ctx) + PL::kT;
  const int tid = static_cast<int>(threadIdx.x);
  {
    const int c = tid / 8, part = tid % 8, first = c / kBlock * kBlock;
    const int end = n < first + kBlock ? n : first + kBlock;  // warp-uniform: a warp's 4 columns share a block
    static_assert(kThreads == 8 * kKdaChunk, "eight lanes a column");
    if (part == 0) T[c * PL::kAld + c] = 1.0f;
    __syncwarp();
    for (int t = first + 1; t < end; ++t) {
      float sum = 0.0f;
      if (t > c) {
        for (int j = c + part; j < t; j += 8) sum += am[j * PL::kAld + t] * T[j * PL::kAld + c];
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      if (part == 0 && t > c) T[t * PL::kAld + c] = -sum;
      __syncwarp();  // row t is read by the column's lanes from the next row on
    }
  }
  __syncthreads();
  for (int distance = 1; distance < kKdaChunk / kBlock; ++distance) {
    const int outputs = (kKdaChunk / kBlock - distance) * kBlock * kBlock;  // blocks (i, i − distance), i ≥ distance
    for (int o = tid; o < outputs; o += kThreads) {
      const int bi = o / (kBlock * kBlock), i = distance + bi, r = o / kBlock % kBlock, cc = o % kBlock;
      const int row = kBlock * i + r, col = kBlock * (i - distance) + cc;
      float sum = 0.0f;
      if (row < n) {
        for (int k = col; k < kBlock * i; ++k) sum += am[k * PL::kAld + row] * T[k * PL::kAld + col];  // T(k, col) = 0 for k < col
      }
      scratch[(bi * kBlock + r) * kXld + cc] = sum;
    }
    __syncthreads();
    for (int o = tid; o < outputs; o += kThreads) {
      const int bi = o / (kBlock * kBlock), i = distance + bi, r = o / kBlock % kBlock, cc = o % kBlock;
      const int row = kBlock * i + r, col = kBlock * (i - distance) + cc;
      if (row >= n) continue;
      float sum = scratch[(bi * kBlock + r) * kXld + cc];  // T_ii's unit diagonal
      for (int m = 0; m < r; ++m) sum += T[row * PL::kAld + kBlock * i + m] * scratch[(bi * kBlock + m) * kXld + cc];
      T[row * PL::kAld + col] = -sum;
    }
    __syncthreads();
  }
}

// One prep item: positions [row0, row0 + n) of head h into the record `rec` (KdaRecord<D>). Not inlined:
// its registers are not shared with the rest of the op body (inlined, the body spilled ~1.1 KB a thread).
template <int D>
__device__ __noinline__ void kda_prep_item(const TaskCtx& ctx, int row0, int n, int64_t h, int64_t d, float* rec) {
  using PL = KdaPrepLayout<D>;
  using RL = KdaRecord<D>;
  kda_prep_stage<D>(ctx, row0, n, h, d);
  kda_prep_pairs<D>(ctx, n);
  float* sm = smem_floats(ctx);
  const float *gamma = sm + PL::kGamma, *kh = sm + PL::kK, *qh = sm + PL::kQ, *am = sm + PL::kAm, *T = sm + PL::kT, *beta = sm + PL::kBeta;
  // 16-byte stores: the decayed rows by 4 channels of a position (lanes take consecutive positions: the
  // [c][t] reads hit 32 banks), T' and M by 4 columns of a row. The rows first: then γ, k̂ and q̂ are
  // done with, and the inverse takes q̂'s room for its scratch.
  for (int i = static_cast<int>(threadIdx.x); i < kKdaChunk * D / 4; i += kThreads) {  // zero past n and d: k̂ and q̂ are
    const int t = i % kKdaChunk, c0 = 4 * (i / kKdaChunk);
    float qv[4], kv[4], ev[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float* g = gamma + (c0 + e) * PL::kLd;
      const float decayed = __expf(g[t]), to_end = __expf(g[n - 1] - g[t]);  // arguments ≤ 0
      const float k = kh[(c0 + e) * PL::kLd + t];
      qv[e] = qh[(c0 + e) * PL::kLd + t] * decayed;
      kv[e] = k * decayed;
      ev[e] = k * to_end;
    }
    const int64_t at = (static_cast<int64_t>(t) * D + c0) / 4;
    reinterpret_cast<float4*>(rec + RL::kQ)[at] = make_float4(qv[0], qv[1], qv[2], qv[3]);
    reinterpret_cast<float4*>(rec + RL::kK)[at] = make_float4(kv[0], kv[1], kv[2], kv[3]);
    reinterpret_cast<float4*>(rec + RL::kKEnd)[at] = make_float4(ev[0], ev[1], ev[2], ev[3]);
  }
  for (int c = static_cast<int>(threadIdx.x); c < D; c += kThreads) rec[RL::kDecay + c] = c < d ? __expf(gamma[c * PL::kLd + n - 1]) : 0.0f;
  kda_prep_inverse<D>(ctx, n, sm + PL::kQ);  // its first barrier orders the reads of q̂ above before the scratch's writes
  for (int i = static_cast<int>(threadIdx.x); i < kKdaChunk * kKdaChunk / 4; i += kThreads) {
    const int r = i / (kKdaChunk / 4), j0 = 4 * (i % (kKdaChunk / 4));
    float tv[4], mv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + e;
      const bool lower = r < n && j <= r;
      tv[e] = lower ? T[r * PL::kAld + j] * beta[j] : 0.0f;
      mv[e] = lower ? am[r * PL::kAld + j] : 0.0f;
    }
    reinterpret_cast<float4*>(rec + RL::kT)[i] = make_float4(tv[0], tv[1], tv[2], tv[3]);
    reinterpret_cast<float4*>(rec + RL::kM)[i] = make_float4(mv[0], mv[1], mv[2], mv[3]);
  }
}

// Shared memory of a scan pass, in floats after the ticket. Row strides: S and X/U ≡ 8 (mod 32) (read as
// mma B fragments), the staged record rows ≡ 4 (A fragments, either orientation).
//   S [D][kSld]            the pass's state (key rows × value columns), across chunks
//   B0, B1 [C][kSt]        K⊙e^γ, then K⊙e^{γ_C−γ}, in one; Q⊙e^γ in the other (alternating by chunk)
//   T', M [C][kTld]
//   X, U [C][kXld]         V − (K⊙e^γ)S₀ and T'·X for the pass's columns
//   e^{γ_C} [D]
template <int D>
struct KdaScanLayout {
  static constexpr int kCols = KdaLayout<D>::kCols;
  static constexpr int kSld = kCols + 8;
  static constexpr int kSt = D + 4;
  static constexpr int kTld = kKdaChunk + 4;
  static constexpr int kXld = kCols + 8;
  static constexpr int kS = 32;
  static constexpr int kB0 = kS + D * kSld;
  static constexpr int kB1 = kB0 + kKdaChunk * kSt;
  static constexpr int kTp = kB1 + kKdaChunk * kSt;
  static constexpr int kM = kTp + kKdaChunk * kTld;
  static constexpr int kX = kM + kKdaChunk * kTld;
  static constexpr int kU = kX + kKdaChunk * kXld;
  static constexpr int kDecay = kU + kKdaChunk * kXld;
  static constexpr int kFloats = kDecay + D;
  static_assert(kFloats * 4 <= kSharedBytes, "a scan pass's tiles must fit the block's shared memory");
  static_assert(D % 16 == 0 && kCols % 8 == 0, "mma tiles: 16 key rows, 8 value columns");
  static_assert(kB0 % 4 == 0 && kSt % 4 == 0 && kTp % 4 == 0 && kTld % 4 == 0 && kDecay % 4 == 0, "cp.async rows of 16 bytes");
};

// Starts copying a record's [C][W] matrix into shared memory rows of stride ld (cp.async, 16 bytes a
// copy); the caller commits the group.
template <int W>
__device__ __forceinline__ void kda_copy_rows(float* dst, int ld, const float* src) {
  constexpr int kVec = W / 4;
  for (int i = static_cast<int>(threadIdx.x); i < kKdaChunk * kVec; i += kThreads) cp_async16(dst + i / kVec * ld + 4 * (i % kVec), src + 4 * i);
}

// One chunk of a scan pass over value columns [c0, c0 + cols) of head h, positions [row0, row0 + n). On
// entry the chunk's K⊙e^γ (in kbuf), T' and M are copied, its Q⊙e^γ (in qbuf) and e^{γ_C} are the
// newest cp.async group; `next` is the following chunk's record or null. Leaves the next chunk's
// copies in flight the same way (K⊙e^γ into qbuf, Q⊙e^γ into kbuf). Block-uniform.
template <int D>
__device__ void kda_scan_chunk(const TaskCtx& ctx, const float* rec, const float* next, int row0, int n, int64_t h, int64_t d, int c0, int cols, float* kbuf,
                               float* qbuf) {
  using SL = KdaScanLayout<D>;
  using RL = KdaRecord<D>;
  constexpr int kColTiles = SL::kCols / 8;
  float* sm = smem_floats(ctx);
  float *S = sm + SL::kS, *Tp = sm + SL::kTp, *M = sm + SL::kM, *X = sm + SL::kX, *U = sm + SL::kU, *decay = sm + SL::kDecay;
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4;
  cp_async_wait<1>();  // all but the newest group: K⊙e^γ, T', M
  __syncthreads();
  // X = V − (K⊙e^γ)S₀; rows past n are zero (so are K's).
  const Rows<const float> values = ctx.in_rows(2);
  for (int i = warp_id(); i < kKdaChunk / 16 * kColTiles; i += kWarps) {
    const int m0 = i / kColTiles * 16, n0 = i % kColTiles * 8;
    float v[4];  // loaded before the product, in flight behind it
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int t = m0 + g + 8 * (q / 2), c = n0 + 2 * t4 + q % 2;
      v[q] = t < n && c < cols ? values[row0 + t][h * d + c0 + c] : 0.0f;
    }
    float acc[4] = {};
    kda_tile_product(acc, kbuf, SL::kSt, S, SL::kSld, m0, n0, D);
#pragma unroll
    for (int q = 0; q < 4; ++q) X[(m0 + g + 8 * (q / 2)) * SL::kXld + n0 + 2 * t4 + q % 2] = v[q] - acc[q];
  }
  __syncthreads();
  kda_copy_rows<D>(kbuf, SL::kSt, rec + RL::kKEnd);  // K⊙e^{γ_C−γ}, for the update
  cp_async_commit();
  // U = T'·X (T' lower triangular: columns up to the tile's last row).
  for (int i = warp_id(); i < kKdaChunk / 16 * kColTiles; i += kWarps) {
    const int m0 = i / kColTiles * 16, n0 = i % kColTiles * 8;
    float acc[4] = {};
    kda_tile_product(acc, Tp, SL::kTld, X, SL::kXld, m0, n0, m0 + 16);
#pragma unroll
    for (int q = 0; q < 4; ++q) U[(m0 + g + 8 * (q / 2)) * SL::kXld + n0 + 2 * t4 + q % 2] = acc[q];
  }
  cp_async_wait<1>();  // Q⊙e^γ and e^{γ_C}
  __syncthreads();
  // O = (Q⊙e^γ)S₀ + M·U.
  const Rows<float> out = ctx.out_rows();
  const int32_t act = ctx.out_act();
  for (int i = warp_id(); i < kKdaChunk / 16 * kColTiles; i += kWarps) {
    const int m0 = i / kColTiles * 16, n0 = i % kColTiles * 8;
    if (m0 >= n) continue;  // warp-uniform
    float acc[4] = {};
    kda_tile_product(acc, qbuf, SL::kSt, S, SL::kSld, m0, n0, D);
    kda_tile_product(acc, M, SL::kTld, U, SL::kXld, m0, n0, m0 + 16);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int t = m0 + g + 8 * (q / 2), c = n0 + 2 * t4 + q % 2;
      if (t < n && c < cols) out[row0 + t][h * d + c0 + c] = round_act(act, acc[q]);
    }
  }
  __syncthreads();
  if (next != nullptr) {  // qbuf, T' and M are free: the next chunk's K⊙e^γ, T', M
    kda_copy_rows<D>(qbuf, SL::kSt, next + RL::kK);
    kda_copy_rows<kKdaChunk>(Tp, SL::kTld, next + RL::kT);
    kda_copy_rows<kKdaChunk>(M, SL::kTld, next + RL::kM);
  }
  cp_async_commit();  // possibly empty: the waits above count groups
  cp_async_wait<1>();  // K⊙e^{γ_C−γ}
  __syncthreads();
  // S ← diag(e^{γ_C})S₀ + (K⊙e^{γ_C−γ})ᵀU: the staged rows read transposed (rows past n are zero).
  constexpr int kTiles = D / 16 * kColTiles;
  for (int tile = warp_id(); tile < kTiles; tile += kWarps) {
    const int m0 = tile / kColTiles * 16, n0 = tile % kColTiles * 8;
    float acc[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int j = m0 + g + 8 * (q / 2), c = n0 + 2 * t4 + q % 2;
      acc[q] = S[j * SL::kSld + c] * decay[j];
    }
#pragma unroll 4
    for (int k0 = 0; k0 < kKdaChunk; k0 += 8) {
      const int p = k0 + t4;
      const float a[4] = {kbuf[p * SL::kSt + m0 + g], kbuf[p * SL::kSt + m0 + g + 8], kbuf[(p + 4) * SL::kSt + m0 + g], kbuf[(p + 4) * SL::kSt + m0 + g + 8]};
      const float b[2] = {U[p * SL::kXld + n0 + g], U[(p + 4) * SL::kXld + n0 + g]};
      kda_mma(acc, a, b);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) S[(m0 + g + 8 * (q / 2)) * SL::kSld + n0 + 2 * t4 + q % 2] = acc[q];
  }
  __syncthreads();
  if (next != nullptr) {  // kbuf and e^{γ_C} are free: the next chunk's Q⊙e^γ
    kda_copy_rows<D>(kbuf, SL::kSt, next + RL::kQ);
    for (int i = static_cast<int>(threadIdx.x); i < D / 4; i += kThreads) cp_async16(decay + 4 * i, next + RL::kDecay + 4 * i);
  }
  cp_async_commit();
}

// Every chunk of one head's sequence (tokens ≥ kKdaChunkedMinTokens) for value columns [c0, c0 + cols),
// from the records of its chunks (records[chunk · heads]): the pass's state (S_global: the head's
// [d, d]) into shared memory, the chunks, the state back. Padded rows and columns are zero.
// Block-uniform.
template <int D>
__device__ __noinline__ void kda_scan(const TaskCtx& ctx, const float* records, int heads, int first, int tokens, int64_t h, int64_t d, int c0, int cols,
                                      float* S_global) {
  using SL = KdaScanLayout<D>;
  using RL = KdaRecord<D>;
  float* sm = smem_floats(ctx);
  float* S = sm + SL::kS;
  for (int i = static_cast<int>(threadIdx.x); i < D * SL::kCols; i += kThreads) {
    const int j = i / SL::kCols, c = i % SL::kCols;
    S[j * SL::kSld + c] = j < d && c < cols ? S_global[j * d + c0 + c] : 0.0f;
  }
  const int chunks = (tokens + kKdaChunk - 1) / kKdaChunk;
  float *b0 = sm + SL::kB0, *b1 = sm + SL::kB1;
  kda_copy_rows<D>(b0, SL::kSt, records + RL::kK);
  kda_copy_rows<kKdaChunk>(sm + SL::kTp, SL::kTld, records + RL::kT);
  kda_copy_rows<kKdaChunk>(sm + SL::kM, SL::kTld, records + RL::kM);
  cp_async_commit();
  kda_copy_rows<D>(b1, SL::kSt, records + RL::kQ);
  for (int i = static_cast<int>(threadIdx.x); i < D / 4; i += kThreads) cp_async16(sm + SL::kDecay + 4 * i, records + RL::kDecay + 4 * i);
  cp_async_commit();
  for (int k = 0; k < chunks; ++k) {
    const float* rec = records + static_cast<int64_t>(k) * heads * RL::kFloats;
    const float* next = k + 1 < chunks ? rec + static_cast<int64_t>(heads) * RL::kFloats : nullptr;
    const int n = tokens - k * kKdaChunk < kKdaChunk ? tokens - k * kKdaChunk : kKdaChunk;
    kda_scan_chunk<D>(ctx, rec, next, first + k * kKdaChunk, n, h, d, c0, cols, k % 2 == 0 ? b0 : b1, k % 2 == 0 ? b1 : b0);
  }
  cp_async_wait<0>();  // the last (empty) groups
  for (int i = static_cast<int>(threadIdx.x); i < D * SL::kCols; i += kThreads) {
    const int j = i / SL::kCols, c = i % SL::kCols;
    if (j < d && c < cols) S_global[j * d + c0 + c] = S[j * SL::kSld + c];
  }
  __syncthreads();  // the next pass or op reuses the shared memory
}

// The step's chunked sequences: their chunks in all, and sequence s's first chunk.
__device__ __forceinline__ int kda_chunks(const StepView& step, int upto) {
  int chunks = 0;
  for (int s = 0; s < upto; ++s) {
    if (step.seq_tokens[s] >= kKdaChunkedMinTokens) chunks += (step.seq_tokens[s] + kKdaChunk - 1) / kKdaChunk;
  }
  return chunks;
}

// Phase 1 (the file comment): prep items from the ticket counter until none is left, then the wait for
// every item. Returns false, with kErrWorkspace reported, when the workspace cannot hold the step's
// records (then no task touches the counters: all see the same step). Block-uniform.
template <int D>
__device__ bool kda_prep_all(const TaskCtx& ctx, int64_t d, int heads, int chunks) {
  const int items = chunks * heads;
  if (ctx.op->sync == nullptr || static_cast<int64_t>(items) * KdaRecord<D>::kFloats > ctx.op->workspace_floats) {
    if (threadIdx.x == 0) report_error(ctx, kErrWorkspace);
    return false;
  }
  const StepView& step = *ctx.step;
  unsigned* const sync = ctx.op->sync;
  for (;;) {
    const int item = take_ticket(ctx, sync);
    if (item >= items) break;  // block-uniform
    int chunk = item / heads, s = 0;  // chunk-major: the scans' first chunks are ready first
    for (;; ++s) {
      const int tokens = step.seq_tokens[s];
      const int own = tokens >= kKdaChunkedMinTokens ? (tokens + kKdaChunk - 1) / kKdaChunk : 0;
      if (chunk < own) break;
      chunk -= own;
    }
    const int n = step.seq_tokens[s] - chunk * kKdaChunk < kKdaChunk ? step.seq_tokens[s] - chunk * kKdaChunk : kKdaChunk;
    kda_prep_item<D>(ctx, step.seq_first_row[s] + chunk * kKdaChunk, n, item % heads, d, ctx.op->workspace + static_cast<int64_t>(item) * KdaRecord<D>::kFloats);
    block_arrive(sync + 1);
  }
  block_wait(sync + 1, items);
  return true;
}

}  // namespace plow::cuda
