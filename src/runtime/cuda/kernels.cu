// Device code of the cuda backend: the dispatch over op bodies, the persistent megakernel (one block
// per SM walking its queue with epoch counters), the eager kernel (one block per task of one op),
// argmax and the random weight fill.
#include "runtime/cuda/kernels.h"

#include <mutex>
#include <new>
#include <set>

#include "graph/op_table.h"
#include "runtime/cuda/device.cuh"
#include "runtime/cuda/mbarrier.cuh"
#include "runtime/cuda/ops/gemv.cuh"
#include "runtime/cuda/ops/misc_ops.cuh"
#include "runtime/cuda/ops/round_rows.cuh"

namespace plow::cuda {

namespace {

// The op bodies this backend has. kTokens has no tasks (the host writes the token ids). kCap: the
// most token rows a GEMV pass serves (gemv_task): 1 in the kernels of one-row plans.
template <int kCap>
__device__ void run_task(const TaskCtx& ctx, int32_t opcode) {
  if (opcode == kOpRoundRows) {
    op_round_rows(ctx);
    return;
  }
  if (opcode == kOpHostDone) return;
  if (!run_gemv_op<kCap>(ctx, opcode) && !run_misc_op(ctx) && threadIdx.x == 0) report_error(ctx, kErrOpcode);
}

constexpr bool host_has_op(Op op) {
  // kSlice: a view, its readers read its source in place, and validate_plan gives it no tasks
  return op == Op::kTokens || op == Op::kSlice || is_gemv_op(static_cast<uint8_t>(op)) || is_misc_op(static_cast<uint8_t>(op));
}

__device__ __forceinline__ uint32_t load_acquire(const unsigned* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(unsigned* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The megakernel keeps two task slots in shared memory past the op bodies' kSharedBytes: a task's
// Instr and its op's descriptor record (kernels.h). While task k runs, the copy engine loads task k+1's
// into the other slot (one bulk copy each, an mbarrier per slot), so between two tasks the block waits
// only for the counter. Read from global memory, the chain instruction → descriptor → arrays → row
// waited an L2 latency a link, task after task: every counter acquire invalidates the SM's L1 (the
// megakernel's SASS has its CCTL.IVALL). The eager kernel reads the descriptor in place: a copy there
// has no wait to hide behind (measured slower: 7.46 against 7.01 ms a batch-1 step).
struct TaskSlot {
  Instr ins;
  alignas(16) unsigned char desc[kDescBytes];
  alignas(16) unsigned char ctx[sizeof(TaskCtx)];  // the task's TaskCtx (thread 0 builds it; see task_ctx)
};
constexpr int kSlotBytes = kSharedBytes + 2 * static_cast<int>(sizeof(TaskSlot));
constexpr int kLaunchSharedBytes = kSlotBytes + 2 * static_cast<int>(sizeof(uint64_t));
static_assert(kSharedBytes % 16 == 0 && sizeof(TaskSlot) % 16 == 0, "bulk copies land on 16-byte boundaries");
static_assert(sizeof(OpDesc) % 8 == 0 && sizeof(DeviceWeight) % 8 == 0, "the arrays after the OpDesc stay 8-byte aligned");
static_assert(kDescHeadBytes <= kDescBytes, "an OpDesc fits its record");
static_assert(kInlineSignals == 2, "the releasing thread keeps two inline counters");

__device__ __forceinline__ uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// The TaskCtx the bodies read, one per block in shared memory: built by thread 0 in `mem` before the
// barrier that starts the task. Each thread building its own copy put it on the thread's stack (the
// bodies take it by reference): nine 8-byte local stores a thread at every task, and every field read
// through local memory (ncu: the kernel-entry stores among the top stalls of a small op, and local
// memory 62% of kda_delta_rule's L1 requests).
__device__ __forceinline__ const TaskCtx& build_task_ctx(unsigned char* mem, const TaskCtx& ctx) { return *new (mem) TaskCtx(ctx); }
__device__ __forceinline__ const TaskCtx& task_ctx(const unsigned char* mem) { return *reinterpret_cast<const TaskCtx*>(mem); }

// Task `ins` (global) and its op's record `desc` of `bytes` into `slot`; `bar` completes when both landed.
__device__ __forceinline__ void load_task(TaskSlot* slot, uint64_t* bar, const Instr* ins, const unsigned char* desc, uint32_t bytes) {
  const uint32_t b = shared_address(bar);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot's last generic-proxy writes (point_at_arrays) before the copy's
  mbar_expect_tx(b, static_cast<uint32_t>(sizeof(Instr)) + bytes);
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(shared_address(&slot->ins)), "l"(ins),
               "r"(static_cast<uint32_t>(sizeof(Instr))), "r"(b)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(shared_address(slot->desc)), "l"(desc),
               "r"(bytes), "r"(b)
               : "memory");
}

// A record longer than kDescHeadBytes carries the OpDesc's arrays: point it at them.
__device__ __forceinline__ void point_at_arrays(TaskSlot* slot) {
  if (slot->ins.desc_bytes <= kDescHeadBytes) return;
  auto* d = reinterpret_cast<OpDesc*>(slot->desc);
  auto* in = reinterpret_cast<int64_t*>(slot->desc + sizeof(OpDesc));
  d->in_offset = in;
  d->in_width = in + d->num_inputs;
  d->in_stride = in + 2 * d->num_inputs;
  d->weights = reinterpret_cast<const DeviceWeight*>(in + 3 * d->num_inputs);
}

// The global timer and the block's clock64 read together just after the timer ticks (the timer's
// resolution may be coarse; its tick is a common instant for every SM): out {globaltimer, clock64}.
__device__ __noinline__ void clock_at_tick(unsigned long long* out) {
  unsigned long long g0, g1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
  } while (g1 == g0);
  const long long c = clock64();
  out[0] = g1;
  out[1] = static_cast<unsigned long long>(c);
}

template <int kCap>
__global__ void __launch_bounds__(kThreads, 1) megakernel(const __grid_constant__ KernelParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int worker = blockIdx.x;
  const int32_t begin = p.queue_begin[worker], end = p.queue_begin[worker + 1];
  float* scratch = p.scratch + static_cast<int64_t>(worker) * kScratchFloats;
  auto* slots = reinterpret_cast<TaskSlot*>(smem + kSharedBytes);
  auto* bars = reinterpret_cast<uint64_t*>(smem + kSlotBytes);
  const long long started = clock64();
  unsigned long long wait_cycles = 0, run_cycles = 0;
  long long task_wait = 0;
  unsigned long long* const trace = p.trace;
  unsigned long long* const trace_clock = trace != nullptr ? trace + kTraceFields * p.queue_begin[gridDim.x] + kTraceClockFields * worker : nullptr;
  if (threadIdx.x == 0 && trace != nullptr) clock_at_tick(trace_clock);
  if (threadIdx.x == 0 && begin < end) {
    for (int b = 0; b < 2; ++b) mbar_init(shared_address(bars + b), 1);
    mbar_init_fence();
    const Instr& first = p.instrs[begin];
    load_task(slots, bars, &first, p.descs + first.desc, first.desc_bytes);
  }
  for (int32_t i = begin; i < end; ++i) {
    const int32_t k = i - begin;
    TaskSlot* slot = slots + (k & 1);
    if (threadIdx.x == 0) {
      const long long t0 = clock64();
      mbar_wait(shared_address(bars + (k & 1)), static_cast<uint32_t>(k >> 1) & 1u);  // loaded while the task before ran
      point_at_arrays(slot);
      const Instr& ins = slot->ins;
      // The other slot's task finished before the barrier that ended it: load the next one there.
      if (i + 1 < end) load_task(slots + ((k + 1) & 1), bars + ((k + 1) & 1), p.instrs + i + 1, p.descs + ins.next_desc, ins.next_desc_bytes);
      build_task_ctx(slot->ctx, TaskCtx{reinterpret_cast<const OpDesc*>(slot->desc), p.arena, &p.step, ins.col_begin, ins.col_end, smem, scratch, ins.task});
      const uint32_t target = ins.wait_threshold * p.epoch;
      if (target != 0) {
        while (load_acquire(p.counters + ins.wait_counter) < target) {
        }
      }
      // No fence: the acquire load orders this thread's later accesses, and the barrier below extends
      // that to the block (the pattern of CUTLASS's GenericBarrier).
      task_wait = clock64() - t0;
      wait_cycles += static_cast<unsigned long long>(task_wait);
      if (trace != nullptr) {
        trace[kTraceFields * i] = static_cast<unsigned long long>(t0);
        trace[kTraceFields * i + 1] = static_cast<unsigned long long>(t0 + task_wait);
      }
    }
    __syncthreads();
    const long long r0 = clock64();
    const Instr& ins = slot->ins;
    run_task<kCap>(task_ctx(slot->ctx), ins.opcode);
    // The releasing thread reads its counters before the barrier: after it, thread 0 loads the task
    // after next into this slot.
    const int32_t signals = ins.num_signals, first_signal = ins.signal_begin, inline0 = ins.signal[0], inline1 = ins.signal[1];
    const int32_t opcode = ins.opcode;
    __syncthreads();
    if (threadIdx.x == 32) {
      // Not thread 0, which goes on to the next task's wait. The block's writes happen before this
      // release through the barrier above (release is cumulative), so a consumer that acquires the
      // counter sees them.
      for (int32_t s = 0; s < signals; ++s) {
        const int32_t counter = signals > kInlineSignals ? p.signals[first_signal + s] : s == 0 ? inline0 : inline1;
        add_release(p.counters + counter, 1u);
      }
    }
    if (threadIdx.x == 0) {
      const long long ran = clock64() - r0;
      run_cycles += static_cast<unsigned long long>(ran);
      if (trace != nullptr) {
        trace[kTraceFields * i + 2] = static_cast<unsigned long long>(r0);
        trace[kTraceFields * i + 3] = static_cast<unsigned long long>(r0 + ran);
      }
      if (p.op_profile != nullptr) {
        unsigned long long* out = p.op_profile + 3 * profile_slot(opcode);
        atomicAdd(out, static_cast<unsigned long long>(task_wait));
        atomicAdd(out + 1, static_cast<unsigned long long>(ran));
        atomicAdd(out + 2, 1ull);
      }
    }
  }
  if (threadIdx.x == 0 && trace != nullptr) clock_at_tick(trace_clock + 2);
  if (threadIdx.x == 0 && p.profile != nullptr) {
    unsigned long long* out = p.profile + 4 * worker;
    out[0] += wait_cycles;
    out[1] += run_cycles;
    out[2] += static_cast<unsigned long long>(end - begin);
    out[3] += static_cast<unsigned long long>(clock64() - started);
  }
}

template <int kCap>
__global__ void __launch_bounds__(kThreads, 1) eager_kernel(const __grid_constant__ KernelParams p, int32_t first) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ alignas(16) unsigned char ctx_mem[sizeof(TaskCtx)];  // as the megakernel's (build_task_ctx)
  const Instr& ins = p.instrs[first + blockIdx.x];
  if (threadIdx.x == 0) {
    float* scratch = p.scratch + static_cast<int64_t>(blockIdx.x) * kScratchFloats;
    build_task_ctx(ctx_mem, TaskCtx{p.ops + ins.op, p.arena, &p.step, ins.col_begin, ins.col_end, smem, scratch, ins.task});
  }
  __syncthreads();
  run_task<kCap>(task_ctx(ctx_mem), ins.opcode);
}

// cand set: write (value, vocab_offset + id) pairs instead of ids / token_out (tensor parallelism).
__global__ void argmax_kernel(const float* logits, int64_t vocab, const int32_t* first_row, const int32_t* tokens, int32_t* ids, float* token_out,
                              float* cand, int64_t vocab_offset) {
  __shared__ float best_v[kWarps];
  __shared__ int64_t best_i[kWarps];
  const int s = blockIdx.x;
  const float* row = logits + (first_row != nullptr ? static_cast<int64_t>(first_row[s]) + tokens[s] - 1 : s) * vocab;
  float v = -INFINITY;
  int64_t idx = vocab;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float x = row[i];
    if (x > v || (x == v && i < idx) || (idx == vocab && !(x == x))) {  // NaN never wins over numbers
      if (x == x || idx == vocab) {
        v = x;
        idx = i;
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) {
      v = ov;
      idx = oi;
    }
  }
  if (threadIdx.x % 32 == 0) {
    best_v[threadIdx.x / 32] = v;
    best_i[threadIdx.x / 32] = idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
      if (best_v[w] > v || (best_v[w] == v && best_i[w] < idx)) {
        v = best_v[w];
        idx = best_i[w];
      }
    }
    if (idx >= vocab) idx = 0;
    if (cand != nullptr) {
      cand[2 * s] = v;
      cand[2 * s + 1] = __int_as_float(static_cast<int32_t>(vocab_offset + idx));
      return;
    }
    ids[s] = static_cast<int32_t>(idx);
    if (token_out != nullptr) token_out[s] = static_cast<float>(idx);
  }
}

__global__ void fold_argmax_kernel(const float* cands, int ranks, int num_seqs, int32_t* ids, float* token_out) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= num_seqs) return;
  float v = cands[2 * s];
  int32_t idx = __float_as_int(cands[2 * s + 1]);
  for (int r = 1; r < ranks; ++r) {
    const float* c = cands + 2 * (static_cast<int64_t>(r) * num_seqs + s);
    const int32_t i = __float_as_int(c[1]);
    if (c[0] > v || (c[0] == v && i < idx) || (!(v == v) && c[0] == c[0])) {  // NaN never wins over numbers
      v = c[0];
      idx = i;
    }
  }
  ids[s] = idx;
  if (token_out != nullptr) token_out[s] = static_cast<float>(idx);
}

// graph/random_weights.cpp's generator, on the device.
__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__device__ __forceinline__ float unit(uint64_t seed, uint64_t tensor, uint64_t i) {
  return static_cast<float>(mix64(seed ^ mix64(tensor * 0x100000001B3ull + i)) >> 40) * 0x1.0p-24f;
}
__device__ __forceinline__ float centered(uint64_t seed, uint64_t tensor, uint64_t i, float std) {
  return (2.0f * unit(seed, tensor, i) - 1.0f) * 1.7320508f * std;
}

__global__ void fill_kernel(uint8_t* data, int64_t count, int32_t type, FillKind kind, uint64_t seed, uint64_t tensor, float fan_in, int32_t scale_base) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const auto u = static_cast<uint64_t>(i);
    if (kind == FillKind::kMxfp4Codes) {
      data[i] = static_cast<uint8_t>(mix64(seed ^ mix64(tensor * 7919 + u)));
      continue;
    }
    if (kind == FillKind::kMxfp4Scales) {
      data[i] = static_cast<uint8_t>(scale_base - 1 + static_cast<int>(unit(seed, tensor + 1, u) * 3.0f));
      continue;
    }
    float v;
    switch (kind) {
      case FillKind::kZero: v = 0.0f; break;
      case FillKind::kALog: v = logf(1.0f + 15.0f * unit(seed, tensor, u)); break;
      case FillKind::kNorm: v = 1.0f + centered(seed, tensor, u, 0.1f); break;
      case FillKind::kEmbedding: v = centered(seed, tensor, u, 1.0f); break;
      case FillKind::kResProj:
      case FillKind::kRouter: v = centered(seed, tensor, u, 4.0f / sqrtf(fan_in)); break;
      default: v = centered(seed, tensor, u, 0.5f / sqrtf(fan_in)); break;
    }
    if (type == kWBF16) {
      reinterpret_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(v);
    } else if (type == kWF16) {
      reinterpret_cast<__half*>(data)[i] = __float2half_rn(v);
    } else {
      reinterpret_cast<float*>(data)[i] = v;
    }
  }
}

__global__ void __launch_bounds__(512) read_probe_kernel(const uint4* data, int64_t count, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = load_stream(reinterpret_cast<const uint8_t*>(data + i + u * stride));
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < count; i += stride) {
    const uint4 v = load_stream(reinterpret_cast<const uint8_t*>(data + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[threadIdx.x % 1024] = acc;  // keeps the loads alive
}

void check_launch(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_failure(what, error);
}

}  // namespace

bool device_has_op(int opcode) { return opcode >= 0 && opcode < static_cast<int>(Op::kCount) && host_has_op(static_cast<Op>(opcode)); }

void configure_kernels() {
  // The limit is a property of the kernel on one device: once per device (tensor-parallel ranks of one
  // process use several).
  static std::mutex mutex;
  static std::set<int> done;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) cuda_failure("querying the current device", cudaGetLastError());
  const std::lock_guard lock(mutex);
  if (done.count(device)) return;
  for (const void* kernel : {reinterpret_cast<const void*>(megakernel<1>), reinterpret_cast<const void*>(megakernel<kMaxGroup>),
                             reinterpret_cast<const void*>(eager_kernel<1>), reinterpret_cast<const void*>(eager_kernel<kMaxGroup>)}) {
    const cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kLaunchSharedBytes);
    if (error != cudaSuccess) cuda_failure("raising the kernels' shared memory limit", error);
  }
  done.insert(device);
}

void launch_megakernel(const KernelParams& params, int workers, int64_t max_rows, cudaStream_t stream) {
  if (max_rows == 1) {
    megakernel<1><<<workers, kThreads, kLaunchSharedBytes, stream>>>(params);
  } else {
    megakernel<kMaxGroup><<<workers, kThreads, kLaunchSharedBytes, stream>>>(params);
  }
  check_launch("the megakernel");
}

void launch_eager(const KernelParams& params, int first_instr, int count, int64_t max_rows, cudaStream_t stream) {
  if (max_rows == 1) {
    eager_kernel<1><<<count, kThreads, kSharedBytes, stream>>>(params, first_instr);
  } else {
    eager_kernel<kMaxGroup><<<count, kThreads, kSharedBytes, stream>>>(params, first_instr);
  }
  check_launch("an eager op");
}

void launch_argmax(const float* logits, int64_t vocab, const int32_t* first_row, const int32_t* tokens, int num_seqs, int32_t* ids,
                   float* token_out, cudaStream_t stream) {
  argmax_kernel<<<num_seqs, 256, 0, stream>>>(logits, vocab, first_row, tokens, ids, token_out, nullptr, 0);
  check_launch("argmax");
}

void launch_argmax_candidates(const float* logits, int64_t vocab, int64_t vocab_offset, const int32_t* first_row, const int32_t* tokens,
                              int num_seqs, float* cand, cudaStream_t stream) {
  argmax_kernel<<<num_seqs, 256, 0, stream>>>(logits, vocab, first_row, tokens, nullptr, nullptr, cand, vocab_offset);
  check_launch("argmax candidates");
}

void launch_fold_argmax(const float* cands, int ranks, int num_seqs, int32_t* ids, float* token_out, cudaStream_t stream) {
  fold_argmax_kernel<<<(num_seqs + 127) / 128, 128, 0, stream>>>(cands, ranks, num_seqs, ids, token_out);
  check_launch("argmax fold");
}

void launch_read_probe(const uint8_t* data, int64_t bytes, uint32_t* sink, int sms, cudaStream_t stream) {
  read_probe_kernel<<<sms * 4, 512, 0, stream>>>(reinterpret_cast<const uint4*>(data), bytes / 16, sink);
  check_launch("the bandwidth probe");
}

void launch_fill(uint8_t* data, int64_t count, int32_t type, FillKind kind, uint64_t seed, uint64_t tensor, float fan_in, int32_t scale_base,
                 cudaStream_t stream) {
  if (count == 0) return;
  const int64_t blocks = std::min<int64_t>((count + 255) / 256, 132 * 32);
  fill_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(data, count, type, kind, seed, tensor, fan_in, scale_base);
  check_launch("the random weight fill");
}

}  // namespace plow::cuda
