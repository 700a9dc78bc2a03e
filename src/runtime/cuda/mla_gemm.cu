// Device side of the MLA prefill GEMMs (mla_gemm.h): the latent append (the op body's rounding), the
// exact copies of cache rows and queries into the GEMMs' input type, the causal softmax (fp32, P rounded
// to the activation dtype as cpu/ops/mla.cpp rounds it) and the scatter of the head outputs into the
// op's output rows (one block per row, threads over its columns: coalesced on both sides); and the
// launches of the fused attention (mla_flash.cuh) that replaces the last three for bf16 and f16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "runtime/cuda/mla_flash.cuh"
#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/kernels.h"  // declared in mla_gemm.h (host headers nvcc need not see)

namespace plow::cuda {

namespace {

constexpr int kBlock = 256;
constexpr int kBlockWarps = kBlock / 32;

int grid_for(int64_t rows) { return static_cast<int>(rows < 65535 ? (rows > 0 ? rows : 1) : 65535); }

void check_launch(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_failure(what, error);
}

// Stores of values exact in T (rounded activations, raw kv_a outputs, P already rounded): no loss.
__device__ __forceinline__ void store_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_f(__half* p, float v) { *p = __float2half_rn(v); }

// Block-wide reductions over kBlock threads (block_sum in device.cuh assumes kThreads); every thread
// gets the result. `red`: kBlockWarps floats of shared memory, free again after the call.
__device__ __forceinline__ float block_reduce_sum(float v, float* red) {
  v = warp_sum(v);
  __syncthreads();
  if (lane_id() == 0) red[warp_id()] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kBlockWarps; ++w) total += red[w];
  __syncthreads();
  return total;
}
__device__ __forceinline__ float block_reduce_max(float v, float* red) {
  v = warp_max(v);
  __syncthreads();
  if (lane_id() == 0) red[warp_id()] = v;
  __syncthreads();
  float top = -INFINITY;
  for (int w = 0; w < kBlockWarps; ++w) top = fmaxf(top, red[w]);
  __syncthreads();
  return top;
}

__global__ void append_kernel(const float* kv_a, int64_t kv_stride, int64_t tokens, DeviceWeight norm, float eps, int64_t rank, int64_t rope, int32_t act,
                              uint8_t* cache, int32_t cache_elem) {
  __shared__ float red[kBlockWarps];
  const int64_t latent = rank + rope;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const float* kv = kv_a + t * kv_stride;
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < rank; i += kBlock) sum += kv[i] * kv[i];
    const float inv = inv_rms(block_reduce_sum(sum, red), rank, eps);
    for (int64_t i = threadIdx.x; i < latent; i += kBlock) {
      store_state_elem(cache, cache_elem, t * latent + i, i < rank ? round_act(act, weight_flat(norm, i) * round_act(act, kv[i] * inv)) : kv[i]);
    }
  }
}

template <typename T>
__global__ void inputs_kernel(const uint8_t* cache, int32_t cache_elem, int64_t visible, int64_t rank, int64_t rope, int64_t heads, int64_t nope, T* latents,
                              int64_t ld_c, T* keys, int64_t ld_k) {
  const int64_t latent = rank + rope;
  for (int64_t tau = blockIdx.x; tau < visible; tau += gridDim.x) {
    const int64_t row = tau * latent;
    for (int64_t i = threadIdx.x; i < rank; i += kBlock) store_f(latents + tau * ld_c + i, load_state_elem(cache, cache_elem, row + i));
    const int64_t tail = ld_k - nope;  // k_r, then the row's padding
    for (int64_t i = threadIdx.x; i < heads * tail; i += kBlock) {
      const int64_t h = i / tail, j = i % tail;
      store_f(keys + (h * visible + tau) * ld_k + nope + j, j < rope ? load_state_elem(cache, cache_elem, row + rank + j) : 0.0f);
    }
  }
}

template <typename T>
__global__ void queries_kernel(const float* q, int64_t q_stride, int64_t tokens, int64_t heads, int64_t qk, T* queries, int64_t ld_q) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t i = threadIdx.x; i < heads * qk; i += kBlock) store_f(queries + (t * heads + i / qk) * ld_q + i % qk, q[t * q_stride + i]);
  }
}

// As cpu_mla_attention: the max over the visible scores, Σ exp(s − max), then P = act(exp(s − max) /
// total); three passes over the row (the scores stay in L2 at the block sizes used).
template <typename T>
__global__ void softmax_kernel(const float* scores, int64_t ld, int64_t rows, int64_t query_rows, int64_t first_visible, int64_t length, T* probs,
                               int32_t act) {
  __shared__ float red[kBlockWarps];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* s = scores + r * ld;
    T* p = probs + r * ld;
    const int64_t visible = first_visible + r % query_rows;
    float top = -INFINITY;
    for (int64_t tau = threadIdx.x; tau < visible; tau += kBlock) top = fmaxf(top, s[tau]);
    top = block_reduce_max(top, red);
    float sum = 0.0f;
    for (int64_t tau = threadIdx.x; tau < visible; tau += kBlock) sum += expf(s[tau] - top);
    const float total = block_reduce_sum(sum, red);
    for (int64_t tau = threadIdx.x; tau < length; tau += kBlock) store_f(p + tau, tau < visible ? round_act(act, expf(s[tau] - top) / total) : 0.0f);
  }
}

__global__ void scatter_kernel(const float* o, int64_t ld_o, int64_t group, int64_t rows, int64_t dv, float* out, int64_t width, int32_t act, bool round_out,
                               const float* gate, int64_t gate_stride) {
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    for (int64_t i = threadIdx.x; i < group * dv; i += kBlock) {
      const float v = o[((i / dv) * rows + t) * ld_o + i % dv];  // head g's rows are [g·rows, (g+1)·rows)
      float y = round_out ? round_act(act, v) : v;
      if (gate != nullptr) y = round_act(act, y * sigmoidf_(gate[t * gate_stride + i]));  // sigmoid_mul's arithmetic
      out[t * width + i] = y;
    }
  }
}

// One block per (head, query tile), heads fastest and query tiles last-first: the longest blocks (last
// rows, most positions) start first, and the blocks running together share their tiles' positions.
template <int QK, int DV, bool kF16>
__global__ void __launch_bounds__(kMlaFlashThreads, 2) mla_flash_kernel(MlaFlashArgs args) {
  extern __shared__ __align__(16) unsigned char smem[];
  mla_flash_block<QK, DV, kF16>(args, static_cast<int>(gridDim.y - 1 - blockIdx.y), static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x), smem);
}

template <int QK, int DV, bool kF16>
void launch_flash(const MlaFlashArgs& args, cudaStream_t stream) {
  constexpr int kBytes = MlaFlashLayout<QK, DV>::kBytes;
  // Over 48 KiB of dynamic shared memory needs the opt-in; it is per device (tensor-parallel ranks may be
  // threads of one process), so it is set at every launch (idempotent, a host call).
  const cudaError_t error = cudaFuncSetAttribute(mla_flash_kernel<QK, DV, kF16>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (error != cudaSuccess) cuda_failure("MLA flash attention shared memory", error);
  const dim3 grid(static_cast<unsigned>(args.heads), static_cast<unsigned>((args.tokens + kMlaFlashRows - 1) / kMlaFlashRows));
  mla_flash_kernel<QK, DV, kF16><<<grid, kMlaFlashThreads, kBytes, stream>>>(args);
  check_launch("MLA flash attention");
}

}  // namespace

void launch_mla_flash(const MlaFlashArgs& args, int32_t type, cudaStream_t stream) {
  if (args.tokens == 0) return;
  const bool f16 = type == kWF16;
  if (args.qk <= kMlaFlashSmallDim && args.dv <= kMlaFlashSmallDim) {
    f16 ? launch_flash<kMlaFlashSmallDim, kMlaFlashSmallDim, true>(args, stream) : launch_flash<kMlaFlashSmallDim, kMlaFlashSmallDim, false>(args, stream);
  } else {
    f16 ? launch_flash<kMlaFlashQk, kMlaFlashDv, true>(args, stream) : launch_flash<kMlaFlashQk, kMlaFlashDv, false>(args, stream);
  }
}

void launch_mla_append(const float* kv_a, int64_t kv_stride, int64_t tokens, const DeviceWeight& norm, float eps, int64_t rank, int64_t rope, int32_t act,
                       uint8_t* cache, int32_t cache_elem, cudaStream_t stream) {
  if (tokens == 0) return;
  append_kernel<<<grid_for(tokens), kBlock, 0, stream>>>(kv_a, kv_stride, tokens, norm, eps, rank, rope, act, cache, cache_elem);
  check_launch("MLA latent append");
}

void launch_mla_inputs(const uint8_t* cache, int32_t cache_elem, int64_t visible, int64_t rank, int64_t rope, int64_t heads, int64_t nope, void* latents,
                       int64_t ld_c, void* keys, int64_t ld_k, int32_t type, cudaStream_t stream) {
  if (visible == 0) return;
  if (type == kWBF16) {
    inputs_kernel<<<grid_for(visible), kBlock, 0, stream>>>(cache, cache_elem, visible, rank, rope, heads, nope, static_cast<__nv_bfloat16*>(latents), ld_c,
                                                            static_cast<__nv_bfloat16*>(keys), ld_k);
  } else if (type == kWF16) {
    inputs_kernel<<<grid_for(visible), kBlock, 0, stream>>>(cache, cache_elem, visible, rank, rope, heads, nope, static_cast<__half*>(latents), ld_c,
                                                            static_cast<__half*>(keys), ld_k);
  } else {
    inputs_kernel<<<grid_for(visible), kBlock, 0, stream>>>(cache, cache_elem, visible, rank, rope, heads, nope, static_cast<float*>(latents), ld_c,
                                                            static_cast<float*>(keys), ld_k);
  }
  check_launch("MLA GEMM inputs");
}

void launch_mla_queries(const float* q, int64_t q_stride, int64_t tokens, int64_t heads, int64_t qk, void* queries, int64_t ld_q, int32_t type,
                        cudaStream_t stream) {
  if (tokens == 0) return;
  if (type == kWBF16) {
    queries_kernel<<<grid_for(tokens), kBlock, 0, stream>>>(q, q_stride, tokens, heads, qk, static_cast<__nv_bfloat16*>(queries), ld_q);
  } else if (type == kWF16) {
    queries_kernel<<<grid_for(tokens), kBlock, 0, stream>>>(q, q_stride, tokens, heads, qk, static_cast<__half*>(queries), ld_q);
  } else {
    queries_kernel<<<grid_for(tokens), kBlock, 0, stream>>>(q, q_stride, tokens, heads, qk, static_cast<float*>(queries), ld_q);
  }
  check_launch("MLA queries");
}

void launch_mla_softmax(const float* scores, int64_t ld, int64_t rows, int64_t query_rows, int64_t first_visible, int64_t length, void* probs, int32_t type,
                        int32_t act, cudaStream_t stream) {
  if (rows == 0) return;
  if (type == kWBF16) {
    softmax_kernel<<<grid_for(rows), kBlock, 0, stream>>>(scores, ld, rows, query_rows, first_visible, length, static_cast<__nv_bfloat16*>(probs), act);
  } else if (type == kWF16) {
    softmax_kernel<<<grid_for(rows), kBlock, 0, stream>>>(scores, ld, rows, query_rows, first_visible, length, static_cast<__half*>(probs), act);
  } else {
    softmax_kernel<<<grid_for(rows), kBlock, 0, stream>>>(scores, ld, rows, query_rows, first_visible, length, static_cast<float*>(probs), act);
  }
  check_launch("MLA softmax");
}

void launch_mla_scatter(const float* o, int64_t ld_o, int64_t group, int64_t rows, int64_t dv, float* out, int64_t width, int32_t act, bool round_out,
                        const float* gate, int64_t gate_stride, cudaStream_t stream) {
  if (rows == 0) return;
  scatter_kernel<<<grid_for(rows), kBlock, 0, stream>>>(o, ld_o, group, rows, dv, out, width, act, round_out, gate, gate_stride);
  check_launch("MLA output scatter");
}

}  // namespace plow::cuda
