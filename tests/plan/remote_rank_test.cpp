// A tensor-parallel rank behind a socket (engine/remote_rank, issue F: `plow serve --tp N --backend
// cuda` runs ranks 1..N−1 as processes): the worker loop over CPU backends of the fixtures, in a child
// process of this binary (`--rank-worker`) or on a thread.
//  - a proxy's steps (batch 1 and 3, prefill, decode, all_logits) equal the same backend in this
//    process bit for bit, and so do context_tokens, reset, save_slot and restore_slot;
//  - a worker that exits or is killed mid-step, or fails to start, is a plow::Error naming the rank,
//    its pid and how it ended; a malformed reply or request is an error, never a hang or a crash;
//  - an abort reaches a rank whose step is waiting; TensorParallelBackend over [rank 0 in process,
//    a proxy of rank 1 served by a thread] equals the in-process ranks (the LocalGroup joining them
//    cannot cross processes; the process mode with NCCL is tests/gpu/cuda_tp_test.cpp's).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/error.h"
#include "engine/rank_wire.h"
#include "engine/remote_rank.h"
#include "engine/tensor_parallel.h"
#include "plan_test_util.h"
#include "runtime/cpu/local_group.h"
#include "runtime/cpu/reference.h"

namespace plow::plan_test {
namespace {

constexpr int kSlots = 3;
constexpr int64_t kMaxContext = 128;
constexpr int kWorkers = 2;

std::string fixture_dir(const std::string& fixture) { return (fs::path(PLOW_TEST_DATA) / fixture).string(); }

// "reference" or "plan" (interpreter) over `model`, in the model's dtype.
std::unique_ptr<Backend> local_backend(const LoadedModel& model, const std::string& kind, Collective* collective = nullptr) {
  const DType act = model.weights->storage_dtype();
  if (kind == "reference") return std::make_unique<ReferenceBackend>(model.graph, *model.weights, act, kSlots, collective);
  return make_plan_interpreter(model, compile_serving_plans(model, kSlots, kMaxContext, 32, kWorkers), kWorkers, act, kSlots, kMaxContext, collective);
}

// A worker's backend that ends its process at the `at`-th step: _exit(7), or SIGKILL.
class DyingBackend : public Backend {
 public:
  DyingBackend(std::unique_ptr<Backend> inner, int at, bool kill) : inner_(std::move(inner)), at_(at), kill_(kill) {}
  StepOutput step(const StepInputs& inputs) override {
    if (++steps_ == at_) {
      if (kill_) raise(SIGKILL);
      _exit(7);
    }
    return inner_->step(inputs);
  }
  void reset_slot(int slot) override { inner_->reset_slot(slot); }
  int64_t context_tokens(int slot) const override { return inner_->context_tokens(slot); }
  int num_slots() const override { return inner_->num_slots(); }
  DType act_dtype() const override { return inner_->act_dtype(); }

 private:
  std::unique_ptr<Backend> inner_;
  int at_, steps_ = 0;
  bool kill_;
};

// `remote_rank_tests --rank-worker FD DIR KIND FAULT`: serves KIND over DIR's model on FD (FAULT:
// none, exit-at-2, kill-at-2).
int run_worker(int fd, const std::string& dir, const std::string& kind, const std::string& fault) {
  std::unique_ptr<LoadedModel> model;
  std::unique_ptr<Backend> backend;
  try {
    model = LoadedModel::load(dir);
    backend = local_backend(*model, kind);
  } catch (const std::exception& e) {
    report_rank_failure(fd, e.what());
    return 1;
  }
  if (fault != "none") backend = std::make_unique<DyingBackend>(std::move(backend), 2, fault == "kill-at-2");
  serve_rank(fd, *backend, [] {});
  return 0;
}

std::unique_ptr<RemoteRankBackend> start_worker(const std::string& dir, const std::string& kind, const std::string& fault = "none") {
  auto remote = RemoteRankBackend::spawn(1, [&](int fd) { return std::vector<std::string>{"/proc/self/exe", "--rank-worker", std::to_string(fd), dir, kind, fault}; });
  remote->await("ready");
  return remote;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

void expect_same_snapshot(const SlotSnapshot& a, const SlotSnapshot& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.rows_begin, b.rows_begin);
  EXPECT_EQ(a.row_floats, b.row_floats);
  ASSERT_EQ(a.fixed.size(), b.fixed.size());
  ASSERT_EQ(a.rows.size(), b.rows.size());
  for (size_t i = 0; i < a.fixed.size(); ++i) EXPECT_TRUE(same_bits(a.fixed[i], b.fixed[i])) << "state " << i;
  for (size_t i = 0; i < a.rows.size(); ++i) EXPECT_TRUE(same_bits(a.rows[i], b.rows[i])) << "state " << i;
}

StepInputs make_step(const std::vector<std::pair<int, int64_t>>& sequences, int64_t vocab, int seed, bool all_logits = false) {
  StepInputs step;
  for (const auto& [slot, tokens] : sequences) {
    step.sequences.push_back({slot, tokens});
    for (int64_t t = 0; t < tokens; ++t) step.token_ids.push_back(static_cast<int32_t>((seed * 131 + slot * 17 + t * 7 + 3) % vocab));
  }
  step.all_logits = all_logits;
  return step;
}

// Batch 1 prefill and decode, then batch 3 mixing decode with prefills, decodes, and an all_logits
// step with a chunk: the same steps on both backends, outputs and context lengths equal bit for bit.
void expect_same_steps(Backend& remote, Backend& local, int64_t vocab) {
  const std::vector<StepInputs> steps = {
      make_step({{0, 7}}, vocab, 1),         make_step({{0, 1}}, vocab, 2),         make_step({{0, 1}, {1, 5}, {2, 9}}, vocab, 3),
      make_step({{0, 1}, {1, 1}, {2, 1}}, vocab, 4), make_step({{2, 1}, {0, 1}, {1, 1}}, vocab, 5), make_step({{1, 1}, {2, 3}}, vocab, 6, true)};
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepOutput got = remote.step(steps[i]), want = local.step(steps[i]);
    EXPECT_EQ(got.rows, want.rows) << "step " << i;
    EXPECT_EQ(got.vocab, want.vocab) << "step " << i;
    EXPECT_TRUE(same_bits(got.logits, want.logits)) << "step " << i << ": max |diff| " << max_abs_diff(got.logits, want.logits);
    for (int slot = 0; slot < kSlots; ++slot) EXPECT_EQ(remote.context_tokens(slot), local.context_tokens(slot)) << "step " << i;
  }
}

class RemoteRankVsLocal : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(RemoteRankVsLocal, StepsAndSlotCallsEqualTheBackendInThisProcess) {
  const auto& [fixture, kind] = GetParam();
  Watchdog watchdog(std::chrono::seconds(120), "remote rank vs local");
  const LoadedModel& model = fixture_model(fixture);
  const auto local = local_backend(model, kind);
  const auto remote = start_worker(fixture_dir(fixture), kind);
  EXPECT_EQ(remote->num_slots(), kSlots);
  EXPECT_EQ(remote->act_dtype(), local->act_dtype());
  EXPECT_TRUE(remote->has_snapshots());
  expect_same_steps(*remote, *local, model.config.vocab_size);

  // Snapshots: whole and from a row, restored into a reset slot, continue as the slot they came from.
  const SlotSnapshot snap = remote->save_slot(2, 0);
  expect_same_snapshot(snap, local->save_slot(2, 0));
  expect_same_snapshot(remote->save_slot(2, 4), local->save_slot(2, 4));
  remote->reset_slot(1);
  local->reset_slot(1);
  EXPECT_EQ(remote->context_tokens(1), 0);
  remote->restore_slot(1, snap);
  local->restore_slot(1, snap);
  EXPECT_EQ(remote->context_tokens(1), snap.tokens);
  const StepInputs next = make_step({{1, 1}, {2, 1}}, model.config.vocab_size, 9);
  StepInputs twin = next;
  twin.token_ids[1] = twin.token_ids[0];
  const StepOutput got = remote->step(twin), want = local->step(twin);
  EXPECT_TRUE(same_bits(got.logits, want.logits));
  const auto vocab = static_cast<ptrdiff_t>(got.vocab);
  EXPECT_TRUE(same_bits({got.logits.begin(), got.logits.begin() + vocab}, {got.logits.begin() + vocab, got.logits.end()})) << "the restored slot";

  // The rank's own errors come back as errors naming it; the proxy stays usable.
  SlotSnapshot wrong = snap;
  wrong.fixed.pop_back();
  wrong.rows.pop_back();
  wrong.row_floats.pop_back();
  EXPECT_THROW(local->restore_slot(0, wrong), Error);
  try {
    remote->restore_slot(0, wrong);
    ADD_FAILURE() << "a snapshot of the wrong shape was restored";
  } catch (const Error& e) {
    EXPECT_TRUE(std::string(e.what()).starts_with("tensor-parallel rank 1: ")) << e.what();
  }
  EXPECT_THROW(remote->step(make_step({{kSlots, 1}}, model.config.vocab_size, 1)), Error);  // no such slot
  EXPECT_EQ(remote->context_tokens(2), local->context_tokens(2));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RemoteRankVsLocal,
                         ::testing::Combine(::testing::Values("tiny-kimi-linear", "tiny-kimi-linear-tied-qlora", "tiny-k3"), ::testing::Values("reference", "plan")),
                         [](const auto& param_info) {
                           std::string name = std::get<0>(param_info.param) + "_" + std::get<1>(param_info.param);
                           for (char& ch : name) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return name;
                         });

class RemoteRankDeath : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

// The worker's process ends inside its second step: that step and every later call fail at once
// with the rank, its pid and how it ended.
TEST_P(RemoteRankDeath, AWorkerThatDiesMidStepIsAnErrorNamingIt) {
  const auto& [fault, ending] = GetParam();
  Watchdog watchdog(std::chrono::seconds(60), "dying worker");
  const auto remote = start_worker(fixture_dir("tiny-kimi-linear"), "reference", fault);
  const int64_t vocab = fixture_model("tiny-kimi-linear").config.vocab_size;
  EXPECT_EQ(remote->step(make_step({{0, 4}}, vocab, 1)).rows, 1);
  std::string message;
  try {
    remote->step(make_step({{0, 1}}, vocab, 2));
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_TRUE(message.starts_with("tensor-parallel rank 1 (pid ")) << message;
  EXPECT_NE(message.find("exited: " + ending), std::string::npos) << message;
  EXPECT_NE(message.find("during step"), std::string::npos) << message;
  try {
    remote->reset_slot(0);
    ADD_FAILURE() << "a call to a dead rank succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

INSTANTIATE_TEST_SUITE_P(Endings, RemoteRankDeath,
                         ::testing::Values(std::pair<std::string, std::string>{"exit-at-2", "exit status 7"},
                                           std::pair<std::string, std::string>{"kill-at-2", "killed by signal 9"}),
                         [](const auto& param_info) { return param_info.param.first == "exit-at-2" ? std::string("exit") : std::string("kill"); });

TEST(RemoteRank, AWorkerThatCannotStartSaysWhy) {
  Watchdog watchdog(std::chrono::seconds(60), "worker that cannot start");
  try {
    start_worker("/nonexistent/plow-model", "reference");
    ADD_FAILURE() << "a worker without a model started";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_TRUE(message.starts_with("tensor-parallel rank 1 (pid ")) << message;
    EXPECT_NE(message.find("failed to start: "), std::string::npos) << message;
    EXPECT_NE(message.find("/nonexistent/plow-model"), std::string::npos) << message;
  }
}

// A socket pair: [0] for the proxy, [1] for whoever plays the rank.
std::array<int, 2> socket_pair() {
  int fds[2];
  PLOW_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0, "socketpair");
  return {fds[0], fds[1]};
}

void write_raw(int fd, uint64_t length, const std::vector<uint8_t>& payload) {
  uint8_t header[8];
  for (int i = 0; i < 8; ++i) header[i] = static_cast<uint8_t>(length >> (8 * i));
  ASSERT_EQ(write(fd, header, 8), 8);
  if (!payload.empty()) {
    ASSERT_EQ(write(fd, payload.data(), payload.size()), static_cast<ssize_t>(payload.size()));
  }
}

struct BadReply {
  std::string name;
  uint64_t length;  // 0: the payload's
  std::vector<uint8_t> payload;
};

std::vector<BadReply> bad_replies() {
  using rank_wire::json;
  const std::vector<float> five(5, 1.0f);
  std::vector<uint8_t> five_bytes(five.size() * sizeof(float));
  std::memcpy(five_bytes.data(), five.data(), five_bytes.size());
  return {{"not MessagePack", 0, {0xc1, 0xc1, 0xc1}},
          {"a length no frame has", uint64_t{1} << 40, {}},
          {"an array, not a map", 0, json::to_msgpack(json::array({1, 2}))},
          {"no logits", 0, json::to_msgpack(json{{"rows", 1}, {"vocab", 2}})},
          {"logits of the wrong size", 0, json::to_msgpack(json{{"rows", 2}, {"vocab", 3}, {"logits", json::binary(five_bytes)}})},
          {"logits as text", 0, json::to_msgpack(json{{"rows", 1}, {"vocab", 1}, {"logits", "1.0"}})}};
}

// The rank answers a step with a malformed frame: the proxy says so, names the rank, and does not
// read the stream again.
TEST(RemoteRank, AMalformedReplyIsAnError) {
  Watchdog watchdog(std::chrono::seconds(60), "malformed reply");
  for (const BadReply& bad : bad_replies()) {
    SCOPED_TRACE(bad.name);
    const auto [proxy_fd, rank_fd] = socket_pair();
    std::thread rank([&, fd = rank_fd] {
      rank_wire::write_frame(fd, {{"stage", "ready"}, {"slots", 1}, {"act_dtype", "F32"}, {"snapshots", false}});
      ASSERT_TRUE(rank_wire::read_frame(fd).has_value());
      write_raw(fd, bad.length ? bad.length : bad.payload.size(), bad.payload);
    });
    RemoteRankBackend remote(1, proxy_fd, 0);
    remote.await("ready");
    std::string message;
    try {
      remote.step(make_step({{0, 1}}, 8, 1));
    } catch (const Error& e) {
      message = e.what();
    }
    EXPECT_TRUE(message.starts_with("tensor-parallel rank 1: a malformed reply to step: ")) << message;
    rank.join();
    close(rank_fd);
    EXPECT_THROW(remote.context_tokens(0), Error);
  }
}

// The rank's side: a request it cannot use gets an error reply (the rank serves on); a frame that is
// not MessagePack gets one too, and then the rank stops reading a stream it cannot trust.
TEST(RemoteRank, AMalformedRequestGetsAnErrorReply) {
  Watchdog watchdog(std::chrono::seconds(60), "malformed request");
  using rank_wire::json;
  const auto [server_fd, rank_fd] = socket_pair();
  const auto backend = local_backend(fixture_model("tiny-kimi-linear"), "reference");
  std::thread rank([&, fd = rank_fd] { serve_rank(fd, *backend, [] {}); });
  ASSERT_EQ(rank_wire::read_frame(server_fd).value().at("stage"), "ready");
  auto ask = [&](const json& request) {
    EXPECT_TRUE(rank_wire::write_frame(server_fd, request));
    return rank_wire::read_frame(server_fd).value_or(json{{"eof", true}});
  };
  EXPECT_NE(ask({{"op", "fly"}}).value("error", "").find("unknown request 'fly'"), std::string::npos);
  const json odd_tokens = {{"op", "step"}, {"token_ids", json::binary({1, 2, 3})}, {"slots", json::array({0})}, {"query_tokens", json::array({1})}, {"all_logits", false}};
  EXPECT_NE(ask(odd_tokens).value("error", "").find("token_ids"), std::string::npos);
  EXPECT_NE(ask({{"op", "reset"}, {"slot", "zero"}}).value("error", "").find("slot"), std::string::npos);
  EXPECT_EQ(ask({{"op", "context"}, {"slot", 0}}), json({{"tokens", 0}}));
  write_raw(server_fd, 2, {0xc1, 0xc1});
  const std::optional<json> reply = rank_wire::read_frame(server_fd);
  ASSERT_TRUE(reply.has_value());
  EXPECT_NE(reply->value("error", "").find("a malformed request"), std::string::npos) << reply->dump();
  EXPECT_FALSE(rank_wire::read_frame(server_fd).has_value()) << "the rank kept reading after a malformed frame";
  rank.join();
  close(server_fd);
  close(rank_fd);
}

// A rank whose step waits (as in a collective whose peer failed) until it is aborted.
class WaitingBackend : public Backend {
 public:
  StepOutput step(const StepInputs&) override {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return aborted_; });
    fail("aborted while waiting for a peer");
  }
  void abort() {
    const std::lock_guard lock(mutex_);
    aborted_ = true;
    cv_.notify_all();
  }
  void reset_slot(int) override {}
  int64_t context_tokens(int) const override { return 0; }
  int num_slots() const override { return 1; }
  DType act_dtype() const override { return DType::F32; }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool aborted_ = false;
};

TEST(RemoteRank, AnAbortReachesARankInTheMiddleOfAStep) {
  Watchdog watchdog(std::chrono::seconds(60), "abort during a step");
  const auto [proxy_fd, rank_fd] = socket_pair();
  WaitingBackend waiting;
  std::thread rank([&, fd = rank_fd] { serve_rank(fd, waiting, [&] { waiting.abort(); }); });
  {
    RemoteRankBackend remote(1, proxy_fd, 0);
    remote.await("ready");
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      remote.abort_rank();
    });
    EXPECT_THROW(
        {
          try {
            remote.step(make_step({{0, 1}}, 8, 1));
          } catch (const Error& e) {
            EXPECT_STREQ(e.what(), "tensor-parallel rank 1: aborted while waiting for a peer");
            throw;
          }
        },
        Error);
    aborter.join();
  }  // the proxy closes its end: the rank's loop returns
  rank.join();
  close(rank_fd);
}

// TensorParallelBackend over rank 0 in this process and rank 1 behind a proxy (served by a thread:
// the LocalGroup joining them is in-process) equals the in-process group bit for bit, snapshots
// included; a failure of rank 1 comes back through the proxy as the group's error.
TEST(RemoteRank, ATensorParallelGroupWithAProxyRankEqualsTheLocalGroup) {
  Watchdog watchdog(std::chrono::seconds(120), "group with a proxy rank");
  const std::string dir = fixture_dir("tiny-kimi-linear-tied-qlora");
  auto group = std::make_shared<LocalGroup>(2);
  auto model1 = LoadedModel::load(dir, {1, 2});
  std::atomic<bool> fail_next{false};
  class Rank1 : public Backend {
   public:
    Rank1(std::unique_ptr<Backend> inner, std::atomic<bool>& fail_next) : inner_(std::move(inner)), fail_next_(fail_next) {}
    StepOutput step(const StepInputs& inputs) override {
      if (fail_next_.exchange(false)) fail("injected failure");
      return inner_->step(inputs);
    }
    void reset_slot(int slot) override { inner_->reset_slot(slot); }
    int64_t context_tokens(int slot) const override { return inner_->context_tokens(slot); }
    int num_slots() const override { return inner_->num_slots(); }
    DType act_dtype() const override { return inner_->act_dtype(); }
    bool has_snapshots() const override { return true; }
    SlotSnapshot save_slot(int slot, int64_t rows_begin) const override { return inner_->save_slot(slot, rows_begin); }
    void restore_slot(int slot, const SlotSnapshot& snapshot) override { inner_->restore_slot(slot, snapshot); }

   private:
    std::unique_ptr<Backend> inner_;
    std::atomic<bool>& fail_next_;
  } rank1(local_backend(*model1, "plan", &group->rank(1)), fail_next);
  const auto [proxy_fd, rank_fd] = socket_pair();
  std::thread worker([&, fd = rank_fd] { serve_rank(fd, rank1, [] {}); });  // the group is aborted here, by control
  {
    std::vector<TpRank> ranks(2);
    ranks[0].model = LoadedModel::load(dir, {0, 2});
    ranks[0].backend = local_backend(*ranks[0].model, "plan", &group->rank(0));
    auto remote = std::make_unique<RemoteRankBackend>(1, proxy_fd, 0);
    remote->await("ready");
    RemoteRankBackend* proxy = remote.get();
    ranks[1].backend = std::move(remote);
    TpGroupControl control;
    control.abort = [g = group.get(), proxy] {
      proxy->abort_rank();
      g->abort();
    };
    control.reset = [g = group.get()] { g->reset(); };
    TensorParallelBackend mixed(std::move(ranks), std::move(control));
    auto local = make_local_tp_backend(
        2, [&](TpShard shard) { return LoadedModel::load(dir, shard); },
        [&](const LoadedModel& model, Collective& collective) { return local_backend(model, "plan", &collective); });
    const int64_t vocab = fixture_model("tiny-kimi-linear-tied-qlora").config.vocab_size;
    expect_same_steps(mixed, *local, vocab);
    expect_same_snapshot(mixed.save_slot(2, 0), local->save_slot(2, 0));
    mixed.restore_slot(0, local->save_slot(2, 0));
    local->restore_slot(0, local->save_slot(2, 0));
    const StepInputs next = make_step({{0, 1}, {2, 1}}, vocab, 11);
    EXPECT_TRUE(same_bits(mixed.step(next).logits, local->step(next).logits));

    fail_next = true;
    try {
      mixed.step(make_step({{1, 1}}, vocab, 12));
      ADD_FAILURE() << "rank 1's failure did not fail the step";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "tensor-parallel rank 1: injected failure");
    }
    mixed.reset_slot(1);
    local->reset_slot(1);
    const StepInputs again = make_step({{1, 6}}, vocab, 13);
    EXPECT_TRUE(same_bits(mixed.step(again).logits, local->step(again).logits)) << "the group after a failed step";
  }
  worker.join();
  close(rank_fd);
}

}  // namespace
}  // namespace plow::plan_test

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "--rank-worker") {
    try {
      return plow::plan_test::run_worker(std::stoi(argv[2]), argv[3], argv[4], argv[5]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank worker: %s\n", e.what());
      return 1;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
