// Helpers shared by the CUDA op bodies (ops/*.cuh): warp reductions, a row-reduction scheduler, dense
// weight loads and the per-sequence view of a step. Everything here is block-uniform where it says so:
// a helper that synchronizes must be called by all kThreads threads of the block.
#pragma once

#include "runtime/cuda/device.cuh"

namespace plow::cuda {

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) / 32; }
__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) % 32; }

// 1 / √(sum/n + ε), written exactly as the CPU reference (norm.cpp) writes it: IEEE sqrt and division.
__device__ __forceinline__ float inv_rms(float sum_sq, int64_t n, float eps) { return 1.0f / sqrtf(sum_sq / static_cast<float>(n) + eps); }

// Element i (row-major flat index) of part 0 of a dense weight (f32, bf16, f16): norm weights, conv
// taps, A_log, dt_bias, kv_b and the router matrix. None of them is MXFP4 (only routed experts are);
// an MXFP4 weight here reads as NaN so the mistake shows in every output.
__device__ __forceinline__ float weight_flat(const DeviceWeight& w, int64_t i) {
  switch (w.type) {
    case kWBF16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(w.data)[i]);
    case kWF16: return __half2float(reinterpret_cast<const __half*>(w.data)[i]);
    case kWF32: return reinterpret_cast<const float*>(w.data)[i];
    default: return __int_as_float(0x7fc00000);
  }
}

// One reduction per row over rows first_row, first_row + row_stride, … below `rows`. partial(t, first,
// stride) returns this thread's share of row t's sum (elements first, first+stride, …); emit(t, total,
// first, stride) uses the row total with the same element split. Few rows (`rows` < 8): the whole block
// reduces one row at a time; many rows: one warp per row — the split depends on `rows` only, so a row's
// sum is the same whichever task reduces it. Block-uniform; ends with __syncthreads so `red` (32 floats
// of shared memory) and whatever emit wrote may be reused at once.
template <typename Partial, typename Emit>
__device__ __forceinline__ void for_each_row_sum(int rows, float* red, Partial partial, Emit emit, int first_row = 0, int row_stride = 1) {
  if (rows < 8) {
    for (int t = first_row; t < rows; t += row_stride) {
      const float total = block_sum(partial(t, static_cast<int>(threadIdx.x), kThreads), red);
      emit(t, total, static_cast<int>(threadIdx.x), kThreads);
    }
  } else {
    for (int t = first_row + warp_id() * row_stride; t < rows; t += kWarps * row_stride) {
      const float total = warp_sum(partial(t, lane_id(), 32));
      emit(t, total, lane_id(), 32);
    }
  }
  __syncthreads();
}

// What a task of a row-reduction op (rms_norm, add_norm: a whole input row reduced per output row;
// gated_rms_norm: a head of a row) writes. Few rows (decode): every row, the task's column slice, each
// task reducing every row. Many rows (≥ 8 and ≥ 2 per task; the same form for every task of the step):
// rows task, task + tasks, … of all the op's columns, so each row is read and reduced once instead of
// once per task (132× at 1024 rows × 2304 on 132 workers), and gated_rms_norm's tasks past its heads
// get rows too — legal because consumers and the op's overwriters wait for all of its tasks. Both
// forms reduce a row with for_each_row_sum's split for the step's rows (a head: with one warp), so the
// results are bit-identical.
struct RowShare {
  int first_row, row_stride;
  int64_t col_begin, col_end;
};
__device__ __forceinline__ RowShare row_share(const TaskCtx& ctx) {
  const int rows = ctx.rows(), tasks = ctx.op->tasks;
  if (rows >= 8 && rows >= 2 * tasks) return {ctx.task, tasks, 0, ctx.op->width};
  return {0, 1, ctx.col_begin, ctx.col_end};
}

// Calls fn(t, c) for every row t < rows and column c of [col_begin, col_begin + n): element t·n + (c −
// col_begin) on thread (that index) mod kThreads, as a flat loop would, but the row and column advance
// by constant steps instead of a 64-bit division and remainder per element (about 70 instructions each,
// more than an elementwise op's own work).
template <typename Fn>
__device__ __forceinline__ void for_each_row_col(int rows, int64_t col_begin, int n, Fn fn) {
  if (n <= 0) return;
  const int dt = kThreads / n, dc = kThreads % n;
  int c = static_cast<int>(threadIdx.x) % n;
  for (int t = static_cast<int>(threadIdx.x) / n; t < rows; t += dt) {
    fn(t, col_begin + c);
    c += dc;
    if (c >= n) {
      c -= n;
      ++t;
    }
  }
}

// Calls fn(t, c) for every row t of the step and every column c of the task's slice.
template <typename Fn>
__device__ __forceinline__ void for_each_slice_element(const TaskCtx& ctx, Fn fn) {
  for_each_row_col(ctx.rows(), ctx.col_begin, static_cast<int>(ctx.col_end - ctx.col_begin), fn);
}

// The slot's buffer of a stateful op's state (fp32).
__device__ __forceinline__ float* state_of(const TaskCtx& ctx, int slot) {
  const DeviceState& state = ctx.step->states[ctx.op->state];
  return state.base + static_cast<int64_t>(slot) * state.slot_floats;
}

__device__ __forceinline__ float* smem_floats(const TaskCtx& ctx) { return reinterpret_cast<float*>(ctx.smem); }

// Hand-offs between the tasks of one op that cooperate through OpDesc::sync (mla.cuh, kda_chunked.cuh).
// take_ticket draws the block's next work item from `counter` (through the first word of shared memory);
// block_arrive counts the calling block's finished work item; block_wait returns once `count` items are
// counted; op_leave counts the task out on `leavers`, and the last task of the op to leave resets all
// the op's counters to 0 (every task has taken its last ticket by then), so they need no epoch and no
// host reset. Block-uniform.
__device__ __forceinline__ int take_ticket(const TaskCtx& ctx, unsigned* counter) {
  int* const slot = reinterpret_cast<int*>(ctx.smem);
  if (threadIdx.x == 0) *slot = static_cast<int>(atomicAdd(counter, 1u));
  __syncthreads();
  const int ticket = *slot;
  __syncthreads();  // every thread has the ticket before thread 0 takes the next
  return ticket;
}
__device__ __forceinline__ void block_arrive(unsigned* counter) {
  __syncthreads();  // the item's writes are done
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}
__device__ __forceinline__ void block_wait(const unsigned* counter, int count) {
  if (threadIdx.x == 0) {
    while (*reinterpret_cast<const volatile unsigned*>(counter) < static_cast<unsigned>(count)) {
    }
    __threadfence();
  }
  __syncthreads();
}
__device__ __forceinline__ void op_leave(const TaskCtx& ctx, unsigned* leavers) {
  if (threadIdx.x == 0) {
    __threadfence();  // this task's last ticket is taken before it counts itself out
    if (atomicAdd(leavers, 1u) == static_cast<unsigned>(ctx.op->tasks - 1)) {
      __threadfence();
      for (int i = 0; i < kOpSyncCounters; ++i) atomicExch(ctx.op->sync + i, 0u);
      __threadfence();
    }
  }
}

// Asynchronous 16-byte copies from global to shared memory (sm_80+ cp.async, L2 only: data other blocks
// wrote during the launch is never read from a stale L1 line). cp_async_wait<N> waits until at most N of
// this thread's committed groups are in flight; a __syncthreads after it makes every thread's copies
// visible. Emulator builds copy at once.
__device__ __forceinline__ void cp_async16(float* smem, const float* global) {
#ifndef PLOW_CUDA_EMU
  const auto dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global) : "memory");
#else
  for (int i = 0; i < 4; ++i) smem[i] = global[i];
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifndef PLOW_CUDA_EMU
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef PLOW_CUDA_EMU
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

}  // namespace plow::cuda
