// Hopper's shared-memory mbarriers as the bulk and tensor copies complete them (the megakernel's task
// slots in kernels.cu, the MLA attention's K/V stages in mla_wgmma.cu). `bar` is a shared-memory
// address (cvta to shared). Included by .cu files only.
#pragma once

#include <cstdint>

namespace plow::cuda {

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

}  // namespace plow::cuda
