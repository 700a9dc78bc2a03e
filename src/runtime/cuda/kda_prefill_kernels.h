// The chunked KDA delta rule of a prefill step as planned launches (kda_prefill.h): what the host
// passes to the two kernels of kda_prefill.cu (kda_prefill.cuh). Plain types only, so the device code
// (and the emulator test) needs no plan or CUDA runtime headers.
#pragma once

#include <cstdint>

#include "runtime/cuda/ops/limits.h"

namespace plow::cuda {

// The workspace record of one (chunk, head), floats: Q⊙e^γ, K⊙e^{γ_n−γ}, W = T'·(K⊙e^γ), U = T'·V
// ([C][128] each, row-major: position, channel), M [C][C], e^{γ_n} [128]. Rows past the chunk's length,
// channels past the head dim and M above its diagonal are zero.
inline constexpr int64_t kKdaRecQg = 0;
inline constexpr int64_t kKdaRecKe = kKdaRecQg + int64_t{kKdaChunk} * kKdaMaxHeadDim;
inline constexpr int64_t kKdaRecW = kKdaRecKe + int64_t{kKdaChunk} * kKdaMaxHeadDim;
inline constexpr int64_t kKdaRecU = kKdaRecW + int64_t{kKdaChunk} * kKdaMaxHeadDim;
inline constexpr int64_t kKdaRecM = kKdaRecU + int64_t{kKdaChunk} * kKdaMaxHeadDim;
inline constexpr int64_t kKdaRecDecay = kKdaRecM + int64_t{kKdaChunk} * kKdaChunk;
inline constexpr int64_t kKdaRecFloats = kKdaRecDecay + kKdaMaxHeadDim;

// How far a channel's γ may fall across a diagonal 16×16 block for the prep to take the block on tensor
// cores (kda_prefill.cuh, kDiagMmaSpread); steeper blocks go to SIMT.
inline constexpr float kKdaDiagMmaSpread = 60.0f;

// Host side (the benchmark's and the emulator test's count of steep blocks): whether the prep takes the
// diagonal block of positions [first, first + 16) of a chunk of n positions on SIMT, i.e. γ of some
// channel in [c_begin, c_end) falls by more than kKdaDiagMmaSpread across it. g points at the chunk's
// first row of the head's log-decays, rows `stride` floats apart; positions past n add nothing.
inline bool kda_diag_block_steep(const float* g, int64_t stride, int first, int n, int c_begin, int c_end) {
  for (int c = c_begin; c < c_end; ++c) {
    float fall = 0.0f;  // γ_first − γ_{first+15}
    for (int t = first + 1; t < first + 16 && t < n; ++t) fall -= g[t * stride + c];
    if (fall > kKdaDiagMmaSpread) return true;
  }
  return false;
}

// One batch of a step's sequences. Rows are the step's (row r of q at q + r·q_stride); the tables are
// on the device: per chunk of the batch its first row and length (1…C), per sequence its first chunk
// (within the batch), its chunks and its slot.
struct KdaPrefillArgs {
  const float *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0, g_stride = 0, beta_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  float* records = nullptr;  // [chunks][heads][kKdaRecFloats]
  const int32_t *chunk_row0 = nullptr, *chunk_len = nullptr;
  const int32_t *seq_chunk0 = nullptr, *seq_chunks = nullptr, *seq_slot = nullptr;
  float* state = nullptr;  // slot s's [heads, d, d] at state + s·state_slot_floats
  int64_t state_slot_floats = 0;
  int32_t chunks = 0, seqs = 0, heads = 0, d = 0;
  int32_t out_act = 0;  // ActType the output is rounded to (kAF32: not rounded)
};

}  // namespace plow::cuda
