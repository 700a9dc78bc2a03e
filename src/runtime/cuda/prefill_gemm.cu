// Device side of the prefill GEMMs: the exact fp32 → bf16/f16 copy of a GEMM's input (the arena's
// values are already rounded to that dtype, so the conversion loses nothing), and the output op's
// rounding.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "runtime/cuda/kernels.h"  // declared in prefill_gemm.h (host headers nvcc need not see)
#include "runtime/cuda/last_rows.h"

namespace plow::cuda {

namespace {

// Blocks tile rows × column blocks, so no element needs a division: a flat index split by a 64-bit
// division and remainder per element (~150 instructions) made the copy bound by issue, ~12 µs for the
// 1024 × 2304 input of a 48B prefill projection, whose 14 MB move in ~4.
// With `first_row`, output row r is input row first_row[r] + tokens[r] − 1 (a sequence's last).
template <typename Half>
__global__ void to_half_kernel(const float* x, int64_t rows, int64_t cols, int64_t stride, Half* out, const int32_t* first_row, const int32_t* tokens) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t src = first_row != nullptr ? static_cast<int64_t>(first_row[r]) + tokens[r] - 1 : r;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols; c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const float v = x[src * stride + c];
      if constexpr (std::is_same_v<Half, __nv_bfloat16>) {
        out[r * cols + c] = __float2bfloat16_rn(v);
      } else {
        out[r * cols + c] = __float2half_rn(v);
      }
    }
  }
}

// Round-to-nearest-even to bf16 or f16 and back, as device.cuh round_act.
template <typename Half>
__device__ __forceinline__ float round_half(float v) {
  if constexpr (std::is_same_v<Half, __nv_bfloat16>) {
    return __bfloat162float(__float2bfloat16_rn(v));
  } else {
    return __half2float(__float2half_rn(v));
  }
}

template <typename Half>
__global__ void round_kernel(float4* y, int64_t quads) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < quads; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = y[i];
    y[i] = make_float4(round_half<Half>(v.x), round_half<Half>(v.y), round_half<Half>(v.z), round_half<Half>(v.w));
  }
}

// Unaligned outputs, element by element.
template <typename Half>
__global__ void round_scalar_kernel(float* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) y[i] = round_half<Half>(y[i]);
}

template <typename Half>
void round_in_place(float* y, int64_t n, cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(y) % 16 == 0) {  // float4 over the body, one block for the tail
    const int64_t quads = n / 4;
    if (quads > 0) round_kernel<Half><<<static_cast<int>(std::clamp<int64_t>((quads + 255) / 256, 1, 8192)), 256, 0, stream>>>(reinterpret_cast<float4*>(y), quads);
    if (n % 4 != 0) round_scalar_kernel<Half><<<1, 32, 0, stream>>>(y + 4 * quads, n % 4);
  } else {
    round_scalar_kernel<Half><<<static_cast<int>(std::clamp<int64_t>((n + 255) / 256, 1, 8192)), 256, 0, stream>>>(y, n);
  }
}

}  // namespace

void launch_round_in_place(float* y, int64_t rows, int64_t cols, int32_t act, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0 || act == kAF32) return;
  if (act == kABF16) {
    round_in_place<__nv_bfloat16>(y, n, stream);
  } else {
    round_in_place<__half>(y, n, stream);
  }
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_failure("output rounding", error);
}

void launch_to_half(const float* x, int64_t rows, int64_t cols, int64_t stride, void* out, int32_t type, cudaStream_t stream, const LastRows* last) {
  const int32_t *first_row = nullptr, *tokens = nullptr;
  if (last != nullptr) {
    rows = last->num_seqs;
    first_row = last->first_row;
    tokens = last->tokens;
  }
  const int64_t n = rows * cols;
  if (n == 0) return;
  // ≤ 4096 blocks of 256 threads, as many column blocks as a row needs (up to 64), the rest over rows.
  const int64_t col_blocks = std::min<int64_t>((cols + 255) / 256, 64);
  const dim3 blocks(static_cast<unsigned>(col_blocks), static_cast<unsigned>(std::clamp<int64_t>(4096 / col_blocks, 1, rows)));
  if (type == kWBF16) {
    to_half_kernel<<<blocks, 256, 0, stream>>>(x, rows, cols, stride, static_cast<__nv_bfloat16*>(out), first_row, tokens);
  } else {
    to_half_kernel<<<blocks, 256, 0, stream>>>(x, rows, cols, stride, static_cast<__half*>(out), first_row, tokens);
  }
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_failure("GEMM input conversion", error);
}

}  // namespace plow::cuda
