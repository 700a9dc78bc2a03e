// Rules around projections: RMSNorm folded into the projection that reads it, horizontal fusion of
// projections sharing an input, and the residual add folded into a projection's epilogue.
#include <algorithm>

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

// Not where h is a moe_down: routed-shared-combine folds that add into the routed experts' down
// projection instead, so the shared expert's projection runs beside the routed experts (in the
// top-k's shadow, schedule.h) and not one dependency hop after them.
Rule linear_residual(bool linear_first) {
  Rule r;
  r.name = linear_first ? "linear-residual-add-commuted" : "linear-residual-add";
  r.definition = linear_first ? "(add@a (linear@lin ?y) ?h) => (linear_add ?y ?h | lin.W), h no moe_down"
                              : "(add@a ?h (linear@lin ?y)) => (linear_add ?y ?h | lin.W), h no moe_down";
  const Pattern lin = Pattern::n(Op::kLinear, "lin", {Pattern::v("y")});
  r.lhs = linear_first ? Pattern::n(Op::kAdd, "a", {lin, Pattern::v("h")}) : Pattern::n(Op::kAdd, "a", {Pattern::v("h"), lin});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    for (const ENode& node : g.nodes(m.vars.at("h"))) {
      if (g.symbol(node.symbol).op == Op::kMoeDown) return std::nullopt;
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
  return {norm_into_linear(), horizontal_linear(), norm_into_multi_linear(), linear_residual(false), linear_residual(true)};
}

}  // namespace plow
