// Device side of the prefill GEMMs: the exact fp32 → bf16/f16 copy of a GEMM's input (the arena's
// values are already rounded to that dtype, so the conversion loses nothing).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "runtime/cuda/kernels.h"  // declared in prefill_gemm.h (host headers nvcc need not see)

namespace plow::cuda {

namespace {

template <typename Half>
__global__ void to_half_kernel(const float* x, int64_t rows, int64_t cols, int64_t stride, Half* out) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = x[(i / cols) * stride + i % cols];
    if constexpr (std::is_same_v<Half, __nv_bfloat16>) {
      out[i] = __float2bfloat16_rn(v);
    } else {
      out[i] = __float2half_rn(v);
    }
  }
}

}  // namespace

void launch_to_half(const float* x, int64_t rows, int64_t cols, int64_t stride, void* out, int32_t type, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  const int blocks = static_cast<int>((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
  if (type == kWBF16) {
    to_half_kernel<<<blocks, 256, 0, stream>>>(x, rows, cols, stride, static_cast<__nv_bfloat16*>(out));
  } else {
    to_half_kernel<<<blocks, 256, 0, stream>>>(x, rows, cols, stride, static_cast<__half*>(out));
  }
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_failure("GEMM input conversion", error);
}

}  // namespace plow::cuda
