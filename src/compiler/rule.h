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

struct Rule {
  std::string name;
  std::string file;        // which rules file defines it (for reports)
  std::string definition;  // "(lhs) => (rhs)" as written by the author
  Pattern lhs;             // unused when `search` is set
  std::function<std::vector<Match>(const EGraph&)> search;          // custom searcher (multi-root rules)
  std::function<bool(const EGraph&, const Match&)> guard;           // optional
  std::function<std::optional<ClassId>(EGraph&, const Match&)> apply;  // builds the RHS; the runner merges it with match.root
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
