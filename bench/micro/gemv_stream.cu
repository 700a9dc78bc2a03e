// Microbenchmark: how fast can one 512-thread block an SM (the megakernel's shape) stream bf16 GEMV rows
// of K = 2304 (the 48B's hidden width) against an fp32 row in shared memory, per block and in all?
// Variants: E a read-only copy (the roofline of this grid), A a warp a row with the row's 9 16-byte
// loads a lane in flight (the op bodies' lane_dot), B the next row's loads issued before this row's
// math, C cp.async into a warp's ring of shared-memory stages, D cp.async.bulk (one lane, an mbarrier a
// stage) into the same. Each is checked against A's dots. Standalone, not part of the build:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o gemv_stream bench/micro/gemv_stream.cu
// then run it on the GPU; docs/cuda.md ("Streaming rows: registers against copies into shared memory")
// has the H200's table.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
constexpr int K = 2304, CH = K / 8 /*16B chunks*/, PL = CH / 32 /*9 per lane*/;

__device__ __forceinline__ uint4 ldnc(const void* p) { uint4 v; asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)); return v; }
__device__ __forceinline__ uint64_t gtime() { uint64_t t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ float dot8(uint4 v, const float* xs) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w}; float s = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) { s += __uint_as_float(w[i] << 16) * xs[2 * i] + __uint_as_float(w[i] & 0xffff0000u) * xs[2 * i + 1]; }
  return s;
}
__device__ __forceinline__ float wsum(float v) { for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o); return v; }

struct Args { const uint8_t* w; const float* x; float* y; int rows_per_block; uint64_t* times; };

__device__ __forceinline__ void stage_x(const float* x, float* xs) { for (int i = threadIdx.x; i < K; i += blockDim.x) xs[i] = x[i]; __syncthreads(); }

// A: a warp a row, the row's 9 loads in flight, reduce, next row.
__global__ void __launch_bounds__(512, 1) kA(Args a) {
  extern __shared__ __align__(16) uint8_t sm[]; float* xs = (float*)sm;
  stage_x(a.x, xs); uint64_t t0 = gtime();
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, nw = blockDim.x / 32;
  const int64_t r0 = (int64_t)blockIdx.x * a.rows_per_block;
  for (int r = warp; r < a.rows_per_block; r += nw) {
    const uint8_t* row = a.w + (r0 + r) * (K * 2);
    uint4 v[PL];
#pragma unroll
    for (int u = 0; u < PL; ++u) v[u] = ldnc(row + (lane + 32 * u) * 16);
    float s = 0;
#pragma unroll
    for (int u = 0; u < PL; ++u) s += dot8(v[u], xs + (lane + 32 * u) * 8);
    s = wsum(s); if (lane == 0) a.y[r0 + r] = s;
  }
  __syncthreads(); if (threadIdx.x == 0) { a.times[2 * blockIdx.x] = t0; a.times[2 * blockIdx.x + 1] = gtime(); }
}
// B: registers double-buffered: the next row's loads issued before this row's math.
__global__ void __launch_bounds__(512, 1) kB(Args a) {
  extern __shared__ __align__(16) uint8_t sm[]; float* xs = (float*)sm;
  stage_x(a.x, xs); uint64_t t0 = gtime();
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, nw = blockDim.x / 32;
  const int64_t r0 = (int64_t)blockIdx.x * a.rows_per_block;
  uint4 v[PL], n[PL];
  int r = warp;
  if (r < a.rows_per_block) {
#pragma unroll
    for (int u = 0; u < PL; ++u) v[u] = ldnc(a.w + (r0 + r) * (K * 2) + (lane + 32 * u) * 16);
  }
  for (; r < a.rows_per_block; r += nw) {
    const int rn = r + nw;
    if (rn < a.rows_per_block) {
#pragma unroll
      for (int u = 0; u < PL; ++u) n[u] = ldnc(a.w + (r0 + rn) * (K * 2) + (lane + 32 * u) * 16);
    }
    float s = 0;
#pragma unroll
    for (int u = 0; u < PL; ++u) s += dot8(v[u], xs + (lane + 32 * u) * 8);
    s = wsum(s); if (lane == 0) a.y[r0 + r] = s;
#pragma unroll
    for (int u = 0; u < PL; ++u) v[u] = n[u];
  }
  __syncthreads(); if (threadIdx.x == 0) { a.times[2 * blockIdx.x] = t0; a.times[2 * blockIdx.x + 1] = gtime(); }
}
// C: cp.async (16 B a lane) into a warp-private ring of S stages, a stage 1/P of a row.
template <int P, int S>
__global__ void __launch_bounds__(512, 1) kC(Args a) {
  extern __shared__ __align__(16) uint8_t sm[]; float* xs = (float*)sm;
  stage_x(a.x, xs); uint64_t t0 = gtime();
  constexpr int SB = K * 2 / P, LU = PL / P;  // stage bytes, loads a lane a stage
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, nw = blockDim.x / 32;
  uint8_t* ring = sm + K * 4 + warp * S * SB;
  const int64_t r0 = (int64_t)blockIdx.x * a.rows_per_block;
  const int mine = (a.rows_per_block - warp + nw - 1) / nw;
  const int stages = mine * P;
  auto issue = [&](int i) {
    if (i < stages) {
      const uint8_t* src = a.w + (r0 + warp + (int64_t)(i / P) * nw) * (K * 2) + (i % P) * SB;
      uint8_t* dst = ring + (i % S) * SB;
#pragma unroll
      for (int u = 0; u < LU; ++u) {
        uint32_t d = (uint32_t)__cvta_generic_to_shared(dst + (lane + 32 * u) * 16);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src + (lane + 32 * u) * 16));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);
  float s = 0;
  for (int i = 0; i < stages; ++i) {
    issue(i + S - 1);
    asm volatile("cp.async.wait_group %0;" :: "n"(S - 1));
    __syncwarp();
    const uint8_t* src = ring + (i % S) * SB;
    const float* xp = xs + (i % P) * (K / P);
#pragma unroll
    for (int u = 0; u < LU; ++u) s += dot8(*(const uint4*)(src + (lane + 32 * u) * 16), xp + (lane + 32 * u) * 8);
    if (i % P == P - 1) { s = wsum(s); if (lane == 0) a.y[r0 + warp + (int64_t)(i / P) * nw] = s; s = 0; }
    __syncwarp();
  }
  asm volatile("cp.async.wait_group 0;");
  __syncthreads(); if (threadIdx.x == 0) { a.times[2 * blockIdx.x] = t0; a.times[2 * blockIdx.x + 1] = gtime(); }
}
// D: bulk copies (cp.async.bulk by lane 0, 1/P of a row each) into a warp-private ring of S stages.
template <int P, int S>
__global__ void __launch_bounds__(512, 1) kD(Args a) {
  extern __shared__ __align__(16) uint8_t sm[]; float* xs = (float*)sm;
  constexpr int SB = K * 2 / P, LU = PL / P;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, nw = blockDim.x / 32;
  uint64_t* bars = (uint64_t*)(sm + K * 4) + warp * S;
  uint8_t* ring = sm + K * 4 + 16 * 8 * 8 + warp * S * SB;
  if (lane == 0) for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"((uint32_t)__cvta_generic_to_shared(bars + s)));
  asm volatile("fence.mbarrier_init.release.cluster;");
  stage_x(a.x, xs); uint64_t t0 = gtime();
  const int64_t r0 = (int64_t)blockIdx.x * a.rows_per_block;
  const int mine = (a.rows_per_block - warp + nw - 1) / nw;
  const int stages = mine * P;
  auto issue = [&](int i) {
    if (i < stages && lane == 0) {
      const uint8_t* src = a.w + (r0 + warp + (int64_t)(i / P) * nw) * (K * 2) + (i % P) * SB;
      uint32_t bar = (uint32_t)__cvta_generic_to_shared(bars + i % S), dst = (uint32_t)__cvta_generic_to_shared(ring + (i % S) * SB);
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(bar), "r"(SB));
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" :: "r"(dst), "l"(src), "r"(SB), "r"(bar) : "memory");
    }
  };
  for (int i = 0; i < S; ++i) issue(i);
  float s = 0;
  for (int i = 0; i < stages; ++i) {
    uint32_t bar = (uint32_t)__cvta_generic_to_shared(bars + i % S), par = (i / S) & 1;
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }" :: "r"(bar), "r"(par) : "memory");
    const uint8_t* src = ring + (i % S) * SB;
    const float* xp = xs + (i % P) * (K / P);
#pragma unroll
    for (int u = 0; u < LU; ++u) s += dot8(*(const uint4*)(src + (lane + 32 * u) * 16), xp + (lane + 32 * u) * 8);
    __syncwarp();
    issue(i + S);
    if (i % P == P - 1) { s = wsum(s); if (lane == 0) a.y[r0 + warp + (int64_t)(i / P) * nw] = s; s = 0; }
  }
  __syncthreads(); if (threadIdx.x == 0) { a.times[2 * blockIdx.x] = t0; a.times[2 * blockIdx.x + 1] = gtime(); }
}
// E: a copy kernel (read only, sum), to give the read roofline with the same grid.
__global__ void __launch_bounds__(512, 1) kE(Args a) {
  extern __shared__ __align__(16) uint8_t sm[];
  uint64_t t0 = gtime();
  const int64_t bytes = (int64_t)a.rows_per_block * K * 2, base = (int64_t)blockIdx.x * bytes;
  uint32_t acc = 0;
  for (int64_t o = threadIdx.x * 16; o < bytes; o += blockDim.x * 16 * 4) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = o + u * blockDim.x * 16 < bytes ? ldnc(a.w + base + o + u * blockDim.x * 16) : uint4{};
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678) a.y[0] = 1;
  __syncthreads(); if (threadIdx.x == 0) { a.times[2 * blockIdx.x] = t0; a.times[2 * blockIdx.x + 1] = gtime(); }
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int maxrows = 1024, regions = 4;
  const size_t region = (size_t)sms * maxrows * K * 2;
  uint8_t* w; CK(cudaMalloc(&w, region * regions));
  { std::vector<uint16_t> h(region / 2); for (size_t i = 0; i < h.size(); ++i) h[i] = 0x3c00 + (uint16_t)((i * 2654435761u >> 20) & 0xff); for (int r = 0; r < regions; ++r) CK(cudaMemcpy(w + r * region, h.data(), region, cudaMemcpyHostToDevice)); }
  float* x; CK(cudaMalloc(&x, K * 4)); { std::vector<float> h(K); for (int i = 0; i < K; ++i) h[i] = (i % 7) * 0.125f - 0.3f; CK(cudaMemcpy(x, h.data(), K * 4, cudaMemcpyHostToDevice)); }
  float* y; CK(cudaMalloc(&y, (size_t)sms * maxrows * 4));
  uint64_t* times; CK(cudaMalloc(&times, sms * 16));
  std::vector<float> ref;
  struct V { const char* name; void (*k)(Args); int smem; };
  const int xb = K * 4;
  V vs[] = {{"E copy", kE, 0}, {"A reg 1 row", kA, xb}, {"B reg 2 rows", kB, xb},
            {"C cpa P1 S2", kC<1, 2>, xb + 16 * 2 * K * 2}, {"C cpa P3 S6", kC<3, 6>, xb + 16 * 6 * K * 2 / 3},
            {"C cpa P3 S8", kC<3, 8>, xb + 16 * 8 * K * 2 / 3}, {"C cpa P3 S4", kC<3, 4>, xb + 16 * 4 * K * 2 / 3},
            {"D bulk P1 S2", kD<1, 2>, xb + 1024 + 16 * 2 * K * 2}, {"D bulk P3 S6", kD<3, 6>, xb + 1024 + 16 * 6 * K * 2 / 3},
            {"D bulk P3 S8", kD<3, 8>, xb + 1024 + 16 * 8 * K * 2 / 3}, {"D bulk P3 S4", kD<3, 4>, xb + 1024 + 16 * 4 * K * 2 / 3}};
  printf("%-16s %6s %10s %10s %10s %10s\n", "variant", "rows", "KB/block", "launch us", "block us", "GB/s/SM(blk)");
  for (int rows : {62, 124, 248, 1024}) {
    for (auto& v : vs) {
      CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, std::max(v.smem, 1)));
      cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
      const int iters = 40; std::vector<double> blk;
      float best = 1e9;
      for (int rep = 0; rep < 3; ++rep) {
        CK(cudaEventRecord(e0));
        for (int it = 0; it < iters; ++it) { Args a{w + (it % regions) * region, x, y, rows, times}; v.k<<<sms, 512, v.smem>>>(a); }
        CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaGetLastError());
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms * 1000 / iters);
      }
      std::vector<uint64_t> t(2 * sms); CK(cudaMemcpy(t.data(), times, sms * 16, cudaMemcpyDeviceToHost));
      double sum = 0; for (int b = 0; b < sms; ++b) sum += (t[2 * b + 1] - t[2 * b]) * 1e-3; sum /= sms;
      const double kb = rows * K * 2 / 1024.0;
      // correctness: compare y with A's
      if (v.k != kE) {
        std::vector<float> h((size_t)sms * rows); CK(cudaMemcpy(h.data(), y, h.size() * 4, cudaMemcpyDeviceToHost));
        if (v.k == kA) ref = h; else { double md = 0; for (size_t i = 0; i < h.size(); ++i) md = std::max(md, (double)fabsf(h[i] - ref[i])); if (md > 1e-3) printf("MISMATCH %g\n", md); }
      }
      printf("%-16s %6d %10.0f %10.2f %10.2f %10.1f   total %.2f TB/s\n", v.name, rows, kb, best, sum, kb * 1.024 / sum, sms * kb * 1024 / (best * 1e-6) / 1e12);
    }
  }
}
