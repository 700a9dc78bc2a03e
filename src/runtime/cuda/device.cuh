// The device-side view of a plan (DESIGN.md §2): what every CUDA op body sees. A plan op becomes one
// OpDesc in device memory (pointers resolved, attributes packed, decoded once on the host); a task is
// one op over a column slice, run by one block of kThreads threads. The same op bodies serve the
// persistent megakernel (a block walks its queue, waiting on epoch counters) and cuda-eager (one
// launch per op, one block per task). Op bodies synchronize only within their block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace plow::cuda {

inline constexpr int kThreads = 512;                 // threads of every worker block
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kSharedBytes = 96 * 1024;       // dynamic shared memory every op body may use
inline constexpr int64_t kScratchFloats = 1 << 18;   // per-block global scratch (1 MiB) for op bodies
inline constexpr int kMaxAttrs = 16;

enum WeightType : int32_t { kWF32 = 0, kWBF16 = 1, kWF16 = 2, kWMXFP4 = 3 };
enum ActType : int32_t { kAF32 = 0, kABF16 = 1, kAF16 = 2 };

// A weight in device memory: one 2-D matrix, or a stack of `parts` equally shaped ones (experts).
// Dense: element (r, c) of part p at data + p·part_bytes + (r·cols + c)·elem_size.
// MXFP4 (§7.7): packed codes [rows, cols/2] (low nibble = even column) at data + p·part_bytes, E8M0
// scales [rows, cols/32] at scales + p·scale_part_bytes; e = 0xFF decodes to NaN.
struct DeviceWeight {
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0, cols = 0;  // 1-D weights: rows = 1
  int64_t part_bytes = 0, scale_part_bytes = 0;
  int32_t type = kWF32;
  int32_t parts = 1;
};

// Per-sequence state of one StateDecl for every slot: slot s at base + s·slot_floats (fp32).
// Conv window [width, depth] (oldest column first, as on the CPU); KDA recurrent [heads, d, d];
// MLA latent cache [max_context, width] rows in position order.
struct DeviceState {
  float* base = nullptr;
  int64_t slot_floats = 0;
  int64_t width = 0, depth = 0;
};

// One op of the plan. Activations live in one fp32 arena (values already rounded to their dtype, as on
// the CPU); an input i is rows of in_width[i] floats at arena + in_offset[i].
struct OpDesc {
  int32_t opcode = 0;
  int32_t act = kAF32;            // the model's activation dtype (rounding points)
  int32_t round_out = 1;          // 1: the output is rounded to `act` (OutDType::kAct); 0: fp32
  int32_t num_inputs = 0;
  int32_t num_weights = 0;
  int32_t state = -1;             // index into StepView::states, −1 when stateless
  int64_t width = 0;              // output columns
  int64_t out_offset = 0;         // output rows of `width` floats at arena + out_offset
  const int64_t* in_offset = nullptr;  // [num_inputs]
  const int64_t* in_width = nullptr;   // [num_inputs]
  const DeviceWeight* weights = nullptr;  // [num_weights]
  float attr[kMaxAttrs] = {};     // packed by pack_attrs (attrs.cpp): op-specific order
};

// The step, as the device sees it (rebuilt by the host before every step). Rows of a sequence are
// contiguous; row r belongs to sequence row_seq[r] at absolute position row_pos[r].
struct StepView {
  int32_t tokens = 0;             // T ≤ the plan's max_tokens
  int32_t num_seqs = 0;
  const int32_t* token_ids = nullptr;   // [T]
  const int32_t* row_seq = nullptr;     // [T]
  const int32_t* row_pos = nullptr;     // [T]
  const int32_t* seq_slot = nullptr;    // [num_seqs]
  const int32_t* seq_first_row = nullptr;
  const int32_t* seq_tokens = nullptr;  // query tokens of the sequence in this step
  const int32_t* seq_context = nullptr; // tokens the slot held before this step
  const DeviceState* states = nullptr;  // [plan states]
  int32_t* error = nullptr;             // first device-side error code (0 = none), see kErr*
};

inline constexpr int32_t kErrBadToken = 1;     // a token id outside the vocabulary
inline constexpr int32_t kErrContext = 2;      // a sequence grew past the slot's cache
inline constexpr int32_t kErrOpcode = 3;       // an opcode without a device body

// What an op body gets: its op, the arena, the step, the column slice [col_begin, col_end) of its
// output, the block's dynamic shared memory (kSharedBytes) and global scratch (kScratchFloats).
struct TaskCtx {
  const OpDesc* op;
  float* arena;
  const StepView* step;
  int64_t col_begin, col_end;
  unsigned char* smem;
  float* scratch;

  __device__ const float* in(int i, int64_t row) const { return arena + op->in_offset[i] + row * op->in_width[i]; }
  __device__ float* out(int64_t row) const { return arena + op->out_offset + row * op->width; }
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
__device__ __forceinline__ float e8m0_value_dev(uint32_t e) { return e == 0xFF ? __int_as_float(0x7fc00000) : ldexpf(1.0f, static_cast<int>(e) - 127); }
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
