// Rules of the feed-forward blocks: gate/up projections with their activation, the activation into
// the down projection (SiLU and SiTU), and the routed-expert sum with the shared-expert add.
#include "compiler/rule.h"
#include "compiler/rules/instance.h"

namespace plow {

namespace {

constexpr double kSilu = 0, kSitu = 1;

Attrs activation_attrs(const Symbol& act, double kind) {
  Attrs attrs = {{"act", kind}, {"beta", 0.0}, {"linear_beta", 0.0}};
  if (kind == kSitu) attrs.set("beta", act.attrs.get("beta")).set("linear_beta", act.attrs.get("linear_beta"));
  return attrs;
}

Attrs situ_attrs() { return {{"beta", 4.0}, {"linear_beta", 25.0}}; }

Rule gate_up(bool situ) {
  const Op act_op = situ ? Op::kSituMul : Op::kSiluMul;
  Rule r;
  r.name = situ ? "gate-up-situ" : "gate-up-silu";
  r.definition = std::string("(") + (situ ? "situ_mul" : "silu_mul") + "@act (linear@g ?x) (linear@u ?x)) => (gate_up_act ?x | g.W u.W)";
  r.lhs = Pattern::n(act_op, "act", {Pattern::n(Op::kLinear, "g", {Pattern::v("x")}), Pattern::n(Op::kLinear, "u", {Pattern::v("x")})});
  r.apply = [situ](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& act = symbol_of(g, m, "act");
    return add_fused(g, Op::kGateUpAct, activation_attrs(act, situ ? kSitu : kSilu),
                     {symbol_of(g, m, "g").weights[0], symbol_of(g, m, "u").weights[0]}, {m.vars.at("x")}, act.width, act.label);
  };
  r.instance = [situ, act_op](int64_t n) {
    Graph g;
    const int x = rules::input(g, n, "x");
    const int gate = rules::linear(g, x, 2 * n + 1, "gate"), up = rules::linear(g, x, 2 * n + 1, "up");
    return rules::finish(g, g.add(act_op, {gate, up}, {}, situ ? situ_attrs() : Attrs{}, "act"));
  };
  return r;
}

Rule act_down(bool situ) {
  const Op act_op = situ ? Op::kSituMul : Op::kSiluMul;
  Rule r;
  r.name = situ ? "situ-into-down" : "silu-into-down";
  r.definition = std::string("(linear@lin (") + (situ ? "situ_mul" : "silu_mul") + "@act ?a ?b)) => (act_linear ?a ?b | lin.W)";
  r.lhs = Pattern::n(Op::kLinear, "lin", {Pattern::n(act_op, "act", {Pattern::v("a"), Pattern::v("b")})});
  r.apply = [situ](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& lin = symbol_of(g, m, "lin");
    return add_fused(g, Op::kActLinear, activation_attrs(symbol_of(g, m, "act"), situ ? kSitu : kSilu), {lin.weights[0]},
                     {m.vars.at("a"), m.vars.at("b")}, lin.width, lin.label);
  };
  r.instance = [situ, act_op](int64_t n) {
    Graph g;
    const int a = rules::input(g, n + 4, "a"), b = rules::input(g, n + 4, "b");
    const int act = g.add(act_op, {a, b}, {}, situ ? situ_attrs() : Attrs{}, "act");
    return rules::finish(g, rules::linear(g, act, n, "down"));
  };
  return r;
}

Rule routed_shared_combine() {
  Rule r;
  r.name = "routed-shared-combine";
  r.definition = "(add@a (moe_down@d ?h ?routes) ?shared) => (moe_down_add ?h ?routes ?shared | d.W2)";
  r.lhs = Pattern::n(Op::kAdd, "a", {Pattern::n(Op::kMoeDown, "d", {Pattern::v("h"), Pattern::v("routes")}), Pattern::v("shared")});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& d = symbol_of(g, m, "d");
    return add_fused(g, Op::kMoeDownAdd, d.attrs, d.weights, {m.vars.at("h"), m.vars.at("routes"), m.vars.at("shared")}, d.width,
                     symbol_of(g, m, "a").label);
  };
  // The whole routed block (router, gate/up, down) so that h holds real expert activations and the
  // routes real expert ids; the expert width n + 2 differs from the model width n.
  r.instance = [](int64_t n) {
    constexpr int64_t kExperts = 5, kTopK = 2;
    Graph g;
    const int x = rules::input(g, n, "x"), shared = rules::input(g, n, "shared");
    const int logits = g.add(Op::kRouterLogits, {x}, {rules::weight(g, "moe.gate.weight", {kExperts, n})}, {}, "router_logits");
    const int routes = g.add(Op::kMoeTopK, {logits}, {rules::weight(g, "moe.gate.e_score_correction_bias", {kExperts})},
                             {{"experts", kExperts}, {"top_k", kTopK}, {"groups", 1}, {"topk_groups", 1}, {"renormalize", 1}, {"scale", 2.5}, {"softmax", 0}},
                             "router");
    int stacks[3];
    for (int j = 0; j < 3; ++j) {
      WeightDecl decl;
      for (int64_t e = 0; e < kExperts; ++e) decl.parts.push_back(fmt::format("moe.experts.{}.w{}.weight", e, j + 1));
      decl.name = decl.parts.front();
      decl.shape = j == 1 ? std::vector<int64_t>{n, n + 2} : std::vector<int64_t>{n + 2, n};  // w1/w3 [I,H], w2 [H,I]
      stacks[j] = g.add_weight(std::move(decl));
    }
    const Attrs routing = {{"experts", kExperts}, {"top_k", kTopK}};
    const int acts = g.add(Op::kMoeGateUp, {x, routes}, {stacks[0], stacks[2]},
                           {{"experts", kExperts}, {"top_k", kTopK}, {"situ", 0}, {"beta", 0}, {"linear_beta", 0}}, "experts_gate_up");
    const int down = g.add(Op::kMoeDown, {acts, routes}, {stacks[1]}, routing, "experts_down");
    return rules::finish(g, g.add(Op::kAdd, {down, shared}, {}, {}, "combine"));
  };
  return r;
}

}  // namespace

std::vector<Rule> ffn_rules() { return {gate_up(false), gate_up(true), act_down(false), act_down(true), routed_shared_combine()}; }

}  // namespace plow
