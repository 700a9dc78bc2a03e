// The compiler pipeline (one place gives the order of the passes): each pass is named, timed,
// switchable, and followed by a graph verification. Today: e-graph fusion with certified rules, then
// the node order plans run in (schedule.h).
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "compiler/certificates.h"
#include "compiler/extract.h"
#include "compiler/runner.h"
#include "graph/graph.h"

namespace plow {

struct CompileOptions {
  bool fusion = true;
  bool schedule = true;  // schedule_serial_waits (schedule.h)
  std::set<std::string> disabled_rules;
  RunnerLimits limits;
  CostModel cost;
};

struct PassReport {
  std::string name;
  double seconds = 0;
  size_t nodes_after = 0;
};

struct CompileReport {
  size_t ops_before = 0;
  size_t ops_after = 0;
  double cost_before = 0;  // CostModel units (bytes-equivalent per decode token)
  double cost_after = 0;
  RunReport saturation;
  std::vector<PassReport> passes;
  std::map<std::string, int> ops_after_by_name;
  std::vector<std::string> rules_fired() const;
};

struct CompiledGraph {
  Graph graph;
  CompileReport report;
};

// Uses all_rules() minus the disabled ones, each of which must hold a valid certificate in `certificates`.
CompiledGraph compile_graph(const Graph& graph, const CompileOptions& options,
                            const CertificateSet& certificates = embedded_certificates());
// Explicit rule set (tests, certification).
CompiledGraph compile_graph(const Graph& graph, const CompileOptions& options, const std::vector<const Rule*>& rules,
                            const CertificateSet& certificates);

double graph_cost(const Graph& graph, const CostModel& model);

// The fusion pass alone, with no certificate check: only for producing certificates.
Graph fuse_uncertified(const Graph& graph, const std::vector<const Rule*>& rules, const CompileOptions& options, CompileReport& report);

}  // namespace plow
