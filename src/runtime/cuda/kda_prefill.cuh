// KDA's chunked delta rule (spec/MODEL.md §6, C = 64) of a prefill step in two launches (kda_prefill.cu;
// the emulator test runs the same blocks on the host), as fla's chunk_kda splits it: everything a chunk needs that does not depend on the state is computed for
// every (chunk, head) at once, so the sequential part per chunk is two levels of products.
//  1. prep, a block per (chunk, head), three blocks an SM: q̂, k̂ (l2-normalized, q̂ times 1/√d), γ (the
//     CPU's sequential sum per channel), A(r, j) = β_r Σ_c k̂_r k̂_j e^{γ_r−γ_j} (j < r) and
//     M(r, j) = Σ_c q̂_r k̂_j e^{γ_r−γ_j} (j ≤ r), T' = (I + A)⁻¹·diag(β), then W = T'·(K⊙e^γ) and
//     U = T'·V; the record (kda_prefill_kernels.h) holds Q⊙e^γ, K⊙e^{γ_n−γ}, W, U, M and e^{γ_n}. The
//     channels go through shared memory in two halves of 64 (A and M accumulate in shared memory across
//     them), which keeps a block at 72.7 KB.
//  2. scan, a block of four warpgroups per (32 value columns, head, sequence), chunk after chunk with the
//     state slice S₀ in two warpgroups' accumulators: level 1, V_new = U − W·S₀ and O = (Q⊙e^γ)·S₀
//     side by side; level 2, O += M·V_new and S ← diag(e^{γ_n})·S₀ + (K⊙e^{γ_n−γ})ᵀ·V_new side by
//     side, on wgmma. Each of the next chunk's arrays comes in one tensor copy (TMA, on an mbarrier) as
//     soon as its buffer is free (W into a second buffer from the chunk's start), the record's rows
//     landing in padded shared rows.
// Pairwise decays are never factored over a whole chunk (the K3 gate takes γ to −320): the products
// factor through the first position of each 16-row block row, where both factors are ≤ 1 below the
// diagonal 16×16 blocks and bounded (kDiagMmaSpread) inside them; diagonal blocks steeper than that
// take e^{γ_r−γ_j} per (pair, channel), as the op body (ops/kda_chunked.cuh) does for all of them.
// Products in 3xTF32 (each operand split hi + lo, three products, fp32 accumulation): mma.sync in the
// prep, wgmma in the scan (kda_tf32.cuh).
#pragma once

#include "runtime/cuda/kda_prefill_kernels.h"
#include "runtime/cuda/kda_tf32.cuh"  // the 3xTF32 products: mma.sync (prep), wgmma (scan)
#include "runtime/cuda/mbarrier.cuh"   // the scan's tensor copies
#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda::kda_planned {

constexpr int kC = kKdaChunk;
constexpr int kD = kKdaMaxHeadDim;
constexpr int kHalf = kD / 2;  // channels a prep pass stages
constexpr int kBlockThreads = 256;
constexpr int kBlockWarps = kBlockThreads / 32;
constexpr int kCols = 32;  // value columns of a scan block
constexpr int kScanThreads = 512;  // a scan block: sixteen warps
constexpr int kKdaPrefillThreads = kBlockThreads;
constexpr int kKdaScanThreads = kScanThreads;
constexpr int kKdaScanCols = kCols;
static_assert(kC == 64 && kD == 128, "the tilings below assume C = 64, d ≤ 128");

// ---- prep --------------------------------------------------------------------------------------------

// Shared memory of a prep block, floats. Channel-major [c][t] arrays have row stride kLd ≡ 8 (mod 32):
// a warp reading 32 positions of a channel, and the mma fragments (8 positions × 4 channels), hit 32
// banks. The staging region later holds the products' B operand [t][kBld] and T = (I + A)⁻¹, then T'
// in its place, [r][kTpld], and the inverse's scratch before them. 72.7 KB: three blocks an SM.
struct PrepSmem {
  static constexpr int kLd = kC + 8;
  static constexpr int kAld = kC + 1;
  static constexpr int kBld = kD + 8;
  static constexpr int kTpld = kC + 4;
  static constexpr int kQ = 0;  // q̂ [kHalf][kLd]
  static constexpr int kK = kQ + kHalf * kLd;
  static constexpr int kG = kK + kHalf * kLd;  // γ
  static constexpr int kB = 0;                 // [C][kBld], after the channels
  static constexpr int kTp = kB + kC * kBld;   // T, then T' [C][kTpld]
  static constexpr int kAm = kG + kHalf * kLd;  // M(r, j) at [r][j] (j ≤ r), A(r, j) at [j][r] (j < r)
  static constexpr int kBeta = kAm + kC * kAld;
  static constexpr int kRq = kBeta + kC;  // q's and k's row scales
  static constexpr int kRk = kRq + kC;
  static constexpr int kSteep = kRk + kC;  // two ints: the steep diagonal blocks of a half's channel warps
  static constexpr int kFloats = kSteep + 2;
  static_assert(kTp + kC * kTpld <= kAm, "B and T' fit the staging region");
  static_assert(kB % 4 == 0 && kBld % 4 == 0, "16-byte rows of B");
};
constexpr int kKdaPrepBytes = PrepSmem::kFloats * 4;

// e^x through ex2.approx.ftz: results below 2⁻¹²⁶ flush to zero (__expf, not flushing, spends a
// compare and two multiplies a call on them).
__device__ __forceinline__ float exp_ftz(float x) {
#ifndef PLOW_CUDA_EMU
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
#else
  return __expf(x);
#endif
}

// A 16-byte global store of v[0…3] at p (16-byte aligned): one st.global.v4 (through a float4 pointer the
// compiler emitted four scalar stores here).
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
#ifndef PLOW_CUDA_EMU
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]) : "memory");
#else
  for (int e = 0; e < 4; ++e) p[e] = v[e];
#endif
}

// A diagonal 16×16 block goes through the tensor cores, factored through its first position, when
// every channel's γ falls by at most this much across the block: the row factors e^{γ_r−γ_16R} stay ≥
// e^−60 (their TF32 rests normal) and the column factors e^{γ_16R−γ_j} ≤ e^60 (no overflow, products
// above the diagonal included). Steeper blocks (the K3 gate allows 75) take e^{γ_r−γ_j} per (pair,
// channel) on SIMT.
constexpr float kDiagMmaSpread = kKdaDiagMmaSpread;

// SIMT unit u of the steep diagonal blocks (set bits of steep): 160 a block, quarter u mod 4 of
// (row, column group) w = u / 4 mod 40, rows 0–3 of the block having one group of 4 columns, rows 4–7
// two, 8–11 three, 12–15 four. Returns whether the unit's block exists.
constexpr int kSimtUnits = 40 * 4;
__device__ __forceinline__ bool simt_unit(int u, int steep, int& r, int& j0) {
  const int w = u / 4 % 40;
  int mask = steep;
  for (int skip = u / kSimtUnits; skip > 0; --skip) mask &= mask - 1;
  if (mask == 0) return false;
  const int b = __ffs(mask) - 1, per = w < 4 ? 1 : w < 12 ? 2 : w < 24 ? 3 : 4, first = w < 4 ? 0 : w < 12 ? 4 : w < 24 ? 12 : 24;
  r = 16 * b + 4 * (per - 1) + (w - first) / per;
  j0 = 16 * b + 4 * ((w - first) % per);
  return true;
}

// Warp w's tensor-core tiles of A and M: block row R (rows 16R…16R+15) and 8-column tiles nt0 …
// nt0 + count − 1 of columns [0, 16R + 16), which share the rows' fragments; tiles nt ≥ 2R are the
// diagonal block's. Rows 3: warps 0–2 (3, 3, 2 tiles), 2: warps 3–4 (3, 3), 1: warps 5–6 (2, 2), 0:
// warp 7 (2).
__device__ __forceinline__ void product_tiles(int warp, int& R, int& nt0, int& count) {
  R = warp < 3 ? 3 : warp < 5 ? 2 : warp < 7 ? 1 : 0;
  nt0 = warp < 3 ? 3 * warp : warp < 5 ? 3 * (warp - 3) : warp < 7 ? 2 * (warp - 5) : 0;
  count = warp < 2 || warp == 3 || warp == 4 ? 3 : 2;
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
  static_assert(kBlockWarps == 8 && kC == 8 * kBlockWarps, "a warp's 8 rows; the staging tiles below");
  const int chunk = item / a.heads, h = item % a.heads, d = a.d;
  const int row0 = a.chunk_row0[chunk], n = a.chunk_len[chunk];
  float* rec = a.records + static_cast<int64_t>(item) * kKdaRecFloats;
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id(), g = lane / 4, t4 = lane % 4;
  float *sq = sm + P::kQ, *sk = sm + P::kK, *sg = sm + P::kG, *am = sm + P::kAm, *T = sm + P::kTp, *beta = sm + P::kBeta;
  int* steep_of = reinterpret_cast<int*>(sm + P::kSteep);  // per channel warp: diagonal blocks too steep for the mma
  const int64_t col0 = static_cast<int64_t>(h) * d;

  // Row scales (ε = 1e−6 on the sum, inside the root; q also times 1/√d) and β: a warp takes 8 rows,
  // lane l channels l, l + 32, … (whole 128-byte lines), four rows' loads in flight at once (a loop
  // over rows waited a DRAM latency per row). Addresses step a row at a time from one base.
  {
    constexpr int kRows = kC / kBlockWarps, kBatch = 4;
    const float* qrow = a.q + static_cast<int64_t>(row0 + warp * kRows) * a.q_stride + col0 + lane;
    const float* krow = a.k + static_cast<int64_t>(row0 + warp * kRows) * a.k_stride + col0 + lane;
    const int tb = warp * kRows + lane;  // lane r < 8 finishes row r
    const float b = lane < kRows && tb < n ? a.beta[(row0 + tb) * a.beta_stride + h] : 0.0f;
    float row_q = 0.0f, row_k = 0.0f;
#pragma unroll 1
    for (int r0 = 0; r0 < kRows; r0 += kBatch) {
      float qv[kBatch][kD / 32], kv[kBatch][kD / 32];
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        const int t = warp * kRows + r0 + r;
#pragma unroll
        for (int i = 0; i < kD / 32; ++i) {
          const bool real = t < n && lane + 32 * i < d;
          qv[r][i] = real ? qrow[32 * i] : 0.0f;
          kv[r][i] = real ? krow[32 * i] : 0.0f;
        }
        qrow += a.q_stride;
        krow += a.k_stride;
      }
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        float sum_q = 0.0f, sum_k = 0.0f;
#pragma unroll
        for (int i = 0; i < kD / 32; ++i) {
          sum_q += qv[r][i] * qv[r][i];
          sum_k += kv[r][i] * kv[r][i];
        }
        sum_q = warp_sum(sum_q);
        sum_k = warp_sum(sum_k);
        if (lane == r0 + r) row_q = sum_q, row_k = sum_k;
      }
    }
    if (lane < kRows) {
      sm[P::kRq + tb] = tb < n ? (1.0f / sqrtf(static_cast<float>(d))) / sqrtf(row_q + 1e-6f) : 0.0f;
      sm[P::kRk + tb] = tb < n ? 1.0f / sqrtf(row_k + 1e-6f) : 0.0f;
      beta[tb] = b;
    }
  }
  for (int i = tid; i < kC * P::kAld; i += kBlockThreads) am[i] = 0.0f;  // A and M accumulate over the halves
  __syncthreads();

#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    const int c0 = half * kHalf;
    // q̂, k̂, g of channels [c0, c0 + 64) into [c][t]: tiles of 8 positions × 4 channels, warp w's
    // positions 8w…8w+7 (lane 8·(c mod 4) + t mod 8), eight tiles' loads in flight a thread.
    {
      const int t = 8 * warp + lane % 8;
      const int64_t at = static_cast<int64_t>(row0 + t);
      const float *qp = a.q + at * a.q_stride + col0 + c0 + lane / 8, *kp = a.k + at * a.k_stride + col0 + c0 + lane / 8;
      const float* gp = a.g + at * a.g_stride + col0 + c0 + lane / 8;
      const float rq = sm[P::kRq + t], rk = sm[P::kRk + t];
#pragma unroll 1
      for (int round = 0; round < 2; ++round) {
        float vq[8], vk[8], vg[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int c = 4 * (8 * round + i) + lane / 8;
          const bool real = t < n && c0 + c < d;
          vq[i] = real ? qp[c - lane / 8] : 0.0f;
          vk[i] = real ? kp[c - lane / 8] : 0.0f;
          vg[i] = real ? gp[c - lane / 8] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int c = 4 * (8 * round + i) + lane / 8;
          sq[c * P::kLd + t] = vq[i] * rq;
          sk[c * P::kLd + t] = vk[i] * rk;
          sg[c * P::kLd + t] = vg[i];
        }
      }
      static_assert(kC / 8 * (kHalf / 4) == 16 * kBlockWarps, "two rounds of eight tiles a warp");
    }
    __syncthreads();
    if (tid < kHalf) {  // γ of channel tid: the CPU's order; which diagonal blocks are too steep
      float sum = 0.0f;
      for (int t = 0; t < kC; ++t) sg[tid * P::kLd + t] = (sum += sg[tid * P::kLd + t]);
      int steep = 0;
#pragma unroll
      for (int R = 0; R < kC / 16; ++R) {
        if (sg[tid * P::kLd + 16 * R] - sg[tid * P::kLd + 16 * R + 15] > kDiagMmaSpread) steep |= 1 << R;
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) steep |= __shfl_xor_sync(0xffffffffu, steep, o);
      if (lane == 0) steep_of[warp] = steep;
    }
    __syncthreads();
    const int steep = steep_of[0] | steep_of[1];
    static_assert(kHalf == 64, "the channels of a half are warps 0 and 1");

    // A and M on tensor cores, through the block row's first position: below the diagonal both factors
    // are ≤ 1; in the diagonal block (when not steep) the column factors are ≥ 1, bounded by kDiagMmaSpread.
    // Each element has one owner: this half's sums are added to shared memory. A warp's tiles share the
    // rows' gated, split fragments (a warp a tile rebuilt them for each).
    {
      int R, nt0, count;
      product_tiles(warp, R, nt0, count);
      const auto takes = [&](int x) { return x < count && (nt0 + x < 2 * R || !(steep >> R & 1)); };  // warp-uniform
      if (16 * R < n && takes(0)) {
        float acc_k[3][4] = {}, acc_q[3][4] = {};
        const int ref = 16 * R, top = ref + g, bottom = top + 8;
#pragma unroll 1
        for (int k0 = 0; k0 < kHalf; k0 += 8) {
          const int lo = (k0 + t4) * P::kLd, hi = lo + 4 * P::kLd;  // channels k0 + t4 and k0 + t4 + 4
          const float e0 = exp_ftz(sg[lo + top] - sg[lo + ref]), e1 = exp_ftz(sg[lo + bottom] - sg[lo + ref]);
          const float e2 = exp_ftz(sg[hi + top] - sg[hi + ref]), e3 = exp_ftz(sg[hi + bottom] - sg[hi + ref]);
          FragA fk, fq;
          fk.set(sk[lo + top] * e0, sk[lo + bottom] * e1, sk[hi + top] * e2, sk[hi + bottom] * e3);
          fq.set(sq[lo + top] * e0, sq[lo + bottom] * e1, sq[hi + top] * e2, sq[hi + bottom] * e3);
#pragma unroll
          for (int x = 0; x < 3; ++x) {
            if (!takes(x)) continue;
            const int j = 8 * (nt0 + x) + g;
            FragB fb;
            fb.set(sk[lo + j] * exp_ftz(sg[lo + ref] - sg[lo + j]), sk[hi + j] * exp_ftz(sg[hi + ref] - sg[hi + j]));
            mma_3x(acc_k[x], fk, fb);
            mma_3x(acc_q[x], fq, fb);
          }
        }
#pragma unroll
        for (int x = 0; x < 3; ++x) {
          if (!takes(x)) continue;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int r = 16 * R + g + 8 * (q / 2), col = 8 * (nt0 + x) + 2 * t4 + q % 2;
            if (r < n && col <= r) {
              am[r * P::kAld + col] += acc_q[x][q];
              if (col < r) am[col * P::kAld + r] += beta[r] * acc_k[x][q];
            }
          }
        }
      }
    }
    // Steep diagonal blocks on SIMT: e^{γ_r−γ_j} per (pair, channel). A unit is a row r, four columns
    // j0…j0+3 (j0 ≤ r) and the channels ≡ quarter (mod 4): the four columns' γ and k̂ are one 16-byte
    // load each. Columns past r are computed and dropped.
    if (steep != 0) {  // block-uniform
      const int units = __popc(steep) * kSimtUnits;
#pragma unroll 1
      for (int base = 0; base < units; base += kBlockThreads) {  // every lane takes part in the shuffles
        const int u = base + (tid + kBlockThreads / 2) % kBlockThreads, quarter = u % 4;  // a last part round to warps 4–7
        int r = 0, j0 = 0;
        const bool mine = u < units && simt_unit(u, steep, r, j0) && r < n;
        float dk[4] = {}, dq[4] = {};
        if (mine) {
#pragma unroll 4
          for (int c = quarter; c < kHalf; c += 4) {
            const float *gc = sg + c * P::kLd, *kc = sk + c * P::kLd;
            const float gr = gc[r], kr = kc[r], qr = sq[c * P::kLd + r];
            const float4 gj = *reinterpret_cast<const float4*>(gc + j0), kj = *reinterpret_cast<const float4*>(kc + j0);
            const float e[4] = {kj.x * exp_ftz(gr - gj.x), kj.y * exp_ftz(gr - gj.y), kj.z * exp_ftz(gr - gj.z), kj.w * exp_ftz(gr - gj.w)};
#pragma unroll
            for (int x = 0; x < 4; ++x) {
              dk[x] += kr * e[x];
              dq[x] += qr * e[x];
            }
          }
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {  // the quarters are adjacent lanes
          dk[x] += __shfl_xor_sync(0xffffffffu, dk[x], 1);
          dq[x] += __shfl_xor_sync(0xffffffffu, dq[x], 1);
          dk[x] += __shfl_xor_sync(0xffffffffu, dk[x], 2);
          dq[x] += __shfl_xor_sync(0xffffffffu, dq[x], 2);
        }
        if (mine && quarter == 0) {
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int jx = j0 + x;
            if (jx <= r) am[r * P::kAld + jx] += dq[x];
            if (jx < r) am[jx * P::kAld + r] += beta[r] * dk[x];
          }
        }
      }
    }
    // This half's record rows: Q⊙e^γ, K⊙e^{γ_n−γ}, and K⊙e^γ into W's place (the product below reads
    // it back). Lanes 2m and 2m + 1 store channels c…c+3 and c+4…c+7 of a position, a whole 32-byte
    // sector (lanes a position apart each stored half of one, and the compiler split those 16-byte
    // stores into four: the L2 took 8× the sectors of the data, ncu); reading channels 4 apart costs a
    // 2-way bank conflict.
    for (int i = tid; i < kC * kHalf / 4; i += kBlockThreads) {
      const int t = i / 2 % kC, c = 8 * (i / (2 * kC)) + 4 * (i % 2);
      float qv[4], ev[4], kv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float* gc = sg + (c + e) * P::kLd;
        const float decayed = exp_ftz(gc[t]), to_end = exp_ftz(gc[n - 1] - gc[t]);  // arguments ≤ 0
        const float k = sk[(c + e) * P::kLd + t];
        qv[e] = sq[(c + e) * P::kLd + t] * decayed;
        ev[e] = k * to_end;
        kv[e] = k * decayed;
      }
      const int64_t at = static_cast<int64_t>(t) * kD + c0 + c;
      store4(rec + kKdaRecQg + at, qv);
      store4(rec + kKdaRecKe + at, ev);
      store4(rec + kKdaRecW + at, kv);
    }
    if (tid < kHalf) rec[kKdaRecDecay + c0 + tid] = c0 + tid < d ? exp_ftz(sg[tid * P::kLd + n - 1]) : 0.0f;
    __syncthreads();  // the next half restages the channels
  }

  // T = (I + A)⁻¹ by 16-position blocks (rows past n are left undefined; T' zeroes them): the diagonal
  // blocks by forward substitution, four lanes a column (a warp's 8 columns share a block; zeros above
  // the diagonal, which the products below read); then the blocks below by distance on tensor cores,
  // T_ij = −T_ii·X with X = Σ_{j≤k<i} A_ik T_kj, a warp a block's 8-column tile, X through its scratch
  // in the staging region.
  {
    const int c = tid / 4, part = tid % 4, first = c / 16 * 16;
    const int end = n < first + 16 ? n : first + 16;
    if (part == 0) T[c * P::kTpld + c] = 1.0f;
    for (int t = first + part; t < c; t += 4) T[t * P::kTpld + c] = 0.0f;
    __syncwarp();
    for (int t = first + 1; t < end; ++t) {
      float sum = 0.0f;
      if (t > c) {
        for (int j = c + part; j < t; j += 4) sum += am[j * P::kAld + t] * T[j * P::kTpld + c];
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (part == 0 && t > c) T[t * P::kTpld + c] = -sum;
      __syncwarp();  // row t is read by the column's lanes from the next row on
    }
    static_assert(kBlockThreads == 4 * kC, "four lanes a column");
  }
  __syncthreads();
  {
    constexpr int kXld = 8;  // X [16][8]: B-operand reads hit 32 banks
    float* x = sm + 16 * kXld * warp;
    for (int distance = 1; distance < kC / 16; ++distance) {
      const int i = distance + warp / 2, tile0 = 16 * (i - distance) + 8 * (warp % 2);  // block row i, its tile
      if (i < kC / 16 && 16 * i < n) {  // warp-uniform; A's rows past n are zero, T's rows before 16i finite
        float acc[4] = {};
        for (int k0 = 16 * (i - distance); k0 < 16 * i; k0 += 8) {  // A(16i + m, k) at am[k][16i + m]
          FragB fb;
          fb.set(T[(k0 + t4) * P::kTpld + tile0 + g], T[(k0 + t4 + 4) * P::kTpld + tile0 + g]);
          mma_3x(acc, frag_a_cols(am, P::kAld, 16 * i, k0), fb);
        }
        x[g * kXld + 2 * t4] = acc[0];
        x[g * kXld + 2 * t4 + 1] = acc[1];
        x[(g + 8) * kXld + 2 * t4] = acc[2];
        x[(g + 8) * kXld + 2 * t4 + 1] = acc[3];
        __syncwarp();
        float y[4] = {};
#pragma unroll
        for (int k0 = 0; k0 < 16; k0 += 8) {  // T_ii (unit lower triangular, zeros above) times X
          FragB fb;
          fb.set(x[(k0 + t4) * kXld + g], x[(k0 + t4 + 4) * kXld + g]);
          mma_3x(y, frag_a_rows(T, P::kTpld, 16 * i, 16 * i + k0), fb);
        }
        __syncwarp();  // x is rewritten at the next distance
        T[(16 * i + g) * P::kTpld + tile0 + 2 * t4] = -y[0];
        T[(16 * i + g) * P::kTpld + tile0 + 2 * t4 + 1] = -y[1];
        T[(16 * i + g + 8) * P::kTpld + tile0 + 2 * t4] = -y[2];
        T[(16 * i + g + 8) * P::kTpld + tile0 + 2 * t4 + 1] = -y[3];
      }
      __syncthreads();
    }
  }

  // T' = T·diag(β) (zero above the diagonal and past n) for the products; M to the record.
  for (int i = tid; i < kC * kC / 4; i += kBlockThreads) {
    const int r = i / (kC / 4), j0 = 4 * (i % (kC / 4));
    float tv[4], mv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + e;
      const bool lower = r < n && j <= r;
      tv[e] = lower ? T[r * P::kTpld + j] * beta[j] : 0.0f;  // in place: this thread's four
      mv[e] = lower ? am[r * P::kAld + j] : 0.0f;
    }
    *reinterpret_cast<float4*>(T + r * P::kTpld + j0) = make_float4(tv[0], tv[1], tv[2], tv[3]);
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
  // U = T'·V (zero past n and d): lanes over a row's channels (thread i: channel i mod 128 of rows
  // i / 128, i / 128 + 2, …), 32 loads of the thread in flight.
  {
    constexpr int kPer = kC * kD / kBlockThreads, kStep = kBlockThreads / kD;
    const int c = tid % kD, t0 = tid / kD;
    const float* vp = a.v + static_cast<int64_t>(row0 + t0) * a.v_stride + col0 + c;
    float vals[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      vals[e] = t0 + kStep * e < n && c < d ? vp[0] : 0.0f;
      vp += kStep * a.v_stride;
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) sm[P::kB + (t0 + kStep * e) * P::kBld + c] = vals[e];
  }
  __syncthreads();
  prep_product(sm, rec + kKdaRecU);
}

// ---- scan --------------------------------------------------------------------------------------------

// Shared memory of a scan block, floats: the record's rows as copied (strides ≡ 4 mod 32 for A read by
// rows, ≡ 8 for K⊙e^{γ_n−γ}, read transposed; every array 128-byte aligned), the copies' four
// mbarriers, then the split B operands (wgmma's layout, 1,024-byte aligned at run time: kSw plus up to
// 1,020 bytes): S₀ᵀ's hi and lo planes (32 columns × 128 keys, 16 KB each) and V_newᵀ's (32 columns ×
// 64 positions, 8 KB each).
struct ScanSmem {
  static constexpr int kAld = kD + 4;
  static constexpr int kKld = kD + 8;
  static constexpr int kMld = kC + 4;
  static constexpr int kUld = kCols + 4;
  static constexpr int kW = 0;                     // W [C][kAld]
  static constexpr int kQ = kW + kC * kAld;        // Q⊙e^γ [C][kAld]
  static constexpr int kKe = kQ + kC * kAld;       // K⊙e^{γ_n−γ} [C][kKld]
  static constexpr int kM = kKe + kC * kKld;       // M [C][kMld]
  static constexpr int kU = kM + kC * kMld;        // U's columns [C][kUld]
  static constexpr int kDecay = kU + kC * kUld;    // e^{γ_n} [kD]
  static constexpr int kW2 = kDecay + kD;          // W's second buffer: chunk k's W at kW or kW2 by k's parity
  static constexpr int kBars = kW2 + kC * kAld;    // mbarriers: W at kW, W at kW2, Q⊙e^γ, level 2's rows
  static constexpr int kSw = kBars + 8;            // the swizzled operands, from the first 1,024-byte boundary
  static constexpr int kSBytes = kD * kCols * 4, kVBytes = kC * kCols * 4;
  static constexpr int kFloats = kSw + (2 * kSBytes + 2 * kVBytes + 1024) / 4;
  static_assert(kW % 32 == 0 && kQ % 32 == 0 && kKe % 32 == 0 && kM % 32 == 0 && kU % 32 == 0 && kDecay % 32 == 0 && kW2 % 32 == 0 &&
                    kAld % 4 == 0 && kKld % 4 == 0 && kMld % 4 == 0 && kUld % 4 == 0 && kBars % 2 == 0,
                "tensor copies to 128-byte boundaries, box rows of 16-byte multiples; 8-byte mbarriers");
  // The bytes that land on a barrier a chunk (whole boxes, the padding's zeros included): W or
  // Q⊙e^γ; K⊙e^{γ_n−γ}, M, U's columns and e^{γ_n}.
  static constexpr uint32_t kRowsBytes = kC * kAld * 4, kLevel2Bytes = kC * (kKld + kMld + kUld) * 4 + kD * 4;
};

// The scan's tensor maps over a batch's records ([chunks · heads] records of kKdaRecFloats floats): the
// records as rows of kD floats (W, Q⊙e^γ, K⊙e^{γ_n−γ} and U) or of kC (M), each box one chunk's array
// (U: a block's columns) landing in the scan's padded rows, the padding past the matrix's last column
// filled with zeros by the copy. make(base, rows, cols, box_cols, box_rows) encodes one (the driver's
// encoder on the device: kda_prefill.cu; the emulator's stand-in in its test).
struct KdaScanMaps {
  TensorMap a, ke, u, m;  // boxes of kAld (W, Q⊙e^γ), kKld, kUld and kMld columns, kC rows each
};
static_assert(kKdaRecFloats % kD == 0 && kKdaRecQg % kD == 0 && kKdaRecKe % kD == 0 && kKdaRecW % kD == 0 && kKdaRecU % kD == 0 &&
                  kKdaRecM % kC == 0,
              "a record's arrays start on rows of its tensor maps");
template <typename Make>
KdaScanMaps kda_scan_maps(const KdaPrefillArgs& a, Make make) {
  using S = ScanSmem;
  const int64_t records = static_cast<int64_t>(a.chunks) * a.heads, rows = records * (kKdaRecFloats / kD);
  return {make(a.records, rows, kD, S::kAld, kC), make(a.records, rows, kD, S::kKld, kC), make(a.records, rows, kD, S::kUld, kC),
          make(a.records, records * (kKdaRecFloats / kC), kC, S::kMld, kC)};
}
constexpr int kKdaScanBytes = ScanSmem::kFloats * 4;

// One scan block: value columns [kKdaScanCols·group, …) of head h over sequence seq's chunks; sm:
// kKdaScanBytes of shared memory. Four warpgroups, each an m64n32 accumulator:
//   level 1: warpgroup 0 W·S₀, then V_new = U − W·S₀ into V_newᵀ's planes; warpgroup 1 (Q⊙e^γ)·S₀;
//   level 2: warpgroup 1 O += M·V_new and the output; warpgroups 2 and 3 the state update of key rows
//     0–63 and 64–127, S ← diag(e^{γ_n})·S₀ + (K⊙e^{γ_n−γ})ᵀ·V_new, the slice kept in their
//     accumulators from chunk to chunk and written into S₀ᵀ's planes for the next level 1.
__device__ __forceinline__ void kda_scan_block(const KdaPrefillArgs& a, const KdaScanMaps& maps, float* sm, int group, int h, int seq) {
  using S = ScanSmem;
  const int c0 = kCols * group, d = a.d;
  const int cols = d - c0 < kCols ? d - c0 : kCols;
  const int chunk0 = a.seq_chunk0[seq], chunks = a.seq_chunks[seq];
  float* state = a.state + a.seq_slot[seq] * a.state_slot_floats + static_cast<int64_t>(h) * d * d;
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id(), g = lane / 4, t4 = lane % 4;
  const int wg = warp / 4, m0 = 16 * (warp % 4);  // the warpgroup; the warp's rows of its m64 tile
  float *qb = sm + S::kQ, *kb = sm + S::kKe, *mb = sm + S::kM, *ub = sm + S::kU, *decay = sm + S::kDecay;
#ifdef PLOW_CUDA_EMU
  emu_wg_smem = reinterpret_cast<const char*>(sm);
  emu_mbar_smem = reinterpret_cast<char*>(sm);
#endif
  const uint32_t sw = (wg_smem(sm + S::kSw) + 1023u) & ~1023u;
  char* sw_ptr = reinterpret_cast<char*>(sm) + (sw - wg_smem(sm));
  const uint32_t s_hi = sw, s_lo = sw + S::kSBytes, v_hi = sw + 2 * S::kSBytes, v_lo = v_hi + S::kVBytes;
  const auto put = [&](uint32_t plane, int k, int n, float x) {  // x split into a hi / lo pair of planes
    uint32_t hi, lo;
    tf32_split(x, hi, lo);
    *reinterpret_cast<uint32_t*>(sw_ptr + (plane - sw) + wg_b_offset(k, n)) = hi;
    *reinterpret_cast<uint32_t*>(sw_ptr + (plane - sw) + (plane == s_hi ? S::kSBytes : S::kVBytes) + wg_b_offset(k, n)) = lo;
  };
  const auto record = [&](int k) { return a.records + (static_cast<int64_t>(chunk0 + k) * a.heads + h) * kKdaRecFloats; };
  // The copies, one tensor copy an array (the record's rows into the padded shared rows) issued by one
  // thread, each as early as its buffer is free: chunk k + 1's W (two buffers) when chunk k's level 1
  // starts, its Q⊙e^γ when chunk k's level 1 is done, its level-2 rows when chunk k's level 2 is done.
  // A barrier's n-th phase is its n-th chunk; the thread arrives on it with the bytes to land.
  constexpr int kCopier = 128;  // warpgroup 1's first thread (its products are off the chain)
  const uint32_t bars = wg_smem(sm + S::kBars), bar_q = bars + 16, bar_level2 = bars + 24;
  const auto w_of = [&](int k) { return sm + (k % 2 == 0 ? S::kW : S::kW2); };
  const auto bar_w = [&](int k) { return bars + 8 * (k % 2); };
  // Chunk k's record as rows of kD floats (M's as rows of kC).
  const auto row_of = [&](int k, int64_t offset, int width) {
    return static_cast<int>((static_cast<int64_t>(chunk0 + k) * a.heads + h) * (kKdaRecFloats / width) + offset / width);
  };
  const auto load_w = [&](int k) {
    mbar_expect_tx(bar_w(k), S::kRowsBytes);
    tensor_g2s_2d(wg_smem(w_of(k)), &maps.a, 0, row_of(k, kKdaRecW, kD), bar_w(k));
  };
  const auto load_q = [&](int k) {
    mbar_expect_tx(bar_q, S::kRowsBytes);
    tensor_g2s_2d(wg_smem(qb), &maps.a, 0, row_of(k, kKdaRecQg, kD), bar_q);
  };
  const auto load_level2 = [&](int k) {  // K⊙e^{γ_n−γ}, M, U's columns, e^{γ_n}
    mbar_expect_tx(bar_level2, S::kLevel2Bytes);
    tensor_g2s_2d(wg_smem(kb), &maps.ke, 0, row_of(k, kKdaRecKe, kD), bar_level2);
    tensor_g2s_2d(wg_smem(mb), &maps.m, 0, row_of(k, kKdaRecM, kC), bar_level2);
    tensor_g2s_2d(wg_smem(ub), &maps.u, c0, row_of(k, kKdaRecU, kD), bar_level2);
    bulk_g2s(wg_smem(decay), record(k) + kKdaRecDecay, kD * 4, bar_level2);
  };
  if (tid == kCopier) {
    for (int b = 0; b < 4; ++b) mbar_init(bars + 8 * b, 1);
    mbar_init_fence();
    load_w(0);
    load_q(0);
    load_level2(0);
  }
  __syncthreads();  // the barriers initialized before anyone waits on them

  // The one accumulator a thread holds: level 1's product (warpgroups 0 and 1, from zero each chunk),
  // the output (warpgroup 1), the state slice (warpgroups 2 and 3, from chunk to chunk: element e at key
  // row j0 + m0 + g (+ 8 for e mod 4 ≥ 2), column 8·(e / 4) + 2·t4 + e mod 2).
  const int j0 = 64 * (wg - 2);
  float acc[16] = {};
  const auto each_of_slice = [&](auto visit) {  // visit(value, key row j, column c); c0 + c is the state's
#pragma unroll
    for (int e = 0; e < 16; ++e) visit(acc[e], j0 + m0 + g + 8 * (e % 4 / 2), 8 * (e / 4) + 2 * t4 + e % 2);
  };
  if (wg >= 2) {
    each_of_slice([&](float& x, int j, int c) {
      x = j < d && c < cols ? state[static_cast<int64_t>(j) * d + c0 + c] : 0.0f;
      put(s_hi, j, c, x);
    });
  }
  for (int k = 0; k < chunks; ++k) {
    const int row0 = a.chunk_row0[chunk0 + k], n = a.chunk_len[chunk0 + k];
    if (wg < 2) {  // W, Q⊙e^γ
      mbar_wait(bar_w(k), k / 2 % 2);
      mbar_wait(bar_q, k % 2);
    }
    wg_fence_proxy();  // S₀'s planes, written by st.shared, seen by wgmma
    __syncthreads();   // and chunk k − 1's level 1 done with the other W buffer
    if (tid == kCopier && k + 1 < chunks) load_w(k + 1);
    if (wg < 2) {
#pragma unroll
      for (int e = 0; e < 16; ++e) acc[e] = 0.0f;
      const float* A = wg == 0 ? w_of(k) : qb;
      wg_product(acc, kD / 8, [&](int s) { return wg_frag_rows(A, S::kAld, m0, s); }, s_hi, s_lo);
    }
    mbar_wait(bar_level2, k % 2);  // level 2's rows
    __syncthreads();               // and every warpgroup done with W, Q⊙e^γ and S₀'s planes
    if (tid == kCopier && k + 1 < chunks) load_q(k + 1);
    if (wg == 0) {  // V_new = U − W·S₀, split into V_newᵀ's planes (k = position, n = column)
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int t = m0 + g + 8 * (e % 4 / 2), c = 8 * (e / 4) + 2 * t4 + e % 2;
        put(v_hi, t, c, ub[t * S::kUld + c] - acc[e]);
      }
    }
    wg_fence_proxy();
    __syncthreads();
    if (wg == 1) {
      wg_product(acc, kC / 8, [&](int s) { return wg_frag_rows(mb, S::kMld, m0, s); }, v_hi, v_lo);
      float* out = a.out + static_cast<int64_t>(row0 + m0 + g) * a.out_stride + static_cast<int64_t>(h) * d + c0;
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int t = m0 + g + 8 * (e % 4 / 2), c = 8 * (e / 4) + 2 * t4 + e % 2;
        if (t < n && c < cols) out[(e % 4 / 2) * 8 * a.out_stride + c] = round_act(a.out_act, acc[e]);
      }
    } else if (wg >= 2) {
      each_of_slice([&](float& x, int j, int) { x *= decay[j]; });
      wg_product(acc, kC / 8, [&](int s) { return wg_frag_cols(kb, S::kKld, j0 + m0, s); }, v_hi, v_lo);  // (K⊙e^{γ_n−γ})ᵀ: A(j, p) = Ke[p][j]
    }
    __syncthreads();  // every product done with V_newᵀ and S₀ᵀ's planes; K⊙e^{γ_n−γ}, M and e^{γ_n} free
    if (wg >= 2) each_of_slice([&](float& x, int j, int c) { put(s_hi, j, c, x); });
    if (tid == kCopier && k + 1 < chunks) load_level2(k + 1);
  }
  if (wg >= 2) {
    each_of_slice([&](float& x, int j, int c) {
      if (j < d && c < cols) state[static_cast<int64_t>(j) * d + c0 + c] = x;
    });
  }
}

}  // namespace plow::cuda::kda_planned
