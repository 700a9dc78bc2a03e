// Hopper's warpgroup MMA (wgmma) as the 16-bit kernels use it (moe_wgmma.cu, mla_wgmma.cu): 16-byte
// cp.async into shared memory, the descriptor of a K-major tile in the 128-byte-swizzled layout, the
// fences, and the m64nNk16 instructions with both operands in shared memory (SS) or A in registers (RS).
//
// The layout: a tile of R rows × 64 K elements (16-bit) is R rows of 128 bytes, 16-byte chunk c of row r
// at chunk c ^ (r mod 8) (8-row atoms of 1,024 bytes, 1,024-byte aligned); wider K is one such tile per
// 64 elements. The k16 steps inside a tile advance the descriptor's start address by 32 bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "runtime/cuda/wgmma_layout.h"  // wg_swizzle, wg_desc

namespace plow::cuda {

__device__ __forceinline__ uint32_t wg_smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16 bytes into shared memory at `dst`: from src (bytes 16) or zeros (bytes 0; src is not read).
__device__ __forceinline__ void wg_cp16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_prior() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// Registers an in-flight wgmma writes, pinned in place: the compiler must not read them ahead of the
// wait that completes the product (CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void wg_fence_operand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Generic-proxy stores to shared memory (st.shared, cp.async) made visible to wgmma's reads.
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d += A·B for a 64×N×16 step. The accumulator fragment of thread t of the warpgroup: rows
// 16·(t/32) + (t%32)/4 (+8), columns 8j + 2·(t%4) (+1) at d[4j..4j+3] (as mma.sync's m16n8 tiles side by
// side). SS: A (64 rows) and B (N rows) by their descriptors, both K-major. RS: A in registers, the
// m16n8k16 A fragment of the warp's 16 rows (a0 (g, 2c..), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8,
// 2c+8..)). Scale-d 1 (accumulate), A and B unscaled, B K-major.
#define PLOW_WG_REGS32 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define PLOW_WG_REGS64 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
  "}"
#define PLOW_WG_OUT32 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define PLOW_WG_OUT64 \
  PLOW_WG_OUT32, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define PLOW_WG_SS(shape, type, regs, a, b) "wgmma.mma_async.sync.aligned." shape ".f32." type "." type " " regs ", %" a ", %" b ", 1, 1, 1, 0, 0;\n"

// SS, N = 64 (32 accumulators) and N = 128 (64).
#define PLOW_WG_SS_FN(n, regs, out, a_op, b_op)                                                              \
  template <typename T>                                                                                      \
  __device__ __forceinline__ void wg_mma_ss(float(&d)[n / 2], uint64_t a, uint64_t b) {                      \
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {                                                        \
      asm volatile(PLOW_WG_SS("m64n" #n "k16", "bf16", regs, a_op, b_op) : out : "l"(a), "l"(b));            \
    } else {                                                                                                 \
      asm volatile(PLOW_WG_SS("m64n" #n "k16", "f16", regs, a_op, b_op) : out : "l"(a), "l"(b));             \
    }                                                                                                        \
  }
PLOW_WG_SS_FN(64, PLOW_WG_REGS32, PLOW_WG_OUT32, "32", "33")
PLOW_WG_SS_FN(128, PLOW_WG_REGS64, PLOW_WG_OUT64, "64", "65")
#undef PLOW_WG_SS_FN

// RS, N = 64 and N = 128: A the four registers of the warp's fragment. N = 64 takes kAccumulate:
// false writes d = A·B (scale-d 0: d's old values are not read, no zeroing before the first k step).
template <typename T, bool kAccumulate = true>
__device__ __forceinline__ void wg_mma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PLOW_WG_REGS32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : PLOW_WG_OUT32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kAccumulate ? 1 : 0));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " PLOW_WG_REGS32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : PLOW_WG_OUT32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kAccumulate ? 1 : 0));
  }
}
template <typename T>
__device__ __forceinline__ void wg_mma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PLOW_WG_REGS64 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
        : PLOW_WG_OUT64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  } else {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " PLOW_WG_REGS64 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
        : PLOW_WG_OUT64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
}

}  // namespace plow::cuda
