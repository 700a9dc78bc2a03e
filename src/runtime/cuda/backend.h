// cuda backend: runs validated Plans on one GPU. Two modes over the same op bodies (device.cuh):
//  - megakernel: one persistent launch per step, grid = plan.workers blocks (≤ SM count, one per SM),
//    each block walks its queue of 64-byte instructions, waiting on epoch counters (acquire) and
//    bumping them (release).
//  - eager: one launch per plan op, one block per task (baseline and bisection aid).
// Weights live in device memory in their storage dtype (MXFP4 experts stay packed); activations in one
// fp32 arena rounded to the activation dtype exactly where the CPU reference rounds.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "graph/graph.h"
#include "graph/weights.h"
#include "plan/critical_path.h"
#include "plan/plan.h"
#include "runtime/backend.h"

namespace plow::cuda {

class NcclComm;
struct DeviceWeightSet;  // weights in device memory, by graph weight id

// Copies bound checkpoint weights to the device (MXFP4 stays packed).
std::shared_ptr<DeviceWeightSet> upload_weights(const Graph& graph, const BoundWeights& weights);
// Draws every declared weight on the device from `seed` with the generator and distributions of
// graph/random_weights.cpp (benchmarks of models too large for host memory).
std::shared_ptr<DeviceWeightSet> random_device_weights(const Graph& graph, uint64_t seed, DType dtype);
int64_t device_weight_bytes(const DeviceWeightSet& weights);
// The roofline's denominator: GB/s of a streaming read of `bytes` (16-byte loads, all SMs), median of
// several timed passes over a buffer far larger than the L2.
double measure_read_bandwidth_gbps(int64_t bytes, int device = 0);

inline constexpr int64_t kPeerReduceMaxRows = 64;

// Default row thresholds of the GEMM path (CudaOptions::gemm_min_rows, decode_gemm_min_rows), from
// `plow bench decode --gemm-plans` on the H200, 48B shape, context 4096, ms a step on the decode
// plan's megakernel / eager / a 2,048-row prefill plan's GEMM path: batch 4 16.1 / 14.8 / 15.1,
// batch 8 26.2 / 24.1 / 17.5, batch 16 45.6 / 42.2 / 21.8, batch 32 85.7 / 79.0 / 28.9. The routed
// experts make the difference: the decode bodies stream each token's experts on their own, the GEMM
// path groups the step's tokens by expert (moe_gemm.h). Below 8 rows the megakernel's decode plans
// stay (batch 1: 8.5 ms a step).
inline constexpr int64_t kGemmMinRows = 8;  // a step on a prefill plan takes its GEMM path from this many rows
inline constexpr int64_t kDecodeGemmMinRows = 8;  // decode steps of this many sequences run on a prefill plan

struct CudaOptions {
  DType act_dtype = DType::F32;
  int num_slots = 1;
  int64_t max_context_tokens = 4096;  // per slot: MLA latent rows reserved at construction
  bool eager = false;                 // one launch per op instead of the megakernel
  bool poison_arena = false;          // tests: fill the activation arena with NaN before every step
  int device = 0;
  // Tensor parallelism: this rank's communicator (not owned; on `device`). Plans with all_reduce ops
  // need one: each all_reduce is an NCCL call between megakernel segments (eager: before its launch).
  NcclComm* comm = nullptr;
  // Tensor parallelism: steps of plans of ≤ kPeerReduceMaxRows rows (decode) run their all_reduces
  // inside the kernel over peer-mapped memory (peer_reduce.h), without NCCL calls or segment cuts;
  // false, or GPUs that cannot map each other's memory: NCCL between segments.
  bool peer_all_reduce = true;
  // Prefill steps of ≥ gemm_min_rows rows run the plan's plain linear ops as cuBLAS GEMMs between megakernel
  // segments (prefill_gemm.h); false: every op on its plan body (the GEMV path, for comparison).
  bool prefill_gemm = true;
  int64_t gemm_min_rows = kGemmMinRows;
  // Decode steps of ≥ this many sequences run on the smallest prefill plan that holds them and has a
  // GEMM path active at that many rows, instead of a decode plan (0: never; kDecodeGemmMinRows above).
  int64_t decode_gemm_min_rows = kDecodeGemmMinRows;
  // On that path, mla_attention ops run as cuBLAS GEMMs in the expanded form too (mla_gemm.h), in steps
  // where a sequence brings ≥ 32 tokens; false: their op body (split-KV, absorbed), for comparison.
  bool prefill_mla_gemm = true;
  // And kda_delta_rule ops run chunked as planned launches (kda_prefill.h), in steps where every sequence
  // brings ≥ 16 tokens; false: their op body (prep and scan inside the megakernel), for comparison.
  bool prefill_kda_planned = true;
  // And a plain linear's GEMM output is rounded by its readers as they load it (prefill_gemm.h
  // round_in_mask) instead of by its own tasks in a pass over its rows, where every reader can; false:
  // every such linear's tasks round it (for comparison: the outputs are the same bits).
  bool prefill_round_in_readers = true;
  // The fp32 scores of one MLA GEMM block stay within this many bytes (tests make it small to force
  // blocks of few query rows and heads).
  int64_t mla_scores_bytes = int64_t{512} << 20;
  // Steps with StepInputs::draws draw their rows on the device (sample.cuh) and download the ids.
  bool device_sampling = true;
  // AttnRes work items take at least this many columns of a row (ops/attn_res.cuh; 0: as many chunks
  // as give about one item a task a phase). `plow bench decode --attn-res-chunk`, to time the cut.
  int64_t attn_res_min_chunk = 0;
};

// Per-opcode time of one step (profile mode): measured by running the step's ops one launch each
// with events (eager order), plus the megakernel's wait statistics.
struct OpcodeProfile {
  std::string op;
  int64_t tasks = 0;
  double ms = 0;
  double bytes = 0;  // weight bytes the op's tasks read
};

class CudaBackend : public Backend {
 public:
  // `graph`: the model's graph the weights were made for; the plans' weight declarations are resolved
  // by name in `weights` (shapes checked). Every plan is validated (validate_plan with this backend's
  // op set) and must fit the device (workers ≤ SMs).
  CudaBackend(const Graph& graph, std::shared_ptr<DeviceWeightSet> weights, std::vector<Plan> plans, const CudaOptions& options);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // With a communicator, also folds the ranks' argmaxes on the device (last_folded_argmax).
  StepOutput step(const StepInputs& inputs) override;
  void reset_slot(int slot) override;
  int64_t context_tokens(int slot) const override;
  bool draws_rows() const override;
  int num_slots() const override;
  DType act_dtype() const override;
  // Prefix caching: the slot's states copied to and from the host (conv windows and KDA state whole,
  // MLA latent rows from rows_begin), exact floats, so a restored slot continues bit-identically.
  bool has_snapshots() const override { return true; }
  SlotSnapshot save_slot(int slot, int64_t rows_begin) const override;
  void restore_slot(int slot, const SlotSnapshot& snapshot) override;

  // Whether the device has a body for `opcode`.
  static bool has_op(uint8_t opcode);
  static int sm_count(int device = 0);
  static std::string device_name(int device = 0);

  // Benchmarks: runs a decode step over `batch` sequences in slots 0..batch−1 at their current context
  // without downloading logits (greedy ids stay on the device and feed the next step). Returns ms.
  // `prefill_plan`: on the smallest prefill plan that holds the batch (its GEMM path) instead of a
  // decode plan. kDecodeWarmupSteps untimed steps run first.
  static constexpr int kDecodeWarmupSteps = 3;
  double timed_decode_steps(int batch, int steps, bool prefill_plan = false);
  // Sets every slot's context to `tokens` (caches filled with the values already there) so a decode
  // step attends over that many cached positions — for benchmarks at long context.
  void fake_context(int64_t tokens);
  std::vector<OpcodeProfile> profile_decode_step(int batch);
  // `steps` decode steps of `batch` rows, each one megakernel launch that records when each task's
  // worker was free for it, its wait ended, its body started and ended (KernelParams::trace); per step
  // the measured critical path (plan/critical_path.h). None for a plan whose step is not one launch
  // (GEMMs between segments, a tensor-parallel rank's collectives).
  std::vector<CriticalPath> trace_decode_steps(int batch, int steps);
  void set_eager(bool eager);  // switch between the megakernel and one launch per op (same weights and state)
  void set_device_sampling(bool on);  // CudaOptions::device_sampling from the next step (benchmarks)
  // Tensor parallelism: in-kernel all_reduces on or off from the next step (every rank alike).
  void set_peer_all_reduce(bool on);
  bool last_step_peer_all_reduce() const;
  // Diagnosis: runs one decode step's ops one launch at a time, each waited for with a host timeout;
  // prints each op's label, tasks and time to stderr, and returns the index of the first op that did
  // not finish within `timeout_ms` (the process cannot reclaim such a GPU: the caller should exit), or −1.
  int diagnose_decode_step(int batch, double timeout_ms);
  const Plan& plan(int index) const;
  int last_plan() const;
  // Tensor parallelism: after a step, per sequence the argmax of the whole vocabulary (lowest id on
  // ties) folded on the device from every rank's block through an all-gather: the token this rank
  // would emit (the cross-rank gate compares it between ranks). Empty without a communicator.
  const std::vector<int32_t>& last_folded_argmax() const;
  // Prefill GEMMs run through cuBLAS since construction (prefill_gemm.h; tests and benchmarks).
  int64_t prefill_gemms() const;
  // Of the plans' linears with a GEMM form, those whose readers round the output (no rounding pass).
  int64_t prefill_linears_rounded_by_readers() const;
  // Routed-expert ops (moe_gate_up, moe_down) run as expert GEMMs since construction (moe_gemm.h), the
  // tokens per expert of the last routing they read, and how the last one's GEMMs ran ("wgmma grouped",
  // "cublas grouped", "cublas per expert", "expert gemv"; "none" before any).
  int64_t prefill_expert_ops() const;
  std::vector<int32_t> last_expert_tokens() const;
  std::string last_expert_gemm() const;
  // Benchmarks and tests: cuBLAS's grouped call for the expert GEMMs instead of the wgmma kernel.
  void set_expert_gemm_cublas(bool on);
  // Benchmarks and tests: MLA prefill attention on the mma.sync kernel (mla_flash.cuh) where the wgmma
  // one (mla_wgmma.cu) would run.
  void set_mla_flash_mma_sync(bool on);
  bool last_expert_gemv() const;  // the last one ran as the expert GEMV (moe_gemm.h: few pairs an expert)
  // Benchmarks: the expert ops' routing reads since the last reset, and the distinct experts they
  // routed to, summed over the reads.
  struct ExpertRouting {
    int64_t reads = 0, experts = 0;
  };
  ExpertRouting expert_routing() const;
  void reset_expert_routing_stats();
  // Benchmarks: stream time of the expert ops (routing sort, gather, GEMMs, epilogue) summed while on;
  // expert_ms() waits for the stream.
  void set_expert_timing(bool on);
  double expert_ms();
  // Of it: the routing sort (on the device for steps whose GEMMs take the wgmma kernel, else on the
  // host with the stream idle) and the GEMMs of steps past the expert GEMV; the rest is the gathers and
  // epilogues. Reset with it.
  struct ExpertParts {
    double sort_ms = 0, gemm_ms = 0;
  };
  ExpertParts expert_parts_ms();
  void reset_expert_ms();
  // mla_attention ops run as MLA GEMMs since construction (mla_gemm.h), the score blocks they ran
  // (fp32: more than ops × sequences when the scores budget split a sequence's queries or heads) and the
  // sequences they attended in the fused kernel (bf16, f16: mla_flash.cuh).
  int64_t prefill_mla_ops() const;
  int64_t prefill_mla_blocks() const;
  int64_t prefill_mla_flash() const;
  int64_t prefill_mla_wgmma() const;  // of those, the sequences on the wgmma kernel (mla_wgmma.cu)
  int64_t prefill_mla_gated() const;  // MLA ops run as GEMMs with K3's output gate in their epilogue
  // Benchmarks: stream time of the MLA GEMM ops (append, expansion, scores, softmax, P·V) summed while
  // on; mla_ms() waits for the stream.
  void set_mla_timing(bool on);
  double mla_ms();
  double mla_attention_ms();  // of mla_ms(), the attention alone (no latents' append, no K/V expansion)
  void reset_mla_ms();
  // kda_delta_rule ops run as planned launches since construction (kda_prefill.h), and the launch pairs
  // they took (more than ops when a step's records were split into batches); their stream time while
  // timing is on (kda_ms() waits for the stream).
  int64_t prefill_kda_ops() const;
  int64_t prefill_kda_batches() const;
  void set_kda_timing(bool on);
  double kda_ms();
  double kda_prep_ms();  // of that, the prep launches (the rest: the scans)
  void reset_kda_ms();
  // Profiling: while on, every step runs one launch per op (eager order) with an event pair around each
  // op and its host part (GEMMs, expert GEMMs, MLA GEMMs, NCCL), waited for at the step's end; per
  // opcode the summed stream time and tasks, largest first. Steps are slower while on (a host wait per
  // step, no megakernel): for finding where a step's time goes, not for timing it.
  void set_op_timing(bool on);
  std::vector<OpcodeProfile> op_times() const;
  void reset_op_times();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace plow::cuda
