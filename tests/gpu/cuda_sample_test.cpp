// Sampling on the device (label gpu): the sampler block (runtime/cuda/sample.cuh) against the host
// sampler's specification, and the scheduler over the cuda backend with device_sampling on (rows drawn
// on the device, ids downloaded; greedy steps answered with the device's argmax).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/model.h"
#include "engine/plans.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "gpu_test_util.h"
#include "runtime/cpu/reference.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/device_memory.h"
#include "runtime/cuda/kernels.h"
#include "unit/sampling_test_util.h"

namespace plow {
namespace {

// Uniforms in the middle of kept tokens' intervals of the id-order walk draw exactly those tokens.
TEST(DeviceSampling, KernelDrawsTheSpecificationsKeptTokens) {
  struct Controls {
    float temperature, top_p, min_p;
    int32_t top_k;
  };
  const std::vector<Controls> controls = {{1.0f, 1.0f, 0.0f, 0}, {0.6f, 0.95f, 0.0f, 0}, {0.7f, 1.0f, 0.0f, 40},
                                          {1.0f, 0.8f, 0.0f, 50}, {1.0f, 1.0f, 0.05f, 0}, {1.0f, 0.9f, 0.2f, 7}};
  int probes = 0;
  for (const auto& [vocab, sigma, step] : std::vector<std::tuple<size_t, float, float>>{{5000, 3.0f, 0.25f}, {163840, 2.5f, 0.0f}}) {
    const std::vector<float> row = sampling_test::random_logits(vocab, sigma, step, true, vocab);
    cuda::DeviceBuffer logits(vocab * sizeof(float), "test logits");
    ASSERT_EQ(cudaMemcpy(logits.ptr, row.data(), vocab * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    for (const Controls& c : controls) {
      const auto kept = sampling_test::kept_by_id(reference_distribution(row, sampling_test::controls(c.temperature, c.top_p, c.min_p, c.top_k), {}, {}));
      std::vector<cuda::RowSampling> draws;
      std::vector<int32_t> want;
      double below = 0.0;
      for (size_t i = 0; i < kept.size(); ++i) {
        if (kept[i].second >= 1e-4) {  // tokens whose interval is wide enough to aim at
          draws.push_back({c.temperature, c.top_p, c.min_p, c.top_k, below + 0.5 * kept[i].second});
          want.push_back(kept[i].first);
        }
        below += kept[i].second;
      }
      const auto n = static_cast<int>(draws.size());
      ASSERT_GT(n, 0);
      cuda::DeviceBuffer rows(draws.size() * sizeof(cuda::RowSampling), "test draws"), ids(draws.size() * sizeof(int32_t), "test ids");
      cuda::DeviceBuffer first_row(draws.size() * sizeof(int32_t), "test rows"), tokens(draws.size() * sizeof(int32_t), "test tokens");
      const std::vector<int32_t> zeros(draws.size(), 0), ones(draws.size(), 1);
      ASSERT_EQ(cudaMemcpy(rows.ptr, draws.data(), draws.size() * sizeof(cuda::RowSampling), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(first_row.ptr, zeros.data(), zeros.size() * sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(tokens.ptr, ones.data(), ones.size() * sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
      cuda::launch_sample(logits.as<float>(), static_cast<int64_t>(vocab), first_row.as<int32_t>(), tokens.as<int32_t>(), rows.as<cuda::RowSampling>(), n,
                          ids.as<int32_t>(), nullptr);
      std::vector<int32_t> got(draws.size());
      ASSERT_EQ(cudaMemcpy(got.data(), ids.ptr, got.size() * sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)]) << "vocab " << vocab << " T " << c.temperature << " top_p " << c.top_p
                                                                            << " top_k " << c.top_k << " u " << draws[static_cast<size_t>(i)].u;
      }
      probes += n;
    }
  }
  EXPECT_GT(probes, 100);
}

// Counts the steps the wrapped backend answered with ids, for the draws it was given or for greedy rows.
class Counting : public sampling_test::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  StepOutput step(const StepInputs& inputs) override {
    StepOutput out = inner_.step(inputs);
    drawn += !inputs.draws.empty() && !out.argmax.empty();
    greedy += inputs.argmax_only && !out.argmax.empty();
    logits += !out.logits.empty();
    return out;
  }
  int drawn = 0, greedy = 0, logits = 0;
};

std::map<std::string, std::vector<int32_t>> run_all(Scheduler& scheduler, const std::vector<Request>& requests) {
  std::map<std::string, std::vector<int32_t>> out;
  for (const Request& r : requests) {
    scheduler.submit(r, [&out, id = r.id](int32_t token, const SampledToken&, std::optional<FinishReason>) { out[id].push_back(token); });
  }
  for (int steps = 0; scheduler.has_work() && steps < 10000; ++steps) scheduler.step();
  return out;
}

// Sampled requests drawn on the device follow their seeds whatever they are batched with, vary from
// greedy, and greedy requests give the reference's tokens through the device's argmax.
TEST(DeviceSampling, SchedulerDrawsOnTheDevice) {
  const auto model = LoadedModel::load(std::string(gpu_test::data_dir()) + "/tiny-kimi-linear");
  auto weights = cuda::upload_weights(model->graph, *model->weights);
  auto make = [&](int slots) {
    std::vector<Plan> plans = {compile_plan(*model, PlanPhase::kDecode, slots, 7, 256), compile_plan(*model, PlanPhase::kPrefill, 64, 7, 256)};
    cuda::CudaOptions options;
    options.act_dtype = DType::F32;
    options.num_slots = slots;
    options.max_context_tokens = 256;
    options.device_sampling = true;
    return std::make_unique<cuda::CudaBackend>(model->graph, weights, std::move(plans), options);
  };
  // Steps no larger than the prefill plan.
  const SchedulerOptions steps{.max_step_tokens = 64, .max_prefill_chunk = 64};
  std::vector<Request> requests;
  for (int i = 0; i < 8; ++i) {
    Request r;
    r.id = fmt::format("r{}", i);
    r.prompt = gpu_test::prompt(i, model->config.vocab_size, 5 + 3 * i);
    r.max_tokens = 10;
    r.sampling = {.temperature = 1.0f, .top_p = 0.95f, .top_k = i % 2 == 0 ? 30 : 0, .seed = 7u + static_cast<uint64_t>(i)};
    requests.push_back(r);
  }
  auto batch_backend = make(8);
  Counting batch_counting(*batch_backend);
  Scheduler batch(batch_counting, steps);
  const auto got = run_all(batch, requests);
  EXPECT_GT(batch_counting.drawn, 0);
  EXPECT_EQ(batch_counting.logits, 0);
  int differs_from_greedy = 0;
  for (const Request& r : requests) {
    auto alone_backend = make(1);
    Scheduler alone(*alone_backend, steps);
    EXPECT_EQ(got.at(r.id), run_all(alone, {r}).at(r.id)) << r.id;
    Request greedy = r;
    greedy.sampling = {};
    auto greedy_backend = make(1);
    Counting greedy_counting(*greedy_backend);
    Scheduler greedy_scheduler(greedy_counting, steps);
    const std::vector<int32_t> greedy_tokens = run_all(greedy_scheduler, {greedy}).at(r.id);
    EXPECT_GT(greedy_counting.greedy, 0);
    ReferenceBackend reference(model->graph, *model->weights, DType::F32, 1);
    Scheduler reference_scheduler(reference, steps);
    EXPECT_EQ(greedy_tokens, run_all(reference_scheduler, {greedy}).at(r.id)) << r.id;
    differs_from_greedy += got.at(r.id) != greedy_tokens;
  }
  EXPECT_GT(differs_from_greedy, 4);
}

}  // namespace
}  // namespace plow
