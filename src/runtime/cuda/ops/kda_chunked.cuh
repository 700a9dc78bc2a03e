// KDA's gated delta rule in the chunked form (spec/MODEL.md §6, C = 64; cpu: ops/kda.cpp chunk_head) for
// the sequences of a step that bring at least kKdaChunkedMinTokens tokens, one pass of at most kCols
// value columns (KdaLayout) at a time. Per chunk: the pairwise-decayed K·Kᵀ and Q·Kᵀ (A, M; fp32 SIMT),
// U = diag(β)(V − (K⊙e^γ)S₀) (tensor cores), U ← (I + A)⁻¹U by forward substitution (SIMT), the outputs
// (Q⊙e^γ)S₀ + M·U and the state update diag(e^{γ_C})S₀ + (K⊙e^{γ_C−γ})ᵀU (tensor cores). The pass's
// state stays in shared memory across chunks. Pairwise decays are exp(γ_r − γ_j), never factored, as the
// CPU's: the K3 gate (γ down to −320 in a chunk) and strong Kimi decays cannot overflow.
//
// The matrix products run as mma.sync m16n8k8 TF32 in the 3xTF32 split (a = a_hi + a_lo, a·b ≈
// a_hi·b_hi + a_hi·b_lo + a_lo·b_hi, fp32 accumulation): about fp32's accuracy, which the KDA core keeps
// (MODEL.md §2), where plain TF32 would lose three decimal digits. Emulator builds (PLOW_CUDA_EMU) run the
// same fragments through shuffles with fp32 products.
#pragma once

#include <cstdint>

#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda {

inline constexpr int kKdaChunk = 64;             // positions per chunk (the CPU's kChunk)
inline constexpr int kKdaChunkedMinTokens = 16;  // shorter sequences run token by token

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

// Shared memory of one chunk, in floats. Channel-major [c][t] arrays have row stride kLd = C + 1 so that a
// warp reading one position of 32 channels, or 32 positions of one channel, hits 32 banks; U's rows are
// padded by 32 / kPerCol so that the lanes of a warp's value columns, reading rows j ≡ r (mod kPerCol),
// do too; S's rows by 8 and the staged rows by 4, so that mma fragments load without bank conflicts.
//   γ [D][kLd]      cumulative log-decay within the chunk
//   AM [C][kLd]     A(r, j) = β_r Σ_c k_r k_j e^{γ_r−γ_j} (j < r) at [j][r]; M(r, j) = Σ_c q_r k_j e^{γ_r−γ_j} (j ≤ r) at [r][j]
//   U [C][kUld]     diag(β)(V − (K⊙e^γ)S₀) of the pass's columns, then solved in place to (I + A)⁻¹ of that;
//                   rows from the chunk's length on are zero
//   S [D][kSld]     the pass's state (key rows × value columns), across chunks
//   stage           per phase: k̂, q̂ pieces [kPiece][kLd] each (the diagonal blocks of A, M); the block
//                   operands of the off-diagonal blocks, kBlockRows rows [kPst] per piece; then K⊙e^γ,
//                   Q⊙e^γ, K⊙e^{γ_C−γ} in turn, [kTokens][kSt] (rows past the chunk's end zero up to a
//                   multiple of 16)
//   β, q_scale / |q|, 1 / |k| [C] each
template <int D>
struct KdaChunkLayout {
  static constexpr int kCols = KdaLayout<D>::kCols;
  static constexpr int kLd = kKdaChunk + 1;
  static constexpr int kUld = kCols + 32 / KdaLayout<D>::kPerCol;
  static constexpr int kSld = kCols + 8;
  static constexpr int kSt = D + 4;
  static constexpr int kPiece = D < 16 ? D : 16;  // channels per A/M staging piece
  static constexpr int kPst = kPiece + 4;          // row stride of the block operands
  static constexpr int kBlockRows = 192;           // k̂ and q̂ rows 16..63, then K for references 16, 32, 48
  static constexpr int kGamma = 0;
  static constexpr int kAm = kGamma + D * kLd;
  static constexpr int kU = kAm + kKdaChunk * kLd;
  static constexpr int kS = kU + kKdaChunk * kUld;
  static constexpr int kStageAt = kS + D * kSld;
  static constexpr int kSmall = 3 * kKdaChunk;  // β and the q, k scales
  static constexpr int kRoom = kSharedBytes / 4 - kStageAt - kSmall;
  static constexpr int kTokens = kRoom / kSt / 16 * 16 < kKdaChunk ? kRoom / kSt / 16 * 16 : kKdaChunk;  // positions per staged piece
  static constexpr int kPairStage = 2 * kPiece * kLd > kBlockRows * kPst ? 2 * kPiece * kLd : kBlockRows * kPst;
  static constexpr int kStage = kTokens * kSt > kPairStage ? kTokens * kSt : kPairStage;
  static constexpr int kBeta = kStageAt + kStage;
  static constexpr int kQScale = kBeta + kKdaChunk;
  static constexpr int kKScale = kQScale + kKdaChunk;
  static constexpr int kFloats = kKScale + kKdaChunk;
  static_assert(kTokens >= 16, "a staged piece holds at least one mma row tile");
  static_assert(kFloats * 4 <= kSharedBytes, "a chunk's tiles must fit the block's shared memory");
  static_assert(D % 16 == 0 && kCols % 8 == 0, "mma tiles: 16 key rows, 8 value columns");
};

// One chunk: positions [0, n) at arena rows row0 + t of head h, value columns [c0, c0 + cols); d the
// real head dim, D the padded one.
struct KdaChunk {
  int row0, n;
  int64_t h, d;
  int c0, cols;
  float q_scale;
  float* sm;
  const float *qscale, *kscale;  // q_scale / |q_t| and 1 / |k_t| in shared memory
  // q̂ (which 0) or k̂ (which 1) of position t, channel j (< d): times the scale over the norm (the CPU
  // divides by the norm, then scales: a few ulps apart, far inside the op's bound).
  __device__ float normed(const TaskCtx& ctx, int which, int t, int64_t j) const {
    return ctx.in(which, row0 + t)[h * d + j] * (which == 0 ? qscale : kscale)[t];
  }
};

// The scales of q and k (q_scale / |q|, 1 / |k|; ε = 1e−6 on the sum, inside the root; one warp per
// (position, q|k)), β, and γ by a sequential sum per channel (the CPU's order) over g staged first.
// Padded channels: γ = 0.
template <int D>
__device__ void kda_chunk_stage(const TaskCtx& ctx, const KdaChunk& ch) {
  using CL = KdaChunkLayout<D>;
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id();
  for (int u = warp_id(); u < 2 * ch.n; u += kWarps) {
    const int t = u / 2, which = u % 2;
    const float* x = ctx.in(which, ch.row0 + t) + ch.h * ch.d;
    float sum = 0.0f;
    for (int64_t j = lane; j < ch.d; j += 32) sum += x[j] * x[j];
    sum = warp_sum(sum);
    if (lane == 0) ch.sm[(which == 0 ? CL::kQScale : CL::kKScale) + t] = (which == 0 ? ch.q_scale : 1.0f) / sqrtf(sum + 1e-6f);
  }
  for (int t = tid; t < ch.n; t += kThreads) ch.sm[CL::kBeta + t] = ctx.in(4, ch.row0 + t)[ch.h];
  float* gamma = ch.sm + CL::kGamma;
  for (int i = tid; i < ch.n * D; i += kThreads) {  // g, all loads in flight at once
    const int t = i / D, c = i % D;
    gamma[c * CL::kLd + t] = c < ch.d ? ctx.in(3, ch.row0 + t)[ch.h * ch.d + c] : 0.0f;
  }
  __syncthreads();
  for (int c = tid; c < D; c += kThreads) {  // then the running sums in place, from shared memory
    float sum = 0.0f;
    for (int t = 0; t < ch.n; ++t) gamma[c * CL::kLd + t] = (sum += gamma[c * CL::kLd + t]);
  }
  __syncthreads();
}

// A and M by 16-position blocks (rows r, columns j ≤ r of the chunk), in two parts:
//  - the diagonal blocks (r, j in one block) on SIMT, the decays exp(γ_r − γ_j) per (pair, channel);
//  - the blocks below them on tensor cores, factored through a reference position: for block row R
//    (rows 16R…16R+15) and any j < 16R, e^{γ_r − γ_j} = e^{γ_r − γ_16R} · e^{γ_16R − γ_j} with both
//    factors ≤ 1 (γ falls with the position), so neither can overflow whatever the gate (a factor that
//    underflows has a product below it); A(r, j) = β_r Σ_c (k̂_r e^{γ_r−γ_16R})_c (k̂_j e^{γ_16R−γ_j})_c,
//    M likewise with q̂_r: two [16 × D]·[D × 16R] products per block row.
// Ends with the block synchronized.
template <int D>
__device__ void kda_chunk_pairs(const TaskCtx& ctx, const KdaChunk& ch) {
  using CL = KdaChunkLayout<D>;
  constexpr int kBlock = 16, kBlockPairs = kBlock * (kBlock + 1) / 2;
  constexpr int kPairs = (kKdaChunk / kBlock * kBlockPairs + kThreads - 1) / kThreads;
  const int tid = static_cast<int>(threadIdx.x);
  const float* gamma = ch.sm + CL::kGamma;
  float* am = ch.sm + CL::kAm;
  // Diagonal blocks: pair q of block b = q / 136 in row order inside the block; r = n: none.
  int pr[kPairs], pj[kPairs];
#pragma unroll
  for (int m = 0; m < kPairs; ++m) {
    const int q = tid + kThreads * m, b = q / kBlockPairs, w = q % kBlockPairs;
    int r = static_cast<int>((sqrtf(8.0f * static_cast<float>(w) + 1.0f) - 1.0f) * 0.5f);
    while (r * (r + 1) / 2 > w) --r;  // exact whatever sqrtf's rounding
    while ((r + 1) * (r + 2) / 2 <= w) ++r;
    pr[m] = kBlock * b + r < ch.n ? kBlock * b + r : ch.n;
    pj[m] = kBlock * b + w - r * (r + 1) / 2;
  }
  {
    float* sk = ch.sm + CL::kStageAt;
    float* sq = sk + CL::kPiece * CL::kLd;
    float acc_k[kPairs] = {}, acc_q[kPairs] = {};
    for (int c0 = 0; c0 < D; c0 += CL::kPiece) {
      for (int i = tid; i < ch.n * CL::kPiece; i += kThreads) {
        const int t = i / CL::kPiece, c = i % CL::kPiece;
        const bool real = c0 + c < ch.d;
        sk[c * CL::kLd + t] = real ? ch.normed(ctx, 1, t, c0 + c) : 0.0f;
        sq[c * CL::kLd + t] = real ? ch.normed(ctx, 0, t, c0 + c) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int m = 0; m < kPairs; ++m) {
        const int r = pr[m], j = pj[m];
        if (r >= ch.n) continue;
        for (int c = 0; c < CL::kPiece; ++c) {
          const float* g = gamma + (c0 + c) * CL::kLd;
          const float kj = sk[c * CL::kLd + j] * __expf(g[r] - g[j]);  // ≤ 1: fast exp's error is absolute ≲ 1e−7
          acc_k[m] += sk[c * CL::kLd + r] * kj;
          acc_q[m] += sq[c * CL::kLd + r] * kj;
        }
      }
      __syncthreads();  // the next piece overwrites the staging
    }
#pragma unroll
    for (int m = 0; m < kPairs; ++m) {
      const int r = pr[m], j = pj[m];
      if (r >= ch.n) continue;
      am[r * CL::kLd + j] = acc_q[m];
      if (j < r) am[j * CL::kLd + r] = ch.sm[CL::kBeta + r] * acc_k[m];
    }
  }
  if (ch.n <= kBlock) {  // no block below the diagonal
    __syncthreads();
    return;
  }
  // Below the diagonal: per channel piece, rows [kPst] of k̂ e^{γ_r−γ_16R} (0..47: r = 16..63), q̂ e^{γ_r−γ_16R}
  // (48..95), and k̂ e^{γ_16R−γ_j} for R = 1 (96..111: j < 16), 2 (112..143: j < 32), 3 (144..191: j < 48);
  // zero past the chunk's end. Warp w < 12 owns block row R and column tile nt (A and M), accumulated over
  // the pieces in registers.
  float* ops = ch.sm + CL::kStageAt;
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4, warp = warp_id();
  const int R = warp < 2 ? 1 : warp < 6 ? 2 : 3, nt = warp < 2 ? warp : warp < 6 ? warp - 2 : warp - 6;
  const bool busy = warp < 12 && kBlock * R < ch.n;  // warp-uniform
  const int right0 = 96 + kBlock * ((R - 1) * R / 2);
  float acc_k[4] = {}, acc_q[4] = {};
  for (int c0 = 0; c0 < D; c0 += CL::kPiece) {
    for (int i = tid; i < CL::kBlockRows * CL::kPiece; i += kThreads) {
      const int row = i / CL::kPiece, c = c0 + i % CL::kPiece;
      float v = 0.0f;
      if (row < 96) {  // the left factor of block row r / 16
        const int r = kBlock + row % 48, ref = r / kBlock * kBlock;
        if (r < ch.n && c < ch.d) v = ch.normed(ctx, row < 48 ? 1 : 0, r, c) * __expf(gamma[c * CL::kLd + r] - gamma[c * CL::kLd + ref]);
      } else {  // the right factor for reference 16R
        const int x = row - 96, rb = x < 16 ? 1 : x < 48 ? 2 : 3, j = x - kBlock * ((rb - 1) * rb / 2), ref = kBlock * rb;
        if (ref < ch.n && c < ch.d) v = ch.normed(ctx, 1, j, c) * __expf(gamma[c * CL::kLd + ref] - gamma[c * CL::kLd + j]);
      }
      ops[row * CL::kPst + i % CL::kPiece] = v;
    }
    __syncthreads();
    if (busy) {
      const float* left_k = ops + (kBlock * (R - 1)) * CL::kPst;
      const float* left_q = left_k + 48 * CL::kPst;
      const float* right = ops + (right0 + 8 * nt) * CL::kPst;
#pragma unroll
      for (int k0 = 0; k0 < CL::kPiece; k0 += 8) {
        const float b[2] = {right[g * CL::kPst + k0 + t4], right[g * CL::kPst + k0 + t4 + 4]};
        const float ak[4] = {left_k[g * CL::kPst + k0 + t4], left_k[(g + 8) * CL::kPst + k0 + t4], left_k[g * CL::kPst + k0 + t4 + 4],
                             left_k[(g + 8) * CL::kPst + k0 + t4 + 4]};
        const float aq[4] = {left_q[g * CL::kPst + k0 + t4], left_q[(g + 8) * CL::kPst + k0 + t4], left_q[g * CL::kPst + k0 + t4 + 4],
                             left_q[(g + 8) * CL::kPst + k0 + t4 + 4]};
        kda_mma(acc_k, ak, b);
        kda_mma(acc_q, aq, b);
      }
    }
    __syncthreads();  // the next piece overwrites the operands
  }
  if (busy) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = kBlock * R + g + 8 * (q / 2), j = 8 * nt + 2 * t4 + q % 2;
      if (r < ch.n) {
        am[r * CL::kLd + j] = acc_q[q];
        am[j * CL::kLd + r] = ch.sm[CL::kBeta + r] * acc_k[q];
      }
    }
  }
  __syncthreads();
}

// Stages positions [p0, p0 + np) of x̂ ⊙ e^{γ_t − γ_ref} (x = q (which 0) or k (1); γ_ref = 0, or γ of the
// chunk's last position when to_end) as rows [t − p0][kSt] at `dst`, rows np up to a multiple of 16 zero;
// ends with the block synchronized.
template <int D>
__device__ void kda_chunk_stage_rows(const TaskCtx& ctx, const KdaChunk& ch, int which, bool to_end, int p0, int np, float* dst) {
  using CL = KdaChunkLayout<D>;
  const float* gamma = ch.sm + CL::kGamma;
  const int rows = (np + 15) / 16 * 16;
  for (int i = static_cast<int>(threadIdx.x); i < rows * D; i += kThreads) {
    const int p = i / D, j = i % D, t = p0 + p;
    const float* g = gamma + j * CL::kLd;
    dst[p * CL::kSt + j] = p < np && j < ch.d ? ch.normed(ctx, which, t, j) * __expf(to_end ? g[ch.n - 1] - g[t] : g[t]) : 0.0f;
  }
  __syncthreads();
}

// Sum over the kPerCol adjacent lanes of a value column; every lane gets the total.
template <int D>
__device__ __forceinline__ float kda_column_sum(float v) {
  for (int o = 1; o < KdaLayout<D>::kPerCol; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// acc += X·S over all D key channels for the 16×8 tile at staged rows m0, state columns n0: X the staged
// rows [kSt], S the pass's state [kSld]. Whole warps.
template <int D>
__device__ __forceinline__ void kda_tile_times_state(float (&acc)[4], const float* staged, const float* S, int m0, int n0) {
  using CL = KdaChunkLayout<D>;
  const int lane = lane_id(), g = lane / 4, t = lane % 4;
#pragma unroll 4
  for (int k0 = 0; k0 < D; k0 += 8) {
    const float a[4] = {staged[(m0 + g) * CL::kSt + k0 + t], staged[(m0 + g + 8) * CL::kSt + k0 + t], staged[(m0 + g) * CL::kSt + k0 + t + 4],
                        staged[(m0 + g + 8) * CL::kSt + k0 + t + 4]};
    const float b[2] = {S[(k0 + t) * CL::kSld + n0 + g], S[(k0 + t + 4) * CL::kSld + n0 + g]};
    kda_mma(acc, a, b);
  }
}

// For every staged piece of x̂ ⊙ e^{γ_t} (x = q (which 0) or k (1)) and every 16×8 tile of its rows × the
// pass's columns, warps in turn: acc = that tile of X·S₀, then tile(acc, first row of the chunk, first
// column). Ends with the block synchronized.
template <int D, typename Tile>
__device__ __forceinline__ void kda_for_each_state_tile(const TaskCtx& ctx, const KdaChunk& ch, int which, Tile tile) {
  using CL = KdaChunkLayout<D>;
  constexpr int kColTiles = CL::kCols / 8;
  const float* S = ch.sm + CL::kS;
  float* staged = ch.sm + CL::kStageAt;
  for (int p0 = 0; p0 < ch.n; p0 += CL::kTokens) {
    const int np = ch.n - p0 < CL::kTokens ? ch.n - p0 : CL::kTokens;
    kda_chunk_stage_rows<D>(ctx, ch, which, false, p0, np, staged);
    const int tiles = (np + 15) / 16 * kColTiles;
    for (int i = warp_id(); i < tiles; i += kWarps) {
      const int m0 = i / kColTiles * 16, n0 = i % kColTiles * 8;
      float acc[4] = {};
      kda_tile_times_state<D>(acc, staged, S, m0, n0);
      tile(acc, p0 + m0, n0);
    }
    __syncthreads();  // the staging is overwritten next
  }
}

// U = diag(β)(V − (K⊙e^γ)S₀) for the pass's columns; rows from n on zero. Ends with the block synchronized.
template <int D>
__device__ void kda_chunk_values(const TaskCtx& ctx, const KdaChunk& ch) {
  using CL = KdaChunkLayout<D>;
  float* U = ch.sm + CL::kU;
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4;
  for (int i = static_cast<int>(threadIdx.x); i < (kKdaChunk - ch.n) * CL::kUld; i += kThreads) U[ch.n * CL::kUld + i] = 0.0f;
  kda_for_each_state_tile<D>(ctx, ch, 1, [&](float (&acc)[4], int m0, int n0) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int t = m0 + g + 8 * (q / 2), c = n0 + 2 * t4 + q % 2;
      if (t < ch.n) {
        const float v = c < ch.cols ? ctx.in(2, ch.row0 + t)[ch.h * ch.d + ch.c0 + c] : 0.0f;
        U[t * CL::kUld + c] = ch.sm[CL::kBeta + t] * (v - acc[q]);
      }
    }
  });
}

// U ← (I + A)⁻¹U by forward substitution, one value column per kPerCol threads (a warp's lanes), rows in
// order; ends with the block synchronized.
template <int D>
__device__ void kda_chunk_solve(const KdaChunk& ch) {
  using L = KdaLayout<D>;
  using CL = KdaChunkLayout<D>;
  const int tid = static_cast<int>(threadIdx.x);
  const int c = tid / L::kPerCol, r = tid % L::kPerCol;
  const float* am = ch.sm + CL::kAm;
  float* U = ch.sm + CL::kU;
  if (c < L::kCols) {  // whole warps
    for (int t = 1; t < ch.n; ++t) {
      float sum = 0.0f;
      for (int j = r; j < t; j += L::kPerCol) sum += am[j * CL::kLd + t] * U[j * CL::kUld + c];
      sum = kda_column_sum<D>(sum);
      if (r == 0) U[t * CL::kUld + c] -= sum;
      __syncwarp();  // row t is read by the column's lanes from the next row on
    }
  }
  __syncthreads();
}

// o_t = S₀ᵀ(q_t ⊙ e^{γ_t}) + Σ_{j≤t} M(t, j) u_j, for the pass's columns. Runs before the state update;
// ends with the block synchronized.
template <int D>
__device__ void kda_chunk_outputs(const TaskCtx& ctx, const KdaChunk& ch) {
  using CL = KdaChunkLayout<D>;
  const float* am = ch.sm + CL::kAm;
  const float* U = ch.sm + CL::kU;
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4;
  kda_for_each_state_tile<D>(ctx, ch, 0, [&](float (&acc)[4], int m0, int n0) {
    // M·U over the positions j ≤ t of the tile's rows (M's upper triangle is A's storage: masked).
    const int top = m0 + g, bottom = top + 8;
    for (int k0 = 0; k0 < m0 + 16; k0 += 8) {
      const int j = k0 + t4;
      const float a[4] = {j <= top ? am[top * CL::kLd + j] : 0.0f, j <= bottom ? am[bottom * CL::kLd + j] : 0.0f,
                          j + 4 <= top ? am[top * CL::kLd + j + 4] : 0.0f, j + 4 <= bottom ? am[bottom * CL::kLd + j + 4] : 0.0f};
      const float b[2] = {U[j * CL::kUld + n0 + g], U[(j + 4) * CL::kUld + n0 + g]};
      kda_mma(acc, a, b);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int t = top + 8 * (q / 2), c = n0 + 2 * t4 + q % 2;
      if (t < ch.n && c < ch.cols) ctx.out(ch.row0 + t)[ch.h * ch.d + ch.c0 + c] = round_out(ctx, acc[q]);
    }
  });
}

// S ← diag(e^{γ_C})S + (K⊙e^{γ_C − γ})ᵀU: each warp keeps its state tiles (16 key rows × 8 columns) in
// registers across the staged pieces. Ends with the block synchronized.
template <int D>
__device__ void kda_chunk_update(const TaskCtx& ctx, const KdaChunk& ch) {
  using CL = KdaChunkLayout<D>;
  constexpr int kColTiles = CL::kCols / 8;
  constexpr int kTiles = D / 16 * kColTiles;
  constexpr int kPerWarp = (kTiles + kWarps - 1) / kWarps;
  const float* gamma = ch.sm + CL::kGamma;
  const float* U = ch.sm + CL::kU;
  float* S = ch.sm + CL::kS;
  float* staged = ch.sm + CL::kStageAt;
  const int lane = lane_id(), g = lane / 4, t4 = lane % 4;
  float acc[kPerWarp][4];
#pragma unroll
  for (int w = 0; w < kPerWarp; ++w) {
    const int tile = warp_id() + kWarps * w;
    const int m0 = tile / kColTiles * 16, n0 = tile % kColTiles * 8;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int j = m0 + g + 8 * (q / 2), c = n0 + 2 * t4 + q % 2;
      acc[w][q] = tile < kTiles ? S[j * CL::kSld + c] * __expf(gamma[j * CL::kLd + ch.n - 1]) : 0.0f;
    }
  }
  for (int p0 = 0; p0 < ch.n; p0 += CL::kTokens) {
    const int np = ch.n - p0 < CL::kTokens ? ch.n - p0 : CL::kTokens;
    kda_chunk_stage_rows<D>(ctx, ch, 1, true, p0, np, staged);
#pragma unroll
    for (int w = 0; w < kPerWarp; ++w) {
      const int tile = warp_id() + kWarps * w;
      if (tile >= kTiles) continue;  // warp-uniform
      const int m0 = tile / kColTiles * 16, n0 = tile % kColTiles * 8;
      for (int k0 = 0; k0 < np; k0 += 8) {  // rows past np are zero in both operands
        const int p = k0 + t4;
        const float a[4] = {staged[p * CL::kSt + m0 + g], staged[p * CL::kSt + m0 + g + 8], staged[(p + 4) * CL::kSt + m0 + g],
                            staged[(p + 4) * CL::kSt + m0 + g + 8]};
        const float b[2] = {U[(p0 + p) * CL::kUld + n0 + g], U[(p0 + p + 4) * CL::kUld + n0 + g]};
        kda_mma(acc[w], a, b);
      }
    }
    __syncthreads();  // the staging is overwritten next
  }
#pragma unroll
  for (int w = 0; w < kPerWarp; ++w) {
    const int tile = warp_id() + kWarps * w;
    if (tile >= kTiles) continue;
    const int m0 = tile / kColTiles * 16, n0 = tile % kColTiles * 8;
#pragma unroll
    for (int q = 0; q < 4; ++q) S[(m0 + g + 8 * (q / 2)) * CL::kSld + n0 + 2 * t4 + q % 2] = acc[w][q];
  }
  __syncthreads();
}

// Every chunk of one head's sequence (tokens ≥ kKdaChunkedMinTokens) for value columns [c0, c0 + cols):
// the pass's state (S_global: the head's [d, d]) into shared memory, the chunks, the state back. Padded
// rows and columns are zero. Block-uniform.
template <int D>
__device__ __forceinline__ void kda_chunked(const TaskCtx& ctx, int first, int tokens, int64_t h, int64_t d, int c0, int cols, float* S_global) {
  using CL = KdaChunkLayout<D>;
  float* sm = smem_floats(ctx);
  float* S = sm + CL::kS;
  for (int i = static_cast<int>(threadIdx.x); i < D * CL::kCols; i += kThreads) {
    const int j = i / CL::kCols, c = i % CL::kCols;
    S[j * CL::kSld + c] = j < d && c < cols ? S_global[j * d + c0 + c] : 0.0f;
  }
  __syncthreads();
  for (int t0 = 0; t0 < tokens; t0 += kKdaChunk) {
    const KdaChunk ch{first + t0, tokens - t0 < kKdaChunk ? tokens - t0 : kKdaChunk, h, d, c0, cols, 1.0f / sqrtf(static_cast<float>(d)), sm,
                      sm + CL::kQScale, sm + CL::kKScale};
    kda_chunk_stage<D>(ctx, ch);
    kda_chunk_pairs<D>(ctx, ch);
    kda_chunk_values<D>(ctx, ch);
    kda_chunk_solve<D>(ch);
    kda_chunk_outputs<D>(ctx, ch);  // reads S₀: before the update
    kda_chunk_update<D>(ctx, ch);
  }
  for (int i = static_cast<int>(threadIdx.x); i < D * CL::kCols; i += kThreads) {
    const int j = i / CL::kCols, c = i % CL::kCols;
    if (j < d && c < cols) S_global[j * d + c0 + c] = S[j * CL::kSld + c];
  }
  __syncthreads();  // the next pass or op reuses the shared memory
}

}  // namespace plow::cuda
