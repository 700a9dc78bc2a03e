// The launches of kda_prefill.cuh's blocks: a prep block per (chunk, head), three an SM; a scan block per
// (32 value columns, head, sequence), four warpgroups, one an SM.
#include "runtime/cuda/kda_prefill.cuh"
#include "runtime/cuda/kernels.h"  // cuda_failure; the launches are declared in kda_prefill.h
#include "runtime/cuda/tensor_map.h"

namespace plow::cuda {

namespace {

using namespace kda_planned;

void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) cuda_failure(what, error);
}

__global__ void __launch_bounds__(kKdaPrefillThreads, 3) kda_prep_kernel(KdaPrefillArgs a) {
  extern __shared__ __align__(16) float sm[];
  kda_prep_block(a, sm, static_cast<int>(blockIdx.x));
}

__global__ void __launch_bounds__(kKdaScanThreads, 1) kda_scan_kernel(KdaPrefillArgs a, const __grid_constant__ KdaScanMaps maps) {
  extern __shared__ __align__(128) float sm[];  // the tensor copies' destinations are 128-byte aligned
  kda_scan_block(a, maps, sm, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z));
}

}  // namespace

void launch_kda_prep(const KdaPrefillArgs& a, cudaStream_t stream) {
  if (a.chunks < 1 || a.seqs < 1) return;
  if (a.d < 1 || a.d > kD) cuda_failure("KDA prefill head dim", cudaErrorInvalidValue);
  check_cuda(cudaFuncSetAttribute(kda_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kKdaPrepBytes), "KDA prep shared memory");
  kda_prep_kernel<<<a.chunks * a.heads, kBlockThreads, kKdaPrepBytes, stream>>>(a);
  check_cuda(cudaGetLastError(), "KDA prefill prep");
}

void launch_kda_scan(const KdaPrefillArgs& a, cudaStream_t stream) {
  if (a.chunks < 1 || a.seqs < 1) return;
  if (a.d < 1 || a.d > kD) cuda_failure("KDA prefill head dim", cudaErrorInvalidValue);
  check_cuda(cudaFuncSetAttribute(kda_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kKdaScanBytes), "KDA scan shared memory");
  // The maps' row coordinates are 32-bit: M's rows (kKdaRecFloats / kC a record) must stay below 2³¹.
  if (static_cast<int64_t>(a.chunks) * a.heads > (int64_t{1} << 31) / (kKdaRecFloats / kC)) {
    cuda_failure("KDA prefill scan: a batch of more records than its tensor maps' rows address", cudaErrorInvalidValue);
  }
  const KdaScanMaps maps = kda_scan_maps(a, [](const float* base, int64_t rows, int64_t cols, int box_cols, int box_rows) {
    return tensor_map_2d(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, rows, cols, cols, static_cast<uint32_t>(box_cols), static_cast<uint32_t>(box_rows),
                         CU_TENSOR_MAP_SWIZZLE_NONE, "KDA prefill scan");
  });
  kda_scan_kernel<<<dim3((a.d + kCols - 1) / kCols, a.heads, a.seqs), kKdaScanThreads, kKdaScanBytes, stream>>>(a, maps);
  check_cuda(cudaGetLastError(), "KDA prefill scan");
}

}  // namespace plow::cuda
