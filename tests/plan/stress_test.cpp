// The counter protocol under stress: random delays before every task on every worker, hundreds of
// steps (epochs), more workers than cores, kernel exceptions in the middle of a step — no divergence
// from the reference, no hang (a watchdog turns a hang into a failure), errors reach the caller.
#include <gtest/gtest.h>

#include "core/error.h"
#include "engine/generate.h"
#include "plan_test_util.h"

namespace plow::plan_test {
namespace {

constexpr const char* kFixture = "tiny-kimi-linear";

std::vector<int32_t> prompt_of(const std::string& fixture, const std::string& name) {
  const json cases = manifest(fixture).at("cases");  // a copy: the manifest is a temporary
  for (const json& c : cases) {
    if (c.at("name") == name) return c.at("prompt_ids").get<std::vector<int32_t>>();
  }
  throw std::runtime_error("no case " + name);
}

std::vector<Plan> decode_and_prefill(const LoadedModel& model, int workers, int64_t chunk) {
  std::vector<Plan> plans;
  plans.push_back(make_plan(model, PlanPhase::kDecode, 1, workers));
  plans.push_back(make_plan(model, PlanPhase::kDecode, 4, workers));
  plans.push_back(make_plan(model, PlanPhase::kPrefill, chunk, workers));
  return plans;
}

struct StressCase {
  int workers;
  int64_t delay_us;
  uint64_t seed;
};

class Stress : public ::testing::TestWithParam<StressCase> {};

TEST_P(Stress, TwoHundredDecodeStepsWithRandomDelays) {
  const StressCase& c = GetParam();
  const LoadedModel& model = fixture_model(kFixture);
  GenerateOptions options;
  options.prompt = prompt_of(kFixture, "len5");
  options.max_new_tokens = 201;  // 1 from the prefill, then 200 decode steps
  options.keep_logits = true;
  ReferenceBackend reference(model.graph, *model.weights, DType::F32, 1);
  const GenerateResult expected = generate(reference, 0, options);

  auto interpreter = make_interpreter(model, decode_and_prefill(model, c.workers, 8), c.workers, DType::F32, 1, 256, c.delay_us, c.seed);
  Watchdog watchdog(std::chrono::seconds(300), "stress");
  const GenerateResult ours = generate(*interpreter, 0, options);
  EXPECT_EQ(ours.generated, expected.generated);
  EXPECT_EQ(max_abs_diff(ours.logits, expected.logits), 0.0f);
  EXPECT_EQ(interpreter->context_tokens(0), 5 + 200);
}

INSTANTIATE_TEST_SUITE_P(Protocol, Stress,
                         ::testing::Values(StressCase{7, 40, 1}, StressCase{3, 150, 2}, StressCase{2, 0, 3}),
                         [](const ::testing::TestParamInfo<StressCase>& p) {
                           return "w" + std::to_string(p.param.workers) + "_delay" + std::to_string(p.param.delay_us) + "us";
                         });

// Three sequences decoded together for 100 steps with delays: identical to the same batch on one
// worker without delays.
TEST(StressBatch, DelayedBatchMatchesSerialRun) {
  const LoadedModel& model = fixture_model(kFixture);
  const auto prompt = prompt_of(kFixture, "len80");
  auto run = [&](int workers, int64_t delay_us) {
    auto interpreter = make_interpreter(model, decode_and_prefill(model, workers, 32), workers, DType::F32, 3, 160, delay_us, 9);
    StepInputs step;
    step.token_ids.assign(prompt.begin(), prompt.begin() + 20);
    step.sequences = {{0, 3}, {1, 9}, {2, 8}};
    std::vector<float> all = interpreter->step(step).logits;
    for (int n = 0; n < 100; ++n) {
      const int64_t vocab = model.config.vocab_size;
      StepInputs decode;
      for (int s = 0; s < 3; ++s) {
        decode.token_ids.push_back(argmax(std::span<const float>(all.data() + static_cast<int64_t>(all.size()) - (3 - s) * vocab, static_cast<size_t>(vocab))));
        decode.sequences.push_back({s, 1});
      }
      const StepOutput out = interpreter->step(decode);
      all.insert(all.end(), out.logits.begin(), out.logits.end());
    }
    return all;
  };
  Watchdog watchdog(std::chrono::seconds(300), "batch stress");
  const std::vector<float> serial = run(1, 0);
  EXPECT_EQ(max_abs_diff(run(5, 60), serial), 0.0f);
}

// A kernel that throws mid-step (PLOW_CHECK on an out-of-vocabulary id in the embedding) must reach the
// caller while other workers wait on counters, leave the pool usable, and later steps must be exact.
TEST(StressErrors, KernelExceptionReachesCallerAndPoolRecovers) {
  const LoadedModel& model = fixture_model(kFixture);
  auto interpreter = make_interpreter(model, decode_and_prefill(model, 7, 8), 7, DType::F32, 1, 64, 30, 5);
  Watchdog watchdog(std::chrono::seconds(300), "exceptions");
  GenerateOptions options;
  options.prompt = prompt_of(kFixture, "len5");
  options.max_new_tokens = 6;
  options.keep_logits = true;
  ReferenceBackend reference(model.graph, *model.weights, DType::F32, 1);
  const GenerateResult expected = generate(reference, 0, options);
  for (int round = 0; round < 10; ++round) {
    StepInputs bad;
    bad.token_ids = {5, static_cast<int32_t>(model.config.vocab_size + round), 7};
    bad.sequences = {{0, 3}};
    const int64_t context = interpreter->context_tokens(0);
    EXPECT_THROW(interpreter->step(bad), InternalError);
    EXPECT_EQ(interpreter->context_tokens(0), context) << "a failed step must not advance the context";
    interpreter->reset_slot(0);
    const GenerateResult ours = generate(*interpreter, 0, options);
    EXPECT_EQ(ours.generated, expected.generated);
    EXPECT_EQ(max_abs_diff(ours.logits, expected.logits), 0.0f) << "round " << round;
  }
}

TEST(StressErrors, StepInputsOutsideThePlansAreErrors) {
  const LoadedModel& model = fixture_model(kFixture);
  std::vector<Plan> plans = {make_plan(model, PlanPhase::kDecode, 2, 2)};
  auto interpreter = make_interpreter(model, std::move(plans), 2, DType::F32, 3, 4);
  StepInputs prefill;
  prefill.token_ids = {1, 2, 3};
  prefill.sequences = {{0, 3}};
  try {
    interpreter->step(prefill);
    FAIL() << "a prefill step without a prefill plan ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no prefill plan holds a step of 3 tokens"), std::string::npos) << e.what();
  }
  StepInputs wide;  // three decode sequences, largest decode bucket 2
  wide.token_ids = {1, 2, 3};
  wide.sequences = {{0, 1}, {1, 1}, {2, 1}};
  EXPECT_THROW(interpreter->step(wide), Error);
  StepInputs twice;
  twice.token_ids = {1, 2};
  twice.sequences = {{0, 1}, {0, 1}};
  EXPECT_THROW(interpreter->step(twice), Error);
  StepInputs one;
  one.token_ids = {1};
  one.sequences = {{1, 1}};
  for (int n = 0; n < 4; ++n) interpreter->step(one);
  try {
    interpreter->step(one);  // the fifth token exceeds the maximum context of 4
    FAIL() << "ran past the maximum context";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("maximum context is 4"), std::string::npos) << e.what();
  }
  EXPECT_EQ(interpreter->context_tokens(1), 4);
}

TEST(StressErrors, PlansThatDoNotFitTheModelAreRefused) {
  const LoadedModel& model = fixture_model(kFixture);
  const LoadedModel& other = fixture_model("tiny-kimi-linear-grouped");
  auto expect_refused = [&](std::vector<Plan> plans, int workers, const std::string& needle) {
    try {
      make_interpreter(model, std::move(plans), workers, DType::F32, 1, 16);
      FAIL() << "accepted; expected an error containing: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_refused({make_plan(other, PlanPhase::kDecode, 1, 1)}, 1, "was compiled for model");
  expect_refused({make_plan(model, PlanPhase::kDecode, 1, 4)}, 2, "needs 4 workers");
  Plan renamed = make_plan(model, PlanPhase::kDecode, 1, 1);
  renamed.weights[3].name += ".renamed";
  expect_refused({renamed}, 1, "is not among the model's weights");
  Plan reshaped = make_plan(model, PlanPhase::kDecode, 1, 1);
  reshaped.weights[0].parts.push_back("extra.part");
  expect_refused({reshaped}, 1, "in the plan but");
}

}  // namespace
}  // namespace plow::plan_test
