// The kernels of the cuda backend and their launchers: the persistent megakernel, the eager per-op
// kernel, on-device argmax, random weight fill. Host code (backend.cu) builds the instruction stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "runtime/cuda/device_types.h"
#include "runtime/cuda/sample.h"

namespace plow::cuda {

// The megakernel's copy of an op's descriptor: the OpDesc, then (when they fit in kDescBytes) its
// arrays in_offset, in_width, in_stride ([num_inputs] int64 each) and weights ([num_weights]), 16-byte
// aligned records in KernelParams::descs. A record of kDescHeadBytes keeps the OpDesc's global array
// pointers; a longer one holds the arrays, and the kernel points the OpDesc at its copies.
inline constexpr int kDescBytes = 2048;
inline constexpr int kDescHeadBytes = (static_cast<int>(sizeof(OpDesc)) + 15) / 16 * 16;
inline constexpr int kInlineSignals = 2;

// One task as the device reads it: 64 bytes, decoded from the plan on the host once.
struct alignas(64) Instr {
  int32_t op = 0;              // OpDesc index
  int32_t opcode = 0;
  int32_t wait_counter = 0;
  uint32_t wait_threshold = 0; // per step: the counter must reach threshold × epoch
  int32_t signal_begin = 0;    // into KernelParams::signals, when num_signals > kInlineSignals
  int32_t num_signals = 0;
  int64_t col_begin = 0, col_end = 0;
  int32_t task = 0;            // index of this task among its op's tasks (0 .. OpDesc::tasks − 1)
  int32_t desc = 0;            // byte offset of the op's record in KernelParams::descs
  int32_t next_desc = 0;       // the next task's in this queue (link_queues), which the megakernel loads while this one runs
  uint16_t desc_bytes = 0, next_desc_bytes = 0;  // record sizes; next_desc_bytes 0 after a queue's last task
  int32_t signal[kInlineSignals] = {};  // the counters to bump, when num_signals ≤ kInlineSignals
};
static_assert(sizeof(Instr) == 64, "instructions are 64 bytes");

// Fills every task's next_desc / next_desc_bytes from the task after it in its queue (queue q:
// instrs [begins[q], begins[q + 1])).
inline void link_queues(std::vector<Instr>& instrs, const std::vector<int32_t>& begins) {
  for (size_t q = 0; q + 1 < begins.size(); ++q) {
    for (int32_t i = begins[q]; i < begins[q + 1]; ++i) {
      const bool last = i + 1 == begins[q + 1];
      instrs[static_cast<size_t>(i)].next_desc = last ? 0 : instrs[static_cast<size_t>(i) + 1].desc;
      instrs[static_cast<size_t>(i)].next_desc_bytes = last ? 0 : instrs[static_cast<size_t>(i) + 1].desc_bytes;
    }
  }
}
// Instr::opcode of a task whose op the host ran as a GEMM (prefill_gemm.h): it rounds its output
// columns in place (ops/round_rows.cuh). Outside the Op range.
inline constexpr int32_t kOpRoundRows = 0x100;
// Instr::opcode of a task whose op the host ran whole, its output already rounded (the routed experts',
// MLA's and KDA's planned launches): it does nothing but count, for the op's readers in the segment.
inline constexpr int32_t kOpHostDone = 0x101;
// Per-opcode profile slots: the plan's opcodes, then one for kOpRoundRows and kOpHostDone (the host
// ops' tasks, "round_rows" in the profile).
inline constexpr int kProfileSlots = 64;
inline constexpr int profile_slot(int32_t opcode) { return opcode == kOpRoundRows ? kProfileSlots - 1 : opcode < kProfileSlots - 1 ? opcode : kProfileSlots - 1; }

inline constexpr int kTraceFields = 4;
inline constexpr int kTraceClockFields = 4;

struct KernelParams {
  const Instr* instrs = nullptr;       // megakernel: queues back to back; eager: tasks in plan order
  const int32_t* queue_begin = nullptr;  // [workers + 1] into instrs (megakernel)
  const int32_t* signals = nullptr;
  const OpDesc* ops = nullptr;         // eager: read in place
  const unsigned char* descs = nullptr;  // megakernel: the ops' descriptor records (Instr::desc)
  float* arena = nullptr;
  unsigned* counters = nullptr;
  float* scratch = nullptr;            // kScratchFloats per block
  unsigned long long* profile = nullptr;  // megakernel: per block {wait cycles, run cycles, tasks, cycles from start to end}, or null
  unsigned long long* op_profile = nullptr;  // megakernel: per opcode slot (profile_slot) {wait cycles, run cycles, tasks}, or null
  // megakernel, or null: per queue position i (instrs order) the clock64 values {free, ready, start,
  // end} of its task (kTraceFields), then per block {globaltimer, clock64} read together at a tick of
  // the global timer as the block starts and again as it ends (kTraceClockFields): the host maps each
  // block's clock onto the global timer (trace_to_ns).
  unsigned long long* trace = nullptr;
  StepView step;
  uint32_t epoch = 0;
};

bool device_has_op(int opcode);
// A failed CUDA call or launch: plow::Error naming `what` (defined in backend.cpp, outside nvcc's view of fmt).
[[noreturn]] void cuda_failure(const char* what, cudaError_t error);
void configure_kernels();  // raises the dynamic shared-memory limits (once per device, on the current one)
// max_rows: the plan's rows (its bucket); plans of one row run kernels whose GEMV bodies carry the
// one-row pass alone (gemv_task's kCap).
void launch_megakernel(const KernelParams& params, int workers, int64_t max_rows, cudaStream_t stream);
void launch_eager(const KernelParams& params, int first_instr, int count, int64_t max_rows, cudaStream_t stream);
// For each sequence s: the argmax (lowest index on ties) of logits row (first_row[s] + tokens[s] − 1)
// of [rows, vocab] at `logits` (row s when first_row is null: the compact rows of a step's last
// tokens); written to ids[s] and, when token_out is set, to token_out[s] as a float.
void launch_argmax(const float* logits, int64_t vocab, const int32_t* first_row, const int32_t* tokens, int num_seqs, int32_t* ids,
                   float* token_out, cudaStream_t stream);

// For each sequence s: the token drawn from the same row launch_argmax reads, with rows[s]'s controls
// and uniform (sample.cuh: a block of kSampleThreads a row); written to ids[s].
void launch_sample(const float* logits, int64_t vocab, const int32_t* first_row, const int32_t* tokens, const RowSampling* rows, int num_seqs,
                   int32_t* ids, cudaStream_t stream);

// Tensor parallelism, the argmax fold of a column-parallel lm_head. Candidates: per sequence s the
// best (value, vocab_offset + id) of this rank's block, as cand[2s] = value, cand[2s+1] = id (an int's
// bits). Fold: over `ranks` candidate arrays back to back, the best value (lowest id on ties) into
// ids[s] and, when set, token_out[s] as a float.
void launch_argmax_candidates(const float* logits, int64_t vocab, int64_t vocab_offset, const int32_t* first_row, const int32_t* tokens,
                              int num_seqs, float* cand, cudaStream_t stream);
void launch_fold_argmax(const float* cands, int ranks, int num_seqs, int32_t* ids, float* token_out, cudaStream_t stream);

// Reads `bytes` at `data` once with 16-byte loads over blocks_per_sm × SMs blocks (the bandwidth probe).
void launch_read_probe(const uint8_t* data, int64_t bytes, uint32_t* sink, int sms, cudaStream_t stream);

// Random weights with the generator of graph/random_weights.cpp: kind selects the distribution.
enum class FillKind : int32_t { kLinear, kNorm, kEmbedding, kResProj, kRouter, kZero, kALog, kMxfp4Codes, kMxfp4Scales };
void launch_fill(uint8_t* data, int64_t count, int32_t type, FillKind kind, uint64_t seed, uint64_t tensor, float fan_in, int32_t scale_base,
                 cudaStream_t stream);

}  // namespace plow::cuda
