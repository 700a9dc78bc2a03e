// Continuous batching: a sequence's tokens do not depend on what it is batched with, how its prompt
// is chunked, or on other requests being aborted; every step leaves the slots consistent.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <span>
#include <string>

#include "core/error.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/scheduler.h"
#include "sampling_test_util.h"

namespace {

using namespace plow;

class SchedulerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { model_ = LoadedModel::load(std::string(PLOW_TEST_DATA) + "/tiny-kimi-linear").release(); }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }

  std::unique_ptr<ReferenceBackend> backend(int slots) const {
    return std::make_unique<ReferenceBackend>(model_->graph, *model_->weights, DType::F32, slots);
  }


  std::vector<int32_t> solo(const Request& request) const {
    auto b = backend(1);
    GenerateOptions options;
    options.prompt = request.prompt;
    options.max_new_tokens = request.max_tokens;
    options.sampling = request.sampling;
    options.stop_ids.assign(request.stop_ids.begin(), request.stop_ids.end());
    return generate(*b, 0, options).generated;
  }

  // Runs every request to completion, checking integrity after each step.
  static std::map<std::string, std::vector<int32_t>> run_all(Scheduler& scheduler, const std::vector<Request>& requests,
                                                               std::map<std::string, FinishReason>* reasons = nullptr) {
    std::map<std::string, std::vector<int32_t>> out;
    for (const Request& r : requests) {
      scheduler.submit(r, [&out, reasons, id = r.id](int32_t token, const SampledToken&, std::optional<FinishReason> done) {
        out[id].push_back(token);
        if (done && reasons) (*reasons)[id] = *done;
      });
    }
    for (int steps = 0; scheduler.has_work(); ++steps) {
      scheduler.step();
      scheduler.check_integrity();
      if (steps > 10000) ADD_FAILURE() << "no progress";
      if (steps > 10000) break;
    }
    return out;
  }

  static LoadedModel* model_;
};

LoadedModel* SchedulerTest::model_ = nullptr;

std::vector<Request> sixteen_requests(int64_t max_tokens) {
  std::vector<Request> requests;
  for (int i = 0; i < 16; ++i) {
    Request r;
    r.id = fmt::format("r{}", i);
    for (int j = 0; j < 1 + (i * 7) % 31; ++j) r.prompt.push_back((i * 37 + j * 11 + 3) % 256);
    r.max_tokens = max_tokens;
    requests.push_back(r);
  }
  return requests;
}

TEST_F(SchedulerTest, BatchedGreedyEqualsSolo) {
  const auto requests = sixteen_requests(8);
  auto b = backend(16);
  Scheduler scheduler(*b, {});
  const auto got = run_all(scheduler, requests);
  for (const Request& r : requests) EXPECT_EQ(got.at(r.id), solo(r)) << r.id << " prompt length " << r.prompt.size();
  EXPECT_EQ(scheduler.free_slots(), 16);
}

TEST_F(SchedulerTest, ChunkedPrefillUnderSmallBudgetAndFewSlots) {
  const auto requests = sixteen_requests(6);
  auto b = backend(5);  // fewer slots than requests: the rest wait in the queue
  Scheduler scheduler(*b, {.max_step_tokens = 7, .max_prefill_chunk = 3});
  for (const Request& r : requests) scheduler.submit(r, [](int32_t, const SampledToken&, std::optional<FinishReason>) {});
  scheduler.step();
  EXPECT_EQ(scheduler.num_running(), 5);
  EXPECT_EQ(scheduler.num_waiting(), 11);
  for (const Request& r : requests) ASSERT_TRUE(scheduler.abort(r.id));
  scheduler.check_integrity();
  const auto got = run_all(scheduler, requests);
  for (const Request& r : requests) EXPECT_EQ(got.at(r.id), solo(r)) << r.id;
}

TEST_F(SchedulerTest, SampledWithSeedEqualsSolo) {
  auto requests = sixteen_requests(6);
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].sampling = {.temperature = 0.9f, .top_p = 0.9f, .top_k = 50, .seed = 100 + i, .repetition_penalty = 1.3f,
                            .presence_penalty = 0.5f, .frequency_penalty = 0.2f};
  }
  auto b = backend(4);
  // Three sampling threads (the default would keep a vocabulary this small on one): the tokens must
  // not depend on them.
  Scheduler scheduler(*b, {.max_step_tokens = 16, .max_prefill_chunk = 8, .sampling_threads = 3});
  const auto got = run_all(scheduler, requests);
  // generate() applies no penalties (it samples without the history): the oracle is each request
  // alone in a one-slot scheduler. Sampling must actually vary, or this test proves nothing.
  int differs_from_greedy = 0;
  for (const Request& r : requests) {
    auto alone_backend = backend(1);
    Scheduler alone(*alone_backend, {});
    EXPECT_EQ(got.at(r.id), run_all(alone, {r}).at(r.id)) << r.id;
    Request greedy = r;
    greedy.sampling = {};
    differs_from_greedy += got.at(r.id) != solo(greedy);
  }
  EXPECT_GT(differs_from_greedy, 8);
}

// A backend that answers argmax_only steps with ids instead of logits, as the cuda backend does
// (the ids from the wrapped reference's logits), and counts the steps of each kind.
class AnswersWithIds : public sampling_test::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  StepOutput step(const StepInputs& inputs) override {
    StepOutput out = inner_.step(inputs);
    if (!inputs.argmax_only) {
      ++logit_steps;
      return out;
    }
    ++id_steps;
    for (int64_t r = 0; r < out.rows; ++r) out.argmax.push_back(argmax(std::span<const float>(out.logits.data() + r * out.vocab, static_cast<size_t>(out.vocab))));
    out.logits.clear();
    return out;
  }

  int id_steps = 0, logit_steps = 0;
};

// Steps whose sampled rows all take their argmax ask for ids (and use them); a request that samples,
// wants logprobs or penalizes makes its steps ask for logits. Tokens equal each request run alone.
TEST_F(SchedulerTest, GreedyStepsTakeIdsFromTheBackend) {
  auto requests = sixteen_requests(6);
  auto reference = backend(16);
  AnswersWithIds greedy_backend(*reference);
  Scheduler greedy(greedy_backend, {});
  const auto got = run_all(greedy, requests);
  for (const Request& r : requests) EXPECT_EQ(got.at(r.id), solo(r)) << r.id;
  EXPECT_GT(greedy_backend.id_steps, 0);
  EXPECT_EQ(greedy_backend.logit_steps, 0);

  requests[3].sampling = {.temperature = 0.9f, .seed = 5};
  requests[3].max_tokens = 12;  // decodes past the others' end
  requests[5].sampling.top_logprobs = 2;
  requests[7].sampling.repetition_penalty = 1.5f;
  auto reference_mixed = backend(16);
  AnswersWithIds mixed_backend(*reference_mixed);
  Scheduler mixed(mixed_backend, {});
  const auto mixed_got = run_all(mixed, requests);
  for (const Request& r : requests) {
    auto alone_backend = backend(1);
    Scheduler alone(*alone_backend, {});
    EXPECT_EQ(mixed_got.at(r.id), run_all(alone, {r}).at(r.id)) << r.id;
  }
  EXPECT_GT(mixed_backend.logit_steps, 0);
  EXPECT_EQ(mixed_backend.id_steps, 0);  // request 3 samples in every step until the last
}

// A backend that draws rows itself (draws_rows), as the cuda backend with device sampling does: the
// specification's kept tokens (reference_distribution) walked in id order to the draw's uniform.
class DrawsRows : public sampling_test::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  bool draws_rows() const override { return true; }
  StepOutput step(const StepInputs& inputs) override {
    StepOutput out = inner_.step(inputs);
    if (inputs.draws.empty()) {
      ++logit_steps;
      return out;
    }
    ++draw_steps;
    for (int64_t r = 0; r < out.rows; ++r) {
      const std::span<const float> row(out.logits.data() + r * out.vocab, static_cast<size_t>(out.vocab));
      const RowDraw& d = inputs.draws[static_cast<size_t>(r)];
      if (d.temperature <= 0.0f || d.top_k == 1) {
        out.argmax.push_back(argmax(row));
        continue;
      }
      const SamplingParams p = sampling_test::controls(d.temperature, d.top_p, d.min_p, d.top_k);
      out.argmax.push_back(sampling_test::draw_by_id(reference_distribution(row, p, {}, {}), d.u));
    }
    out.logits.clear();
    return out;
  }

  int draw_steps = 0, logit_steps = 0;
};

// Sampled requests on a backend that draws rows: every step hands it the draws (no logits come
// back), the tokens follow each request's seed whatever it is batched with, and sampling varies;
// a request with penalties or logprobs brings the logits back for its steps.
TEST_F(SchedulerTest, BackendDrawsTheRowsWithTheSequencesUniforms) {
  auto requests = sixteen_requests(6);
  for (size_t i = 0; i < requests.size(); ++i) requests[i].sampling = {.temperature = 1.1f, .top_p = 0.95f, .top_k = i % 3 == 0 ? 20 : 0, .seed = 40 + i};
  requests[2].sampling = {};  // greedy among sampled
  auto reference = backend(16);
  DrawsRows drawing(*reference);
  Scheduler scheduler(drawing, {});
  const auto got = run_all(scheduler, requests);
  EXPECT_GT(drawing.draw_steps, 0);
  EXPECT_EQ(drawing.logit_steps, 0);
  int differs_from_greedy = 0;
  for (const Request& r : requests) {
    auto alone_reference = backend(1);
    DrawsRows alone_drawing(*alone_reference);
    Scheduler alone(alone_drawing, {});
    EXPECT_EQ(got.at(r.id), run_all(alone, {r}).at(r.id)) << r.id;
    Request greedy = r;
    greedy.sampling = {};
    differs_from_greedy += got.at(r.id) != solo(greedy);
  }
  EXPECT_EQ(got.at(requests[2].id), solo(requests[2]));
  EXPECT_GT(differs_from_greedy, 8);

  requests[4].sampling.frequency_penalty = 0.5f;
  requests[4].max_tokens = 12;  // decodes past the others' end
  auto reference_mixed = backend(16);
  DrawsRows mixed(*reference_mixed);
  Scheduler mixed_scheduler(mixed, {});
  run_all(mixed_scheduler, requests);
  EXPECT_GT(mixed.logit_steps, 0);
  EXPECT_EQ(mixed.draw_steps, 0);  // request 4 samples with a penalty in every step
}

TEST_F(SchedulerTest, AbortMidFlightFreesTheSlotAndOthersContinue) {
  const auto requests = sixteen_requests(10);
  auto b = backend(4);
  Scheduler scheduler(*b, {});
  std::map<std::string, std::vector<int32_t>> out;
  for (const Request& r : requests) {
    scheduler.submit(r, [&out, id = r.id](int32_t t, const SampledToken&, std::optional<FinishReason>) { out[id].push_back(t); });
  }
  for (int i = 0; i < 3; ++i) scheduler.step();
  ASSERT_EQ(scheduler.state("r1"), RequestState::kDecoding);
  ASSERT_EQ(scheduler.free_slots(), 0);
  EXPECT_TRUE(scheduler.abort("r1"));
  EXPECT_EQ(scheduler.free_slots(), 1);
  EXPECT_FALSE(scheduler.state("r1"));
  EXPECT_FALSE(scheduler.abort("r1"));
  EXPECT_TRUE(scheduler.abort("r9"));  // still queued
  scheduler.check_integrity();
  const size_t aborted_tokens = out["r1"].size();
  while (scheduler.has_work()) {
    scheduler.step();
    scheduler.check_integrity();
  }
  EXPECT_EQ(out["r1"].size(), aborted_tokens);
  EXPECT_EQ(out.count("r9"), 0u);
  for (const Request& r : requests) {
    if (r.id != "r1" && r.id != "r9") {
      EXPECT_EQ(out[r.id], solo(r)) << r.id;
    }
  }
  EXPECT_EQ(scheduler.free_slots(), 4);
}

TEST_F(SchedulerTest, MaxTokensAndStopIds) {
  Request base = sixteen_requests(12)[5];
  const std::vector<int32_t> free_run = solo(base);
  ASSERT_EQ(free_run.size(), 12u);
  Request stopped = base;
  stopped.id = "stopped";
  stopped.stop_ids = {free_run[4]};
  size_t first = 0;
  while (free_run[first] != free_run[4]) ++first;  // the stop id may appear earlier
  Request short_one = base;
  short_one.id = "short";
  short_one.max_tokens = 3;
  auto b = backend(2);
  Scheduler scheduler(*b, {});
  std::map<std::string, FinishReason> reasons;
  const auto got = run_all(scheduler, {stopped, short_one}, &reasons);
  EXPECT_EQ(got.at("stopped"), std::vector<int32_t>(free_run.begin(), free_run.begin() + static_cast<long>(first) + 1));
  EXPECT_EQ(reasons.at("stopped"), FinishReason::kStop);
  EXPECT_EQ(got.at("short"), std::vector<int32_t>(free_run.begin(), free_run.begin() + 3));
  EXPECT_EQ(reasons.at("short"), FinishReason::kLength);
}

TEST_F(SchedulerTest, RejectsBadRequests) {
  auto b = backend(1);
  Scheduler scheduler(*b, {});
  Request r;
  r.id = "x";
  EXPECT_THROW(scheduler.submit(r, {}), Error);
  r.prompt = {1, 2};
  r.max_tokens = 0;
  EXPECT_THROW(scheduler.submit(r, {}), Error);
  r.max_tokens = 1;
  scheduler.submit(r, [](int32_t, const SampledToken&, std::optional<FinishReason>) {});
  EXPECT_THROW(scheduler.submit(r, {}), Error);
  EXPECT_EQ(scheduler.num_waiting(), 1);
}

}  // namespace
