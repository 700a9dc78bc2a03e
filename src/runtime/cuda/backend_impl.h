// CudaBackend's state and its per-step machinery (internal to src/runtime/cuda): shared by backend.cpp
// (construction, steps, slots) and backend_tools.cpp (the benchmarks' timed steps, the profile and the
// diagnosis).
#pragma once

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nvtx3/nvToolsExt.h>

#include "core/error.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/device_memory.h"
#include "runtime/cuda/kda_prefill.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/mla_gemm.h"
#include "runtime/cuda/moe_gemm.h"
#include "runtime/cuda/nccl_comm.h"
#include "runtime/cuda/peer_reduce.h"
#include "runtime/cuda/prefill_gemm.h"

namespace plow::cuda {

struct CudaBackend::Impl {
  struct PreparedPlan {
    Plan plan;
    DeviceBuffer ops, op_inputs, op_weights, queue_instrs, task_instrs, queue_begin, signals, counters;
    DeviceBuffer descs;  // the ops' descriptor records, as the megakernel copies them (kernels.h)
    DeviceBuffer op_sync;  // kOpCounters per op (OpDesc::sync), 0 between steps
    std::vector<std::pair<int32_t, int32_t>> op_tasks;  // per op: [first, end) in task order
    std::vector<int64_t> token_offsets;                 // arena offsets of the kTokens ops
    uint32_t max_threshold = 1;
    uint32_t epoch = 0;
    // Tensor parallelism: the megakernel runs in segments split at the all_reduce ops; before a
    // segment the host enqueues the NCCL all-reduces that open it. None without all_reduce ops.
    std::vector<Segment> segments;
    bool peer_reduce = false;  // small enough for the in-kernel all_reduce (peer_reduce.h)
    GemmPath gemm;  // steps of ≥ options.gemm_min_rows rows: linears as cuBLAS GEMMs (prefill_gemm.h)
  };

  std::shared_ptr<DeviceWeightSet> weights;
  CudaOptions options;
  cudaStream_t stream = nullptr;
  std::vector<std::unique_ptr<PreparedPlan>> plans;
  std::unique_ptr<GemmRunner> gemm_runner;  // when a plan has a GEMM path
  std::unique_ptr<MoeGemmRunner> moe_runner;  // when a plan's GEMM path has routed-expert ops (moe_gemm.h)
  std::unique_ptr<MlaGemmRunner> mla_runner;  // when a plan's GEMM path has MLA ops (mla_gemm.h)
  std::unique_ptr<KdaPrefillRunner> kda_runner;  // when a plan's GEMM path has KDA ops (kda_prefill.h)
  std::vector<MlaSequence> step_seqs;         // the current step's sequences, as uploaded (the MLA host ops)
  // A GEMM step whose output op the host runs (GemmPath::output_on_host) computes only the logits the
  // step returns when last_logits_only is set (step(), for a step without all_logits); compact_logits
  // then says that row s of the output holds sequence s's last row.
  bool last_logits_only = false, compact_logits = false;
  DeviceBuffer arena, scratch, state_table, step_ints, error_flag, argmax_ids, profile, op_profile, fold_cands;
  DeviceBuffer sample_rows;  // a step's RowSampling per sequence (options.device_sampling)
  DeviceBuffer workspace;  // shared by the ops whose tasks cooperate (OpDesc::workspace: MLA)
  std::vector<int32_t> last_folded;  // tensor parallelism: the last step's folded argmax per sequence
  std::unique_ptr<PeerReduceArea> peer_area;  // tensor parallelism: the in-kernel all_reduce's slots
  bool peer_failed = false;                   // the areas could not be mapped: NCCL from then on
  bool last_peer = false;                     // the last step's all_reduces ran in the kernel
  uint32_t coll_epoch = 0;                    // steps run by this rank (the same count on every rank)
  std::vector<DeviceBuffer> state_buffers;
  std::vector<DeviceState> states;
  std::vector<int64_t> contexts;  // per slot
  int64_t max_tokens = 0;
  int max_workers = 0;
  int last_plan = -1;

  // The plan of `phase` with the fewest max_tokens that holds `rows` and passes `also`; −1 if none.
  template <typename Pred>
  int smallest_plan(PlanPhase phase, int64_t rows, Pred also) const {
    int best = -1;
    for (size_t i = 0; i < plans.size(); ++i) {
      const PreparedPlan& p = *plans[i];
      if (p.plan.phase != phase || p.plan.max_tokens < rows || !also(p)) continue;
      if (best < 0 || p.plan.max_tokens < plans[static_cast<size_t>(best)]->plan.max_tokens) best = static_cast<int>(i);
    }
    return best;
  }

  int choose(bool decode, int64_t rows) const {
    const PlanPhase phase = decode ? PlanPhase::kDecode : PlanPhase::kPrefill;
    const int best = smallest_plan(phase, rows, [](const PreparedPlan&) { return true; });
    if (best >= 0) return best;
    std::string available;
    for (const auto& prepared : plans) available += fmt::format("{}{} ≤ {}", available.empty() ? "" : ", ", phase_name(prepared->plan.phase), prepared->plan.max_tokens);
    fail("cuda: no {} plan holds a step of {} tokens (plans: {})", phase_name(phase), rows, available);
  }

  // The plan a step runs on: a decode step of ≥ options.decode_gemm_min_rows sequences on the smallest
  // prefill plan whose GEMM path takes it, when there is one; otherwise choose().
  int choose_step(bool decode, int64_t rows) const {
    if (decode && options.decode_gemm_min_rows > 0 && rows >= options.decode_gemm_min_rows) {
      const int best = smallest_plan(PlanPhase::kPrefill, rows, [&](const PreparedPlan& p) { return p.gemm.active(rows, options.gemm_min_rows); });
      if (best >= 0) return best;
    }
    return choose(decode, rows);
  }

  // Uploads the step view (sequences as StepView arrays) and writes the token ids into the arena.
  StepView upload_step(PreparedPlan& prepared, const std::vector<int32_t>& tokens, const std::vector<SequenceStep>& seqs) {
    const auto rows = static_cast<int32_t>(tokens.size());
    const auto n = static_cast<int32_t>(seqs.size());
    std::vector<int32_t> ints;
    ints.reserve(static_cast<size_t>(3 * rows + 4 * n));
    ints.insert(ints.end(), tokens.begin(), tokens.end());
    std::vector<int32_t> row_seq, row_pos, slot, first_row, count, context;
    int32_t row = 0;
    step_seqs.clear();
    for (int32_t s = 0; s < n; ++s) {
      const SequenceStep& seq = seqs[static_cast<size_t>(s)];
      slot.push_back(seq.slot);
      first_row.push_back(row);
      count.push_back(static_cast<int32_t>(seq.query_tokens));
      context.push_back(static_cast<int32_t>(contexts[static_cast<size_t>(seq.slot)]));
      step_seqs.push_back({seq.slot, row, seq.query_tokens, contexts[static_cast<size_t>(seq.slot)]});
      for (int64_t t = 0; t < seq.query_tokens; ++t) {
        row_seq.push_back(s);
        row_pos.push_back(static_cast<int32_t>(contexts[static_cast<size_t>(seq.slot)] + t));
      }
      row += static_cast<int32_t>(seq.query_tokens);
    }
    for (const auto* v : {&row_seq, &row_pos, &slot, &first_row, &count, &context}) ints.insert(ints.end(), v->begin(), v->end());
    check(cudaMemcpyAsync(step_ints.ptr, ints.data(), ints.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream), "step upload");
    const int32_t* base = step_ints.as<int32_t>();
    StepView view;
    view.tokens = rows;
    view.num_seqs = n;
    view.token_ids = base;
    view.row_seq = base + rows;
    view.row_pos = base + 2 * rows;
    view.seq_slot = base + 3 * rows;
    view.seq_first_row = view.seq_slot + n;
    view.seq_tokens = view.seq_first_row + n;
    view.seq_context = view.seq_tokens + n;
    view.states = state_table.as<DeviceState>();
    view.error = error_flag.as<int32_t>();
    std::vector<float> as_float(tokens.begin(), tokens.end());
    for (int64_t offset : prepared.token_offsets) {
      check(cudaMemcpyAsync(arena.as<float>() + offset, as_float.data(), as_float.size() * sizeof(float), cudaMemcpyHostToDevice, stream), "token upload");
    }
    check(cudaStreamSynchronize(stream), "step upload");  // the host vectors die with this call
    return view;
  }

  // A synthetic decode step (benchmarks, diagnosis): sequence s in slot s reads token 1 + s (below the
  // vocabulary), so that the sequences differ and route to different experts as a served batch's do.
  // One token for all made the whole batch route alike: 20 distinct experts an MoE op at batch 32,
  // where uniform routing reaches 163 of 256. Each slot at its current context.
  StepView upload_decode_step(PreparedPlan& prepared, int batch) {
    int64_t vocab = std::numeric_limits<int32_t>::max();
    for (const PlanOp& op : prepared.plan.ops) {
      if (op.op() == Op::kEmbedding && !op.weights.empty()) vocab = prepared.plan.weights[static_cast<size_t>(op.weights.front())].shape.front();
    }
    std::vector<SequenceStep> seqs;
    std::vector<int32_t> ids;
    for (int s = 0; s < batch; ++s) {
      seqs.push_back({s, 1});
      ids.push_back(static_cast<int32_t>((1 + s) % vocab));
    }
    return upload_step(prepared, ids, seqs);
  }

  // Parameters of one launch. Only the megakernel advances the epoch: eager launches never bump the
  // counters, so counting them would leave the next megakernel waiting for a threshold never reached.
  KernelParams params(PreparedPlan& prepared, const StepView& view, bool eager) {
    if (!eager) prepared.epoch += 1;
    if (static_cast<uint64_t>(prepared.max_threshold) * (prepared.epoch + 1) >= (uint64_t{1} << 31)) {  // counters restart before they overflow
      check(cudaMemsetAsync(prepared.counters.ptr, 0, prepared.counters.bytes, stream), "counter reset");
      prepared.epoch = 1;
    }
    KernelParams p;
    p.instrs = eager ? prepared.task_instrs.as<Instr>() : prepared.queue_instrs.as<Instr>();
    p.queue_begin = prepared.queue_begin.as<int32_t>();
    p.signals = prepared.signals.as<int32_t>();
    p.ops = prepared.ops.as<OpDesc>();
    p.descs = prepared.descs.as<unsigned char>();
    p.arena = arena.as<float>();
    p.counters = prepared.counters.as<unsigned>();
    p.scratch = scratch.as<float>();
    p.step = view;
    p.epoch = prepared.epoch;
    if (options.comm) {
      p.step.coll_epoch = ++coll_epoch;
      p.step.peers = peer_table(prepared);
      last_peer = p.step.peers != nullptr;
    }
    return p;
  }

  // The peers' areas when this step's all_reduces run in the kernel, else null (NCCL). The first step
  // that wants them maps them: a collective, reached at the same step by every rank.
  const PeerTable* peer_table(const PreparedPlan& prepared) {
    if (!prepared.peer_reduce || !peer_area || !options.peer_all_reduce || peer_failed) return nullptr;
    if (!peer_area->connected()) {
      std::string why;
      if (!peer_area->connect(*options.comm, stream, &why)) {
        peer_failed = true;
        if (options.comm->rank() == 0) std::fprintf(stderr, "cuda: all_reduce stays on NCCL: %s\n", why.c_str());
        return nullptr;
      }
    }
    return peer_area->table();
  }

  // Tensor parallelism: the ranks' fp32 partial sums (the all_reduce's input) summed by NCCL into its
  // output buffer, over the step's rows; the op's own task then rounds them.
  void all_reduce(const PreparedPlan& prepared, int32_t op_index, const KernelParams& p) {
    const PlanOp& op = prepared.plan.op(op_index);
    const PlanOp& input = prepared.plan.op(op.inputs.at(0));
    options.comm->all_reduce_sum(arena.as<float>() + input.offset, arena.as<float>() + op.offset, static_cast<int64_t>(p.step.tokens) * op.width, stream);
  }

  // The host's part of an op: its NCCL all-reduce, or its GEMM, routed-expert GEMMs, MLA GEMMs or KDA
  // launches (`gemm`: this step takes the GEMM path; `mla`, `kda`: and its MLA, KDA ops theirs). All on
  // the stream, after the segments before the op.
  void run_host_op(const PreparedPlan& prepared, int32_t op_index, const KernelParams& p, bool gemm, bool mla = false, bool kda = false) {
    if (prepared.plan.op(op_index).op() == Op::kAllReduce && p.step.peers == nullptr) all_reduce(prepared, op_index, p);
    if (!gemm) return;
    const auto i = static_cast<size_t>(op_index);
    if (op_index == prepared.gemm.output_on_host) {
      const LastRows last{p.step.seq_first_row, p.step.seq_tokens, p.step.num_seqs};
      compact_logits = gemm_runner->run_output(*prepared.gemm.ops[i], arena.as<float>(), p.step.tokens, last_logits_only ? &last : nullptr);
    } else if (prepared.gemm.ops[i]) {
      gemm_runner->run(*prepared.gemm.ops[i], arena.as<float>(), p.step.tokens);
    }
    if (prepared.gemm.moe_ops[i]) moe_runner->run(*prepared.gemm.moe_ops[i], arena.as<float>(), p.step.tokens);
    if (mla && prepared.gemm.mla_ops[i]) {
      const MlaGemmOp& op = *prepared.gemm.mla_ops[i];
      mla_runner->run(op, arena.as<float>(), states[static_cast<size_t>(op.state)], step_seqs);
    }
    if (kda && prepared.gemm.kda_ops[i]) {
      const KdaPrefillOp& op = *prepared.gemm.kda_ops[i];
      kda_runner->run(op, arena.as<float>(), states[static_cast<size_t>(op.state)]);
    }
  }

  // Whether this GEMM step runs its MLA ops as GEMMs: one of its sequences brings enough tokens to pay
  // for expanding its cache (mla_gemm.h); else the op body, which reads the latents as they are.
  bool mla_gemm_step() const {
    if (!mla_runner) return false;
    return std::any_of(step_seqs.begin(), step_seqs.end(), [](const MlaSequence& s) { return s.tokens >= kMlaGemmMinTokens; });
  }

  // set_op_timing: the step's ops one launch each between events, added to op_times (backend_tools.cpp).
  bool op_timing = false;
  std::map<std::string, OpcodeProfile> op_times;
  std::vector<cudaEvent_t> timing_events;  // destroyed with the stream (~CudaBackend)
  void launch_timed(const PreparedPlan& prepared, const KernelParams& p, bool gemm, bool mla, bool kda);

  // One op's tasks in one launch, after its host part (p.instrs: the task order of the chosen path).
  // Each op is an NVTX range named by its opcode (`ncu --nvtx --nvtx-include "moe_topk/"` picks its
  // launches); without a tool attached a push costs a null check.
  void launch_op(const PreparedPlan& prepared, size_t op_index, const KernelParams& p, bool gemm = false, bool mla = false, bool kda = false) {
    nvtxRangePushA(op_name(prepared.plan.ops[op_index].op()).data());
    run_host_op(prepared, static_cast<int32_t>(op_index), p, gemm, mla, kda);
    const auto [first, end] = prepared.op_tasks[op_index];
    const bool host_only = gemm && static_cast<int32_t>(op_index) == prepared.gemm.output_on_host;
    if (end > first && !host_only) launch_eager(p, first, end - first, prepared.plan.max_tokens, stream);
    nvtxRangePop();
  }

  void launch(PreparedPlan& prepared, const KernelParams& p, bool eager) {
    const bool gemm = prepared.gemm.active(p.step.tokens, options.gemm_min_rows);
    const bool mla = gemm && mla_gemm_step();
    const bool kda = gemm && kda_runner && KdaPrefillRunner::takes(step_seqs);
    compact_logits = false;
    if (gemm && gemm_runner) gemm_runner->new_step();  // the last step's input copies are stale (no runner: a path of MoE or MLA ops only)
    if (gemm && moe_runner) moe_runner->new_step();  // the last step's routing is stale
    if (mla) mla_runner->new_step();
    if (kda) kda_runner->new_step(step_seqs);
    const GemmSchedule& schedule = prepared.gemm.schedule(mla, kda);
    if (eager) {  // step() passes eager while op_timing is on
      KernelParams tasks = p;
      if (gemm) tasks.instrs = schedule.task_instrs.as<Instr>();
      if (op_timing) {
        launch_timed(prepared, tasks, gemm, mla, kda);
        return;
      }
      for (size_t i = 0; i < prepared.plan.ops.size(); ++i) launch_op(prepared, i, tasks, gemm, mla, kda);
      return;
    }
    // In-kernel all_reduces need no cuts (a GEMM step keeps its GEMM cuts).
    static const std::vector<Segment> kUncut;
    const std::vector<Segment>& segments = gemm ? schedule.segments : p.step.peers != nullptr ? kUncut : prepared.segments;
    if (segments.empty()) {
      launch_megakernel(p, prepared.plan.workers, prepared.plan.max_tokens, stream);
      return;
    }
    for (const Segment& segment : segments) {
      for (int32_t op : segment.host_ops) run_host_op(prepared, op, p, gemm, mla, kda);
      KernelParams part = p;
      part.instrs = segment.instrs.as<Instr>();
      part.queue_begin = segment.queue_begin.as<int32_t>();
      if (segment.tasks > 0) launch_megakernel(part, prepared.plan.workers, prepared.plan.max_tokens, stream);
    }
  }

  // Tensor parallelism: per sequence, the best logit of this rank's vocabulary block gathered from
  // every rank and folded; ids into argmax_ids and, when set, the next step's token buffer.
  void fold_argmax(const PreparedPlan& prepared, const StepView& view, int num_seqs, float* token_out) {
    const PlanOp& head = prepared.plan.op(prepared.plan.output_op);
    const int ranks = options.comm->size();
    float* mine = fold_cands.as<float>();
    float* all = mine + 2 * max_tokens;
    launch_argmax_candidates(arena.as<float>() + head.offset, head.width, head.width * options.comm->rank(),
                             compact_logits ? nullptr : view.seq_first_row, view.seq_tokens, num_seqs, mine, stream);
    options.comm->all_gather(mine, all, static_cast<int64_t>(2 * num_seqs) * static_cast<int64_t>(sizeof(float)), stream);
    launch_fold_argmax(all, ranks, num_seqs, argmax_ids.as<int32_t>(), token_out, stream);
  }

  // The calling thread's current device is this backend's (tensor-parallel ranks step from threads).
  void use_device() const { check(cudaSetDevice(options.device), "selecting the device"); }

  void check_device_error() {
    int32_t code = 0;
    check(cudaMemcpyAsync(&code, error_flag.ptr, sizeof(code), cudaMemcpyDeviceToHost, stream), "error flag");
    check(cudaStreamSynchronize(stream), "step");
    if (code == 0) return;
    check(cudaMemsetAsync(error_flag.ptr, 0, sizeof(int32_t), stream), "error flag");
    switch (code) {
      case kErrBadToken: fail("cuda: a token id is outside the vocabulary");
      case kErrContext: fail("cuda: a sequence outgrew its slot's cache");
      case kErrOpcode: fail("cuda: an op without a device body was run");
      case kErrPeerTimeout:
        fail("cuda: rank {}'s in-kernel all_reduce waited 20 s for a peer's partial sums (a rank failed, or the ranks ran different steps)",
             options.comm ? options.comm->rank() : 0);
      case kErrPeerSlot: fail("cuda: an in-kernel all_reduce does not fit its slot (a bug: the slots are sized from the plans)");
      case kErrWorkspace: fail("cuda: a step outgrew an op's workspace (MLA, chunked KDA: the tasks' shared one; a GEMV body: its block's scratch); a sizing bug");
      case kErrRouting: fail("cuda: a MoE top-k row routes to an expert id that is not an integer in 0..experts-1 (read by the device routing sort)");
      default: fail("cuda: the device reported error {}", code);
    }
  }
};

}  // namespace plow::cuda
