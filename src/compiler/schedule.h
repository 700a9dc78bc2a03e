// The order of a compiled graph's nodes, which plans keep: every worker runs its tasks op after op in
// that order (plan/lower.cpp), so the order decides what a worker does while it waits.
#pragma once

#include "graph/graph.h"

namespace plow {

// The graph with the same nodes in another topological order: the given one, except around a serial
// op (moe_topk: one task per 16 rows, so one at decode, while every other worker waits for it), whose
// window is kSerialFillWindow nodes either side. Of the nodes that do not depend on it, those before
// it whose readers come after it (or move with them) move to just after it, and those after its first
// reader whose inputs all come before that reader (or move with them) move to just before it, so the
// workers run them while it runs. Collectives stay (ranks keep them in one order anyway, and one would make every
// worker wait), so do stateful ops; a view moves only with the nodes that read it. On the MoE layers this puts the shared expert (it reads
// the layer input, not the routes) between the top-k and the routed experts.
inline constexpr int kSerialFillWindow = 16;

// A graph with `graph`'s weights and states and `nodes` (indexed by old id, inputs old ids) in
// `order`, a topological order of the ones kept; `output` is an old id.
Graph rebuilt_in_order(const Graph& graph, const std::vector<Node>& nodes, const std::vector<int>& order, int output);
Graph schedule_serial_waits(const Graph& graph);

}  // namespace plow
