// The split-KV B item of MLA (mla.cuh) on tensor cores: scores S = Q·Cᵀ and u += P·C with
// mma.sync m16n8k16 (bf16 in, fp32 accumulate) for bf16-activation models.
// Why it keeps the SIMT body's results: the cache rows are bf16-exact there (the latents are rounded
// to the activation dtype, k_r is a rounded kv_a output), and the fp32 operands q_abs and P are split
// into bf16 hi + lo (x = hi + lo + O(2⁻¹⁶·x)), two products each, so scores and u keep ~16 bits of
// mantissa where the SIMT body keeps 24: below the bf16 rounding of the op's output.
// The SIMT body spent ~250 µs per MLA layer at batch 1 × 4096 positions (ncu: ~440K warp instructions
// per item at IPC 1, stalled on its barriers); this item does a 32-row tile in 544 mma (288 for the
// scores, 256 for P·C, hi and lo each), spread over the 16 warps.
#pragma once

#include "runtime/cuda/ops/mla_common.cuh"

namespace plow::cuda {

inline constexpr int kMlaMmaRows = 32;               // cache rows per tile (4 n-tiles of the score)
inline constexpr int kMlaMmaLd = kMlaMaxLatent + 8;  // bf16 row stride in shared memory (conflict-free fragments)

// Whether the op takes this item: bf16 activations, and a shape the warp split below covers.
__device__ __forceinline__ bool mla_mma_fits(const TaskCtx& ctx, const MlaShape& sh) {
  return ctx.op->act == kABF16 && sh.latent % 16 == 0 && sh.latent <= kMlaMaxLatent && sh.rank % (8 * kWarps) == 0 && sh.rank <= kMlaMaxRank;
}

__device__ __forceinline__ uint32_t mla_pack_bf16(float low, float high) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(low, high);  // .x (low half) = low
  return *reinterpret_cast<const uint32_t*>(&v);
}

// x ≈ hi + lo, both bf16, packed two elements per register (element k low, k + 1 high).
__device__ __forceinline__ void mla_split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const float h0 = __bfloat162float(__float2bfloat16_rn(x0)), h1 = __bfloat162float(__float2bfloat16_rn(x1));
  hi = mla_pack_bf16(h0, h1);
  lo = mla_pack_bf16(x0 - h0, x1 - h1);
}

// d += a·b: a 16×16 (row-major fragment), b 16×8 (column fragment), d 16×8 fp32.
__device__ __forceinline__ void mla_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared memory of the item (bytes from `base`): q hi/lo [16][kMlaMmaLd] bf16 each, the tile
// [kMlaMmaRows][kMlaMmaLd] bf16, score partials [4][16][kMlaMmaRows] fp32 (one per k quarter), P
// [16][kMlaMmaRows] fp32, and per query the running max, sum and this tile's rescale.
struct MlaMmaSmem {
  __nv_bfloat16 *qhi, *qlo, *tile;
  float *part, *p, *m, *l, *alpha;
};

__device__ __forceinline__ MlaMmaSmem mla_mma_smem(float* base) {
  MlaMmaSmem s;
  s.qhi = reinterpret_cast<__nv_bfloat16*>(base);
  s.qlo = s.qhi + kMlaGroup * kMlaMmaLd;
  s.tile = s.qlo + kMlaGroup * kMlaMmaLd;
  s.part = reinterpret_cast<float*>(s.tile + kMlaMmaRows * kMlaMmaLd);
  s.p = s.part + 4 * kMlaGroup * kMlaMmaRows;
  s.m = s.p + kMlaGroup * kMlaMmaRows;
  s.l = s.m + kMlaGroup;
  s.alpha = s.l + kMlaGroup;
  return s;
}
static_assert((2 * kMlaGroup + kMlaMmaRows) * kMlaMmaLd * 2 + (5 * kMlaGroup * kMlaMmaRows + 3 * kMlaGroup) * 4 + 128 <= kSharedBytes,
              "the MLA mma item's shared memory");
static_assert(kMlaMmaRows * (kMlaMaxLatent / 4) % kThreads == 0, "the tile load: whole float4 rounds");
static_assert(kMlaGroup == 16 && kWarps == 16, "one m16 tile of queries; four score n-tiles × four k quarters over 16 warps");

// B item ib on tensor cores: as mla_split_item (mla.cuh), same records.
__device__ __noinline__ void mla_split_item_mma(const TaskCtx& ctx, const MlaShape sh, const MlaSchedule sched, int ib, const MlaWorkspace ws,
                                                float* smem) {
  const StepView& step = *ctx.step;
  const MlaBItem it = mla_b_item(step, sh, sched, ib);
  const int s = it.seq, context = it.context, first = it.first, q0 = it.q0, nq = it.nq, begin = it.begin, stop = it.stop;
  const MlaMmaSmem sm = mla_mma_smem(smem);
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id();
  const int g = lane >> 2, c2 = (lane & 3) * 2;  // fragment row (group) and column pair
  const int quads = sh.latent / 4;
  // The group's q_abs rows as bf16 hi/lo (zero rows past nq): every load in flight, then the stores.
  // Slots past nq load query nq − 1's row and drop it: a load under a branch was issued alone (SASS:
  // five dependent L2 latencies for the five loads a thread).
  {
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
  const float* cache = state_of(ctx, step.seq_slot[s]);
  // u [16 queries][rank]: warp w owns columns [w·rank/16, …) as rank/128 n-tiles of 8.
  constexpr int kMaxTiles = kMlaMaxRank / (8 * kWarps);
  const int ntiles = sh.rank / (8 * kWarps), e_base = warp * ntiles * 8;
  float u[kMaxTiles][4];
#pragma unroll
  for (int t = 0; t < kMaxTiles; ++t) u[t][0] = u[t][1] = u[t][2] = u[t][3] = 0.0f;
  const int ksteps = sh.latent / 16, kq = warp >> 2, nt = warp & 3;
  const int ks_begin = kq * ksteps / 4, ks_end = (kq + 1) * ksteps / 4;
  for (int r0 = begin; r0 < stop; r0 += kMlaMmaRows) {
    const int n = stop - r0 < kMlaMmaRows ? stop - r0 : kMlaMmaRows;
    // The tile: rows [r0, r0 + n) as bf16 (exact), zero past n; every load in flight, then the stores.
    {
      constexpr int kPer = kMlaMmaRows * (kMlaMaxLatent / 4) / kThreads;
      const float* src = cache + static_cast<int64_t>(r0) * sh.latent;
      float4 v[kPer];
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int idx = tid + i * kThreads, row = idx / quads, e = (idx % quads) * 4;
        v[i] = row < n ? __ldcg(reinterpret_cast<const float4*>(src + static_cast<int64_t>(row) * sh.latent + e)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int idx = tid + i * kThreads, row = idx / quads, e = (idx % quads) * 4;
        if (row < kMlaMmaRows) *reinterpret_cast<uint2*>(sm.tile + row * kMlaMmaLd + e) = make_uint2(mla_pack_bf16(v[i].x, v[i].y), mla_pack_bf16(v[i].z, v[i].w));
      }
    }
    __syncthreads();  // the tile (and, the first time, q and the stats) are in place
    // Scores: warp (kq, nt) sums k steps [ks_begin, ks_end) of n-tile nt (rows nt·8 …).
    {
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const __nv_bfloat16* brow = sm.tile + (nt * 8 + g) * kMlaMmaLd + c2;
      for (int ks = ks_begin; ks < ks_end; ++ks) {
        const int kc = ks * 16 + c2;
        uint32_t ahi[4], alo[4];
        ahi[0] = *reinterpret_cast<const uint32_t*>(sm.qhi + g * kMlaMmaLd + kc);
        ahi[1] = *reinterpret_cast<const uint32_t*>(sm.qhi + (g + 8) * kMlaMmaLd + kc);
        ahi[2] = *reinterpret_cast<const uint32_t*>(sm.qhi + g * kMlaMmaLd + kc + 8);
        ahi[3] = *reinterpret_cast<const uint32_t*>(sm.qhi + (g + 8) * kMlaMmaLd + kc + 8);
        alo[0] = *reinterpret_cast<const uint32_t*>(sm.qlo + g * kMlaMmaLd + kc);
        alo[1] = *reinterpret_cast<const uint32_t*>(sm.qlo + (g + 8) * kMlaMmaLd + kc);
        alo[2] = *reinterpret_cast<const uint32_t*>(sm.qlo + g * kMlaMmaLd + kc + 8);
        alo[3] = *reinterpret_cast<const uint32_t*>(sm.qlo + (g + 8) * kMlaMmaLd + kc + 8);
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(brow + ks * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(brow + ks * 16 + 8);
        mla_mma(d, ahi, b0, b1);
        mla_mma(d, alo, b0, b1);
      }
      float* part = sm.part + kq * kMlaGroup * kMlaMmaRows;
      part[g * kMlaMmaRows + nt * 8 + c2] = d[0];
      part[g * kMlaMmaRows + nt * 8 + c2 + 1] = d[1];
      part[(g + 8) * kMlaMmaRows + nt * 8 + c2] = d[2];
      part[(g + 8) * kMlaMmaRows + nt * 8 + c2 + 1] = d[3];
    }
    __syncthreads();
    // Online softmax: warp j, query j, lane = tile row (kMlaMmaRows == 32).
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
      sm.p[j * kMlaMmaRows + r] = p;
      const float sum = warp_sum(p);
      __syncwarp();  // every lane has read m[j] before lane 0 rewrites it (racecheck)
      if (lane == 0) {
        sm.alpha[j] = alpha;
        if (m_new != -INFINITY) sm.l[j] = sm.l[j] * alpha + sum, sm.m[j] = m_new;
      }
    }
    __syncthreads();
    // u ← alpha·u + P·C over the tile's rows (two k steps of 16).
    {
      const float a_lo = sm.alpha[g], a_hi = sm.alpha[g + 8];
#pragma unroll
      for (int t = 0; t < kMaxTiles; ++t) {
        if (t >= ntiles) break;
        u[t][0] *= a_lo, u[t][1] *= a_lo, u[t][2] *= a_hi, u[t][3] *= a_hi;
      }
#pragma unroll
      for (int ks = 0; ks < kMlaMmaRows / 16; ++ks) {
        const int kr = ks * 16 + c2;
        uint32_t ahi[4], alo[4];
        mla_split_pair(sm.p[g * kMlaMmaRows + kr], sm.p[g * kMlaMmaRows + kr + 1], ahi[0], alo[0]);
        mla_split_pair(sm.p[(g + 8) * kMlaMmaRows + kr], sm.p[(g + 8) * kMlaMmaRows + kr + 1], ahi[1], alo[1]);
        mla_split_pair(sm.p[g * kMlaMmaRows + kr + 8], sm.p[g * kMlaMmaRows + kr + 9], ahi[2], alo[2]);
        mla_split_pair(sm.p[(g + 8) * kMlaMmaRows + kr + 8], sm.p[(g + 8) * kMlaMmaRows + kr + 9], ahi[3], alo[3]);
#pragma unroll
        for (int t = 0; t < kMaxTiles; ++t) {
          if (t >= ntiles) break;
          const int e = e_base + t * 8 + g;
          const __nv_bfloat16* col = sm.tile + e;
          const __nv_bfloat162 b0 = __halves2bfloat162(col[kr * kMlaMmaLd], col[(kr + 1) * kMlaMmaLd]);
          const __nv_bfloat162 b1 = __halves2bfloat162(col[(kr + 8) * kMlaMmaLd], col[(kr + 9) * kMlaMmaLd]);
          const uint32_t b0r = *reinterpret_cast<const uint32_t*>(&b0), b1r = *reinterpret_cast<const uint32_t*>(&b1);
          mla_mma(u[t], ahi, b0r, b1r);
          mla_mma(u[t], alo, b0r, b1r);
        }
      }
    }
    __syncthreads();  // tile and P are rewritten by the next tile
  }
  __syncthreads();  // the stats, when no tile ran
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
