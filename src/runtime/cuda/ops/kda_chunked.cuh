// KDA's gated delta rule in the chunked form (spec/MODEL.md §6, C = 64; cpu: ops/kda.cpp chunk_head) for
// the sequences of a step that bring at least kKdaChunkedMinTokens tokens. Per chunk: the pairwise-decayed
// K·Kᵀ and Q·Kᵀ (A, M), U by forward substitution, the outputs, the state update; the state stays in the
// registers of the recurrent layout (KdaLayout: one pass of at most kCols value columns) across chunks.
// Pairwise decays are exp(γ_r − γ_j), never factored, as the CPU's: the K3 gate (γ down to −320 in a
// chunk) and strong Kimi decays cannot overflow. fp32 SIMT math throughout (no tensor cores yet).
#pragma once

#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda {

inline constexpr int kKdaChunk = 64;             // positions per chunk (the CPU's kChunk)
inline constexpr int kKdaChunkedMinTokens = 16;  // shorter sequences run token by token

// Shared memory of one chunk, in floats. Channel-major [c][t] arrays have row stride kLd = C + 1 so that a
// warp reading one position of 32 channels, or 32 positions of one channel, hits 32 banks; U's rows are
// padded by 32 / kPerCol so that the lanes of a warp's value columns, reading rows j ≡ r (mod kPerCol),
// do too.
//   γ [D][kLd]      cumulative log-decay within the chunk
//   AM [C][kLd]     A(r, j) = β_r Σ_c k_r k_j e^{γ_r−γ_j} (j < r) at [j][r]; M(r, j) = Σ_c q_r k_j e^{γ_r−γ_j} (j ≤ r) at [r][j]
//   U [C][kUld]     diag(β)(V − (K⊙e^γ)S₀) of the pass's columns, then solved in place to (I + A)⁻¹ of that
//   stage           per phase: k̂, q̂ pieces [kPiece][kLd] each; then K⊙e^γ, Q⊙e^γ, K⊙e^{γ_C−γ} in turn, [kTokens][D]
//   β, |q|, |k| [C] each
template <int D>
struct KdaChunkLayout {
  static constexpr int kLd = kKdaChunk + 1;
  static constexpr int kUld = KdaLayout<D>::kCols + 32 / KdaLayout<D>::kPerCol;
  static constexpr int kPiece = D < 16 ? D : 16;  // channels per A/M staging piece
  static constexpr int kStage = 2 * kPiece * kLd;
  static constexpr int kTokens = kStage / D < kKdaChunk ? kStage / D : kKdaChunk;  // positions per [kTokens][D] piece
  static constexpr int kGamma = 0;
  static constexpr int kAm = kGamma + D * kLd;
  static constexpr int kU = kAm + kKdaChunk * kLd;
  static constexpr int kStageAt = kU + kKdaChunk * kUld;
  static constexpr int kBeta = kStageAt + kStage;
  static constexpr int kQNorm = kBeta + kKdaChunk;
  static constexpr int kKNorm = kQNorm + kKdaChunk;
  static constexpr int kFloats = kKNorm + kKdaChunk;
  static_assert(kFloats * 4 <= kSharedBytes, "a chunk's tiles must fit the block's shared memory");
  static_assert(kKdaChunk * kKdaChunk % kThreads == 0, "A/M pairs split evenly over the threads");
};

// One chunk: positions [0, n) at arena rows row0 + t of head h, value columns [c0, c0 + cols); d the
// real head dim, D the padded one.
struct KdaChunk {
  int row0, n;
  int64_t h, d;
  int c0, cols;
  float q_scale;
  float* sm;
  const float *qnorm, *knorm;  // |q_t|, |k_t| in shared memory
  // q̂ (which 0) or k̂ (which 1) of position t, channel j (< d): divide by the norm, then scale, as the CPU.
  __device__ float normed(const TaskCtx& ctx, int which, int t, int64_t j) const {
    const float x = ctx.in(which, row0 + t)[h * d + j];
    return which == 0 ? x / qnorm[t] * q_scale : x / knorm[t];
  }
};

// Norms of q and k (ε = 1e−6 on the sum, inside the root; one warp per (position, q|k)), β, and γ by a
// sequential sum per channel (the CPU's order) over g staged first. Padded channels: γ = 0.
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
    if (lane == 0) ch.sm[(which == 0 ? CL::kQNorm : CL::kKNorm) + t] = sqrtf(sum + 1e-6f);
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

// A and M over the lower triangle: thread tid owns the pairs p = tid + kThreads·m (r = p / C, j = p mod C),
// accumulated over channel pieces of k̂, q̂ staged channel-major. Ends with the block synchronized.
template <int D>
__device__ void kda_chunk_pairs(const TaskCtx& ctx, const KdaChunk& ch) {
  using CL = KdaChunkLayout<D>;
  constexpr int kPairs = kKdaChunk * kKdaChunk / kThreads;
  const int tid = static_cast<int>(threadIdx.x);
  const float* gamma = ch.sm + CL::kGamma;
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
      const int p = tid + kThreads * m, r = p / kKdaChunk, j = p % kKdaChunk;
      if (j > r || r >= ch.n) continue;
      for (int c = 0; c < CL::kPiece; ++c) {
        const float* g = gamma + (c0 + c) * CL::kLd;
        const float kj = sk[c * CL::kLd + j] * expf(g[r] - g[j]);
        acc_k[m] += sk[c * CL::kLd + r] * kj;
        acc_q[m] += sq[c * CL::kLd + r] * kj;
      }
    }
    __syncthreads();  // the next piece overwrites the staging
  }
  float* am = ch.sm + CL::kAm;
#pragma unroll
  for (int m = 0; m < kPairs; ++m) {
    const int p = tid + kThreads * m, r = p / kKdaChunk, j = p % kKdaChunk;
    if (j > r || r >= ch.n) continue;
    am[r * CL::kLd + j] = acc_q[m];
    if (j < r) am[j * CL::kLd + r] = ch.sm[CL::kBeta + r] * acc_k[m];
  }
  __syncthreads();
}

// Stages positions [p0, p0 + np) of x̂ ⊙ e^{γ_t − γ_ref} (x = q (which 0) or k (1); γ_ref = 0, or γ of the
// chunk's last position when to_end) as [kTokens][D] at `dst`; ends with the block synchronized.
template <int D>
__device__ void kda_chunk_stage_rows(const TaskCtx& ctx, const KdaChunk& ch, int which, bool to_end, int p0, int np, float* dst) {
  using CL = KdaChunkLayout<D>;
  const float* gamma = ch.sm + CL::kGamma;
  for (int i = static_cast<int>(threadIdx.x); i < np * D; i += kThreads) {
    const int t = p0 + i / D, j = i % D;
    const float* g = gamma + j * CL::kLd;
    dst[i] = j < ch.d ? ch.normed(ctx, which, t, j) * expf(to_end ? g[ch.n - 1] - g[t] : g[t]) : 0.0f;
  }
  __syncthreads();
}

// Σ_j x[j]·S[j][c] over the register state: thread (c, r) sums its key rows; not reduced over the column.
template <int D>
__device__ __forceinline__ float kda_rows_dot(const float* x, int r, const float (&S)[KdaLayout<D>::kRows]) {
  using L = KdaLayout<D>;
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < L::kRows; ++i) sum += x[r + L::kPerCol * i] * S[i];
  return sum;
}

// Sum over the kPerCol adjacent lanes of a value column; every lane gets the total.
template <int D>
__device__ __forceinline__ float kda_column_sum(float v) {
  for (int o = 1; o < KdaLayout<D>::kPerCol; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Calls fn(t, x) on the pass's column threads (whole warps) for every position t of the chunk, x the
// staged row [D] of kda_chunk_stage_rows(which, to_end); pieces of kTokens positions, block-synchronized.
template <int D, typename Fn>
__device__ __forceinline__ void kda_for_each_staged(const TaskCtx& ctx, const KdaChunk& ch, int which, bool to_end, Fn fn) {
  using CL = KdaChunkLayout<D>;
  float* staged = ch.sm + CL::kStageAt;
  const bool column = static_cast<int>(threadIdx.x) / KdaLayout<D>::kPerCol < KdaLayout<D>::kCols;
  for (int p0 = 0; p0 < ch.n; p0 += CL::kTokens) {
    const int np = ch.n - p0 < CL::kTokens ? ch.n - p0 : CL::kTokens;
    kda_chunk_stage_rows<D>(ctx, ch, which, to_end, p0, np, staged);
    if (column) {
      for (int p = 0; p < np; ++p) fn(p0 + p, staged + p * D);
    }
    __syncthreads();  // the staging is overwritten next
  }
}

// U = diag(β)(V − (K⊙e^γ)S₀) from the register state.
template <int D>
__device__ __forceinline__ void kda_chunk_values(const TaskCtx& ctx, const KdaChunk& ch, const float (&S)[KdaLayout<D>::kRows]) {
  using L = KdaLayout<D>;
  using CL = KdaChunkLayout<D>;
  const int c = static_cast<int>(threadIdx.x) / L::kPerCol, r = static_cast<int>(threadIdx.x) % L::kPerCol;
  float* U = ch.sm + CL::kU;
  kda_for_each_staged<D>(ctx, ch, 1, false, [&](int t, const float* k_decayed) {
    const float predicted = kda_column_sum<D>(kda_rows_dot<D>(k_decayed, r, S));
    if (r == 0) {
      const float v = c < ch.cols ? ctx.in(2, ch.row0 + t)[ch.h * ch.d + ch.c0 + c] : 0.0f;
      U[t * CL::kUld + c] = ch.sm[CL::kBeta + t] * (v - predicted);
    }
  });
}

// o_t = S₀ᵀ(q_t ⊙ e^{γ_t}) + Σ_{j≤t} M(t, j) u_j: the first part from the register state, the second split
// over the lanes of the column like the key rows, one reduction for both. Runs before the state update.
template <int D>
__device__ __forceinline__ void kda_chunk_outputs(const TaskCtx& ctx, const KdaChunk& ch, const float (&S)[KdaLayout<D>::kRows]) {
  using L = KdaLayout<D>;
  using CL = KdaChunkLayout<D>;
  const int c = static_cast<int>(threadIdx.x) / L::kPerCol, r = static_cast<int>(threadIdx.x) % L::kPerCol;
  const float* am = ch.sm + CL::kAm;
  const float* U = ch.sm + CL::kU;
  kda_for_each_staged<D>(ctx, ch, 0, false, [&](int t, const float* q_decayed) {
    float sum = kda_rows_dot<D>(q_decayed, r, S);
    for (int j = r; j <= t; j += L::kPerCol) sum += am[t * CL::kLd + j] * U[j * CL::kUld + c];
    sum = kda_column_sum<D>(sum);
    if (r == 0 && c < ch.cols) ctx.out(ch.row0 + t)[ch.h * ch.d + ch.c0 + c] = round_out(ctx, sum);
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

// S ← diag(e^{γ_C})S + Σ_t (k_t ⊙ e^{γ_C − γ_t}) ⊗ u_t on the register state; ends with the block
// synchronized.
template <int D>
__device__ __forceinline__ void kda_chunk_update(const TaskCtx& ctx, const KdaChunk& ch, float (&S)[KdaLayout<D>::kRows]) {
  using L = KdaLayout<D>;
  using CL = KdaChunkLayout<D>;
  const int c = static_cast<int>(threadIdx.x) / L::kPerCol, r = static_cast<int>(threadIdx.x) % L::kPerCol;
  const float* gamma = ch.sm + CL::kGamma;
  const float* U = ch.sm + CL::kU;
#pragma unroll
  for (int i = 0; i < L::kRows; ++i) S[i] *= expf(gamma[(r + L::kPerCol * i) * CL::kLd + ch.n - 1]);
  kda_for_each_staged<D>(ctx, ch, 1, true, [&](int t, const float* k_to_end) {
    const float u = U[t * CL::kUld + c];
#pragma unroll
    for (int i = 0; i < L::kRows; ++i) S[i] += k_to_end[r + L::kPerCol * i] * u;
  });
}

// Every chunk of one head's sequence (tokens ≥ kKdaChunkedMinTokens) for value columns [c0, c0 + cols),
// state S in registers (KdaLayout<D>; padded rows and columns zero). Block-uniform.
template <int D>
__device__ __forceinline__ void kda_chunked(const TaskCtx& ctx, int first, int tokens, int64_t h, int64_t d, int c0, int cols,
                                            float (&S)[KdaLayout<D>::kRows]) {
  using CL = KdaChunkLayout<D>;
  for (int t0 = 0; t0 < tokens; t0 += kKdaChunk) {
    float* sm = smem_floats(ctx);
    const KdaChunk ch{first + t0, tokens - t0 < kKdaChunk ? tokens - t0 : kKdaChunk, h, d, c0, cols, 1.0f / sqrtf(static_cast<float>(d)), sm,
                      sm + CL::kQNorm, sm + CL::kKNorm};
    kda_chunk_stage<D>(ctx, ch);
    kda_chunk_pairs<D>(ctx, ch);
    kda_chunk_values<D>(ctx, ch, S);
    kda_chunk_solve<D>(ch);
    kda_chunk_outputs<D>(ctx, ch, S);  // reads S₀: before the update
    kda_chunk_update<D>(ctx, ch, S);
  }
}

}  // namespace plow::cuda
