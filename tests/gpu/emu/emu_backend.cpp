// A host stand-in for CudaBackend that runs the real CUDA op bodies (ops/gemv.cuh, ops/misc_ops.cuh) on
// 512 emulated threads per task (emu_prelude.h), tasks one after another in plan order, the arena
// poisoned with NaN before every step. It checks the bodies' logic (indexing, slices, state, barriers:
// a divergent one aborts) without a GPU; it says nothing about speed, races across blocks or nvcc.
// Every op body exists here (run_gemv_op, run_misc_op), but not the prefill plans' GEMM path, the
// launches between megakernel segments (moe_gemm, prefill_gemm) or the planned KDA prefill.
#include <algorithm>
#include <array>
#include <cstring>
#include <map>

#include "core/dtype.h"
#include "core/error.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/device.cuh"  // the emulation copy made by tests/CMakeLists.txt
#include "runtime/cuda/ops/gemv.cuh"
#include "runtime/cuda/ops/misc_ops.cuh"
#include "runtime/cuda/weight_layout.h"

namespace plow::cuda {

// The weights as upload_weights lays them out on the device (weight_layout.h), in host memory. Tied
// weights share one copy.
struct DeviceWeightSet {
  std::vector<DeviceWeight> by_id;
  std::map<std::string, int> by_name;
  std::vector<std::vector<uint8_t>> buffers;
};
std::shared_ptr<DeviceWeightSet> upload_weights(const Graph& g, const BoundWeights& bound) {
  auto set = std::make_shared<DeviceWeightSet>();
  std::map<const TensorView*, DeviceWeight> done;
  for (size_t id = 0; id < g.weights().size(); ++id) {
    const BoundWeight& b = bound[static_cast<int>(id)];
    set->by_name.emplace(g.weights()[id].name, static_cast<int>(id));
    if (auto it = done.find(b.parts.front()); it != done.end()) {
      set->by_id.push_back(it->second);
      continue;
    }
    DeviceWeight w = weight_layout(g.weights()[id], b);
    const TensorView& first = *b.parts.front();
    std::vector<uint8_t> data(static_cast<size_t>(w.part_bytes * w.parts)), scales(static_cast<size_t>(w.scale_part_bytes * w.parts));
    for (int p = 0; p < w.parts; ++p) {
      const TensorView& part = *b.parts[static_cast<size_t>(p)];
      std::memcpy(data.data() + p * w.part_bytes, part.data, static_cast<size_t>(w.part_bytes));
      if (w.type == kWMXFP4) std::memcpy(scales.data() + p * w.scale_part_bytes, part.mx_scales, static_cast<size_t>(w.scale_part_bytes));
    }
    w.data = data.data(), w.scales = scales.data();  // the heap buffers move with the vectors
    set->buffers.push_back(std::move(data));
    set->buffers.push_back(std::move(scales));
    done.emplace(&first, w);
    set->by_id.push_back(w);
  }
  return set;
}

struct CudaBackend::Impl {
  std::shared_ptr<DeviceWeightSet> weights;
  std::vector<Plan> plans;
  CudaOptions opt;
  std::vector<std::vector<float>> states;
  std::vector<DeviceState> dstates;
  std::vector<bool> per_token;  // per state: one row per token (the MLA latent cache)
  std::vector<int64_t> context;
  std::map<std::pair<const Plan*, size_t>, std::array<unsigned, kOpCounters>> sync;  // per plan op, kept across steps
};

// Bytes of one slot of a state.
static int64_t slot_bytes(const DeviceState& s) { return s.slot_elems * state_elem_bytes(s.elem); }

CudaBackend::CudaBackend(const Graph& graph, std::shared_ptr<DeviceWeightSet> weights, std::vector<Plan> plans, const CudaOptions& o)
    : impl_(std::make_unique<Impl>()) {
  impl_->weights = weights;
  impl_->plans = std::move(plans);
  impl_->opt = o;
  const int32_t act = o.act_dtype == DType::BF16 ? kABF16 : o.act_dtype == DType::F16 ? kAF16 : kAF32;
  for (const StateDecl& d : graph.states()) {
    DeviceState s;
    s.width = d.width;
    if (d.kind == StateKind::kConvWindow) s.depth = d.depth, s.slot_elems = d.width * d.depth;
    if (d.kind == StateKind::kKdaRecurrent) s.depth = d.depth, s.slot_elems = d.width * (d.width / d.depth);
    if (d.kind == StateKind::kMlaLatent) s.depth = o.max_context_tokens, s.slot_elems = o.max_context_tokens * d.width, s.elem = act;  // as CudaBackend
    impl_->states.emplace_back(static_cast<size_t>((slot_bytes(s) * o.num_slots + 3) / 4), 0.0f);  // the slots' bytes, in whole floats
    impl_->dstates.push_back(s);
    impl_->per_token.push_back(d.kind == StateKind::kMlaLatent);
  }
  impl_->context.assign(static_cast<size_t>(o.num_slots), 0);
}
CudaBackend::~CudaBackend() = default;
void CudaBackend::reset_slot(int slot) {
  for (size_t i = 0; i < impl_->states.size(); ++i) {
    const int64_t bytes = slot_bytes(impl_->dstates[i]);
    std::memset(reinterpret_cast<uint8_t*>(impl_->states[i].data()) + slot * bytes, 0, static_cast<size_t>(bytes));
  }
  impl_->context[static_cast<size_t>(slot)] = 0;
}
int CudaBackend::sm_count(int) { return 132; }  // an H200's, so the 132-worker cases run here too
// As CudaBackend's: the whole fixed states, per-token rows from rows_begin, 16-bit elements as fp32.
SlotSnapshot CudaBackend::save_slot(int slot, int64_t rows_begin) const {
  SlotSnapshot snap;
  snap.tokens = context_tokens(slot);
  snap.rows_begin = rows_begin;
  for (size_t i = 0; i < impl_->states.size(); ++i) {
    const DeviceState& s = impl_->dstates[i];
    const bool latent = impl_->per_token[i];
    const int64_t first = latent ? rows_begin * s.width : 0, count = latent ? (snap.tokens - rows_begin) * s.width : s.slot_elems;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(impl_->states[i].data()) + slot * slot_bytes(s) + first * state_elem_bytes(s.elem);
    std::vector<float> out(static_cast<size_t>(count));
    for (size_t k = 0; k < out.size(); ++k) {
      if (s.elem == kAF32) {
        std::memcpy(&out[k], src + 4 * k, 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * k, 2);
        out[k] = s.elem == kABF16 ? bf16_to_f32(bits) : f16_to_f32(bits);
      }
    }
    snap.row_floats.push_back(latent ? s.width : 0);
    snap.fixed.push_back(latent ? std::vector<float>{} : std::move(out));
    snap.rows.push_back(latent ? std::move(out) : std::vector<float>{});
  }
  return snap;
}
void CudaBackend::restore_slot(int slot, const SlotSnapshot& snap) {
  reset_slot(slot);
  for (size_t i = 0; i < impl_->states.size(); ++i) {
    const auto& s = impl_->dstates[i];
    const std::vector<float>& src = snap.rows.at(i).empty() ? snap.fixed.at(i) : snap.rows.at(i);
    if (int64_t(src.size()) > s.slot_elems) fail("emu: snapshot too large");
    uint8_t* dst = reinterpret_cast<uint8_t*>(impl_->states[i].data()) + slot * slot_bytes(s);
    for (size_t k = 0; k < src.size(); ++k) {
      if (s.elem == kAF32) {
        std::memcpy(dst + 4 * k, &src[k], 4);
      } else {
        const uint16_t bits = s.elem == kABF16 ? f32_to_bf16(src[k]) : f32_to_f16(src[k]);
        std::memcpy(dst + 2 * k, &bits, 2);
      }
    }
  }
  impl_->context[static_cast<size_t>(slot)] = snap.tokens;
}
int64_t CudaBackend::context_tokens(int s) const { return impl_->context[static_cast<size_t>(s)]; }
int CudaBackend::num_slots() const { return impl_->opt.num_slots; }
DType CudaBackend::act_dtype() const { return impl_->opt.act_dtype; }
bool CudaBackend::draws_rows() const { return false; }  // the emulated backend answers with logits
bool CudaBackend::has_op(uint8_t op) { return is_gemv_op(op) || is_misc_op(op) || op == uint8_t(Op::kTokens) || op == uint8_t(Op::kSlice); }

// kCap as the backend's kernels: 1 for one-row plans (kernels.cu launch_megakernel / launch_eager).
static void run_block(TaskCtx ctx, bool one_row) {
  static EmuBlock* block = new EmuBlock;  // 128 MiB of fiber stacks, made once
  bool unknown = false;
  block->run([&] {
    const int32_t opcode = ctx.op->opcode;
    const bool ran = one_row ? run_gemv_op<1>(ctx, opcode) : run_gemv_op<kMaxGroup>(ctx, opcode);
    if (!ran && !run_misc_op(ctx)) unknown = true;
  });
  if (unknown) fail("emu: no body for opcode {}", ctx.op->opcode);
}

StepOutput CudaBackend::step(const StepInputs& in) {
  Impl& m = *impl_;
  const bool decode = std::all_of(in.sequences.begin(), in.sequences.end(), [](const SequenceStep& s) { return s.query_tokens == 1; });
  const auto rows = static_cast<int64_t>(in.token_ids.size());
  const Plan* plan = nullptr;
  for (const Plan& p : m.plans) {
    if (p.phase != (decode ? PlanPhase::kDecode : PlanPhase::kPrefill) || p.max_tokens < rows) continue;
    if (!plan || p.max_tokens < plan->max_tokens) plan = &p;
  }
  if (!plan) fail("emu: no plan");
  std::vector<int32_t> row_seq, row_pos, seq_slot, seq_first, seq_tokens, seq_context;
  int first = 0;
  for (size_t s = 0; s < in.sequences.size(); ++s) {
    const auto& q = in.sequences[s];
    seq_slot.push_back(q.slot), seq_first.push_back(first), seq_tokens.push_back(int32_t(q.query_tokens));
    seq_context.push_back(int32_t(m.context[size_t(q.slot)]));
    for (int64_t t = 0; t < q.query_tokens; ++t) row_seq.push_back(int32_t(s)), row_pos.push_back(int32_t(m.context[size_t(q.slot)] + t));
    first += int(q.query_tokens);
  }
  std::vector<DeviceState> dstates = m.dstates;
  for (size_t i = 0; i < dstates.size(); ++i) dstates[i].base = m.states[i].data();
  int32_t error = 0;
  StepView view;
  view.tokens = int32_t(rows);
  view.num_seqs = int32_t(in.sequences.size());
  view.token_ids = in.token_ids.data();
  view.row_seq = row_seq.data(), view.row_pos = row_pos.data(), view.seq_slot = seq_slot.data(), view.seq_first_row = seq_first.data();
  view.seq_tokens = seq_tokens.data(), view.seq_context = seq_context.data(), view.states = dstates.data(), view.error = &error;
  std::vector<float> arena(size_t(plan->arena_floats), NAN);  // poisoned every step
  std::vector<DeviceWeight> all_weights;
  for (const WeightDecl& d : plan->weights) {
    auto it = m.weights->by_name.find(d.name);
    if (it == m.weights->by_name.end()) fail("emu: weight {} not found", d.name);
    all_weights.push_back(m.weights->by_id[static_cast<size_t>(it->second)]);
  }
  const int32_t act = m.opt.act_dtype == DType::BF16 ? kABF16 : m.opt.act_dtype == DType::F16 ? kAF16 : kAF32;
  for (size_t oi = 0; oi < plan->ops.size(); ++oi) {
    const PlanOp& op = plan->ops[oi];
    std::vector<int64_t> in_off, in_w, in_stride;
    for (int32_t i : op.inputs) {
      const ActivationView v = activation_view(*plan, i);  // a slice: read in place, at its source's stride
      in_off.push_back(v.offset), in_w.push_back(v.width), in_stride.push_back(v.row_stride);
    }
    std::vector<DeviceWeight> ws;
    for (int32_t w : op.weights) ws.push_back(all_weights[size_t(w)]);
    OpDesc d;
    d.opcode = op.opcode, d.act = act, d.round_out = op.dtype == OutDType::kAct ? 1 : 0;
    d.num_inputs = int32_t(op.inputs.size()), d.num_weights = int32_t(op.weights.size()), d.state = op.state;
    d.width = op.width, d.out_offset = op.offset, d.in_offset = in_off.data(), d.in_width = in_w.data(), d.in_stride = in_stride.data(), d.weights = ws.data();
    pack_op_attrs(op, d.attr);
    d.tasks = int32_t(std::count_if(plan->tasks.begin(), plan->tasks.end(), [&](const PlanTask& t) { return t.op == int32_t(oi); }));
    std::vector<float> workspace;
    std::array<unsigned, kOpCounters>& sync = m.sync[{plan, oi}];
    if (cooperates(op)) {  // the backend's sizing, NaN-poisoned
      workspace.assign(size_t(workspace_floats(op, plan->max_tokens, int64_t(m.context.size()), d.tasks)), NAN);
      d.workspace = workspace.data(), d.workspace_floats = int64_t(workspace.size());
    }
    d.sync = sync.data();
    if (op.op() == Op::kTokens) {
      for (int64_t t = 0; t < rows; ++t) arena[size_t(op.offset + t)] = float(in.token_ids[size_t(t)]);
      continue;
    }
    int32_t task_index = 0;
    for (const PlanTask& task : plan->tasks) {
      if (task.op != int32_t(oi)) continue;
      TaskCtx ctx{&d, arena.data(), &view, task.col_begin, task.col_end, nullptr, nullptr, task_index++};
      std::vector<unsigned char> smem(kSharedBytes);
      std::vector<float> scratch(size_t(kScratchFloats), NAN);
      ctx.smem = smem.data(), ctx.scratch = scratch.data();
      run_block(ctx, plan->max_tokens == 1);
      for (const auto& pending : emu_cp.pending) {  // the copies' shared memory dies with the task
        if (!pending.empty()) fail("emu: a task of op {} ended with cp.async copies never waited for", op.label);
      }
    }
    for (unsigned c : sync) {
      if (c != 0 && error == 0) fail("emu: op {} left its counters at {} (the last task resets them)", op.label, c);
    }
  }
  if (error) fail("emu: device error {}", error);
  for (const auto& q : in.sequences) m.context[size_t(q.slot)] += q.query_tokens;
  const PlanOp& out = plan->ops[size_t(plan->output_op)];
  StepOutput r;
  r.rows = rows, r.vocab = out.width;
  r.logits.assign(arena.begin() + out.offset, arena.begin() + out.offset + rows * out.width);
  return r;
}

}  // namespace plow::cuda
