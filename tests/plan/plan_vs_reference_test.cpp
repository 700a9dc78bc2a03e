// Plan vs reference (correctness gate 3): the plan interpreter against cpu/reference on every fixture
// with an oracle.json, at 1, 2 and 7 workers — greedy tokens identical and logits bit-identical
// (kernels run on column slices are the same arithmetic). Also split prefill through prefill plans,
// several sequences of mixed lengths in one step against each sequence run alone, and K3 ops on
// random weights.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "engine/generate.h"
#include "plan_test_util.h"

namespace plow::plan_test {
namespace {

struct PlanRun {
  std::string fixture, case_name, dtype;
  int workers = 1;
  int64_t chunk = 0;  // 0: whole prompt in one prefill step
  std::string label() const {
    std::string text = fixture + "_" + case_name + "_" + dtype + "_w" + std::to_string(workers) + (chunk ? "_chunk" + std::to_string(chunk) : "");
    for (char& ch : text) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
    return text;
  }
};

const json& find_case(const std::string& fixture, const std::string& name) {
  static std::map<std::string, json> manifests;
  json& m = manifests[fixture];
  if (m.is_null()) m = manifest(fixture);
  for (const json& c : m.at("cases")) {
    if (c.at("name") == name) return c;
  }
  throw std::runtime_error("no case " + name);
}

std::vector<PlanRun> all_runs() {
  std::vector<PlanRun> runs;
  for (const std::string& fixture : oracle_fixtures()) {
    const json cases = manifest(fixture).at("cases");  // a copy: the manifest is a temporary
    for (const json& c : cases) {
      for (const auto& [dtype, unused] : c.at("runs").items()) {
        for (int workers : {1, 2, 7}) runs.push_back({fixture, c.at("name"), dtype, workers, 0});
        if (c.at("prompt_ids").size() > 33) runs.push_back({fixture, c.at("name"), dtype, 3, 33});  // split prefill
      }
    }
  }
  return runs;
}

// Forwards to the interpreter and records which phase of plan ran each step.
class Recording : public Backend {
 public:
  explicit Recording(PlanInterpreter& inner) : inner_(inner) {}
  StepOutput step(const StepInputs& inputs) override {
    StepOutput out = inner_.step(inputs);
    const Plan& plan = inner_.plan(inner_.last_plan());
    steps.push_back({plan.phase, plan.max_tokens, static_cast<int64_t>(inputs.token_ids.size())});
    return out;
  }
  void reset_slot(int slot) override { inner_.reset_slot(slot); }
  int64_t context_tokens(int slot) const override { return inner_.context_tokens(slot); }
  int num_slots() const override { return inner_.num_slots(); }
  DType act_dtype() const override { return inner_.act_dtype(); }

  struct Step {
    PlanPhase phase;
    int64_t bucket, tokens;
  };
  std::vector<Step> steps;

 private:
  PlanInterpreter& inner_;
};

GenerateOptions options_for(const PlanRun& run) {
  const json& c = find_case(run.fixture, run.case_name);
  GenerateOptions options;
  options.prompt = c.at("prompt_ids").get<std::vector<int32_t>>();
  options.max_new_tokens = static_cast<int64_t>(c.at("runs").at(run.dtype).at("greedy_ids").size());
  options.prefill_chunk_tokens = run.chunk;
  options.keep_logits = true;
  return options;
}

DType act_of(const std::string& dtype) { return dtype == "float32" ? DType::F32 : DType::BF16; }

const GenerateResult& reference_result(const PlanRun& run) {
  static std::map<std::string, GenerateResult> cache;
  const std::string key = run.fixture + "/" + run.case_name + "/" + run.dtype + "/" + std::to_string(run.chunk);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const LoadedModel& model = fixture_model(run.fixture);
  ReferenceBackend reference(model.graph, *model.weights, act_of(run.dtype), 1);
  return cache[key] = generate(reference, 0, options_for(run));
}

class PlanVsReference : public ::testing::TestWithParam<PlanRun> {};

TEST_P(PlanVsReference, GreedyTokensAndLogitsAreBitIdentical) {
  const PlanRun& run = GetParam();
  const LoadedModel& model = fixture_model(run.fixture);
  const GenerateOptions options = options_for(run);
  const auto prompt = static_cast<int64_t>(options.prompt.size());
  const int64_t chunk = run.chunk ? run.chunk : prompt;
  std::vector<Plan> plans;
  plans.push_back(make_plan(model, PlanPhase::kDecode, 1, run.workers));
  if (chunk > 1) plans.push_back(make_plan(model, PlanPhase::kPrefill, chunk, run.workers));
  auto interpreter = make_interpreter(model, std::move(plans), run.workers, act_of(run.dtype), 1, prompt + options.max_new_tokens);
  Recording recording(*interpreter);
  const GenerateResult ours = [&] {
    Watchdog watchdog(std::chrono::seconds(120), run.label());
    return generate(recording, 0, options);
  }();
  const GenerateResult& expected = reference_result(run);

  const float diff = max_abs_diff(ours.logits, expected.logits);
  std::printf("%s: max |plan − reference| = %g over %zu logits, %zu steps\n", run.label().c_str(), diff, ours.logits.size(), recording.steps.size());
  EXPECT_EQ(ours.generated, expected.generated);
  EXPECT_LE(diff, 1e-4f);
  EXPECT_EQ(diff, 0.0f) << "column slices of deterministic kernels must reproduce the reference bit for bit";
  // Prompt steps of more than one token ran on prefill plans, single-token steps on the decode plan.
  for (const auto& step : recording.steps) {
    EXPECT_EQ(step.phase, step.tokens > 1 ? PlanPhase::kPrefill : PlanPhase::kDecode);
    EXPECT_LE(step.tokens, step.bucket);
  }
  if (run.chunk) {
    EXPECT_EQ(std::count_if(recording.steps.begin(), recording.steps.end(), [](const auto& s) { return s.phase == PlanPhase::kPrefill; }),
              (prompt + run.chunk - 1) / run.chunk);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PlanVsReference, ::testing::ValuesIn(all_runs()),
                         [](const ::testing::TestParamInfo<PlanRun>& param) { return param.param.label(); });

TEST(PlanFixtures, ArePresent) {
  std::set<std::string> fixtures;
  for (const PlanRun& run : all_runs()) fixtures.insert(run.fixture);
  EXPECT_GE(fixtures.size(), 4u);
  EXPECT_GE(all_runs().size(), 36u);
}

// Per sequence: the tokens each step fed it and the logits row it got back.
struct Trace {
  std::vector<std::vector<int32_t>> fed;
  std::vector<std::vector<float>> logits;
};

// Several sequences per step, of mixed lengths, in one plan step (prefill and mixed batches on prefill
// plans, decode batches on a decode bucket) — each must match that sequence run alone on the reference.
void check_batch(const std::string& fixture, int workers) {
  const LoadedModel& model = fixture_model(fixture);
  const auto prompt = find_case(fixture, "len80").at("prompt_ids").get<std::vector<int32_t>>();
  const int64_t vocab = model.config.vocab_size;
  std::vector<Plan> plans;
  for (int64_t bucket : {1, 2, 4}) plans.push_back(make_plan(model, PlanPhase::kDecode, bucket, workers));
  plans.push_back(make_plan(model, PlanPhase::kPrefill, 32, workers));
  std::vector<Plan> copies = plans;
  auto interpreter = make_interpreter(model, std::move(plans), workers, DType::F32, 4, 64);
  // The same steps asking for ids only (StepInputs::argmax_only): each row's argmax, no logits.
  auto ids_interpreter = make_interpreter(model, std::move(copies), workers, DType::F32, 4, 64);
  Watchdog watchdog(std::chrono::seconds(120), "batch " + fixture);

  std::vector<Trace> traces(4);
  auto run_step = [&](const std::vector<std::pair<int, std::vector<int32_t>>>& parts, int64_t expect_bucket) {
    StepInputs step;
    for (const auto& [slot, tokens] : parts) {
      step.token_ids.insert(step.token_ids.end(), tokens.begin(), tokens.end());
      step.sequences.push_back({slot, static_cast<int64_t>(tokens.size())});
    }
    const StepOutput out = interpreter->step(step);
    EXPECT_EQ(interpreter->plan(interpreter->last_plan()).max_tokens, expect_bucket);
    step.argmax_only = true;
    const StepOutput ids = ids_interpreter->step(step);
    EXPECT_TRUE(ids.logits.empty());
    ASSERT_EQ(ids.argmax.size(), parts.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      Trace& trace = traces[static_cast<size_t>(parts[i].first)];
      trace.fed.push_back(parts[i].second);
      trace.logits.emplace_back(out.logits.begin() + static_cast<int64_t>(i) * vocab, out.logits.begin() + static_cast<int64_t>(i + 1) * vocab);
      EXPECT_EQ(ids.argmax[i], argmax(trace.logits.back())) << fixture << ": step row " << i;
    }
  };
  auto next = [&](int slot) { return std::vector<int32_t>{argmax(traces[static_cast<size_t>(slot)].logits.back())}; };
  auto slice = [&](size_t begin, size_t count) { return std::vector<int32_t>(prompt.begin() + static_cast<int64_t>(begin), prompt.begin() + static_cast<int64_t>(begin + count)); };

  run_step({{0, slice(0, 5)}, {1, slice(5, 1)}, {2, slice(10, 12)}}, 32);       // prefill of three lengths
  for (int n = 0; n < 3; ++n) run_step({{0, next(0)}, {1, next(1)}, {2, next(2)}}, 4);  // decode batch of 3
  run_step({{1, next(1)}, {3, slice(30, 7)}, {0, next(0)}}, 32);                // mixed: a prefill among decodes
  for (int n = 0; n < 2; ++n) run_step({{3, next(3)}, {2, next(2)}}, 2);        // decode batch of 2
  run_step({{0, next(0)}}, 1);

  for (int slot = 0; slot < 4; ++slot) {
    ReferenceBackend alone(model.graph, *model.weights, DType::F32, 1);
    const Trace& trace = traces[static_cast<size_t>(slot)];
    for (size_t s = 0; s < trace.fed.size(); ++s) {
      StepInputs step;
      step.token_ids = trace.fed[s];
      step.sequences = {{0, static_cast<int64_t>(trace.fed[s].size())}};
      const StepOutput out = alone.step(step);
      EXPECT_EQ(max_abs_diff(out.logits, trace.logits[s]), 0.0f) << fixture << ": slot " << slot << " step " << s;
    }
    EXPECT_EQ(interpreter->context_tokens(slot), alone.context_tokens(0));
  }
}

TEST(PlanBatch, MixedLengthsMatchEachSequenceAlone) {
  for (const std::string& fixture : oracle_fixtures()) {
    check_batch(fixture, 3);
    check_batch(fixture, 1);
  }
}

// K3 ops (AttnRes over many inputs, gated MLA, SiTU, LatentMoE, MXFP4 experts) on other weights than
// the fixture's: random bf16 weights and bf16 activations, prefill split in chunks of 5.
TEST(PlanK3, RandomWeightsMatchReference) {
  const fs::path config = fs::path(PLOW_TEST_DATA) / "tiny-k3" / "config.json";
  ASSERT_TRUE(fs::exists(config));
  const auto model = LoadedModel::random(config.string(), 7, DType::BF16);
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43};
  GenerateOptions options;
  options.prompt = prompt;
  options.max_new_tokens = 12;
  options.keep_logits = true;
  options.prefill_chunk_tokens = 5;
  ReferenceBackend reference(model->graph, *model->weights, DType::BF16, 1);
  const GenerateResult expected = generate(reference, 0, options);
  for (int workers : {2, 5}) {
    for (bool fuse : {true, false}) {  // the compiled graph, and the graph as built
      std::vector<Plan> plans = {make_plan(*model, PlanPhase::kDecode, 1, workers, fuse),
                                 make_plan(*model, PlanPhase::kPrefill, 5, workers, fuse)};
      auto interpreter = make_interpreter(*model, std::move(plans), workers, DType::BF16, 1, 32);
      Watchdog watchdog(std::chrono::seconds(120), "k3");
      const GenerateResult ours = generate(*interpreter, 0, options);
      EXPECT_EQ(ours.generated, expected.generated);
      EXPECT_EQ(max_abs_diff(ours.logits, expected.logits), 0.0f) << workers << " workers, fused " << fuse;
    }
  }
}

}  // namespace
}  // namespace plow::plan_test
