// Prefill GEMMs through cuBLAS: which linear ops take them, the megakernel segments they cut, the
// GEMM call (fp32 accumulate, fp32 out; the op's tasks round) and the benchmark's cuBLAS peer.
#include "runtime/cuda/prefill_gemm.h"

#include <algorithm>

#include "core/error.h"
#include "graph/op_table.h"

namespace plow::cuda {

namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) fail("cuda: cuBLAS {}: {}", what, cublasGetStatusString(status));
}

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // one fixed workspace: results do not depend on the pool

cudaDataType half_type(int32_t type) { return type == kWBF16 ? CUDA_R_16BF : CUDA_R_16F; }

}  // namespace

std::optional<GemmOp> gemm_form(const Plan& plan, const PlanOp& op, const DeviceWeight& weight, int32_t act) {
  if ((op.op() != Op::kLinear && op.op() != Op::kRouterLogits) || op.inputs.size() != 1 || weight.parts != 1 || weight.type == kWMXFP4) return std::nullopt;
  const PlanOp& input = plan.op(op.inputs.front());
  if (weight.cols != input.width || weight.rows != op.width) return std::nullopt;
  const bool exact_input = input.dtype == OutDType::kAct && ((weight.type == kWBF16 && act == kABF16) || (weight.type == kWF16 && act == kAF16));
  if (weight.type != kWF32 && !exact_input) return std::nullopt;
  const ActivationView x = activation_view(plan, op.inputs.front());  // a slice is a view of its source's rows
  return GemmOp{weight, x.offset, op.offset, input.width, op.width, x.row_stride, op.dtype == OutDType::kAct ? act : kAF32, op.inputs.front()};
}

bool rounds_inputs_on_load(Op op) {
  switch (op) {
    case Op::kAdd:
    case Op::kSiluMul:
    case Op::kSituMul:
    case Op::kSigmoid:
    case Op::kShortConvSilu:
    case Op::kKdaGate:
    case Op::kGatedRmsNorm:
      return true;
    default:
      return false;
  }
}

int32_t round_in_mask(const Plan& plan, const PlanOp& reader) {
  if (plan.phase != PlanPhase::kPrefill || !rounds_inputs_on_load(reader.op())) return 0;
  int32_t mask = 0;
  for (size_t i = 0; i < reader.inputs.size() && i < 31; ++i) {
    const PlanOp& input = plan.op(reader.inputs[i]);  // a view (slice) is not a linear: its source keeps its rounding
    if (input.op() == Op::kLinear && input.dtype == OutDType::kAct) mask |= int32_t{1} << i;
  }
  return mask;
}

std::vector<Segment> build_segments(const Plan& plan, const std::vector<Instr>& by_task, const std::vector<bool>& host_op, int32_t skip_op,
                                    const std::vector<int32_t>* also_reads) {
  std::vector<Segment> segments(1);
  const auto ops = static_cast<int32_t>(plan.ops.size());
  for (int32_t i = 0; i < ops; ++i) {
    if (!host_op[static_cast<size_t>(i)]) continue;
    Segment& open = segments.back();
    // Join the open segment while it holds host ops only and op i reads none of their outputs.
    const bool only_host = !open.host_ops.empty() && open.host_ops.front() == open.first_op && static_cast<int32_t>(open.host_ops.size()) == i - open.first_op;
    const std::vector<int32_t>& inputs = plan.ops[static_cast<size_t>(i)].inputs;
    const int32_t also = also_reads != nullptr ? (*also_reads)[static_cast<size_t>(i)] : -1;
    if (only_host && also < open.first_op && std::all_of(inputs.begin(), inputs.end(), [&](int32_t in) { return in < open.first_op; })) {
      open.host_ops.push_back(i);
      continue;
    }
    segments.emplace_back();
    segments.back().first_op = i;
    segments.back().host_ops = {i};
  }
  for (size_t k = 0; k < segments.size(); ++k) {
    const int32_t first = segments[k].first_op, end = k + 1 < segments.size() ? segments[k + 1].first_op : ops;
    std::vector<Instr> instrs;
    std::vector<int32_t> begins{0};
    for (const std::vector<int32_t>& queue : plan.queues) {
      for (int32_t t : queue) {
        const int32_t op = plan.tasks[static_cast<size_t>(t)].op;
        if (op >= first && op < end && op != skip_op) instrs.push_back(by_task[static_cast<size_t>(t)]);
      }
      begins.push_back(static_cast<int32_t>(instrs.size()));
    }
    link_queues(instrs, begins);
    segments[k].tasks = static_cast<int64_t>(instrs.size());
    segments[k].instrs = upload(instrs, "instructions");
    segments[k].queue_begin = upload(begins, "queues");
  }
  return segments;
}

namespace {

// The tasks of the ops marked in `host` or `absorbed` (an op whose output a host op wrote: the MLA
// epilogue's output gate) only round, or do nothing where `rounded` says the host's kernels rounded the
// output already (a round_rows pass over a routed-expert op's [T, k·I] rows re-read and re-wrote
// ~0.5 GB a layer of an 8K prompt); segments cut at the host ops, each also waiting for the op
// `also_reads` names (−1: none), and leave out the tasks of `skip_op` (eager steps skip them in
// launch_op).
GemmSchedule gemm_schedule(const Plan& plan, const std::vector<Instr>& by_task, const std::vector<bool>& host, const std::vector<bool>& absorbed,
                           const std::vector<bool>& rounded, const std::vector<int32_t>& also_reads, const std::vector<bool>& reduce, int32_t skip_op) {
  std::vector<Instr> tasks = by_task;
  for (Instr& ins : tasks) {
    const auto op = static_cast<size_t>(ins.op);
    if (!(host[op] || absorbed[op]) || reduce[op]) continue;
    ins.opcode = rounded[op] ? kOpHostDone : kOpRoundRows;
  }
  GemmSchedule schedule;
  schedule.task_instrs = upload(tasks, "instructions");
  schedule.segments = build_segments(plan, tasks, host, skip_op, &also_reads);
  return schedule;
}

// Whether the host can do all of the output op's work: it has a GEMM form, the plan has no all_reduce
// (a tensor-parallel rank's argmax fold reads the logits at the sequences' rows) and nothing waits on
// the op's tasks (no reader, no signals).
bool output_on_host(const Plan& plan, const std::vector<Instr>& by_task, const std::vector<bool>& reduce, const GemmPath& path) {
  const int32_t out = plan.output_op;
  if (out < 0 || !path.ops[static_cast<size_t>(out)] || std::find(reduce.begin(), reduce.end(), true) != reduce.end()) return false;
  for (const PlanOp& op : plan.ops) {
    if (std::find(op.inputs.begin(), op.inputs.end(), out) != op.inputs.end()) return false;
  }
  return std::none_of(by_task.begin(), by_task.end(), [&](const Instr& ins) { return ins.op == out && ins.num_signals > 0; });
}

// Per op: a plain linear run as a GEMM whose output every reader rounds as it loads it (an op body
// that OpDesc::round_in tells to, or a GEMM over 16-bit weights, whose input conversion rounds to
// nearest as round_rows does), so that its tasks need not round it. Not the plan's output, whose
// rounding the host does or whose values leave the step.
std::vector<bool> outputs_rounded_by_readers(const Plan& plan, const GemmPath& path, int32_t act) {
  std::vector<bool> rounded(plan.ops.size(), false);
  if (act == kAF32) return rounded;
  std::vector<int> readers(plan.ops.size(), 0);
  std::vector<bool> other(plan.ops.size(), false);  // read by something that needs rounded values
  for (size_t j = 0; j < plan.ops.size(); ++j) {
    const PlanOp& reader = plan.ops[j];
    const int32_t mask = round_in_mask(plan, reader);
    const bool gemm_reader = path.ops[j].has_value() && path.ops[j]->weight.type != kWF32;
    for (size_t i = 0; i < reader.inputs.size(); ++i) {
      const auto in = static_cast<size_t>(reader.inputs[i]);
      readers[in] += 1;
      if (!(gemm_reader || (i < 31 && ((mask >> i) & 1) != 0))) other[in] = true;
    }
  }
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    rounded[i] = path.ops[i].has_value() && plan.ops[i].op() == Op::kLinear && plan.ops[i].dtype == OutDType::kAct && readers[i] > 0 && !other[i] &&
                 static_cast<int32_t>(i) != plan.output_op;
  }
  return rounded;
}

}  // namespace

GemmPath plan_gemm_path(const Plan& plan, const std::vector<DeviceWeight>& weights, const std::vector<Instr>& by_task, const std::vector<bool>& reduce,
                        int32_t act, bool mla, bool kda, bool readers_round, int64_t min_rows) {
  GemmPath path;
  if (plan.phase != PlanPhase::kPrefill || plan.max_tokens < min_rows) return path;
  path.ops.resize(plan.ops.size());
  path.moe_ops.resize(plan.ops.size());
  path.mla_ops.resize(plan.ops.size());
  path.kda_ops.resize(plan.ops.size());
  std::vector<bool> host = reduce;
  bool any_mla = false, any_kda = false;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    std::vector<DeviceWeight> op_weights;
    for (int32_t w : op.weights) op_weights.push_back(weights[static_cast<size_t>(w)]);
    if (reads_routed_experts(op.op())) {
      path.moe_ops[i] = moe_gemm_form(plan, op, op_weights, act);
      if (!path.moe_ops[i]) continue;
      host[i] = true;
      path.moe_capacity.add(*path.moe_ops[i], plan.max_tokens);
      continue;
    }
    if (op.op() == Op::kMlaAttention) {
      if (mla) path.mla_ops[i] = mla_gemm_form(plan, static_cast<int32_t>(i), op_weights, act);
      if (!path.mla_ops[i]) continue;
      any_mla = true;
      path.mla_capacity.add(*path.mla_ops[i], plan.max_tokens);
      continue;  // a host op in the all_host schedule only (below)
    }
    if (op.op() == Op::kKdaDeltaRule) {
      if (kda) path.kda_ops[i] = kda_prefill_form(plan, op, act);
      if (!path.kda_ops[i]) continue;
      any_kda = true;
      path.kda_capacity.add(*path.kda_ops[i], plan.max_tokens);
      continue;  // a host op where the schedule says so (below)
    }
    if (op.weights.size() != 1) continue;
    path.ops[i] = gemm_form(plan, op, op_weights.front(), act);
    if (!path.ops[i]) continue;
    host[i] = true;
    path.max_input_elems = std::max(path.max_input_elems, plan.max_tokens * path.ops[i]->in);
  }
  if (path.max_input_elems == 0 && path.moe_capacity.pairs == 0 && !any_mla && !any_kda) return {};
  if (output_on_host(plan, by_task, reduce, path)) path.output_on_host = plan.output_op;
  const std::vector<bool> by_readers = readers_round ? outputs_rounded_by_readers(plan, path, act) : std::vector<bool>(plan.ops.size(), false);
  path.rounded_by_readers = std::count(by_readers.begin(), by_readers.end(), true);
  const auto with = [&](bool mla_host, bool kda_host) {
    std::vector<bool> marked = host, absorbed(plan.ops.size(), false), rounded(plan.ops.size(), false);
    std::vector<int32_t> also_reads(plan.ops.size(), -1);
    for (size_t i = 0; i < plan.ops.size(); ++i) {
      const bool mla_op = mla_host && path.mla_ops[i].has_value(), kda_op = kda_host && path.kda_ops[i].has_value();
      marked[i] = marked[i] || mla_op || kda_op;
      // Their kernels round what they write as the op body does (the expert epilogues, MLA's scatter or
      // flash store with the gate's arithmetic, KDA's scan): the plain GEMMs' fp32 outputs are the ones
      // left to round.
      rounded[i] = rounded[i] || path.moe_ops[i].has_value() || mla_op || kda_op || by_readers[i];
      if (mla_op && path.mla_ops[i]->gate_op >= 0) {  // the output gate in the MLA epilogue: it reads the gate
        const auto gated = static_cast<size_t>(path.mla_ops[i]->gate_op);
        absorbed[gated] = true;
        rounded[gated] = true;
        also_reads[i] = plan.ops[gated].inputs[1];
      }
    }
    return gemm_schedule(plan, by_task, marked, absorbed, rounded, also_reads, reduce, path.output_on_host);
  };
  path.all_host = with(true, true);
  if (any_mla) path.mla_body = with(false, true);
  if (any_kda) path.kda_body = with(true, false);
  if (any_mla && any_kda) path.both_body = with(false, false);
  return path;
}

GemmRunner::GemmRunner(int64_t max_input_elems, cudaStream_t stream)
    : stream_(stream),
      staging_(static_cast<size_t>(std::max<int64_t>(max_input_elems, 1)) * 2 * kStagingSlots, "GEMM inputs"),
      workspace_(kWorkspaceBytes, "cuBLAS workspace"),
      slot_elems_(std::max<int64_t>(max_input_elems, 1)) {
  check_cublas(cublasCreate(&handle_), "handle");
  check_cublas(cublasSetStream(handle_, stream_), "stream");
  check_cublas(cublasSetWorkspace(handle_, workspace_.ptr, workspace_.bytes), "workspace");  // after SetStream, which resets it
}

GemmRunner::~GemmRunner() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

const void* GemmRunner::staged_input(const GemmOp& op, const float* x, int64_t rows) {
  if (rows * op.in > slot_elems_) fail("cuda: a GEMM input of {}x{} outgrows its staging buffer", rows, op.in);
  using Lru = StagingLru<StagedKey, kStagingSlots>;
  const Lru::Use use = op.x_op >= 0 ? staged_.use(StagedKey{op.x_op, x, rows, op.in, op.x_stride, op.weight.type})
                                    : Lru::Use{staged_.take(), false};  // an input no op names: converted each time
  void* out = staging_.as<uint8_t>() + use.slot * slot_elems_ * 2;
  if (!use.hit) launch_to_half(x, rows, op.in, op.x_stride, out, op.weight.type, stream_);
  return out;
}

// Row-major y[T, out] = x[T, in]·W[out, in]ᵀ is column-major yᵀ[out, T] = W·xᵀ: op(A) = Aᵀ over W's
// rows (lda = in), B = xᵀ (ldb = ldx), C = yᵀ (ldc = out). fp32 weights: pedantic, never TF32, whatever
// NVIDIA_TF32_OVERRIDE says.
void GemmRunner::gemm(const GemmOp& op, const void* x, int64_t ldx, float* y, int64_t rows) {
  const float alpha = 1.0f, beta = 0.0f;
  const auto m = static_cast<int>(op.out), n = static_cast<int>(rows), k = static_cast<int>(op.in);
  calls_ += 1;
  const bool fp32 = op.weight.type == kWF32;
  const cudaDataType type = fp32 ? CUDA_R_32F : half_type(op.weight.type);
  check_cublas(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, op.weight.data, type, k, x, type, static_cast<int>(ldx), &beta, y, CUDA_R_32F, m,
                            fp32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               fp32 ? "fp32 GEMM" : "half GEMM");
}

void GemmRunner::run(const GemmOp& op, float* arena, int64_t rows) {
  const float* x = arena + op.x_offset;
  if (op.weight.type == kWF32) {
    gemm(op, x, op.x_stride, arena + op.y_offset, rows);
    return;
  }
  gemm(op, staged_input(op, x, rows), op.in, arena + op.y_offset, rows);
}

bool GemmRunner::run_output(const GemmOp& op, float* arena, int64_t rows, const LastRows* last) {
  float* y = arena + op.y_offset;
  const bool compact = last != nullptr && op.weight.type != kWF32;
  if (compact) {
    if (last->num_seqs * op.in > slot_elems_) fail("cuda: the last rows of {} sequences outgrow the GEMM staging buffer", last->num_seqs);
    launch_to_half(arena + op.x_offset, last->num_seqs, op.in, op.x_stride, staging_.ptr, op.weight.type, stream_, last);
    staged_.forget(0);  // a gather of the last rows, which no later GEMM reads
    rows = last->num_seqs;
    gemm(op, staging_.ptr, op.in, y, rows);
  } else {
    run(op, arena, rows);
  }
  launch_round_in_place(y, rows, op.out, op.round_to, stream_);
  return compact;
}

namespace {

// Median ms of `reps` timed calls of `call` on `stream`, after three warm-up calls.
template <typename Call>
double median_ms(cudaStream_t stream, int reps, Call&& call) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<float> times;
  for (int r = 0; r < std::max(reps, 1) + 3; ++r) {
    check(cudaEventRecord(start, stream), "event");
    call();
    check(cudaEventRecord(stop, stream), "event");
    check(cudaEventSynchronize(stop), "GEMM timing");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "event");
    if (r >= 3) times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return static_cast<double>(times[times.size() / 2]);
}

}  // namespace

GemmTimes time_prefill_gemm(int64_t rows, int64_t out, int64_t in, int reps, int device) {
  check(cudaSetDevice(device), "selecting the device");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  GemmTimes times;
  {
    DeviceBuffer x(static_cast<size_t>(rows * in) * 2, "GEMM peer"), w(static_cast<size_t>(out * in) * 2, "GEMM peer");
    DeviceBuffer arena(static_cast<size_t>(rows * (in + out)) * sizeof(float), "GEMM peer");
    launch_fill(x.as<uint8_t>(), rows * in, kWBF16, FillKind::kEmbedding, 1, 1, static_cast<float>(in), 0, stream);
    launch_fill(w.as<uint8_t>(), out * in, kWBF16, FillKind::kLinear, 1, 2, static_cast<float>(in), 0, stream);
    launch_fill(arena.as<uint8_t>(), rows * (in + out), kWF32, FillKind::kEmbedding, 1, 3, static_cast<float>(in), 0, stream);
    GemmRunner ours(rows * in, stream);
    GemmOp op{DeviceWeight{w.as<uint8_t>(), nullptr, out, in, out * in * 2, 0, kWBF16, 1}, 0, rows * in, in, out, in};
    op.x_op = 0;  // an op's output, so a step's later GEMMs over it find the staged copy
    times.ours_ms = median_ms(stream, reps, [&] {
      ours.new_step();  // each call converts its input, as the first GEMM of a step over it does
      ours.run(op, arena.as<float>(), rows);
    });
    times.ours_gemm_ms = median_ms(stream, reps, [&] { ours.run(op, arena.as<float>(), rows); });  // the staged copy reused
    // The conversion alone, into the peer's input (bf16 values of the same kind as its fill).
    times.convert_ms = median_ms(stream, reps, [&] { launch_to_half(arena.as<float>(), rows, in, in, x.ptr, kWBF16, stream); });
    // The library alone: bf16 in, bf16 out, no conversion (its best case at this shape).
    DeviceBuffer y(static_cast<size_t>(rows * out) * 2, "GEMM peer");
    const float alpha = 1.0f, beta = 0.0f;
    const auto m = static_cast<int>(out), n = static_cast<int>(rows), k = static_cast<int>(in);
    cublasHandle_t handle = ours.handle();
    times.cublas_ms = median_ms(stream, reps, [&] {
      check_cublas(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, w.ptr, CUDA_R_16BF, k, x.ptr, CUDA_R_16BF, k, &beta, y.ptr, CUDA_R_16BF, m,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "bf16 GEMM peer");
    });
  }
  cudaStreamDestroy(stream);
  return times;
}

}  // namespace plow::cuda
