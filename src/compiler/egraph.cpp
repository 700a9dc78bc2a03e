#include "compiler/egraph.h"

#include <algorithm>
#include <functional>

#include "core/error.h"

namespace plow {

namespace {

std::string identity_key(const Symbol& s) {
  std::string key = fmt::format("{}|{}|{}|", static_cast<int>(s.op), s.state, s.width);
  for (int w : s.weights) key += fmt::format("{},", w);
  key += "|";
  for (const auto& [name, value] : s.attrs.values()) key += fmt::format("{}={};", name, value);
  return key;
}

}  // namespace

size_t ENodeHash::operator()(const ENode& node) const {
  size_t h = std::hash<uint32_t>()(node.symbol);
  for (ClassId c : node.children) h = h * 1000003u ^ std::hash<uint32_t>()(c);
  return h;
}

uint32_t EGraph::intern(const Symbol& symbol) {
  const std::string key = identity_key(symbol);
  auto it = symbol_index_.find(key);
  if (it != symbol_index_.end()) return it->second;
  symbols_.push_back(symbol);
  const auto id = static_cast<uint32_t>(symbols_.size() - 1);
  symbol_index_.emplace(key, id);
  return id;
}

ClassId EGraph::find(ClassId id) const {
  ClassId root = id;
  while (parent_[root] != root) root = parent_[root];
  while (parent_[id] != root) {  // path compression
    const ClassId next = parent_[id];
    parent_[id] = root;
    id = next;
  }
  return root;
}

ENode EGraph::canonical(ENode node) const {
  for (ClassId& c : node.children) c = find(c);
  return node;
}

ClassId EGraph::add(ENode node) {
  node = canonical(std::move(node));
  if (auto it = memo_.find(node); it != memo_.end()) return find(it->second);
  const auto id = static_cast<ClassId>(classes_.size());
  parent_.push_back(id);
  EClass eclass;
  eclass.nodes.push_back(node);
  eclass.width = symbols_.at(node.symbol).width;
  classes_.push_back(std::move(eclass));
  for (ClassId child : node.children) classes_[child].parents.emplace_back(node, id);
  memo_.emplace(std::move(node), id);
  ++version_;
  return id;
}

bool EGraph::merge(ClassId a, ClassId b) {
  a = find(a);
  b = find(b);
  if (a == b) return false;
  PLOW_CHECK(classes_[a].width == classes_[b].width, "merging classes of widths {} and {}", classes_[a].width, classes_[b].width);
  if (classes_[a].nodes.size() + classes_[a].parents.size() < classes_[b].nodes.size() + classes_[b].parents.size()) std::swap(a, b);
  parent_[b] = a;
  EClass& into = classes_[a];
  EClass& from = classes_[b];
  into.nodes.insert(into.nodes.end(), from.nodes.begin(), from.nodes.end());
  into.parents.insert(into.parents.end(), from.parents.begin(), from.parents.end());
  from.nodes.clear();
  from.parents.clear();
  pending_.push_back(a);
  ++version_;
  return true;
}

// Re-canonicalizes the parents of a class; parents that became equal are merged (congruence).
void EGraph::repair(ClassId id) {
  EClass& eclass = classes_[id];
  auto parents = std::move(eclass.parents);
  eclass.parents.clear();
  for (auto& [node, cls] : parents) {
    memo_.erase(node);
    node = canonical(node);
    memo_[node] = find(cls);
  }
  std::unordered_map<ENode, ClassId, ENodeHash> unique;
  for (auto& [node, cls] : parents) {
    auto [it, inserted] = unique.emplace(node, find(cls));
    if (!inserted) {
      merge(it->second, cls);
      it->second = find(it->second);
    }
  }
  EClass& current = classes_[find(id)];
  for (auto& [node, cls] : unique) current.parents.emplace_back(node, find(cls));
}

void EGraph::rebuild() {
  while (!pending_.empty()) {
    std::vector<ClassId> todo;
    todo.swap(pending_);
    for (ClassId& c : todo) c = find(c);
    std::sort(todo.begin(), todo.end());
    todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
    for (ClassId c : todo) repair(c);
  }
  // Canonical, duplicate-free node lists, for matching and extraction.
  for (ClassId c = 0; c < classes_.size(); ++c) {
    if (find(c) != c) continue;
    auto& nodes = classes_[c].nodes;
    for (ENode& node : nodes) node = canonical(node);
    std::sort(nodes.begin(), nodes.end(), [](const ENode& x, const ENode& y) {
      return x.symbol != y.symbol ? x.symbol < y.symbol : x.children < y.children;
    });
    nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  }
}

std::vector<ClassId> EGraph::classes() const {
  std::vector<ClassId> result;
  for (ClassId c = 0; c < classes_.size(); ++c) {
    if (find(c) == c) result.push_back(c);
  }
  return result;
}

size_t EGraph::num_classes() const { return classes().size(); }

std::string Pattern::text() const {
  if (!var.empty()) return fmt::format("?{}", var);
  std::string out = fmt::format("({}", op_name(op));
  if (!bind.empty()) out += fmt::format("@{}", bind);
  if (any_arity) out += " ...";
  for (const Pattern& child : children) out += fmt::format(" {}", child.text());
  out += ")";
  return out;
}

namespace {

void match_into(const EGraph& graph, const Pattern& pattern, ClassId cls, Match current, std::vector<Match>& out,
                const std::function<void(Match, std::vector<Match>&)>& next) {
  cls = graph.find(cls);
  if (!pattern.var.empty()) {
    auto it = current.vars.find(pattern.var);
    if (it != current.vars.end() && graph.find(it->second) != cls) return;
    current.vars[pattern.var] = cls;
    next(std::move(current), out);
    return;
  }
  for (const ENode& node : graph.nodes(cls)) {
    if (graph.symbol(node.symbol).op != pattern.op) continue;
    if (!pattern.any_arity && node.children.size() != pattern.children.size()) continue;
    Match with_node = current;
    if (!pattern.bind.empty()) {
      with_node.nodes[pattern.bind] = node;
      with_node.node_classes[pattern.bind] = cls;
    }
    // Match children left to right, threading the bindings through.
    std::function<void(size_t, Match, std::vector<Match>&)> child = [&](size_t i, Match m, std::vector<Match>& acc) {
      if (i == pattern.children.size()) {
        next(std::move(m), acc);
        return;
      }
      match_into(graph, pattern.children[i], node.children[i], std::move(m), acc,
                 [&](Match deeper, std::vector<Match>& acc2) { child(i + 1, std::move(deeper), acc2); });
    };
    child(0, std::move(with_node), out);
  }
}

}  // namespace

std::vector<Match> ematch(const EGraph& graph, const Pattern& pattern, ClassId root) {
  std::vector<Match> out;
  Match start;
  start.root = graph.find(root);
  match_into(graph, pattern, root, start, out, [](Match m, std::vector<Match>& acc) { acc.push_back(std::move(m)); });
  return out;
}

}  // namespace plow
