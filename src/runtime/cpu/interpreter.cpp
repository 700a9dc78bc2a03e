// PlanInterpreter: each step, the caller fills the token ids, releases the workers and runs queue 0
// itself; every worker walks its queue — wait until counter ≥ threshold × epoch, run the kernel on the
// task's columns, bump the counters it signals — and the caller joins them before it touches slots.
// A kernel exception sets the abort flag (waiting workers give up), is rethrown to the caller, and the
// failed plan's counters restart from zero.
#include "runtime/cpu/interpreter.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <utility>

#include "core/argmax.h"
#include "core/error.h"
#include "plan/validate.h"

namespace plow {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

bool same_state(const StateDecl& a, const StateDecl& b) {
  return a.kind == b.kind && a.width == b.width && a.depth == b.depth && a.label == b.label;
}

// Plan weight id → index into `weights`, matched by declaration name; parts and shapes must agree.
std::vector<int> bind_weights(const Plan& plan, const BoundWeights& weights, const std::map<std::string, int>& by_name) {
  std::vector<int> ids;
  for (const WeightDecl& decl : plan.weights) {
    auto it = by_name.find(decl.name);
    if (it == by_name.end()) fail("plan '{}': weight '{}' is not among the model's weights", plan.source, decl.name);
    const WeightDecl& bound = *weights[it->second].decl;
    if (bound.parts != decl.parts || bound.shape != decl.shape || bound.mxfp4 != decl.mxfp4) {
      fail("plan '{}': weight '{}' has shape [{}] ({} parts{}) in the plan but [{}] ({} parts{}) in the model", plan.source, decl.name,
           fmt::join(decl.shape, ","), decl.parts.size(), decl.mxfp4 ? ", MXFP4" : "", fmt::join(bound.shape, ","), bound.parts.size(),
           bound.mxfp4 ? ", MXFP4" : "");
    }
    ids.push_back(it->second);
  }
  return ids;
}

}  // namespace

struct PlanInterpreter::PreparedPlan {
  struct alignas(64) Counter {  // one per cache line: workers bump different counters without false sharing
    std::atomic<uint64_t> value{0};
  };
  struct Op {
    Node node;
    CpuOpFn kernel = nullptr;
    std::vector<Activation> inputs;  // into the arena
    std::vector<const BoundWeight*> weights;
    float* out = nullptr;
  };
  struct Task {
    int32_t op = 0;
    int64_t col_begin = 0, col_end = 0;
    Counter* wait = nullptr;
    uint64_t threshold = 0;
    std::vector<Counter*> signals;
  };

  Plan plan;
  std::vector<Op> ops;
  std::vector<Task> tasks;
  std::unique_ptr<Counter[]> counters;
  std::vector<int32_t> token_ops;
  uint64_t epoch = 0;  // steps this plan has started; counters reach threshold × epoch within one
};

PlanInterpreter::PlanInterpreter(const BoundWeights& weights, std::vector<Plan> plans, const InterpreterOptions& options)
    : weights_(weights), options_(options) {
  if (options.workers < 1 || options.workers > PlanLimits::kMaxWorkers) fail("cpu-plan: {} workers, expected 1..{}", options.workers, PlanLimits::kMaxWorkers);
  if (options.act_dtype != DType::F32 && options.act_dtype != DType::BF16 && options.act_dtype != DType::F16) {
    fail("cpu-plan: activation dtype {} is not supported (expected F32, BF16 or F16)", dtype_name(options.act_dtype));
  }
  if (options.num_slots < 1) fail("cpu-plan: {} slots, expected at least 1", options.num_slots);
  if (options.max_context_tokens < 1) fail("cpu-plan: max context of {} tokens, expected at least 1", options.max_context_tokens);
  if (plans.empty()) fail("cpu-plan: no plans to run");

  std::map<std::string, int> by_name;
  std::vector<std::vector<int>> weight_ids_of;  // per plan: plan weight id → bound weight index
  for (size_t i = 0; i < weights.size(); ++i) by_name.emplace(weights[static_cast<int>(i)].decl->name, static_cast<int>(i));
  for (Plan& plan : plans) {
    validate_plan(plan, has_op);
    const Plan& first = plans_.empty() ? plan : plans_.front()->plan;
    if (options.model_fingerprint && plan.model_fingerprint != *options.model_fingerprint) {
      fail("plan '{}' was compiled for model {:016x}, this model is {:016x}", plan.source, plan.model_fingerprint, *options.model_fingerprint);
    }
    if (plan.workers > options.workers) fail("plan '{}' needs {} workers, the interpreter has {}", plan.source, plan.workers, options.workers);
    if (plan.states.size() != first.states.size() || !std::equal(plan.states.begin(), plan.states.end(), first.states.begin(), same_state) ||
        plan.op(plan.output_op).width != first.op(first.output_op).width) {
      fail("plan '{}' and plan '{}' describe different models (state tables or output widths differ)", plan.source, first.source);
    }
    std::vector<int> weight_ids = bind_weights(plan, weights, by_name);
    auto prepared = std::make_unique<PreparedPlan>();
    prepared->plan = std::move(plan);
    plans_.push_back(std::move(prepared));
    plans_.back()->ops.reserve(plans_.back()->plan.ops.size());
    arena_.resize(std::max(arena_.size(), static_cast<size_t>(plans_.back()->plan.arena_floats)));
    weight_ids_of.push_back(std::move(weight_ids));
  }
  for (size_t i = 0; i < plans_.size(); ++i) prepare(*plans_[i], weight_ids_of[i]);  // the arena is final now

  slots_.resize(static_cast<size_t>(options.num_slots));
  for (int slot = 0; slot < options.num_slots; ++slot) reset_slot(slot);
  for (int w = 0; w < options.workers; ++w) delay_rngs_.emplace_back(options.inject_delay_seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(w));
  for (int w = 1; w < options.workers; ++w) threads_.emplace_back([this, w] { worker_loop(w); });
}

PlanInterpreter::~PlanInterpreter() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

// Resolves every operand to a pointer once: arena buffers, bound weights, the kernel, the counters.
void PlanInterpreter::prepare(PreparedPlan& prepared, const std::vector<int>& weight_ids) {
  const Plan& plan = prepared.plan;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    PreparedPlan::Op& ready = prepared.ops.emplace_back();
    ready.node.op = op.op();
    ready.node.inputs.assign(op.inputs.begin(), op.inputs.end());
    ready.node.weights.assign(op.weights.begin(), op.weights.end());
    ready.node.attrs = op.attrs;
    ready.node.state = op.state;
    ready.node.width = op.width;
    ready.node.dtype = op.dtype;
    ready.node.label = op.label;
    ready.kernel = cpu_kernel(op.op());
    ready.out = arena_.data() + op.offset;
    for (int32_t input : op.inputs) {
      const ActivationView view = activation_view(plan, input);  // a slice is read in place, at its source's stride
      ready.inputs.push_back({arena_.data() + view.offset, view.width, view.row_stride});
    }
    for (int32_t w : op.weights) ready.weights.push_back(&weights_[weight_ids[static_cast<size_t>(w)]]);
    if (op.op() == Op::kTokens) prepared.token_ops.push_back(static_cast<int32_t>(i));
  }
  prepared.counters.reset(new PreparedPlan::Counter[static_cast<size_t>(plan.counters)]);
  for (const PlanTask& task : plan.tasks) {
    PreparedPlan::Task& ready = prepared.tasks.emplace_back();
    ready.op = task.op;
    ready.col_begin = task.col_begin;
    ready.col_end = task.col_end;
    ready.wait = &prepared.counters[static_cast<size_t>(task.wait_counter)];
    ready.threshold = static_cast<uint64_t>(task.wait_threshold);
    for (int32_t c : task.signals) ready.signals.push_back(&prepared.counters[static_cast<size_t>(c)]);
  }
}

bool PlanInterpreter::has_op(uint8_t opcode) {
  const auto op = static_cast<Op>(opcode);
  return op == Op::kTokens || (op < Op::kCount && cpu_kernel(op) != nullptr);
}

const Plan& PlanInterpreter::plan(int index) const { return plans_.at(static_cast<size_t>(index))->plan; }

void PlanInterpreter::reset_slot(int slot) {
  if (slot < 0 || slot >= num_slots()) fail("cpu-plan: slot {} outside 0..{}", slot, num_slots() - 1);
  const std::vector<StateDecl>& states = plans_.front()->plan.states;
  SlotState& state = slots_[static_cast<size_t>(slot)];
  state.context_tokens = 0;
  state.buffers.resize(states.size());
  for (size_t i = 0; i < states.size(); ++i) {
    const StateDecl& decl = states[i];
    std::vector<float>& buffer = state.buffers[i];
    switch (decl.kind) {
      case StateKind::kConvWindow: buffer.assign(static_cast<size_t>(decl.width * decl.depth), 0.0f); break;
      case StateKind::kKdaRecurrent: buffer.assign(static_cast<size_t>(decl.width * (decl.width / decl.depth)), 0.0f); break;
      case StateKind::kMlaLatent:
        // Reserved once: the head-0 slice appends while the other slices read, so it must never reallocate.
        buffer.clear();
        buffer.reserve(static_cast<size_t>(options_.max_context_tokens * decl.width));
        break;
    }
  }
}

int64_t PlanInterpreter::context_tokens(int slot) const {
  if (slot < 0 || slot >= num_slots()) fail("cpu-plan: slot {} outside 0..{}", slot, num_slots() - 1);
  return slots_[static_cast<size_t>(slot)].context_tokens;
}

SlotSnapshot PlanInterpreter::save_slot(int slot, int64_t rows_begin) const {
  if (slot < 0 || slot >= num_slots()) fail("cpu-plan: slot {} outside 0..{}", slot, num_slots() - 1);
  return save_slot_state(slots_[static_cast<size_t>(slot)], plans_.front()->plan.states, rows_begin);
}

void PlanInterpreter::restore_slot(int slot, const SlotSnapshot& snapshot) {
  if (slot < 0 || slot >= num_slots()) fail("cpu-plan: slot {} outside 0..{}", slot, num_slots() - 1);
  reset_slot(slot);  // reserves the MLA caches before the rows are copied in
  restore_slot_state(slots_[static_cast<size_t>(slot)], plans_.front()->plan.states, snapshot, options_.max_context_tokens);
}

int PlanInterpreter::choose_plan(const StepInputs& inputs) const {
  const auto rows = static_cast<int64_t>(inputs.token_ids.size());
  const bool decode = std::all_of(inputs.sequences.begin(), inputs.sequences.end(), [](const SequenceStep& s) { return s.query_tokens == 1; });
  const PlanPhase phase = decode ? PlanPhase::kDecode : PlanPhase::kPrefill;
  int best = -1;
  for (size_t i = 0; i < plans_.size(); ++i) {
    const Plan& plan = plans_[i]->plan;
    if (plan.phase != phase || plan.max_tokens < rows) continue;
    if (best < 0 || plan.max_tokens < plans_[static_cast<size_t>(best)]->plan.max_tokens) best = static_cast<int>(i);
  }
  if (best >= 0) return best;
  std::string available;
  for (const auto& prepared : plans_) {
    available += fmt::format("{}{} ≤ {}", available.empty() ? "" : ", ", phase_name(prepared->plan.phase), prepared->plan.max_tokens);
  }
  fail("cpu-plan: no {} plan holds a step of {} tokens in {} sequences (plans: {})", phase_name(phase), rows, inputs.sequences.size(), available);
}

StepOutput PlanInterpreter::step(const StepInputs& inputs) {
  const auto rows = static_cast<int64_t>(inputs.token_ids.size());
  if (inputs.sequences.empty() || rows == 0) fail("cpu-plan: a step needs at least one sequence and one token");
  StepDescriptor desc;
  desc.tokens = rows;
  std::vector<bool> seen(slots_.size(), false);
  for (const SequenceStep& seq : inputs.sequences) {
    if (seq.slot < 0 || seq.slot >= num_slots()) fail("cpu-plan: slot {} outside 0..{}", seq.slot, num_slots() - 1);
    if (seen[static_cast<size_t>(seq.slot)]) fail("cpu-plan: slot {} appears twice in one step", seq.slot);
    seen[static_cast<size_t>(seq.slot)] = true;
    if (seq.query_tokens < 1) fail("cpu-plan: sequence in slot {} brings {} tokens", seq.slot, seq.query_tokens);
    const int64_t context = slots_[static_cast<size_t>(seq.slot)].context_tokens;
    if (context + seq.query_tokens > options_.max_context_tokens) {
      fail("cpu-plan: slot {} would hold {} tokens, the maximum context is {}", seq.slot, context + seq.query_tokens, options_.max_context_tokens);
    }
    const int64_t first_row = desc.sequences.empty() ? 0 : desc.sequences.back().first_row + desc.sequences.back().query_tokens;
    desc.sequences.push_back({seq.slot, first_row, seq.query_tokens, context, {}});
  }
  if (desc.sequences.back().first_row + desc.sequences.back().query_tokens != rows) fail("cpu-plan: sequences cover {} tokens, the step has {}", desc.sequences.back().first_row + desc.sequences.back().query_tokens, rows);

  const int chosen = choose_plan(inputs);
  PreparedPlan& prepared = *plans_[static_cast<size_t>(chosen)];
  for (int32_t op : prepared.token_ops) {
    for (int64_t t = 0; t < rows; ++t) prepared.ops[static_cast<size_t>(op)].out[t] = static_cast<float>(inputs.token_ids[static_cast<size_t>(t)]);
  }
  prepared.epoch += 1;
  current_ = &prepared;
  inputs_ = &inputs;
  rows_ = rows;
  run_workers();
  if (error_) {
    // Tasks that never ran left the counters short of this epoch: restart this plan's epochs.
    for (int32_t c = 0; c < prepared.plan.counters; ++c) prepared.counters[static_cast<size_t>(c)].value.store(0, std::memory_order_relaxed);
    prepared.epoch = 0;
    abort_.store(false, std::memory_order_relaxed);
    std::exception_ptr error = std::exchange(error_, nullptr);
    std::rethrow_exception(error);
  }
  for (const SequenceStep& seq : inputs.sequences) slots_[static_cast<size_t>(seq.slot)].context_tokens += seq.query_tokens;
  last_plan_ = chosen;
  last_step_ = std::move(desc);

  const PlanOp& head = prepared.plan.op(prepared.plan.output_op);
  const float* logits = prepared.ops[static_cast<size_t>(prepared.plan.output_op)].out;
  StepOutput result;
  result.vocab = head.width;
  if (inputs.all_logits) {
    result.rows = rows;
    result.logits.assign(logits, logits + rows * head.width);
    return result;
  }
  for (const StepSequenceDesc& seq : last_step_.sequences) {
    const float* row = logits + (seq.first_row + seq.query_tokens - 1) * head.width;
    if (inputs.argmax_only) {  // as the cuda backend answers: the ids, no logits
      result.argmax.push_back(argmax(std::span<const float>(row, static_cast<size_t>(head.width))));
    } else {
      result.logits.insert(result.logits.end(), row, row + head.width);
    }
    result.rows += 1;
  }
  return result;
}

void PlanInterpreter::run_workers() {
  if (!threads_.empty()) {
    {
      std::lock_guard lock(mutex_);
      generation_ += 1;
      pending_ = static_cast<int>(threads_.size());
    }
    start_cv_.notify_all();
  }
  run_queue(0);
  if (!threads_.empty()) {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
  }
}

void PlanInterpreter::worker_loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      start_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    run_queue(worker);
    std::lock_guard lock(mutex_);
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

void PlanInterpreter::record_error(std::exception_ptr error) {
  std::lock_guard lock(error_mutex_);
  if (!error_) error_ = std::move(error);
  abort_.store(true, std::memory_order_relaxed);
}

void PlanInterpreter::run_queue(int worker) {
  PreparedPlan& prepared = *current_;
  if (worker >= prepared.plan.workers) return;
  const uint64_t epoch = prepared.epoch;
  for (int32_t index : prepared.plan.queues[static_cast<size_t>(worker)]) {
    const PreparedPlan::Task& task = prepared.tasks[static_cast<size_t>(index)];
    if (options_.inject_delay_max_us > 0) {
      const auto delay_us = static_cast<int64_t>(delay_rngs_[static_cast<size_t>(worker)]() % static_cast<uint64_t>(options_.inject_delay_max_us + 1));
      if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    }
    // Spin, then yield, then sleep: workers may outnumber cores (CI machines have two).
    const uint64_t target = task.threshold * epoch;
    for (uint32_t spins = 0; task.wait->value.load(std::memory_order_acquire) < target; ++spins) {
      if (abort_.load(std::memory_order_relaxed)) return;
      if (spins < 64) {
        cpu_relax();
      } else if (spins < 64 + 256) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    const PreparedPlan::Op& op = prepared.ops[static_cast<size_t>(task.op)];
    try {
      OpContext ctx{op.node, op.inputs, op.weights, op.out, rows_, options_.act_dtype, *inputs_, slots_, task.col_begin, task.col_end, options_.collective};
      op.kernel(ctx);
    } catch (...) {
      record_error(std::current_exception());
      return;
    }
    for (PreparedPlan::Counter* counter : task.signals) counter->value.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace plow
