#include "compiler/compile.h"

#include <chrono>

#include "compiler/rewrite.h"
#include "compiler/schedule.h"
#include "core/error.h"

namespace plow {

std::vector<std::string> CompileReport::rules_fired() const {
  std::vector<std::string> names;
  for (const auto& [name, count] : saturation.applied) names.push_back(name);
  return names;
}

double graph_cost(const Graph& graph, const CostModel& model) {
  double total = 0;
  for (const Node& node : graph.nodes()) {
    Symbol s{node.op, node.attrs, node.weights, node.state, node.width, node.label};
    std::vector<int64_t> widths;
    for (int input : node.inputs) widths.push_back(graph.node(input).width);
    total += node_cost(s, widths, graph, model);
  }
  return total;
}

namespace {

Graph fuse(const Graph& graph, const std::vector<const Rule*>& rules, const CompileOptions& options, CompileReport& report) {
  EGraph egraph;
  std::vector<ClassId> classes;
  for (const Node& node : graph.nodes()) {
    std::vector<ClassId> children;
    for (int input : node.inputs) children.push_back(classes[static_cast<size_t>(input)]);
    classes.push_back(egraph.add(Symbol{node.op, node.attrs, node.weights, node.state, node.width, node.label}, children));
  }
  egraph.rebuild();
  std::vector<const Rule*> in_egraph, on_extracted;
  for (const Rule* rule : rules) (rule->rewrite ? on_extracted : in_egraph).push_back(rule);
  report.saturation = run_rules(egraph, in_egraph, options.limits);
  Extraction extraction = extract(egraph, classes[static_cast<size_t>(graph.output())], graph, options.cost);
  return rewrite_extracted(extraction.graph, on_extracted, report.saturation.applied);
}

}  // namespace

Graph fuse_uncertified(const Graph& graph, const std::vector<const Rule*>& rules, const CompileOptions& options, CompileReport& report) {
  return fuse(graph, rules, options, report);
}

CompiledGraph compile_graph(const Graph& graph, const CompileOptions& options, const std::vector<const Rule*>& rules,
                            const CertificateSet& certificates) {
  require_certified(rules, certificates);
  CompiledGraph result{graph, {}};
  CompileReport& report = result.report;
  report.ops_before = graph.nodes().size();
  report.cost_before = graph_cost(graph, options.cost);
  struct Pass {
    const char* name;
    bool enabled;
    std::function<Graph(const Graph&)> run;
  };
  const std::vector<Pass> pipeline = {
      {"egraph-fusion", options.fusion, [&](const Graph& g) { return fuse(g, rules, options, report); }},
      {"serial-wait-fill", options.schedule, [](const Graph& g) { return schedule_serial_waits(g); }},
  };
  for (const Pass& pass : pipeline) {
    if (!pass.enabled) continue;
    const auto start = std::chrono::steady_clock::now();
    result.graph = pass.run(result.graph);
    result.graph.verify();
    report.passes.push_back({pass.name, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                             result.graph.nodes().size()});
  }
  report.ops_after = result.graph.nodes().size();
  report.cost_after = graph_cost(result.graph, options.cost);
  for (const Node& node : result.graph.nodes()) report.ops_after_by_name[std::string(op_name(node.op))] += 1;
  return result;
}

CompiledGraph compile_graph(const Graph& graph, const CompileOptions& options, const CertificateSet& certificates) {
  std::vector<const Rule*> rules;
  for (const Rule& rule : all_rules()) {
    if (!options.disabled_rules.count(rule.name)) rules.push_back(&rule);
  }
  return compile_graph(graph, options, rules, certificates);
}

}  // namespace plow
