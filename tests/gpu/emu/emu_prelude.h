// Host emulation of the CUDA features the op bodies use: 512 cooperative fibers per block on one OS
// thread (fewer for kernels of smaller blocks: run's `threads`, a multiple of 32; switched by
// plow_emu_switch on x86-64, by ucontext elsewhere); __syncthreads / __syncwarp are barriers the
// scheduler releases when every live fiber of the block / warp has arrived (a divergent barrier
// deadlocks and is reported). Test scaffolding only.
#pragma once
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include <ucontext.h>
#include "core/dtype.h"
#define PLOW_CUDA_EMU 1  // bodies with inline PTX take their host stand-ins
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __noinline__
struct __nv_bfloat16 { uint16_t bits; };
struct __half { uint16_t bits; };
inline float __bfloat162float(__nv_bfloat16 b) { return plow::bf16_to_f32(b.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return {plow::f32_to_bf16(v)}; }
inline float __half2float(__half h) { return plow::f16_to_f32(h.bits); }
inline __half __ushort_as_half(unsigned short bits) { return {bits}; }
inline __half __float2half_rn(float v) { return {plow::f32_to_f16(v)}; }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
struct EmuDim3 { unsigned x = 0, y = 0, z = 0; };
inline EmuDim3 threadIdx;  // set by the scheduler before resuming a fiber

#if defined(__x86_64__)
// A fiber switch without glibc's swapcontext, which makes a sigprocmask system call at every switch
// (~40% of an emulator run's time went to the kernel): push the callee-saved registers, save the
// stack pointer, load the other's, pop its registers and return into it.
extern "C" void plow_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .pushsection .text
  .weak plow_emu_switch
  .type plow_emu_switch, @function
plow_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size plow_emu_switch, .-plow_emu_switch
  .popsection
)");
#endif

struct EmuBlock {
  enum Wait { kRun, kBlock, kWarp, kNamed, kDone };
  static constexpr int kN = 512;
  static constexpr size_t kStack = 256 * 1024;
#if defined(__x86_64__)
  void* sched_sp = nullptr;
  void* sp[kN];  // a waiting fiber's saved stack pointer
#else
  ucontext_t sched;
  ucontext_t ctx[kN];
#endif
  Wait wait[kN];
  int named[kN];         // a fiber waiting at a named barrier (kNamed): its id
  int named_threads[16];  // the threads each named barrier waits for
  std::vector<char> stacks = std::vector<char>(kN * kStack);
  uint32_t xch[kN];
  int current = 0;
  int n = kN;  // fibers of the block being run
  // 0: every runnable fiber runs in each pass, in order; otherwise the seed of a random half each pass,
  // so warps and warpgroups drift apart as on the device (orderings a missing barrier would break).
  uint64_t schedule_seed = 0;
  // A warpgroup (threads 128·w …) whose fibers run only when no other fiber can: it falls behind the
  // others as far as the barriers let it (−1: none).
  int slow_group = -1;
  bool spun = false;  // the fiber just resumed only polled (a wait on an mbarrier): no progress
  std::function<void()> body;
  static void entry();
  void make(int i);    // fiber i, to start at entry()
  void resume(int i);  // the scheduler runs fiber i until it waits or ends
  void yield();        // the current fiber back to the scheduler
  void run(std::function<void()> fn, int threads = kN);
};
inline EmuBlock* emu_block = nullptr;
inline void EmuBlock::entry() {
  emu_block->body();
  emu_block->wait[emu_block->current] = kDone;
  emu_block->yield();  // never resumed
}
#if defined(__x86_64__)
inline void EmuBlock::make(int i) {
  // The frame plow_emu_switch pops: six registers, then entry() as the return address, and a slot
  // for entry's own return address, so its stack is aligned as after a call.
  void** frame = reinterpret_cast<void**>(stacks.data() + static_cast<size_t>(i + 1) * kStack) - 8;
  for (int r = 0; r < 6; ++r) frame[r] = nullptr;
  frame[6] = reinterpret_cast<void*>(&EmuBlock::entry);
  frame[7] = nullptr;
  sp[i] = frame;
}
inline void EmuBlock::resume(int i) { plow_emu_switch(&sched_sp, sp[i]); }
inline void EmuBlock::yield() { plow_emu_switch(&sp[current], sched_sp); }
#else
inline void EmuBlock::make(int i) {
  getcontext(&ctx[i]);
  ctx[i].uc_stack.ss_sp = stacks.data() + i * kStack;
  ctx[i].uc_stack.ss_size = kStack;
  ctx[i].uc_link = &sched;
  makecontext(&ctx[i], &EmuBlock::entry, 0);
}
inline void EmuBlock::resume(int i) { swapcontext(&sched, &ctx[i]); }
inline void EmuBlock::yield() { swapcontext(&ctx[current], &sched); }
#endif
inline void EmuBlock::run(std::function<void()> fn, int threads) {
  if (threads < 32 || threads > kN || threads % 32 != 0) { std::fprintf(stderr, "emu: a block of %d threads\n", threads); std::abort(); }
  body = std::move(fn);
  emu_block = this;
  n = threads;
  for (int i = 0; i < n; ++i) {
    make(i);
    wait[i] = kRun;
    named[i] = 0;
  }
  for (;;) {
    bool ran = false, skipped = false, progress = false;
    for (int i = 0; i < n; ++i) {
      if (wait[i] != kRun) continue;
      if (i / 128 == slow_group) { skipped = true; continue; }
      if (schedule_seed != 0) {  // each runnable fiber runs in a pass with probability 1/2 (xorshift)
        schedule_seed ^= schedule_seed << 13, schedule_seed ^= schedule_seed >> 7, schedule_seed ^= schedule_seed << 17;
        if ((schedule_seed & 1u) != 0) { skipped = true; continue; }
      }
      current = i;
      threadIdx.x = static_cast<unsigned>(i);
      spun = false;
      resume(i);
      ran = true;
      progress = progress || !spun;
    }
    if (!progress && slow_group >= 0) {  // nothing else moved: the slow warpgroup's turn
      for (int i = 0; i < n; ++i) {
        if (wait[i] != kRun || i / 128 != slow_group) continue;
        current = i;
        threadIdx.x = static_cast<unsigned>(i);
        resume(i);
        ran = true;
      }
    }
    int done = 0, at_block = 0;
    for (int i = 0; i < n; ++i) done += wait[i] == kDone, at_block += wait[i] == kBlock;
    if (done == n) return;
    bool released = false;
    if (at_block > 0 && at_block + done == n) {
      if (done > 0) { std::fprintf(stderr, "emu: __syncthreads with %d threads already exited\n", done); std::abort(); }
      for (int i = 0; i < n; ++i) wait[i] = kRun;
      released = true;
    }
    for (int w = 0; w < n / 32; ++w) {
      int at_warp = 0;
      for (int l = 0; l < 32; ++l) at_warp += wait[w * 32 + l] == kWarp;
      if (at_warp == 32) { for (int l = 0; l < 32; ++l) wait[w * 32 + l] = kRun; released = true; }
      else if (at_warp > 0) {
        int other = 0;
        for (int l = 0; l < 32; ++l) other += wait[w * 32 + l] != kWarp && wait[w * 32 + l] != kRun;
        if (other + at_warp == 32 && !ran) { std::fprintf(stderr, "emu: divergent warp barrier in warp %d\n", w); std::abort(); }
      }
    }
    int at_named[16] = {};
    for (int i = 0; i < n; ++i) at_named[named[i]] += wait[i] == kNamed;
    for (int id = 1; id < 16; ++id) {
      if (at_named[id] == 0 || at_named[id] < named_threads[id]) continue;
      for (int i = 0; i < n; ++i) {
        if (wait[i] == kNamed && named[i] == id) wait[i] = kRun;
      }
      released = true;
    }
    if (!ran && !released && !skipped) { std::fprintf(stderr, "emu: deadlock\n"); std::abort(); }
  }
}
inline void emu_wait(EmuBlock::Wait kind) {
  EmuBlock& b = *emu_block;
  const int me = b.current;
  b.wait[me] = kind;
  b.yield();
  threadIdx.x = static_cast<unsigned>(me);
}
inline void __syncthreads() { emu_wait(EmuBlock::kBlock); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_wait(EmuBlock::kWarp); }
// bar.sync id, threads: released when `threads` fibers wait at barrier id (1…15; 0 is __syncthreads').
inline void named_sync(int id, int threads) {
  if (id < 1 || id > 15 || threads % 32 != 0) std::abort();
  EmuBlock& b = *emu_block;
  b.named[b.current] = id;
  b.named_threads[id] = threads;
  emu_wait(EmuBlock::kNamed);
}
// Lane `src` of this warp's value v (every lane of the warp must call it).
template <typename T>
inline T emu_shuffle(T v, unsigned src) {
  static_assert(sizeof(T) == 4);
  const unsigned t = threadIdx.x, base = t - t % 32;
  emu_block->xch[t] = std::bit_cast<uint32_t>(v);
  __syncwarp();
  const uint32_t other = emu_block->xch[base + (src & 31u)];
  __syncwarp();
  return std::bit_cast<T>(other);
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int o) { return emu_shuffle(v, (threadIdx.x % 32) ^ static_cast<unsigned>(o)); }
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) { return emu_shuffle(v, static_cast<unsigned>(src)); }
// Whether pred holds on every lane of this warp (every lane must call it).
inline bool __all_sync(unsigned, bool pred) {
  const unsigned t = threadIdx.x, base = t - t % 32;
  emu_block->xch[t] = pred ? 1u : 0u;
  __syncwarp();
  bool all = true;
  for (unsigned l = 0; l < 32; ++l) all = all && emu_block->xch[base + l] != 0;
  __syncwarp();
  return all;
}
// The lanes of this warp whose pred holds, as a bit mask (every lane must call it).
inline unsigned __ballot_sync(unsigned, bool pred) {
  const unsigned t = threadIdx.x, base = t - t % 32;
  emu_block->xch[t] = pred ? 1u : 0u;
  __syncwarp();
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l) bits |= (emu_block->xch[base + l] != 0 ? 1u : 0u) << l;
  __syncwarp();
  return bits;
}
// The lanes of this warp whose v equals this lane's (every lane must call it).
inline unsigned __match_any_sync(unsigned, unsigned v) {
  const unsigned t = threadIdx.x, base = t - t % 32;
  emu_block->xch[t] = v;
  __syncwarp();
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l) bits |= (emu_block->xch[base + l] == v ? 1u : 0u) << l;
  __syncwarp();
  return bits;
}
// The sum of v over the lanes in mask (every lane of the warp must call it, each with its group's mask).
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  const unsigned t = threadIdx.x, base = t - t % 32;
  emu_block->xch[t] = v;
  __syncwarp();
  unsigned sum = 0;
  for (unsigned l = 0; l < 32; ++l) sum += (mask >> l & 1u) != 0 ? emu_block->xch[base + l] : 0u;
  __syncwarp();
  return sum;
}
// One OS thread runs every block: plain read-modify-writes are atomic, fences are no-ops.
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline unsigned atomicExch(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = v;
  return old;
}
inline void __threadfence() {}
inline void __threadfence_system() {}
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
struct uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline unsigned __float_as_uint(float v) { return std::bit_cast<unsigned>(v); }
inline float __uint_as_float(unsigned v) { return std::bit_cast<float>(v); }
inline int min(int a, int b) { return a < b ? a : b; }
inline float __expf(float x) { return std::exp(x); }  // the device's fast exp: the host's exact one here
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __ffs(int x) { return x == 0 ? 0 : std::countr_zero(static_cast<unsigned>(x)) + 1; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __ldcg(const float* p) { return *p; }
template <class T>
inline T __ldg(const T* p) { return *p; }
inline unsigned short __ldcg(const unsigned short* p) { return *p; }
// cp.async: each fiber's copies stay pending in their commit group until a wait covers them (as late as
// a device may land them), or land at issue with `eager` (as early); `src_bytes` < 16 zero-fills the
// rest. Blocks run one after another, so a block must wait for all its copies before it ends (the
// tests check `pending` is empty).
struct EmuCpAsync {
  struct Copy {
    void* dst;
    const void* src;
    int bytes, group;
  };
  std::vector<Copy> pending[EmuBlock::kN];
  int committed[EmuBlock::kN] = {};
  bool eager = false;
};
inline EmuCpAsync emu_cp;
inline void emu_cp_land(const EmuCpAsync::Copy& c) {
  std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
  std::memset(static_cast<char*>(c.dst) + c.bytes, 0, static_cast<size_t>(16 - c.bytes));
}
inline void emu_cp_async(void* dst, const void* src, int src_bytes) {
  if (src_bytes != 0 && src_bytes != 16) std::abort();
  // The device faults ("misaligned address") on a cp.async whose addresses are not 16-byte aligned.
  if (((reinterpret_cast<uintptr_t>(dst) | (src_bytes != 0 ? reinterpret_cast<uintptr_t>(src) : 0)) & 15) != 0) std::abort();
  const unsigned t = threadIdx.x;
  const EmuCpAsync::Copy c{dst, src, src_bytes, emu_cp.committed[t]};
  if (emu_cp.eager) {
    emu_cp_land(c);
  } else {
    emu_cp.pending[t].push_back(c);
  }
}
inline void emu_cp_commit() { emu_cp.committed[threadIdx.x] += 1; }
inline void emu_cp_wait(int keep) {  // all but this fiber's newest `keep` groups have landed
  std::vector<EmuCpAsync::Copy>& pending = emu_cp.pending[threadIdx.x];
  const int below = emu_cp.committed[threadIdx.x] - keep;
  std::vector<EmuCpAsync::Copy> later;
  for (const EmuCpAsync::Copy& c : pending) {
    if (c.group < below) {
      emu_cp_land(c);
    } else {
      later.push_back(c);
    }
  }
  pending = std::move(later);
}
inline float4 __ldcg(const float4* p) { return *p; }
inline int atomicCAS(int* p, int expected, int desired) {
  const int old = *p;
  if (old == expected) *p = desired;
  return old;
}
