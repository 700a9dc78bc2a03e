// Device side of the routed-expert GEMMs (moe_gemm.h): the gather of the pairs' rows in expert order,
// the grouped call's pointer arrays, and the two epilogues, which round exactly where op_moe_gate_up and
// op_moe_down_impl (ops/gemv.cuh) round, in the same order. One block per sorted pair (or token) row,
// threads over its columns: coalesced on both sides.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "runtime/cuda/device.cuh"
#include "runtime/cuda/kernels.h"  // declared in moe_gemm.h (host headers nvcc need not see)

namespace plow::cuda {

namespace {

constexpr int kBlock = 256;

int grid_for(int64_t rows) { return static_cast<int>(rows < 4096 ? (rows > 0 ? rows : 1) : 4096); }

void check_launch(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_failure(what, error);
}

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_f(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }  // exact: v is a bf16 value
__device__ __forceinline__ void store_f(__half* p, float v) { *p = __float2half_rn(v); }

template <typename T>
__global__ void gather_kernel(const float* base, int64_t stride, int64_t slot_width, int64_t top_k, const int32_t* perm, int64_t pairs, int64_t cols, T* dst,
                              int64_t ld) {
  for (int64_t p = blockIdx.x; p < pairs; p += gridDim.x) {
    const int64_t q = perm[p];
    const float* src = base + (q / top_k) * stride + (q % top_k) * slot_width;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) store_f(dst + p * ld + c, src[c]);
  }
}

struct PointerSets {
  const uint8_t* w[2];
  int64_t part_bytes;
  const uint8_t* b;
  int64_t b_row_bytes;
  uint8_t* c[2];
  int64_t c_row_bytes;
};

__global__ void pointers_kernel(const int32_t* groups, int n, int sets, PointerSets s, void** ptrs) {
  const int total = n * sets;
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < total; g += gridDim.x * blockDim.x) {
    const int j = g / n, i = g % n;
    const int64_t e = groups[i], first = groups[n + i];
    ptrs[g] = const_cast<uint8_t*>(s.w[j] + e * s.part_bytes);
    ptrs[total + g] = const_cast<uint8_t*>(s.b + first * s.b_row_bytes);
    ptrs[2 * total + g] = s.c[j] + first * s.c_row_bytes;
  }
}

// op_moe_gate_up's epilogue: gate and up rounded (cuBLAS already rounded half outputs: rounding again
// leaves them), the activation rounded, the output rounded when the op's dtype is the activation's.
template <typename T>
__global__ void activation_kernel(const T* gate, const T* up, int64_t ld, const int32_t* perm, int64_t pairs, int64_t inter, float* out, int32_t act,
                                  bool round_out, bool situ, float beta, float linear_beta) {
  for (int64_t p = blockIdx.x; p < pairs; p += gridDim.x) {
    float* row = out + static_cast<int64_t>(perm[p]) * inter;  // pair q's columns [s·I, (s+1)·I) of token row t: q·I
    for (int64_t i = threadIdx.x; i < inter; i += blockDim.x) {
      const float g = round_act(act, load_f(gate + p * ld + i)), u = round_act(act, load_f(up + p * ld + i));
      const float v = situ ? round_act(act, situf_(g, u, beta, linear_beta)) : round_act(act, round_act(act, siluf_(g)) * u);
      row[i] = round_out ? round_act(act, v) : v;
    }
  }
}

// op_moe_down_impl's epilogue: per token, Σ_s route_s · round(y_s) in slot order from 0 (fp32), rounded;
// plus the shared input, rounded again (kMoeDownAdd). No rounding at all for a partial sum.
template <typename T, bool ADD>
__global__ void combine_kernel(const T* y, int64_t ld, const int32_t* inv, int64_t rows, int64_t top_k, int64_t width, const float* routes,
                               int64_t routes_stride, const float* shared, int64_t shared_stride, float* out, int32_t act, bool round_out) {
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const float* route = routes + t * routes_stride;
    const int32_t* sorted = inv + t * top_k;
    for (int64_t o = threadIdx.x; o < width; o += blockDim.x) {
      float total = 0.0f;
      for (int64_t s = 0; s < top_k; ++s) {
        const float dot = load_f(y + static_cast<int64_t>(sorted[s]) * ld + o);
        total += route[s] * (round_out ? round_act(act, dot) : dot);
      }
      float v = round_out ? round_act(act, total) : total;
      if (ADD) {
        v = v + shared[t * shared_stride + o];
        v = round_out ? round_act(act, v) : v;
      }
      out[t * width + o] = v;
    }
  }
}

template <typename T>
void combine(const void* y, int64_t ld, const int32_t* inv, int64_t rows, int64_t top_k, int64_t width, const float* routes, int64_t routes_stride,
             const float* shared, int64_t shared_stride, float* out, int32_t act, bool round_out, cudaStream_t stream) {
  const T* typed = static_cast<const T*>(y);
  if (shared != nullptr) {
    combine_kernel<T, true><<<grid_for(rows), kBlock, 0, stream>>>(typed, ld, inv, rows, top_k, width, routes, routes_stride, shared, shared_stride, out, act,
                                                                   round_out);
  } else {
    combine_kernel<T, false><<<grid_for(rows), kBlock, 0, stream>>>(typed, ld, inv, rows, top_k, width, routes, routes_stride, shared, shared_stride, out, act,
                                                                    round_out);
  }
}

}  // namespace

void launch_moe_gather(const float* base, int64_t stride, int64_t slot_width, int64_t top_k, const int32_t* perm, int64_t pairs, int64_t cols, void* dst,
                       int64_t ld, int32_t type, cudaStream_t stream) {
  if (pairs == 0) return;
  if (type == kWBF16) {
    gather_kernel<<<grid_for(pairs), kBlock, 0, stream>>>(base, stride, slot_width, top_k, perm, pairs, cols, static_cast<__nv_bfloat16*>(dst), ld);
  } else if (type == kWF16) {
    gather_kernel<<<grid_for(pairs), kBlock, 0, stream>>>(base, stride, slot_width, top_k, perm, pairs, cols, static_cast<__half*>(dst), ld);
  } else {
    gather_kernel<<<grid_for(pairs), kBlock, 0, stream>>>(base, stride, slot_width, top_k, perm, pairs, cols, static_cast<float*>(dst), ld);
  }
  check_launch("MoE gather");
}

void launch_moe_pointers(const int32_t* groups, int n, int sets, const uint8_t* w0, const uint8_t* w1, int64_t part_bytes, const uint8_t* b,
                         int64_t b_row_bytes, uint8_t* c0, uint8_t* c1, int64_t c_row_bytes, void** ptrs, cudaStream_t stream) {
  if (n == 0) return;
  const PointerSets s{{w0, w1}, part_bytes, b, b_row_bytes, {c0, c1}, c_row_bytes};
  pointers_kernel<<<(n * sets + kBlock - 1) / kBlock, kBlock, 0, stream>>>(groups, n, sets, s, ptrs);
  check_launch("MoE GEMM pointers");
}

void launch_moe_activation(const void* gate, const void* up, int64_t ld, int32_t type, const int32_t* perm, int64_t pairs, int64_t inter, float* out,
                           int32_t act, bool round_out, bool situ, float beta, float linear_beta, cudaStream_t stream) {
  if (pairs == 0) return;
  if (type == kWBF16) {
    activation_kernel<<<grid_for(pairs), kBlock, 0, stream>>>(static_cast<const __nv_bfloat16*>(gate), static_cast<const __nv_bfloat16*>(up), ld, perm, pairs,
                                                              inter, out, act, round_out, situ, beta, linear_beta);
  } else if (type == kWF16) {
    activation_kernel<<<grid_for(pairs), kBlock, 0, stream>>>(static_cast<const __half*>(gate), static_cast<const __half*>(up), ld, perm, pairs, inter, out,
                                                              act, round_out, situ, beta, linear_beta);
  } else {
    activation_kernel<<<grid_for(pairs), kBlock, 0, stream>>>(static_cast<const float*>(gate), static_cast<const float*>(up), ld, perm, pairs, inter, out, act,
                                                              round_out, situ, beta, linear_beta);
  }
  check_launch("MoE activation");
}

void launch_moe_combine(const void* y, int64_t ld, int32_t type, const int32_t* inv, int64_t rows, int64_t top_k, int64_t width, const float* routes,
                        int64_t routes_stride, const float* shared, int64_t shared_stride, float* out, int32_t act, bool round_out, cudaStream_t stream) {
  if (rows == 0) return;
  if (type == kWBF16) {
    combine<__nv_bfloat16>(y, ld, inv, rows, top_k, width, routes, routes_stride, shared, shared_stride, out, act, round_out, stream);
  } else if (type == kWF16) {
    combine<__half>(y, ld, inv, rows, top_k, width, routes, routes_stride, shared, shared_stride, out, act, round_out, stream);
  } else {
    combine<float>(y, ld, inv, rows, top_k, width, routes, routes_stride, shared, shared_stride, out, act, round_out, stream);
  }
  check_launch("MoE combine");
}

}  // namespace plow::cuda
