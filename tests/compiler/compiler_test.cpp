// The compiler: e-graph basics, rule certificates (produced here, checked against the committed
// data, refusal of uncertified or changed rules), fused models equal to unfused ones on every
// fixture, and the fused op counts of deep models.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "certify.h"
#include "compiler/compile.h"
#include "compiler/schedule.h"
#include "core/error.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/plans.h"
#include "plan/plan.h"

namespace plow {
namespace {

namespace fs = std::filesystem;

TEST(EGraph, HashConsesAndRestoresCongruence) {
  EGraph g;
  Symbol leaf_a{Op::kInput, {{"width", 4}}, {}, -1, 4, "a"}, leaf_b{Op::kInput, {{"width", 4}, {"id", 1}}, {}, -1, 4, "b"};
  const ClassId a = g.add(leaf_a, {}), b = g.add(leaf_b, {});
  const Symbol sig{Op::kSigmoid, {}, {}, -1, 4, "s"};
  const ClassId fa = g.add(sig, {a}), fb = g.add(sig, {b});
  EXPECT_EQ(g.add(sig, {a}), fa);  // hash-consing
  EXPECT_NE(g.find(fa), g.find(fb));
  EXPECT_TRUE(g.merge(a, b));
  g.rebuild();
  EXPECT_EQ(g.find(fa), g.find(fb));  // congruence: equal children make equal parents
  EXPECT_FALSE(g.merge(fa, fb));
}

TEST(EGraph, MatchesPatternsWithSharedVariables) {
  EGraph g;
  const ClassId x = g.add(Symbol{Op::kInput, {{"width", 3}}, {}, -1, 3, "x"}, {});
  const ClassId y = g.add(Symbol{Op::kInput, {{"width", 3}, {"id", 1}}, {}, -1, 3, "y"}, {});
  const Symbol add{Op::kAdd, {}, {}, -1, 3, "add"};
  const ClassId xx = g.add(add, {x, x}), xy = g.add(add, {x, y});
  const Pattern same = Pattern::n(Op::kAdd, "a", {Pattern::v("p"), Pattern::v("p")});
  EXPECT_EQ(ematch(g, same, xx).size(), 1u);
  EXPECT_EQ(ematch(g, same, xy).size(), 0u);
  EXPECT_EQ(same.text(), "(add@a ?p ?p)");
}

TEST(Rules, AtLeastTwelveNamedRulesInThreeFiles) {
  std::set<std::string> names, files;
  for (const Rule& rule : all_rules()) {
    EXPECT_TRUE(names.insert(rule.name).second) << "duplicate rule " << rule.name;
    files.insert(rule.file);
    EXPECT_FALSE(rule.definition.empty()) << rule.name;
    EXPECT_TRUE(rule.instance) << rule.name << " has no certificate instance";
  }
  EXPECT_GE(names.size(), 12u);
  EXPECT_EQ(files.size(), 3u);
}

// Produces every certificate and compares it with the committed src/compiler/certificates.json.
// PLOW_UPDATE_CERTIFICATES=1 rewrites that file instead (then rebuild).
TEST(Certificates, EveryRuleCertifiedAndCommitted) {
  CertificateSet produced;
  for (const Rule& rule : all_rules()) {
    produced[rule.name] = certify(rule);
    const Certificate& c = produced[rule.name];
    std::printf("%-30s %2d cases, max |lhs − rhs| = %.3g (bound %.3g), hash %s\n", rule.name.c_str(), c.cases, c.max_error, c.bound,
                c.definition_hash.c_str());
    EXPECT_TRUE(c.passed()) << rule.name;
  }
  if (std::getenv("PLOW_UPDATE_CERTIFICATES")) {
    std::ofstream(fs::path(PLOW_SOURCE_DIR) / "src/compiler/certificates.json", std::ios::trunc) << certificates_to_json(produced);
    GTEST_SKIP() << "certificates written; rebuild to embed them";
  }
  const CertificateSet& committed = embedded_certificates();
  for (const auto& [name, c] : produced) {
    ASSERT_TRUE(committed.count(name)) << "rule " << name << " has no committed certificate";
    EXPECT_EQ(committed.at(name).definition_hash, c.definition_hash) << name;
    EXPECT_EQ(committed.at(name).cases, c.cases) << name;
  }
}

TEST(Certificates, CompilerRefusesUncertifiedOrChangedRules) {
  Rule edited = all_rules().front();
  edited.definition += " (edited)";
  const Graph graph = edited.instance(5);
  try {
    compile_graph(graph, {}, {&edited}, embedded_certificates());
    FAIL() << "a changed rule was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("changed since it was certified"), std::string::npos) << e.what();
  }
  Rule unknown = all_rules().front();
  unknown.name = "norm-into-linear-v2";
  try {
    compile_graph(graph, {}, {&unknown}, embedded_certificates());
    FAIL() << "an uncertified rule was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no certificate"), std::string::npos) << e.what();
  }
}

TEST(Certificates, AWrongRuleFailsItsCertificate) {
  // gate/up swapped: plausible, wrong — the certificate must catch it.
  Rule wrong;
  for (const Rule& rule : all_rules()) {
    if (rule.name == "gate-up-silu") wrong = rule;
  }
  ASSERT_FALSE(wrong.name.empty());
  wrong.name = "gate-up-silu-swapped";
  wrong.apply = [](EGraph& g, const Match& m) -> std::optional<ClassId> {
    const Symbol& act = symbol_of(g, m, "act");
    return add_fused(g, Op::kGateUpAct, {{"act", 0.0}, {"beta", 0.0}, {"linear_beta", 0.0}},
                     {symbol_of(g, m, "u").weights[0], symbol_of(g, m, "g").weights[0]}, {m.vars.at("x")}, act.width, act.label);
  };
  const Certificate c = certify(wrong);
  std::printf("swapped gate/up: max |lhs − rhs| = %.3g\n", c.max_error);
  EXPECT_FALSE(c.passed());
  CertificateSet set = {{wrong.name, c}};
  EXPECT_THROW(require_certified({&wrong}, set), Error);
}

// Every fixture: the fused graph's logits are bit-identical to the unfused graph's.
TEST(FusedModels, EqualUnfusedOnEveryFixture) {
  int fixtures = 0;
  for (const auto& entry : fs::directory_iterator(PLOW_TEST_DATA)) {
    if (!fs::exists(entry.path() / "oracle.json")) continue;
    ++fixtures;
    const auto model = LoadedModel::load(entry.path().string());
    const CompiledGraph compiled = compile_graph(model->graph, {});
    const BoundWeights fused_weights(compiled.graph, *model->checkpoint, model->config.tensor_prefix);
    GenerateOptions options;
    options.prompt = {5, 17, 42, 99, 7, 3, 11};
    options.max_new_tokens = 6;
    options.keep_logits = true;
    options.prefill_chunk_tokens = 4;
    const DType act = model->weights->storage_dtype();
    ReferenceBackend unfused(model->graph, *model->weights, act, 1), fused(compiled.graph, fused_weights, act, 1);
    const GenerateResult a = generate(unfused, 0, options), b = generate(fused, 0, options);
    EXPECT_EQ(a.generated, b.generated) << entry.path();
    EXPECT_EQ(a.logits, b.logits) << entry.path();
    std::printf("%s: %zu ops -> %zu, rules fired: %zu\n", entry.path().filename().c_str(), compiled.report.ops_before,
                compiled.report.ops_after, compiled.report.rules_fired().size());
    EXPECT_LT(compiled.report.ops_after, compiled.report.ops_before);
  }
  EXPECT_GE(fixtures, 5);
}

TEST(FusedModels, DeepModelsHaveTheExpectedFusedOps) {
  for (const char* name : {"kimi-linear-48b-a3b.json", "k3-tp8-rank.json"}) {
    const auto model = LoadedModel::describe((fs::path(PLOW_SOURCE_DIR) / "bench/configs" / name).string());
    const auto start = std::chrono::steady_clock::now();
    const CompiledGraph compiled = compile_graph(model->graph, {});
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto& ops = compiled.report.ops_after_by_name;
    auto count = [&](const char* op) { return ops.count(op) ? ops.at(op) : 0; };
    const ModelConfig& c = model->config;
    std::printf("%s: %zu ops -> %zu in %.3f s (%s after %d iterations)\n", name, compiled.report.ops_before, compiled.report.ops_after,
                seconds, compiled.report.saturation.stop_reason.c_str(), compiled.report.saturation.iterations);
    for (const auto& [op, n] : ops) std::printf("  %-20s %d\n", op.c_str(), n);
    EXPECT_LT(compiled.report.cost_after, compiled.report.cost_before);
    EXPECT_LT(compiled.report.ops_after - static_cast<size_t>(count("slice")), compiled.report.ops_before) << "fewer tasks";
    EXPECT_EQ(compiled.report.saturation.stop_reason, "saturated");
    // Every KDA core fused: its convs, its gate (f_b projection included) and β inside one op.
    EXPECT_EQ(count("kda_fused_core"), c.num_layers_of(MixerKind::kKda));
    for (const char* gone : {"kda_delta_rule", "short_conv_silu", "kda_gate", "linear_kda_gate", "sigmoid"}) EXPECT_EQ(count(gone), 0) << gone;
    if (c.attn_res_block_size) {
      EXPECT_EQ(count("attn_res_norm"), 2 * c.num_layers + 1);  // every AttnRes mix feeds its norm directly
      EXPECT_EQ(count("attn_res_mix"), 0);
    } else {
      EXPECT_EQ(count("gated_norm_linear"), 0);  // every KDA output norm inside its fused core (kda-core-gated-norm)
      EXPECT_EQ(count("gate_up_act"), c.num_layers);                           // dense FFN or shared experts, per layer
      EXPECT_EQ(count("silu_mul"), 0);
    }
  }
}

// Decode plans of the 48B: every router and every attention projection after the first layer reads
// its residual sum's two terms (add-norm-into-router / -multi-linear), so none waits for an add_norm;
// the sum's add_norm or add is still there for its other readers, after them. Prefill plans keep the
// unfused form, as does a decode plan compiled without the rules.
TEST(FusedModels, DecodePlansReadTheResidualSumsTerms) {
  const auto model = LoadedModel::describe((fs::path(PLOW_SOURCE_DIR) / "bench/configs/kimi-linear-48b-a3b.json").string());
  const ModelConfig& c = model->config;
  auto count = [](const Plan& plan, Op op) { return std::count_if(plan.ops.begin(), plan.ops.end(), [op](const PlanOp& o) { return o.op() == op; }); };
  const int64_t moe_layers = count(compile_plan(*model, PlanPhase::kDecode, 1, 8, 64, false), Op::kMoeTopK);
  ASSERT_GT(moe_layers, 0);
  const Plan decode = compile_plan(*model, PlanPhase::kDecode, 1, 8, 64);
  // A router still reads a norm only where the residual add is a projection's epilogue (linear_add:
  // the o_proj of three MLA layers), whose sum needs that projection's weights.
  EXPECT_EQ(count(decode, Op::kAddNormRouterLogits) + count(decode, Op::kRouterLogits), moe_layers);
  EXPECT_GE(count(decode, Op::kAddNormRouterLogits), moe_layers - 3);
  for (const PlanOp& op : decode.ops) {
    if (op.op() != Op::kRouterLogits) continue;
    const PlanOp& norm = decode.ops[static_cast<size_t>(op.inputs[0])];
    ASSERT_EQ(norm.op(), Op::kRmsNorm) << op.label;
    EXPECT_EQ(decode.ops[static_cast<size_t>(norm.inputs[0])].op(), Op::kLinearAdd) << op.label;
  }
  EXPECT_EQ(count(decode, Op::kAddNormMultiLinear), c.num_layers - 1);  // layer 0's norm reads the embedding
  // The add or add_norm of the same two terms comes after each fused op in the plan's order, so the
  // workers that run its few tasks run them after their task of the fused op, not before.
  for (size_t f = 0; f < decode.ops.size(); ++f) {
    const PlanOp& op = decode.ops[f];
    if (op.op() != Op::kAddNormRouterLogits && op.op() != Op::kAddNormMultiLinear) continue;
    size_t sum = 0;
    for (size_t i = 0; i < decode.ops.size(); ++i) {
      const PlanOp& o = decode.ops[i];
      if ((o.op() == Op::kAdd || o.op() == Op::kAddNorm) && o.inputs == op.inputs) sum = i;
    }
    EXPECT_GT(sum, f) << op.label << ": its terms' sum is not after it";
  }
  const Plan prefill = compile_plan(*model, PlanPhase::kPrefill, 64, 8, 64);
  EXPECT_EQ(count(prefill, Op::kAddNormRouterLogits) + count(prefill, Op::kAddNormMultiLinear), 0);
  const Plan without = compile_plan(*model, PlanPhase::kDecode, 1, 8, 64, true,
                                    PlanTuning{.disabled_rules = {"add-norm-into-router", "add-norm-into-multi-linear"}});
  EXPECT_EQ(count(without, Op::kAddNormRouterLogits) + count(without, Op::kAddNormMultiLinear), 0);
  EXPECT_EQ(count(without, Op::kRouterLogits), moe_layers);
  // At 132 workers a router task takes 4 of the 256 experts (lower.cpp, kRouterTaskColumns): 64 tasks,
  // so 68 workers are free for the add_norm the experts read.
  const Plan wide = compile_plan(*model, PlanPhase::kDecode, 1, 132, 64);
  std::vector<int64_t> tasks(wide.ops.size(), 0);
  for (const PlanTask& task : wide.tasks) tasks[static_cast<size_t>(task.op)] += 1;
  for (size_t i = 0; i < wide.ops.size(); ++i) {
    if (wide.ops[i].op() == Op::kAddNormRouterLogits || wide.ops[i].op() == Op::kRouterLogits) {
      EXPECT_EQ(tasks[i], 64) << wide.ops[i].label;
    }
  }
}

// A decode plan compiled without a rule (bench decode --disable-rule) keeps that rule's left-hand side:
// without kda-gate-into-linear every KDA gate is its own op again; an unknown name is an error that
// names it and lists the rules.
TEST(FusedModels, DecodePlanWithoutARule) {
  const auto model = LoadedModel::describe((fs::path(PLOW_SOURCE_DIR) / "bench/configs/kimi-linear-48b-a3b.json").string());
  auto count = [](const Plan& plan, Op op) { return std::count_if(plan.ops.begin(), plan.ops.end(), [op](const PlanOp& o) { return o.op() == op; }); };
  auto fired = [](const Plan& plan, const char* rule) { return std::count(plan.compile.rules_fired.begin(), plan.compile.rules_fired.end(), rule); };
  const int64_t kda_layers = model->config.num_layers_of(MixerKind::kKda);
  const Plan with = compile_plan(*model, PlanPhase::kDecode, 1, 8, 64);
  EXPECT_EQ(count(with, Op::kKdaFusedCore), kda_layers);
  for (const PlanOp& op : with.ops) {  // the output norm inside: o_proj a plain linear of the normed heads
    if (op.op() == Op::kKdaFusedCore) {
      EXPECT_EQ(op.inputs.size(), 6u) << op.label;
    }
  }
  EXPECT_EQ(count(with, Op::kGatedNormLinear), 0);
  const Plan no_norm = compile_plan(*model, PlanPhase::kDecode, 1, 8, 64, true, PlanTuning{.disabled_rules = {"kda-core-gated-norm"}});
  EXPECT_EQ(count(no_norm, Op::kKdaFusedCore), kda_layers);
  EXPECT_EQ(count(no_norm, Op::kGatedNormLinear), kda_layers);
  EXPECT_EQ(count(with, Op::kKdaDeltaRule), 0);
  EXPECT_EQ(count(with, Op::kLinearKdaGate), 0);
  const Plan no_core = compile_plan(*model, PlanPhase::kDecode, 1, 8, 64, true, PlanTuning{.disabled_rules = {"kda-core-fuse"}});
  EXPECT_EQ(count(no_core, Op::kKdaFusedCore), 0);
  EXPECT_EQ(count(no_core, Op::kKdaDeltaRule), kda_layers);
  EXPECT_EQ(count(no_core, Op::kLinearKdaGate), kda_layers);
  EXPECT_EQ(count(no_core, Op::kGatedNormLinear), kda_layers);
  EXPECT_EQ(fired(no_core, "kda-core-fuse"), 0);
  const Plan without = compile_plan(*model, PlanPhase::kDecode, 1, 8, 64, true, PlanTuning{.disabled_rules = {"kda-core-fuse", "kda-gate-into-linear"}});
  EXPECT_EQ(count(without, Op::kLinearKdaGate), 0);
  EXPECT_EQ(count(without, Op::kKdaGate), kda_layers);
  EXPECT_EQ(fired(without, "kda-gate-into-linear"), 0);
  const Plan prefill = compile_plan(*model, PlanPhase::kPrefill, 64, 8, 64);  // the chunked delta rule, plain linears
  EXPECT_EQ(count(prefill, Op::kKdaFusedCore), 0);
  EXPECT_EQ(count(prefill, Op::kKdaDeltaRule), kda_layers);
  try {
    compile_plan(*model, PlanPhase::kDecode, 1, 8, 64, true, PlanTuning{.disabled_rules = {"kda-gate-into-linears"}});
    ADD_FAILURE() << "an unknown rule was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'kda-gate-into-linears' is not a compiler rule"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("kda-gate-into-linear,"), std::string::npos) << e.what();
  }
}

// The node order plans run in (compiler/schedule.h): on both deep graphs the shared expert's gate/up
// sits between every moe_topk and its first reader (48B: moved up from after the routed gate/up, the
// fusion order of moe_down_add; K3: moved down from before the router), and the scheduled graph
// holds the same nodes as the one in fusion order (EqualUnfusedOnEveryFixture compares its logits bit
// for bit).
TEST(Schedule, SharedExpertFillsTheTopKWait) {
  for (const char* name : {"kimi-linear-48b-a3b.json", "k3-tp8-rank.json"}) {
    const auto model = LoadedModel::describe((fs::path(PLOW_SOURCE_DIR) / "bench/configs" / name).string());
    CompileOptions in_fusion_order;
    in_fusion_order.schedule = false;
    const Graph scheduled = compile_graph(model->graph, {}).graph, plain = compile_graph(model->graph, in_fusion_order).graph;
    auto labels = [](const Graph& g) {
      std::multiset<std::string> all;
      for (const Node& node : g.nodes()) all.insert(std::string(op_name(node.op)) + " " + node.label);
      return all;
    };
    EXPECT_EQ(labels(scheduled), labels(plain)) << name;
    EXPECT_EQ(scheduled.node(scheduled.output()).label, plain.node(plain.output()).label) << name;
    const auto n = static_cast<int>(scheduled.nodes().size());
    int topks = 0, filled = 0, moved_in_plain = 0;
    for (const Graph* g : {&scheduled, &plain}) {
      for (int t = 0; t < n; ++t) {
        if (g->node(t).op != Op::kMoeTopK) continue;
        int reader = t + 1;
        while (reader < n && std::count(g->node(reader).inputs.begin(), g->node(reader).inputs.end(), t) == 0) ++reader;
        ASSERT_LT(reader, n) << name << ": " << g->node(t).label << " has no reader";
        bool shared_between = false;
        for (int z = t + 1; z < reader; ++z) shared_between = shared_between || g->node(z).label.find(".shared") != std::string::npos;
        if (g == &scheduled) {
          ++topks;
          filled += shared_between;
        } else {
          moved_in_plain += shared_between;
        }
      }
    }
    std::printf("%s: %d moe_topk, the shared expert before the routed experts after %d of them (%d in fusion order)\n", name, topks, filled, moved_in_plain);
    EXPECT_GT(topks, 0) << name;
    EXPECT_EQ(filled, topks) << name;
    EXPECT_EQ(moved_in_plain, 0) << name << ": fusion order already did it (the test would show nothing)";
  }
}

// ---- where decode plans put buffers and tasks (plan/lower.cpp) ---------------------------------------

// The decode plans of the two deep shapes at 132 workers, batch 1 and 4.
std::vector<Plan> deep_decode_plans() {
  std::vector<Plan> plans;
  for (const char* name : {"kimi-linear-48b-a3b.json", "k3-tp8-rank.json"}) {
    const auto model = LoadedModel::describe((fs::path(PLOW_SOURCE_DIR) / "bench/configs" / name).string());
    for (int64_t batch : {1, 4}) plans.push_back(compile_plan(*model, PlanPhase::kDecode, batch, 132, 0));
  }
  return plans;
}

// Every op an op's tasks wait for is one of its inputs' owners or done before one of them starts: a
// buffer never takes space whose reader is off the op's own path (first fit had the shared expert wait
// for the top-k, which had read the router's logits there: 23 such waits in 48B's plan, 46 in K3's).
TEST(DecodePlans, NoWaitForAnOpOffTheOpsPath) {
  for (const Plan& plan : deep_decode_plans()) {
    const size_t n = plan.ops.size();
    std::vector<std::set<int32_t>> signallers(n);
    for (const PlanTask& task : plan.tasks) {
      for (int32_t c : task.signals) signallers[static_cast<size_t>(c)].insert(task.op);
    }
    std::vector<std::vector<bool>> done(n, std::vector<bool>(n, false));  // done[i][j]: j finished whenever i starts
    int waits = 0, off_path = 0;
    for (size_t i = 0; i < n; ++i) {
      std::vector<bool> through_inputs(n, false);
      for (int32_t input : plan.ops[i].inputs) {
        const int32_t owner = activation_view(plan, input).owner;
        through_inputs[static_cast<size_t>(owner)] = true;
        for (size_t j = 0; j < n; ++j) through_inputs[j] = through_inputs[j] || done[static_cast<size_t>(owner)][j];
      }
      for (int32_t s : signallers[i]) {
        ++waits;
        if (!through_inputs[static_cast<size_t>(s)]) {
          ++off_path;
          ADD_FAILURE() << plan.ops[i].label << " (" << op_name(plan.ops[i].op()) << ") waits for " << plan.ops[static_cast<size_t>(s)].label << " ("
                        << op_name(plan.ops[static_cast<size_t>(s)].op()) << "), off its path";
        }
        done[i][static_cast<size_t>(s)] = true;
        for (size_t j = 0; j < n; ++j) done[i][j] = done[i][j] || done[static_cast<size_t>(s)][j];
      }
    }
    EXPECT_GT(waits, static_cast<int>(n));
    EXPECT_EQ(off_path, 0) << plan.max_tokens << " rows, " << n << " ops";
  }
}

// The ops between a top-k and its first reader (the shared expert, scheduled into its shadow) leave
// the top-k's worker alone: it goes on to the routed experts as soon as the top-k ends.
TEST(DecodePlans, ATopKsWorkerRunsNothingInItsShadow) {
  for (const Plan& plan : deep_decode_plans()) {
    std::vector<int32_t> worker_of(plan.tasks.size(), -1);
    for (size_t w = 0; w < plan.queues.size(); ++w) {
      for (int32_t t : plan.queues[w]) worker_of[static_cast<size_t>(t)] = static_cast<int32_t>(w);
    }
    std::vector<std::vector<int32_t>> tasks_of(plan.ops.size());
    for (size_t t = 0; t < plan.tasks.size(); ++t) tasks_of[static_cast<size_t>(plan.tasks[t].op)].push_back(static_cast<int32_t>(t));
    int topks = 0, shadowed = 0;
    for (size_t k = 0; k < plan.ops.size(); ++k) {
      if (plan.ops[k].op() != Op::kMoeTopK) continue;
      size_t reader = k + 1;
      while (reader < plan.ops.size() && std::count(plan.ops[reader].inputs.begin(), plan.ops[reader].inputs.end(), static_cast<int32_t>(k)) == 0) ++reader;
      ASSERT_LT(reader, plan.ops.size());
      std::set<int32_t> busy;
      for (int32_t t : tasks_of[k]) busy.insert(worker_of[static_cast<size_t>(t)]);
      ++topks;
      for (size_t j = k + 1; j < reader; ++j) {
        shadowed += !tasks_of[j].empty();
        for (int32_t t : tasks_of[j]) EXPECT_EQ(busy.count(worker_of[static_cast<size_t>(t)]), 0u) << plan.ops[j].label << " beside " << plan.ops[k].label;
      }
    }
    EXPECT_GT(topks, 0);
    EXPECT_GE(shadowed, topks);  // the shared expert is in every top-k's shadow (Schedule.SharedExpertFillsTheTopKWait)
  }
}

// A top-k's shadow tail (the shadow's last ops, those the routed gate/up does not read: the shared
// expert's down projection) runs on shadow_tail_workers workers of its own (here 8), beside the
// routed gate/up, which the others run (the top-k's worker among them); with shadow_tail_workers 0
// it runs in the shadow on every worker but the top-k's, before the routed gate/up. K3's shadows end
// in a light op (the shared expert's situ_mul) or in the latent down projection that the routed
// experts read: no tail, and the routed gate/up on every worker.
TEST(DecodePlans, AShadowTailRunsBesideTheRoutedExperts) {
  for (const auto& [name, expected_tails] : {std::pair{"kimi-linear-48b-a3b.json", 26}, std::pair{"k3-tp8-rank.json", 0}}) {
    const auto model = LoadedModel::describe((fs::path(PLOW_SOURCE_DIR) / "bench/configs" / name).string());
    for (int32_t tail_workers : {8, 0}) {
      for (int64_t batch : {1, 4}) {
        PlanTuning tuning;
        tuning.shadow_tail_workers = tail_workers;
        const Plan plan = compile_plan(*model, PlanPhase::kDecode, batch, 132, 0, true, tuning);
        std::vector<int32_t> worker_of(plan.tasks.size(), -1);
        for (size_t w = 0; w < plan.queues.size(); ++w) {
          for (int32_t t : plan.queues[w]) worker_of[static_cast<size_t>(t)] = static_cast<int32_t>(w);
        }
        std::vector<std::set<int32_t>> workers_of(plan.ops.size());
        for (size_t t = 0; t < plan.tasks.size(); ++t) workers_of[static_cast<size_t>(plan.tasks[t].op)].insert(worker_of[t]);
        const auto first_reader = [&](size_t op) {
          for (size_t r = op + 1; r < plan.ops.size(); ++r) {
            for (int32_t input : plan.ops[r].inputs) {
              if (activation_view(plan, input).owner == static_cast<int32_t>(op)) return r;
            }
          }
          return plan.ops.size();
        };
        int tails = 0;
        for (size_t k = 0; k < plan.ops.size(); ++k) {
          if (plan.ops[k].op() != Op::kMoeTopK) continue;
          const size_t routed = first_reader(k);
          ASSERT_LT(routed, plan.ops.size());
          ASSERT_EQ(plan.ops[routed].op(), Op::kMoeGateUp);
          if (expected_tails == 0) {
            EXPECT_EQ(workers_of[routed].size(), plan.queues.size()) << name << ": no tail, no worker set aside";
          }
          size_t tail_begin = routed;  // the shadow's last ops that stream weights and that nothing up to the routed gate/up reads
          while (tail_begin - 1 > k && (plan.ops[tail_begin - 1].is_view() || (!plan.ops[tail_begin - 1].weights.empty() && first_reader(tail_begin - 1) > routed))) {
            --tail_begin;
          }
          for (size_t j = tail_begin; j < routed; ++j) {
            if (plan.ops[j].is_view()) continue;
            ++tails;
            const std::string where = plan.ops[j].label + " beside " + plan.ops[routed].label + ", batch " + std::to_string(batch);
            EXPECT_EQ(workers_of[j].count(*workers_of[k].begin()), 0u) << where;  // never the top-k's worker
            std::set<int32_t> both;
            std::set_intersection(workers_of[j].begin(), workers_of[j].end(), workers_of[routed].begin(), workers_of[routed].end(),
                                  std::inserter(both, both.begin()));
            if (tail_workers > 0) {
              EXPECT_EQ(workers_of[j].size(), static_cast<size_t>(tail_workers)) << where;
              EXPECT_TRUE(both.empty()) << where << ": " << both.size() << " workers run both";
              EXPECT_EQ(workers_of[routed].size() + workers_of[j].size(), plan.queues.size()) << where;
              EXPECT_EQ(workers_of[routed].count(*workers_of[k].begin()), 1u) << where;  // the top-k's worker goes on to the routed experts
            } else {
              EXPECT_EQ(workers_of[j].size(), plan.queues.size() - 1) << where;
              EXPECT_EQ(both.size(), workers_of[j].size()) << where;
            }
          }
        }
        EXPECT_EQ(tails, expected_tails) << name << ", tail workers " << tail_workers << ", batch " << batch;  // 48B: the shared down projection of every MoE layer
      }
    }
  }
}

// A residual sum whose norm the input projections now read from its two terms runs just after them,
// not after the layer's attention: its few tasks then run beside the attention instead of delaying the
// router that reads it (48B: the KDA core's o_proj came before it on its workers).
TEST(DecodePlans, TheResidualSumFollowsTheProjectionsThatReadItsTerms) {
  const auto model = LoadedModel::describe((fs::path(PLOW_SOURCE_DIR) / "bench/configs/kimi-linear-48b-a3b.json").string());
  const Graph g = compile_graph(model->graph, {}).graph;
  int sums = 0;
  for (int i = 0; i + 1 < static_cast<int>(g.nodes().size()); ++i) {
    const Node& projections = g.node(i);
    if (projections.op != Op::kAddNormMultiLinear) continue;
    for (int j = 0; j < static_cast<int>(g.nodes().size()); ++j) {
      const Node& sum = g.node(j);
      if (sum.op != Op::kAdd || sum.inputs != projections.inputs) continue;
      ++sums;
      EXPECT_EQ(j, i + 1) << sum.label << " after " << projections.label;
    }
  }
  EXPECT_GE(sums, 20);  // the KDA and MLA layers after the first
}

// ---- serial-wait-fill on small hand-built graphs --------------------------------------------------

// A MoE layer over x = embedding(tokens), hidden 8, 4 experts of 8, top-2: router_logits(`router_in`),
// moe_topk, moe_gate_up(x, routes), moe_down; `before` adds nodes between x and the router (returns the
// node the router reads), `after` nodes between the gate/up and the down; the output sums the down
// projection with `tail`'s node. Labels name every node.
struct MoeLayer {
  Graph g;
  int tokens = 0, x = 0, logits = 0, topk = 0, up = 0, down = 0;
  int weight(const std::string& name, std::vector<int64_t> shape, int64_t parts = 1) {
    WeightDecl decl;
    decl.name = name;
    for (int64_t p = 0; p < parts; ++p) decl.parts.push_back(parts == 1 ? name : fmt::format("{}.{}", name, p));
    decl.shape = std::move(shape);
    return g.add_weight(std::move(decl));
  }
  int sigmoid(int input, const std::string& label) { return g.add(Op::kSigmoid, {input}, {}, {}, label); }
};

template <typename Before, typename After, typename Tail>
Graph moe_layer(Before before, After after, Tail tail) {
  MoeLayer m;
  m.tokens = m.g.add(Op::kTokens, {}, {}, {}, "tokens");
  m.x = m.g.add(Op::kEmbedding, {m.tokens}, {m.weight("embed", {50, 8})}, {}, "x");
  const int router_in = before(m);
  m.logits = m.g.add(Op::kRouterLogits, {router_in}, {m.weight("gate", {4, 8})}, {}, "logits");
  m.topk = m.g.add(Op::kMoeTopK, {m.logits}, {m.weight("bias", {4})},
                   {{"experts", 4}, {"top_k", 2}, {"groups", 1}, {"topk_groups", 1}, {"renormalize", 1}, {"scale", 1}, {"softmax", 0}}, "topk");
  const Attrs routing = {{"experts", 4}, {"top_k", 2}};
  m.up = m.g.add(Op::kMoeGateUp, {m.x, m.topk}, {m.weight("w1", {8, 8}, 4), m.weight("w3", {8, 8}, 4)}, routing, "up");
  after(m);
  m.down = m.g.add(Op::kMoeDown, {m.up, m.topk}, {m.weight("w2", {8, 8}, 4)}, routing, "down");
  m.g.set_output(m.g.add(Op::kAdd, {m.down, tail(m)}, {}, {}, "out"));
  m.g.verify();
  return m.g;
}

std::vector<std::string> node_labels(const Graph& g) {
  std::vector<std::string> labels;
  for (const Node& node : g.nodes()) labels.push_back(node.label);
  return labels;
}

// Before the top-k: a chain of two independent nodes both move after it (the first because its reader
// moves too). After its first reader: a chain of independent nodes moves before that reader (the
// 48B shared expert's gate/up, the view of its fused output, and its down projection), in its order,
// and so does "tail", which reads only nodes before the reader or moved.
TEST(Schedule, SinksChainsBeforeTheTopKAndHoistsChainsAfterIt) {
  int b = 0, d = 0;
  const Graph g = moe_layer(
      [&](MoeLayer& m) {
        b = m.sigmoid(m.sigmoid(m.x, "a"), "b");
        return m.x;
      },
      [&](MoeLayer& m) {
        const int view = m.g.add(Op::kSlice, {m.sigmoid(m.x, "c")}, {}, {{"offset", 0.0}, {"width", 8.0}}, "view");
        d = m.sigmoid(view, "d");
      },
      [&](MoeLayer& m) { return m.g.add(Op::kAdd, {b, d}, {}, {}, "tail"); });
  ASSERT_EQ(node_labels(g), (std::vector<std::string>{"tokens", "x", "a", "b", "logits", "topk", "up", "c", "view", "d", "down", "tail", "out"}));
  const Graph s = schedule_serial_waits(g);
  EXPECT_EQ(node_labels(s), (std::vector<std::string>{"tokens", "x", "logits", "topk", "a", "b", "c", "view", "d", "tail", "up", "down", "out"}));
  s.verify();
}

// The nodes the router reads (ancestors of the top-k) stay before it.
TEST(Schedule, KeepsTheTopKsAncestors) {
  const Graph g = moe_layer([](MoeLayer& m) { return m.sigmoid(m.sigmoid(m.x, "a"), "b"); }, [](MoeLayer&) {}, [](MoeLayer& m) { return m.x; });
  EXPECT_EQ(node_labels(schedule_serial_waits(g)), node_labels(g));
}

// Nodes further than kSerialFillWindow before the top-k stay where they are, even when they could fill
// its wait; at the graph's start the window is cut at node 0 (the test above).
TEST(Schedule, LooksOnlyInsideTheWindow) {
  int far = 0;
  const Graph g = moe_layer(
      [&](MoeLayer& m) {
        far = m.sigmoid(m.x, "far");
        int chain = m.x;
        for (int i = 0; i < kSerialFillWindow + 2; ++i) chain = m.sigmoid(chain, fmt::format("r{}", i));
        return chain;
      },
      [](MoeLayer&) {}, [&](MoeLayer&) { return far; });
  const Graph s = schedule_serial_waits(g);
  EXPECT_EQ(node_labels(s), node_labels(g));
}

// A top-k that is the graph's output (no reader): nothing to hoist, and nothing fails.
TEST(Schedule, TopKWithoutReaderIsLeftAlone) {
  MoeLayer m;
  m.tokens = m.g.add(Op::kTokens, {}, {}, {}, "tokens");
  m.x = m.g.add(Op::kEmbedding, {m.tokens}, {m.weight("embed", {50, 8})}, {}, "x");
  m.logits = m.g.add(Op::kRouterLogits, {m.x}, {m.weight("gate", {4, 8})}, {}, "logits");
  m.topk = m.g.add(Op::kMoeTopK, {m.logits}, {m.weight("bias", {4})},
                   {{"experts", 4}, {"top_k", 2}, {"groups", 1}, {"topk_groups", 1}, {"renormalize", 1}, {"scale", 1}, {"softmax", 0}}, "topk");
  m.g.set_output(m.topk);
  m.g.verify();
  EXPECT_EQ(node_labels(schedule_serial_waits(m.g)), node_labels(m.g));
}

}  // namespace
}  // namespace plow
