// The fused causal attention of one MLA prefill sequence (mla_flash.h) in the flash-attention-2 form on
// tensor cores: a block holds 64 query rows of one head (16 per warp; q staged once in shared memory)
// and walks the K/V tiles of 64 positions up to its causal bound, staged in shared memory by cp.async
// in two stages (the next tile loads while this one is used); per tile S = q·Kᵀ and O += P·V by
// mma.sync m16n8k16 (16-bit in, fp32 accumulate), the softmax online in fp32 (running max and sum per
// row, base-2 exponent), P rounded to the element type before its mma. The output row is O / Σ,
// rounded to the activation dtype as the cuBLAS path's scatter rounds it.
//
// Error against the CPU reference (cpu/ops/mla.cpp: P = act(exp(s − max) / Σ) in fp32, then P·V): both
// sum products of the same 16-bit-exact q, K, V in fp32 (only the order differs), and both round each
// weight once to the element type before P·V, the CPU after normalizing, this kernel before (relative
// to the running max; Σ is taken from the unrounded weights). Each weight of either side is within a
// relative 2⁻⁹ (bf16; 2⁻¹² f16) of exact, so an output differs from the CPU's by at most
// 2·2⁻⁹·Σ p|v| ≤ 2⁻⁸·max|v| before its final rounding, and in practice by ~2⁻⁹·√(Σ p²v²) (independent
// rounding errors): a fraction of one output ulp, against bounds of 3–4 ulps of the output scale
// (cuda_prefill_test, cuda_ops_test) and the logit bound downstream (cuda_model_test). The output's own
// rounding adds at most one ulp where the two land on either side of a rounding boundary.
//
// Emulator builds (PLOW_CUDA_EMU, tests/gpu/emu) run the same body with host stand-ins for cp.async
// (copies land at the wait that covers them, or at issue), ldmatrix and mma (warp exchanges, fp32 sums).
// 150-line kernel body: one pass of a flash-attention block reads best in one piece.
#pragma once

#include <cstdint>

#include "runtime/cuda/mla_flash.h"
#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda {

// Shared memory of a block: two stages of K [keys][kLdK] then V [keys][kLdV], then q [rows][kLdK],
// 16-bit elements. Rows are padded by 8 elements (16 bytes past a multiple of 128): the 8 rows of an
// ldmatrix hit 8 distinct 16-byte bank groups. (q in registers instead, 48 of them at QK 192, pushed
// the kernel past 255 registers into spills.) 192/128: 109 KiB, two blocks an SM.
template <int QK, int DV>
struct MlaFlashLayout {
  static constexpr int kLdK = QK + 8;
  static constexpr int kLdV = DV + 8;
  static constexpr int kKElems = kMlaFlashKeys * kLdK;
  static constexpr int kStageElems = kKElems + kMlaFlashKeys * kLdV;
  static constexpr int kQAt = 2 * kStageElems;
  static constexpr int kBytes = (kQAt + kMlaFlashRows * kLdK) * 2;
  static_assert(QK % 16 == 0 && DV % 16 == 0, "whole mma k steps of q·k, pairs of 8-column v tiles");
  static_assert(kMlaFlashKeys * QK / 8 % kMlaFlashThreads == 0 && kMlaFlashKeys * DV / 8 % kMlaFlashThreads == 0, "tile loads in whole rounds");
  static_assert(kLdK * 2 % 128 == 16 && kLdV * 2 % 128 == 16, "conflict-free ldmatrix rows");
};

#ifndef PLOW_CUDA_EMU

__device__ __forceinline__ uint32_t flash_smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16 bytes into shared memory: from src (src_bytes 16), or zeros (src_bytes 0; src is not read).
__device__ __forceinline__ void flash_cp_async(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(flash_smem_addr(dst)), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void flash_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// This thread's copies have landed but for the `kPending` groups it committed last.
template <int kPending>
__device__ __forceinline__ void flash_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8×8 matrices of 16-bit elements, matrix i's row r at the address lane 8i + r gives; register i
// holds matrix i's (row lane/4, columns 2·(lane%4), +1), or with kTrans its (rows 2·(lane%4), +1, column lane/4).
template <bool kTrans>
__device__ __forceinline__ void flash_ldmatrix(uint32_t (&r)[4], const uint16_t* row) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(flash_smem_addr(row))
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(flash_smem_addr(row))
                 : "memory");
  }
}

// d += a·b: a the 16×16 row-major fragment (a0 (g, 2c..), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..)),
// b the 16×8 column fragment (b0 (2c.., g), b1 (2c+8.., g)), d the 16×8 fp32 tile (d0, d1 (g, 2c..);
// d2, d3 (g+8, 2c..)); g = lane/4, c = lane%4. Whole warps.
template <bool kF16>
__device__ __forceinline__ void flash_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 2^x on the MUFU, results below 2⁻¹²⁶ flushed to zero (ex2.approx.ftz: exp2f's own error, without its
// two multiplies and a compare for denormal results). A weight that small against the row's max of 1
// adds nothing a bf16 or f16 P·V can hold.
__device__ __forceinline__ float flash_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// Whether `pred` holds on every lane of the warp.
__device__ __forceinline__ bool flash_warp_all(bool pred) { return __all_sync(0xffffffffu, pred); }

// Two values rounded to the element type (nearest even), `low` in the low half.
template <bool kF16>
__device__ __forceinline__ uint32_t flash_pack(float low, float high) {
  if constexpr (kF16) {
    const __half2 v = __floats2half2_rn(low, high);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

#else  // PLOW_CUDA_EMU: one OS thread runs the block's fibers; per-fiber state indexed by threadIdx.x.

struct MlaFlashEmu {
  const uint16_t* rows[EmuBlock::kN] = {};
  uint32_t regs[EmuBlock::kN][6] = {};
};
inline MlaFlashEmu mla_flash_emu;

// cp.async through the emulator's deferred copies (emu_prelude.h emu_cp).
inline void flash_cp_async(void* dst, const void* src, int src_bytes) { emu_cp_async(dst, src, src_bytes); }
inline void flash_cp_commit() { emu_cp_commit(); }
template <int kPending>
inline void flash_cp_wait() {
  emu_cp_wait(kPending);
}

template <bool kTrans>
inline void flash_ldmatrix(uint32_t (&r)[4], const uint16_t* row) {
  const unsigned t = threadIdx.x, base = t - t % 32, lane = t % 32;
  mla_flash_emu.rows[t] = row;
  __syncwarp();
  for (unsigned i = 0; i < 4; ++i) {
    uint32_t low = 0, high = 0;
    if (kTrans) {
      low = mla_flash_emu.rows[base + 8 * i + 2 * (lane % 4)][lane / 4];
      high = mla_flash_emu.rows[base + 8 * i + 2 * (lane % 4) + 1][lane / 4];
    } else {
      low = mla_flash_emu.rows[base + 8 * i + lane / 4][2 * (lane % 4)];
      high = mla_flash_emu.rows[base + 8 * i + lane / 4][2 * (lane % 4) + 1];
    }
    r[i] = low | high << 16;
  }
  __syncwarp();
}

template <bool kF16>
inline float flash_emu_value(uint32_t reg, int half) {
  const uint16_t bits = static_cast<uint16_t>(half ? reg >> 16 : reg);
  return kF16 ? plow::f16_to_f32(bits) : plow::bf16_to_f32(bits);
}

// The fragments of every lane through the exchange area; each product exact in fp32 (8- or 11-bit
// significands), summed in k order.
template <bool kF16>
inline void flash_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const unsigned t = threadIdx.x, base = t - t % 32, lane = t % 32;
  uint32_t* mine = mla_flash_emu.regs[t];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0, mine[5] = b1;
  __syncwarp();
  const int g = static_cast<int>(lane / 4), c = static_cast<int>(lane % 4);
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0), col = 2 * c + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const uint32_t* a_lane = mla_flash_emu.regs[base + (row % 8) * 4 + (k % 8) / 2];
      const uint32_t* b_lane = mla_flash_emu.regs[base + col * 4 + (k % 8) / 2];
      acc += flash_emu_value<kF16>(a_lane[row / 8 + 2 * (k / 8)], k % 2) * flash_emu_value<kF16>(b_lane[4 + k / 8], k % 2);
    }
    out[e] = acc;
  }
  __syncwarp();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

inline float flash_exp2(float x) {
  const float y = std::exp2(x);
  return y < 0x1p-126f ? 0.0f : y;
}
inline bool flash_warp_all(bool pred) { return __all_sync(0xffffffffu, pred); }

template <bool kF16>
inline uint32_t flash_pack(float low, float high) {
  if (kF16) return static_cast<uint32_t>(__float2half_rn(low).bits) | static_cast<uint32_t>(__float2half_rn(high).bits) << 16;
  return static_cast<uint32_t>(__float2bfloat16_rn(low).bits) | static_cast<uint32_t>(__float2bfloat16_rn(high).bits) << 16;
}

#endif  // PLOW_CUDA_EMU

// d0 += a·b0, d1 += a·b1, where (b0, b1) are two 8-column B tiles side by side: the four matrices of
// one ldmatrix at `row` (this lane's address).
template <bool kF16, bool kTrans>
__device__ __forceinline__ void flash_mma_pair(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4], const uint16_t* row) {
  uint32_t b[4];
  flash_ldmatrix<kTrans>(b, row);
  flash_mma<kF16>(d0, a, b[0], b[1]);
  flash_mma<kF16>(d1, a, b[2], b[3]);
}

// This thread's two rows of a block's online softmax (the m16n8 accumulator layout: rows g and g + 8 of
// its warp's 16), shared by this kernel and the wgmma one (mla_wgmma.cu).
struct FlashRows {
  int lo, hi;                                 // query rows
  float m_lo = -INFINITY, m_hi = -INFINITY;  // running max of the unscaled scores
  float l_lo = 0.0f, l_hi = 0.0f;            // this thread's share of Σ
};

// One tile of scores s (kTiles 8-position column tiles from position j0; c = lane % 4) into the
// unnormalized weights exp2(s·scale − max·scale) (one FFMA and the MUFU an element), the running max
// (of the unscaled scores: scale > 0) and sum updated and O (kOut column tiles) rescaled to the new max;
// the rescale is skipped while no row of the warp's max moved (α = 1 exactly: the product would change
// nothing), which is most tiles past the first few. Masks only where a position can pass a row's bound
// (context + row): `diagonal` tiles. The first tile holds position 0, which every row sees, so the
// maxima are finite from there on (the guard keeps a row that saw nothing at p = 0, not NaN).
template <int kTiles, int kOut>
__device__ __forceinline__ void flash_softmax_tile(float (&s)[kTiles][4], float (&o)[kOut][4], FlashRows& r, int j0, bool diagonal, int context, float scale_log2,
                                                   int c) {
  if (diagonal) {
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      const int key = j0 + nt * 8 + 2 * c;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (key + (e & 1) > context + (e < 2 ? r.lo : r.hi)) s[nt][e] = -INFINITY;
      }
    }
  }
  float top_lo = -INFINITY, top_hi = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    top_lo = fmaxf(top_lo, fmaxf(s[nt][0], s[nt][1]));
    top_hi = fmaxf(top_hi, fmaxf(s[nt][2], s[nt][3]));
  }
#pragma unroll
  for (int o_lane = 1; o_lane < 4; o_lane *= 2) {  // the 4 lanes of a row
    top_lo = fmaxf(top_lo, __shfl_xor_sync(0xffffffffu, top_lo, o_lane));
    top_hi = fmaxf(top_hi, __shfl_xor_sync(0xffffffffu, top_hi, o_lane));
  }
  const float new_lo = fmaxf(r.m_lo, top_lo), new_hi = fmaxf(r.m_hi, top_hi);
  const float base_lo = new_lo == -INFINITY ? 0.0f : new_lo * scale_log2, base_hi = new_hi == -INFINITY ? 0.0f : new_hi * scale_log2;
  // 0 while the max was −∞; exactly 1 while it stays (the same product on both sides).
  const float alpha_lo = flash_exp2(r.m_lo * scale_log2 - base_lo), alpha_hi = flash_exp2(r.m_hi * scale_log2 - base_hi);
  r.m_lo = new_lo, r.m_hi = new_hi;
  float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    s[nt][0] = flash_exp2(fmaf(s[nt][0], scale_log2, -base_lo)), s[nt][1] = flash_exp2(fmaf(s[nt][1], scale_log2, -base_lo));
    s[nt][2] = flash_exp2(fmaf(s[nt][2], scale_log2, -base_hi)), s[nt][3] = flash_exp2(fmaf(s[nt][3], scale_log2, -base_hi));
    sum_lo += s[nt][0] + s[nt][1], sum_hi += s[nt][2] + s[nt][3];
  }
  r.l_lo = r.l_lo * alpha_lo + sum_lo, r.l_hi = r.l_hi * alpha_hi + sum_hi;
  if (flash_warp_all(alpha_lo == 1.0f && alpha_hi == 1.0f)) return;
#pragma unroll
  for (int nt = 0; nt < kOut; ++nt) o[nt][0] *= alpha_lo, o[nt][1] *= alpha_lo, o[nt][2] *= alpha_hi, o[nt][3] *= alpha_hi;
}

// The tiles of O / Σ into this thread's rows and columns of out (head h's columns of the op's rows; rows
// past tokens and columns past dv stay untouched), rounded and, with kGate, gated as the cuBLAS path's
// scatter does it.
template <int kOut, bool kGate>
__device__ __forceinline__ void flash_store_tiles(const MlaFlashArgs& a, const float (&o)[kOut][4], const FlashRows& r, float inv_lo, float inv_hi,
                                                  float* out, const float* gate, int c) {
  const auto store = [&](int row, int col, float v) {
    if (row >= a.tokens || col >= a.dv) return;
    float y = a.round_out ? round_act(a.act, v) : v;
    if constexpr (kGate) y = round_act(a.act, y * sigmoidf_(gate[static_cast<int64_t>(row) * a.gate_stride + col]));
    out[static_cast<int64_t>(row) * a.width + col] = y;
  };
#pragma unroll
  for (int nt = 0; nt < kOut; ++nt) {
    const int col = nt * 8 + 2 * c;
    store(r.lo, col, o[nt][0] * inv_lo);
    store(r.lo, col + 1, o[nt][1] * inv_lo);
    store(r.hi, col, o[nt][2] * inv_hi);
    store(r.hi, col + 1, o[nt][3] * inv_hi);
  }
}

// Σ over the row's 4 lanes, then O / Σ into head h's columns of the op's rows (flash_store_tiles). The
// gate is chosen once, outside the unrolled stores: tested in each of the 4·kOut inlined stores, it
// took cicc ~4 minutes for one 64-wide instantiation of mla_flash_kernel and ~30 for the four of
// mla_gemm.cu (8 s and 31 s for the 64- and 192-wide ones with the choice hoisted; the same arithmetic
// per element).
template <int kOut>
__device__ __forceinline__ void flash_store_rows(const MlaFlashArgs& a, const float (&o)[kOut][4], FlashRows r, int h, int c) {
#pragma unroll
  for (int o_lane = 1; o_lane < 4; o_lane *= 2) {
    r.l_lo += __shfl_xor_sync(0xffffffffu, r.l_lo, o_lane);
    r.l_hi += __shfl_xor_sync(0xffffffffu, r.l_hi, o_lane);
  }
  const float inv_lo = 1.0f / r.l_lo, inv_hi = 1.0f / r.l_hi;
  float* out = a.out + static_cast<int64_t>(h) * a.dv;
  if (a.gate != nullptr) {
    flash_store_tiles<kOut, true>(a, o, r, inv_lo, inv_hi, out, a.gate + static_cast<int64_t>(h) * a.dv, c);
  } else {
    flash_store_tiles<kOut, false>(a, o, r, inv_lo, inv_hi, out, nullptr, c);
  }
}

// K/V tile j (positions [64j, 64j + 64)) into stage j % 2 in whole 16-byte copies; positions from
// `keys` on and columns past ld_k / ld_v are cp.async's zero fill (source size 0), so nothing past the
// block's causal bound or a head's rows is read. Columns [qk, ld_k) are zero in the buffer (mla_flash.h);
// columns [dv, ld_v) may hold anything: they reach only output columns that are never written.
template <int QK, int DV>
__device__ __forceinline__ void mla_flash_stage(const MlaFlashArgs& a, const uint16_t* kg, const uint16_t* vg, int keys, int j, int tid, uint16_t* sm) {
  using L = MlaFlashLayout<QK, DV>;
  uint16_t* ks = sm + (j & 1) * L::kStageElems;
  uint16_t* vs = ks + L::kKElems;
  const int j0 = j * kMlaFlashKeys;
  constexpr int kKChunks = QK / 8, kVChunks = DV / 8;
#pragma unroll
  for (int i = 0; i < kMlaFlashKeys * kKChunks / kMlaFlashThreads; ++i) {
    const int idx = tid + i * kMlaFlashThreads, r = idx / kKChunks, col = idx % kKChunks * 8;
    const int bytes = j0 + r < keys && col < a.ld_k ? 16 : 0;
    flash_cp_async(ks + r * L::kLdK + col, bytes > 0 ? kg + static_cast<int64_t>(j0 + r) * a.ld_k + col : kg, bytes);
  }
#pragma unroll
  for (int i = 0; i < kMlaFlashKeys * kVChunks / kMlaFlashThreads; ++i) {
    const int idx = tid + i * kMlaFlashThreads, r = idx / kVChunks, col = idx % kVChunks * 8;
    const int bytes = j0 + r < keys && col < a.ld_v ? 16 : 0;
    flash_cp_async(vs + r * L::kLdV + col, bytes > 0 ? vg + static_cast<int64_t>(j0 + r) * a.ld_v + col : vg, bytes);
  }
}

// Block (q_tile, h) of one sequence: query rows [64·q_tile, +64) of head h, thread tid of
// kMlaFlashThreads, smem MlaFlashLayout<QK, DV>::kBytes (16-byte aligned). QK ≥ qk and DV ≥ dv.
template <int QK, int DV, bool kF16>
__device__ __forceinline__ void mla_flash_block(const MlaFlashArgs& a, int q_tile, int h, int tid, unsigned char* smem) {
  using L = MlaFlashLayout<QK, DV>;
  constexpr int kKeyTiles = kMlaFlashKeys / 8;  // n-tiles of S
  const int lane = tid % 32, warp = tid / 32, g = lane / 4, c = lane % 4;
  const int t0 = q_tile * kMlaFlashRows;
  const int keys = a.context + min(t0 + kMlaFlashRows, a.tokens);  // the block's last row sees positions [0, keys)
  const int tiles = (keys + kMlaFlashKeys - 1) / kMlaFlashKeys;
  const int64_t head_rows = static_cast<int64_t>(h) * (a.context + a.tokens);
  const uint16_t* kg = a.keys + head_rows * a.ld_k;
  const uint16_t* vg = a.values + head_rows * a.ld_v;
  uint16_t* sm = reinterpret_cast<uint16_t*>(smem);
  mla_flash_stage<QK, DV>(a, kg, vg, keys, 0, tid, sm);
  flash_cp_commit();

  // The block's q rows in the element type (exact: q is an activation), zero past tokens and qk; the
  // first tile's barrier orders these stores before any ldmatrix of them.
  uint16_t* qs = sm + L::kQAt;
  {
    const float* q = a.q + static_cast<int64_t>(h) * a.qk;
    for (int idx = tid; idx < kMlaFlashRows * QK / 2; idx += kMlaFlashThreads) {
      const int r = idx / (QK / 2), col = idx % (QK / 2) * 2, row = t0 + r;
      const float* src = q + static_cast<int64_t>(row) * a.q_stride + col;
      const float x0 = row < a.tokens && col < a.qk ? src[0] : 0.0f, x1 = row < a.tokens && col + 1 < a.qk ? src[1] : 0.0f;
      *reinterpret_cast<uint32_t*>(qs + r * L::kLdK + col) = flash_pack<kF16>(x0, x1);
    }
  }
  FlashRows rows{t0 + warp * 16 + g, t0 + warp * 16 + g + 8};  // this thread's rows of the warp's 16
  float o[DV / 8][4];
#pragma unroll
  for (int nt = 0; nt < DV / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  // ldmatrix row addresses of this lane: q as the A fragment (rows +0/+8, columns +0/+8), K (keys
  // +0/+8, columns +0/+8), V transposed (positions +0/+8, columns +0/+8).
  const int q_lane = (warp * 16 + (lane / 8 % 2) * 8 + lane % 8) * L::kLdK + (lane / 16) * 8;
  const int k_lane = ((lane / 16) * 8 + lane % 8) * L::kLdK + (lane / 8 % 2) * 8;
  const int v_lane = ((lane / 8 % 2) * 8 + lane % 8) * L::kLdV + (lane / 16) * 8;

  for (int j = 0; j < tiles; ++j) {
    if (j + 1 < tiles) {
      mla_flash_stage<QK, DV>(a, kg, vg, keys, j + 1, tid, sm);
      flash_cp_commit();
      flash_cp_wait<1>();
    } else {
      flash_cp_wait<0>();
    }
    __syncthreads();  // tile j has landed for every thread
    const uint16_t* ks = sm + (j & 1) * L::kStageElems;
    const uint16_t* vs = ks + L::kKElems;
    float s[kKeyTiles][4];
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < QK / 16; ++kk) {
      uint32_t qf[4];
      flash_ldmatrix<false>(qf, qs + q_lane + kk * 16);
#pragma unroll
      for (int np = 0; np < kKeyTiles / 2; ++np) flash_mma_pair<kF16, false>(s[2 * np], s[2 * np + 1], qf, ks + k_lane + np * 16 * L::kLdK + kk * 16);
    }
    flash_softmax_tile(s, o, rows, j * kMlaFlashKeys, j * kMlaFlashKeys + kMlaFlashKeys - 1 > a.context + t0, a.context, a.scale_log2, c);
    // O += P·V: the score tiles 2kk, 2kk + 1 are the A fragment of positions [16kk, 16kk + 16).
#pragma unroll
    for (int kk = 0; kk < kKeyTiles / 2; ++kk) {
      const uint32_t p[4] = {flash_pack<kF16>(s[2 * kk][0], s[2 * kk][1]), flash_pack<kF16>(s[2 * kk][2], s[2 * kk][3]),
                             flash_pack<kF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]), flash_pack<kF16>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int np = 0; np < DV / 16; ++np) flash_mma_pair<kF16, true>(o[2 * np], o[2 * np + 1], p, vs + v_lane + kk * 16 * L::kLdV + np * 16);
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

  flash_store_rows(a, o, rows, h, c);
}

}  // namespace plow::cuda
