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

// The KDA mixer's core in one op: the q/k/v convs, the gate (its f_b projection included) and β no
// longer a dependency level between the layer's projections and its delta rule. The fused op owns the
// convs' windows (attrs conv_q/k/v), so each conv may be read by the delta rule alone.
Rule kda_core_fuse() {
  Rule r;
  r.name = "kda-core-fuse";
  r.definition =
      "(kda_delta_rule@core (short_conv_silu@cq ?xq) (short_conv_silu@ck ?xk) (short_conv_silu@cv ?xv) (kda_gate@gate (linear@fb ?f)) "
      "(sigmoid ?b)) => (kda_fused_core ?xq ?xk ?xv ?f ?b | cq.C ck.C cv.C fb.W gate.A_log gate.dt_bias; state core.state, "
      "conv_q cq.state, conv_k ck.state, conv_v cv.state), if each conv is read by core alone and the kernels agree";
  const auto conv = [](const char* bind, const char* var) { return Pattern::n(Op::kShortConvSilu, bind, {Pattern::v(var)}); };
  r.lhs = Pattern::n(Op::kKdaDeltaRule, "core",
                     {conv("cq", "xq"), conv("ck", "xk"), conv("cv", "xv"),
                      Pattern::n(Op::kKdaGate, "gate", {Pattern::n(Op::kLinear, "fb", {Pattern::v("f")})}),
                      Pattern::n(Op::kSigmoid, "beta", {Pattern::v("b")})});
  r.guard = [](const EGraph& g, const Match& m) {
    const double kernel = symbol_of(g, m, "cq").attrs.get("kernel");
    for (const char* bind : {"cq", "ck", "cv"}) {
      if (symbol_of(g, m, bind).attrs.get("kernel") != kernel) return false;
      for (const auto& [parent, cls] : g.parents(m.node_classes.at(bind))) {
        if (g.find(cls) != g.find(m.root)) return false;  // another reader would need the conv's own window update
      }
    }
    return true;
  };
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& core = symbol_of(g, m, "core");
    const Symbol& gate = symbol_of(g, m, "gate");
    Symbol fused;
    fused.op = Op::kKdaFusedCore;
    fused.attrs = gate.attrs;  // heads, head_dim, lower_bound (K3)
    fused.attrs.set("kernel", symbol_of(g, m, "cq").attrs.get("kernel"));
    fused.attrs.set("conv_q", symbol_of(g, m, "cq").state).set("conv_k", symbol_of(g, m, "ck").state).set("conv_v", symbol_of(g, m, "cv").state);
    fused.weights = {symbol_of(g, m, "cq").weights[0], symbol_of(g, m, "ck").weights[0], symbol_of(g, m, "cv").weights[0],
                     symbol_of(g, m, "fb").weights[0], gate.weights[0], gate.weights[1]};
    fused.state = core.state;
    fused.width = core.width;
    fused.label = core.label;
    return g.add(fused, {m.vars.at("xq"), m.vars.at("xk"), m.vars.at("xv"), m.vars.at("f"), m.vars.at("b")});
  };
  r.instance = [](int64_t n) {
    const int64_t heads = 2, d = n, width = heads * d, kernel = n % 2 != 0 ? 4 : 3;
    Graph g;
    int qkv[3];
    const char* names[3] = {"q", "k", "v"};
    for (int j = 0; j < 3; ++j) {
      const int window = g.add_state({StateKind::kConvWindow, width, kernel - 1, fmt::format("{}_conv", names[j])});
      qkv[j] = g.add(Op::kShortConvSilu, {rules::input(g, width, names[j])}, {rules::weight(g, fmt::format("kda.{}_conv1d.weight", names[j]), {width, 1, kernel})},
                     {{"kernel", static_cast<double>(kernel)}}, fmt::format("{}_conv", names[j]), window);
    }
    Attrs attrs{{"heads", static_cast<double>(heads)}, {"head_dim", static_cast<double>(d)}};
    if (n % 2 != 0) attrs.set("lower_bound", -5.0);  // odd instances certify the K3 bounded gate
    const int gate = g.add(Op::kKdaGate, {rules::linear(g, rules::input(g, n + 1, "f"), width, "f_b")},
                           {rules::weight(g, "kda.A_log", {heads}), rules::weight(g, "kda.dt_bias", {width})}, attrs, "gate");
    const int beta = g.add(Op::kSigmoid, {rules::input(g, heads, "b")}, {}, {}, "beta");
    const int state = g.add_state({StateKind::kKdaRecurrent, width, heads, "state"});
    return rules::finish(g, g.add(Op::kKdaDeltaRule, {qkv[0], qkv[1], qkv[2], gate, beta}, {}, {{"heads", static_cast<double>(heads)}, {"head_dim", static_cast<double>(d)}},
                                  "core", state));
  };
  return r;
}

// The output gate's low-rank projection and the gated norm inside the fused core (a task holds whole
// heads, the norm's unit): the g_b linear's tasks (a worker each at batch 1) and its buffer go, and
// o_proj reads the normed heads as a plain linear. Only a low-rank gate (its input at most 4 heads
// wide: K3's full-rank gate would put a hidden-wide projection in every task), and only when nothing
// but this norm (or o_proj's gated_norm_linear over the same two classes, the same value) reads the
// core: extracting both cores would update the states twice.
Rule kda_core_gated_norm() {
  Rule r;
  r.name = "kda-core-gated-norm";
  r.definition =
      "(gated_rms_norm@gn (kda_fused_core@core ?xq ?xk ?xv ?f ?b) (linear@gb ?g)) => (kda_fused_core ?xq ?xk ?xv ?f ?b ?g | core.weights gb.W "
      "gn.w; core.attrs, eps gn.eps; state core.state), if width(g) <= 4 head_dim and core is read by gn (or gated_norm_linear(core, gb)) alone";
  r.lhs = Pattern::n(Op::kGatedRmsNorm, "gn", {Pattern::n(Op::kKdaFusedCore, "core", {Pattern::v("xq"), Pattern::v("xk"), Pattern::v("xv"), Pattern::v("f"),
                                                                                    Pattern::v("b")}),
                                              Pattern::n(Op::kLinear, "gb", {Pattern::v("g")})});
  r.guard = [](const EGraph& g, const Match& m) {
    const Symbol& core = symbol_of(g, m, "core");
    if (g.width(m.vars.at("g")) > 4 * core.attrs.i("head_dim")) return false;
    const ClassId core_class = g.find(m.node_classes.at("core")), z_class = g.find(m.node_classes.at("gb"));
    for (const auto& [parent, cls] : g.parents(core_class)) {
      if (g.find(cls) == g.find(m.root)) continue;
      const bool same_norm = g.symbol(parent.symbol).op == Op::kGatedNormLinear && parent.children.size() == 2 &&
                             g.find(parent.children[0]) == core_class && g.find(parent.children[1]) == z_class;
      if (!same_norm) return false;
    }
    return true;
  };
  r.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& core = symbol_of(g, m, "core");
    const Symbol& gn = symbol_of(g, m, "gn");
    Symbol fused = core;
    fused.attrs.set("eps", gn.attrs.get("eps"));
    fused.weights.push_back(symbol_of(g, m, "gb").weights[0]);
    fused.weights.push_back(gn.weights[0]);
    fused.label = gn.label;
    return g.add(fused, {m.vars.at("xq"), m.vars.at("xk"), m.vars.at("xv"), m.vars.at("f"), m.vars.at("b"), m.vars.at("g")});
  };
  r.instance = [](int64_t n) {
    const int64_t heads = 2, d = n, width = heads * d, kernel = 4;
    Graph g;
    Attrs attrs{{"heads", static_cast<double>(heads)}, {"head_dim", static_cast<double>(d)}, {"kernel", static_cast<double>(kernel)}};
    if (n % 2 != 0) attrs.set("lower_bound", -5.0);
    std::vector<int> inputs, weights;
    for (const char* name : {"q", "k", "v"}) {
      inputs.push_back(rules::input(g, width, name));
      weights.push_back(rules::weight(g, fmt::format("kda.{}_conv1d.weight", name), {width, 1, kernel}));
      attrs.set(fmt::format("conv_{}", name), g.add_state({StateKind::kConvWindow, width, kernel - 1, fmt::format("{}_conv", name)}));
    }
    inputs.push_back(rules::input(g, n + 1, "f"));
    inputs.push_back(rules::input(g, heads, "b"));
    weights.push_back(rules::weight(g, "kda.f_b_proj.weight", {width, n + 1}));
    weights.push_back(rules::weight(g, "kda.A_log", {heads}));
    weights.push_back(rules::weight(g, "kda.dt_bias", {width}));
    const int state = g.add_state({StateKind::kKdaRecurrent, width, heads, "state"});
    const int core = g.add(Op::kKdaFusedCore, inputs, weights, attrs, "core", state);
    const int z = rules::linear(g, rules::input(g, n - 1, "g"), width, "g_b");
    Attrs norm_attrs{{"heads", static_cast<double>(heads)}, {"head_dim", static_cast<double>(d)}, {"eps", 1e-5}};
    return rules::finish(g, g.add(Op::kGatedRmsNorm, {core, z}, {rules::weight(g, "kda.o_norm.weight", {d})}, norm_attrs, "o_norm"));
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
  return {kda_gate_into_linear(), kda_core_fuse(), kda_core_gated_norm(), kda_gated_norm(), mla_output_gate(), add_into_norm(), attn_res_norm()};
}

}  // namespace plow
