// The fused causal attention of one MLA prefill sequence on Hopper's warpgroup MMA, for the heads of
// the Kimi-Linear/K3 shape (q·k ≤ 192, v ≤ 128, beyond mla_flash.cuh's small instantiation): the same
// flash-attention-2 form, numerics and rounding points as mla_flash.cuh (see its comment for the error
// against the CPU reference), with the products on wgmma instead of mma.sync:
//  - a block is two warpgroups (256 threads), 64 query rows each, of one head; each warp keeps its 16
//    rows of q, in the element type, as the register A fragments of S's twelve k steps (48 registers);
//  - K tiles of 64 positions (three 64-column tiles, 128-byte-swizzled K-major: wgmma.cuh) and Vᵀ tiles
//    (the values transposed by the expansion, `ld_vt`: 128 rows of 64 positions, so they are K-major for
//    P·V too) come by the tensor memory accelerator (TMA) into a ring of four stages, three tiles ahead,
//    one thread issuing a tile's four boxes, an mbarrier a stage completing when its bytes landed;
//  - S = q·Kᵀ is twelve m64n64k16 with K in shared memory (the first one with scale-d 0: no zeroing);
//    the online softmax and the output (mla_flash.cuh's flash_softmax_tile and flash_store_rows) work
//    on the accumulators in registers, whose layout is mma.sync's m16n8 tiles side by side; P, rounded
//    to the element type, is the register A operand of four m64n128k16 for O += P·V.
// No block barrier inside the loop: a warpgroup waits only for its tile's mbarrier, counts itself done
// with a stage in shared memory, and the second of the two to finish a stage loads the stage's next
// tile. The warpgroups drift apart, and one's softmax runs under the other's products; in lockstep
// (cp.async by every thread and two block barriers a tile, until this) the tensor pipe was 44% busy
// (ncu, one 8K layer: 1.67 ms) with the warps waiting on their products, and neither flash-attention
// 3's intra-warpgroup overlap (two score buffers, S of tile j + 2 queued during tile j + 1's softmax;
// 48e0e01, and on this kernel in e88112b: no faster either) nor q in registers moved it. H200, 48B,
// MLA ops of seven layers over 8K / 32K: 14.1 / 207 ms (the lockstep kernel), 13.1 / 189 (its softmax
// on ex2.approx with the scale in one FFMA, O's rescale skipped while no max moved, copies at one
// swizzled offset a thread: 813M → 457M instructions over an 8K layer), 10.5–10.8 / 148–153 with the
// warpgroups apart.
// The warpgroups share each K/V tile: at one warpgroup a block (64 rows, two blocks an SM) the tiles'
// copies from L2 came to ~10 MB a block at 32K positions (168 GB a 48B layer); two halve them (MLA ops
// over 32K: 288 → 265 ms). 161 KB of shared memory, ~200 registers: one block an SM.
#include "runtime/cuda/kernels.h"  // declared in mla_gemm.h (host headers nvcc need not see)
#include "runtime/cuda/mbarrier.cuh"
#include "runtime/cuda/mla_flash.cuh"
#include "runtime/cuda/tensor_map.h"
#include "runtime/cuda/wgmma.cuh"

namespace plow::cuda {

namespace {

constexpr int kGroups = 2;            // warpgroups of a block, sharing its K/V tiles
constexpr int kRows = 64 * kGroups;   // query rows of a block: 64 a warpgroup (its wgmma M)
constexpr int kKeys = 64;             // positions of a K/V tile
constexpr int kThreads = 128 * kGroups;
constexpr int kQk = kMlaFlashQk, kDv = kMlaFlashDv;
constexpr int kQkTiles = kQk / 64;  // 64-column tiles of q and K
constexpr int kKBytes = kQkTiles * kKeys * 128;
constexpr int kStageBytes = kKBytes + kDv * 128;  // K, then Vᵀ [dv][64 positions]
constexpr int kStages = 4;  // tiles j + 1 .. j + 3 landed or in flight while tile j is used
constexpr int kBarBytes = kStages * 8 + kStages * 4;  // the `full` mbarriers, then the `done` counts
constexpr int kBytes = kStages * kStageBytes + kBarBytes + 1024;  // + the slack to align to 1,024 bytes
static_assert(kQk % 64 == 0 && kDv == 128, "whole 64-column tiles of q·k; P·V is one m64n128 product");
static_assert(kKBytes % 1024 == 0 && kStageBytes % 1024 == 0, "tiles start on swizzle atoms");

// The 128 threads of warpgroup `group` (barrier 1 + group; 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int group) { asm volatile("bar.sync %0, 128;" ::"r"(1 + group) : "memory"); }

// Block (head blockIdx.x, query tile gridDim.y − 1 − blockIdx.y: the longest blocks start first). K
// and Vᵀ through tensor maps (`k_map`: [heads·visible rows, ld_k], `v_map`: [heads·dv rows, ld_vt], 16-bit,
// boxes of 64 columns × 64 / 128 rows): a box's columns past ld_k / ld_vt and rows past the last head
// are the copy's zero fill; K rows past `keys` (the next head's, or later positions: finite) score
// positions every row of the block masks, Vᵀ rows past dv (the next head's) make output columns the
// stores drop, and Vᵀ columns past `keys` meet P = 0 (up to `visible` real values, then the
// expansion's zeros: no NaN).
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) mla_wgmma_kernel(MlaFlashArgs a, const __grid_constant__ CUtensorMap k_map,
                                                                const __grid_constant__ CUtensorMap v_map) {
  constexpr bool kF16 = std::is_same_v<T, __half>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = (wg_smem(smem_raw) + 1023u) & ~1023u;
  const auto stage_at = [&](int tile) { return base + static_cast<uint32_t>(tile % kStages) * kStageBytes; };
  const uint32_t bars = base + kStages * kStageBytes;
  const auto full_bar = [&](int tile) { return bars + 8u * static_cast<uint32_t>(tile % kStages); };
  // A stage's `full` mbarrier completes on its tile's bytes; its `done` count is the warpgroups done with
  // it (the second to finish, an odd count before its add, loads the stage's next tile).
  unsigned* done = reinterpret_cast<unsigned*>(smem_raw + (bars + 8u * kStages - wg_smem(smem_raw)));
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32, g = lane / 4, c = lane % 4, group = tid / 128;
  const int h = static_cast<int>(blockIdx.x), t0 = static_cast<int>(gridDim.y - 1 - blockIdx.y) * kRows;
  const int keys = a.context + min(t0 + kRows, a.tokens);  // the block's last row sees positions [0, keys)
  const int tiles = (keys + kKeys - 1) / kKeys;
  const int k_row = h * (a.context + a.tokens), v_row = h * a.dv;  // the head's first rows in the maps
  // Tile t (positions [64t, 64t + 64)) into its stage by one thread: three K boxes and one Vᵀ box.
  const auto load_tile = [&](int t) {
    const uint32_t at = stage_at(t), bar = full_bar(t);
    mbar_expect_tx(bar, kStageBytes);
#pragma unroll
    for (int q = 0; q < kQkTiles; ++q) tensor_g2s_2d(at + q * (kKeys * 128), &k_map, 64 * q, k_row + t * kKeys, bar);
    tensor_g2s_2d(at + kKBytes, &v_map, t * kKeys, v_row, bar);
  };
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) mbar_init(bars + 8u * st, 1), done[st] = 0;
    mbar_init_fence();
  }
  __syncthreads();
  if (tid == 0) {
    for (int t = 0; t < kStages && t < tiles; ++t) load_tile(t);
  }

  // q rows of this warp (16 of the block's 128) in the element type (exact: q is an activation), zero
  // past tokens and qk, as the A fragments of S = q·Kᵀ for its kQk / 16 steps, in registers for the
  // whole block (from shared memory, both operands there, S's products read 96 KB of it a tile; the
  // kernel's time did not change, but shared memory and 36 registers did).
  uint32_t qf[kQk / 16][4];
  {
    const float* q = a.q + static_cast<int64_t>(h) * a.qk;
    const int lo = t0 + warp * 16 + g;
#pragma unroll
    for (int ks = 0; ks < kQk / 16; ++ks) {
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const int row = lo + 8 * (f & 1), col = 16 * ks + 2 * c + 8 * (f >> 1);
        const float* src = q + static_cast<int64_t>(row) * a.q_stride + col;
        const bool in = row < a.tokens;
        qf[ks][f] = flash_pack<kF16>(in && col < a.qk ? src[0] : 0.0f, in && col + 1 < a.qk ? src[1] : 0.0f);
      }
    }
  }
  FlashRows rows{t0 + warp * 16 + g, t0 + warp * 16 + g + 8};  // this thread's rows of the warp's 16 (warps of group w: rows 64w…)
  // The accumulators as mla_flash.cuh's m16n8 tiles side by side; wgmma takes them flat (same order).
  float o[kDv / 8][4];
#pragma unroll
  for (int nt = 0; nt < kDv / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float(&o_flat)[kDv / 2] = reinterpret_cast<float(&)[kDv / 2]>(o);

  // S of tile j + 1 is issued right behind P·V of tile j, so the tensor cores run both back to back
  // while the next softmax waits for them; s holds only the next tile's scores then (P is packed).
  float s[kKeys / 8][4] = {};  // zeroed once for the compiler: the first k step overwrites it (scale-d 0)
  float(&s_flat)[kKeys / 2] = reinterpret_cast<float(&)[kKeys / 2]>(s);
  const auto issue_scores = [&](int tile) {  // waits for the tile's copies
    mbar_wait(full_bar(tile), static_cast<uint32_t>(tile / kStages) & 1u);
    const uint64_t desc = wg_desc(stage_at(tile));
    wg_fence();
    wg_mma_rs<T, false>(s_flat, qf[0], desc);
#pragma unroll
    for (int k = 1; k < kQk / 16; ++k) wg_mma_rs<T>(s_flat, qf[k], desc + (((k / 4) * (kKeys * 128) + 32 * (k % 4)) >> 4));
    wg_commit();
  };
  issue_scores(0);
  wg_wait();
  for (int j = 0; j < tiles; ++j) {
    wg_fence_operand(s_flat);
    flash_softmax_tile(s, o, rows, j * kKeys, j * kKeys + kKeys - 1 > a.context + t0, a.context, a.scale_log2, c);
    uint32_t p[kKeys / 16][4];
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      p[kk][0] = flash_pack<kF16>(s[2 * kk][0], s[2 * kk][1]), p[kk][1] = flash_pack<kF16>(s[2 * kk][2], s[2 * kk][3]);
      p[kk][2] = flash_pack<kF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]), p[kk][3] = flash_pack<kF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
    // O += P·V: score tiles 2kk, 2kk + 1 are the A fragment of positions [16kk, 16kk + 16), all four
    // packed before the first product reads them (wgmma reads its registers asynchronously).
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) wg_mma_rs<T>(o_flat, p[kk], wg_desc(stage_at(j) + kKBytes) + ((32 * kk) >> 4));
    wg_commit();
    if (j + 1 < tiles) issue_scores(j + 1);
    wg_wait();  // P·V of tile j (o) and S of tile j + 1 (s)
    wg_fence_operand(o_flat);
    group_sync(group);  // this warpgroup is done with tile j's stage
    if (tid % 128 == 0) {
      const unsigned before = atomicAdd(done + j % kStages, 1u);
      if ((before & 1u) != 0 && j + kStages < tiles) {  // the other warpgroup is done with it too
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        load_tile(j + kStages);
      }
    }
  }

  flash_store_rows(a, o, rows, h, c);
}

// A row-major [rows, cols] matrix of 16-bit elements (row stride cols) in boxes of 64 columns × box_rows,
// 128-byte swizzled, zeros outside.
CUtensorMap tensor_map(const uint16_t* data, int64_t rows, int64_t cols, uint32_t box_rows, bool f16) {
  return tensor_map_2d(f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, data, rows, cols, cols, 64, box_rows,
                       CU_TENSOR_MAP_SWIZZLE_128B, "MLA wgmma attention");
}

template <typename T>
void launch(const MlaFlashArgs& args, cudaStream_t stream) {
  // Per device (tensor-parallel ranks may be threads of one process): set at every launch.
  const cudaError_t error = cudaFuncSetAttribute(mla_wgmma_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (error != cudaSuccess) cuda_failure("MLA wgmma attention shared memory", error);
  constexpr bool kF16 = std::is_same_v<T, __half>;
  const CUtensorMap k_map = tensor_map(args.keys, static_cast<int64_t>(args.heads) * (args.context + args.tokens), args.ld_k, kKeys, kF16);
  const CUtensorMap v_map = tensor_map(args.values, static_cast<int64_t>(args.heads) * args.dv, args.ld_vt, kDv, kF16);
  const dim3 grid(static_cast<unsigned>(args.heads), static_cast<unsigned>((args.tokens + kRows - 1) / kRows));
  mla_wgmma_kernel<T><<<grid, kThreads, kBytes, stream>>>(args, k_map, v_map);
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
