// Device helpers over device_types.h for the op bodies: TaskCtx, rounding, activations, weight
// access, block reductions. Included by .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "runtime/cuda/device_types.h"

namespace plow::cuda {

// A tensor's rows as a loop indexes them: base and row stride read from the OpDesc once. Indexing
// through TaskCtx::in/out inside a loop re-reads the descriptor after every store (the compiler cannot
// prove that a store to the arena leaves the OpDesc alone), two dependent loads before each element's.
template <typename T>
struct Rows {
  T* base;
  int64_t stride;
  __device__ T* operator[](int64_t row) const { return base + row * stride; }
};

// What an op body gets: its op, the arena, the step, the column slice [col_begin, col_end) of its
// output, the block's dynamic shared memory (kSharedBytes) and global scratch (kScratchFloats), and
// which of the op's op->tasks tasks it is.
struct TaskCtx {
  const OpDesc* op;
  float* arena;
  const StepView* step;
  int64_t col_begin, col_end;
  unsigned char* smem;
  float* scratch;
  int32_t task = 0;

  // Row `row` of input i: in_width(i) floats (a view's rows keep its source's stride).
  __device__ const float* in(int i, int64_t row) const { return arena + op->in_offset[i] + row * op->in_stride[i]; }
  __device__ float* out(int64_t row) const { return arena + op->out_offset + row * op->width; }
  __device__ Rows<const float> in_rows(int i) const { return {arena + op->in_offset[i], op->in_stride[i]}; }
  __device__ Rows<float> out_rows() const { return {arena + op->out_offset, op->width}; }
  // The dtype the output is rounded to: round_act(out_act(), v) == round_out(*this, v).
  __device__ int32_t out_act() const { return op->round_out ? op->act : kAF32; }
  // The dtype input i's loads are rounded to: op->act where OpDesc::round_in says its values may be
  // unrounded, else fp32 (round_act leaves the value as it is).
  __device__ int32_t in_act(int i) const { return (op->round_in >> i) & 1 ? op->act : kAF32; }
  __device__ int64_t in_width(int i) const { return op->in_width[i]; }
  __device__ const DeviceWeight& weight(int i) const { return op->weights[i]; }
  __device__ float attr(int i) const { return op->attr[i]; }
  __device__ int rows() const { return step->tokens; }
};

// Rounding to the activation dtype, round-to-nearest-even, as core/dtype round_to.
__device__ __forceinline__ float round_act(int32_t act, float v) {
  if (act == kABF16) return __bfloat162float(__float2bfloat16_rn(v));
  if (act == kAF16) return __half2float(__float2half_rn(v));
  return v;
}
__device__ __forceinline__ float round_out(const TaskCtx& ctx, float v) { return ctx.op->round_out ? round_act(ctx.op->act, v) : v; }

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }
// The KDA gate of z = f + dt_bias in head h (kda_gate, linear_kda_gate): −exp(A_log[h])·softplus(z)
// (softplus returns z above 20), or with a lower bound lb (K3, bounded) lb·σ(exp(A_log[h])·z).
// kda_gate_rate takes rate = exp(A_log[h]) already computed (kda_gate's tasks take it once a head).
__device__ __forceinline__ float kda_gate_rate(float z, float rate, bool bounded, float lower_bound) {
  if (bounded) return lower_bound * sigmoidf_(rate * z);
  const float softplus = z > 20.0f ? z : logf(1.0f + expf(z));
  return -rate * softplus;
}
__device__ __forceinline__ float kda_gate_value(float z, float a_log, bool bounded, float lower_bound) {
  return kda_gate_rate(z, expf(a_log), bounded, lower_bound);
}
__device__ __forceinline__ float situf_(float a, float b, float beta, float linear_beta) {
  const float up = linear_beta > 0 ? linear_beta * tanhf(b / linear_beta) : b;
  return beta * tanhf(a / beta) * sigmoidf_(a) * up;
}

__device__ __forceinline__ void report_error(const TaskCtx& ctx, int32_t code) { atomicCAS(ctx.step->error, 0, code); }

// One element of a weight as fp32 (slow path: scalar loads; GEMV bodies use vector loads).
__device__ __forceinline__ float e2m1_value_dev(uint32_t code) {
  const float m[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = m[code & 7];
  return (code & 8) ? -v : v;
}
// E8M0 → 2^(e − 127) by its bits (e = 0: the subnormal 2⁻¹²⁷; 0xFF: NaN).
__device__ __forceinline__ float e8m0_value_dev(uint32_t e) { return __uint_as_float(e == 0xFFu ? 0x7fc00000u : e == 0u ? 0x00400000u : e << 23); }
__device__ __forceinline__ float weight_at(const DeviceWeight& w, int64_t part, int64_t row, int64_t col) {
  const uint8_t* base = w.data + part * w.part_bytes;
  switch (w.type) {
    case kWBF16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[row * w.cols + col]);
    case kWF16: return __half2float(reinterpret_cast<const __half*>(base)[row * w.cols + col]);
    case kWMXFP4: {
      const uint8_t byte = base[row * (w.cols / 2) + col / 2];
      const uint32_t code = (col & 1) ? byte >> 4 : byte & 0xF;
      return e2m1_value_dev(code) * e8m0_value_dev(w.scales[part * w.scale_part_bytes + row * (w.cols / 32) + col / 32]);
    }
    default: return reinterpret_cast<const float*>(base)[row * w.cols + col];
  }
}

// Block-wide sum of one value per thread; every thread gets the total. Uses 32 floats of `red`
// (shared memory); the caller must not reuse `red` until after the next __syncthreads.
__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = lane < kWarps ? red[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  return total;
}

}  // namespace plow::cuda
