#include "compiler/runner.h"

#include <chrono>

namespace plow {

RunReport run_rules(EGraph& graph, const std::vector<const Rule*>& rules, const RunnerLimits& limits) {
  RunReport report;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  report.stop_reason = "iteration limit";
  for (int iteration = 0; iteration < limits.iterations; ++iteration) {
    // Search everything first, then apply: matches of one iteration all see the same e-graph.
    std::vector<std::pair<const Rule*, std::vector<Match>>> found;
    for (const Rule* rule : rules) {
      std::vector<Match> matches;
      if (rule->search) {
        matches = rule->search(graph);
      } else {
        for (ClassId cls : graph.classes()) {
          for (Match& m : ematch(graph, rule->lhs, cls)) matches.push_back(std::move(m));
        }
      }
      found.emplace_back(rule, std::move(matches));
    }
    const uint64_t before = graph.version();
    for (auto& [rule, matches] : found) {
      for (const Match& match : matches) {
        if (rule->guard && !rule->guard(graph, match)) continue;
        const uint64_t version = graph.version();
        if (auto rhs = rule->apply(graph, match)) graph.merge(match.root, *rhs);
        if (graph.version() != version) report.applied[rule->name] += 1;
      }
    }
    graph.rebuild();
    report.iterations = iteration + 1;
    if (graph.version() == before) {
      report.stop_reason = "saturated";
      break;
    }
    if (graph.num_nodes() > limits.nodes) {
      report.stop_reason = "node limit";
      break;
    }
    if (elapsed() > limits.seconds) {
      report.stop_reason = "time limit";
      break;
    }
  }
  report.nodes = graph.num_nodes();
  report.classes = graph.num_classes();
  return report;
}

}  // namespace plow
