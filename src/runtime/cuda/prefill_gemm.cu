// Device side of the prefill GEMMs: the exact fp32 → bf16/f16 copy of a GEMM's input (the arena's
// values are already rounded to that dtype, so the conversion loses nothing).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "runtime/cuda/kernels.h"  // declared in prefill_gemm.h (host headers nvcc need not see)

namespace plow::cuda {

namespace {

// Blocks tile rows × column blocks, so no element needs a division: a flat index split by a 64-bit
// division and remainder per element (~150 instructions) made the copy bound by issue, ~12 µs for the
// 1024 × 2304 input of a 48B prefill projection, whose 14 MB move in ~4.
template <typename Half>
__global__ void to_half_kernel(const float* x, int64_t rows, int64_t cols, int64_t stride, Half* out) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols; c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const float v = x[r * stride + c];
      if constexpr (std::is_same_v<Half, __nv_bfloat16>) {
        out[r * cols + c] = __float2bfloat16_rn(v);
      } else {
        out[r * cols + c] = __float2half_rn(v);
      }
    }
  }
}

}  // namespace

void launch_to_half(const float* x, int64_t rows, int64_t cols, int64_t stride, void* out, int32_t type, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  // ≤ 4096 blocks of 256 threads, as many column blocks as a row needs (up to 64), the rest over rows.
  const int64_t col_blocks = std::min<int64_t>((cols + 255) / 256, 64);
  const dim3 blocks(static_cast<unsigned>(col_blocks), static_cast<unsigned>(std::clamp<int64_t>(4096 / col_blocks, 1, rows)));
  if (type == kWBF16) {
    to_half_kernel<<<blocks, 256, 0, stream>>>(x, rows, cols, stride, static_cast<__nv_bfloat16*>(out));
  } else {
    to_half_kernel<<<blocks, 256, 0, stream>>>(x, rows, cols, stride, static_cast<__half*>(out));
  }
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_failure("GEMM input conversion", error);
}

}  // namespace plow::cuda
