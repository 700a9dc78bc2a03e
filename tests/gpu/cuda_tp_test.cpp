// Tensor parallelism on two GPUs (issue F; CTest labels gpu and multigpu: needs a machine with two or
// more GPUs, and fails on one with fewer). Two ranks, each a process of this binary with one GPU and
// one NCCL communicator (the way `plow bench decode --tp` runs them), decoding in lockstep:
//  - the cross-rank gate: at every step every rank's device-folded argmax (its lm_head block, the
//    candidates all-gathered over NCCL) is the same token, and each rank feeds it back as its next input;
//  - TP2 against the CPU reference (one rank): greedy tokens identical over 64 steps on every fp32
//    fixture that splits in two and on the bundled model, batch 1 and batch 3, megakernel and eager,
//    with the all_reduces inside the kernel (peer-mapped memory, the default) and as NCCL calls;
//  - ranks as threads of one process (TensorParallelBackend, ncclCommInitAll): the same tokens, and
//    the in-kernel all_reduce's logits equal NCCL's bit for bit;
//  - the server's process mode (rank 1 a `plow tp-worker` behind a socket): the same tokens, and a
//    killed rank fails the step instead of hanging it.
// PLOW_TEST_DATA and PLOW_BINARY in the environment override the compiled-in paths (the GPU machine
// runs a copy).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>
#include <vector>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/error.h"
#include "engine/generate.h"
#include "engine/plans.h"
#include "engine/sampler.h"
#include "engine/remote_rank.h"
#include "engine/tensor_parallel.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/nccl_comm.h"
#include "tools/cuda_commands.h"
#include "gpu_test_util.h"

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

// The plow binary whose `tp-worker` the server's process mode starts (PLOW_BINARY overrides it too).
std::string plow_binary() {
  const char* env = std::getenv("PLOW_BINARY");
  return env != nullptr ? env : PLOW_BINARY;
}

// fp32 fixtures whose heads and expert columns split in two (tiny-k3's 32-column MXFP4 experts do not),
// and the bundled K3 model.
std::vector<std::string> model_dirs() {
  const fs::path data = data_dir();
  return {(data / "tiny-kimi-linear").string(), (data / "tiny-kimi-linear-grouped").string(), (data / "tiny-kimi-linear-tied-qlora").string(),
          (data.parent_path().parent_path() / "models" / "plow-k3-code-small").string()};
}

using gpu_test::prompt;

// One rank, run in its own process (as `plow bench decode --tp` runs them): joins the NCCL group
// through the id file, decodes `batch` prompts for kSteps greedy steps taking each next token from its
// device-folded argmax, and writes its tokens (one line per step) to `out`.
// `peer`: in-kernel all_reduces, and every step must have used them (no silent fallback to NCCL).
int run_rank(int rank, const std::string& id_file, const std::string& dir, int batch, bool eager, bool peer, const std::string& out) {
  std::ifstream id_in(id_file, std::ios::binary);
  const std::string id((std::istreambuf_iterator<char>(id_in)), std::istreambuf_iterator<char>());
  cuda::NcclComm comm(id, rank, kRanks, rank);
  auto model = LoadedModel::load(dir, {rank, kRanks});
  const int workers = cuda::CudaBackend::sm_count(rank);
  std::vector<Plan> plans = {compile_plan(*model, PlanPhase::kDecode, batch, workers, kMaxContext),
                             compile_plan(*model, PlanPhase::kPrefill, 64, workers, kMaxContext)};
  cuda::CudaOptions options;
  options.act_dtype = DType::F32;
  options.num_slots = batch;
  options.max_context_tokens = kMaxContext;
  options.eager = eager;
  options.device = rank;
  options.comm = &comm;
  options.peer_all_reduce = peer;
  cuda::CudaBackend backend(model->graph, cuda::upload_weights(model->graph, *model->weights), std::move(plans), options);
  StepInputs step;
  for (int s = 0; s < batch; ++s) {
    const auto p = prompt(s, model->config.vocab_size, 7 + 5 * s);
    step.token_ids.insert(step.token_ids.end(), p.begin(), p.end());
    step.sequences.push_back({s, static_cast<int64_t>(p.size())});
  }
  std::ofstream lines(out);
  for (int64_t i = 0; i < kSteps; ++i) {
    backend.step(step);
    if (backend.last_step_peer_all_reduce() != peer) fail("step {}: the all_reduces ran {}", i, peer ? "through NCCL" : "in the kernel");
    const std::vector<int32_t> next = backend.last_folded_argmax();
    for (int32_t t : next) lines << t << " ";
    lines << "\n";
    step = {};
    for (int s = 0; s < batch; ++s) {
      step.token_ids.push_back(next[static_cast<size_t>(s)]);
      step.sequences.push_back({s, 1});
    }
  }
  return lines ? 0 : 1;
}

// Per rank, per step, the tokens of the batch: the ranks run as processes of this binary.
std::vector<std::vector<std::vector<int32_t>>> run_ranks(const std::string& dir, int batch, bool eager, bool peer) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < kRanks) fail("this test needs {} GPUs, the machine has {}", kRanks, devices);
  const fs::path tmp = fs::temp_directory_path() / ("plow-tp-test-" + std::to_string(::getpid()));
  fs::create_directories(tmp);
  const std::string id_file = (tmp / "id").string();
  std::ofstream(id_file, std::ios::binary) << cuda::NcclComm::new_unique_id();
  std::vector<pid_t> children;
  for (int r = 0; r < kRanks; ++r) {
    std::vector<std::string> args = {"/proc/self/exe", "--rank", std::to_string(r), id_file, dir, std::to_string(batch), eager ? "1" : "0",
                                     peer ? "1" : "0", (tmp / ("rank" + std::to_string(r))).string()};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ) != 0) fail("cannot start rank {}", r);
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a rank failed";
  }
  std::vector<std::vector<std::vector<int32_t>>> tokens(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    std::ifstream in(tmp / ("rank" + std::to_string(r)));
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::vector<int32_t> step;
      for (int32_t t; fields >> t;) step.push_back(t);
      tokens[static_cast<size_t>(r)].push_back(step);
    }
  }
  fs::remove_all(tmp);
  return tokens;
}

std::vector<int32_t> reference_run(const std::string& dir, const std::vector<int32_t>& ids) {
  auto model = LoadedModel::load(dir);
  ReferenceBackend reference(model->graph, *model->weights, DType::F32, 1);
  GenerateOptions options;
  options.prompt = ids;
  options.max_new_tokens = kSteps;
  return generate(reference, 0, options).generated;
}

// Two prompts prefilled in one step, then decoded together for kSteps greedy steps on the tokens of
// the backend's (gathered) logits; `check` sees every step's tokens. They must equal the reference.
void expect_reference_tokens(Backend& backend, const std::string& dir, const std::function<void(int64_t, const std::vector<int32_t>&)>& check) {
  const int batch = 2;
  const int64_t vocab = LoadedModel::describe((fs::path(dir) / "config.json").string())->config.vocab_size;
  std::vector<std::vector<int32_t>> prompts = {prompt(0, vocab, 7), prompt(1, vocab, 12)};
  std::vector<std::vector<int32_t>> got(batch);
  StepInputs step;
  for (int s = 0; s < batch; ++s) {
    step.token_ids.insert(step.token_ids.end(), prompts[static_cast<size_t>(s)].begin(), prompts[static_cast<size_t>(s)].end());
    step.sequences.push_back({s, static_cast<int64_t>(prompts[static_cast<size_t>(s)].size())});
  }
  for (int64_t i = 0; i < kSteps; ++i) {
    const StepOutput out = backend.step(step);
    step = {};
    std::vector<int32_t> tokens;
    for (int s = 0; s < batch; ++s) {
      const int32_t token = argmax(std::span<const float>(out.logits.data() + s * out.vocab, static_cast<size_t>(out.vocab)));
      tokens.push_back(token);
      got[static_cast<size_t>(s)].push_back(token);
      step.token_ids.push_back(token);
      step.sequences.push_back({s, 1});
    }
    check(i, tokens);
  }
  for (int s = 0; s < batch; ++s) EXPECT_EQ(got[static_cast<size_t>(s)], reference_run(dir, prompts[static_cast<size_t>(s)])) << "sequence " << s;
}

// The server's plans for two slots, fp32 activations (as the reference runs).
tools::ServingShape serving_shape(bool eager) {
  tools::ServingShape shape;
  shape.num_slots = 2;
  shape.max_context = kMaxContext;
  shape.max_step_tokens = 64;
  shape.eager = eager;
  shape.act = DType::F32;
  return shape;
}

class TensorParallelCuda : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(TensorParallelCuda, TwoRanksEmitTheReferenceTokensAndAgreeEveryStep) {
  const auto [batch, eager, peer] = GetParam();
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    const auto tokens = run_ranks(dir, batch, eager, peer);
    ASSERT_EQ(tokens[0].size(), static_cast<size_t>(kSteps));
    EXPECT_EQ(tokens[0], tokens[1]) << "the ranks' folded argmaxes differ: the cross-rank token gate";
    const int64_t vocab = LoadedModel::describe((fs::path(dir) / "config.json").string())->config.vocab_size;
    for (int s = 0; s < batch; ++s) {
      std::vector<int32_t> got;
      for (const auto& step : tokens[0]) got.push_back(step.at(static_cast<size_t>(s)));
      EXPECT_EQ(got, reference_run(dir, prompt(s, vocab, 7 + 5 * s))) << "sequence " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, TensorParallelCuda, ::testing::Combine(::testing::Values(1, 3), ::testing::Bool(), ::testing::Bool()),
                         [](const auto& mode) {
                           return fmt::format("batch{}_{}_{}", std::get<0>(mode.param), std::get<1>(mode.param) ? "eager" : "megakernel",
                                              std::get<2>(mode.param) ? "in_kernel" : "nccl");
                         });

// The ranks as threads of one process (what `plow serve --tp 2 --backend cuda` builds): TensorParallelBackend
// over two CudaBackends with communicators from ncclCommInitAll. Tokens from the gathered logits equal
// the reference, and each rank's device fold agrees with them at every step.
// Two ranks as threads over `dir`, greedy from two prompts for kSteps steps: per step the gathered
// logits rows; checks each rank's device fold against the gathered argmax and the all_reduce path used.
std::vector<std::vector<float>> thread_ranks(const std::string& dir, bool peer, std::vector<std::vector<int32_t>>& got) {
  auto comms = cuda::NcclComm::init_all(kRanks);
  std::vector<TpRank> ranks;
  std::vector<cuda::CudaBackend*> cudas;
  const int batch = 2;
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(cudaSetDevice(r), cudaSuccess);
    TpRank rank;
    rank.model = LoadedModel::load(dir, {r, kRanks});
    const int workers = cuda::CudaBackend::sm_count(r);
    std::vector<Plan> plans = {compile_plan(*rank.model, PlanPhase::kDecode, batch, workers, kMaxContext),
                               compile_plan(*rank.model, PlanPhase::kPrefill, 64, workers, kMaxContext)};
    cuda::CudaOptions options;
    options.act_dtype = DType::F32;
    options.num_slots = batch;
    options.max_context_tokens = kMaxContext;
    options.device = r;
    options.comm = comms[static_cast<size_t>(r)].get();
    options.peer_all_reduce = peer;
    auto backend = std::make_unique<cuda::CudaBackend>(rank.model->graph, cuda::upload_weights(rank.model->graph, *rank.model->weights),
                                                       std::move(plans), options);
    cudas.push_back(backend.get());
    rank.backend = std::move(backend);
    ranks.push_back(std::move(rank));
  }
  TensorParallelBackend group(std::move(ranks), {});
  const int64_t vocab = LoadedModel::describe((fs::path(dir) / "config.json").string())->config.vocab_size;
  const std::vector<std::vector<int32_t>> prompts = {prompt(0, vocab, 7), prompt(1, vocab, 12)};
  got.assign(batch, {});
  std::vector<std::vector<float>> logits;
  StepInputs step;
  for (int s = 0; s < batch; ++s) {
    step.token_ids.insert(step.token_ids.end(), prompts[static_cast<size_t>(s)].begin(), prompts[static_cast<size_t>(s)].end());
    step.sequences.push_back({s, static_cast<int64_t>(prompts[static_cast<size_t>(s)].size())});
  }
  for (int64_t i = 0; i < kSteps; ++i) {
    StepOutput out = group.step(step);
    for (cuda::CudaBackend* rank : cudas) EXPECT_EQ(rank->last_step_peer_all_reduce(), peer) << "step " << i;
    step = {};
    for (int s = 0; s < batch; ++s) {
      const int32_t token = argmax(std::span<const float>(out.logits.data() + s * out.vocab, static_cast<size_t>(out.vocab)));
      for (cuda::CudaBackend* rank : cudas) EXPECT_EQ(rank->last_folded_argmax().at(static_cast<size_t>(s)), token) << "step " << i;
      got[static_cast<size_t>(s)].push_back(token);
      step.token_ids.push_back(token);
      step.sequences.push_back({s, 1});
    }
    logits.push_back(std::move(out.logits));
  }
  for (int s = 0; s < batch; ++s) EXPECT_EQ(got[static_cast<size_t>(s)], reference_run(dir, prompts[static_cast<size_t>(s)])) << "sequence " << s;
  return logits;
}

// The ranks as threads of one process (what `plow serve --tp 2 --backend cuda` builds): TensorParallelBackend
// over two CudaBackends with communicators from ncclCommInitAll. Tokens from the gathered logits equal
// the reference, each rank's device fold agrees with them at every step, and the in-kernel all_reduce
// (two ranks: one fp32 addition per element) gives NCCL's logits bit for bit.
TEST(TensorParallelCudaThreads, TwoRanksInOneProcessEmitTheReferenceTokens) {
  int devices = 0;
  ASSERT_TRUE(cudaGetDeviceCount(&devices) == cudaSuccess && devices >= kRanks) << "this test needs " << kRanks << " GPUs";
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    std::vector<std::vector<int32_t>> in_kernel_tokens, nccl_tokens;
    const auto in_kernel = thread_ranks(dir, true, in_kernel_tokens);
    const auto nccl = thread_ranks(dir, false, nccl_tokens);
    EXPECT_EQ(in_kernel_tokens, nccl_tokens);
    ASSERT_EQ(in_kernel.size(), nccl.size());
    for (size_t i = 0; i < nccl.size(); ++i) {
      ASSERT_EQ(in_kernel[i].size(), nccl[i].size());
      size_t differ = 0;
      for (size_t j = 0; j < nccl[i].size(); ++j) differ += std::memcmp(&in_kernel[i][j], &nccl[i][j], sizeof(float)) != 0;
      EXPECT_EQ(differ, 0u) << "logits of step " << i << " differ between the two all_reduce paths";
    }
  }
}

// The server's process mode (`plow serve --tp 2 --backend cuda`: tools/cuda_serve.cpp's factory; rank 0
// in this process, rank 1 a `plow tp-worker` process of the plow binary behind a socket): the tokens of
// the gathered logits equal the reference, megakernel and eager.
TEST(TensorParallelCudaServe, RanksAsServerProcessesEmitTheReferenceTokens) {
  int devices = 0;
  ASSERT_TRUE(cudaGetDeviceCount(&devices) == cudaSuccess && devices >= kRanks) << "this test needs " << kRanks << " GPUs";
  for (const std::string& dir : model_dirs()) {
    for (const bool eager : {false, true}) {
      SCOPED_TRACE(dir + (eager ? " eager" : " megakernel"));
      const auto backend = tools::make_cuda_tp_serving_backend(dir, kRanks, serving_shape(eager), plow_binary());
      expect_reference_tokens(*backend, dir, [](int64_t, const std::vector<int32_t>&) {});
    }
  }
}

// Rank 1's process is killed between steps: the next step fails, naming the rank and how it ended,
// once the group's abort (30 s) has released rank 0 from its collective; it does not hang.
TEST(TensorParallelCudaServe, AKilledRankFailsTheStepInsteadOfHangingIt) {
  int devices = 0;
  ASSERT_TRUE(cudaGetDeviceCount(&devices) == cudaSuccess && devices >= kRanks) << "this test needs " << kRanks << " GPUs";
  const std::string dir = model_dirs().front();
  const auto backend = tools::make_cuda_tp_serving_backend(dir, kRanks, serving_shape(false), plow_binary());
  auto& group = dynamic_cast<TensorParallelBackend&>(*backend);
  const pid_t pid = dynamic_cast<RemoteRankBackend&>(group.rank(1)).pid();
  StepInputs step;
  step.token_ids = {3, 5, 7};
  step.sequences = {{0, 3}};
  ASSERT_EQ(backend->step(step).rows, 1);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 1200 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!done) {
      std::fprintf(stderr, "the step after rank 1 was killed did not end within 120 s: the group hangs\n");
      std::_Exit(3);
    }
  });
  step.token_ids = {9};
  step.sequences = {{0, 1}};
  std::string message;
  try {
    backend->step(step);
  } catch (const Error& e) {
    message = e.what();
  }
  done = true;
  watchdog.join();
  EXPECT_NE(message.find(fmt::format("tensor-parallel rank 1 (pid {}) exited: killed by signal 9", pid)), std::string::npos) << message;
}

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

// `cuda_tp_tests --rank R ID_FILE DIR BATCH EAGER PEER OUT` is one rank's process; otherwise the tests.
int main(int argc, char** argv) {
  if (argc == 9 && std::string(argv[1]) == "--rank") {
    try {
      return plow::run_rank(std::stoi(argv[2]), argv[3], argv[4], std::stoi(argv[5]), std::string(argv[6]) == "1", std::string(argv[7]) == "1", argv[8]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %s: %s\n", argv[2], e.what());
      return 1;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
