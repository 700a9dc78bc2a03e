// Small left-hand-side graphs for rule certificates: kInput leaves, weights named so that
// random_checkpoint draws them at meaningful scales (norm weights near 1, decisive routers).
#pragma once

#include <fmt/format.h>

#include "graph/graph.h"

namespace plow::rules {

// Inputs are told apart by an "input" attribute: e-graph identity ignores labels, and two inputs
// of one width must never be taken for the same value.
inline int input(Graph& g, int64_t width, const std::string& name) {
  return g.add(Op::kInput, {}, {}, {{"width", static_cast<double>(width)}, {"input", static_cast<double>(g.nodes().size())}}, name);
}

inline int weight(Graph& g, const std::string& name, std::vector<int64_t> shape) {
  return g.add_weight({name, {name}, std::move(shape), false});
}

inline int linear(Graph& g, int x, int64_t out, const std::string& name) {
  return g.add(Op::kLinear, {x}, {weight(g, name + ".weight", {out, g.node(x).width})}, {}, name);
}

inline int norm(Graph& g, int x, const std::string& name) {
  return g.add(Op::kRmsNorm, {x}, {weight(g, name + "_norm.weight", {g.node(x).width})}, {{"eps", 1e-5}}, name);
}

inline Graph finish(Graph& g, int output) {
  g.set_output(output);
  g.verify();
  return std::move(g);
}

}  // namespace plow::rules
