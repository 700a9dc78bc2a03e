// The measured critical path of one run of a plan: given when each task's worker was free for it, when
// its wait was satisfied, and when its body started and ended, the chain of tasks that set the step's
// length, and what that chain spent in each op's bodies, in the hops between a producer's end and its
// consumer's start, and in the gaps between two tasks of one queue. The static path
// (summary.h critical_path_tasks) counts tasks; this one measures them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/plan.h"

namespace plow {

// One task of a run, in nanoseconds from any common origin (every worker's clock mapped onto it).
struct TaskTimes {
  double free = 0;   // its worker began this task (the task before it in the queue had ended)
  double ready = 0;  // its wait was satisfied (= free for a task that waits on nothing)
  double start = 0;  // its body started
  double end = 0;    // its body ended (its counters released)
};

// The path's time by opcode: `run` in bodies of that op, `hop` from the end of the producer whose
// release let a task of that op go to that task's start (the consumer's wait and dispatch), `queue`
// from the end of the task before it in its worker's queue to its start (the task did not wait).
struct CriticalPathOp {
  std::string op;
  int64_t tasks = 0;  // tasks of the op on the path
  double run_ns = 0, hop_ns = 0, queue_ns = 0;
};

struct CriticalPath {
  double span_ns = 0;    // the path's first task's free time to its last task's end: its parts sum to this
  int64_t tasks = 0;     // tasks on the path
  int64_t hops = 0;      // of which entered through a counter
  double run_ns = 0, hop_ns = 0, queue_ns = 0, lead_ns = 0;  // lead: the first task's free → start
  std::vector<CriticalPathOp> ops;  // by run + hop + queue, largest first
  std::vector<int32_t> chain;       // the path's task indices (plan.tasks), first to last
};

// times: one per plan task (plan.tasks order). The path ends at the task that ends last and walks back:
// a task that waited (its producer ended no earlier than its queue predecessor) came from the producer (the
// signaller of its wait counter that ended last), else from its queue predecessor. Throws on a size
// mismatch.
CriticalPath measured_critical_path(const Plan& plan, const std::vector<TaskTimes>& times);

}  // namespace plow
