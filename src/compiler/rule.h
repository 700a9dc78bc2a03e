// A rewrite rule: a name, a pattern (or a custom searcher for multi-node rules), a guard and a
// builder for the right-hand side. `definition` is the rule's canonical text (both sides); its hash
// keys the rule's certificate, so editing a rule voids its certificate until it is re-certified.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "compiler/egraph.h"

namespace plow {

// What a rule that runs on the extracted graph makes of one node: `op` over `inputs` (node ids of
// that graph) with these weights and attributes, in place of the node (same width and label).
struct NodeRewrite {
  Op op;
  std::vector<int> inputs;
  std::vector<int> weights;
  Attrs attrs;
};

struct Rule {
  std::string name;
  std::string file;        // which rules file defines it (for reports)
  std::string definition;  // "(lhs) => (rhs)" as written by the author
  Pattern lhs;             // unused when `search` is set
  std::function<std::vector<Match>(const EGraph&)> search;          // custom searcher (multi-root rules)
  std::function<bool(const EGraph&, const Match&)> guard;           // optional
  std::function<std::optional<ClassId>(EGraph&, const Match&)> apply;  // builds the RHS; the runner merges it with match.root
  // Set instead of lhs/apply for a rule that runs on the extracted graph (rewrite.h), where the
  // extraction's amortized tree cost would never choose its right-hand side: it reads more classes
  // than the left-hand side, for a gain (a dependency hop) that bytes do not price.
  std::function<std::optional<NodeRewrite>(const Graph&, int node)> rewrite;
  // Certificate instance: the left-hand side as a small graph (kInput leaves) at a size seed
  // (odd sizes included) — both sides are evaluated on it by the CPU reference.
  std::function<Graph(int64_t size)> instance;
};

std::string definition_hash(const Rule& rule);  // FNV-1a-64 of name + definition, hex

// Helpers for rule bodies.
const Symbol& symbol_of(const EGraph& graph, const Match& match, const std::string& bind);
ClassId add_fused(EGraph& graph, Op op, Attrs attrs, std::vector<int> weights, std::vector<ClassId> children, int64_t width,
                  std::string label);

// The rules, by file (rules/*.cpp); all_rules() is their union in a fixed order.
std::vector<Rule> linear_rules();
std::vector<Rule> ffn_rules();
std::vector<Rule> attention_rules();
const std::vector<Rule>& all_rules();

}  // namespace plow
