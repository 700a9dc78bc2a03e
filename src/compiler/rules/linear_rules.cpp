// Rules around projections: RMSNorm folded into the projection that reads it, horizontal fusion of
// projections sharing an input, and the residual add folded into a projection's epilogue.
#include <algorithm>
#include <optional>
#include <utility>

#include "compiler/rule.h"
#include "compiler/rules/instance.h"

namespace plow {

namespace {

Rule norm_into_linear() {
  Rule r;
  r.name = "norm-into-linear";
  r.definition = "(linear@lin (rms_norm@norm ?x)) => (norm_linear ?x | norm.w lin.W)";
  r.lhs = Pattern::n(Op::kLinear, "lin", {Pattern::n(Op::kRmsNorm, "norm", {Pattern::v("x")})});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& lin = symbol_of(g, m, "lin");
    const Symbol& norm = symbol_of(g, m, "norm");
    return add_fused(g, Op::kNormLinear, {{"eps", norm.attrs.get("eps")}}, {norm.weights[0], lin.weights[0]}, {m.vars.at("x")},
                     lin.width, lin.label);
  };
  r.instance = [](int64_t n) {
    Graph g;
    const int x = rules::input(g, n, "x");
    return rules::finish(g, rules::linear(g, rules::norm(g, x, "n"), n + 3, "proj"));
  };
  return r;
}

// All plain linears reading one class become slices of one multi_linear (weights in id order).
Rule horizontal_linear() {
  Rule r;
  r.name = "horizontal-linear";
  r.definition = "(linear@1 ?x W1) ... (linear@n ?x Wn), n >= 2 => (slice_i (multi_linear ?x | W1..Wn))";
  r.search = [](const EGraph& g) {
    std::vector<Match> matches;
    for (ClassId x : g.classes()) {
      std::vector<std::pair<int, ClassId>> linears;  // (weight id, class)
      for (const auto& [node, cls] : g.parents(x)) {
        const Symbol& s = g.symbol(node.symbol);
        if (s.op != Op::kLinear || node.children.size() != 1 || g.find(node.children[0]) != g.find(x)) continue;
        linears.emplace_back(s.weights[0], g.find(cls));
      }
      std::sort(linears.begin(), linears.end());
      linears.erase(std::unique(linears.begin(), linears.end()), linears.end());
      if (linears.size() < 2) continue;
      Match m;
      m.root = g.find(x);
      m.vars["x"] = g.find(x);
      for (size_t i = 0; i < linears.size(); ++i) m.vars[fmt::format("lin{:04d}", i)] = linears[i].second;
      matches.push_back(std::move(m));
    }
    return matches;
  };
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    std::vector<int> weights;
    std::vector<std::pair<ClassId, int64_t>> parts;  // class, width
    std::string label;
    for (const auto& [name, cls] : m.vars) {
      if (name == "x") continue;
      for (const ENode& node : g.nodes(cls)) {
        const Symbol& s = g.symbol(node.symbol);
        if (s.op == Op::kLinear && node.children.size() == 1 && g.find(node.children[0]) == g.find(m.vars.at("x"))) {
          weights.push_back(s.weights[0]);
          parts.emplace_back(cls, s.width);
          label += (label.empty() ? "" : "+") + s.label;
          break;
        }
      }
    }
    int64_t total = 0;
    for (const auto& part : parts) total += part.second;
    const ClassId multi = add_fused(g, Op::kMultiLinear, {}, weights, {m.vars.at("x")}, total, label);
    int64_t offset = 0;
    for (const auto& [cls, width] : parts) {
      const ClassId slice = add_fused(g, Op::kSlice, {{"offset", static_cast<double>(offset)}, {"width", static_cast<double>(width)}}, {},
                                      {multi}, width, label + ".slice");
      g.merge(cls, slice);
      offset += width;
    }
    return std::nullopt;  // equalities were asserted above
  };
  r.instance = [](int64_t n) {
    Graph g;
    const int x = rules::input(g, n, "x");
    const int a = rules::linear(g, x, n + 1, "a"), b = rules::linear(g, x, 2 * n, "b"), c = rules::linear(g, x, 3, "c");
    const int ab = g.add(Op::kAdd, {rules::linear(g, a, n, "a2"), rules::linear(g, b, n, "b2")}, {}, {}, "ab");
    return rules::finish(g, g.add(Op::kAdd, {ab, rules::linear(g, c, n, "c2")}, {}, {}, "abc"));
  };
  return r;
}

Rule norm_into_multi_linear() {
  Rule r;
  r.name = "norm-into-multi-linear";
  r.definition = "(multi_linear@m (rms_norm@norm ?x)) => (norm_multi_linear ?x | norm.w m.W...)";
  r.lhs = Pattern::n(Op::kMultiLinear, "m", {Pattern::n(Op::kRmsNorm, "norm", {Pattern::v("x")})});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& multi = symbol_of(g, m, "m");
    const Symbol& norm = symbol_of(g, m, "norm");
    std::vector<int> weights = {norm.weights[0]};
    weights.insert(weights.end(), multi.weights.begin(), multi.weights.end());
    return add_fused(g, Op::kNormMultiLinear, {{"eps", norm.attrs.get("eps")}}, weights, {m.vars.at("x")}, multi.width, multi.label);
  };
  r.instance = [](int64_t n) {
    Graph g;
    const int x = rules::norm(g, rules::input(g, n, "x"), "n");
    const int multi = g.add(Op::kMultiLinear, {x}, {rules::weight(g, "p.weight", {n, n}), rules::weight(g, "q.weight", {5, n})}, {}, "pq");
    return rules::finish(g, multi);
  };
  return r;
}

// The readers of a residual stream's norm read the sum's two terms themselves: each task adds and
// normalizes the rows it stages (as norm_multi_linear already normalizes them), so the projection or
// the router no longer waits for an add_norm's few tasks: one dependency hop a layer each at decode.
// The sum stays an add (or the add_norm that the experts read) for its other readers, off that path.
// These run on the extracted graph (Rule::rewrite, compiler/rewrite.h): reading two rows where the
// norm's reader read one, their right-hand sides never win the extraction's byte count.

// The terms when node `id` is a + b: add(a, b), or the sum half of add_norm(a, b). Not a
// tensor-parallel partial sum (attr partial: fp32, unrounded), which the fused ops would round.
std::optional<std::pair<int, int>> sum_terms(const Graph& g, int id) {
  const Node& node = g.node(id);
  if (node.op == Op::kAdd && !(node.attrs.has("partial") && node.attrs.get("partial") != 0)) return std::pair{node.inputs[0], node.inputs[1]};
  if (node.op == Op::kSlice && node.attrs.i("offset") == 0) {
    const Node& fused = g.node(node.inputs[0]);
    if (fused.op == Op::kAddNorm && node.width == fused.width / 2) return std::pair{fused.inputs[0], fused.inputs[1]};
  }
  return std::nullopt;
}

// rms_norm(a + b; w) as node `id`: rms_norm(add(a, b)) or the norm half of add_norm(a, b).
struct NormOfSum {
  int a, b, weight;
  double eps;
};
std::optional<NormOfSum> norm_of_sum(const Graph& g, int id) {
  const Node& node = g.node(id);
  if (node.op == Op::kRmsNorm) {
    if (const auto terms = sum_terms(g, node.inputs[0])) return NormOfSum{terms->first, terms->second, node.weights[0], node.attrs.get("eps")};
  }
  if (node.op == Op::kSlice) {
    const Node& fused = g.node(node.inputs[0]);
    if (fused.op == Op::kAddNorm && node.attrs.i("offset") == fused.width / 2 && node.width == fused.width / 2) {
      return NormOfSum{fused.inputs[0], fused.inputs[1], fused.weights[0], fused.attrs.get("eps")};
    }
  }
  return std::nullopt;
}

Rule add_norm_into_multi_linear() {
  Rule r;
  r.name = "add-norm-into-multi-linear";
  r.definition =
      "(norm_multi_linear@m (add ?a ?b)) => (add_norm_multi_linear ?a ?b | m.w m.W...); "
      "(multi_linear@m (rms_norm@norm (add ?a ?b))) => (add_norm_multi_linear ?a ?b | norm.w m.W...); on the extracted graph";
  r.rewrite = [](const Graph& g, int id) -> std::optional<NodeRewrite> {
    const Node& node = g.node(id);
    if (node.op == Op::kNormMultiLinear) {
      if (const auto terms = sum_terms(g, node.inputs[0])) {
        return NodeRewrite{Op::kAddNormMultiLinear, {terms->first, terms->second}, node.weights, {{"eps", node.attrs.get("eps")}}};
      }
    }
    if (node.op == Op::kMultiLinear) {
      if (const auto norm = norm_of_sum(g, node.inputs[0])) {
        std::vector<int> weights = {norm->weight};
        weights.insert(weights.end(), node.weights.begin(), node.weights.end());
        return NodeRewrite{Op::kAddNormMultiLinear, {norm->a, norm->b}, weights, {{"eps", norm->eps}}};
      }
    }
    return std::nullopt;
  };
  // The sum read by the projections and by the residual after them, as in a layer; odd sizes take the
  // first form (norm_multi_linear, as fusion extracts it), even sizes the second.
  r.instance = [](int64_t n) {
    Graph g;
    const int sum = g.add(Op::kAdd, {rules::input(g, n, "a"), rules::input(g, n, "b")}, {}, {}, "sum");
    const int p = rules::weight(g, "p.weight", {n - 2, n}), q = rules::weight(g, "q.weight", {2, n});
    const int multi = n % 2 != 0 ? g.add(Op::kNormMultiLinear, {sum}, {rules::weight(g, "n_norm.weight", {n}), p, q}, {{"eps", 1e-5}}, "pq")
                                 : g.add(Op::kMultiLinear, {rules::norm(g, sum, "n")}, {p, q}, {}, "pq");
    return rules::finish(g, g.add(Op::kAdd, {sum, multi}, {}, {}, "out"));
  };
  return r;
}

Rule add_norm_into_router() {
  Rule r;
  r.name = "add-norm-into-router";
  r.definition = "(router_logits@r (rms_norm@norm (add ?a ?b))) => (add_norm_router_logits ?a ?b | norm.w r.W); on the extracted graph";
  r.rewrite = [](const Graph& g, int id) -> std::optional<NodeRewrite> {
    const Node& node = g.node(id);
    if (node.op != Op::kRouterLogits) return std::nullopt;
    const auto norm = norm_of_sum(g, node.inputs[0]);
    if (!norm) return std::nullopt;
    return NodeRewrite{Op::kAddNormRouterLogits, {norm->a, norm->b}, {norm->weight, node.weights[0]}, {{"eps", norm->eps}}};
  };
  r.instance = [](int64_t n) {  // the norm read by the experts too (here a projection), the sum by the residual
    Graph g;
    const int sum = g.add(Op::kAdd, {rules::input(g, n, "a"), rules::input(g, n, "b")}, {}, {}, "sum");
    const int normed = rules::norm(g, sum, "post_attention");
    const int logits = g.add(Op::kRouterLogits, {normed}, {rules::weight(g, "moe.gate.weight", {n, n})}, {}, "router_logits");
    const int experts = g.add(Op::kAdd, {sum, rules::linear(g, normed, n, "experts")}, {}, {}, "residual");
    return rules::finish(g, g.add(Op::kAdd, {experts, logits}, {}, {}, "out"));
  };
  return r;
}

// Not where h is a moe_down: routed-shared-combine folds that add into the routed experts' down
// projection instead, so the shared expert's projection runs beside the routed experts (in the
// top-k's shadow, schedule.h) and not one dependency hop after them. Nor where y is a KDA output norm
// with a low-rank gate (z = linear(g) of g at most 4 heads wide), the norm kda-core-gated-norm folds
// into the fused core in decode plans, o_proj then a plain linear: that residual add stays an add,
// which the next layer's router and projections read as its two terms (add-norm-into-router /
// -multi-linear, as when o_proj is a gated_norm_linear); a linear_add's sum would need a norm op of its
// own before them, one dependency hop more. (K3's full-rank gate keeps its linear_add.)
Rule linear_residual(bool linear_first) {
  Rule r;
  r.name = linear_first ? "linear-residual-add-commuted" : "linear-residual-add";
  r.definition = linear_first ? "(add@a (linear@lin ?y) ?h) => (linear_add ?y ?h | lin.W), h no moe_down, y no low-rank-gated KDA output norm"
                              : "(add@a ?h (linear@lin ?y)) => (linear_add ?y ?h | lin.W), h no moe_down, y no low-rank-gated KDA output norm";
  const Pattern lin = Pattern::n(Op::kLinear, "lin", {Pattern::v("y")});
  r.lhs = linear_first ? Pattern::n(Op::kAdd, "a", {lin, Pattern::v("h")}) : Pattern::n(Op::kAdd, "a", {Pattern::v("h"), lin});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    for (const ENode& node : g.nodes(m.vars.at("h"))) {
      if (g.symbol(node.symbol).op == Op::kMoeDown) return std::nullopt;
    }
    for (const ENode& node : g.nodes(m.vars.at("y"))) {
      const Symbol& norm = g.symbol(node.symbol);
      if (norm.op != Op::kGatedRmsNorm) continue;
      for (const ENode& z : g.nodes(node.children[1])) {
        const bool low_rank = g.symbol(z.symbol).op == Op::kLinear && g.width(z.children[0]) <= 4 * norm.attrs.i("head_dim");
        if (low_rank) return std::nullopt;
      }
    }
    const Symbol& l = symbol_of(g, m, "lin");
    return add_fused(g, Op::kLinearAdd, {}, {l.weights[0]}, {m.vars.at("y"), m.vars.at("h")}, l.width, symbol_of(g, m, "a").label);
  };
  r.instance = [linear_first](int64_t n) {
    Graph g;
    const int h = rules::input(g, n, "h"), y = rules::input(g, n + 2, "y");
    const int projected = rules::linear(g, y, n, "o");
    return rules::finish(g, g.add(Op::kAdd, linear_first ? std::vector<int>{projected, h} : std::vector<int>{h, projected}, {}, {}, "res"));
  };
  return r;
}

}  // namespace

std::vector<Rule> linear_rules() {
  return {norm_into_linear(),       horizontal_linear(),     norm_into_multi_linear(), add_norm_into_multi_linear(),
          add_norm_into_router(),   linear_residual(false), linear_residual(true)};
}

}  // namespace plow
