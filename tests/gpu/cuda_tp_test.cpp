// Tensor parallelism on two GPUs (issue F; CTest labels gpu and multigpu: needs a machine with two or
// more GPUs, and fails on one with fewer). Two ranks, one GPU and one NCCL communicator each, stepped
// in lockstep by TensorParallelBackend:
//  - the cross-rank gate: at every step every rank's device-folded argmax (its lm_head block, the
//    candidates all-gathered over NCCL) is the same token, and it is the argmax of the gathered row;
//  - TP2 against the CPU reference (one rank): greedy tokens identical over 64 steps on every fp32
//    fixture that splits in two and on the bundled model, batch 1 and batch 3, megakernel and eager.
// PLOW_TEST_DATA in the environment overrides the compiled-in path (the GPU machine runs a copy).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <vector>

#include "core/error.h"
#include "engine/generate.h"
#include "engine/plans.h"
#include "engine/sampler.h"
#include "engine/tensor_parallel.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/nccl_comm.h"

namespace plow {
namespace {

namespace fs = std::filesystem;

constexpr int kRanks = 2;
constexpr int64_t kSteps = 64;
constexpr int64_t kMaxContext = 256;

std::string data_dir() {
  const char* env = std::getenv("PLOW_TEST_DATA");
  return env != nullptr ? env : PLOW_TEST_DATA;
}

// fp32 fixtures whose heads and expert columns split in two (tiny-k3's 32-column MXFP4 experts do not),
// and the bundled K3 model.
std::vector<std::string> model_dirs() {
  const fs::path data = data_dir();
  return {(data / "tiny-kimi-linear").string(), (data / "tiny-kimi-linear-grouped").string(), (data / "tiny-kimi-linear-tied-qlora").string(),
          (data.parent_path().parent_path() / "models" / "plow-k3-code-small").string()};
}

std::vector<int32_t> prompt(int seed, int64_t vocab, int64_t length) {
  std::vector<int32_t> ids;
  uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(seed + 1);
  for (int64_t i = 0; i < length; ++i) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    ids.push_back(static_cast<int32_t>((x * 0x2545F4914F6CDD1Dull >> 33) % static_cast<uint64_t>(vocab)));
  }
  return ids;
}

struct Group {
  std::vector<std::unique_ptr<cuda::NcclComm>> comms;
  std::unique_ptr<TensorParallelBackend> backend;
  std::vector<cuda::CudaBackend*> ranks;
};

Group make_group(const std::string& dir, int batch, bool eager) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < kRanks) fail("this test needs {} GPUs, the machine has {}", kRanks, devices);
  Group g;
  g.comms = cuda::NcclComm::init_all(kRanks);
  std::vector<TpRank> ranks;
  for (int r = 0; r < kRanks; ++r) {
    TpRank rank;
    rank.model = LoadedModel::load(dir, {r, kRanks});
    const int workers = cuda::CudaBackend::sm_count(r);
    std::vector<Plan> plans = {compile_plan(*rank.model, PlanPhase::kDecode, batch, workers, kMaxContext),
                               compile_plan(*rank.model, PlanPhase::kPrefill, 16, workers, kMaxContext)};
    cuda::CudaOptions options;
    options.act_dtype = DType::F32;
    options.num_slots = batch;
    options.max_context_tokens = kMaxContext;
    options.eager = eager;
    options.device = r;
    options.comm = g.comms[static_cast<size_t>(r)].get();
    if (cudaSetDevice(r) != cudaSuccess) fail("cannot select device {}", r);
    auto backend = std::make_unique<cuda::CudaBackend>(rank.model->graph, cuda::upload_weights(rank.model->graph, *rank.model->weights),
                                                       std::move(plans), options);
    g.ranks.push_back(backend.get());
    rank.backend = std::move(backend);
    ranks.push_back(std::move(rank));
  }
  TpGroupControl control;
  control.abort = [comms = &g.comms] {
    for (auto& c : *comms) c->abort();
  };
  g.backend = std::make_unique<TensorParallelBackend>(std::move(ranks), std::move(control));
  return g;
}

// `batch` sequences of different prompts decoded together for kSteps: per sequence the greedy ids,
// checking the cross-rank gate at every step.
std::vector<std::vector<int32_t>> run_group(Group& g, const std::vector<std::vector<int32_t>>& prompts) {
  const auto n = static_cast<int>(prompts.size());
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(n));
  StepInputs step;
  for (int s = 0; s < n; ++s) {
    step.token_ids.insert(step.token_ids.end(), prompts[static_cast<size_t>(s)].begin(), prompts[static_cast<size_t>(s)].end());
    step.sequences.push_back({s, static_cast<int64_t>(prompts[static_cast<size_t>(s)].size())});
  }
  for (int64_t i = 0; i < kSteps; ++i) {
    const StepOutput logits = g.backend->step(step);
    step = {};
    for (int s = 0; s < n; ++s) {
      const std::span<const float> row(logits.logits.data() + s * logits.vocab, static_cast<size_t>(logits.vocab));
      const int32_t token = argmax(row);
      for (cuda::CudaBackend* rank : g.ranks) {
        EXPECT_EQ(rank->last_folded_argmax().at(static_cast<size_t>(s)), token) << "step " << i << " sequence " << s << ": a rank's fold disagrees";
      }
      out[static_cast<size_t>(s)].push_back(token);
      step.token_ids.push_back(token);
      step.sequences.push_back({s, 1});
    }
  }
  return out;
}

std::vector<int32_t> reference_run(const std::string& dir, const std::vector<int32_t>& ids) {
  auto model = LoadedModel::load(dir);
  ReferenceBackend reference(model->graph, *model->weights, DType::F32, 1);
  GenerateOptions options;
  options.prompt = ids;
  options.max_new_tokens = kSteps;
  return generate(reference, 0, options).generated;
}

class TensorParallelCuda : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(TensorParallelCuda, TwoRanksEmitTheReferenceTokensAndAgreeEveryStep) {
  const auto [batch, eager] = GetParam();
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    Group g = make_group(dir, batch, eager);
    const int64_t vocab = LoadedModel::describe((fs::path(dir) / "config.json").string()).get()->config.vocab_size;
    std::vector<std::vector<int32_t>> prompts;
    for (int s = 0; s < batch; ++s) prompts.push_back(prompt(s, vocab, 7 + 5 * s));
    const auto tokens = run_group(g, prompts);
    for (int s = 0; s < batch; ++s) {
      // The first id of a run is the prompt's last logits' argmax: kSteps ids in all, as generate makes.
      const std::vector<int32_t> expected = reference_run(dir, prompts[static_cast<size_t>(s)]);
      const std::vector<int32_t>& got = tokens[static_cast<size_t>(s)];
      EXPECT_EQ(got, expected) << "sequence " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, TensorParallelCuda, ::testing::Combine(::testing::Values(1, 3), ::testing::Bool()),
                         [](const auto& mode) { return fmt::format("batch{}_{}", std::get<0>(mode.param), std::get<1>(mode.param) ? "eager" : "megakernel"); });

// A plan of a rank needs a communicator: without one the backend refuses it at construction.
TEST(TensorParallelCudaPlans, ARanksPlanWithoutACommunicatorIsRefused) {
  auto model = LoadedModel::load(model_dirs().front(), {0, kRanks});
  std::vector<Plan> plans = {compile_plan(*model, PlanPhase::kDecode, 1, 8, kMaxContext)};
  cuda::CudaOptions options;
  options.act_dtype = DType::F32;
  EXPECT_THROW(cuda::CudaBackend(model->graph, cuda::upload_weights(model->graph, *model->weights), std::move(plans), options), Error);
}

}  // namespace
}  // namespace plow
