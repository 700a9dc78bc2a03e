#include "compiler/extract.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <limits>
#include <set>

#include "core/error.h"

namespace plow {

double node_cost(const Symbol& symbol, const std::vector<int64_t>& input_widths, const Graph& source, const CostModel& model) {
  const bool free_view = symbol.op == Op::kSlice || symbol.op == Op::kTokens || symbol.op == Op::kInput;
  double bytes = 0;
  for (int id : symbol.weights) {
    const WeightDecl& decl = source.weights().at(static_cast<size_t>(id));
    double numel = 1;
    for (int64_t d : decl.shape) numel *= static_cast<double>(d);
    double parts = static_cast<double>(decl.parts.size());
    if (reads_routed_experts(symbol.op)) parts = symbol.attrs.get("top_k");  // k of E experts
    bytes += numel * parts * (decl.mxfp4 ? 0.53125 : model.bytes_per_param);
    bytes += numel * parts * model.bytes_per_instruction;
  }
  double activations = static_cast<double>(symbol.width);
  for (int64_t width : input_widths) activations += static_cast<double>(width);
  return bytes + activations * model.bytes_per_activation + (free_view ? 0.0 : model.task_overhead_bytes);
}

namespace {

std::vector<int64_t> child_widths(const EGraph& egraph, const ENode& node) {
  std::vector<int64_t> widths;
  for (ClassId c : node.children) widths.push_back(egraph.width(c));
  return widths;
}

}  // namespace

namespace {

using Choice = std::map<ClassId, const ENode*>;

// One pass of amortized tree-cost extraction: a class used by k consumers charges each 1/k of its
// cost, so a producer shared by several consumers (a multi_linear and its slices) is not paid k times.
// own[i][j]: the cost of the j-th e-node of classes[i] alone; costs are indexed by class id.
Choice choose(const EGraph& egraph, const std::vector<ClassId>& classes, const std::vector<std::vector<double>>& own,
              const std::vector<double>& uses, size_t id_bound) {
  constexpr double kInfinity = std::numeric_limits<double>::infinity();
  std::vector<double> cost(id_bound, kInfinity);
  std::vector<const ENode*> best(id_bound, nullptr);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = 0; i < classes.size(); ++i) {
      const ClassId c = classes[i];
      const auto& nodes = egraph.nodes(c);
      for (size_t j = 0; j < nodes.size(); ++j) {
        double total = own[i][j];
        for (ClassId child : nodes[j].children) total += cost[egraph.find(child)] / uses[egraph.find(child)];
        if (total < cost[c] && (cost[c] == kInfinity || cost[c] - total > 1e-9 * cost[c])) {
          cost[c] = total;
          best[c] = &nodes[j];
          changed = true;
        }
      }
    }
  }
  Choice choice;
  for (ClassId c : classes) {
    if (best[c]) choice[c] = best[c];
  }
  return choice;
}

// How often each class is read by the chosen DAG reachable from the root.
std::map<ClassId, double> references(const EGraph& egraph, ClassId root, const Choice& choice) {
  std::map<ClassId, double> refs;
  std::set<ClassId> seen;
  std::vector<ClassId> stack = {egraph.find(root)};
  while (!stack.empty()) {
    const ClassId c = stack.back();
    stack.pop_back();
    if (!seen.insert(c).second) continue;
    for (ClassId child : choice.at(c)->children) {
      refs[egraph.find(child)] += 1;
      stack.push_back(egraph.find(child));
    }
  }
  return refs;
}

Extraction build(const EGraph& egraph, ClassId root, const Choice& choice, const Graph& source, const CostModel& model) {
  Extraction result;
  for (const WeightDecl& decl : source.weights()) result.graph.add_weight(decl);
  for (const StateDecl& decl : source.states()) result.graph.add_state(decl);
  std::map<ClassId, int> built;
  // Post-order walk of the chosen DAG; each class is built once however many consumers it has.
  std::function<int(ClassId)> visit = [&](ClassId c) -> int {
    c = egraph.find(c);
    if (auto it = built.find(c); it != built.end()) return it->second;
    PLOW_CHECK(choice.count(c), "e-class {} has no finite-cost node", c);
    const ENode& node = *choice.at(c);
    std::vector<int> inputs;
    for (ClassId child : node.children) inputs.push_back(visit(child));
    const Symbol& s = egraph.symbol(node.symbol);
    const int id = result.graph.add(s.op, inputs, s.weights, s.attrs, s.label, s.state);
    std::vector<int64_t> widths;
    for (int input : inputs) widths.push_back(result.graph.node(input).width);
    result.cost += node_cost(s, widths, source, model);
    built[c] = id;
    return id;
  };
  result.graph.set_output(visit(root));
  result.graph.verify();
  return result;
}

}  // namespace

Extraction extract(const EGraph& egraph, ClassId root, const Graph& source, const CostModel& model) {
  const std::vector<ClassId> classes = egraph.classes();
  // Two priors for how many consumers share a class: (a) every distinct consumer e-node in the
  // e-graph; (b) 1, except multi-output producers read through kSlice views, shared by their slices.
  // From each prior, iterate: re-count uses in the DAG actually extracted (classes outside it keep the
  // prior), re-choose; keep the cheapest DAG by its exact cost (each node counted once).
  const size_t id_bound = classes.empty() ? 0 : static_cast<size_t>(classes.back()) + 1;  // classes() is ascending
  std::vector<double> all_consumers(id_bound, 1.0), slice_consumers(id_bound, 1.0);
  std::vector<std::vector<double>> own(classes.size());
  for (size_t i = 0; i < classes.size(); ++i) {
    const ClassId c = classes[i];
    std::set<std::pair<uint32_t, std::vector<ClassId>>> distinct, slices;
    for (const auto& [node, cls] : egraph.parents(c)) {
      ENode canonical = node;
      for (ClassId& child : canonical.children) child = egraph.find(child);
      distinct.emplace(canonical.symbol, canonical.children);
      if (egraph.symbol(node.symbol).op == Op::kSlice) slices.emplace(canonical.symbol, canonical.children);
    }
    all_consumers[c] = std::max<double>(1.0, static_cast<double>(distinct.size()));
    slice_consumers[c] = std::max<double>(1.0, static_cast<double>(slices.size()));
    for (const ENode& node : egraph.nodes(c)) own[i].push_back(node_cost(egraph.symbol(node.symbol), child_widths(egraph, node), source, model));
  }
  std::optional<Extraction> best;
  for (const auto* prior : {&all_consumers, &slice_consumers}) {
    std::vector<double> uses = *prior;
    Choice previous;
    for (int round = 0; round < 8; ++round) {
      const Choice choice = choose(egraph, classes, own, uses, id_bound);
      if (choice == previous) break;
      Extraction candidate = build(egraph, root, choice, source, model);
      if (!best || candidate.cost < best->cost) best = std::move(candidate);
      const auto refs = references(egraph, root, choice);
      for (ClassId c : classes) uses[c] = refs.count(c) ? std::max(1.0, refs.at(c)) : (*prior)[c];
      previous = choice;
    }
  }
  return std::move(*best);
}

}  // namespace plow
