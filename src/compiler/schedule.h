// The order of a compiled graph's nodes, which plans keep: every worker runs its tasks op after op in
// that order (plan/lower.cpp), so the order decides what a worker does while it waits.
#pragma once

#include "graph/graph.h"

namespace plow {

// The graph with the same nodes in another topological order: the given one, except that the nodes
// in the kSerialFillWindow nodes before a serial op (moe_topk: one task per 16 rows, so one at decode,
// while every other worker waits for it) that it does not depend on, and whose readers come after it
// or move with them, move to just after it, so the workers run them while it runs. Collectives stay
// (ranks keep them in one order anyway, and one would make every worker wait), so do stateful ops and
// views. On the MoE layers this puts the shared expert's gate/up projection (it reads the layer input,
// not the routes) between the router and the routed experts, where the workers waited for the top-k.
inline constexpr int kSerialFillWindow = 16;
Graph schedule_serial_waits(const Graph& graph);

}  // namespace plow
