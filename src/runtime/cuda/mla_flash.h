// The fused MLA prefill attention (mla_flash.cuh) as the host sees it: its tile shape, the head dims
// it is built for and its arguments. Plain C++ (no CUDA headers): mla_gemm.cpp and the host emulator
// test include it.
#pragma once

#include <cstdint>

#include "runtime/cuda/device_types.h"

namespace plow::cuda {

inline constexpr int kMlaFlashRows = 64;  // query rows of a block: 16 per warp
inline constexpr int kMlaFlashKeys = 64;  // key positions of a K/V tile
inline constexpr int kMlaFlashWarps = kMlaFlashRows / 16;
inline constexpr int kMlaFlashThreads = 32 * kMlaFlashWarps;

// Head dims the kernel is instantiated for (q·k width, v width); a head takes the smallest that
// holds it, zero-padded: (64, 64) for the small fixtures, (192, 128) for the Kimi-Linear/K3 heads.
// Wider heads keep the cuBLAS blocks.
inline constexpr int kMlaFlashSmallDim = 64;
inline constexpr int kMlaFlashQk = 192, kMlaFlashDv = 128;

// Whether one sequence's attention of an op with these head dims and GEMM element type runs fused:
// bf16 and f16 (fp32 models keep the pedantic fp32 GEMMs).
inline bool mla_flash_fits(int64_t qk, int64_t dv, int32_t type) {
  return (type == kWBF16 || type == kWF16) && qk >= 1 && dv >= 1 && qk <= kMlaFlashQk && dv <= kMlaFlashDv;
}

// Whether such an attention runs on the wgmma kernel (mla_wgmma.cu, heads past the small
// instantiation), which reads the values transposed (MlaFlashArgs::ld_vt).
inline bool mla_wgmma_fits(int64_t qk, int64_t dv, int32_t type) {
  return mla_flash_fits(qk, dv, type) && (qk > kMlaFlashSmallDim || dv > kMlaFlashSmallDim);
}

// One sequence: queries rows [0, tokens) over positions [0, context + tokens), row t seeing positions
// ≤ context + t. Keys and values are the expansion's per-head blocks of 16-bit elements (bf16 or f16):
// head h's position τ at keys + (h·(context + tokens) + τ)·ld_k (qk columns, then zeros up to ld_k),
// values likewise with ld_v (dv columns, then anything); ld_k and ld_v are qk and dv rounded up to 8
// (16-byte rows, copied whole). q is the op's fp32 input (values exact
// in the element type), row t at q + t·q_stride, head h at column h·qk; the output row t at
// out + t·width, head h at column h·dv, rounded to `act` when round_out, then gated when `gate` is set.
struct MlaFlashArgs {
  const float* q = nullptr;
  const uint16_t* keys = nullptr;
  const uint16_t* values = nullptr;
  float* out = nullptr;
  int64_t q_stride = 0, width = 0;
  int32_t ld_k = 0, ld_v = 0;
  // > 0: the values transposed (the wgmma kernel): head h's value column d at values + (h·dv + d)·ld_vt,
  // positions [0, context + tokens) then zeros up to ld_vt (a multiple of 8); ld_v unused.
  int32_t ld_vt = 0;
  int32_t tokens = 0, context = 0, heads = 0, qk = 0, dv = 0;
  float scale_log2 = 0;  // (nope + rope)^(−1/2) · log2(e): scores in the base-2 exponent's unit
  int32_t act = kABF16;
  bool round_out = true;
  // The K3 output gate in the epilogue (MlaGemmOp::gate_op): row t's gate at gate + t·gate_stride, head h
  // at column h·dv; the stored value is act(o'·σ(g)), o' the output as rounded above (sigmoid_mul's
  // arithmetic and its one rounding). nullptr: no gate.
  const float* gate = nullptr;
  int64_t gate_stride = 0;
};

}  // namespace plow::cuda
