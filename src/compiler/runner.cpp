#include "compiler/runner.h"

#include <chrono>

namespace plow {

namespace {

// A tensor-parallel rank's partial sums (attr "partial": fp32 outputs that an all_reduce adds up) stay
// as built: the fused ops round their outputs, and a partial sum must reach its all_reduce unrounded.
bool touches_partial_sum(const EGraph& graph, const Match& match) {
  auto partial = [&](ClassId cls) {
    for (const ENode& node : graph.nodes(cls)) {
      if (graph.symbol(node.symbol).attrs.has("partial")) return true;
    }
    return false;
  };
  if (partial(match.root)) return true;
  for (const auto& [name, cls] : match.vars) {
    if (partial(cls)) return true;
  }
  return false;
}

}  // namespace

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
        if (touches_partial_sum(graph, match)) continue;
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
