// summarize_plan: counts, the critical path (tasks in op order, so every signaller of a counter is
// seen before its waiters) and the weight bytes a full bucket reads.
#include "plan/summary.h"

#include <algorithm>

namespace plow {

int64_t critical_path_tasks(const Plan& plan) {
  std::vector<int32_t> order(plan.tasks.size());
  for (size_t t = 0; t < order.size(); ++t) order[t] = static_cast<int32_t>(t);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return plan.task(a).op < plan.task(b).op; });
  std::vector<int64_t> counter_depth(static_cast<size_t>(plan.counters), 0);  // deepest task signalling each counter
  int64_t longest = 0;
  for (int32_t t : order) {
    const PlanTask& task = plan.task(t);
    const int64_t depth = 1 + (task.wait_threshold > 0 ? counter_depth[static_cast<size_t>(task.wait_counter)] : 0);
    for (int32_t c : task.signals) counter_depth[static_cast<size_t>(c)] = std::max(counter_depth[static_cast<size_t>(c)], depth);
    longest = std::max(longest, depth);
  }
  return longest;
}

namespace {

// Bytes of one op's weights that a step of `rows` tokens reads: one embedding row per token, top_k
// parts of a stacked (expert) weight per token, everything else whole.
int64_t op_weight_bytes(const Plan& plan, const PlanOp& op, DType weight_dtype, int64_t rows) {
  int64_t bytes = 0;
  for (int32_t id : op.weights) {
    const WeightDecl& decl = plan.weights[static_cast<size_t>(id)];
    int64_t numel = 1;
    for (int64_t d : decl.shape) numel *= d;
    const int64_t part_bytes = decl.mxfp4 ? numel / 2 + numel / 32 : numel * static_cast<int64_t>(dtype_size(weight_dtype));
    const auto parts = static_cast<int64_t>(decl.parts.size());
    if (op.op() == Op::kEmbedding) {
      bytes += part_bytes / decl.shape[0] * std::min(rows, decl.shape[0]);
    } else if (parts > 1 && op.attrs.has("top_k")) {
      bytes += part_bytes * std::min(parts, rows * op.attrs.i("top_k"));
    } else {
      bytes += part_bytes * parts;
    }
  }
  return bytes;
}

}  // namespace

PlanSummary summarize_plan(const Plan& plan, DType weight_dtype) {
  PlanSummary s;
  s.ops = static_cast<int64_t>(plan.ops.size());
  s.tasks = static_cast<int64_t>(plan.tasks.size());
  s.counters = plan.counters;
  s.critical_path_tasks = critical_path_tasks(plan);
  s.arena_bytes = plan.arena_bytes();
  for (const PlanOp& op : plan.ops) {
    s.by_opcode[std::string(op_name(op.op()))].first += 1;
    s.weight_bytes_per_step += op_weight_bytes(plan, op, weight_dtype, plan.max_tokens);
  }
  for (const PlanTask& task : plan.tasks) s.by_opcode[std::string(op_name(plan.op(task.op).op()))].second += 1;
  s.min_queue_tasks = plan.queues.empty() ? 0 : static_cast<int64_t>(plan.queues.front().size());
  for (const auto& queue : plan.queues) {
    s.min_queue_tasks = std::min(s.min_queue_tasks, static_cast<int64_t>(queue.size()));
    s.max_queue_tasks = std::max(s.max_queue_tasks, static_cast<int64_t>(queue.size()));
  }
  return s;
}

}  // namespace plow
