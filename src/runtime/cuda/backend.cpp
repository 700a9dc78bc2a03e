// CudaBackend: device memory for weights, states and the activation arena; each plan decoded once into
// OpDesc tables and 64-byte instructions; a step = upload the step view and token ids, one megakernel
// launch (or one launch per op in eager mode), download the logits rows asked for and the error flag.
#include "runtime/cuda/backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/dtype.h"
#include "core/error.h"
#include "graph/op_table.h"
#include "plan/validate.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/device_memory.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/nccl_comm.h"
#include "runtime/cuda/peer_reduce.h"
#include "runtime/cuda/ops/limits.h"
#include "runtime/cuda/ops_attrs.h"
#include "runtime/cuda/prefill_gemm.h"

namespace plow::cuda {

namespace {

// Slot `slot`'s buffer of a state.
uint8_t* slot_bytes(const DeviceState& s, int64_t slot) { return static_cast<uint8_t*>(s.base) + slot * s.slot_elems * state_elem_bytes(s.elem); }

// Tasks of each op of the plan.
std::vector<int32_t> tasks_per_op(const Plan& plan) {
  std::vector<int32_t> count(plan.ops.size(), 0);
  for (const PlanTask& task : plan.tasks) count[static_cast<size_t>(task.op)] += 1;
  return count;
}

// Whether `later` reads, through any chain of inputs, the output of `earlier` (so every task of
// `earlier` has finished before any task of `later` starts, in both launch modes).
bool depends_on(const Plan& plan, int32_t later, int32_t earlier) {
  std::vector<bool> seen(plan.ops.size(), false);
  std::vector<int32_t> stack{later};
  while (!stack.empty()) {
    const int32_t op = stack.back();
    stack.pop_back();
    for (int32_t in : plan.op(op).inputs) {
      if (in == earlier) return true;
      if (in > earlier && !seen[static_cast<size_t>(in)]) seen[static_cast<size_t>(in)] = true, stack.push_back(in);
    }
  }
  return false;
}

bool same_state(const StateDecl& a, const StateDecl& b) {
  return a.kind == b.kind && a.width == b.width && a.depth == b.depth && a.label == b.label;
}

}  // namespace


CudaBackend::CudaBackend(const Graph& graph, std::shared_ptr<DeviceWeightSet> weights, std::vector<Plan> plans, const CudaOptions& options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.weights = std::move(weights);
  m.options = options;
  if (!m.weights) fail("cuda: no weights");
  if (plans.empty()) fail("cuda: no plans to run");
  if (options.num_slots < 1) fail("cuda: {} slots, expected at least 1", options.num_slots);
  if (options.max_context_tokens < 1) fail("cuda: max context of {} tokens, expected at least 1", options.max_context_tokens);
  const int32_t act = act_type(options.act_dtype);
  check(cudaSetDevice(options.device), "selecting the device");
  configure_kernels();
  check(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "stream");
  const int sms = sm_count(options.device);
  (void)graph;

  int64_t arena_floats = 0;
  for (Plan& plan : plans) {
    validate_plan(plan, [](uint8_t opcode) { return device_has_op(opcode); });
    if (plan.workers > sms) fail("plan '{}' needs {} workers; this GPU has {} SMs (compile with --workers ≤ {})", plan.source, plan.workers, sms, sms);
    const Plan& first = m.plans.empty() ? plan : m.plans.front()->plan;
    if (plan.states.size() != first.states.size() || !std::equal(plan.states.begin(), plan.states.end(), first.states.begin(), same_state) ||
        plan.op(plan.output_op).width != first.op(first.output_op).width) {
      fail("plan '{}' and plan '{}' describe different models (state tables or output widths differ)", plan.source, first.source);
    }
    auto prepared = std::make_unique<Impl::PreparedPlan>();
    prepared->plan = std::move(plan);
    arena_floats = std::max(arena_floats, prepared->plan.arena_floats);
    m.max_tokens = std::max(m.max_tokens, prepared->plan.max_tokens);
    m.max_workers = std::max(m.max_workers, prepared->plan.workers);
    m.plans.push_back(std::move(prepared));
  }
  m.arena = DeviceBuffer(static_cast<size_t>(arena_floats) * sizeof(float), "the activation arena");
  check(cudaMemset(m.arena.ptr, 0, m.arena.bytes), "arena");
  m.scratch = DeviceBuffer(static_cast<size_t>(std::max(m.max_workers, 1)) * kScratchFloats * sizeof(float) * 2, "op scratch");
  m.step_ints = DeviceBuffer(static_cast<size_t>(3 * m.max_tokens + 4 * m.max_tokens + 64) * sizeof(int32_t), "the step view");
  m.error_flag = DeviceBuffer(sizeof(int32_t), "the error flag");
  check(cudaMemset(m.error_flag.ptr, 0, sizeof(int32_t)), "error flag");
  m.argmax_ids = DeviceBuffer(static_cast<size_t>(m.max_tokens) * sizeof(int32_t), "argmax ids");
  if (options.device_sampling) m.sample_rows = DeviceBuffer(static_cast<size_t>(m.max_tokens) * sizeof(RowSampling), "draws");
  if (options.comm) {
    if (options.comm->device() != options.device) fail("cuda: the communicator of rank {} is on device {}, the backend on {}", options.comm->rank(), options.comm->device(), options.device);
    m.fold_cands = DeviceBuffer(static_cast<size_t>(2 * m.max_tokens * (1 + options.comm->size())) * sizeof(float), "argmax fold");
  }
  m.profile = DeviceBuffer(static_cast<size_t>(std::max(m.max_workers, 1)) * 4 * sizeof(unsigned long long), "profile counters");
  m.op_profile = DeviceBuffer(static_cast<size_t>(3 * kProfileSlots) * sizeof(unsigned long long), "profile counters");

  // Per-slot state, one buffer per state declaration for all slots.
  for (const StateDecl& decl : m.plans.front()->plan.states) {
    DeviceState s;
    s.width = decl.width;
    switch (decl.kind) {
      case StateKind::kConvWindow: s.depth = decl.depth; s.slot_elems = decl.width * decl.depth; break;
      case StateKind::kKdaRecurrent: s.depth = decl.depth; s.slot_elems = decl.width * (decl.width / decl.depth); break;
      case StateKind::kMlaLatent: s.depth = options.max_context_tokens; s.slot_elems = options.max_context_tokens * decl.width; s.elem = act; break;
    }
    DeviceBuffer buffer(static_cast<size_t>(s.slot_elems * options.num_slots * state_elem_bytes(s.elem)), decl.label.c_str());
    check(cudaMemset(buffer.ptr, 0, buffer.bytes), "state");
    s.base = buffer.ptr;
    m.states.push_back(s);
    m.state_buffers.push_back(std::move(buffer));
  }
  m.state_table = upload(m.states, "the state table");
  m.contexts.assign(static_cast<size_t>(options.num_slots), 0);

  // Ops whose tasks cooperate across blocks (MLA split-KV, chunked KDA, AttnRes: ops_attrs.h cooperates) share
  // one workspace, sized for the largest; sharing is safe because each such op depends on the one before
  // it (checked here).
  int64_t workspace_floats = 0;
  for (const auto& prepared : m.plans) {
    const Plan& plan = prepared->plan;
    const std::vector<int32_t> tasks = tasks_per_op(plan);
    int32_t previous = -1;
    for (int32_t i = 0; i < static_cast<int32_t>(plan.ops.size()); ++i) {
      if (!cooperates(plan.op(i))) continue;
      if (previous >= 0 && !depends_on(plan, i, previous)) {
        fail("plan '{}': ops '{}' and '{}' may run at once, but share the ops' workspace", plan.source, plan.op(previous).label, plan.op(i).label);
      }
      previous = i;
      workspace_floats = std::max(workspace_floats, cuda::workspace_floats(plan.op(i), plan.max_tokens, options.num_slots, tasks[static_cast<size_t>(i)]));
    }
  }
  if (workspace_floats > 0) m.workspace = DeviceBuffer(static_cast<size_t>(workspace_floats) * sizeof(float), "the ops' workspace");

  // Decode each plan: OpDescs with resolved pointers, instructions in queue order and in task order.
  int64_t max_gemm_input = 0;
  MoeGemmCapacity moe_capacity;
  MlaGemmCapacity mla_capacity;
  KdaPrefillCapacity kda_capacity;
  int peer_ops = 0;
  int64_t peer_slot = 0;
  for (auto& prepared_ptr : m.plans) {
    Impl::PreparedPlan& prepared = *prepared_ptr;
    const Plan& plan = prepared.plan;
    std::vector<DeviceWeight> plan_weights;
    for (const WeightDecl& decl : plan.weights) {
      auto it = m.weights->by_name.find(decl.name);
      if (it == m.weights->by_name.end()) fail("plan '{}': weight '{}' is not among the model's weights", plan.source, decl.name);
      const DeviceWeight& w = m.weights->by_id[static_cast<size_t>(it->second)];
      const auto [rows, cols] = matrix_shape(decl.shape);
      if (w.rows != rows || w.cols != cols || w.parts != static_cast<int32_t>(decl.parts.size()) || (w.type == kWMXFP4) != decl.mxfp4) {
        fail("plan '{}': weight '{}' is [{}x{}]x{} in the plan but [{}x{}]x{} on the device", plan.source, decl.name, rows, cols, decl.parts.size(), w.rows,
             w.cols, w.parts);
      }
      plan_weights.push_back(w);
    }
    std::vector<int64_t> op_inputs;
    std::vector<DeviceWeight> op_weights;
    std::vector<std::pair<size_t, size_t>> input_at, weight_at;  // per op: first index into the two arrays
    for (const PlanOp& op : plan.ops) {
      input_at.emplace_back(op_inputs.size(), 0);
      for (int32_t in : op.inputs) op_inputs.push_back(activation_view(plan, in).offset);  // a slice: its source's buffer
      for (int32_t in : op.inputs) op_inputs.push_back(plan.op(in).width);
      for (int32_t in : op.inputs) op_inputs.push_back(activation_view(plan, in).row_stride);
      weight_at.emplace_back(op_weights.size(), 0);
      for (int32_t w : op.weights) op_weights.push_back(plan_weights[static_cast<size_t>(w)]);
    }
    prepared.op_inputs = upload(op_inputs, "op inputs");
    prepared.op_weights = upload(op_weights, "op weights");
    prepared.op_sync = DeviceBuffer(static_cast<size_t>(std::max<size_t>(plan.ops.size(), 1)) * kOpCounters * sizeof(unsigned), "op counters");
    check(cudaMemset(prepared.op_sync.ptr, 0, prepared.op_sync.bytes), "op counters");
    const std::vector<int32_t> op_task_count = tasks_per_op(plan);
    std::vector<OpDesc> descs;
    int reduce_ordinal = 0;
    for (size_t i = 0; i < plan.ops.size(); ++i) {
      const PlanOp& op = plan.ops[i];
      OpDesc d;
      d.opcode = op.opcode;
      d.act = act;
      d.round_out = op.dtype == OutDType::kAct ? 1 : 0;
      d.num_inputs = static_cast<int32_t>(op.inputs.size());
      d.num_weights = static_cast<int32_t>(op.weights.size());
      d.state = op.state;
      d.width = op.width;
      d.out_offset = op.offset;
      d.in_offset = prepared.op_inputs.as<int64_t>() + input_at[i].first;
      d.in_width = d.in_offset + op.inputs.size();
      d.in_stride = d.in_width + op.inputs.size();
      d.weights = prepared.op_weights.as<DeviceWeight>() + weight_at[i].first;
      pack_op_attrs(op, d.attr);
      if (op.op() == Op::kAllReduce) d.attr[0] = static_cast<float>(reduce_ordinal++);
      if (op.op() == Op::kAttnResMix || op.op() == Op::kAttnResNorm) d.attr[2] = static_cast<float>(options.attn_res_min_chunk);
      d.tasks = op_task_count[i];
      if (options.prefill_gemm && options.prefill_round_in_readers) d.round_in = round_in_mask(plan, op);  // only GEMM steps leave inputs unrounded
      if (cooperates(op)) {
        d.workspace = m.workspace.as<float>();
        d.workspace_floats = workspace_floats;
      }
      d.sync = prepared.op_sync.as<unsigned>() + i * kOpCounters;
      descs.push_back(d);
      if (op.op() == Op::kTokens) prepared.token_offsets.push_back(op.offset);
    }
    prepared.ops = upload(descs, "op table");
    // The megakernel's records: each OpDesc with its arrays after it when they fit in kDescBytes.
    std::vector<unsigned char> records;
    std::vector<std::pair<int32_t, uint16_t>> record_at;  // per op: byte offset, bytes
    for (size_t i = 0; i < plan.ops.size(); ++i) {
      const OpDesc& d = descs[i];
      const size_t inputs = static_cast<size_t>(d.num_inputs), op_weight_count = static_cast<size_t>(d.num_weights);
      const size_t arrays = 3 * inputs * sizeof(int64_t) + op_weight_count * sizeof(DeviceWeight);
      const bool inline_arrays = sizeof(OpDesc) + arrays <= static_cast<size_t>(kDescBytes);
      const size_t bytes = inline_arrays ? (sizeof(OpDesc) + arrays + 15) / 16 * 16 : kDescHeadBytes;
      const size_t at = records.size();
      records.resize(at + bytes, 0);
      std::memcpy(records.data() + at, &d, sizeof(OpDesc));
      if (inline_arrays) {  // else the record is the OpDesc alone (kDescHeadBytes), with its global array pointers
        unsigned char* out = records.data() + at + sizeof(OpDesc);
        const int64_t* in = op_inputs.data() + input_at[i].first;  // offsets, widths, strides back to back
        std::memcpy(out, in, 3 * inputs * sizeof(int64_t));
        std::memcpy(out + 3 * inputs * sizeof(int64_t), op_weights.data() + weight_at[i].first, op_weight_count * sizeof(DeviceWeight));
      }
      if (records.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) fail("plan '{}': its op descriptors pass 2 GiB", plan.source);
      record_at.emplace_back(static_cast<int32_t>(at), static_cast<uint16_t>(bytes));
    }
    prepared.descs = upload(records, "op descriptors");

    std::vector<int32_t> signals;
    std::vector<Instr> by_task;
    prepared.op_tasks.assign(plan.ops.size(), {0, 0});
    for (size_t t = 0; t < plan.tasks.size(); ++t) {
      const PlanTask& task = plan.tasks[t];
      const PlanOp& op = plan.op(task.op);
      Instr ins;
      ins.op = task.op;
      ins.opcode = op.opcode;
      ins.wait_counter = task.wait_counter;
      ins.wait_threshold = static_cast<uint32_t>(task.wait_threshold);
      prepared.max_threshold = std::max(prepared.max_threshold, ins.wait_threshold);
      ins.signal_begin = static_cast<int32_t>(signals.size());
      ins.num_signals = static_cast<int32_t>(task.signals.size());
      signals.insert(signals.end(), task.signals.begin(), task.signals.end());
      for (size_t s = 0; s < task.signals.size() && s < static_cast<size_t>(kInlineSignals); ++s) ins.signal[s] = task.signals[s];
      ins.desc = record_at[static_cast<size_t>(task.op)].first;
      ins.desc_bytes = record_at[static_cast<size_t>(task.op)].second;
      ins.col_begin = task.col_begin;
      ins.col_end = task.col_end;
      auto& range = prepared.op_tasks[static_cast<size_t>(task.op)];
      if (range.second == range.first) range.first = static_cast<int32_t>(t);
      range.second = static_cast<int32_t>(t) + 1;
      ins.task = static_cast<int32_t>(t) - range.first;  // an op's tasks are consecutive in the plan
      by_task.push_back(ins);
    }
    std::vector<Instr> by_queue;
    std::vector<int32_t> queue_begin{0};
    for (const std::vector<int32_t>& queue : plan.queues) {
      for (int32_t t : queue) by_queue.push_back(by_task[static_cast<size_t>(t)]);
      queue_begin.push_back(static_cast<int32_t>(by_queue.size()));
    }
    link_queues(by_queue, queue_begin);
    prepared.task_instrs = upload(by_task, "instructions");
    prepared.queue_instrs = upload(by_queue, "instructions");
    prepared.queue_begin = upload(queue_begin, "queues");
    std::vector<bool> reduce(plan.ops.size());  // ops with a host part on every path
    for (size_t i = 0; i < plan.ops.size(); ++i) reduce[i] = plan.ops[i].op() == Op::kAllReduce;
    const auto all_reduces = std::count(reduce.begin(), reduce.end(), true);
    if (all_reduces > 0 && options.comm == nullptr) fail("plan '{}' has {} all_reduce ops (a tensor-parallel rank's) but the backend has no communicator", plan.source, all_reduces);
    if (all_reduces > 0) prepared.segments = build_segments(plan, by_task, reduce);
    if (all_reduces > 0 && plan.max_tokens <= kPeerReduceMaxRows) {
      prepared.peer_reduce = true;
      peer_ops = std::max(peer_ops, static_cast<int>(all_reduces));
      for (const PlanOp& op : plan.ops) {
        if (op.op() == Op::kAllReduce) peer_slot = std::max(peer_slot, plan.max_tokens * op.width);
      }
    }
    if (options.prefill_gemm) {
      prepared.gemm = plan_gemm_path(plan, plan_weights, by_task, reduce, act, options.prefill_mla_gemm, options.prefill_kda_planned,
                                     options.prefill_round_in_readers, options.gemm_min_rows);
    }
    max_gemm_input = std::max(max_gemm_input, prepared.gemm.max_input_elems);
    moe_capacity.merge(prepared.gemm.moe_capacity);
    mla_capacity.merge(prepared.gemm.mla_capacity);
    kda_capacity.merge(prepared.gemm.kda_capacity);
    prepared.signals = upload(signals, "signals");
    prepared.counters = DeviceBuffer(static_cast<size_t>(std::max(plan.counters, 1)) * sizeof(unsigned), "counters");
    check(cudaMemset(prepared.counters.ptr, 0, prepared.counters.bytes), "counters");
  }
  if (max_gemm_input > 0) m.gemm_runner = std::make_unique<GemmRunner>(max_gemm_input, m.stream);
  if (moe_capacity.pairs > 0) m.moe_runner = std::make_unique<MoeGemmRunner>(moe_capacity, m.stream, m.error_flag.as<int32_t>());
  if (mla_capacity.rows > 0) {
    if (options.mla_scores_bytes < 1) fail("cuda: an MLA scores budget of {} bytes, expected at least 1", options.mla_scores_bytes);
    m.mla_runner = std::make_unique<MlaGemmRunner>(mla_capacity, options.max_context_tokens, options.mla_scores_bytes, m.stream);
  }
  if (kda_capacity.rows > 0) m.kda_runner = std::make_unique<KdaPrefillRunner>(kda_capacity, m.stream);
  if (peer_ops > 0 && options.comm->size() <= kMaxPeerRanks) m.peer_area = std::make_unique<PeerReduceArea>(options.device, options.comm->size(), peer_ops, peer_slot);
}

CudaBackend::~CudaBackend() {
  if (impl_ && impl_->stream != nullptr) {
    cudaSetDevice(impl_->options.device);
    cudaStreamSynchronize(impl_->stream);
    impl_->gemm_runner.reset();  // its cuBLAS handle works on the stream
    impl_->moe_runner.reset();
    impl_->mla_runner.reset();
    impl_->kda_runner.reset();
    for (cudaEvent_t e : impl_->timing_events) cudaEventDestroy(e);
    cudaStreamDestroy(impl_->stream);
  }
}

bool CudaBackend::has_op(uint8_t opcode) { return device_has_op(opcode); }

int CudaBackend::sm_count(int device) { return sm_count_of(device); }

std::string CudaBackend::device_name(int device) {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "device query");
  return prop.name;
}

int CudaBackend::num_slots() const { return impl_->options.num_slots; }
DType CudaBackend::act_dtype() const { return impl_->options.act_dtype; }
const Plan& CudaBackend::plan(int index) const { return impl_->plans.at(static_cast<size_t>(index))->plan; }
int CudaBackend::last_plan() const { return impl_->last_plan; }

int64_t CudaBackend::context_tokens(int slot) const {
  if (slot < 0 || slot >= num_slots()) fail("cuda: slot {} outside 0..{}", slot, num_slots() - 1);
  return impl_->contexts[static_cast<size_t>(slot)];
}

void CudaBackend::reset_slot(int slot) {
  Impl& m = *impl_;
  m.use_device();
  if (slot < 0 || slot >= num_slots()) fail("cuda: slot {} outside 0..{}", slot, num_slots() - 1);
  for (size_t i = 0; i < m.states.size(); ++i) {
    const DeviceState& s = m.states[i];
    if (m.plans.front()->plan.states[i].kind == StateKind::kMlaLatent) continue;  // rows past the context are never read
    check(cudaMemsetAsync(slot_bytes(s, slot), 0, static_cast<size_t>(s.slot_elems * state_elem_bytes(s.elem)), m.stream), "state reset");
  }
  check(cudaStreamSynchronize(m.stream), "state reset");
  m.contexts[static_cast<size_t>(slot)] = 0;
}

SlotSnapshot CudaBackend::save_slot(int slot, int64_t rows_begin) const {
  const Impl& m = *impl_;
  m.use_device();
  const int64_t tokens = context_tokens(slot);
  if (rows_begin < 0 || rows_begin > tokens) fail("save_slot: rows_begin {} outside the slot's 0..{} tokens", rows_begin, tokens);
  SlotSnapshot snap;
  snap.tokens = tokens;
  snap.rows_begin = rows_begin;
  const std::vector<StateDecl>& decls = m.plans.front()->plan.states;
  std::vector<std::vector<uint16_t>> halves(m.states.size());  // 16-bit states, converted after the copies
  for (size_t i = 0; i < m.states.size(); ++i) {
    const DeviceState& s = m.states[i];
    const bool rows = decls[i].kind == StateKind::kMlaLatent;
    const int64_t first = rows ? rows_begin * s.width : 0, count = rows ? (tokens - rows_begin) * s.width : s.slot_elems;
    const uint8_t* base = slot_bytes(s, slot) + first * state_elem_bytes(s.elem);
    std::vector<float> host;
    if (s.elem == kAF32) {
      host.resize(static_cast<size_t>(count));
      if (count > 0) check(cudaMemcpyAsync(host.data(), base, host.size() * sizeof(float), cudaMemcpyDeviceToHost, m.stream), "slot snapshot");
    } else {
      halves[i].resize(static_cast<size_t>(count));
      if (count > 0) check(cudaMemcpyAsync(halves[i].data(), base, halves[i].size() * 2, cudaMemcpyDeviceToHost, m.stream), "slot snapshot");
    }
    snap.row_floats.push_back(rows ? s.width : 0);
    snap.fixed.push_back(rows ? std::vector<float>{} : std::move(host));
    snap.rows.push_back(rows ? std::move(host) : std::vector<float>{});
  }
  check(cudaStreamSynchronize(m.stream), "slot snapshot");
  for (size_t i = 0; i < m.states.size(); ++i) {
    if (m.states[i].elem == kAF32) continue;
    std::vector<float>& out = decls[i].kind == StateKind::kMlaLatent ? snap.rows[i] : snap.fixed[i];
    out.resize(halves[i].size());
    const std::vector<uint16_t>& h = halves[i];
    if (m.states[i].elem == kABF16) {  // a shift a value: vectorized (a 32K-token cache is ~10⁸ of them)
      for (size_t k = 0; k < out.size(); ++k) out[k] = bf16_to_f32(h[k]);
    } else {
      for (size_t k = 0; k < out.size(); ++k) out[k] = f16_to_f32(h[k]);
    }
  }
  return snap;
}

void CudaBackend::restore_slot(int slot, const SlotSnapshot& snapshot) {
  Impl& m = *impl_;
  m.use_device();
  if (slot < 0 || slot >= num_slots()) fail("restore_slot: slot {} outside 0..{}", slot, num_slots() - 1);
  if (snapshot.rows_begin != 0) fail("restore_slot: the snapshot starts at row {}, a restore needs every row from 0", snapshot.rows_begin);
  if (snapshot.tokens < 0 || snapshot.tokens > m.options.max_context_tokens) {
    fail("restore_slot: the snapshot holds {} tokens, the maximum context is {}", snapshot.tokens, m.options.max_context_tokens);
  }
  const std::vector<StateDecl>& decls = m.plans.front()->plan.states;
  if (snapshot.fixed.size() != decls.size() || snapshot.rows.size() != decls.size()) {
    fail("restore_slot: the snapshot has {} states, this model {}", snapshot.fixed.size(), decls.size());
  }
  for (size_t i = 0; i < m.states.size(); ++i) {
    const DeviceState& s = m.states[i];
    const bool rows = decls[i].kind == StateKind::kMlaLatent;
    const std::vector<float>& source = rows ? snapshot.rows[i] : snapshot.fixed[i];
    const auto expected = static_cast<size_t>(rows ? snapshot.tokens * s.width : s.slot_elems);
    if (source.size() != expected) fail("restore_slot: state '{}' has {} floats in the snapshot, expected {}", decls[i].label, source.size(), expected);
  }
  std::vector<std::vector<uint16_t>> halves(m.states.size());  // 16-bit states: the copies' sources until the sync
  for (size_t i = 0; i < m.states.size(); ++i) {
    const DeviceState& s = m.states[i];
    const bool rows = decls[i].kind == StateKind::kMlaLatent;
    const std::vector<float>& source = rows ? snapshot.rows[i] : snapshot.fixed[i];
    if (source.empty()) continue;
    if (s.elem == kAF32) {
      check(cudaMemcpyAsync(slot_bytes(s, slot), source.data(), source.size() * sizeof(float), cudaMemcpyHostToDevice, m.stream), "slot restore");
    } else {  // the rows a 16-bit state saved: exact in it again
      std::vector<uint16_t>& h = halves[i];
      h.resize(source.size());
      if (s.elem == kABF16) {
        for (size_t k = 0; k < h.size(); ++k) h[k] = f32_to_bf16(source[k]);
      } else {
        for (size_t k = 0; k < h.size(); ++k) h[k] = f32_to_f16(source[k]);
      }
      check(cudaMemcpyAsync(slot_bytes(s, slot), halves[i].data(), halves[i].size() * 2, cudaMemcpyHostToDevice, m.stream), "slot restore");
    }
  }
  check(cudaStreamSynchronize(m.stream), "slot restore");
  m.contexts[static_cast<size_t>(slot)] = snapshot.tokens;
}

StepOutput CudaBackend::step(const StepInputs& inputs) {
  Impl& m = *impl_;
  m.use_device();
  const auto rows = static_cast<int64_t>(inputs.token_ids.size());
  if (inputs.sequences.empty() || rows == 0) fail("cuda: a step needs at least one sequence and one token");
  std::vector<bool> seen(static_cast<size_t>(num_slots()), false);
  int64_t covered = 0;
  bool decode = true;
  for (const SequenceStep& seq : inputs.sequences) {
    if (seq.slot < 0 || seq.slot >= num_slots()) fail("cuda: slot {} outside 0..{}", seq.slot, num_slots() - 1);
    if (seen[static_cast<size_t>(seq.slot)]) fail("cuda: slot {} appears twice in one step", seq.slot);
    seen[static_cast<size_t>(seq.slot)] = true;
    if (seq.query_tokens < 1) fail("cuda: sequence in slot {} brings {} tokens", seq.slot, seq.query_tokens);
    const int64_t context = m.contexts[static_cast<size_t>(seq.slot)];
    if (context + seq.query_tokens > m.options.max_context_tokens) {
      fail("cuda: slot {} would hold {} tokens, the maximum context is {}", seq.slot, context + seq.query_tokens, m.options.max_context_tokens);
    }
    covered += seq.query_tokens;
    decode = decode && seq.query_tokens == 1;
  }
  if (covered != rows) fail("cuda: sequences cover {} tokens, the step has {}", covered, rows);
  const int chosen = m.choose_step(decode, rows);
  Impl::PreparedPlan& prepared = *m.plans[static_cast<size_t>(chosen)];
  if (m.options.poison_arena) check(cudaMemsetAsync(m.arena.ptr, 0xFF, m.arena.bytes, m.stream), "arena poison");  // 0xFFFFFFFF is a NaN
  const StepView view = m.upload_step(prepared, inputs.token_ids, inputs.sequences);
  // Op timing runs the step eagerly: its parameters must be eager ones too (task-order instructions,
  // and no epoch advance, which a megakernel step after it would wait on forever).
  const bool eager = m.options.eager || m.op_timing;
  {
    struct Reset {
      bool& flag;
      ~Reset() { flag = false; }
    } reset{m.last_logits_only};  // the tools' steps (timed decode, profiles) keep every row
    m.last_logits_only = !inputs.all_logits;
    m.launch(prepared, m.params(prepared, view, eager), eager);
  }
  if (m.options.comm) m.fold_argmax(prepared, view, static_cast<int>(inputs.sequences.size()), nullptr);

  const PlanOp& head = prepared.plan.op(prepared.plan.output_op);
  StepOutput result;
  result.vocab = head.width;
  const float* logits = m.arena.as<float>() + head.offset;
  if (!inputs.draws.empty() && !inputs.all_logits && draws_rows()) {  // rows drawn on the device, no logits
    const auto seqs = static_cast<int>(inputs.sequences.size());
    if (inputs.draws.size() != inputs.sequences.size()) fail("cuda: {} draws for {} sequences", inputs.draws.size(), inputs.sequences.size());
    std::vector<RowSampling> draws(inputs.draws.size());
    for (size_t s = 0; s < draws.size(); ++s) {
      const RowDraw& d = inputs.draws[s];
      if (!(d.u >= 0.0 && d.u < 1.0) || d.top_k < 0) fail("cuda: draw {} has u {} and top_k {} (want u in [0, 1), top_k >= 0)", s, d.u, d.top_k);
      draws[s] = {d.temperature, d.top_p, d.min_p, static_cast<int32_t>(std::min<int64_t>(d.top_k, head.width)), d.u};
    }
    check(cudaMemcpyAsync(m.sample_rows.ptr, draws.data(), draws.size() * sizeof(RowSampling), cudaMemcpyHostToDevice, m.stream), "draw upload");
    launch_sample(logits, head.width, m.compact_logits ? nullptr : view.seq_first_row, view.seq_tokens, m.sample_rows.as<RowSampling>(), seqs,
                  m.argmax_ids.as<int32_t>(), m.stream);
    result.rows = seqs;
    result.argmax.resize(static_cast<size_t>(seqs));
    check(cudaMemcpyAsync(result.argmax.data(), m.argmax_ids.ptr, result.argmax.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, m.stream),
          "drawn ids download");
  } else if (inputs.argmax_only && !inputs.all_logits && !m.options.comm) {  // the ids from the device, no logits
    const auto seqs = static_cast<int>(inputs.sequences.size());
    launch_argmax(logits, head.width, m.compact_logits ? nullptr : view.seq_first_row, view.seq_tokens, seqs, m.argmax_ids.as<int32_t>(), nullptr,
                  m.stream);
    result.rows = seqs;
    result.argmax.resize(static_cast<size_t>(seqs));
    check(cudaMemcpyAsync(result.argmax.data(), m.argmax_ids.ptr, result.argmax.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, m.stream),
          "argmax download");
  } else if (inputs.all_logits) {
    result.rows = rows;
    result.logits.resize(static_cast<size_t>(rows * head.width));
    check(cudaMemcpyAsync(result.logits.data(), logits, result.logits.size() * sizeof(float), cudaMemcpyDeviceToHost, m.stream), "logits download");
  } else {
    result.rows = static_cast<int64_t>(inputs.sequences.size());
    result.logits.resize(static_cast<size_t>(result.rows * head.width));
    if (m.compact_logits) {  // row s holds sequence s's last row (Impl::compact_logits)
      check(cudaMemcpyAsync(result.logits.data(), logits, result.logits.size() * sizeof(float), cudaMemcpyDeviceToHost, m.stream), "logits download");
    } else {
      int64_t row = 0;
      for (size_t s = 0; s < inputs.sequences.size(); ++s) {
        row += inputs.sequences[s].query_tokens;
        check(cudaMemcpyAsync(result.logits.data() + s * static_cast<size_t>(head.width), logits + (row - 1) * head.width,
                              static_cast<size_t>(head.width) * sizeof(float), cudaMemcpyDeviceToHost, m.stream),
              "logits download");
      }
    }
  }
  if (m.options.comm) {
    m.last_folded.resize(inputs.sequences.size());
    check(cudaMemcpyAsync(m.last_folded.data(), m.argmax_ids.ptr, m.last_folded.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, m.stream), "argmax fold");
  }
  m.check_device_error();
  for (const SequenceStep& seq : inputs.sequences) m.contexts[static_cast<size_t>(seq.slot)] += seq.query_tokens;
  m.last_plan = chosen;
  return result;
}

const std::vector<int32_t>& CudaBackend::last_folded_argmax() const { return impl_->last_folded; }

bool CudaBackend::draws_rows() const { return impl_->options.device_sampling && impl_->options.comm == nullptr; }

void CudaBackend::set_device_sampling(bool on) {
  Impl& m = *impl_;
  m.use_device();
  if (on && m.sample_rows.ptr == nullptr) m.sample_rows = DeviceBuffer(static_cast<size_t>(m.max_tokens) * sizeof(RowSampling), "draws");
  m.options.device_sampling = on;
}

int64_t CudaBackend::prefill_gemms() const { return impl_->gemm_runner ? impl_->gemm_runner->calls() : 0; }
int64_t CudaBackend::prefill_linears_rounded_by_readers() const {
  int64_t n = 0;
  for (const auto& prepared : impl_->plans) n += prepared->gemm.rounded_by_readers;
  return n;
}

int64_t CudaBackend::prefill_expert_ops() const { return impl_->moe_runner ? impl_->moe_runner->calls() : 0; }

std::vector<int32_t> CudaBackend::last_expert_tokens() const { return impl_->moe_runner ? impl_->moe_runner->last_expert_tokens() : std::vector<int32_t>{}; }

std::string CudaBackend::last_expert_gemm() const {
  return expert_gemm_path_name(impl_->moe_runner ? impl_->moe_runner->last_path() : ExpertGemmPath::kNone);
}

void CudaBackend::set_expert_gemm_cublas(bool on) {
  if (impl_->moe_runner) impl_->moe_runner->set_prefer_cublas(on);
}

void CudaBackend::set_mla_flash_mma_sync(bool on) {
  if (impl_->mla_runner) impl_->mla_runner->set_prefer_mma_sync(on);
}

bool CudaBackend::last_expert_gemv() const { return impl_->moe_runner && impl_->moe_runner->last_gemv(); }

CudaBackend::ExpertRouting CudaBackend::expert_routing() const {
  if (!impl_->moe_runner) return {};
  const MoeGemmRunner::RoutingStats stats = impl_->moe_runner->routing_stats();
  return {stats.reads, stats.experts};
}

void CudaBackend::reset_expert_routing_stats() {
  if (impl_->moe_runner) impl_->moe_runner->reset_routing_stats();
}

void CudaBackend::set_expert_timing(bool on) {
  if (impl_->moe_runner) impl_->moe_runner->set_timing(on);
}

double CudaBackend::expert_ms() {
  impl_->use_device();
  return impl_->moe_runner ? impl_->moe_runner->timed_ms() : 0.0;
}

CudaBackend::ExpertParts CudaBackend::expert_parts_ms() {
  impl_->use_device();
  if (!impl_->moe_runner) return {};
  const MoeGemmRunner::TimedParts parts = impl_->moe_runner->timed_parts();
  return {parts.sort_ms, parts.gemm_ms};
}

void CudaBackend::reset_expert_ms() {
  impl_->use_device();
  if (impl_->moe_runner) impl_->moe_runner->reset_timed_ms();
}

int64_t CudaBackend::prefill_kda_ops() const { return impl_->kda_runner ? impl_->kda_runner->calls() : 0; }

int64_t CudaBackend::prefill_kda_batches() const { return impl_->kda_runner ? impl_->kda_runner->batches() : 0; }

void CudaBackend::set_kda_timing(bool on) {
  if (impl_->kda_runner) impl_->kda_runner->set_timing(on);
}

double CudaBackend::kda_ms() { return impl_->kda_runner ? impl_->kda_runner->timed_ms() : 0.0; }

double CudaBackend::kda_prep_ms() { return impl_->kda_runner ? impl_->kda_runner->prep_ms() : 0.0; }

void CudaBackend::reset_kda_ms() {
  if (impl_->kda_runner) impl_->kda_runner->reset_timed_ms();
}

int64_t CudaBackend::prefill_mla_ops() const { return impl_->mla_runner ? impl_->mla_runner->calls() : 0; }

int64_t CudaBackend::prefill_mla_blocks() const { return impl_->mla_runner ? impl_->mla_runner->blocks() : 0; }

int64_t CudaBackend::prefill_mla_flash() const { return impl_->mla_runner ? impl_->mla_runner->flash() : 0; }
int64_t CudaBackend::prefill_mla_wgmma() const { return impl_->mla_runner ? impl_->mla_runner->wgmma_flash() : 0; }
int64_t CudaBackend::prefill_mla_gated() const { return impl_->mla_runner ? impl_->mla_runner->gated() : 0; }

void CudaBackend::set_mla_timing(bool on) {
  if (impl_->mla_runner) impl_->mla_runner->set_timing(on);
}

double CudaBackend::mla_ms() {
  impl_->use_device();
  return impl_->mla_runner ? impl_->mla_runner->timed_ms() : 0.0;
}

double CudaBackend::mla_attention_ms() {
  impl_->use_device();
  return impl_->mla_runner ? impl_->mla_runner->attend_ms() : 0.0;
}

void CudaBackend::reset_mla_ms() {
  impl_->use_device();
  if (impl_->mla_runner) impl_->mla_runner->reset_timed_ms();
}

void CudaBackend::set_eager(bool eager) { impl_->options.eager = eager; }

void CudaBackend::set_peer_all_reduce(bool on) { impl_->options.peer_all_reduce = on; }

bool CudaBackend::last_step_peer_all_reduce() const { return impl_->last_peer; }

}  // namespace plow::cuda
