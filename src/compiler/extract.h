// Extraction: pick one e-node per e-class by a cost model (bytes moved + per-task overhead +
// instruction count), then rebuild a Graph from the root by walking the shared DAG with
// memoization — a class used by many consumers becomes one node, never a copy per use.
#pragma once

#include <functional>

#include "compiler/egraph.h"
#include "graph/graph.h"

namespace plow {

struct CostModel {
  double bytes_per_param = 2.0;            // bf16 weights; MXFP4 declarations count 0.53
  double bytes_per_activation = 2.0;       // per element read or written, one token (decode)
  double task_overhead_bytes = 1.3e6;      // ~0.3 µs of a 4.3 TB/s memory system per extra task
  double bytes_per_instruction = 0.01;     // arithmetic is nearly free next to weight streaming
};

struct Extraction {
  Graph graph;
  double cost = 0;  // the extracted DAG, each node counted once
};

// `source` supplies the weight and state declarations (copied unchanged into the result).
Extraction extract(const EGraph& egraph, ClassId root, const Graph& source, const CostModel& model);

double node_cost(const Symbol& symbol, const std::vector<int64_t>& input_widths, const Graph& source, const CostModel& model);

}  // namespace plow
