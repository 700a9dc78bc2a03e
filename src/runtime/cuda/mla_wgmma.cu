// The fused causal attention of one MLA prefill sequence on Hopper's warpgroup MMA, for the heads of
// the Kimi-Linear/K3 shape (q·k ≤ 192, v ≤ 128, beyond mla_flash.cuh's small instantiation): the same
// flash-attention-2 form, numerics and rounding points as mla_flash.cuh (see its comment for the error
// against the CPU reference), with the products on wgmma instead of mma.sync:
//  - a block is two warpgroups (256 threads), 64 query rows each, of one head; q is staged once into
//    shared memory in the 128-byte-swizzled K-major layout (wgmma.cuh), three 64-column tiles;
//  - K tiles of 64 positions (three 64-column tiles) and Vᵀ tiles (the values transposed by the
//    expansion, `ld_vt`: 128 rows of 64 positions, so they are K-major for P·V too) come through a ring
//    of three stages by cp.async, the next two tiles loading while this one is used;
//  - S = q·Kᵀ is twelve m64n64k16 with both operands in shared memory; the online softmax and the
//    output (mla_flash.cuh's flash_softmax_tile and flash_store_rows) work on the accumulators in
//    registers, whose layout is mma.sync's m16n8 tiles side by side; P, rounded to the element type,
//    is the register A operand of four m64n128k16 for O += P·V.
// The warpgroups share each K/V tile: at one warpgroup a block (64 rows, two blocks an SM) the tiles'
// copies from L2 came to ~10 MB a block at 32K positions (168 GB a 48B layer, of the order of the
// kernel's time at L2's bandwidth); two halve them (H200, 48B, MLA ops over 32K: 288 → 265 ms). S of
// tile j + 1 is issued right behind P·V of tile j (both products back to back on the tensor cores),
// from a ring of three stages: 8K 18.0 → 13.9 ms, 32K 265 → 199 ms. 169 KB of shared memory: one
// block an SM.
#include "runtime/cuda/kernels.h"  // declared in mla_gemm.h (host headers nvcc need not see)
#include "runtime/cuda/mla_flash.cuh"
#include "runtime/cuda/wgmma.cuh"

namespace plow::cuda {

namespace {

constexpr int kGroups = 2;            // warpgroups of a block, sharing its K/V tiles
constexpr int kRows = 64 * kGroups;   // query rows of a block: 64 a warpgroup (its wgmma M)
constexpr int kKeys = 64;             // positions of a K/V tile
constexpr int kThreads = 128 * kGroups;
constexpr int kQk = kMlaFlashQk, kDv = kMlaFlashDv;
constexpr int kQkTiles = kQk / 64;  // 64-column tiles of q and K
constexpr int kQBytes = kQkTiles * kRows * 128;
constexpr int kKBytes = kQkTiles * kKeys * 128;
constexpr int kStageBytes = kKBytes + kDv * 128;  // K, then Vᵀ [dv][64 positions]
constexpr int kStages = 4;  // tiles j + 1 .. j + 3 landed or in flight while tile j is used
constexpr int kBytes = kQBytes + kStages * kStageBytes + 1024;  // + the slack to align to 1,024 bytes
static_assert(kQk % 64 == 0 && kDv == 128, "whole 64-column tiles of q·k; P·V is one m64n128 product");
static_assert(kQBytes % 1024 == 0 && kKBytes % 1024 == 0 && kStageBytes % 1024 == 0, "tiles start on swizzle atoms");

// K/V tile j (positions [64j, 64j + 64)) into the stage at `at`, whole 16-byte copies: K rows from
// `keys` on and columns past ld_k, Vᵀ rows past dv and positions from `keys` on (by 8: a copy that
// starts before `keys` reads the values up to its end, finite: the expansion zeroes [visible, ld_vt))
// are the copies' zero fill. Thread t copies chunk t mod 8 of rows t/8 + 32i of each 64-column K tile
// and of the Vᵀ tile, so its swizzled offset is one per thread (row mod 8 is t/8 mod 8) and the rest
// steps by constants (the copies' address arithmetic was a fifth of the kernel's instructions).
__device__ __forceinline__ void stage_tile(const MlaFlashArgs& a, const uint16_t* kg, const uint16_t* vtg, int keys, int j, uint32_t at, int tid) {
  static_assert(kThreads == 256 && kKeys == 64 && kDv == 128, "32 rows of 8 chunks a round");
  const int j0 = j * kKeys, r0 = tid / 8, c = tid % 8;
  const uint32_t lane_at = at + static_cast<uint32_t>(r0 * 128 + ((c ^ (r0 & 7)) << 4));
#pragma unroll
  for (int i = 0; i < kKeys / 32; ++i) {
    const int row = j0 + r0 + 32 * i;
    const uint16_t* src = kg + static_cast<int64_t>(row) * a.ld_k + 8 * c;
#pragma unroll
    for (int t = 0; t < kQkTiles; ++t) {
      const bool real = row < keys && 64 * t + 8 * c < a.ld_k;
      wg_cp16(lane_at + t * (kKeys * 128) + i * (32 * 128), real ? src + 64 * t : kg, real ? 16 : 0);
    }
  }
  const int p = j0 + 8 * c;
#pragma unroll
  for (int i = 0; i < kDv / 32; ++i) {
    const int d = r0 + 32 * i;
    const bool real = d < a.dv && p < keys;
    wg_cp16(lane_at + kKBytes + i * (32 * 128), real ? vtg + static_cast<int64_t>(d) * a.ld_vt + p : vtg, real ? 16 : 0);
  }
}

// Block (head blockIdx.x, query tile gridDim.y − 1 − blockIdx.y: the longest blocks start first).
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) mla_wgmma_kernel(MlaFlashArgs a) {
  constexpr bool kF16 = std::is_same_v<T, __half>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = (wg_smem(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_at = base;
  const auto stage_at = [&](int tile) { return base + kQBytes + static_cast<uint32_t>(tile % kStages) * kStageBytes; };
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32, g = lane / 4, c = lane % 4, group = tid / 128;
  const int h = static_cast<int>(blockIdx.x), t0 = static_cast<int>(gridDim.y - 1 - blockIdx.y) * kRows;
  const int keys = a.context + min(t0 + kRows, a.tokens);  // the block's last row sees positions [0, keys)
  const int tiles = (keys + kKeys - 1) / kKeys;
  const uint16_t* kg = a.keys + static_cast<int64_t>(h) * (a.context + a.tokens) * a.ld_k;
  const uint16_t* vtg = a.values + static_cast<int64_t>(h) * a.dv * a.ld_vt;
  // Copy groups: the prologue commits tiles 0..kStages−1 (empty past the last), iteration j one more
  // (tile j + kStages into the slot tile j leaves), so tile t is group t.
#pragma unroll
  for (int t = 0; t < kStages; ++t) {
    if (t < tiles) stage_tile(a, kg, vtg, keys, t, stage_at(t), tid);
    flash_cp_commit();
  }

  // q rows [t0, t0 + 64) of head h in the element type (exact: q is an activation), zero past tokens
  // and qk; the first tile's fence and barrier order these stores before wgmma reads them.
  {
    const float* q = a.q + static_cast<int64_t>(h) * a.qk;
    constexpr int kChunks = kQk / 8;
#pragma unroll 2
    for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
      const int r = idx / kChunks, ch = idx % kChunks, row = t0 + r;
      const float* src = q + static_cast<int64_t>(row) * a.q_stride + 8 * ch;
      float x[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = row < a.tokens && 8 * ch + e < a.qk ? src[e] : 0.0f;
      const uint4 v = make_uint4(flash_pack<kF16>(x[0], x[1]), flash_pack<kF16>(x[2], x[3]), flash_pack<kF16>(x[4], x[5]), flash_pack<kF16>(x[6], x[7]));
      const uint32_t at = q_at + (ch / 8) * (kRows * 128) + wg_swizzle(r, ch % 8);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    }
  }
  FlashRows rows{t0 + warp * 16 + g, t0 + warp * 16 + g + 8};  // this thread's rows of the warp's 16 (warps of group w: rows 64w…)
  // The accumulators as mla_flash.cuh's m16n8 tiles side by side; wgmma takes them flat (same order).
  float o[kDv / 8][4];
#pragma unroll
  for (int nt = 0; nt < kDv / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float(&o_flat)[kDv / 2] = reinterpret_cast<float(&)[kDv / 2]>(o);

  // Two tiles' scores: S of tile j + 1 accumulates in one while the softmax of the other runs, so the
  // tensor cores have P·V of tile j and S of tile j + 2 queued while the CUDA cores take tile j + 1's
  // softmax (flash-attention 3's intra-warpgroup overlap). The buffers alternate, hence the loop below
  // runs two iterations a turn.
  float sa[kKeys / 8][4], sb[kKeys / 8][4];
  uint32_t p[kKeys / 16][4];  // P of the tile whose P·V is next, in the element type
  const auto issue_scores = [&](float(&d)[kKeys / 8][4], int tile) {  // tile's copies landed for every thread before
    float(&d_flat)[kKeys / 2] = reinterpret_cast<float(&)[kKeys / 2]>(d);
#pragma unroll
    for (int i = 0; i < kKeys / 2; ++i) asm volatile("mov.b32 %0, 0;" : "=f"(d_flat[i]));  // a zero of its own each: a shared one became an accumulator
    wg_fence();
#pragma unroll
    for (int k = 0; k < kQk / 16; ++k) {
      const uint32_t step = (k / 4) * (kRows * 128) + group * (64 * 128) + 32 * (k % 4), k_step = (k / 4) * (kKeys * 128) + 32 * (k % 4);
      wg_mma_ss<T>(d_flat, wg_desc(q_at + step), wg_desc(stage_at(tile) + k_step));
    }
  };
  // Softmax of tile `tile`'s landed scores d; the returned factors rescale O once the P·V before it is done.
  const auto softmax = [&](float(&d)[kKeys / 8][4], int tile) {
    wg_fence_operand(reinterpret_cast<float(&)[kKeys / 2]>(d));  // not read ahead of the wait
    return flash_softmax_scores(d, rows, tile * kKeys, tile * kKeys + kKeys - 1 > a.context + t0, a.context, a.scale_log2, c);
  };
  // O += P·V: score tiles 2kk, 2kk + 1 are the A fragment of positions [16kk, 16kk + 16).
  const auto pack = [&](const float(&d)[kKeys / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      p[kk][0] = flash_pack<kF16>(d[2 * kk][0], d[2 * kk][1]), p[kk][1] = flash_pack<kF16>(d[2 * kk][2], d[2 * kk][3]);
      p[kk][2] = flash_pack<kF16>(d[2 * kk + 1][0], d[2 * kk + 1][1]), p[kk][3] = flash_pack<kF16>(d[2 * kk + 1][2], d[2 * kk + 1][3]);
    }
  };

  // Prologue: S of tiles 0 and 1 issued, tile 0's softmax taken and P packed (O is zero: no rescale).
  // S of tile 1 is issued even when the block has one tile (its stage holds no tile then; the scores
  // are never read): ptxas serializes the products where a wait cannot be proven to complete them, so
  // every product and every wait below is on a path without conditions on the tile count.
  flash_cp_wait<kStages - 1>();  // tile 0
  wg_fence_proxy();
  __syncthreads();  // tile 0 and q in shared memory for every thread
  issue_scores(sa, 0);
  wg_commit();
  flash_cp_wait<kStages - 2>();  // tile 1
  wg_fence_proxy();
  __syncthreads();
  issue_scores(sb, 1);
  wg_commit();
  wg_wait_pending<1>();
  softmax(sa, 0);
  pack(sa);

  // Iteration j: S(j) done, P(j) in p; S(j + 1) issued into `next` (when `has_next`), `free` unused;
  // `issue`: S(j + 2) into `free`. Two product groups a turn (P·V, then S or none), so the waits count
  // the same in every iteration. Copy group t is tile t (the prologue committed tiles 0..kStages − 1,
  // iteration j commits tile j + kStages).
  const auto iteration = [&](int j, float(&next)[kKeys / 8][4], float(&free)[kKeys / 8][4], auto issue, auto has_next) {
    if constexpr (decltype(issue)::value) {
      flash_cp_wait<kStages - 3>();  // tile j + 2 (groups up to j + kStages − 1 committed)
      wg_fence_proxy();
      __syncthreads();  // tile j + 2 for every thread
    }
    wg_fence_operand(reinterpret_cast<uint32_t(&)[kKeys / 4]>(p));
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) wg_mma_rs<T>(o_flat, p[kk], wg_desc(stage_at(j) + kKBytes + 32 * kk));
    wg_commit();
    if constexpr (decltype(issue)::value) issue_scores(free, j + 2);
    wg_commit();
    wg_wait_pending<2>();  // S(j + 1); P·V(j) and S(j + 2) may run on
    FlashAlpha alpha{};
    if constexpr (decltype(has_next)::value) alpha = softmax(next, j + 1);
    wg_wait_pending<1>();  // P·V(j)
    wg_fence_operand(o_flat);
    wg_fence_operand(reinterpret_cast<uint32_t(&)[kKeys / 4]>(p));
    if constexpr (decltype(has_next)::value) {
      flash_rescale(o, alpha);
      pack(next);
    }
    __syncthreads();  // every warpgroup is done with tile j's slot
    if (j + kStages < tiles) stage_tile(a, kg, vtg, keys, j + kStages, stage_at(j), tid);
    flash_cp_commit();
  };
  using Yes = std::true_type;
  using No = std::false_type;
  int j = 0;
  for (; j + 3 < tiles; j += 2) {
    iteration(j, sb, sa, Yes{}, Yes{});
    iteration(j + 1, sa, sb, Yes{}, Yes{});
  }
  // One to three tiles left, S(j + 1) in sb.
  if (tiles - j == 3) {
    iteration(j, sb, sa, Yes{}, Yes{});
    iteration(j + 1, sa, sb, No{}, Yes{});
    iteration(j + 2, sb, sa, No{}, No{});
  } else if (tiles - j == 2) {
    iteration(j, sb, sa, No{}, Yes{});
    iteration(j + 1, sa, sb, No{}, No{});
  } else {
    iteration(j, sb, sa, No{}, No{});
  }
  wg_wait_pending<0>();  // the last (empty) group
  flash_cp_wait<0>();    // the trailing (empty) groups

  flash_store_rows(a, o, rows, h, c);
}

template <typename T>
void launch(const MlaFlashArgs& args, cudaStream_t stream) {
  // Per device (tensor-parallel ranks may be threads of one process): set at every launch.
  const cudaError_t error = cudaFuncSetAttribute(mla_wgmma_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (error != cudaSuccess) cuda_failure("MLA wgmma attention shared memory", error);
  const dim3 grid(static_cast<unsigned>(args.heads), static_cast<unsigned>((args.tokens + kRows - 1) / kRows));
  mla_wgmma_kernel<T><<<grid, kThreads, kBytes, stream>>>(args);
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) cuda_failure("MLA wgmma attention", launched);
}

}  // namespace

void launch_mla_wgmma(const MlaFlashArgs& args, int32_t type, cudaStream_t stream) {
  if (args.tokens == 0) return;
  if (type == kWF16) {
    launch<__half>(args, stream);
  } else {
    launch<__nv_bfloat16>(args, stream);
  }
}

}  // namespace plow::cuda
