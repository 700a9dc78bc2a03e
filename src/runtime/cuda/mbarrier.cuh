// Hopper's shared-memory mbarriers as the bulk and tensor copies complete them (the megakernel's task
// slots in kernels.cu, the MLA attention's K/V stages in mla_wgmma.cu, the KDA scan's record rows in
// kda_prefill.cuh). `bar` is a shared-memory address (cvta to shared). The host emulator's stand-ins
// (copies landing at issue or at a wait's next poll, phases, a wait that never completes reported)
// follow the device's.
#pragma once

#include <cstdint>

#ifndef PLOW_CUDA_EMU
#include <cudaTypedefs.h>  // CUtensorMap

namespace plow::cuda {

// A 2D tensor map (encoded on the host: tensor_map.h), passed to a kernel as a __grid_constant__ parameter.
using TensorMap = CUtensorMap;

// `count` arrivals complete a phase (1: the thread that also sets the expected bytes).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// The inits above visible to the copy engines (after the last init, before the barrier that starts
// the copies).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// This thread's arrival, with `bytes` more for the copies issued on `bar` to land.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Spins until the phase of parity `parity` completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred ready;\n"
      "MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      "@!ready bra MBAR_WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// A bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory to this
// block's shared memory at `dst`, completing that many of bar's expected bytes as it lands.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes),
               "r"(bar)
               : "memory");
}
// The box of a 2D tensor map at column c0, row c1 into shared memory at `dst` (128-byte aligned), its
// bytes (the whole box, zeros outside the matrix included) completing on `bar`.
__device__ __forceinline__ void tensor_g2s_2d(uint32_t dst, const TensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
               : "memory");
}

}  // namespace plow::cuda
#else
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

namespace plow::cuda {
// Shared addresses are offsets from the block's emulated shared memory (as wg_smem's); a barrier's
// state lives beside it, by address. One OS thread runs the fibers: no atomics.
inline char* emu_mbar_smem = nullptr;
// The emulator's tensor map: a row-major [rows][cols] matrix of elem_bytes elements (row stride ld
// elements) read in boxes of box_cols × box_rows, zeros outside it (as the device's
// CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE, no swizzle).
struct TensorMap {
  const char* base = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
  int elem_bytes = 4, box_cols = 0, box_rows = 0;
};
struct EmuMbar {
  struct Copy {  // bytes from src, or (map.base set) the box of map at column c0, row c1
    uint32_t dst;
    const void* src;
    uint32_t bytes;
    TensorMap map{};
    int64_t c0 = 0, c1 = 0;
  };
  uint32_t count = 1, left = 1, phase = 0;
  int64_t tx = 0;
  std::vector<Copy> pending;
};
inline std::map<uint32_t, EmuMbar> emu_mbars;
inline bool emu_mbar_eager = false;  // copies land at issue (as early as a device may land them), else at the first wait
inline EmuMbar& emu_mbar(uint32_t bar) {
  const auto it = emu_mbars.find(bar);
  if (it == emu_mbars.end()) { std::fprintf(stderr, "emu: mbarrier at %u used before its init\n", bar); std::abort(); }
  return it->second;
}
inline void emu_mbar_step(EmuMbar& b) {
  if (b.left == 0 && b.tx == 0) b.phase += 1, b.left = b.count;
}
inline void emu_mbar_land(EmuMbar& b, const EmuMbar::Copy& c) {
  if (c.map.base == nullptr) {
    std::memcpy(emu_mbar_smem + c.dst, c.src, c.bytes);
  } else {
    const TensorMap& m = c.map;
    char* out = emu_mbar_smem + c.dst;
    for (int r = 0; r < m.box_rows; ++r) {
      for (int j = 0; j < m.box_cols; ++j, out += m.elem_bytes) {
        const int64_t row = c.c1 + r, col = c.c0 + j;
        if (row >= 0 && row < m.rows && col >= 0 && col < m.cols) {
          std::memcpy(out, m.base + (row * m.ld + col) * m.elem_bytes, static_cast<size_t>(m.elem_bytes));
        } else {
          std::memset(out, 0, static_cast<size_t>(m.elem_bytes));
        }
      }
    }
  }
  b.tx -= c.bytes;
  emu_mbar_step(b);
}
inline void mbar_init(uint32_t bar, uint32_t count) { emu_mbars[bar] = EmuMbar{count, count, 0, 0, {}}; }
inline void mbar_init_fence() {}
inline void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  EmuMbar& b = emu_mbar(bar);
  b.tx += bytes;
  b.left -= 1;
  emu_mbar_step(b);
}
// A copy issued on bar: landed now (eager), else at the next poll of a wait on bar.
inline void emu_mbar_issue(uint32_t bar, const EmuMbar::Copy& c) {
  EmuMbar& b = emu_mbar(bar);
  if (emu_mbar_eager) {
    emu_mbar_land(b, c);
  } else {
    b.pending.push_back(c);
  }
}
inline void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  // The device faults on a bulk copy whose size or addresses are not multiples of 16.
  if (((dst | bytes | reinterpret_cast<uintptr_t>(src)) & 15) != 0) { std::fprintf(stderr, "emu: misaligned bulk copy\n"); std::abort(); }
  emu_mbar_issue(bar, EmuMbar::Copy{dst, src, bytes});
}
inline void tensor_g2s_2d(uint32_t dst, const TensorMap* map, int c0, int c1, uint32_t bar) {
  // The device faults on a tensor copy to a shared address off 128 bytes, or a box row off 16 bytes.
  if ((dst & 127) != 0 || (map->box_cols * map->elem_bytes) % 16 != 0) { std::fprintf(stderr, "emu: misaligned tensor copy\n"); std::abort(); }
  emu_mbar_issue(bar, EmuMbar::Copy{dst, nullptr, static_cast<uint32_t>(map->box_cols * map->box_rows * map->elem_bytes), *map, c0, c1});
}
inline void mbar_wait(uint32_t bar, uint32_t parity) {
  EmuMbar& b = emu_mbar(bar);
  for (long spins = 0;; ++spins) {
    for (const EmuMbar::Copy& c : b.pending) emu_mbar_land(b, c);  // copies issued while this thread waits land too
    b.pending.clear();
    if ((b.phase & 1) != parity) return;  // the phase of this parity completed
    if (spins > 100'000) { std::fprintf(stderr, "emu: an mbarrier wait that never completes (thread %u, barrier %u, parity %u)\n", threadIdx.x, bar, parity); std::abort(); }
    emu_block->spun = true;
    emu_wait(EmuBlock::kRun);
  }
}
// Whether every bulk copy issued has landed (a block must not end with copies in flight).
inline bool emu_mbar_idle() {
  for (const auto& [bar, b] : emu_mbars) {
    if (!b.pending.empty()) return false;
  }
  return true;
}
}  // namespace plow::cuda
#endif
