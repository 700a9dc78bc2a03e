// measured_critical_path: the walk back from the task that ended last (critical_path.h).
#include "plan/critical_path.h"

#include <algorithm>
#include <map>

#include "core/error.h"

namespace plow {

CriticalPath measured_critical_path(const Plan& plan, const std::vector<TaskTimes>& times) {
  if (times.size() != plan.tasks.size()) fail("critical path: {} task times for a plan of {} tasks", times.size(), plan.tasks.size());
  CriticalPath path;
  if (times.empty()) return path;
  // Each task's queue predecessor, and per counter the signaller that ended last.
  std::vector<int32_t> before(plan.tasks.size(), -1);
  for (const std::vector<int32_t>& queue : plan.queues) {
    for (size_t i = 1; i < queue.size(); ++i) before[static_cast<size_t>(queue[i])] = queue[i - 1];
  }
  std::vector<int32_t> last_signaller(static_cast<size_t>(std::max(plan.counters, 0)), -1);
  for (size_t t = 0; t < plan.tasks.size(); ++t) {
    for (int32_t c : plan.tasks[t].signals) {
      int32_t& last = last_signaller[static_cast<size_t>(c)];
      if (last < 0 || times[t].end > times[static_cast<size_t>(last)].end) last = static_cast<int32_t>(t);
    }
  }
  int32_t at = 0;
  for (size_t t = 1; t < times.size(); ++t) {
    if (times[t].end > times[static_cast<size_t>(at)].end) at = static_cast<int32_t>(t);
  }
  std::map<std::string, CriticalPathOp> by_op;
  const double last_end = times[static_cast<size_t>(at)].end;
  while (true) {
    path.chain.push_back(at);
    const PlanTask& task = plan.task(at);
    const TaskTimes& now = times[static_cast<size_t>(at)];
    const std::string name(op_name(plan.op(task.op).op()));
    CriticalPathOp& entry = by_op[name];
    entry.op = name;
    entry.tasks += 1;
    entry.run_ns += now.end - now.start;
    path.run_ns += now.end - now.start;
    const int32_t producer = task.wait_threshold > 0 ? last_signaller[static_cast<size_t>(task.wait_counter)] : -1;
    const int32_t queued = before[static_cast<size_t>(at)];
    const bool waited = producer >= 0 && (queued < 0 || times[static_cast<size_t>(producer)].end >= times[static_cast<size_t>(queued)].end);
    if (waited) {
      const double hop = now.start - times[static_cast<size_t>(producer)].end;
      entry.hop_ns += hop;
      path.hop_ns += hop;
      path.hops += 1;
      at = producer;
    } else if (queued >= 0) {
      const double gap = now.start - times[static_cast<size_t>(queued)].end;
      entry.queue_ns += gap;
      path.queue_ns += gap;
      at = queued;
    } else {
      path.lead_ns = now.start - now.free;
      path.span_ns = last_end - now.free;
      break;
    }
  }
  std::reverse(path.chain.begin(), path.chain.end());
  path.tasks = static_cast<int64_t>(path.chain.size());
  for (auto& [name, entry] : by_op) path.ops.push_back(entry);
  std::sort(path.ops.begin(), path.ops.end(), [](const CriticalPathOp& a, const CriticalPathOp& b) {
    return a.run_ns + a.hop_ns + a.queue_ns > b.run_ns + b.hop_ns + b.queue_ns;
  });
  return path;
}

}  // namespace plow
