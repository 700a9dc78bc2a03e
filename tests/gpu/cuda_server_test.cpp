// `plow serve --backend cuda` in-process on the GPU (label gpu): concurrent greedy requests give the
// CPU reference's tokens; the prefix cache works on the GPU (the cuda backend's slot snapshots): a
// multi-turn conversation hits, reports cached tokens, and answers exactly as a server without the
// cache; snapshots restore a slot bit-identically. PLOW_TEST_DATA in the environment overrides the
// compiled-in path (the GPU machine runs a copy).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <future>
#include <vector>

#include "engine/generate.h"
#include "engine/model.h"
#include "engine/plans.h"
#include "runtime/cuda/backend.h"
#include "server/server_test_util.h"

namespace plow {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

fs::path data_dir() {
  const char* env = std::getenv("PLOW_TEST_DATA");
  return env != nullptr ? env : PLOW_TEST_DATA;
}

// What `plow serve --backend cuda` builds (tools/cuda_commands.cpp make_cuda_serving_backend).
std::unique_ptr<Backend> cuda_serving_backend(const LoadedModel& model, int slots, int64_t max_context, int64_t step_tokens) {
  const int workers = cuda::CudaBackend::sm_count();
  cuda::CudaOptions options;
  options.act_dtype = model.weights->storage_dtype();
  options.num_slots = slots;
  options.max_context_tokens = max_context;
  return std::make_unique<cuda::CudaBackend>(model.graph, cuda::upload_weights(model.graph, *model.weights),
                                             compile_serving_plans(model, slots, max_context, step_tokens, workers, /*fuse_prefill=*/false), options);
}

json complete(const server_test::Running& running, const json& body) {
  auto c = running.client();
  auto res = c.Post("/v1/completions", body.dump(), "application/json");
  if (!res) return json{{"error", "no response"}};
  EXPECT_EQ(res->status, 200) << res->body;
  return json::parse(res->body);
}

TEST(CudaServer, ConcurrentGreedyRequestsGiveTheReferenceTokens) {
  const fs::path dir = server_test::make_model_dir(data_dir());
  const auto model = LoadedModel::load(dir.string());
  ServeOptions options;
  options.model_dir = dir.string();
  options.num_slots = 4;
  options.make_backend = cuda_serving_backend;
  server_test::Running running(options);
  std::vector<std::future<json>> futures;
  auto ids = [](int i) { return std::vector<int32_t>{static_cast<int32_t>(5 + i), 17, static_cast<int32_t>(42 + 3 * i), 99, 7}; };
  for (int i = 0; i < 8; ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] {
      return complete(running, {{"prompt", ids(i)}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}});
    }));
  }
  for (int i = 0; i < 8; ++i) {
    ReferenceBackend reference(model->graph, *model->weights, model->weights->storage_dtype(), 1);
    GenerateOptions g;
    g.prompt = ids(i);
    g.max_new_tokens = 12;
    const json got = futures[static_cast<size_t>(i)].get();
    EXPECT_EQ(got["choices"][0]["token_ids"].get<std::vector<int32_t>>(), generate(reference, 0, g).generated) << "request " << i;
  }
  fs::remove_all(dir.parent_path());
}

// Three turns of one conversation: each prompt extends the previous prompt and answer. With the prefix
// cache the later turns hit (cached_tokens > 0, /metrics counts the hits) and answer exactly as a
// server without the cache does.
TEST(CudaServer, MultiTurnPrefixHitsAnswerAsAColdServer) {
  const fs::path dir = server_test::make_model_dir(data_dir());
  auto run_conversation = [&](int64_t cache_mb, std::vector<int64_t>* cached, std::string* metrics) {
    ServeOptions options;
    options.model_dir = dir.string();
    options.num_slots = 2;
    options.prefix_cache_mb = cache_mb;
    options.make_backend = cuda_serving_backend;
    server_test::Running running(options);
    std::vector<int32_t> conversation;
    for (int i = 0; i < 40; ++i) conversation.push_back((i * 37 + 11) % 256);
    std::vector<std::vector<int32_t>> answers;
    for (int turn = 0; turn < 3; ++turn) {
      const json out = complete(running, {{"prompt", conversation}, {"max_tokens", 10}, {"temperature", 0}, {"ignore_eos", true}});
      const auto answer = out["choices"][0]["token_ids"].get<std::vector<int32_t>>();
      answers.push_back(answer);
      if (cached) cached->push_back(out["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>());
      conversation.insert(conversation.end(), answer.begin(), answer.end());
      for (int i = 0; i < 9; ++i) conversation.push_back((turn * 53 + i * 7 + 3) % 256);  // the next user message
    }
    if (metrics) *metrics = running.client().Get("/metrics")->body;
    return answers;
  };
  std::vector<int64_t> cached;
  std::string metrics;
  const auto warm = run_conversation(64, &cached, &metrics);
  const auto cold = run_conversation(0, nullptr, nullptr);
  EXPECT_EQ(warm, cold);
  ASSERT_EQ(cached.size(), 3u);
  EXPECT_EQ(cached[0], 0);
  EXPECT_GT(cached[1], 0);
  EXPECT_GT(cached[2], cached[1]);
  EXPECT_NE(metrics.find("prefix_cache_hits"), std::string::npos);
  fs::remove_all(dir.parent_path());
}

// A snapshot of a slot after a prompt, restored into another slot: both continue with the same logits,
// bit for bit; a snapshot of another shape is refused.
TEST(CudaServer, SlotSnapshotsRestoreBitIdentically) {
  const auto model = LoadedModel::load((data_dir() / "tiny-kimi-linear").string());
  auto backend = cuda_serving_backend(*model, 2, 128, 32);
  StepInputs prompt;
  prompt.token_ids = {5, 9, 11, 3, 7, 2, 8, 40, 41};
  prompt.sequences = {{0, 9}};
  backend->step(prompt);
  const SlotSnapshot snap = backend->save_slot(0, 0);
  EXPECT_EQ(snap.tokens, 9);
  backend->restore_slot(1, snap);
  EXPECT_EQ(backend->context_tokens(1), 9);
  StepInputs next;
  next.token_ids = {4, 4};
  next.sequences = {{0, 1}, {1, 1}};
  const StepOutput out = backend->step(next);
  const std::vector<float> a(out.logits.begin(), out.logits.begin() + out.vocab), b(out.logits.begin() + out.vocab, out.logits.end());
  EXPECT_EQ(a, b);
  const SlotSnapshot tail = backend->save_slot(0, 4);
  EXPECT_EQ(tail.rows_begin, 4);
  EXPECT_THROW(backend->restore_slot(1, tail), Error);
  SlotSnapshot wrong = snap;
  wrong.fixed.pop_back();
  EXPECT_THROW(backend->restore_slot(1, wrong), Error);
}

}  // namespace
}  // namespace plow
