#include "compiler/schedule.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace plow {

namespace {

bool is_serial(Op op) { return op == Op::kMoeTopK; }

// Whether a node may move past others: not a collective (ranks keep them in one order, and one makes
// every worker wait), not stateful, not a view (a slice has no tasks: moving it gains nothing).
bool movable(const Node& node) { return node.op != Op::kAllReduce && node.op != Op::kSlice && node.state < 0; }

Graph reordered(const Graph& graph, const std::vector<int>& order) { return rebuilt_in_order(graph, graph.nodes(), order, graph.output()); }

}  // namespace

Graph rebuilt_in_order(const Graph& graph, const std::vector<Node>& nodes, const std::vector<int>& order, int output) {
  Graph out;
  for (const WeightDecl& w : graph.weights()) out.add_weight(w);
  for (const StateDecl& s : graph.states()) out.add_state(s);
  std::vector<int> id(nodes.size(), -1);
  for (int old : order) {
    const Node& node = nodes[static_cast<size_t>(old)];
    std::vector<int> inputs;
    for (int input : node.inputs) {
      PLOW_CHECK(id[static_cast<size_t>(input)] >= 0, "node {} ({}) placed before its input {}", old, node.label, input);
      inputs.push_back(id[static_cast<size_t>(input)]);
    }
    id[static_cast<size_t>(old)] = out.add(node.op, std::move(inputs), node.weights, node.attrs, node.label, node.state);
  }
  out.set_output(id[static_cast<size_t>(output)]);
  return out;
}

Graph schedule_serial_waits(const Graph& graph) {
  const auto n = static_cast<int>(graph.nodes().size());
  std::vector<int> order(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  std::vector<int> position = order;  // node → its index in order
  std::vector<std::vector<int>> readers(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    for (int input : graph.node(i).inputs) readers[static_cast<size_t>(input)].push_back(i);
  }
  for (int serial = 0; serial < n; ++serial) {
    if (!is_serial(graph.node(serial).op)) continue;
    const int p = position[static_cast<size_t>(serial)], first = std::max(0, p - kSerialFillWindow);
    // In the window before the serial op: its ancestors stay; another node moves when it is movable
    // and each of its readers placed before the serial op moves too (back to front: readers first).
    std::vector<bool> ancestor(static_cast<size_t>(p - first + 1), false), moves(ancestor.size(), false);
    ancestor[static_cast<size_t>(p - first)] = true;
    for (int k = p; k >= first; --k) {
      if (!ancestor[static_cast<size_t>(k - first)]) continue;
      for (int input : graph.node(order[static_cast<size_t>(k)]).inputs) {
        const int at = position[static_cast<size_t>(input)];
        if (at >= first) ancestor[static_cast<size_t>(at - first)] = true;
      }
    }
    for (int k = p - 1; k >= first; --k) {
      const int node = order[static_cast<size_t>(k)];
      if (ancestor[static_cast<size_t>(k - first)] || !movable(graph.node(node))) continue;
      bool readers_move = true;
      for (int reader : readers[static_cast<size_t>(node)]) {
        const int at = position[static_cast<size_t>(reader)];
        readers_move = readers_move && (at > p || moves[static_cast<size_t>(at - first)]);
      }
      moves[static_cast<size_t>(k - first)] = readers_move;
    }
    // order[first, p]: the staying nodes, the serial op last, then the moving ones in their order.
    std::vector<int> stay, go;
    for (int k = first; k <= p; ++k) (moves[static_cast<size_t>(k - first)] ? go : stay).push_back(order[static_cast<size_t>(k)]);
    const int at = first + static_cast<int>(stay.size()) - 1;  // the serial op's new place
    stay.insert(stay.end(), go.begin(), go.end());
    std::copy(stay.begin(), stay.end(), order.begin() + first);
    for (int k = first; k <= p; ++k) position[static_cast<size_t>(order[static_cast<size_t>(k)])] = k;

    // After its first reader y, within the window: the movable nodes that do not depend on it and
    // whose inputs all come before y or move too, to just before y in their order. Chains move: the
    // 48B shared expert's down projection follows its gate/up into the shadow, where it had run after
    // the routed gate/up on every worker, and the routed down waited for it there (the measured path).
    int y = p + 1;
    auto reads_serial = [&](int k) {
      const std::vector<int>& inputs = graph.node(order[static_cast<size_t>(k)]).inputs;
      return std::find(inputs.begin(), inputs.end(), serial) != inputs.end();
    };
    while (y < n && !reads_serial(y)) ++y;
    if (y >= n) continue;
    const int last = std::min(n - 1, y + kSerialFillWindow);
    std::vector<bool> depends(static_cast<size_t>(last - at + 1), false), hoist(depends.size(), false);
    depends[0] = true;
    for (int k = at + 1; k <= last; ++k) {
      const Node& node = graph.node(order[static_cast<size_t>(k)]);
      bool ready = true;
      for (int input : node.inputs) {
        const int i = position[static_cast<size_t>(input)];
        if (i >= at && depends[static_cast<size_t>(i - at)]) depends[static_cast<size_t>(k - at)] = true;
        ready = ready && (i < y || (i > y && hoist[static_cast<size_t>(i - at)]));
      }
      // A view moves with the nodes that read it (it has no tasks, but they must follow it).
      hoist[static_cast<size_t>(k - at)] = k > y && ready && !depends[static_cast<size_t>(k - at)] && (movable(node) || node.op == Op::kSlice);
    }
    std::vector<int> before, after;
    for (int k = y; k <= last; ++k) (hoist[static_cast<size_t>(k - at)] ? before : after).push_back(order[static_cast<size_t>(k)]);
    before.insert(before.end(), after.begin(), after.end());
    std::copy(before.begin(), before.end(), order.begin() + y);
    for (int k = y; k <= last; ++k) position[static_cast<size_t>(order[static_cast<size_t>(k)])] = k;
  }
  return reordered(graph, order);
}

}  // namespace plow
