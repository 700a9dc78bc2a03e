// The 128-byte-swizzled K-major layout wgmma reads (wgmma.cuh) as plain integer arithmetic, without
// CUDA headers, so that the host emulator's stand-ins (kda_tf32.cuh) read shared memory the same way.
#pragma once

#include <cstdint>

namespace plow::cuda {

// The byte offset of 16-byte chunk c (0..7) of row r in a swizzled tile.
__device__ __forceinline__ uint32_t wg_swizzle(int r, int c) { return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4)); }

// The descriptor of a K-major swizzled tile at shared address `at` (1,024-byte aligned, or advanced by
// a multiple of 32 bytes inside the first row for the k16 steps): leading offset 16 bytes (unused by
// this layout), stride 1,024 bytes (one atom), swizzle mode 1 (128 bytes).
__device__ __forceinline__ uint64_t wg_desc(uint32_t at) {
  return static_cast<uint64_t>((at & 0x3FFFF) >> 4) | (uint64_t{16 >> 4} << 16) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

}  // namespace plow::cuda
