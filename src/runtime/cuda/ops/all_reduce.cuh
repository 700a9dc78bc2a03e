// kAllReduce (whole: one task): out = act(Σ over ranks of the fp32 partial sums x), the sum in rank
// order (cpu: ops/collective.cpp). Two ways, chosen by the host per step:
// - NCCL (step->peers null): the host enqueued ncclAllReduce into `out` before this task; the task
//   rounds it.
// - In the kernel (peer_reduce.h): the task stores x into slot (parity, k, me) of every peer's area,
//   raises the peers' flags to the step's collective epoch, waits for its own flags, then sums.
// attrs: [0] k, the op's ordinal among the plan's all_reduces (set by the backend).
#pragma once

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/elementwise.cuh"

namespace plow::cuda {

inline constexpr unsigned long long kPeerTimeoutNs = 20ull * 1000 * 1000 * 1000;

#ifndef PLOW_CUDA_EMU
__device__ __forceinline__ void store_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned load_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#else  // the host emulation (tests/gpu/emu): one OS thread, no peers
inline void store_release_sys(unsigned* p, unsigned v) { *p = v; }
inline unsigned load_acquire_sys(const unsigned* p) { return *p; }
inline unsigned long long global_ns() { return 0; }
#endif

__device__ __noinline__ void op_all_reduce(const TaskCtx& ctx) {
  const PeerTable* pt = ctx.step->peers;
  if (pt == nullptr) {
    op_all_reduce_round(ctx);
    return;
  }
  const int k = static_cast<int>(ctx.attr(0));
  const int me = pt->rank, size = pt->size;
  const unsigned epoch = ctx.step->coll_epoch;
  const int parity = static_cast<int>(epoch & 1u);
  const int64_t rows = ctx.rows(), width = ctx.op->width, n = rows * width;
  if (k < 0 || k >= pt->ops || n > pt->slot_floats) {  // the host sized the slots: a bug, not bad input
    if (threadIdx.x == 0) report_error(ctx, kErrPeerSlot);
    return;
  }
  const int64_t cell = (static_cast<int64_t>(parity) * pt->ops + k) * size;  // first (parity, k, ·) index
  const float* x = ctx.in(0, 0);
  const int64_t stride = ctx.op->in_stride[0];
  // Vector stores when rows and the input's start are 16-byte aligned (slots are).
  const bool vec = width % 4 == 0 && stride % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;

  // 1. Push this rank's partials into every peer's slot (parity, k, me).
  for (int q = 0; q < size; ++q) {
    if (q == me) continue;
    float* dst = pt->slots[q] + (cell + me) * pt->slot_floats;
    if (vec) {
      const int64_t per_row = width / 4;
      for (int64_t i = threadIdx.x; i < rows * per_row; i += kThreads) {
        const int64_t t = i / per_row, c = i % per_row;
        reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(x + t * stride)[c];
      }
    } else {
      for (int64_t i = threadIdx.x; i < n; i += kThreads) dst[i] = x[(i / width) * stride + i % width];
    }
  }
  __syncthreads();  // every thread's stores happen before the flag's release (cumulativity)
  const int q = static_cast<int>(threadIdx.x);
  if (q < size && q != me) {
    __threadfence_system();
    store_release_sys(pt->flags[q] + cell + me, epoch);
  }
  // 2. Wait for every peer's partials in this rank's slots (parity, k, q).
  if (q < size && q != me) {
    const unsigned* flag = pt->flags[me] + cell + q;
    const unsigned long long start = global_ns();
    while (static_cast<int>(load_acquire_sys(flag) - epoch) < 0) {
      // A step that has failed (this wait timed out before, or any other device error) waits no more:
      // the host reports the error after the launch.
      if (*static_cast<volatile int32_t*>(ctx.step->error) != 0) break;
      if (global_ns() - start > kPeerTimeoutNs) {
        report_error(ctx, kErrPeerTimeout);
        break;
      }
    }
  }
  __syncthreads();
  // 3. Σ in rank order (the same bits on every rank), rounded once. Peers' slots bypass L1 (__ldcg).
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int64_t t = i / width, c = i % width;
    const float own = x[t * stride + c];
    float sum = me == 0 ? own : __ldcg(pt->slots[me] + (cell + 0) * pt->slot_floats + i);
    for (int r = 1; r < size; ++r) sum += r == me ? own : __ldcg(pt->slots[me] + (cell + r) * pt->slot_floats + i);
    ctx.out(t)[c] = round_out(ctx, sum);
  }
}

}  // namespace plow::cuda
