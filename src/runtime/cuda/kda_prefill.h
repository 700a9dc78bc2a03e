// KDA's delta rule of a prefill step as planned launches (issue H): on the GEMM path (prefill_gemm.h) a
// plan's kda_delta_rule op runs on the host between megakernel segments, in the chunked form of the CPU
// reference (MODEL.md §6, C = 64; kda_prefill.cu), when every sequence of the step brings at least
// kKdaChunkedMinTokens tokens (prefill steps); steps with shorter sequences (decode rows) keep the op
// body, which runs those token by token. Internal to src/runtime/cuda (backend.cpp, prefill_gemm.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "plan/plan.h"
#include "runtime/cuda/device_memory.h"
#include "runtime/cuda/kda_prefill_kernels.h"
#include "runtime/cuda/mla_gemm.h"  // MlaSequence: the step's sequences as uploaded
#include "runtime/cuda/stream_timer.h"

namespace plow::cuda {

// One kda_delta_rule op: q, k, v [T, heads·d] (activations), g [T, heads·d] (fp32 log-decay), β [T,
// heads] (fp32) at arena offsets with their row strides; the output [T, heads·d]; the state index
// (fp32 [heads, d, d] per slot).
struct KdaPrefillOp {
  int64_t q_offset = 0, q_stride = 0, k_offset = 0, k_stride = 0, v_offset = 0, v_stride = 0;
  int64_t g_offset = 0, g_stride = 0, beta_offset = 0, beta_stride = 0;
  int64_t out_offset = 0, width = 0, heads = 0, d = 0;
  int32_t state = -1;
  int32_t out_act = kAF32;  // the output's rounding (the activation dtype, or kAF32)
};

// The planned form of `op` when it has one: a kKdaDeltaRule of head dim ≤ kKdaMaxHeadDim with its state.
std::optional<KdaPrefillOp> kda_prefill_form(const Plan& plan, const PlanOp& op, int32_t act);

// What the runner's workspace must hold: the most step rows and heads of the plans' ops.
struct KdaPrefillCapacity {
  int64_t rows = 0, heads = 0;
  void add(const KdaPrefillOp& op, int64_t max_rows);
  void merge(const KdaPrefillCapacity& other);
};

// Runs kda_delta_rule ops on one stream. Per step that takes them (takes()): new_step(), then run() for
// each op in plan order.
class KdaPrefillRunner {
 public:
  KdaPrefillRunner(const KdaPrefillCapacity& capacity, cudaStream_t stream);
  KdaPrefillRunner(const KdaPrefillRunner&) = delete;
  KdaPrefillRunner& operator=(const KdaPrefillRunner&) = delete;

  // Whether a step of these sequences runs its KDA ops here: every one brings at least
  // kKdaChunkedMinTokens tokens.
  static bool takes(const std::vector<MlaSequence>& seqs);
  // The step's chunk and sequence tables, uploaded once for its ops, in batches whose records fit.
  void new_step(const std::vector<MlaSequence>& seqs);
  // The op over the step: its output rows written, the sequences' states advanced.
  void run(const KdaPrefillOp& op, float* arena, const DeviceState& state);

  int64_t calls() const { return calls_; }
  int64_t batches() const { return batches_run_; }  // launch pairs (tests: that a step was split)
  // Timing (benchmarks): with it on, each op's stream time is added up, and apart its prep launches'
  // (the rest is the scans); the totals synchronize.
  void set_timing(bool on) { timing_ = on; }
  double timed_ms() { return timer_.total_ms(); }
  double prep_ms() { return prep_timer_.total_ms(); }
  void reset_timed_ms() {
    timer_.reset();
    prep_timer_.reset();
  }

 private:
  struct Batch {
    int32_t first_chunk = 0, chunks = 0, first_seq = 0, seqs = 0;
  };
  cudaStream_t stream_ = nullptr;
  KdaPrefillCapacity capacity_;
  int64_t max_chunks_ = 0;  // records a batch may hold, per head
  DeviceBuffer records_, tables_;
  std::vector<int32_t> host_tables_;
  std::vector<Batch> batches_;
  int64_t total_chunks_ = 0, total_seqs_ = 0;
  int64_t calls_ = 0, batches_run_ = 0;
  bool timing_ = false;
  StreamTimer timer_, prep_timer_;
};

// ---- device side (kda_prefill.cu) -------------------------------------------------------------------

// Every (chunk, head) of the batch into its record (prep), then per (value-column group, head,
// sequence) the scan over its chunks: outputs written, states advanced. d ≤ kKdaMaxHeadDim.
void launch_kda_prep(const KdaPrefillArgs& args, cudaStream_t stream);
void launch_kda_scan(const KdaPrefillArgs& args, cudaStream_t stream);

}  // namespace plow::cuda
