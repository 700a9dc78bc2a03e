// Lowering a graph to a Plan for one bucket: slices every op over the workers, places buffers in an
// arena with reuse, wires the dependency counters (data and write-after-read) and fills the queues.
#pragma once

#include <cstdint>

#include "graph/graph.h"
#include "plan/plan.h"

namespace plow {

struct LowerOptions {
  PlanPhase phase = PlanPhase::kDecode;
  int64_t max_tokens = 1;         // decode: batch bucket (1, 2, 4, …); prefill: chunk tokens
  int32_t workers = 1;
  int64_t max_context = 0;        // informational for now (backends reserve caches from their own option)
  uint64_t model_fingerprint = 0; // model_fingerprint(config text, the model's graph before fusion)
  // A light op (a few loads and flops an output element, no weight matrix to stream: short conv, KDA
  // gate, sigmoid, elementwise products and sums, RMSNorm and add_norm) gets at most one task per this
  // many output elements of the bucket (max_tokens × width), never fewer than one; 1: one slice per
  // worker like every other op. See lower.cpp add_tasks. 48B decode on the H200, ms a step at batch 1
  // / 4 × context 0 (`plow bench decode --light-task-elements N`): 1: 6.08 / 11.43; 64: 5.84 / 11.42;
  // 256: 5.72 / 11.16; 512: 5.72 / 11.03; 1,024: 5.75 / 11.06; 4,096: 6.06 / 11.33.
  static constexpr int64_t kLightTaskElements = 512;
  int64_t light_task_elements = kLightTaskElements;
  // Workers a serial op's shadow tail runs on, beside the serial op's first reader (lower.cpp: the
  // shared expert's down projection beside the routed gate/up); 0 keeps the tail in the shadow on
  // every worker. Taken when the plan has at least kWorkersPerTailWorker times as many workers. Off by
  // default until timed on a GPU (`plow bench decode --shadow-tail-workers N`; docs/cuda.md).
  static constexpr int32_t kShadowTailWorkers = 0;
  static constexpr int64_t kWorkersPerTailWorker = 4;
  int32_t shadow_tail_workers = kShadowTailWorkers;
};

// The graph must pass Graph::verify(). Throws plow::Error for options out of range.
Plan lower_to_plan(const Graph& graph, const LowerOptions& options);

}  // namespace plow
