// The routed experts' GEMMs of a prefill step on Hopper's warpgroup MMA (moe_gemm.h launch_moe_wgmma).
// A block computes 128 GEMM outputs (weight rows) of one weight stack for one job: up to BN sorted rows
// of one expert (the routing sort cuts an expert's rows into jobs of at most kMoeWgmmaJobRows; those of
// at most 64 take the BN = 64 kernel, with half the multiply work and a deeper ring, the others
// BN = 128). Its 256 threads stream the weight rows and the job's rows (gate_up's token rows read in
// place through the routing's permutation: b_rows) through a ring of shared-memory stages by cp.async,
// 64 K elements a stage in the 128-byte swizzled layout wgmma reads; each warpgroup multiplies its 64
// weight rows by the job's rows with wgmma m64nBNk16 (16-bit in, fp32 accumulate), four a stage. The
// output is rounded once, to the output type, as cuBLAS rounds its GEMM's output.
//
// Why: at 2,048-token steps an expert gets ~64 rows, so the op is a weight stream (below the ridge) whose
// instruction count decides how close it comes to the bandwidth: one wgmma is 64·BN·16 multiply-adds
// (an mma.sync 16·8·16), and the threads' remaining work is the cp.async of their stage share.
// K past gemm_in, weight rows past gemm_out and job rows past its count are the copies' zero fill.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "runtime/cuda/kernels.h"
#include "runtime/cuda/moe_lists.h"
#include "runtime/cuda/wgmma.cuh"

namespace plow::cuda {

namespace {

constexpr int kWgRows = 128;     // weight rows (GEMM outputs) of a block: 64 a warpgroup
constexpr int kWgK = 64;         // K elements of a stage: one 128-byte row
constexpr int kWgThreads = 256;  // two warpgroups

template <int BN>
struct WgLayout {
  static constexpr int kStages = BN == 64 ? 4 : 3;  // ~96 KB: two blocks an SM
  static constexpr int kABytes = kWgRows * 128;
  static constexpr int kStageBytes = kABytes + BN * 128;
  static constexpr int kBytes = kStages * kStageBytes + 1024;  // + the slack to align the ring to 1024 bytes
  static_assert(kABytes % 1024 == 0 && kStageBytes % 1024 == 0, "stages start on swizzle atoms");
};

struct WgArgs {
  const int32_t* job_list;  // moe_lists.h: the short and long job counts, then the jobs (expert, first sorted row, rows)
  int32_t job_class;        // 0: the short jobs (≤ 64 rows), 1: the long ones (≤ kMoeWgmmaJobRows)
  const uint8_t* w[2];      // weight stacks: expert e's [gemm_out, gemm_in] at w + e·part_bytes
  int64_t part_bytes;
  const uint8_t* b;         // sorted rows, row stride ld_in elements
  int64_t ld_in;
  const int32_t* b_rows;    // null, or sorted row p is row b_rows[p] / b_div of b
  int32_t b_div;
  uint8_t* c[2];            // outputs, row stride ld_out elements of TOut
  int64_t ld_out;
  int32_t gemm_in, gemm_out, out_tiles;
};

__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

// The job's rows a thread copies: row (tid + i·kWgThreads) / 8 of the job for i < kBRows, as addresses
// (null past the job's rows).
template <int BN>
struct JobRows {
  static constexpr int kBRows = BN * 8 / kWgThreads;
  const uint8_t* row[kBRows];
};
template <int BN>
__device__ __forceinline__ JobRows<BN> job_rows(const WgArgs& a, int first, int rows, int elem_bytes) {
  JobRows<BN> j;
  const int64_t ld_b_bytes = a.ld_in * elem_bytes;
#pragma unroll
  for (int i = 0; i < JobRows<BN>::kBRows; ++i) {
    const int r = (static_cast<int>(threadIdx.x) + i * kWgThreads) / 8;
    const int64_t source = r >= rows ? -1 : a.b_rows != nullptr ? a.b_rows[first + r] / a.b_div : first + r;
    j.row[i] = source < 0 ? nullptr : a.b + source * ld_b_bytes;
  }
  return j;
}

// Stage `slot` ← K elements [64·kt, 64·kt + 64) of the block's weight rows and the job's rows. Thread
// copies: 16 bytes (8 elements) each, 8 consecutive threads a 128-byte row; chunk c of row r lands at
// chunk c ^ (r mod 8) of its row (the 128-byte swizzle).
template <int BN>
__device__ __forceinline__ void wg_load(uint32_t ring, int slot, int kt, const uint8_t* w, int rows_w, const JobRows<BN>& b, int gemm_in, int elem_bytes) {
  using L = WgLayout<BN>;
  const uint32_t a_at = ring + slot * L::kStageBytes, b_at = a_at + L::kABytes;
  const int64_t w_row_bytes = static_cast<int64_t>(gemm_in) * elem_bytes;
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int i = 0; i < kWgRows * 8 / kWgThreads; ++i) {
    const int idx = tid + i * kWgThreads, r = idx / 8, c = idx % 8, k = kt * kWgK + 8 * c;
    const bool real = r < rows_w && k < gemm_in;
    wg_cp16(a_at + wg_swizzle(r, c), real ? w + r * w_row_bytes + static_cast<int64_t>(k) * elem_bytes : w, real ? 16 : 0);
  }
#pragma unroll
  for (int i = 0; i < JobRows<BN>::kBRows; ++i) {
    const int idx = tid + i * kWgThreads, r = idx / 8, c = idx % 8, k = kt * kWgK + 8 * c;
    const bool real = b.row[i] != nullptr && k < gemm_in;
    wg_cp16(b_at + wg_swizzle(r, c), real ? b.row[i] + static_cast<int64_t>(k) * elem_bytes : w, real ? 16 : 0);
  }
}

// Block (x = set · out_tiles + out tile, y = job).
template <typename T, typename TOut, int BN>
__global__ void __launch_bounds__(kWgThreads, 2) moe_wgmma_kernel(WgArgs a) {
  using L = WgLayout<BN>;
  extern __shared__ uint8_t wg_smem_raw[];
  const uint32_t ring = (wg_smem(wg_smem_raw) + 1023u) & ~1023u;
  if (static_cast<int>(blockIdx.y) >= a.job_list[a.job_class]) return;  // the grid may hold more rows than the list has jobs (a device routing)
  const int32_t* job = a.job_list + 2 + 3 * (a.job_class == 0 ? 0 : a.job_list[0]) + 3 * blockIdx.y;
  const int expert = job[0], first = job[1], rows = job[2];
  const int set = static_cast<int>(blockIdx.x) / a.out_tiles, out0 = static_cast<int>(blockIdx.x) % a.out_tiles * kWgRows;
  const int elem_bytes = static_cast<int>(sizeof(T));
  const uint8_t* w = (set == 0 ? a.w[0] : a.w[1]) + expert * a.part_bytes + static_cast<int64_t>(out0) * a.gemm_in * elem_bytes;
  const int rows_w = a.gemm_out - out0 < kWgRows ? a.gemm_out - out0 : kWgRows;
  const JobRows<BN> b = job_rows<BN>(a, first, rows, elem_bytes);
  const int k_tiles = (a.gemm_in + kWgK - 1) / kWgK;

  float d[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) d[i] = 0.0f;
  // The ring: stages 0..kStages−1 are copy groups 0..kStages−1; iteration kt commits one more group,
  // holding stage kt − 1 + kStages (empty at kt = 0 and past the last stage), so stage s ≥ kStages is
  // group s + 1 and, at iteration kt, all but the kStages − 2 newest groups hold every stage ≤ kt.
  // The multiplies of stage kt stay in flight while the threads refill the slot of stage kt − 1 (one
  // wgmma group pending: its multiplies are done once wait_group 1 returns), so the tensor cores do not
  // wait for the copies' issue and the barriers.
#pragma unroll
  for (int s = 0; s < L::kStages; ++s) {
    if (s < k_tiles) wg_load<BN>(ring, s, s, w, rows_w, b, a.gemm_in, elem_bytes);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  const int group = static_cast<int>(threadIdx.x) / 128;
  for (int kt = 0; kt < k_tiles; ++kt) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(L::kStages - 2) : "memory");  // stage kt has landed (this thread's copies)
    wg_fence_proxy();  // visible to wgmma's (async proxy) reads
    __syncthreads();  // every thread's copies of stage kt
    const int slot = kt % L::kStages;
    const uint32_t a_at = ring + slot * L::kStageBytes + group * 64 * 128, b_at = ring + slot * L::kStageBytes + L::kABytes;
    wg_fence();
#pragma unroll
    for (int k = 0; k < kWgK / 16; ++k) wg_mma_ss<T>(d, wg_desc(a_at + 32 * k), wg_desc(b_at + 32 * k));
    wg_commit();
    wg_wait_prior();  // this warpgroup's multiplies of stage kt − 1 are done
    __syncthreads();  // and the other warpgroup's: the slot of stage kt − 1 is free
    const int refill = kt - 1 + L::kStages;
    if (kt > 0 && refill < k_tiles) wg_load<BN>(ring, (kt - 1) % L::kStages, refill, w, rows_w, b, a.gemm_in, elem_bytes);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  wg_wait();
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // the trailing (empty) groups

  // Output (row first + n, column out0 + m) for weight row m of this warpgroup and job row n.
  TOut* c = reinterpret_cast<TOut*>(set == 0 ? a.c[0] : a.c[1]);
  const int t = static_cast<int>(threadIdx.x) % 128, m = out0 + group * 64 + t / 32 * 16 + t % 32 / 4;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = 8 * j + 2 * (t % 4) + (e & 1), o = m + 8 * (e / 2);
      if (n < rows && o < a.gemm_out) store_out(c + (static_cast<int64_t>(first) + n) * a.ld_out + o, d[4 * j + e]);
    }
  }
}

template <typename T, typename TOut, int BN>
void launch(const WgArgs& a, int jobs, int sets, cudaStream_t stream) {
  const auto kernel = moe_wgmma_kernel<T, TOut, BN>;
  const cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, WgLayout<BN>::kBytes);
  if (error != cudaSuccess) cuda_failure("MoE wgmma GEMM shared memory", error);
  kernel<<<dim3(static_cast<unsigned>(a.out_tiles * sets), static_cast<unsigned>(jobs)), kWgThreads, WgLayout<BN>::kBytes, stream>>>(a);
}

// The short jobs on the 64-row kernel, then the long ones on the 128-row kernel (one stream: in order).
template <typename T, typename TOut>
void launch_both(WgArgs a, int short_grid, int long_grid, int sets, cudaStream_t stream) {
  a.job_class = 0;
  if (short_grid > 0) launch<T, TOut, 64>(a, short_grid, sets, stream);
  a.job_class = 1;
  if (long_grid > 0) launch<T, TOut, 128>(a, long_grid, sets, stream);
}

}  // namespace

bool moe_wgmma_supports(const DeviceWeight* w, int sets, int64_t gemm_in, int64_t gemm_out, const void* b, int64_t ld_in, int32_t in_type, int32_t out_type) {
  if ((in_type != kWBF16 && in_type != kWF16) || (out_type != in_type && out_type != kWF32)) return false;
  if (sets < 1 || sets > 2 || gemm_in % 8 != 0 || ld_in % 8 != 0 || gemm_in > (int64_t{1} << 30) || gemm_out > (int64_t{1} << 30)) return false;
  for (int j = 0; j < sets; ++j) {
    if (w[j].type != in_type || reinterpret_cast<uintptr_t>(w[j].data) % 16 != 0 || w[j].part_bytes != w[0].part_bytes) return false;
  }
  return reinterpret_cast<uintptr_t>(b) % 16 == 0 && w[0].part_bytes % 16 == 0;
}

bool launch_moe_wgmma(const int32_t* job_list, int short_grid, int long_grid, const DeviceWeight* w, int sets, int64_t gemm_in, int64_t gemm_out,
                      const void* b, int64_t ld_in, int32_t in_type, const int32_t* b_rows, int32_t b_div, void* c0, void* c1, int64_t ld_out,
                      int32_t out_type, cudaStream_t stream) {
  if (!moe_wgmma_supports(w, sets, gemm_in, gemm_out, b, ld_in, in_type, out_type) || (b_rows != nullptr && b_div < 1)) return false;
  if (short_grid < 0 || long_grid < 0 || short_grid > 65535 || long_grid > 65535) return false;
  if (short_grid + long_grid == 0) return true;
  WgArgs a{};
  a.job_list = job_list;
  a.w[0] = w[0].data;
  a.w[1] = sets > 1 ? w[1].data : w[0].data;
  a.part_bytes = w[0].part_bytes;
  a.b = static_cast<const uint8_t*>(b);
  a.ld_in = ld_in;
  a.b_rows = b_rows;
  a.b_div = b_div;
  a.c[0] = static_cast<uint8_t*>(c0);
  a.c[1] = static_cast<uint8_t*>(sets > 1 ? c1 : c0);
  a.ld_out = ld_out;
  a.gemm_in = static_cast<int32_t>(gemm_in);
  a.gemm_out = static_cast<int32_t>(gemm_out);
  a.out_tiles = static_cast<int32_t>((gemm_out + kWgRows - 1) / kWgRows);
  if (in_type == kWBF16) {
    if (out_type == kWF32) launch_both<__nv_bfloat16, float>(a, short_grid, long_grid, sets, stream);
    else launch_both<__nv_bfloat16, __nv_bfloat16>(a, short_grid, long_grid, sets, stream);
  } else {
    if (out_type == kWF32) launch_both<__half, float>(a, short_grid, long_grid, sets, stream);
    else launch_both<__half, __half>(a, short_grid, long_grid, sets, stream);
  }
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_failure("MoE wgmma GEMM", error);
  return true;
}

}  // namespace plow::cuda
