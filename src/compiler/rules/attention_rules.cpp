// Rules around the mixers and the residual stream: the KDA gate folded into the f_b projection, the
// KDA gated norm and the MLA output gate folded into o_proj, the residual add folded into the next
// RMSNorm, and the AttnRes mix into its norm.
#include "compiler/rule.h"
#include "compiler/rules/instance.h"

namespace plow {

namespace {

Rule kda_gated_norm() {
  Rule r;
  r.name = "kda-gated-norm-fuse";
  r.definition = "(linear@lin (gated_rms_norm@gn ?o ?z)) => (gated_norm_linear ?o ?z | gn.w lin.W)";
  r.lhs = Pattern::n(Op::kLinear, "lin", {Pattern::n(Op::kGatedRmsNorm, "gn", {Pattern::v("o"), Pattern::v("z")})});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& lin = symbol_of(g, m, "lin");
    const Symbol& gn = symbol_of(g, m, "gn");
    return add_fused(g, Op::kGatedNormLinear, gn.attrs, {gn.weights[0], lin.weights[0]}, {m.vars.at("o"), m.vars.at("z")}, lin.width, lin.label);
  };
  r.instance = [](int64_t n) {
    const int64_t heads = 3, d = n;
    Graph g;
    const int o = rules::input(g, heads * d, "o"), z = rules::input(g, heads * d, "z");
    const int gn = g.add(Op::kGatedRmsNorm, {o, z}, {rules::weight(g, "kda.o_norm.weight", {d})},
                         {{"heads", heads}, {"head_dim", static_cast<double>(d)}, {"eps", 1e-5}}, "o_norm");
    return rules::finish(g, rules::linear(g, gn, n + 1, "o_proj"));
  };
  return r;
}

// The gate reads nothing but the projection's own column (and its head's A_log): a per-column
// epilogue. At decode it is one dependency level and a few µs of task overhead less per KDA layer.
Rule kda_gate_into_linear() {
  Rule r;
  r.name = "kda-gate-into-linear";
  r.definition = "(kda_gate@gate (linear@lin ?f)) => (linear_kda_gate ?f | lin.W gate.A_log gate.dt_bias)";
  r.lhs = Pattern::n(Op::kKdaGate, "gate", {Pattern::n(Op::kLinear, "lin", {Pattern::v("f")})});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& lin = symbol_of(g, m, "lin");
    const Symbol& gate = symbol_of(g, m, "gate");
    return add_fused(g, Op::kLinearKdaGate, gate.attrs, {lin.weights[0], gate.weights[0], gate.weights[1]}, {m.vars.at("f")}, gate.width,
                     gate.label);
  };
  r.instance = [](int64_t n) {
    const int64_t heads = 3, d = n;
    Graph g;
    const int f = rules::input(g, n + 1, "f");
    Attrs attrs{{"heads", heads}, {"head_dim", static_cast<double>(d)}};
    if (n % 2 != 0) attrs.set("lower_bound", -5.0);  // odd instances certify the K3 bounded gate
    const int gate = g.add(Op::kKdaGate, {rules::linear(g, f, heads * d, "f_b")},
                           {rules::weight(g, "kda.A_log", {heads}), rules::weight(g, "kda.dt_bias", {heads * d})}, attrs, "gate");
    return rules::finish(g, gate);
  };
  return r;
}

Rule mla_output_gate() {
  Rule r;
  r.name = "mla-out-gate-fuse";
  r.definition = "(linear@lin (sigmoid_mul@gate ?o ?g)) => (act_linear[sigmoid] ?o ?g | lin.W)";
  r.lhs = Pattern::n(Op::kLinear, "lin", {Pattern::n(Op::kSigmoidMul, "gate", {Pattern::v("o"), Pattern::v("g")})});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& lin = symbol_of(g, m, "lin");
    return add_fused(g, Op::kActLinear, {{"act", 2.0}, {"beta", 0.0}, {"linear_beta", 0.0}}, {lin.weights[0]},
                     {m.vars.at("o"), m.vars.at("g")}, lin.width, lin.label);
  };
  r.instance = [](int64_t n) {
    Graph g;
    const int o = rules::input(g, 2 * n, "o"), gate = rules::input(g, 2 * n, "g");
    return rules::finish(g, rules::linear(g, g.add(Op::kSigmoidMul, {o, gate}, {}, {}, "gate"), n, "o_proj"));
  };
  return r;
}

// rms_norm(a + b) and a + b itself are both read from one add_norm: [sum | normed].
Rule add_into_norm() {
  Rule r;
  r.name = "add-into-norm";
  r.definition = "(rms_norm@norm (add@sum ?a ?b)) => (slice[H,2H] (add_norm ?a ?b | norm.w)), sum => (slice[0,H] (add_norm ...))";
  r.lhs = Pattern::n(Op::kRmsNorm, "norm", {Pattern::n(Op::kAdd, "sum", {Pattern::v("a"), Pattern::v("b")})});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& norm = symbol_of(g, m, "norm");
    const int64_t width = norm.width;
    const std::string label = symbol_of(g, m, "sum").label;
    const ClassId fused = add_fused(g, Op::kAddNorm, {{"eps", norm.attrs.get("eps")}}, {norm.weights[0]}, {m.vars.at("a"), m.vars.at("b")},
                                    2 * width, label + "+" + norm.label);
    const ClassId sum = add_fused(g, Op::kSlice, {{"offset", 0.0}, {"width", static_cast<double>(width)}}, {}, {fused}, width, label);
    g.merge(m.node_classes.at("sum"), sum);
    return add_fused(g, Op::kSlice, {{"offset", static_cast<double>(width)}, {"width", static_cast<double>(width)}}, {}, {fused}, width,
                     norm.label);
  };
  r.instance = [](int64_t n) {
    Graph g;
    const int a = rules::input(g, n, "a"), b = rules::input(g, n, "b");
    const int sum = g.add(Op::kAdd, {a, b}, {}, {}, "sum");
    const int normed = rules::norm(g, sum, "next");
    return rules::finish(g, g.add(Op::kAdd, {sum, rules::linear(g, normed, n, "proj")}, {}, {}, "out"));  // both sum and norm used
  };
  return r;
}

Rule attn_res_norm() {
  Rule r;
  r.name = "attn-res-mix-norm";
  r.definition = "(rms_norm@norm (attn_res_mix@mix ...)) => (attn_res_norm ... | mix.w_n mix.w_q norm.w)";
  r.lhs = Pattern::n(Op::kRmsNorm, "norm", {Pattern::any(Op::kAttnResMix, "mix")});
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& norm = symbol_of(g, m, "norm");
    const Symbol& mix = symbol_of(g, m, "mix");
    return add_fused(g, Op::kAttnResNorm, {{"eps", mix.attrs.get("eps")}, {"norm_eps", norm.attrs.get("eps")}},
                     {mix.weights[0], mix.weights[1], norm.weights[0]}, m.nodes.at("mix").children, norm.width, norm.label);
  };
  r.instance = [](int64_t n) {
    Graph g;
    std::vector<int> values;
    for (int j = 0; j < 3; ++j) values.push_back(rules::input(g, n, fmt::format("v{}", j)));
    const int mix = g.add(Op::kAttnResMix, values, {rules::weight(g, "ar.res_norm.weight", {n}), rules::weight(g, "ar.res_proj.weight", {1, n})},
                          {{"eps", 1e-5}}, "mix");
    return rules::finish(g, rules::norm(g, mix, "layer"));
  };
  return r;
}

}  // namespace

std::vector<Rule> attention_rules() {
  return {kda_gate_into_linear(), kda_gated_norm(), mla_output_gate(), add_into_norm(), attn_res_norm()};
}

}  // namespace plow
