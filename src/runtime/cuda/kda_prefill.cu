// The launches of kda_prefill.cuh's blocks: a prep block per (chunk, head), three an SM; a scan block per
// (32 value columns, head, sequence), four warpgroups, one an SM.
#include "runtime/cuda/kda_prefill.cuh"
#include "runtime/cuda/kernels.h"  // cuda_failure; the launches are declared in kda_prefill.h

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

__global__ void __launch_bounds__(kKdaScanThreads, 1) kda_scan_kernel(KdaPrefillArgs a) {
  extern __shared__ __align__(16) float sm[];
  kda_scan_block(a, sm, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z));
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
  kda_scan_kernel<<<dim3((a.d + kCols - 1) / kCols, a.heads, a.seqs), kKdaScanThreads, kKdaScanBytes, stream>>>(a);
  check_cuda(cudaGetLastError(), "KDA prefill scan");
}

}  // namespace plow::cuda
