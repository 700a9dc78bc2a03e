// Eight half-precision values (bf16 or f16) from the four 32-bit words of a 16-byte chunk, element
// 2i in word i's low half. Plain intrinsics only, so the host emulation (tests/gpu/emu) builds it too.
#pragma once

#include "runtime/cuda/device.cuh"

namespace plow::cuda {

__device__ __forceinline__ void unpack_half8(const uint32_t (&w)[4], int32_t type, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (type == kWBF16) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
}

}  // namespace plow::cuda
