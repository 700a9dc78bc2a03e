// Tensor parallelism on the CPU with simulated ranks (issue F, DESIGN.md §5): every fixture split over
// two ranks (threads joined by a LocalGroup) against the oracle (HF transformers, or the K3 PyTorch
// reference) with the oracle test's own bounds; the plan interpreter's ranks bit-identical to the
// reference's ranks; per-rank plans validated and bound to their rank; a failing rank aborts the
// group instead of hanging it; snapshots through the group restore bit-identical state.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include <unistd.h>

#include "core/npy.h"
#include "engine/generate.h"
#include "engine/tensor_parallel.h"
#include "plan/validate.h"
#include "../oracle/logit_compare.h"
#include "plan_test_util.h"

namespace plow::plan_test {
namespace {

std::string fixture_dir(const std::string& fixture) { return (fs::path(PLOW_TEST_DATA) / fixture).string(); }

DType act_of(const std::string& dtype) { return dtype == "float32" ? DType::F32 : DType::BF16; }

// `size` ranks of `fixture` on the reference backend, or on plan interpreters of `workers` threads
// (workers = 0), with a decode plan and a prefill plan of `chunk` tokens.
std::unique_ptr<TensorParallelBackend> tp_backend(const std::string& fixture, int size, DType act, int workers = 0, int64_t chunk = 128,
                                                  int slots = 1, int64_t max_context = 256) {
  return make_local_tp_backend(
      size, [&](TpShard shard) { return LoadedModel::load(fixture_dir(fixture), shard); },
      [&](const LoadedModel& model, Collective& collective) -> std::unique_ptr<Backend> {
        if (workers == 0) return std::make_unique<ReferenceBackend>(model.graph, *model.weights, act, slots, &collective);
        std::vector<Plan> plans = {make_plan(model, PlanPhase::kDecode, slots, workers), make_plan(model, PlanPhase::kPrefill, chunk, workers)};
        return make_plan_interpreter(model, std::move(plans), workers, act, slots, max_context, &collective);
      });
}

struct TpRun {
  std::string fixture, case_name, dtype;
  std::string label() const {
    std::string text = fixture + "_" + case_name + "_" + dtype;
    for (char& ch : text) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
    return text;
  }
};

// tiny-k3's MXFP4 experts are 32 columns wide, one MXFP4 block: they cannot be split (see
// TensorParallel.Mxfp4ExpertsSplitInWholeBlocksOnly); its K3 features are covered by the bundled
// model and by K3RanksMatchOneRank below.
bool splits_in_two(const std::string& fixture) { return fixture != "tiny-k3"; }

std::vector<TpRun> all_runs() {
  std::vector<TpRun> runs;
  for (const std::string& fixture : oracle_fixtures()) {
    if (!splits_in_two(fixture)) continue;
    const json cases = manifest(fixture).at("cases");
    for (const json& c : cases) {
      for (const auto& [dtype, unused] : c.at("runs").items()) runs.push_back({fixture, c.at("name"), dtype});
    }
  }
  return runs;
}

using test::Comparison;
using test::compare;

class TensorParallelVsOracle : public ::testing::TestWithParam<TpRun> {};

// Two ranks against the oracle with the bounds of oracle_test.cpp: fp32 within 1e-3 of the oracle's
// logits and HF's greedy tokens exactly; bf16 about as close to HF-fp32 as HF-bf16 is. Then the same
// split on plan interpreters must reproduce the reference ranks bit for bit.
TEST_P(TensorParallelVsOracle, TwoRanksMatchTheOracleAndPlansMatchTheRanks) {
  const TpRun& run = GetParam();
  json c;
  const json cases = manifest(run.fixture).at("cases");
  for (const json& each : cases) {
    if (each.at("name") == run.case_name) c = each;
  }
  const json& expected = c.at("runs").at(run.dtype);
  const DType act = act_of(run.dtype);
  const int64_t vocab = fixture_model(run.fixture).config.vocab_size;
  GenerateOptions options;
  options.prompt = c.at("prompt_ids").get<std::vector<int32_t>>();
  const auto greedy = expected.at("greedy_ids").get<std::vector<int32_t>>();
  options.max_new_tokens = static_cast<int64_t>(greedy.size());
  const auto rows = static_cast<int64_t>(options.prompt.size() + greedy.size()) - 1;
  GenerateOptions forced = options;
  forced.keep_logits = true;
  forced.forced_tokens = greedy;

  Watchdog watchdog(std::chrono::seconds(300), run.label());
  auto ranks = tp_backend(run.fixture, 2, act);
  const GenerateResult teacher = generate(*ranks, 0, forced);
  ASSERT_EQ(teacher.logits.size(), static_cast<size_t>(rows * vocab));
  const NpyArray oracle = read_npy_f32((fs::path(PLOW_TEST_DATA) / run.fixture / expected.at("logits").get<std::string>()).string());
  const Comparison vs_oracle = compare(teacher.logits, oracle.data, vocab);
  std::printf("%s: tp2 max |plow − oracle| = %.3g, median row max %.3g, argmax agreement %.3f\n", run.label().c_str(), vs_oracle.max_abs,
              vs_oracle.median_row_max, vs_oracle.argmax_agreement);
  if (act == DType::F32) {
    EXPECT_LE(vs_oracle.max_abs, 1e-3f);
    EXPECT_EQ(generate(*ranks, 0, options).generated, greedy);
  } else {
    const NpyArray f32 = read_npy_f32((fs::path(PLOW_TEST_DATA) / run.fixture / c.at("runs").at("float32").at("logits").get<std::string>()).string());
    const Comparison ours = compare(teacher.logits, f32.data, vocab), theirs = compare(oracle.data, f32.data, vocab);
    std::printf("    vs HF fp32: tp2-bf16 median row max %.3g (argmax %.3f); HF-bf16 %.3g (argmax %.3f)\n", ours.median_row_max,
                ours.argmax_agreement, theirs.median_row_max, theirs.argmax_agreement);
    EXPECT_LE(ours.median_row_max, 1.5f * theirs.median_row_max);
    EXPECT_GE(ours.argmax_agreement, theirs.argmax_agreement - 0.1f - 1.0f / static_cast<float>(rows));
  }

  // The plan interpreter on each rank (fused plans, 2 workers, a prefill plan smaller than the prompt).
  auto planned = tp_backend(run.fixture, 2, act, 2, 33);
  const GenerateResult on_plans = generate(*planned, 0, [&] {
    GenerateOptions o = forced;
    o.prefill_chunk_tokens = 33;
    return o;
  }());
  const GenerateResult chunked = generate(*ranks, 0, [&] {
    GenerateOptions o = forced;
    o.prefill_chunk_tokens = 33;
    return o;
  }());
  EXPECT_EQ(max_abs_diff(on_plans.logits, chunked.logits), 0.0f) << "plans on each rank must reproduce the reference ranks bit for bit";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallelVsOracle, ::testing::ValuesIn(all_runs()),
                         [](const ::testing::TestParamInfo<TpRun>& param) { return param.param.label(); });

TEST(TensorParallel, EveryFixtureRuns) {
  std::set<std::string> fixtures;
  for (const TpRun& run : all_runs()) fixtures.insert(run.fixture);
  EXPECT_GE(fixtures.size(), 4u);
}

TEST(TensorParallel, Mxfp4ExpertsSplitInWholeBlocksOnly) {
  try {
    LoadedModel::load(fixture_dir("tiny-k3"), {0, 2});
    FAIL() << "32-column MXFP4 experts split in two";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("moe_intermediate_size = 32 does not divide among 2 tensor-parallel ranks in blocks of 32"),
              std::string::npos)
        << e.what();
  }
}

// The bundled K3 model (MXFP4 experts split by columns, AttnRes, gated MLA, SiTU) on two ranks: its
// reference greedy continuations (tests/data/bundled-model/reference.json) token for token, on the
// reference ranks and on plan ranks.
TEST(TensorParallel, BundledModelGreedyContinuationsOnTwoRanks) {
  const fs::path root = fs::path(PLOW_TEST_DATA).parent_path().parent_path();
  std::ifstream in(fs::path(PLOW_TEST_DATA) / "bundled-model" / "reference.json");
  const json reference = json::parse(in);
  const std::string dir = (root / reference.at("model_dir").get<std::string>()).string();
  Watchdog watchdog(std::chrono::seconds(300), "bundled model tp2");
  for (int workers : {0, 2}) {
    auto backend = make_local_tp_backend(
        2, [&](TpShard shard) { return LoadedModel::load(dir, shard); },
        [&](const LoadedModel& model, Collective& collective) -> std::unique_ptr<Backend> {
          if (workers == 0) return std::make_unique<ReferenceBackend>(model.graph, *model.weights, DType::F32, 1, &collective);
          std::vector<Plan> plans = {make_plan(model, PlanPhase::kDecode, 1, workers), make_plan(model, PlanPhase::kPrefill, 16, workers)};
          return make_plan_interpreter(model, std::move(plans), workers, DType::F32, 1, 128, &collective);
        });
    for (const json& g : reference.at("greedy")) {
      GenerateOptions options;
      options.prompt = g.at("prompt_ids").get<std::vector<int32_t>>();
      const auto expected = g.at("greedy_ids").get<std::vector<int32_t>>();
      options.max_new_tokens = static_cast<int64_t>(expected.size());
      options.prefill_chunk_tokens = workers ? 16 : 0;
      EXPECT_EQ(generate(*backend, 0, options).generated, expected) << g.at("prompt") << (workers ? " on plans" : " on the reference");
    }
  }
}

// A K3 shape with LatentMoE (its routed path reduced apart from the shared experts), drawn at random
// without MXFP4 so 64 expert columns split in two: two and four ranks against one.
TEST(TensorParallel, K3RanksMatchOneRank) {
  std::ifstream in(fs::path(PLOW_TEST_DATA) / "tiny-k3" / "config.json");
  json config = json::parse(in);
  config.erase("quantization_config");
  config["text_config"]["moe_intermediate_size"] = 64;
  config["text_config"]["num_attention_heads"] = 4;
  config["text_config"]["num_key_value_heads"] = 4;
  config["text_config"]["linear_attn_config"]["num_heads"] = 4;
  const fs::path dir = fs::temp_directory_path() / ("plow-tp-k3-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "config.json").string();
  std::ofstream(path) << config.dump(1);
  auto whole = LoadedModel::random(path, 7, DType::F32);
  ASSERT_TRUE(whole->config.latent_moe_size.has_value());
  ReferenceBackend one(whole->graph, *whole->weights, DType::F32, 1);
  GenerateOptions options;
  options.prompt = {3, 17, 99, 4, 250, 31, 8, 8, 120};
  options.max_new_tokens = 12;
  options.keep_logits = true;
  const GenerateResult expected = generate(one, 0, options);
  for (int size : {2, 4}) {
    auto ranks = make_local_tp_backend(
        size, [&](TpShard shard) { return LoadedModel::random(path, 7, DType::F32, shard); },
        [](const LoadedModel& model, Collective& collective) -> std::unique_ptr<Backend> {
          return std::make_unique<ReferenceBackend>(model.graph, *model.weights, DType::F32, 1, &collective);
        });
    const GenerateResult got = generate(*ranks, 0, options);
    EXPECT_EQ(got.generated, expected.generated) << size << " ranks";
    EXPECT_LE(max_abs_diff(got.logits, expected.logits), 1e-4f) << size << " ranks";
  }
  fs::remove_all(dir);
}

// The split itself: half the heads and intermediate columns per rank, one all_reduce per sublayer
// (two in a LatentMoE layer with shared experts), the vocabulary halved, the partial weights blocks
// of the checkpoint's tensors.
TEST(TensorParallel, RankGraphsSplitTheModel) {
  for (const std::string& fixture : oracle_fixtures()) {
    if (!splits_in_two(fixture)) continue;
    SCOPED_TRACE(fixture);
    const LoadedModel& whole = fixture_model(fixture);
    for (int r = 0; r < 2; ++r) {
      auto rank = LoadedModel::load(fixture_dir(fixture), {r, 2});
      const ModelConfig& c = rank->config;
      int reduces = 0;
      for (const Node& node : rank->graph.nodes()) reduces += node.op == Op::kAllReduce;
      const int64_t latent_shared = c.latent_moe_size && c.num_shared_experts > 0
                                        ? std::count(c.ffns.begin(), c.ffns.end(), FfnKind::kMoe)
                                        : 0;
      EXPECT_EQ(reduces, 2 * c.num_layers + latent_shared);
      EXPECT_EQ(rank->graph.node(rank->graph.output()).width, c.vocab_size / 2);
      int64_t rank_floats = 0, whole_floats = 0;
      for (const WeightDecl& d : rank->graph.weights()) rank_floats += std::accumulate(d.shape.begin(), d.shape.end(), int64_t{1}, std::multiplies<>()) * static_cast<int64_t>(d.parts.size());
      for (const WeightDecl& d : whole.graph.weights()) whole_floats += std::accumulate(d.shape.begin(), d.shape.end(), int64_t{1}, std::multiplies<>()) * static_cast<int64_t>(d.parts.size());
      EXPECT_LT(rank_floats, whole_floats * 3 / 4) << "most weights are split";
      // A column block of o_proj is the checkpoint's columns [r·n, (r+1)·n) of every row.
      for (int w = 0; w < static_cast<int>(rank->graph.weights().size()); ++w) {
        const WeightDecl& d = rank->graph.weights()[static_cast<size_t>(w)];
        if (d.shard_axis != 1 || d.mxfp4 || d.parts.size() != 1) continue;
        const TensorView& block = *(*rank->weights)[w].parts[0];
        const auto& decls = whole.graph.weights();
        const auto it = std::find_if(decls.begin(), decls.end(), [&](const WeightDecl& e) { return e.name == d.name; });
        ASSERT_NE(it, decls.end()) << d.name;
        const TensorView& full = *(*whole.weights)[static_cast<int>(it - decls.begin())].parts[0];
        const int64_t cols = d.shape[1];
        for (int64_t row : {int64_t{0}, d.shape[0] - 1}) {
          for (int64_t col : {int64_t{0}, cols - 1}) {
            ASSERT_EQ(block.at(static_cast<size_t>(row * cols + col)), full.at(static_cast<size_t>(row * cols * 2 + r * cols + col))) << d.name;
          }
        }
      }
    }
  }
}

// Each rank's plans validate and carry their rank's fingerprint: a plan compiled for rank 0 does not
// load on rank 1, nor on the unsplit model.
TEST(TensorParallel, PlansArePerRank) {
  const std::string fixture = "tiny-kimi-linear";
  auto r0 = LoadedModel::load(fixture_dir(fixture), {0, 2});
  auto r1 = LoadedModel::load(fixture_dir(fixture), {1, 2});
  const Plan plan = make_plan(*r0, PlanPhase::kDecode, 2, 3);
  validate_plan(plan, [](uint8_t opcode) { return PlanInterpreter::has_op(opcode); });
  EXPECT_TRUE(std::any_of(plan.ops.begin(), plan.ops.end(), [](const PlanOp& op) { return op.op() == Op::kAllReduce; }));
  EXPECT_NE(fingerprint_of(*r0), fingerprint_of(*r1));
  EXPECT_THROW(make_plan_interpreter(*r1, {plan}, 3, DType::F32, 1, 64), Error);
  EXPECT_THROW(make_plan_interpreter(fixture_model(fixture), {plan}, 3, DType::F32, 1, 64), Error);
}

TEST(TensorParallel, DegreesThatDoNotDivideAreRefusedByName) {
  try {
    LoadedModel::load(fixture_dir("tiny-kimi-linear"), {0, 3});
    FAIL() << "3 ranks of 2 heads loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not divide among 3 tensor-parallel ranks"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
  }
  EXPECT_THROW(LoadedModel::load(fixture_dir("tiny-kimi-linear"), {2, 2}), Error);
}

// A rank whose step fails while the other waits in an all_reduce: the step fails on the caller, no
// rank hangs, and after resetting the slot the group runs again.
class FailingOnce : public Backend {
 public:
  explicit FailingOnce(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  StepOutput step(const StepInputs& inputs) override {
    if (fail_next) {
      fail_next = false;
      fail("rank 1: injected failure");
    }
    return inner_->step(inputs);
  }
  void reset_slot(int slot) override { inner_->reset_slot(slot); }
  int64_t context_tokens(int slot) const override { return inner_->context_tokens(slot); }
  int num_slots() const override { return inner_->num_slots(); }
  DType act_dtype() const override { return inner_->act_dtype(); }
  bool fail_next = true;

 private:
  std::unique_ptr<Backend> inner_;
};

TEST(TensorParallel, AFailingRankAbortsTheGroupInsteadOfHangingIt) {
  Watchdog watchdog(std::chrono::seconds(60), "failing rank");
  FailingOnce* failing = nullptr;
  auto backend = make_local_tp_backend(
      2, [](TpShard shard) { return LoadedModel::load(fixture_dir("tiny-kimi-linear"), shard); },
      [&](const LoadedModel& model, Collective& collective) -> std::unique_ptr<Backend> {
        auto inner = std::make_unique<ReferenceBackend>(model.graph, *model.weights, DType::F32, 1, &collective);
        if (collective.rank() == 0) return inner;
        auto wrapped = std::make_unique<FailingOnce>(std::move(inner));
        failing = wrapped.get();
        return wrapped;
      });
  StepInputs step;
  step.token_ids = {1, 2, 3};
  step.sequences = {{0, 3}};
  EXPECT_THROW(backend->step(step), Error);
  ASSERT_FALSE(failing->fail_next);
  backend->reset_slot(0);
  const StepOutput out = backend->step(step);
  ReferenceBackend whole(fixture_model("tiny-kimi-linear").graph, *fixture_model("tiny-kimi-linear").weights, DType::F32, 1);
  EXPECT_LE(max_abs_diff(out.logits, whole.step(step).logits), 1e-4f);
}

// Prefix caching through the group: a snapshot after a prompt, restored into another slot, continues
// with the logits of the slot that never stopped.
TEST(TensorParallel, SnapshotsRestoreEveryRanksState) {
  auto backend = tp_backend("tiny-kimi-linear-tied-qlora", 2, DType::F32, 2, 16, 2, 64);
  ASSERT_TRUE(backend->has_snapshots());
  StepInputs prompt;
  prompt.token_ids = {5, 9, 11, 3, 7, 2, 8};
  prompt.sequences = {{0, 7}};
  backend->step(prompt);
  const SlotSnapshot snap = backend->save_slot(0, 0);
  backend->restore_slot(1, snap);
  StepInputs next;
  next.token_ids = {4, 4};
  next.sequences = {{0, 1}, {1, 1}};
  const StepOutput out = backend->step(next);
  const auto vocab = out.vocab;
  const std::vector<float> a(out.logits.begin(), out.logits.begin() + vocab), b(out.logits.begin() + vocab, out.logits.end());
  EXPECT_EQ(max_abs_diff(a, b), 0.0f);
  SlotSnapshot wrong = snap;
  wrong.fixed.pop_back();
  EXPECT_THROW(backend->restore_slot(1, wrong), Error);
}

}  // namespace
}  // namespace plow::plan_test
