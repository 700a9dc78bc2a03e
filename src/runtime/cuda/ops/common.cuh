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

// Whether a task of a row-parallel op (the norms, the elementwise ops, the embedding) takes whole rows
// instead of its column slice of every row: steps of ≥ 8 rows and ≥ 2 rows a task, the same form for
// every task of the step. Legal whatever the plan's slices say, because consumers and the op's
// overwriters wait for all of its tasks.
__device__ __forceinline__ bool shares_rows(const TaskCtx& ctx) {
  const int rows = ctx.rows();
  return rows >= 8 && rows >= 2 * ctx.op->tasks;
}

// What a task of a row-reduction op (rms_norm, add_norm: a whole input row reduced per output row;
// gated_rms_norm: a head of a row) writes. Few rows (decode): every row, the task's column slice, each
// task reducing every row. Many rows (shares_rows): rows task, task + tasks, … of all the op's
// columns, so each row is read and reduced once instead of once per task (132× at 1024 rows × 2304 on
// 132 workers), and gated_rms_norm's tasks past its heads get rows too. Both forms reduce a row with
// for_each_row_sum's split for the step's rows (a head: with one warp), so the results are
// bit-identical.
struct RowShare {
  int first_row, row_stride;
  int64_t col_begin, col_end;
};
__device__ __forceinline__ RowShare row_share(const TaskCtx& ctx) {
  if (shares_rows(ctx)) return {ctx.task, ctx.op->tasks, 0, ctx.op->width};
  return {0, 1, ctx.col_begin, ctx.col_end};
}

// Loads a thread has in flight in the loops below: each issues the loads of its next kLoadBatch
// elements before it uses them. A loop that loads, computes and stores one element at a time waits a
// DRAM latency per element (after the descriptor re-reads Rows avoids), because the compiler must
// assume the store may alias the next element's inputs: with one block of kThreads per SM that is 2 KiB
// in flight per input and SM, ~0.6 TB/s over 132 SMs (the 48B's 1,024-row add: ~45 µs for 28 MB).
// Eight elements give 16 KiB, about what covers the DRAM latency at the H200's bandwidth.
inline constexpr int kLoadBatch = 8;

// Two values a batched loop's load hands to its store (an element's operands).
struct Operands {
  float a, b;
};

// Calls store(t, c, load(t, c)) for every row t of [row_begin, row_end) and column c of [col_begin,
// col_begin + n): element i of that rectangle (row-major) on thread i mod kThreads, the row and column
// advanced by constant steps instead of a 64-bit division and remainder per element (about 70
// instructions each, more than an elementwise op's own work). load returns the element's operands (any
// type); a thread's loads of kLoadBatch elements come before their stores.
template <typename Load, typename Store>
__device__ __forceinline__ void for_each_element(int row_begin, int row_end, int64_t col_begin, int n, Load load, Store store) {
  if (n <= 0) return;
  const int dt = kThreads / n, dc = kThreads % n;
  int t = row_begin + static_cast<int>(threadIdx.x) / n, c = static_cast<int>(threadIdx.x) % n;
  while (t < row_end) {
    int ts[kLoadBatch], cs[kLoadBatch];
    decltype(load(t, col_begin)) v[kLoadBatch] = {};
#pragma unroll
    for (int k = 0; k < kLoadBatch; ++k) {
      ts[k] = t;
      cs[k] = c;
      if (t < row_end) v[k] = load(t, col_begin + c);
      t += dt;
      c += dc;
      if (c >= n) {
        c -= n;
        ++t;
      }
    }
#pragma unroll
    for (int k = 0; k < kLoadBatch; ++k) {
      if (ts[k] < row_end) store(ts[k], col_begin + cs[k], v[k]);
    }
  }
}

// Calls fn(t, c) for every row t < rows and column c of [col_begin, col_begin + n), element by element
// in for_each_element's order (for bodies whose elements read what they load once, from L1).
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

// What a task of an elementwise op (or the embedding) writes: its column slice of every row, or in
// steps of many rows (shares_rows) a contiguous range of whole rows: a 17-column slice of a 2304-wide
// row (132 workers) is 68 bytes a row, three 32-byte sectors fetched for two used, in 1024 short
// pieces; whole rows stream one contiguous block per task.
struct ElementShare {
  int row_begin, row_end;
  int64_t col_begin, col_end;
};
__device__ __forceinline__ ElementShare element_share(const TaskCtx& ctx) {
  const int rows = ctx.rows();
  if (!shares_rows(ctx)) return {0, rows, ctx.col_begin, ctx.col_end};
  const int64_t tasks = ctx.op->tasks;
  return {static_cast<int>(rows * ctx.task / tasks), static_cast<int>(rows * (ctx.task + 1) / tasks), 0, ctx.op->width};
}

// for_each_element over the task's element_share.
template <typename Load, typename Store>
__device__ __forceinline__ void for_each_share_element(const TaskCtx& ctx, Load load, Store store) {
  const ElementShare s = element_share(ctx);
  for_each_element(s.row_begin, s.row_end, s.col_begin, static_cast<int>(s.col_end - s.col_begin), load, store);
}

// Whether a task's element_share can go four columns at a time (for_each_share_element4): whole rows
// (steps of many rows), a width of a multiple of 4, and the given row bases and strides (`rows`: the
// op's output and inputs) 16-byte aligned.
template <int N>
__device__ __forceinline__ bool share_in_fours(const TaskCtx& ctx, const ElementShare& s, const Rows<const float> (&rows)[N]) {
  if (s.col_begin != 0 || s.col_end != ctx.op->width || ctx.op->width % 4 != 0) return false;
  uintptr_t bits = 0;
  for (int i = 0; i < N; ++i) bits |= reinterpret_cast<uintptr_t>(rows[i].base) | static_cast<uintptr_t>(rows[i].stride * 4);
  return (bits & 15) == 0;
}

// for_each_element over the task's element_share, four columns at a time where share_in_fours holds
// (the loads and stores one 16-byte access each: an op over an 8K prompt's rows moved a quarter of
// its bytes an instruction, ~0.6 of the read roofline with kLoadBatch loads in flight), else one at a
// time. load4(t, c) / store4(t, c, v) take columns c..c+3, load(t, c) / store(t, c, v) one; both
// compute each element as the other does, so the values are the same.
template <int N, typename Load4, typename Store4, typename Load, typename Store>
__device__ __forceinline__ void for_each_share_element4(const TaskCtx& ctx, const Rows<const float> (&rows)[N], Load4 load4, Store4 store4, Load load,
                                                        Store store) {
  const ElementShare s = element_share(ctx);
  if (share_in_fours(ctx, s, rows)) {
    for_each_element(
        s.row_begin, s.row_end, 0, static_cast<int>(s.col_end / 4), [&](int t, int64_t c4) { return load4(t, 4 * c4); },
        [&](int t, int64_t c4, auto v) { store4(t, 4 * c4, v); });
    return;
  }
  for_each_element(s.row_begin, s.row_end, s.col_begin, static_cast<int>(s.col_end - s.col_begin), load, store);
}

__device__ __forceinline__ float4 load4f(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void store4f(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// Calls store(i, load(i)) for i = first, first + stride, … below end, kLoadBatch loads before their
// stores (for_each_element's reason).
template <typename Load, typename Store>
__device__ __forceinline__ void for_each_strided(int64_t first, int64_t end, int stride, Load load, Store store) {
  for (int64_t i = first; i < end; i += static_cast<int64_t>(kLoadBatch) * stride) {
    decltype(load(i)) v[kLoadBatch] = {};
#pragma unroll
    for (int k = 0; k < kLoadBatch; ++k) {
      if (i + k * stride < end) v[k] = load(i + k * stride);
    }
#pragma unroll
    for (int k = 0; k < kLoadBatch; ++k) {
      if (i + k * stride < end) store(i + k * stride, v[k]);
    }
  }
}

// add(…add(add(init, load(first)), load(first + stride))…) over i < end, in that order (the split a
// row reduction's results depend on), with kSumBatch loads in flight instead of one: twice kLoadBatch,
// because a warp reduces a whole row alone (2304 columns: 72 loads a lane) and a task of a long step
// has fewer rows (~8) than warps. The sum and the loaded values may be structs (several sums at once).
inline constexpr int kSumBatch = 2 * kLoadBatch;
template <typename Load, typename Add, typename Sum = float>
__device__ __forceinline__ Sum strided_sum(int64_t first, int64_t end, int stride, Load load, Add add, Sum init = Sum{}) {
  Sum sum = init;
  for (int64_t i = first; i < end; i += static_cast<int64_t>(kSumBatch) * stride) {
    decltype(load(i)) v[kSumBatch] = {};
#pragma unroll
    for (int k = 0; k < kSumBatch; ++k) {
      if (i + k * stride < end) v[k] = load(i + k * stride);
    }
#pragma unroll
    for (int k = 0; k < kSumBatch; ++k) {
      if (i + k * stride < end) sum = add(sum, v[k]);
    }
  }
  return sum;
}

// The slot's buffer of a stateful op's fp32 state (conv windows, KDA recurrent state).
__device__ __forceinline__ float* state_of(const TaskCtx& ctx, int slot) {
  const DeviceState& state = ctx.step->states[ctx.op->state];
  return static_cast<float*>(state.base) + static_cast<int64_t>(slot) * state.slot_elems;
}

// The slot's buffer of a state of any element type (the MLA latent cache), as bytes.
__device__ __forceinline__ uint8_t* state_bytes_of(const TaskCtx& ctx, int slot) {
  const DeviceState& state = ctx.step->states[ctx.op->state];
  return static_cast<uint8_t*>(state.base) + static_cast<int64_t>(slot) * state.slot_elems * state_elem_bytes(state.elem);
}

// Element i of a state buffer of element type `elem` as fp32, and its store (exact: what a state holds
// is already rounded to its type). 16-bit loads go through L2 (`ld.global.cg`) as the fp32 ones do.
__device__ __forceinline__ float load_state_elem(const uint8_t* base, int32_t elem, int64_t i) {
  if (elem == kAF32) return __ldcg(reinterpret_cast<const float*>(base) + i);
  const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(base) + i);
  return elem == kABF16 ? __uint_as_float(static_cast<unsigned>(bits) << 16) : __half2float(__ushort_as_half(bits));
}
__device__ __forceinline__ void store_state_elem(uint8_t* base, int32_t elem, int64_t i, float v) {
  if (elem == kAF32) {
    reinterpret_cast<float*>(base)[i] = v;
  } else if (elem == kABF16) {
    reinterpret_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  } else {
    reinterpret_cast<__half*>(base)[i] = __float2half_rn(v);
  }
}

// The block's dynamic shared memory, which TaskCtx::smem points at in both kernels (kernels.cu). Bodies
// reach it through this symbol rather than the pointer so that ptxas sees the state space: shared loads
// and stores (LDS/STS) instead of generic ones (LD/ST), which also may alias global memory. The host
// emulator has no such symbol and keeps the pointer.
#ifndef PLOW_CUDA_EMU
extern __shared__ __align__(16) unsigned char plow_dynamic_smem[];
__device__ __forceinline__ unsigned char* smem_bytes(const TaskCtx&) { return plow_dynamic_smem; }
#else
__device__ __forceinline__ unsigned char* smem_bytes(const TaskCtx& ctx) { return ctx.smem; }
#endif
__device__ __forceinline__ float* smem_floats(const TaskCtx& ctx) { return reinterpret_cast<float*>(smem_bytes(ctx)); }

// Hand-offs between the tasks of one op that cooperate through OpDesc::sync (mla.cuh, kda_chunked.cuh).
// take_ticket draws the block's next work item from `counter` (through the first word of shared memory);
// block_arrive counts the calling block's finished work item; block_wait returns once `count` items are
// counted; op_leave counts the task out on `leavers`, and the last task of the op to leave resets all
// the op's counters to 0 (every task has taken its last ticket by then), so they need no epoch and no
// host reset. Block-uniform.
__device__ __forceinline__ int take_ticket(const TaskCtx& ctx, unsigned* counter) {
  int* const slot = reinterpret_cast<int*>(smem_bytes(ctx));
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
// visible. Emulator builds defer each copy to the wait that covers it (emu_prelude.h emu_cp), so a
// missing wait reads stale shared memory there too.
__device__ __forceinline__ void cp_async16(float* smem, const float* global) {
#ifndef PLOW_CUDA_EMU
  const auto dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global) : "memory");
#else
  emu_cp_async(smem, global, 16);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifndef PLOW_CUDA_EMU
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  emu_cp_commit();
#endif
}
// The same copy, or 16 zero bytes into `smem` when !valid (`global` is then not read).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* global, bool valid) {
#ifndef PLOW_CUDA_EMU
  const auto dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global), "r"(valid ? 16 : 0) : "memory");
#else
  emu_cp_async(smem, global, valid ? 16 : 0);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef PLOW_CUDA_EMU
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#else
  emu_cp_wait(N);
#endif
}

}  // namespace plow::cuda
