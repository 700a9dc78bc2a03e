// What `plow inspect FILE.plow` reports about a plan: sizes, the critical path through the task
// dependency graph, and the weight bytes one step touches.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "core/dtype.h"
#include "plan/plan.h"

namespace plow {

struct PlanSummary {
  int64_t ops = 0;
  int64_t tasks = 0;
  int64_t counters = 0;
  int64_t critical_path_tasks = 0;  // longest chain of tasks linked by counter waits
  int64_t arena_bytes = 0;
  int64_t weight_bytes_per_step = 0;  // a full bucket: max_tokens rows (embedding rows, top-k experts per row)
  int64_t min_queue_tasks = 0;
  int64_t max_queue_tasks = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> by_opcode;  // op name → (ops, tasks)
};

// The plan must have passed validate_plan. weight_dtype: how non-MXFP4 weights are stored.
PlanSummary summarize_plan(const Plan& plan, DType weight_dtype);
int64_t critical_path_tasks(const Plan& plan);

}  // namespace plow
