// The fused causal attention of one MLA prefill sequence on Hopper's warpgroup MMA, for the heads of
// the Kimi-Linear/K3 shape (q·k ≤ 192, v ≤ 128, beyond mla_flash.cuh's small instantiation): the same
// flash-attention-2 form, numerics and rounding points as mla_flash.cuh (see its comment for the error
// against the CPU reference), with the products on wgmma instead of mma.sync:
//  - a block is two warpgroups (256 threads), 64 query rows each, of one head; each warp keeps its 16
//    rows of q, in the element type, as the register A fragments of S's twelve k steps (48 registers);
//  - K tiles of 64 positions (three 64-column tiles, 128-byte-swizzled K-major: wgmma.cuh) and Vᵀ tiles
//    (the values transposed by the expansion, `ld_vt`: 128 rows of 64 positions, so they are K-major for
//    P·V too) come through a ring of four stages by cp.async, three tiles ahead of the one in use;
//  - S = q·Kᵀ is twelve m64n64k16 with K in shared memory (the first one with scale-d 0: no zeroing);
//    the online softmax and the output (mla_flash.cuh's flash_softmax_tile and flash_store_rows) work
//    on the accumulators in registers, whose layout is mma.sync's m16n8 tiles side by side; P, rounded
//    to the element type, is the register A operand of four m64n128k16 for O += P·V.
// The warpgroups share each K/V tile: at one warpgroup a block (64 rows, two blocks an SM) the tiles'
// copies from L2 came to ~10 MB a block at 32K positions (168 GB a 48B layer, of the order of the
// kernel's time at L2's bandwidth); two halve them (H200, 48B, MLA ops over 32K: 288 → 265 ms). S of
// tile j + 1 is issued right behind P·V of tile j (both products back to back on the tensor cores):
// 8K 18.0 → 13.9 ms, 32K 265 → 199 ms. Then (MLA ops of seven layers, 8K / 32K) the softmax on
// ex2.approx with the scale in one FFMA, O's rescale skipped while no max moved and the copies at one
// swizzled offset a thread: 14.1 → 13.0 / 207 → 188 ms (141f0bf), 183.5 at 32K with q in registers;
// the kernel's instructions over an 8K layer 813M → 457M. What did not move it (H200, each against
// the build before it in one session): q in registers instead of shared memory (at 8K), S of
// tile j + 2 queued while tile j + 1's softmax runs (two score buffers, flash-attention 3's
// intra-warpgroup overlap), and the query tiles of one head side by side on the SMs (L2 reuse). ncu on
// an 8K layer (1.67 ms): tensor pipe active 44%, warps mostly waiting on the products' completion
// (WARPGROUP.DEPBAR) with the two warpgroups in lockstep through the block barriers; what is left is
// the flash-attention 3 structure (a producer warpgroup with TMA, mbarriers per stage, the consumer
// warpgroups ping-ponging their softmax against each other's products). 161 KB of shared memory, 208
// registers: one block an SM.
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
constexpr int kKBytes = kQkTiles * kKeys * 128;
constexpr int kStageBytes = kKBytes + kDv * 128;  // K, then Vᵀ [dv][64 positions]
constexpr int kStages = 4;  // tiles j + 1 .. j + 3 landed or in flight while tile j is used
constexpr int kBytes = kStages * kStageBytes + 1024;  // + the slack to align to 1,024 bytes
static_assert(kQk % 64 == 0 && kDv == 128, "whole 64-column tiles of q·k; P·V is one m64n128 product");
static_assert(kKBytes % 1024 == 0 && kStageBytes % 1024 == 0, "tiles start on swizzle atoms");

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
  const auto stage_at = [&](int tile) { return base + static_cast<uint32_t>(tile % kStages) * kStageBytes; };
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32, g = lane / 4, c = lane % 4;
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
  const auto issue_scores = [&](int tile) {  // tile's copies landed for every thread before
    const uint64_t desc = wg_desc(stage_at(tile));
    wg_fence();
    wg_mma_rs<T, false>(s_flat, qf[0], desc);
#pragma unroll
    for (int k = 1; k < kQk / 16; ++k) wg_mma_rs<T>(s_flat, qf[k], desc + (((k / 4) * (kKeys * 128) + 32 * (k % 4)) >> 4));
    wg_commit();
  };
  flash_cp_wait<kStages - 1>();  // tile 0
  wg_fence_proxy();
  __syncthreads();  // tile 0 for every thread
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
    if (j + 1 < tiles) {
      flash_cp_wait<kStages - 2>();  // tile j + 1
      wg_fence_proxy();
      __syncthreads();  // tile j + 1 for every thread
      issue_scores(j + 1);
    }
    wg_wait();        // P·V of tile j (o) and S of tile j + 1 (s)
    wg_fence_operand(o_flat);
    __syncthreads();  // every warpgroup is done with tile j's slot
    if (j + kStages < tiles) stage_tile(a, kg, vtg, keys, j + kStages, stage_at(j), tid);
    flash_cp_commit();
  }
  flash_cp_wait<0>();  // the trailing (empty) groups

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
