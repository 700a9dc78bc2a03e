// Device side of the routed-expert GEMMs (moe_gemm.h): the device routing sort and the expert GEMV of
// small steps, the gather of the pairs' rows in expert order, the grouped call's pointer arrays, and the
// two epilogues, which round exactly where op_moe_gate_up and
// op_moe_down_impl (ops/gemv.cuh) round, in the same order. One block per sorted pair (or token) row,
// threads over its columns: coalesced on both sides.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "runtime/cuda/device.cuh"
#include "runtime/cuda/kernels.h"  // declared in moe_gemm.h (host headers nvcc need not see)
#include "runtime/cuda/moe_lists.h"
#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/gemv_dot.cuh"
#include "runtime/cuda/ops/limits.h"

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
// Round to nearest even: exact for the gather's values (already of that type), the GEMV's rounding of a dot.
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_f(__half* p, float v) { *p = __float2half_rn(v); }

// V consecutive elements at p as fp32, and back (V = 4: one 16-byte fp32 or 8-byte 16-bit access; the
// launchers take V = 4 only where every such access is aligned).
template <int V, typename T>
__device__ __forceinline__ void load_n(const T* p, float (&v)[V]) {
  if constexpr (V == 1) {
    v[0] = load_f(p);
  } else if constexpr (std::is_same_v<T, float>) {
    static_assert(V == 4);
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
    static_assert(V == 4);
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    const T* h = reinterpret_cast<const T*>(&x);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = load_f(h + e);
  }
}
template <int V, typename T>
__device__ __forceinline__ void store_n(T* p, const float (&v)[V]) {
  if constexpr (V == 1) {
    store_f(p, v[0]);
  } else if constexpr (std::is_same_v<T, float>) {
    static_assert(V == 4);
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    static_assert(V == 4);
    uint2 x;
    T* h = reinterpret_cast<T*>(&x);
#pragma unroll
    for (int e = 0; e < 4; ++e) store_f(h + e, v[e]);
    *reinterpret_cast<uint2*>(p) = x;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, int V>
__global__ void gather_kernel(const float* base, int64_t stride, int64_t slot_width, int64_t top_k, const int32_t* perm, int64_t pairs, int64_t cols, T* dst,
                              int64_t ld) {
  for (int64_t p = blockIdx.x; p < pairs; p += gridDim.x) {
    const int64_t q = perm != nullptr ? perm[p] : p * top_k;
    const float* src = base + (q / top_k) * stride + (q % top_k) * slot_width;
    for (int64_t c = threadIdx.x * V; c < cols; c += blockDim.x * V) {
      float v[V];
      load_n<V>(src + c, v);
      store_n<V>(dst + p * ld + c, v);
    }
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
// With `sorted` (element type TS), also row p of it (stride sorted_ld): the down op's input rows as its
// gather would copy them from `out` (the same values, converted by the same store).
template <typename T, typename TS, int V>
__global__ void activation_kernel(const T* gate, const T* up, int64_t ld, const int32_t* perm, int64_t pairs, int64_t inter, float* out, int32_t act,
                                  bool round_out, bool situ, float beta, float linear_beta, TS* sorted, int64_t sorted_ld) {
  for (int64_t p = blockIdx.x; p < pairs; p += gridDim.x) {
    float* row = out + static_cast<int64_t>(perm[p]) * inter;  // pair q's columns [s·I, (s+1)·I) of token row t: q·I
    for (int64_t i = threadIdx.x * V; i < inter; i += blockDim.x * V) {
      float g[V], u[V], y[V];
      load_n<V>(gate + p * ld + i, g);
      load_n<V>(up + p * ld + i, u);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float ge = round_act(act, g[e]), ue = round_act(act, u[e]);
        const float v = situ ? round_act(act, situf_(ge, ue, beta, linear_beta)) : round_act(act, round_act(act, siluf_(ge)) * ue);
        y[e] = round_out ? round_act(act, v) : v;
      }
      store_n<V>(row + i, y);
      if (sorted != nullptr) store_n<V>(sorted + p * sorted_ld + i, y);
    }
  }
}

// op_moe_down_impl's epilogue: per token, Σ_s route_s · round(y_s) in slot order from 0 (fp32), rounded;
// plus the shared input, rounded again (kMoeDownAdd). No rounding at all for a partial sum.
template <typename T, bool ADD, int V>
__global__ void combine_kernel(const T* y, int64_t ld, const int32_t* inv, int64_t rows, int64_t top_k, int64_t width, const float* routes,
                               int64_t routes_stride, const float* shared, int64_t shared_stride, float* out, int32_t act, bool round_out) {
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const float* route = routes + t * routes_stride;
    const int32_t* sorted = inv + t * top_k;
    for (int64_t o = threadIdx.x * V; o < width; o += blockDim.x * V) {
      float total[V] = {};
      for (int64_t s = 0; s < top_k; ++s) {
        float dot[V];
        load_n<V>(y + static_cast<int64_t>(sorted[s]) * ld + o, dot);
#pragma unroll
        for (int e = 0; e < V; ++e) total[e] += route[s] * (round_out ? round_act(act, dot[e]) : dot[e]);
      }
      float v[V];
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = round_out ? round_act(act, total[e]) : total[e];
      if (ADD) {
        float add[V];
        load_n<V>(shared + t * shared_stride + o, add);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          v[e] = v[e] + add[e];
          v[e] = round_out ? round_act(act, v[e]) : v[e];
        }
      }
      store_n<V>(out + t * width + o, v);
    }
  }
}

// launch_moe_gemv: block (column slice, expert i); the expert's rows in groups of G ≤ kGemvGroup,
// staged as fp32 once per group. A warp streams two weight rows at a time (gate and up of one column,
// or two columns of down): kPairBatch<G> 16-byte loads in flight a lane on each row (gemv_dot.cuh).
// 256 threads, two blocks an SM (128 registers: at 64 or 80 they spilled; one block of 512 an SM was
// slower than cuBLAS's grouped GEMM, nothing streaming while it staged its rows).
constexpr int kGemvThreads = 256, kGemvWarps = kGemvThreads / 32;
// Output columns of a block, per stack: gate_up (two stacks) 64, down 128 (its rows are shorter: more
// of them share a staging). H200, 48B shape, a decode batch of 32 × 4096: 35.5 ms a step; down at 64
// columns 36.2, gate_up 128 and down 256 36.0.
__host__ __device__ constexpr int64_t gemv_cols(int sets) { return sets == 2 ? 64 : 128; }
constexpr int kGemvGroup = 4;  // rows staged at a time (37 KB at 2,304 wide); an expert with more takes several passes

struct GemvStacks {
  DeviceWeight w[2];
};

// Lane g < count stores row g's dot (after the warp's reduction).
template <int G, typename TOut>
__device__ __forceinline__ void store_dots(float (&acc)[G], int count, TOut* out, int64_t p0, int64_t ld_out, int64_t c) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g] = warp_sum(acc[g]);
  if (lane < count) {
    float v = 0.0f;
#pragma unroll
    for (int g = 0; g < G; ++g) v = g == lane ? acc[g] : v;
    store_f(out + (p0 + lane) * ld_out + c, v);
  }
}

template <int G, typename TOut>
__device__ __forceinline__ void gemv_rows(const GemvStacks& s, int sets, int64_t e, int64_t gemm_in, int64_t c0, int64_t c1, const float* xs, int ld,
                                          int64_t p0, int count, TOut* c_0, TOut* c_1, int64_t ld_out) {
  const int warp = threadIdx.x / 32;
  const DeviceWeight& w0 = s.w[0];
  const bool half = (w0.type == kWBF16 || w0.type == kWF16) && (sets == 1 || s.w[1].type == w0.type) && gemm_in % 8 == 0 &&
                    (reinterpret_cast<uintptr_t>(w0.data) | reinterpret_cast<uintptr_t>(s.w[1].data) | static_cast<uintptr_t>(w0.part_bytes)) % 16 == 0;
  const size_t row_bytes = static_cast<size_t>(gemm_in) * 2;
  if (half) {
    // Pairs of weight rows: (gate c, up c) for two stacks, (c, c + kGemvWarps) for one.
    const int64_t step = sets == 2 ? kGemvWarps : 2 * kGemvWarps;
    const uint8_t* base_a = w0.data + e * w0.part_bytes;
    const uint8_t* base_b = sets == 2 ? s.w[1].data + e * s.w[1].part_bytes : base_a;
    const int32_t type = w0.type;
    for (int64_t c = c0 + warp; c < c1; c += step) {
      const int64_t cb = sets == 2 ? c : c + kGemvWarps;
      const bool has_b = sets == 2 || cb < c1;
      const uint8_t* a = base_a + static_cast<size_t>(c) * row_bytes;
      const uint8_t* b = base_b + static_cast<size_t>(has_b ? cb : c) * row_bytes;
      float acc_a[G], acc_b[G];
#pragma unroll
      for (int g = 0; g < G; ++g) acc_a[g] = acc_b[g] = 0.0f;
      lane_dot2<G>(type, a, xs, b, xs, ld, static_cast<int>(gemm_in), acc_a, acc_b);
      store_dots<G>(acc_a, count, c_0, p0, ld_out, c);
      if (sets == 2) {
        store_dots<G>(acc_b, count, c_1, p0, ld_out, c);
      } else if (has_b) {
        store_dots<G>(acc_b, count, c_0, p0, ld_out, cb);
      }
    }
    return;
  }
  for (int64_t c = c0 + warp; c < c1; c += kGemvWarps) {
    for (int j = 0; j < sets; ++j) {
      float acc[G];
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = 0.0f;
      lane_dot<G>(s.w[j], e, c, xs, ld, static_cast<int>(gemm_in), acc);
      store_dots<G>(acc, count, j == 0 ? c_0 : c_1, p0, ld_out, c);
    }
  }
}

template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kGemvThreads, 2) gemv_kernel(const int32_t* active, const int32_t* offsets, const int32_t* n_active, int64_t pairs,
                                                            GemvStacks s, int sets, int64_t gemm_in, int64_t gemm_out, const TIn* b, int64_t ld_in, TOut* c_0,
                                                            TOut* c_1, int64_t ld_out, int group) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  const int i = blockIdx.y, n = *n_active;
  if (i >= n) return;  // the grid has a row for every expert the step could reach
  const int64_t e = active[i], first = offsets[i], end = i + 1 < n ? offsets[i + 1] : pairs;
  const int ld = static_cast<int>((gemm_in + 3) & ~int64_t{3});
  const int64_t cols = gemv_cols(sets);
  const int64_t c0 = blockIdx.x * cols, c1 = c0 + cols < gemm_out ? c0 + cols : gemm_out;
  for (int64_t p0 = first; p0 < end; p0 += group) {
    const int count = static_cast<int>(end - p0 < group ? end - p0 : group);
    const int padded_rows = count == 1 ? 1 : count == 2 ? 2 : 4;
    __syncthreads();  // the previous group's readers are done
    for (int g = 0; g < padded_rows; ++g) {
      for (int k = threadIdx.x; k < ld; k += kGemvThreads) xs[g * ld + k] = g < count && k < gemm_in ? load_f(b + (p0 + g) * ld_in + k) : 0.0f;
    }
    __syncthreads();
    if (count == 1) {
      gemv_rows<1>(s, sets, e, gemm_in, c0, c1, xs, ld, p0, count, c_0, c_1, ld_out);
    } else if (count == 2) {
      gemv_rows<2>(s, sets, e, gemm_in, c0, c1, xs, ld, p0, count, c_0, c_1, ld_out);
    } else {
      gemv_rows<4>(s, sets, e, gemm_in, c0, c1, xs, ld, p0, count, c_0, c_1, ld_out);
    }
  }
}

template <typename TIn, typename TOut>
bool gemv(const int32_t* active, const int32_t* offsets, const int32_t* n, int max_n, int64_t pairs, const GemvStacks& s, int sets, int64_t gemm_in,
          int64_t gemm_out, const void* b, int64_t ld_in, void* c0, void* c1, int64_t ld_out, cudaStream_t stream) {
  const int64_t ld = (gemm_in + 3) & ~int64_t{3};
  int group = pairs <= 1 ? 1 : pairs == 2 ? 2 : kGemvGroup;  // a padded group: 1, 2 or 4 rows (no expert has more than the step's pairs)
  while (group > 1 && static_cast<size_t>(group * ld) * sizeof(float) > static_cast<size_t>(kMoeGemvMaxStagedBytes)) group /= 2;
  const size_t smem = static_cast<size_t>(group * ld) * sizeof(float);
  if (smem > static_cast<size_t>(kMoeGemvMaxStagedBytes)) return false;
  const auto kernel = gemv_kernel<TIn, TOut>;
  if (smem > 48 * 1024) {
    const cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (error != cudaSuccess) cuda_failure("MoE GEMV shared memory", error);
  }
  const int64_t cols = gemv_cols(sets);
  const dim3 grid(static_cast<unsigned>((gemm_out + cols - 1) / cols), static_cast<unsigned>(max_n));
  kernel<<<grid, kGemvThreads, smem, stream>>>(active, offsets, n, pairs, s, sets, gemm_in, gemm_out, static_cast<const TIn*>(b), ld_in,
                                               static_cast<TOut*>(c0), static_cast<TOut*>(c1), ld_out, group);
  return true;
}

// launch_moe_route: one block, one thread per expert for the scans.
// The expert of pair q (slot q mod k of top-k row q / k: k weights, then k ids as floats); an id that is
// not an integer in 0..experts-1 sets *error to kErrRouting and counts as expert 0.
__device__ __forceinline__ int routed_expert(const float* routes, int64_t stride, int64_t top_k, int64_t q, int experts, int32_t* error) {
  const float id = routes[(q / top_k) * stride + top_k + q % top_k];
  if (id >= 0.0f && id < static_cast<float>(experts) && id == floorf(id)) return static_cast<int>(id);
  atomicCAS(error, 0, kErrRouting);
  return 0;
}

constexpr int kRouteThreads = 1024;
static_assert(kRouteThreads >= kMoeDeviceMaxExperts, "the routing sort scans one expert per thread");

__global__ void __launch_bounds__(kRouteThreads) route_kernel(const float* routes, int64_t stride, int64_t rows, int64_t top_k, int experts, int32_t* perm,
                                                              int32_t* inv, int32_t* active, int32_t* offsets, int32_t* counts, unsigned long long* stats,
                                                              int32_t* error) {
  using Scan = cub::BlockScan<int, kRouteThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int count[kMoeDeviceMaxExperts], start[kMoeDeviceMaxExperts];
  __shared__ int16_t expert_of[kMoeDeviceMaxPairs];
  const int t = threadIdx.x;
  const int pairs = static_cast<int>(rows * top_k);
  if (t < experts) count[t] = 0;
  __syncthreads();
  for (int q = t; q < pairs; q += kRouteThreads) {
    const int e = routed_expert(routes, stride, top_k, q, experts, error);
    expert_of[q] = static_cast<int16_t>(e);
    atomicAdd(&count[e], 1);
  }
  __syncthreads();
  const int c = t < experts ? count[t] : 0;
  int first = 0, slot = 0, n = 0;
  Scan(scan).ExclusiveSum(c, first);
  __syncthreads();  // the scan's storage is reused
  Scan(scan).ExclusiveSum(c > 0 ? 1 : 0, slot, n);
  if (t < experts) {
    start[t] = first;
    counts[t] = c;
    if (c > 0) {
      active[slot] = t;
      offsets[slot] = first;
    }
  }
  if (t == 0) {
    counts[experts] = n;
    stats[0] += 1;
    stats[1] += static_cast<unsigned long long>(n);
  }
  __syncthreads();
  // Sorted position: the expert's first plus the pairs before q with the same expert (ascending q).
  for (int q = t; q < pairs; q += kRouteThreads) {
    const int e = expert_of[q];
    int rank = 0;
    for (int r = 0; r < q; ++r) rank += expert_of[r] == e ? 1 : 0;
    const int p = start[e] + rank;
    perm[p] = q;
    inv[q] = p;
  }
}

// The large-step routing sort (launch_moe_sort). Keys: each pair's expert id (an invalid one sets
// kErrRouting and counts as expert 0, as route_kernel does), values the pair indices; counts by a
// shared-memory histogram per block.
__global__ void __launch_bounds__(kBlock) sort_keys_kernel(const float* routes, int64_t stride, int64_t top_k, int64_t pairs, int experts, int32_t* keys,
                                                           int32_t* values, int32_t* counts, int32_t* error) {
  __shared__ int hist[kMoeDeviceMaxExperts];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < pairs; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = routed_expert(routes, stride, top_k, q, experts, error);
    keys[q] = e;
    values[q] = static_cast<int32_t>(q);
    atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    if (hist[e] != 0) atomicAdd(&counts[e], hist[e]);
  }
}

// One block: from the counts, the active experts and their first sorted pairs (as the host's sort
// writes them), the active count after the counts, the statistics, and the wgmma kernel's job list
// (launch_moe_wgmma: the short and long job counts, then the short jobs, then the long ones). Expert e's
// rows are pieces of kMoeWgmmaJobRows; its last piece is a short job when it has at most 64 rows.
__global__ void __launch_bounds__(kRouteThreads) sort_lists_kernel(int experts, int32_t* counts, int32_t* active, int32_t* offsets, int32_t* job_list,
                                                                   unsigned long long* stats) {
  using Scan = cub::BlockScan<int, kRouteThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int t = threadIdx.x;
  const int c = t < experts ? counts[t] : 0;
  const int pieces = (c + kMoeWgmmaJobRows - 1) / kMoeWgmmaJobRows, last = c - (pieces - 1) * kMoeWgmmaJobRows;
  const int short_jobs = c > 0 && last <= 64 ? 1 : 0, long_jobs = pieces - short_jobs;
  int first = 0, slot = 0, n = 0, short_at = 0, short_total = 0, long_at = 0, long_total = 0;
  Scan(scan).ExclusiveSum(c, first);
  __syncthreads();  // the scan's storage is reused
  Scan(scan).ExclusiveSum(c > 0 ? 1 : 0, slot, n);
  __syncthreads();
  Scan(scan).ExclusiveSum(short_jobs, short_at, short_total);
  __syncthreads();
  Scan(scan).ExclusiveSum(long_jobs, long_at, long_total);
  if (c > 0) {
    active[slot] = t;
    offsets[slot] = first;
  }
  int32_t* jobs = job_list + 2;
  if (short_jobs > 0) {
    int32_t* job = jobs + 3 * short_at;
    job[0] = t, job[1] = first + (pieces - 1) * kMoeWgmmaJobRows, job[2] = last;
  }
  for (int j = 0; j < long_jobs; ++j) {
    int32_t* job = jobs + 3 * (short_total + long_at + j);
    job[0] = t, job[1] = first + j * kMoeWgmmaJobRows, job[2] = min(kMoeWgmmaJobRows, c - j * kMoeWgmmaJobRows);
  }
  if (t == 0) {
    counts[experts] = n;
    job_list[0] = short_total;
    job_list[1] = long_total;
    stats[0] += 1;
    stats[1] += static_cast<unsigned long long>(n);
  }
}

__global__ void inverse_kernel(const int32_t* perm, int64_t pairs, int32_t* inv) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < pairs; p += static_cast<int64_t>(gridDim.x) * blockDim.x) inv[perm[p]] = static_cast<int32_t>(p);
}

template <typename T>
void combine(const void* y, int64_t ld, const int32_t* inv, int64_t rows, int64_t top_k, int64_t width, const float* routes, int64_t routes_stride,
             const float* shared, int64_t shared_stride, float* out, int32_t act, bool round_out, cudaStream_t stream) {
  const T* typed = static_cast<const T*>(y);
  const bool v4 = width % 4 == 0 && ld % 4 == 0 && aligned16(y) && aligned16(out) && (shared == nullptr || (shared_stride % 4 == 0 && aligned16(shared)));
  const auto launch = [&](auto kernel) {
    kernel<<<grid_for(rows), kBlock, 0, stream>>>(typed, ld, inv, rows, top_k, width, routes, routes_stride, shared, shared_stride, out, act, round_out);
  };
  if (shared != nullptr) {
    if (v4) launch(combine_kernel<T, true, 4>);
    else launch(combine_kernel<T, true, 1>);
  } else {
    if (v4) launch(combine_kernel<T, false, 4>);
    else launch(combine_kernel<T, false, 1>);
  }
}

}  // namespace

void launch_moe_gather(const float* base, int64_t stride, int64_t slot_width, int64_t top_k, const int32_t* perm, int64_t pairs, int64_t cols, void* dst,
                       int64_t ld, int32_t type, cudaStream_t stream) {
  if (pairs == 0) return;
  const bool v4 = cols % 4 == 0 && stride % 4 == 0 && slot_width % 4 == 0 && ld % 4 == 0 && aligned16(base) && aligned16(dst);
  const auto launch = [&](auto* typed, auto kernel) { kernel<<<grid_for(pairs), kBlock, 0, stream>>>(base, stride, slot_width, top_k, perm, pairs, cols, typed, ld); };
  if (type == kWBF16) {
    auto* typed = static_cast<__nv_bfloat16*>(dst);
    v4 ? launch(typed, gather_kernel<__nv_bfloat16, 4>) : launch(typed, gather_kernel<__nv_bfloat16, 1>);
  } else if (type == kWF16) {
    auto* typed = static_cast<__half*>(dst);
    v4 ? launch(typed, gather_kernel<__half, 4>) : launch(typed, gather_kernel<__half, 1>);
  } else {
    auto* typed = static_cast<float*>(dst);
    v4 ? launch(typed, gather_kernel<float, 4>) : launch(typed, gather_kernel<float, 1>);
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

void launch_moe_route(const float* routes, int64_t stride, int64_t rows, int64_t top_k, int experts, int32_t* perm, int32_t* inv, int32_t* active,
                      int32_t* offsets, int32_t* counts, unsigned long long* stats, int32_t* error, cudaStream_t stream) {
  route_kernel<<<1, kRouteThreads, 0, stream>>>(routes, stride, rows, top_k, experts, perm, inv, active, offsets, counts, stats, error);
  check_launch("MoE routing sort");
}

size_t moe_sort_temp_bytes(int64_t pairs) {
  size_t bytes = 0;
  const cudaError_t error = cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
                                                            static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(pairs), 0,
                                                            10);
  if (error != cudaSuccess) cuda_failure("MoE routing sort storage", error);
  return bytes;
}

void launch_moe_sort(const float* routes, int64_t stride, int64_t rows, int64_t top_k, int experts, const MoeSortBuffers& b, int32_t* perm, int32_t* inv,
                     int32_t* active, int32_t* offsets, int32_t* job_list, int32_t* counts, unsigned long long* stats, int32_t* error, cudaStream_t stream) {
  const int64_t pairs = rows * top_k;
  const cudaError_t cleared = cudaMemsetAsync(counts, 0, static_cast<size_t>(experts) * sizeof(int32_t), stream);
  if (cleared != cudaSuccess) cuda_failure("MoE routing counts", cleared);
  // A block per 256 pairs up to 264 (two an SM of the H200): each block's histogram adds its counts once.
  const int blocks = static_cast<int>(std::min<int64_t>((pairs + kBlock - 1) / kBlock, 264));
  sort_keys_kernel<<<std::max(blocks, 1), kBlock, 0, stream>>>(routes, stride, top_k, pairs, experts, b.keys, b.values, counts, error);
  check_launch("MoE routing keys");
  int bits = 1;
  while ((1 << bits) < experts) ++bits;
  size_t bytes = b.temp_bytes;
  // Unsigned keys: the ids are non-negative, and no sign bit is reordered.
  const cudaError_t sorted = cub::DeviceRadixSort::SortPairs(b.temp, bytes, reinterpret_cast<const uint32_t*>(b.keys), reinterpret_cast<uint32_t*>(b.sorted_keys),
                                                             b.values, perm, static_cast<int>(pairs), 0, bits, stream);
  if (sorted != cudaSuccess) cuda_failure("MoE routing radix sort", sorted);
  sort_lists_kernel<<<1, kRouteThreads, 0, stream>>>(experts, counts, active, offsets, job_list, stats);
  check_launch("MoE routing lists");
  inverse_kernel<<<grid_for(pairs), kBlock, 0, stream>>>(perm, pairs, inv);
  check_launch("MoE routing inverse");
}

bool launch_moe_gemv(const int32_t* active, const int32_t* offsets, const int32_t* n, int max_n, int64_t pairs, const DeviceWeight* w, int sets,
                     int64_t gemm_in, int64_t gemm_out, const void* b, int64_t ld_in, int32_t in_type, void* c0, void* c1, int64_t ld_out,
                     int32_t out_type, cudaStream_t stream) {
  if (max_n > 65535 || sets < 1 || sets > 2) return false;
  if (max_n == 0 || pairs == 0) return true;
  GemvStacks s{{w[0], sets > 1 ? w[1] : w[0]}};
  bool ok = false;
  if (in_type == kWBF16 && out_type == kWBF16) {
    ok = gemv<__nv_bfloat16, __nv_bfloat16>(active, offsets, n, max_n, pairs, s, sets, gemm_in, gemm_out, b, ld_in, c0, c1, ld_out, stream);
  } else if (in_type == kWBF16 && out_type == kWF32) {
    ok = gemv<__nv_bfloat16, float>(active, offsets, n, max_n, pairs, s, sets, gemm_in, gemm_out, b, ld_in, c0, c1, ld_out, stream);
  } else if (in_type == kWF16 && out_type == kWF16) {
    ok = gemv<__half, __half>(active, offsets, n, max_n, pairs, s, sets, gemm_in, gemm_out, b, ld_in, c0, c1, ld_out, stream);
  } else if (in_type == kWF16 && out_type == kWF32) {
    ok = gemv<__half, float>(active, offsets, n, max_n, pairs, s, sets, gemm_in, gemm_out, b, ld_in, c0, c1, ld_out, stream);
  } else if (in_type == kWF32 && out_type == kWF32) {
    ok = gemv<float, float>(active, offsets, n, max_n, pairs, s, sets, gemm_in, gemm_out, b, ld_in, c0, c1, ld_out, stream);
  }
  if (ok) check_launch("MoE GEMV");
  return ok;
}

void launch_moe_activation(const void* gate, const void* up, int64_t ld, int32_t type, const int32_t* perm, int64_t pairs, int64_t inter, float* out,
                           int32_t act, bool round_out, bool situ, float beta, float linear_beta, void* sorted, int64_t sorted_ld, int32_t sorted_type,
                           cudaStream_t stream) {
  if (pairs == 0) return;
  const bool v4 = inter % 4 == 0 && ld % 4 == 0 && aligned16(gate) && aligned16(up) && aligned16(out) && sorted_ld % 4 == 0 && aligned16(sorted);
  // The gate/up element type, then the sorted copy's (float: none, null).
  const auto with_sorted = [&](const auto* g, const auto* u) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(g)>>;
    const auto launch = [&](auto* typed, auto kernel) {
      kernel<<<grid_for(pairs), kBlock, 0, stream>>>(g, u, ld, perm, pairs, inter, out, act, round_out, situ, beta, linear_beta, typed, sorted_ld);
    };
    if (sorted != nullptr && sorted_type == kWBF16) {
      auto* typed = static_cast<__nv_bfloat16*>(sorted);
      v4 ? launch(typed, activation_kernel<T, __nv_bfloat16, 4>) : launch(typed, activation_kernel<T, __nv_bfloat16, 1>);
    } else if (sorted != nullptr && sorted_type == kWF16) {
      auto* typed = static_cast<__half*>(sorted);
      v4 ? launch(typed, activation_kernel<T, __half, 4>) : launch(typed, activation_kernel<T, __half, 1>);
    } else {
      auto* typed = static_cast<float*>(sorted);  // null: no copy
      v4 ? launch(typed, activation_kernel<T, float, 4>) : launch(typed, activation_kernel<T, float, 1>);
    }
  };
  if (type == kWBF16) {
    with_sorted(static_cast<const __nv_bfloat16*>(gate), static_cast<const __nv_bfloat16*>(up));
  } else if (type == kWF16) {
    with_sorted(static_cast<const __half*>(gate), static_cast<const __half*>(up));
  } else {
    with_sorted(static_cast<const float*>(gate), static_cast<const float*>(up));
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
