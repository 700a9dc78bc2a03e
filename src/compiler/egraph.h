// E-graph over plow ops: hash-consed e-nodes, union-find over e-classes, deferred rebuild that
// restores congruence (egg's scheme), and e-matching of patterns with variables. Stateful ops carry
// their state id in the symbol, so two of them are never equal.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "graph/graph.h"

namespace plow {

using ClassId = uint32_t;

// The non-child part of an e-node. `label` is carried for readable plans but is not part of identity.
struct Symbol {
  Op op = Op::kTokens;
  Attrs attrs;
  std::vector<int> weights;
  int state = -1;
  int64_t width = 0;
  std::string label;
};

struct ENode {
  uint32_t symbol = 0;
  std::vector<ClassId> children;
  bool operator==(const ENode& other) const { return symbol == other.symbol && children == other.children; }
};

struct ENodeHash {
  size_t operator()(const ENode& node) const;
};

class EGraph {
 public:
  uint32_t intern(const Symbol& symbol);
  const Symbol& symbol(uint32_t id) const { return symbols_.at(id); }

  ClassId add(ENode node);  // returns the existing class when an equal e-node is present
  ClassId add(const Symbol& symbol, std::vector<ClassId> children) { return add(ENode{intern(symbol), std::move(children)}); }
  ClassId find(ClassId id) const;
  bool merge(ClassId a, ClassId b);  // true if two classes became one; call rebuild() before matching again
  void rebuild();

  std::vector<ClassId> classes() const;  // canonical ids, ascending
  const std::vector<ENode>& nodes(ClassId id) const { return classes_.at(find(id)).nodes; }
  const std::vector<std::pair<ENode, ClassId>>& parents(ClassId id) const { return classes_.at(find(id)).parents; }
  int64_t width(ClassId id) const { return classes_.at(find(id)).width; }
  size_t num_nodes() const { return memo_.size(); }
  size_t num_classes() const;
  uint64_t version() const { return version_; }  // bumps whenever a node is added or classes merge

 private:
  struct EClass {
    std::vector<ENode> nodes;
    std::vector<std::pair<ENode, ClassId>> parents;
    int64_t width = 0;
  };
  ENode canonical(ENode node) const;
  void repair(ClassId id);

  std::vector<Symbol> symbols_;
  std::unordered_map<std::string, uint32_t> symbol_index_;
  mutable std::vector<ClassId> parent_;
  std::vector<EClass> classes_;
  std::unordered_map<ENode, ClassId, ENodeHash> memo_;
  std::vector<ClassId> pending_;
  uint64_t version_ = 0;
};

// A pattern: a variable (matches any class; equal names bind equal classes) or an op with child
// patterns. `bind` names the matched e-node so a rule can read its symbol (weights, attributes).
struct Pattern {
  std::string var;
  Op op = Op::kTokens;
  std::string bind;
  std::vector<Pattern> children;
  bool any_arity = false;  // match the op with whatever children it has (variadic ops)

  static Pattern v(std::string name) { return Pattern{std::move(name), Op::kTokens, "", {}, false}; }
  static Pattern n(Op op, std::string bind, std::vector<Pattern> children) {
    return Pattern{"", op, std::move(bind), std::move(children), false};
  }
  static Pattern any(Op op, std::string bind) { return Pattern{"", op, std::move(bind), {}, true}; }
  std::string text() const;  // s-expression, e.g. (linear@lin (rms_norm@norm ?x))
};

struct Match {
  ClassId root = 0;
  std::map<std::string, ClassId> vars;
  std::map<std::string, ENode> nodes;          // by Pattern::bind
  std::map<std::string, ClassId> node_classes;  // the class each bound e-node was found in
};

std::vector<Match> ematch(const EGraph& graph, const Pattern& pattern, ClassId root);

}  // namespace plow
