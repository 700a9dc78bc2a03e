#include "compiler/rewrite.h"

#include <algorithm>
#include <optional>

#include "compiler/schedule.h"

namespace plow {

namespace {

bool is_sum_half(const Node& node, int64_t half) { return node.op == Op::kSlice && node.attrs.i("offset") == 0 && node.attrs.i("width") == half; }

}  // namespace

Graph rewrite_extracted(const Graph& graph, const std::vector<const Rule*>& rules, std::map<std::string, int>& applied) {
  const auto n = static_cast<int>(graph.nodes().size());
  // The nodes after the rewrites, by their old ids (inputs still old ids).
  std::vector<Node> nodes = graph.nodes();
  std::vector<bool> rewritten(static_cast<size_t>(n), false);
  for (int i = 0; i < n; ++i) {
    for (const Rule* rule : rules) {
      const std::optional<NodeRewrite> r = rule->rewrite(graph, i);
      if (!r) continue;
      Node& node = nodes[static_cast<size_t>(i)];
      node.op = r->op;
      node.inputs = r->inputs;
      node.weights = r->weights;
      node.attrs = r->attrs;
      rewritten[static_cast<size_t>(i)] = true;
      applied[rule->name] += 1;
      break;
    }
  }
  if (std::none_of(rewritten.begin(), rewritten.end(), [](bool b) { return b; })) return graph;
  // Live: the output, stateful nodes and what they read.
  std::vector<bool> live(static_cast<size_t>(n), false);
  live[static_cast<size_t>(graph.output())] = true;
  for (int i = n - 1; i >= 0; --i) {
    const Node& node = nodes[static_cast<size_t>(i)];
    if (node.state >= 0) live[static_cast<size_t>(i)] = true;
    if (!live[static_cast<size_t>(i)]) continue;
    for (int input : node.inputs) live[static_cast<size_t>(input)] = true;
  }
  std::vector<std::vector<int>> readers(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    if (!live[static_cast<size_t>(i)]) continue;
    for (int input : nodes[static_cast<size_t>(i)].inputs) readers[static_cast<size_t>(input)].push_back(i);
  }
  // An add_norm whose live readers all take the sum half: that add, read in place of those slices.
  std::vector<int> alias(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) alias[static_cast<size_t>(i)] = i;
  for (int i = 0; i < n; ++i) {
    Node& node = nodes[static_cast<size_t>(i)];
    if (!live[static_cast<size_t>(i)] || node.op != Op::kAddNorm || i == graph.output()) continue;
    const int64_t half = node.width / 2;
    const auto& by = readers[static_cast<size_t>(i)];
    if (by.empty() || !std::all_of(by.begin(), by.end(), [&](int r) { return is_sum_half(nodes[static_cast<size_t>(r)], half) && r != graph.output(); })) continue;
    node.op = Op::kAdd;
    node.weights.clear();
    node.attrs = {};
    node.width = half;
    for (int r : by) {
      alias[static_cast<size_t>(r)] = i;
      live[static_cast<size_t>(r)] = false;
    }
  }
  for (Node& node : nodes) {
    for (int& input : node.inputs) input = alias[static_cast<size_t>(input)];
  }
  // Readers again (through the aliases), then the order: a node that a rewritten node read before
  // and reads no longer moves, with the views of it, to just before its first reader.
  for (auto& r : readers) r.clear();
  for (int i = 0; i < n; ++i) {
    if (!live[static_cast<size_t>(i)]) continue;
    for (int input : nodes[static_cast<size_t>(i)].inputs) readers[static_cast<size_t>(input)].push_back(i);
  }
  std::vector<bool> delayed(static_cast<size_t>(n), false);
  std::vector<int> released_by(static_cast<size_t>(n), -1);  // the first rewritten node that stopped reading it
  for (int i = 0; i < n; ++i) {
    if (!rewritten[static_cast<size_t>(i)]) continue;
    for (int before : graph.node(i).inputs) {
      // What the old node read, through views (a slice of an add_norm) and one norm (rms_norm of an add).
      std::vector<int> chain = {before};
      const Node& b = graph.node(before);
      if ((b.op == Op::kSlice || b.op == Op::kRmsNorm) && !b.inputs.empty()) chain.push_back(b.inputs[0]);
      for (int c : chain) {
        const Node& node = nodes[static_cast<size_t>(c)];
        const auto& now = nodes[static_cast<size_t>(i)].inputs;
        if (live[static_cast<size_t>(c)] && node.op != Op::kSlice && node.state < 0 && std::find(now.begin(), now.end(), c) == now.end()) {
          if (!delayed[static_cast<size_t>(c)]) released_by[static_cast<size_t>(c)] = i;
          delayed[static_cast<size_t>(c)] = true;
        }
      }
    }
  }
  std::vector<int> order;
  for (int i = 0; i < n; ++i) {
    if (live[static_cast<size_t>(i)] && !delayed[static_cast<size_t>(i)] &&
        !(nodes[static_cast<size_t>(i)].op == Op::kSlice && delayed[static_cast<size_t>(nodes[static_cast<size_t>(i)].inputs[0])])) {
      order.push_back(i);
    }
  }
  for (int d = n - 1; d >= 0; --d) {  // later ones first: a delayed node's readers are placed before it is
    if (!delayed[static_cast<size_t>(d)]) continue;
    // The delayed node and its views; the first reader of any of them that is not one of them.
    std::vector<int> group = {d};
    for (int r : readers[static_cast<size_t>(d)]) {
      if (nodes[static_cast<size_t>(r)].op == Op::kSlice) group.push_back(r);
    }
    size_t at = order.size();
    for (int member : group) {
      for (int r : readers[static_cast<size_t>(member)]) {
        if (std::find(group.begin(), group.end(), r) != group.end()) continue;
        at = std::min(at, static_cast<size_t>(std::find(order.begin(), order.end(), r) - order.begin()));
      }
    }
    // No later than just after the rewritten node that stopped reading it (its inputs come before
    // that node): its tasks then follow that op's on their workers, not the ops after it. 48B decode:
    // the residual sum a layer's router and post-attention norm read was placed after the KDA core's
    // o_proj, five workers ran it there (~5 µs) and the router waited for them on every KDA layer;
    // just after the input projections it runs beside the core.
    const auto by = std::find(order.begin(), order.end(), released_by[static_cast<size_t>(d)]);
    if (by != order.end()) at = std::min(at, static_cast<size_t>(by - order.begin()) + 1);
    order.insert(order.begin() + static_cast<std::ptrdiff_t>(at), group.begin(), group.end());
  }
  return rebuilt_in_order(graph, nodes, order, alias[static_cast<size_t>(graph.output())]);
}

}  // namespace plow
