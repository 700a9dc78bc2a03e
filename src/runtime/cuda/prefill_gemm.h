// Prefill on tensor cores (issue H, first slice): a prefill plan's plain linear and router_logits ops
// run as one cuBLAS GEMM each, between megakernel segments, when a step has ≥ CudaOptions::gemm_min_rows
// rows (backend.h: 8 by default; decode batches that large run here too); the op's own tasks then only
// round the fp32 GEMM output to the activation dtype (ops/round_rows.cuh), as the GEMV body rounds its
// dots. Internal to src/runtime/cuda (backend.cpp).
#pragma once

#include <cublas_v2.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "plan/plan.h"
#include "runtime/cuda/device_memory.h"
#include "runtime/cuda/kda_prefill.h"
#include "runtime/cuda/last_rows.h"
#include "runtime/cuda/mla_gemm.h"
#include "runtime/cuda/moe_gemm.h"
#include "runtime/cuda/staging_lru.h"

namespace plow::cuda {

// One linear op as a GEMM: y[T, out] = x[T, in]·Wᵀ with W [out, in] row-major; x rows at arena +
// x_offset (row stride x_stride), y rows at arena + y_offset (row stride `out`), both fp32.
struct GemmOp {
  DeviceWeight weight;
  int64_t x_offset = 0, y_offset = 0, in = 0, out = 0;
  int64_t x_stride = 0;  // floats between input rows: the input's width, or its source's for a slice view
  int32_t round_to = 0;  // the op's output dtype (ActType: kAF32 when it is not rounded), for run_output
  int32_t x_op = -1;     // the plan op whose output (or view of one) the GEMM reads
};

// The GEMM form of `op`, when it has one: a plain kLinear or kRouterLogits over one dense matrix whose
// input values are exact in the GEMM's input type. The GEMM's fp32 output is what the op's rounding
// tasks leave as it is where the op's dtype is fp32 (router logits: never rounded, OpDesc::round_out 0). fp32 weights: an fp32 GEMM (no TF32) over the arena as is; bf16 or
// f16 weights: activations of that dtype (input op rounded to it), converted exactly; else nullopt.
std::optional<GemmOp> gemm_form(const Plan& plan, const PlanOp& op, const DeviceWeight& weight, int32_t act);

// Readers that round a GEMM's output themselves. A plain linear's GEMM leaves fp32 sums, which its
// tasks round to the activation dtype (ops/round_rows.cuh) in a pass of their own over the output
// rows (an 8K prompt's q, k, v, f_b and g_b projections are [8,192, 4,096] each). The op bodies of
// these opcodes round their inputs as they load them where OpDesc::round_in marks them instead, and a
// GEMM that reads the output converts it to its 16-bit input type with the same rounding; a linear
// whose every reader is one of the two skips the pass (kOpHostDone).
bool rounds_inputs_on_load(Op op);
// OpDesc::round_in of `reader` in `plan`: bit i for each input i that is a plain linear's output in
// the activation dtype, when the plan is a prefill plan and the reader's body rounds on load.
int32_t round_in_mask(const Plan& plan, const PlanOp& reader);

// The plan's queues cut into megakernel launches: each segment first runs its host ops (all_reduce,
// GEMMs) on the stream, then the tasks of ops [first_op, next segment's first_op) in queue order. A
// host op opens a segment; host ops right after it that read none of the group's outputs join it.
// `skip_op` (≥ 0): an op whose tasks are left out, the host doing all of its work. `also_reads` (per
// op, −1 for none): an op a host op reads besides its inputs (the MLA epilogue's output gate).
struct Segment {
  int32_t first_op = 0;
  std::vector<int32_t> host_ops;
  DeviceBuffer instrs, queue_begin;
  int64_t tasks = 0;  // none: only the host ops run
};
std::vector<Segment> build_segments(const Plan& plan, const std::vector<Instr>& by_task, const std::vector<bool>& host_op, int32_t skip_op = -1,
                                    const std::vector<int32_t>* also_reads = nullptr);

// One way to run a GEMM step: the segments cut at its host ops and the all_reduces, and the task-order
// instructions (eager) where the host ops' tasks only round (a no-op on the MoE and MLA ops' outputs,
// which the host's kernels wrote rounded).
struct GemmSchedule {
  std::vector<Segment> segments;
  DeviceBuffer task_instrs;
};

// The GEMM path of one plan: per plan op its GEMM form, its routed-expert GEMM form (moe_gemm.h), its
// MLA GEMM form (mla_gemm.h) or its planned KDA form (kda_prefill.h), or none; up to four schedules:
// every form a host op, and the MLA ops (steps where no sequence brings kMlaGemmMinTokens tokens), the
// KDA ops (steps with a sequence under kKdaChunkedMinTokens) or both on their op bodies (empty where
// the plan has no such forms).
struct GemmPath {
  std::vector<std::optional<GemmOp>> ops;
  std::vector<std::optional<MoeGemmOp>> moe_ops;
  std::vector<std::optional<MlaGemmOp>> mla_ops;
  std::vector<std::optional<KdaPrefillOp>> kda_ops;
  GemmSchedule all_host, mla_body, kda_body, both_body;
  // The plan's output op (the LM head) when the host does all of it (GemmRunner::run_output): a GEMM
  // over the rows whose logits the step returns, rounded by the host; its tasks are left out of both
  // schedules. −1 when it keeps its rounding tasks (no GEMM form, a tensor-parallel plan, a reader or a
  // counter after it).
  int32_t output_on_host = -1;
  int64_t max_input_elems = 0;  // the largest GEMM input (rows × in) the plan can bring
  int64_t rounded_by_readers = 0;  // linears whose readers round their GEMM output (outputs_rounded_by_readers)
  MoeGemmCapacity moe_capacity;  // what its MoE ops need at max_tokens rows
  MlaGemmCapacity mla_capacity;  // what its MLA ops need at max_tokens rows
  KdaPrefillCapacity kda_capacity;  // what its KDA ops need at max_tokens rows
  bool available() const { return !all_host.segments.empty(); }
  bool active(int64_t rows, int64_t min_rows) const { return available() && rows >= min_rows; }
  // The schedule of a GEMM step; `mla`: its MLA ops run as GEMMs; `kda`: its KDA ops as planned launches.
  const GemmSchedule& schedule(bool mla, bool kda) const {
    const bool mla_host = mla || mla_body.segments.empty(), kda_host = kda || kda_body.segments.empty();
    if (mla_host && kda_host) return all_host;
    if (kda_host) return mla_body;
    return mla_host ? kda_body : both_body;
  }
};
// Empty for decode plans, plans of fewer than `min_rows` rows and plans without any GEMM form.
// `weights`: the plan's weights on the device; `reduce`: its all_reduce ops (host ops on every path);
// `mla`: whether mla_attention ops may take their GEMM form; `kda`: kda_delta_rule ops their planned one;
// `readers_round`: whether the readers' round_in (set with it) may stand in for a linear's rounding tasks.
GemmPath plan_gemm_path(const Plan& plan, const std::vector<DeviceWeight>& weights, const std::vector<Instr>& by_task, const std::vector<bool>& reduce,
                        int32_t act, bool mla, bool kda, bool readers_round, int64_t min_rows);

// cuBLAS on one stream: a handle, its workspace, and the bf16/f16 copies of GEMM inputs. A step's
// GEMMs often read one input (a KDA layer's six projections of the normed hidden state, an MoE
// layer's router and shared expert): a copy of op X's output stays valid for the step (X's rows are
// not rewritten while an op still reads them), so each input is converted once a step, into one of
// kStagingSlots buffers (StagingLru: the least recently used is overwritten). Copies are keyed by the
// producing op, never by address alone: the arena gives a dead op's rows to later ops.
class GemmRunner {
 public:
  static constexpr int kStagingSlots = 2;

  GemmRunner(int64_t max_input_elems, cudaStream_t stream);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // A new step: the staged copies are stale.
  void new_step() { staged_.clear(); }
  // y = x·Wᵀ over `rows` rows, fp32 accumulate, fp32 out (unrounded: the op's tasks round).
  void run(const GemmOp& op, float* arena, int64_t rows);
  // The output op, rounded here to op.round_to (its tasks do not run). With `last` and 16-bit weights
  // only the sequences' last rows: their logits land in rows 0..num_seqs−1 of the output, and the
  // function returns true; otherwise every row, in place, and false.
  bool run_output(const GemmOp& op, float* arena, int64_t rows, const LastRows* last);
  cublasHandle_t handle() const { return handle_; }
  int64_t calls() const { return calls_; }

 private:
  // What a staging slot holds: a copy of `op`'s output rows (or a view of them) at x.
  struct StagedKey {
    int32_t op = -1;
    const float* x = nullptr;
    int64_t rows = 0, cols = 0, stride = 0;
    int32_t type = -1;
    bool operator==(const StagedKey&) const = default;
  };
  // op's input rows as a packed 16-bit array (its weight's type), converted unless a slot holds them.
  const void* staged_input(const GemmOp& op, const float* x, int64_t rows);
  void gemm(const GemmOp& op, const void* x, int64_t ldx, float* y, int64_t rows);

  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer staging_, workspace_;
  int64_t slot_elems_ = 0;
  StagingLru<StagedKey, kStagingSlots> staged_;
  int64_t calls_ = 0;
};

// fp32 rows [rows, cols] (row stride `stride` floats) to a packed bf16 (type kWBF16) or f16 array; with
// `last`, its num_seqs rows are the sequences' last rows (`rows` is ignored).
void launch_to_half(const float* x, int64_t rows, int64_t cols, int64_t stride, void* out, int32_t type, cudaStream_t stream, const LastRows* last = nullptr);
// Rows [rows, cols] (packed) rounded in place to `act` (ActType; kAF32: nothing to do).
void launch_round_in_place(float* y, int64_t rows, int64_t cols, int32_t act, cudaStream_t stream);

// The benchmark's kernel-level comparison at one projection shape [rows × in]·[in × out], bf16 weights,
// random operands, median of `reps` timed calls each: `ours` is GemmRunner::run as a step's first linear
// over its input runs it (fp32 arena → bf16 copy → GEMM, fp32 out; the rounding tasks not included),
// `ours_gemm` the same call on an input already converted (every later linear over that input in the
// step: a KDA layer's six projections read one), `cublas` the library alone (bf16 in and out),
// `convert` the input's conversion alone (what a step pays once per input it converts).
struct GemmTimes {
  double ours_ms = 0, ours_gemm_ms = 0, cublas_ms = 0, convert_ms = 0;
};
GemmTimes time_prefill_gemm(int64_t rows, int64_t out, int64_t in, int reps, int device);

}  // namespace plow::cuda
