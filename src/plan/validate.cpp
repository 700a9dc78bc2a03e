// validate_plan: see validate.h for the list of guarantees. The checks run in dependency order
// (counts, then ops, then tasks, counters, buffers, queues) so each one may index what the earlier
// ones have bounded.
#include "plan/validate.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/error.h"
#include "plan/occupants.h"

namespace plow {

namespace {

constexpr double kMaxAttrMagnitude = 16777216.0;  // 2^24: integer casts are exact, products of two fit int64

// Attributes that kernels and shape rules use as sizes: non-negative integers (≥ 1 unless listed in kZeroOk).
const std::set<std::string_view> kSizeAttrs = {"heads", "head_dim", "nope", "rope", "v", "rank", "kernel", "experts",
                                               "top_k", "groups", "topk_groups", "width", "offset", "conv_q", "conv_k", "conv_v"};
const std::set<std::string_view> kZeroOk = {"nope", "rope", "offset", "conv_q", "conv_k", "conv_v"};  // conv_*: state ids

class Checker {
 public:
  Checker(const Plan& plan, const std::function<bool(uint8_t)>& backend_has_op) : plan_(plan), has_op_(backend_has_op) {}

  void run() {
    check_counts();
    check_declarations();
    check_ops();
    check_tasks();
    check_counters();
    check_buffers();
    check_queues();
  }

 private:
  template <typename... Args>
  [[noreturn]] void reject(fmt::format_string<Args...> format, Args&&... args) const {
    fail("plan '{}': {}", plan_.source, fmt::format(format, std::forward<Args>(args)...));
  }

  std::string describe(int32_t i) const {
    const PlanOp& op = plan_.ops[static_cast<size_t>(i)];
    const std::string_view name = op.opcode < static_cast<uint8_t>(Op::kCount) ? op_name(op.op()) : "?";
    return fmt::format("op {} ('{}', {})", i, op.label, name);
  }

  void check_counts() const {
    using L = PlanLimits;
    if (plan_.format_version != kPlanFormatVersion) reject("format version {}, this build runs {}", plan_.format_version, kPlanFormatVersion);
    auto bound = [&](const char* field, int64_t value, int64_t lo, int64_t hi) {
      if (value < lo || value > hi) reject("field '{}' is {}, expected {}..{}", field, value, lo, hi);
    };
    bound("max_tokens", plan_.max_tokens, 1, L::kMaxTokens);
    bound("workers", plan_.workers, 1, L::kMaxWorkers);
    bound("ops", static_cast<int64_t>(plan_.ops.size()), 1, L::kMaxOps);
    bound("tasks", static_cast<int64_t>(plan_.tasks.size()), 0, L::kMaxTasks);
    bound("counters", plan_.counters, 0, L::kMaxCounters);
    bound("weights", static_cast<int64_t>(plan_.weights.size()), 0, L::kMaxWeights);
    bound("states", static_cast<int64_t>(plan_.states.size()), 0, L::kMaxStates);
    bound("queues", static_cast<int64_t>(plan_.queues.size()), plan_.workers, plan_.workers);
    bound("arena_floats", plan_.arena_floats, 0, L::kMaxArenaFloats);
    bound("output_op", plan_.output_op, 0, static_cast<int64_t>(plan_.ops.size()) - 1);
    bound("compile.ops_before_fusion", plan_.compile.ops_before_fusion, 0, L::kMaxOps);
    bound("compile.rules_fired", static_cast<int64_t>(plan_.compile.rules_fired.size()), 0, L::kMaxRules);
  }

  void check_declarations() {
    for (size_t i = 0; i < plan_.weights.size(); ++i) {
      const WeightDecl& w = plan_.weights[i];
      const auto parts = static_cast<int64_t>(w.parts.size()), rank = static_cast<int64_t>(w.shape.size());
      if (w.name.empty() || static_cast<int64_t>(w.name.size()) > PlanLimits::kMaxNameBytes) reject("weight {}: name of {} bytes", i, w.name.size());
      if (parts < 1 || parts > PlanLimits::kMaxWeightParts) reject("weight {} ('{}'): {} parts, expected 1..{}", i, w.name, parts, PlanLimits::kMaxWeightParts);
      if (rank < 1 || rank > PlanLimits::kMaxShapeRank) reject("weight {} ('{}'): shape of rank {}", i, w.name, rank);
      for (int64_t d : w.shape) {
        if (d < 1 || d > PlanLimits::kMaxDim) reject("weight {} ('{}'): dimension {} outside 1..{}", i, w.name, d, PlanLimits::kMaxDim);
      }
      graph_.add_weight(w);
    }
    for (size_t i = 0; i < plan_.states.size(); ++i) {
      const StateDecl& s = plan_.states[i];
      if (s.width < 1 || s.width > PlanLimits::kMaxWidth || s.depth < 0 || s.depth > PlanLimits::kMaxWidth ||
          (s.kind == StateKind::kKdaRecurrent && (s.depth < 1 || s.width % s.depth != 0))) {
        reject("state {} ('{}'): width {} and depth {} are not a valid state size", i, s.label, s.width, s.depth);
      }
      graph_.add_state(s);
    }
  }

  void check_attrs(int32_t i, const PlanOp& op) const {
    if (static_cast<int64_t>(op.attrs.values().size()) > PlanLimits::kMaxAttrs) reject("{}: {} attributes", describe(i), op.attrs.values().size());
    for (const auto& [name, value] : op.attrs.values()) {
      if (!std::isfinite(value) || std::fabs(value) > kMaxAttrMagnitude) reject("{}: attribute '{}' = {} is not a finite number within ±2^24", describe(i), name, value);
      if (!kSizeAttrs.count(name)) continue;
      const double least = kZeroOk.count(name) ? 0.0 : 1.0;
      if (value != std::floor(value) || value < least) reject("{}: attribute '{}' = {} must be an integer >= {}", describe(i), name, value, least);
    }
    if (op.op() == Op::kMoeTopK) {
      for (const char* name : {"experts", "top_k", "groups", "topk_groups", "renormalize", "scale", "softmax"}) {
        if (!op.attrs.has(name)) reject("{}: attribute '{}' is missing", describe(i), name);
      }
      const int64_t experts = op.attrs.i("experts"), top_k = op.attrs.i("top_k"), groups = op.attrs.i("groups"), keep = op.attrs.i("topk_groups");
      if (experts % groups != 0 || keep > groups || top_k > keep * (experts / groups)) {
        reject("{}: routing {} of {} experts in {} groups keeping {} is impossible", describe(i), top_k, experts, groups, keep);
      }
    }
  }

  void check_ops() {
    for (int32_t i = 0; i < static_cast<int32_t>(plan_.ops.size()); ++i) {
      const PlanOp& op = plan_.ops[static_cast<size_t>(i)];
      if (op.opcode >= static_cast<uint8_t>(Op::kCount)) reject("op {} ('{}'): opcode {} is not in the op table ({} ops)", i, op.label, op.opcode, static_cast<int>(Op::kCount));
      if (!has_op_(op.opcode)) reject("{}: this backend has no kernel for op '{}'", describe(i), op_name(op.op()));
      if (static_cast<int64_t>(op.label.size()) > PlanLimits::kMaxNameBytes) reject("op {}: label of {} bytes", i, op.label.size());
      if (static_cast<int64_t>(op.inputs.size()) > PlanLimits::kMaxOpInputs || static_cast<int64_t>(op.weights.size()) > PlanLimits::kMaxOpWeights) {
        reject("{}: {} inputs and {} weights", describe(i), op.inputs.size(), op.weights.size());
      }
      for (int32_t input : op.inputs) {
        if (input < 0 || input >= i) reject("{}: input {} is not an earlier op (producers must precede consumers)", describe(i), input);
      }
      for (int32_t w : op.weights) {
        if (w < 0 || w >= static_cast<int32_t>(plan_.weights.size())) reject("{}: weight {} outside the weight table of {}", describe(i), w, plan_.weights.size());
      }
      if (op.state != -1 && (op.state < 0 || op.state >= static_cast<int32_t>(plan_.states.size()))) reject("{}: state {} outside the state table", describe(i), op.state);
      if (op.state >= 0 && !state_users_.insert(op.state).second) reject("{}: state {} is already updated by another op", describe(i), op.state);
      if (op.width < 1 || op.width > PlanLimits::kMaxWidth) reject("{}: width {} outside 1..{}", describe(i), op.width, PlanLimits::kMaxWidth);
      if (op.dtype != out_dtype_of(op.op(), op.attrs)) reject("{}: output dtype differs from the op table's", describe(i));
      check_attrs(i, op);
      try {
        graph_.add(op.op(), {op.inputs.begin(), op.inputs.end()}, {op.weights.begin(), op.weights.end()}, op.attrs, op.label, op.state);
      } catch (const InternalError& e) {
        reject("{} does not fit the op table: {}", describe(i), e.what());
      }
      if (graph_.node(i).width != op.width) reject("{}: width {} but its shape rule gives {}", describe(i), op.width, graph_.node(i).width);
      for (const int extra : extra_states(graph_.node(i))) {  // kda_fused_core's conv windows
        if (extra >= static_cast<int>(plan_.states.size())) reject("{}: state {} outside the state table", describe(i), extra);
        if (!state_users_.insert(extra).second) reject("{}: state {} is already updated by another op", describe(i), extra);
      }
      check_wiring(i, op);
    }
    std::vector<bool> read(plan_.weights.size(), false);
    for (const PlanOp& op : plan_.ops) {
      for (int32_t w : op.weights) read[static_cast<size_t>(w)] = true;
    }
    for (size_t w = 0; w < read.size(); ++w) {
      if (!read[w]) reject("weight {} ('{}') is declared but no op reads it", w, plan_.weights[w].name);
    }
  }

  // What kernels index beyond the shape rules: state sizes, token ids and expert ids.
  void check_wiring(int32_t i, const PlanOp& op) const {
    const Node& node = graph_.node(i);
    auto expect_state = [&](StateKind kind, int64_t width, int64_t depth) {
      const StateDecl& s = plan_.states[static_cast<size_t>(op.state)];
      if (s.kind != kind || s.width != width || (depth >= 0 && s.depth != depth)) {
        reject("{}: state {} ('{}') has the wrong kind or size for this op", describe(i), op.state, s.label);
      }
    };
    switch (op.op()) {
      case Op::kShortConvSilu: expect_state(StateKind::kConvWindow, node.width, node.attrs.i("kernel") - 1); break;
      case Op::kKdaDeltaRule: expect_state(StateKind::kKdaRecurrent, node.width, node.attrs.i("heads")); break;
      case Op::kKdaFusedCore:
        expect_state(StateKind::kKdaRecurrent, node.width, node.attrs.i("heads"));
        for (const int window : extra_states(node)) {
          const StateDecl& s = plan_.states[static_cast<size_t>(window)];
          if (s.kind != StateKind::kConvWindow || s.width != node.width || s.depth != node.attrs.i("kernel") - 1) {
            reject("{}: conv state {} ('{}') has the wrong kind or size for this op", describe(i), window, s.label);
          }
        }
        break;
      case Op::kMlaAttention: expect_state(StateKind::kMlaLatent, node.attrs.i("rank") + node.attrs.i("rope"), -1); break;
      case Op::kEmbedding:
        if (plan_.ops[static_cast<size_t>(op.inputs[0])].op() != Op::kTokens) reject("{}: embeds op {}, which is not the token ids", describe(i), op.inputs[0]);
        break;
      default: break;
    }
    if (op.is_view()) {  // the shape rule has bounded [offset, offset + width) by the input's width
      if (i == plan_.output_op) reject("{}: the output is a slice (a view); backends need the logits in a buffer of their own", describe(i));
      const int64_t expected = activation_view(plan_, i).offset;
      if (op.offset != expected) reject("{}: a view at arena float {}, but its source's buffer puts its columns at {}", describe(i), op.offset, expected);
    }
    if (op.op() == Op::kAllReduce && plan_.ops[static_cast<size_t>(op.inputs[0])].is_view()) {
      reject("{}: reads a slice (a strided view), but collectives need contiguous rows", describe(i));
    }
    if (reads_routed_experts(op.op())) {  // kernels index the expert stacks by the ids in input 1
      const PlanOp& routes = plan_.ops[static_cast<size_t>(op.inputs[1])];
      if (routes.op() != Op::kMoeTopK || routes.attrs.get("experts") != op.attrs.get("experts") || routes.attrs.get("top_k") != op.attrs.get("top_k")) {
        reject("{}: routes come from {}, not a moe_topk over the same experts", describe(i), describe(op.inputs[1]));
      }
    }
  }

  void check_tasks() {
    tasks_of_.assign(plan_.ops.size(), {});
    waits_of_.assign(plan_.ops.size(), {});
    for (int32_t t = 0; t < static_cast<int32_t>(plan_.tasks.size()); ++t) {
      const PlanTask& task = plan_.tasks[static_cast<size_t>(t)];
      if (task.op < 0 || task.op >= static_cast<int32_t>(plan_.ops.size())) reject("task {}: op {} out of range", t, task.op);
      const PlanOp& op = plan_.ops[static_cast<size_t>(task.op)];
      if (op.op() == Op::kTokens) reject("task {}: {} is filled by the backend and has no tasks", t, describe(task.op));
      if (op.is_view()) reject("task {}: {} is a view of its input and has no tasks", t, describe(task.op));
      // A spread op's tasks past its units own the empty slice at its end (lower.cpp add_tasks).
      const bool spread_past_units = spread_tasks(graph_.node(task.op), plan_.workers, plan_.max_tokens) > 0 && task.col_begin == op.width && task.col_end == op.width;
      if (!spread_past_units && (task.col_begin < 0 || task.col_begin >= task.col_end || task.col_end > op.width)) {
        reject("task {} of {}: columns [{}, {}) outside [0, {})", t, describe(task.op), task.col_begin, task.col_end, op.width);
      }
      if (task.wait_counter < 0 || task.wait_counter >= plan_.counters) reject("task {}: wait counter {} outside 0..{}", t, task.wait_counter, plan_.counters - 1);
      if (task.wait_threshold < 0 || task.wait_threshold > PlanLimits::kMaxTasks) reject("task {}: threshold {} out of range", t, task.wait_threshold);
      if (static_cast<int64_t>(task.signals.size()) > PlanLimits::kMaxSignals) reject("task {}: signals {} counters", t, task.signals.size());
      std::vector<int32_t> sorted = task.signals;
      std::sort(sorted.begin(), sorted.end());
      for (size_t k = 0; k < sorted.size(); ++k) {
        if (sorted[k] < 0 || sorted[k] >= plan_.counters) reject("task {}: signal counter {} outside 0..{}", t, sorted[k], plan_.counters - 1);
        if (k > 0 && sorted[k] == sorted[k - 1]) reject("task {}: signals counter {} twice", t, sorted[k]);
      }
      tasks_of_[static_cast<size_t>(task.op)].push_back(t);
      auto& waits = waits_of_[static_cast<size_t>(task.op)];
      if (std::find(waits.begin(), waits.end(), task.wait_counter) == waits.end()) waits.push_back(task.wait_counter);
    }
    for (int32_t i = 0; i < static_cast<int32_t>(plan_.ops.size()); ++i) {
      if (plan_.ops[static_cast<size_t>(i)].op() == Op::kTokens || plan_.ops[static_cast<size_t>(i)].is_view()) continue;
      std::vector<std::pair<int64_t, int64_t>> slices;
      for (int32_t t : tasks_of_[static_cast<size_t>(i)]) slices.emplace_back(plan_.tasks[static_cast<size_t>(t)].col_begin, plan_.tasks[static_cast<size_t>(t)].col_end);
      std::sort(slices.begin(), slices.end());
      int64_t unit = 0;
      try {
        unit = slice_granularity(graph_.node(i));
      } catch (const InternalError& e) {
        reject("{}: no slice unit: {}", describe(i), e.what());
      }
      if (unit < 1) reject("{}: slice unit of {} columns", describe(i), unit);
      int64_t covered = 0;
      for (const auto& [begin, end] : slices) {
        if (begin != covered) reject("{}: slices leave a gap or overlap at column {}", describe(i), covered);
        if (begin % unit != 0 || (end % unit != 0 && end != plan_.ops[static_cast<size_t>(i)].width)) reject("{}: slice [{}, {}) splits a unit of {} columns", describe(i), begin, end, unit);
        covered = end;
      }
      if (covered != plan_.ops[static_cast<size_t>(i)].width) reject("{}: tasks cover {} of {} columns", describe(i), covered, plan_.ops[static_cast<size_t>(i)].width);
      // Empty slices only up to the op's spread (plans from before moe_topk or gated_rms_norm spread have fewer: valid).
      const auto tasks = static_cast<int64_t>(slices.size());
      const int64_t nonempty = std::count_if(slices.begin(), slices.end(), [](const auto& s) { return s.first < s.second; });
      const int64_t most = std::max(nonempty, spread_tasks(graph_.node(i), plan_.workers, plan_.max_tokens));
      if (tasks > most) reject("{}: {} tasks, at most {} ({} column slices, spread over {} workers and {} rows)", describe(i), tasks, most, nonempty, plan_.workers, plan_.max_tokens);
    }
  }

  bool signals(int32_t task, int32_t counter) const {
    const auto& list = plan_.tasks[static_cast<size_t>(task)].signals;
    return std::find(list.begin(), list.end(), counter) != list.end();
  }

  // Every task of `before` must signal every counter a task of `after` waits on.
  void require_edges(int32_t before, int32_t after, const char* why) const {
    for (int32_t counter : waits_of_[static_cast<size_t>(after)]) {
      for (int32_t s : tasks_of_[static_cast<size_t>(before)]) {
        if (!signals(s, counter)) reject("task {} of {} does not signal counter {} that {} waits on ({})", s, describe(before), counter, describe(after), why);
      }
    }
  }

  void check_counters() const {
    const auto counters = static_cast<size_t>(plan_.counters);
    std::vector<int64_t> signalled(counters, 0);
    std::vector<int32_t> last_signaller(counters, -1), first_waiter(counters, INT32_MAX);
    for (const PlanTask& task : plan_.tasks) {
      for (int32_t c : task.signals) {
        signalled[static_cast<size_t>(c)] += 1;
        last_signaller[static_cast<size_t>(c)] = std::max(last_signaller[static_cast<size_t>(c)], task.op);
      }
      first_waiter[static_cast<size_t>(task.wait_counter)] = std::min(first_waiter[static_cast<size_t>(task.wait_counter)], task.op);
    }
    for (int32_t t = 0; t < static_cast<int32_t>(plan_.tasks.size()); ++t) {
      const PlanTask& task = plan_.tasks[static_cast<size_t>(t)];
      const auto c = static_cast<size_t>(task.wait_counter);
      if (task.wait_threshold != signalled[c]) reject("task {} of {}: threshold {} but {} tasks signal counter {} per step", t, describe(task.op), task.wait_threshold, signalled[c], c);
      if (last_signaller[c] >= first_waiter[c]) {
        reject("counter {} is signalled by {} and awaited by {}: a task would wait on itself or a later op (cycle)", c, describe(last_signaller[c]), describe(first_waiter[c]));
      }
    }
    for (int32_t y = 0; y < static_cast<int32_t>(plan_.ops.size()); ++y) {
      for (int32_t input : plan_.ops[static_cast<size_t>(y)].inputs) require_edges(activation_view(plan_, input).owner, y, "it reads that op's output");
    }
  }

  // Buffers inside the arena; arena reuse only after the last reader, with a counter edge from every
  // reader of the space (or its writer, when nothing reads it) to the new owner. Views own no space:
  // a read through one is a read of the buffer it looks into (check_wiring pinned its offset there).
  void check_buffers() const {
    const auto n = static_cast<int32_t>(plan_.ops.size());
    std::vector<std::vector<int32_t>> readers(plan_.ops.size());
    for (int32_t j = 0; j < n; ++j) {
      if (plan_.ops[static_cast<size_t>(j)].is_view()) continue;
      for (int32_t input : plan_.ops[static_cast<size_t>(j)].inputs) {
        auto& list = readers[static_cast<size_t>(activation_view(plan_, input).owner)];
        if (list.empty() || list.back() != j) list.push_back(j);
      }
    }
    int64_t used_end = 0;
    OccupantMap occupants;
    for (int32_t y = 0; y < n; ++y) {
      const PlanOp& op = plan_.ops[static_cast<size_t>(y)];
      if (op.is_view()) continue;
      const int64_t floats = plan_.buffer_floats(op);
      if (op.offset < 0 || op.offset > plan_.arena_floats - floats) reject("{}: buffer [{}, {}) floats outside the arena of {}", describe(y), op.offset, op.offset + floats, plan_.arena_floats);
      used_end = std::max(used_end, op.offset + floats);
      const std::vector<int32_t> previous = occupants.claim(op.offset, op.offset + floats, y);
      for (int32_t x : previous) {  // liveness first: a live overlap is the clearer error
        const auto& read_by = readers[static_cast<size_t>(x)];
        if (x == plan_.output_op) reject("{}: buffer overwrites the output of {}", describe(y), describe(x));
        if (op.op() == Op::kTokens) reject("{}: token ids are written before the step, over the buffer of {}", describe(y), describe(x));
        if (!read_by.empty() && read_by.back() >= y) reject("{}: buffer overlaps that of {}, which {} still reads", describe(y), describe(x), describe(read_by.back()));
      }
      for (int32_t x : previous) {
        const auto& read_by = readers[static_cast<size_t>(x)];
        if (read_by.empty()) require_edges(x, y, "it overwrites that op's buffer");
        for (int32_t r : read_by) require_edges(r, y, "it overwrites a buffer that op reads");
      }
    }
    if (plan_.arena_floats > used_end) reject("arena of {} floats is larger than its buffers need ({})", plan_.arena_floats, used_end);
  }

  void check_queues() const {
    std::vector<bool> queued(plan_.tasks.size(), false);
    size_t total = 0;
    for (size_t w = 0; w < plan_.queues.size(); ++w) {
      int32_t previous_op = -1;
      for (int32_t t : plan_.queues[w]) {
        if (t < 0 || t >= static_cast<int32_t>(plan_.tasks.size())) reject("queue {}: task {} out of range", w, t);
        if (queued[static_cast<size_t>(t)]) reject("queue {}: task {} is queued twice", w, t);
        queued[static_cast<size_t>(t)] = true;
        const int32_t op = plan_.tasks[static_cast<size_t>(t)].op;
        if (op <= previous_op) reject("queue {}: task {} ({}) follows a task of {}: queues must run in op order", w, t, describe(op), describe(previous_op));
        previous_op = op;
        ++total;
      }
    }
    if (total != plan_.tasks.size()) reject("queues hold {} of {} tasks", total, plan_.tasks.size());
  }

  const Plan& plan_;
  const std::function<bool(uint8_t)>& has_op_;
  Graph graph_;  // the plan's ops rebuilt through the op table (shape rules)
  std::set<int32_t> state_users_;
  std::vector<std::vector<int32_t>> tasks_of_;
  std::vector<std::vector<int32_t>> waits_of_;  // distinct wait counters of each op's tasks
};

}  // namespace

void validate_plan(const Plan& plan, const std::function<bool(uint8_t opcode)>& backend_has_op) {
  Checker(plan, backend_has_op).run();
}

}  // namespace plow
