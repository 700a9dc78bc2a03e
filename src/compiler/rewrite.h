// The rules that run on the extracted graph (Rule::rewrite): each node is offered to the rules in
// order and the first match replaces it; nodes no longer read by anything are dropped (stateful ones
// never), an add_norm of which only the sum is still read becomes that add, and a node that a
// rewritten node no longer reads moves to just after that node (before its first reader, if that comes
// first), so the workers that run its tasks run them after the rewritten node's instead of before, and
// before the ops that follow it (plans keep the graph's order).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "compiler/rule.h"
#include "graph/graph.h"

namespace plow {

// `applied` counts each rule's rewrites (by name).
Graph rewrite_extracted(const Graph& graph, const std::vector<const Rule*>& rules, std::map<std::string, int>& applied);

}  // namespace plow
