// Equality saturation: apply every rule to every match, rebuild, repeat until nothing changes or a
// limit (iterations, e-nodes, seconds) is hit; the reason it stopped is recorded.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "compiler/egraph.h"
#include "compiler/rule.h"

namespace plow {

struct RunnerLimits {
  int iterations = 12;
  size_t nodes = 500000;
  double seconds = 5.0;
};

struct RunReport {
  int iterations = 0;
  std::string stop_reason;             // "saturated", "iteration limit", "node limit", "time limit"
  std::map<std::string, int> applied;  // rule name → applications that changed the e-graph
  size_t nodes = 0;
  size_t classes = 0;
};

RunReport run_rules(EGraph& graph, const std::vector<const Rule*>& rules, const RunnerLimits& limits);

}  // namespace plow
