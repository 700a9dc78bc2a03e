// The split-KV B item of MLA (mla.cuh) on tensor cores: scores S = Q·Cᵀ and u += P·C with
// mma.sync m16n8k16 (bf16 in, fp32 accumulate) for bf16-activation models.
// Why it keeps the SIMT body's results: the cache holds bf16 rows (the latents are rounded to the
// activation dtype, k_r is a rounded kv_a output, so 16 bits hold them exactly), and the fp32 operands
// q_abs and P are split into bf16 hi + lo (x = hi + lo + O(2⁻¹⁶·x)), two products each, so scores and
// u keep ~16 bits of mantissa where the SIMT body keeps 24: below the bf16 rounding of the op's output.
// A 32-row tile: 16 warps, each a quarter of the latent's k steps of one 8-row score n-tile (the four
// quarters meet in shared memory), then one warp a query for the online softmax, which also splits P,
// then each warp rank/16 value columns of u. Operands come from shared memory by ldmatrix (q and P as
// A, the tile transposed as P·C's B). Tiles come by cp.async straight into one of two shared buffers,
// the next tile landing while this one is used, and thread 0 has the L2 fetch the rows two tiles
// ahead (one bulk prefetch). With the fp32 cache of before, a tile went through registers (loaded,
// converted, stored): holding the next tile's rows in registers through this one's products, ptxas
// spilled every one of them (ptxas -v, 320 bytes of spill stores), so a tile's loads were not
// overlapped with the products before it (~4.3 µs a tile visit on the H200 at batch 32 × 32,768;
// docs/cuda.md).
// Emulator builds (tests/gpu/emu) run it with mla_flash.cuh's host stand-ins for ldmatrix and mma.
#pragma once

#include "runtime/cuda/mla_flash.cuh"  // flash_ldmatrix, flash_mma, flash_pack (and their emulator stand-ins)
#include "runtime/cuda/ops/mla_common.cuh"

namespace plow::cuda {

inline constexpr int kMlaMmaRows = 32;                          // cache rows per tile (4 n-tiles of the score)
inline constexpr int kMlaMmaLd = kMlaMaxLatent + 8;             // bf16 row stride (1,168 bytes: conflict-free ldmatrix rows)
inline constexpr int kMlaMmaPLd = kMlaMmaRows + 8;              // P's bf16 row stride (80 bytes: likewise)
inline constexpr int kMlaMmaRowsPerWarp = kMlaMmaRows / kWarps;  // tile rows a warp loads
inline constexpr int kMlaMmaTileElems = kMlaMmaRows * kMlaMmaLd;  // one tile buffer (bf16 elements)
inline constexpr int kMlaMmaChunkRounds = (kMlaMaxLatent / 8 + 31) / 32;  // 16-byte copies a lane per bf16 row

// Whether the op takes this item: bf16 activations and cache rows, and a shape the warp split below covers.
__device__ __forceinline__ bool mla_mma_fits(const TaskCtx& ctx, const MlaShape& sh) {
  return ctx.op->act == kABF16 && ctx.step->states[ctx.op->state].elem == kABF16 && sh.latent % 16 == 0 && sh.latent <= kMlaMaxLatent &&
         sh.rank % (8 * kWarps) == 0 && sh.rank <= kMlaMaxRank;
}

// x ≈ hi + lo, both bf16, packed two elements per register (element k low, k + 1 high).
__device__ __forceinline__ void mla_split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const float h0 = __bfloat162float(__float2bfloat16_rn(x0)), h1 = __bfloat162float(__float2bfloat16_rn(x1));
  hi = flash_pack<false>(h0, h1);
  lo = flash_pack<false>(x0 - h0, x1 - h1);
}

// Shared memory of the item (bytes from `base`): q hi/lo [16][kMlaMmaLd] bf16 each, two tiles
// [kMlaMmaRows][kMlaMmaLd] bf16 (this one, and the next one landing), score partials
// [4][16][kMlaMmaRows] fp32 (one per k quarter), P hi/lo [16][kMlaMmaPLd] bf16 each, and per query the
// running max, sum and this tile's rescale.
struct MlaMmaSmem {
  uint16_t *qhi, *qlo, *tile, *phi, *plo;
  float *part, *m, *l, *alpha;
};

__device__ __forceinline__ MlaMmaSmem mla_mma_smem(float* base) {
  MlaMmaSmem s;
  s.qhi = reinterpret_cast<uint16_t*>(base);
  s.qlo = s.qhi + kMlaGroup * kMlaMmaLd;
  s.tile = s.qlo + kMlaGroup * kMlaMmaLd;
  s.part = reinterpret_cast<float*>(s.tile + 2 * kMlaMmaTileElems);
  s.phi = reinterpret_cast<uint16_t*>(s.part + 4 * kMlaGroup * kMlaMmaRows);
  s.plo = s.phi + kMlaGroup * kMlaMmaPLd;
  s.m = reinterpret_cast<float*>(s.plo + kMlaGroup * kMlaMmaPLd);
  s.l = s.m + kMlaGroup;
  s.alpha = s.l + kMlaGroup;
  return s;
}
static_assert((2 * kMlaGroup + 2 * kMlaMmaRows) * kMlaMmaLd * 2 % 16 == 0 && kMlaGroup * kMlaMmaPLd * 2 % 16 == 0, "16-byte aligned ldmatrix rows");
static_assert((2 * kMlaGroup + 2 * kMlaMmaRows) * kMlaMmaLd * 2 + 4 * kMlaGroup * kMlaMmaRows * 4 + 2 * kMlaGroup * kMlaMmaPLd * 2 + 3 * kMlaGroup * 4 + 128 <=
                  kSharedBytes,
              "the MLA mma item's shared memory");
static_assert(kMlaMmaRows % kWarps == 0 && kMlaMaxLatent / 8 <= 32 * kMlaMmaChunkRounds, "the tile copy: whole rows a warp");
static_assert(kMlaGroup == 16 && kWarps == 16 && kMlaMmaRows == 32, "one m16 tile of queries; four score n-tiles × four k quarters over 16 warps");

// Has the L2 fetch cache rows [r0, r0 + n) (one bulk prefetch: the rows are contiguous, 16-byte
// multiples since latent % 16 == 0). A hint: nothing waits for it.
__device__ __forceinline__ void mla_mma_prefetch_rows(const uint8_t* cache, int latent, int r0, int n) {
#ifndef PLOW_CUDA_EMU
  if (n > 0) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(cache + static_cast<int64_t>(r0) * latent * 2), "r"(static_cast<uint32_t>(n * latent * 2))
                 : "memory");
  }
#else
  (void)cache, (void)latent, (void)r0, (void)n;
#endif
}

// Tile rows [r0, r0 + n) of the bf16 cache into `tile` ([kMlaMmaRows][kMlaMmaLd]) by cp.async, rows past
// n zero-filled (their P is 0, and 0·NaN would not be): warp w copies rows 2w and 2w + 1, lane the
// 16-byte chunks lane + 32i of each. Committed by the caller.
__device__ __forceinline__ void mla_mma_copy_tile(const uint8_t* cache, int latent, int r0, int n, uint16_t* tile) {
  const int lane = lane_id(), chunks = latent / 8;
#pragma unroll
  for (int k = 0; k < kMlaMmaRowsPerWarp; ++k) {
    const int row = warp_id() * kMlaMmaRowsPerWarp + k;
    const uint8_t* src = cache + static_cast<int64_t>(r0 + (row < n ? row : 0)) * latent * 2;
#pragma unroll
    for (int i = 0; i < kMlaMmaChunkRounds; ++i) {
      const int q = lane + 32 * i;
      if (q < chunks) cp_async16_zfill(tile + row * kMlaMmaLd + 8 * q, src + 16 * q, row < n);
    }
  }
}

// B item ib on tensor cores: as mla_split_item (mla.cuh), same records.
__device__ __noinline__ void mla_split_item_mma(const TaskCtx& ctx, const MlaShape sh, const MlaSchedule sched, int ib, const MlaWorkspace ws,
                                                float* smem) {
  const StepView& step = *ctx.step;
  const MlaBItem it = mla_b_item(step, sh, sched, ib);
  const int s = it.seq, context = it.context, first = it.first, q0 = it.q0, nq = it.nq, begin = it.begin, stop = it.stop;
  const MlaMmaSmem sm = mla_mma_smem(smem);
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id();
  const int g = lane >> 2, c2 = (lane & 3) * 2;  // fragment row (group) and column pair
  const uint8_t* cache = state_bytes_of(ctx, step.seq_slot[s]);
  if (tid == 0) mla_mma_prefetch_rows(cache, sh.latent, begin, stop - begin < 2 * kMlaMmaRows ? stop - begin : 2 * kMlaMmaRows);
  if (begin < stop) mla_mma_copy_tile(cache, sh.latent, begin, stop - begin < kMlaMmaRows ? stop - begin : kMlaMmaRows, sm.tile);
  cp_async_commit();
  // The group's q_abs rows as bf16 hi/lo (zero rows past nq): every load in flight, then the stores.
  // Slots past nq load query nq − 1's row and drop it: a load under a branch was issued alone (SASS:
  // five dependent L2 latencies for the five loads a thread).
  {
    const int quads = sh.latent / 4;
    constexpr int kPer = (kMlaGroup * (kMlaMaxLatent / 4) + kThreads - 1) / kThreads;
    float4 v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * kThreads, j = idx / quads, e = (idx % quads) * 4;
      const int qi = q0 + (j < nq ? j : nq - 1);
      v[i] = __ldcg(reinterpret_cast<const float4*>(ws.qabs + (static_cast<int64_t>(first + qi / sh.heads) * sh.heads + qi % sh.heads) * sh.latent + e));
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * kThreads, j = idx / quads, e = (idx % quads) * 4;
      if (j >= kMlaGroup) break;
      if (j >= nq) v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      uint32_t h01, l01, h23, l23;
      mla_split_pair(v[i].x, v[i].y, h01, l01);
      mla_split_pair(v[i].z, v[i].w, h23, l23);
      *reinterpret_cast<uint2*>(sm.qhi + j * kMlaMmaLd + e) = make_uint2(h01, h23);
      *reinterpret_cast<uint2*>(sm.qlo + j * kMlaMmaLd + e) = make_uint2(l01, l23);
    }
  }
  if (tid < kMlaGroup) sm.m[tid] = -INFINITY, sm.l[tid] = 0.0f;
  // u [16 queries][rank]: warp w owns columns [w·rank/16, …) as rank/128 n-tiles of 8.
  constexpr int kMaxTiles = kMlaMaxRank / (8 * kWarps);
  const int ntiles = sh.rank / (8 * kWarps), e_base = warp * ntiles * 8;
  float u[kMaxTiles][4];
#pragma unroll
  for (int t = 0; t < kMaxTiles; ++t) u[t][0] = u[t][1] = u[t][2] = u[t][3] = 0.0f;
  const int ksteps = sh.latent / 16, kq = warp >> 2, nt = warp & 3;
  const int ks_begin = kq * ksteps / 4, ks_end = (kq + 1) * ksteps / 4;
  // ldmatrix addresses: an A fragment's lane gives row (lane & 7) + 8·bit 3 and column 8·bit 4 of its
  // 16×16 block (matrices rows 0–7 / 8–15 × columns 0–7 / 8–15, as a0..a3); a transposed B pair's lane
  // gives row k (lane & 7) + 8·bit 3 and column 8·bit 4 (two 8-column n-tiles, b0 b1 each).
  const int ld_row = (lane & 7) + 8 * ((lane >> 3) & 1), ld_col = 8 * (lane >> 4);
  for (int r0 = begin, buf = 0; r0 < stop; r0 += kMlaMmaRows, buf ^= 1) {
    const int n = stop - r0 < kMlaMmaRows ? stop - r0 : kMlaMmaRows;
    const uint16_t* tile = sm.tile + buf * kMlaMmaTileElems;
    cp_async_wait<0>();  // this thread's copies of this tile (the only ones in flight)
    // The tile (and, the first time, q and the stats) are in place, and every warp is past the last
    // tile's products: so the tile ends without a barrier of its own (its shared data, P, alpha and the
    // score partials, are next written after this one).
    __syncthreads();
    {
      // The next tile lands in the other buffer (last read by the tile before) while this one is used;
      // the L2 fetches the one after it.
      const int next = r0 + kMlaMmaRows, ahead = r0 + 2 * kMlaMmaRows;
      if (next < stop) mla_mma_copy_tile(cache, sh.latent, next, stop - next < kMlaMmaRows ? stop - next : kMlaMmaRows, sm.tile + (buf ^ 1) * kMlaMmaTileElems);
      cp_async_commit();
      if (tid == 0 && ahead < stop) mla_mma_prefetch_rows(cache, sh.latent, ahead, stop - ahead < kMlaMmaRows ? stop - ahead : kMlaMmaRows);
    }
    // Scores: warp (kq, nt) sums k steps [ks_begin, ks_end) of n-tile nt (rows nt·8 …); the hi and lo
    // products in two chains.
    {
      float dh[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const uint16_t* brow = tile + (nt * 8 + g) * kMlaMmaLd + c2;
      for (int ks = ks_begin; ks < ks_end; ++ks) {
        uint32_t ahi[4], alo[4];
        flash_ldmatrix<false>(ahi, sm.qhi + ld_row * kMlaMmaLd + ks * 16 + ld_col);
        flash_ldmatrix<false>(alo, sm.qlo + ld_row * kMlaMmaLd + ks * 16 + ld_col);
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(brow + ks * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(brow + ks * 16 + 8);
        flash_mma<false>(dh, ahi, b0, b1);
        flash_mma<false>(dl, alo, b0, b1);
      }
      float* part = sm.part + kq * kMlaGroup * kMlaMmaRows;
      *reinterpret_cast<float2*>(part + g * kMlaMmaRows + nt * 8 + c2) = make_float2(dh[0] + dl[0], dh[1] + dl[1]);
      *reinterpret_cast<float2*>(part + (g + 8) * kMlaMmaRows + nt * 8 + c2) = make_float2(dh[2] + dl[2], dh[3] + dl[3]);
    }
    __syncthreads();
    // Online softmax: warp j, query j, lane = tile row (kMlaMmaRows == 32); P split into bf16 hi/lo once.
    {
      const int j = warp, r = lane;
      float score = -INFINITY;
      if (j < nq && r < n && r0 + r < context + (q0 + j) / sh.heads + 1) {
        const int at = j * kMlaMmaRows + r, quarter = kMlaGroup * kMlaMmaRows;
        score = (sm.part[at] + sm.part[at + quarter] + sm.part[at + 2 * quarter] + sm.part[at + 3 * quarter]) * sh.scale;
      }
      const float m_old = sm.m[j], m_new = fmaxf(m_old, warp_max(score));
      float p = 0.0f, alpha = 1.0f;
      if (m_new != -INFINITY) {
        alpha = expf(m_old - m_new);  // 0 while m was −∞
        p = expf(score - m_new);      // 0 for hidden rows
      }
      const __nv_bfloat16 hi = __float2bfloat16_rn(p);
      sm.phi[j * kMlaMmaPLd + r] = *reinterpret_cast<const uint16_t*>(&hi);
      const __nv_bfloat16 lo = __float2bfloat16_rn(p - __bfloat162float(hi));
      sm.plo[j * kMlaMmaPLd + r] = *reinterpret_cast<const uint16_t*>(&lo);
      const float sum = warp_sum(p);
      __syncwarp();  // every lane has read m[j] before lane 0 rewrites it (racecheck)
      if (lane == 0) {
        sm.alpha[j] = alpha;
        if (m_new != -INFINITY) sm.l[j] = sm.l[j] * alpha + sum, sm.m[j] = m_new;
      }
    }
    __syncthreads();
    // u ← alpha·u + P·C over the tile's rows (two k steps of 16); C's fragments by transposed ldmatrix,
    // two n-tiles at a time.
    {
      const float a_lo = sm.alpha[g], a_hi = sm.alpha[g + 8];
#pragma unroll
      for (int t = 0; t < kMaxTiles; ++t) {
        if (t >= ntiles) break;
        u[t][0] *= a_lo, u[t][1] *= a_lo, u[t][2] *= a_hi, u[t][3] *= a_hi;
      }
#pragma unroll
      for (int ks = 0; ks < kMlaMmaRows / 16; ++ks) {
        uint32_t ahi[4], alo[4];
        flash_ldmatrix<false>(ahi, sm.phi + ld_row * kMlaMmaPLd + ks * 16 + ld_col);
        flash_ldmatrix<false>(alo, sm.plo + ld_row * kMlaMmaPLd + ks * 16 + ld_col);
#pragma unroll
        for (int t = 0; t < kMaxTiles; t += 2) {
          if (t >= ntiles) break;
          // Columns e_base + t·8 … + 15 (the second n-tile's past rank/16 when ntiles is odd: read, unused;
          // inside the row since e_base + ntiles·8 + 8 ≤ rank + 8 ≤ kMlaMmaLd).
          uint32_t b[4];
          flash_ldmatrix<true>(b, tile + (ks * 16 + ld_row) * kMlaMmaLd + e_base + t * 8 + ld_col);
          flash_mma<false>(u[t], ahi, b[0], b[1]);
          flash_mma<false>(u[t], alo, b[0], b[1]);
          if (t + 1 < ntiles) {
            flash_mma<false>(u[t + 1], ahi, b[2], b[3]);
            flash_mma<false>(u[t + 1], alo, b[2], b[3]);
          }
        }
      }
    }
  }
  __syncthreads();  // the stats (and when no tile ran, their initial values)
  const int64_t rec = static_cast<int64_t>(ib) * kMlaGroup;
  if (tid < nq) ws.part_ml[(rec + tid) * 2] = sm.m[tid], ws.part_ml[(rec + tid) * 2 + 1] = sm.l[tid];
#pragma unroll
  for (int t = 0; t < kMaxTiles; ++t) {
    if (t >= ntiles) break;
    const int e = e_base + t * 8 + c2;
    if (g < nq) ws.part_u[(rec + g) * sh.rank + e] = u[t][0], ws.part_u[(rec + g) * sh.rank + e + 1] = u[t][1];
    if (g + 8 < nq) ws.part_u[(rec + g + 8) * sh.rank + e] = u[t][2], ws.part_u[(rec + g + 8) * sh.rank + e + 1] = u[t][3];
  }
}

}  // namespace plow::cuda
