// Prefix cache: the page pool's reference counts, the radix tree's sharing, matching, LRU eviction
// and locks (integrity checked after every operation), and the property that matters: a cache hit
// gives exactly the logits of a cold run of the same tokens.
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "core/error.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/page_pool.h"
#include "engine/plans.h"
#include "engine/prefix_cache.h"
#include "engine/scheduler.h"
#include "runtime/cpu/interpreter.h"

namespace {

using namespace plow;

// A backend whose state is a pure function of the tokens consumed: one fixed-size state (a running
// hash in 3 floats) and one per-token state (2 floats per token), so restores can be checked exactly.
class FakeBackend : public Backend {
 public:
  explicit FakeBackend(int slots) : slots_(static_cast<size_t>(slots)) {}
  StepOutput step(const StepInputs& inputs) override {
    size_t at = 0;
    for (const SequenceStep& seq : inputs.sequences) {
      for (int64_t t = 0; t < seq.query_tokens; ++t) consume(slots_[static_cast<size_t>(seq.slot)], inputs.token_ids[at++]);
    }
    StepOutput out;
    out.rows = static_cast<int64_t>(inputs.sequences.size());
    out.vocab = 4;
    for (const SequenceStep& seq : inputs.sequences) {
      const Slot& s = slots_[static_cast<size_t>(seq.slot)];
      for (int i = 0; i < 4; ++i) out.logits.push_back(s.fixed[static_cast<size_t>(i % 3)] + static_cast<float>(i));
    }
    return out;
  }
  void reset_slot(int slot) override { slots_.at(static_cast<size_t>(slot)) = Slot{}; }
  int64_t context_tokens(int slot) const override { return static_cast<int64_t>(slots_.at(static_cast<size_t>(slot)).rows.size() / 2); }
  int num_slots() const override { return static_cast<int>(slots_.size()); }
  DType act_dtype() const override { return DType::F32; }
  bool has_snapshots() const override { return true; }
  SlotSnapshot save_slot(int slot, int64_t rows_begin) const override {
    const Slot& s = slots_.at(static_cast<size_t>(slot));
    SlotSnapshot snap;
    snap.tokens = context_tokens(slot);
    snap.rows_begin = rows_begin;
    snap.row_floats = {0, 2};
    snap.fixed = {s.fixed, {}};
    snap.rows = {{}, std::vector<float>(s.rows.begin() + rows_begin * 2, s.rows.end())};
    return snap;
  }
  void restore_slot(int slot, const SlotSnapshot& snap) override {
    Slot& s = slots_.at(static_cast<size_t>(slot));
    s.fixed = snap.fixed[0];
    s.rows = snap.rows[1];
  }
  // A slot fed `tokens` from empty.
  void feed(int slot, const std::vector<int32_t>& tokens) {
    reset_slot(slot);
    for (int32_t t : tokens) consume(slots_[static_cast<size_t>(slot)], t);
  }

 private:
  struct Slot {
    std::vector<float> fixed = std::vector<float>(3, 0.0f);
    std::vector<float> rows;
  };
  static void consume(Slot& s, int32_t token) {
    const auto pos = static_cast<float>(s.rows.size() / 2);
    for (size_t i = 0; i < 3; ++i) s.fixed[i] = s.fixed[i] * 0.5f + static_cast<float>(token * (static_cast<int32_t>(i) + 1)) + pos;
    s.rows.push_back(static_cast<float>(token));
    s.rows.push_back(pos);
  }
  std::vector<Slot> slots_;
};

std::vector<int32_t> range_tokens(int32_t first, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(first + i);
  return out;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

void expect_same_state(const SlotSnapshot& a, const SlotSnapshot& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.fixed, b.fixed);
  EXPECT_EQ(a.rows, b.rows);
}

TEST(PagePool, ReferenceCountsAndDoubleFree) {
  PagePool pool(16, 4, 3);
  EXPECT_EQ(pool.page_bytes(), 16 * 4 * 4);
  const int32_t a = pool.allocate(), b = pool.allocate();
  EXPECT_NE(a, b);
  EXPECT_EQ(pool.pages_used(), 2);
  EXPECT_TRUE(pool.can_allocate(1));
  EXPECT_FALSE(pool.can_allocate(2));
  pool.ref(a);
  EXPECT_EQ(pool.refs(a), 2);
  pool.unref(a);
  pool.unref(a);
  EXPECT_EQ(pool.refs(a), 0);
  EXPECT_EQ(pool.pages_used(), 1);
  EXPECT_THROW(pool.unref(a), InternalError);  // freed twice
  EXPECT_THROW(pool.ref(a), InternalError);    // a free page has no holders to add to
  std::vector<int32_t> expected(3, 0);
  expected[static_cast<size_t>(b)] = 1;
  pool.check_integrity(&expected);
  expected[static_cast<size_t>(b)] = 2;  // a holder the pool does not know about: a leak in the caller's books
  EXPECT_THROW(pool.check_integrity(&expected), InternalError);
}

TEST(PrefixCache, MatchesTheLongestSnapshotAndRestoresExactly) {
  FakeBackend backend(2);
  PrefixCache cache(1 << 20, 4);
  const auto prompt = range_tokens(10, 11);  // 2 blocks + a tail of 3
  backend.feed(0, prompt);
  ASSERT_TRUE(cache.insert(prompt, backend, 0));
  cache.check_integrity();
  EXPECT_EQ(cache.stats().nodes, 2);
  EXPECT_EQ(cache.stats().entries, 1);

  const auto longer = concat(prompt, range_tokens(50, 6));
  EXPECT_FALSE(cache.match(longer, 10).has_value());  // the only snapshot is at 11 tokens
  auto hit = cache.match(longer, static_cast<int64_t>(longer.size()) - 1);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->tokens, 11);
  backend.feed(1, prompt);
  expect_same_state(cache.materialize(*hit), backend.save_slot(1, 0));

  // A prompt that diverges inside the tail does not match; one that diverges in block 2 neither.
  auto diverged = prompt;
  diverged[9] = 999;
  EXPECT_FALSE(cache.match(diverged, 100).has_value());
  diverged = prompt;
  diverged[5] = 999;
  EXPECT_FALSE(cache.match(diverged, 100).has_value());

  // A turn end deeper in the same conversation: the longer snapshot wins, the blocks are shared.
  backend.feed(0, longer);
  ASSERT_TRUE(cache.insert(longer, backend, 0));
  cache.check_integrity();
  EXPECT_EQ(cache.stats().nodes, 4);  // 17 tokens = 4 blocks of 4 + 1
  hit = cache.match(concat(longer, {7}), 100);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->tokens, 17);
  backend.feed(1, longer);
  expect_same_state(cache.materialize(*hit), backend.save_slot(1, 0));
  // Re-inserting the same tokens keeps one entry.
  ASSERT_TRUE(cache.insert(longer, backend, 1));
  EXPECT_EQ(cache.stats().entries, 2);
  cache.check_integrity();
}

TEST(PrefixCache, SharedPrefixPagesAreStoredOnce) {
  FakeBackend backend(1);
  PrefixCache cache(1 << 20, 4);
  const auto system = range_tokens(100, 12);  // 3 blocks shared by every conversation
  for (int user = 0; user < 5; ++user) {
    const auto prompt = concat(system, range_tokens(200 + user * 10, 5));  // 1 own block + a tail of 1
    backend.feed(0, prompt);
    ASSERT_TRUE(cache.insert(prompt, backend, 0));
    cache.check_integrity();
  }
  EXPECT_EQ(cache.stats().pages_used, 3 + 5);
  EXPECT_EQ(cache.stats().entries, 5);
}

TEST(PrefixCache, EvictsLeastRecentlyUsedUnderTheBudget) {
  FakeBackend backend(1);
  // Page: 4 tokens × 2 floats × 4 bytes = 32 B; an entry with a tail of 1: (3 + 2) floats = 20 B.
  // Each 9-token prompt: 2 pages + 20 B = 84 B. The budget holds two of them.
  PrefixCache cache(200, 4);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(range_tokens(1000 * (i + 1), 9));
  for (int i = 0; i < 2; ++i) {
    backend.feed(0, prompts[static_cast<size_t>(i)]);
    ASSERT_TRUE(cache.insert(prompts[static_cast<size_t>(i)], backend, 0));
  }
  EXPECT_EQ(cache.stats().bytes_used, 168);
  ASSERT_TRUE(cache.match(concat(prompts[0], {1}), 100).has_value());  // prompt 0 is now the most recent
  backend.feed(0, prompts[2]);
  ASSERT_TRUE(cache.insert(prompts[2], backend, 0));
  cache.check_integrity();
  EXPECT_EQ(cache.stats().evictions, 1);
  EXPECT_TRUE(cache.match(concat(prompts[0], {1}), 100).has_value());
  EXPECT_FALSE(cache.match(concat(prompts[1], {1}), 100).has_value());  // the least recently used went
  EXPECT_EQ(cache.stats().pages_used, 4);

  // A locked path survives eviction: its pages are referenced by the lock as well as the tree.
  auto hit = cache.match(concat(prompts[2], {1}), 100);
  ASSERT_TRUE(hit.has_value());
  cache.lock(hit->node);
  cache.check_integrity();
  for (int i : {3, 0}) {
    backend.feed(0, prompts[static_cast<size_t>(i)]);
    cache.insert(prompts[static_cast<size_t>(i)], backend, 0);
    cache.check_integrity();
  }
  EXPECT_GE(cache.stats().pages_used, 2);
  EXPECT_LE(cache.stats().bytes_used, 200);
  cache.unlock(hit->node);
  cache.check_integrity();
  EXPECT_EQ(cache.stats().locks, 0);

  // Larger than the whole budget: refused, nothing changes.
  const auto huge = range_tokens(5000, 40);
  backend.feed(0, huge);
  const PrefixCacheStats before = cache.stats();
  EXPECT_FALSE(cache.insert(huge, backend, 0));
  EXPECT_EQ(cache.stats().bytes_used, before.bytes_used);
  cache.check_integrity();
}

// --- Hits on the CPU reference: the logits of a hit equal a cold run of the same tokens. ---

// Forwards to a backend and records, per slot, the logits row of every sequence in every step.
class RecordingBackend : public Backend {
 public:
  explicit RecordingBackend(Backend& inner) : inner_(inner) {}
  StepOutput step(const StepInputs& inputs) override {
    StepOutput out = inner_.step(inputs);
    for (size_t i = 0; i < inputs.sequences.size(); ++i) {
      const float* row = out.logits.data() + static_cast<int64_t>(i) * out.vocab;
      rows[inputs.sequences[i].slot].emplace_back(row, row + out.vocab);
    }
    return out;
  }
  void reset_slot(int slot) override {
    rows[slot].clear();
    inner_.reset_slot(slot);
  }
  int64_t context_tokens(int slot) const override { return inner_.context_tokens(slot); }
  int num_slots() const override { return inner_.num_slots(); }
  DType act_dtype() const override { return inner_.act_dtype(); }
  bool has_snapshots() const override { return inner_.has_snapshots(); }
  SlotSnapshot save_slot(int slot, int64_t rows_begin) const override { return inner_.save_slot(slot, rows_begin); }
  void restore_slot(int slot, const SlotSnapshot& snapshot) override { inner_.restore_slot(slot, snapshot); }

  std::map<int, std::vector<std::vector<float>>> rows;

 private:
  Backend& inner_;
};

class PrefixCacheHitTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { model_ = LoadedModel::load(std::string(PLOW_TEST_DATA) + "/tiny-kimi-linear").release(); }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static LoadedModel* model_;
};

LoadedModel* PrefixCacheHitTest::model_ = nullptr;

struct Turn {
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  int64_t cached = -1;
  std::vector<std::vector<float>> logits;  // the rows that were sampled: last prompt token, then each decode
};

// One request through the scheduler; records what it produced and the rows its slot saw.
Turn run_turn(Scheduler& scheduler, RecordingBackend& backend, const std::vector<int32_t>& prompt, int64_t max_tokens) {
  Turn turn;
  turn.prompt = prompt;
  Request r;
  r.id = "turn";
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  scheduler.submit(r, [&](int32_t token, const SampledToken&, std::optional<FinishReason>) { turn.output.push_back(token); },
                   [&](int64_t cached) { turn.cached = cached; });
  while (scheduler.has_work()) {
    scheduler.step();
    scheduler.check_integrity();
  }
  turn.logits = backend.rows[0];  // one slot: the conversation always runs in slot 0
  return turn;
}

TEST_F(PrefixCacheHitTest, MultiTurnHitsEqualAColdRunBitForBit) {
  ReferenceBackend reference(model_->graph, *model_->weights, DType::F32, 1);
  RecordingBackend recording(reference);
  Scheduler scheduler(recording, {.max_step_tokens = 256, .max_prefill_chunk = 256, .prefix_cache_bytes = 64 << 20, .prefix_cache_block_tokens = 16});
  const int64_t max_tokens = 6;
  std::vector<Turn> turns;
  std::vector<int32_t> prompt = range_tokens(3, 37);
  for (int t = 0; t < 3; ++t) {
    recording.rows.clear();
    turns.push_back(run_turn(scheduler, recording, prompt, max_tokens));
    const Turn& turn = turns.back();
    ASSERT_EQ(turn.output.size(), static_cast<size_t>(max_tokens));
    // The next turn: this conversation, the reply, and a new user message.
    prompt = concat(concat(turn.prompt, turn.output), range_tokens(40 + 9 * t, 19 + t));
  }
  // Turn 1 is cold; turns 2 and 3 resume at the previous turn's end (prompt + all but the last reply token).
  EXPECT_EQ(turns[0].cached, 0);
  for (size_t t = 1; t < turns.size(); ++t) {
    EXPECT_EQ(turns[t].cached, static_cast<int64_t>(turns[t - 1].prompt.size() + turns[t - 1].output.size()) - 1) << "turn " << t;
  }
  const PrefixCacheCounters counters = scheduler.prefix_cache_counters();
  EXPECT_EQ(counters.hit_tokens, turns[1].cached + turns[2].cached);
  EXPECT_EQ(counters.queried_tokens, static_cast<int64_t>(turns[0].prompt.size() + turns[1].prompt.size() + turns[2].prompt.size()));

  // Cold, with the same step boundaries as the chain of turns (KDA's chunked prefill rounds at its
  // chunk boundaries, so the cold run must split where the turns did to be comparable bit for bit):
  // one fresh slot fed each turn's uncached prompt part in one step, then its reply one token a step.
  ReferenceBackend cold(model_->graph, *model_->weights, DType::F32, 1);
  int64_t consumed = 0;
  for (const Turn& turn : turns) {
    ASSERT_EQ(cold.context_tokens(0), std::max<int64_t>(turn.cached, 0));
    std::vector<std::vector<float>> rows;
    StepInputs prefill;
    prefill.token_ids.assign(turn.prompt.begin() + consumed, turn.prompt.end());
    prefill.sequences = {{0, static_cast<int64_t>(prefill.token_ids.size())}};
    rows.push_back(cold.step(prefill).logits);
    for (size_t i = 0; i + 1 < turn.output.size(); ++i) {
      StepInputs decode;
      decode.token_ids = {turn.output[i]};
      decode.sequences = {{0, 1}};
      rows.push_back(cold.step(decode).logits);
    }
    consumed = static_cast<int64_t>(turn.prompt.size() + turn.output.size()) - 1;
    ASSERT_EQ(rows.size(), turn.logits.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      ASSERT_EQ(rows[i].size(), turn.logits[i].size());
      EXPECT_EQ(0, std::memcmp(rows[i].data(), turn.logits[i].data(), rows[i].size() * sizeof(float)))
          << "turn of " << turn.prompt.size() << " tokens, row " << i << ": the hit's logits differ from the cold run's";
    }
  }

  // Cold in ONE prefill step (no split): KDA chunk boundaries move, so the logits agree to fp32
  // rounding only (docs/architecture.md: split prefill ≈ 2e-6 on KDA outputs), and greedy tokens match.
  const Turn& last = turns.back();
  ReferenceBackend whole(model_->graph, *model_->weights, DType::F32, 1);
  GenerateOptions options;
  options.prompt = last.prompt;
  options.max_new_tokens = max_tokens;
  options.keep_logits = true;
  const GenerateResult result = generate(whole, 0, options);
  EXPECT_EQ(result.generated, last.output);
  const float* first = result.logits.data() + (static_cast<int64_t>(last.prompt.size()) - 1) * result.vocab;
  float max_diff = 0.0f;
  for (int64_t v = 0; v < result.vocab; ++v) max_diff = std::max(max_diff, std::abs(first[v] - last.logits[0][static_cast<size_t>(v)]));
  std::printf("hit vs unsplit cold run: max |Δlogit| %.2e\n", max_diff);
  EXPECT_LT(max_diff, 1e-4f);
}

// Prefill chunk ends inside a prompt are snapshots: a second prompt that shares only a long opening
// resumes at the last chunk end inside it. The scheduler splits a cold prompt at the same chunk ends,
// so the hit's logits equal the cold run's through the same scheduler bit for bit.
TEST_F(PrefixCacheHitTest, ChunkEndsInsideAPromptServeOtherPrompts) {
  const SchedulerOptions cached{.max_step_tokens = 32, .max_prefill_chunk = 32, .prefix_cache_bytes = 64 << 20, .prefix_cache_block_tokens = 16};
  SchedulerOptions cold_options = cached;
  cold_options.prefix_cache_bytes = 0;
  const auto system = range_tokens(3, 70);
  const auto a = concat(system, range_tokens(100, 5)), b = concat(system, range_tokens(150, 9));

  ReferenceBackend reference(model_->graph, *model_->weights, DType::F32, 1);
  RecordingBackend recording(reference);
  Scheduler scheduler(recording, cached);
  run_turn(scheduler, recording, a, 3);
  recording.rows.clear();
  const Turn hit = run_turn(scheduler, recording, b, 3);
  EXPECT_EQ(hit.cached, 64);  // chunk ends at 32 and 64 lie inside the shared 70 tokens

  ReferenceBackend fresh(model_->graph, *model_->weights, DType::F32, 1);
  RecordingBackend cold_recording(fresh);
  Scheduler cold_scheduler(cold_recording, cold_options);
  Turn cold = run_turn(cold_scheduler, cold_recording, b, 3);
  EXPECT_EQ(cold.cached, 0);
  EXPECT_EQ(hit.output, cold.output);
  // The cold run also recorded its two inner chunks (no logits sampled there): compare the sampled rows.
  ASSERT_EQ(cold.logits.size(), hit.logits.size() + 2);
  cold.logits.erase(cold.logits.begin(), cold.logits.begin() + 2);
  for (size_t i = 0; i < hit.logits.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(hit.logits[i].data(), cold.logits[i].data(), hit.logits[i].size() * sizeof(float))) << "row " << i;
  }
}

TEST_F(PrefixCacheHitTest, SharedSystemPromptAcrossConcurrentUsersEqualsSolo) {
  ReferenceBackend reference(model_->graph, *model_->weights, DType::F32, 4);
  Scheduler scheduler(reference, {.max_step_tokens = 64, .max_prefill_chunk = 64, .prefix_cache_bytes = 64 << 20, .prefix_cache_block_tokens = 16});
  const auto system = range_tokens(5, 40);
  // Warm the cache with the system prompt alone (its prompt end is a snapshot point).
  Request warm{"warm", system, {}, 2, {}};
  scheduler.submit(warm, [](int32_t, const SampledToken&, std::optional<FinishReason>) {});
  while (scheduler.has_work()) scheduler.step();
  std::map<std::string, std::vector<int32_t>> out;
  std::map<std::string, int64_t> cached;
  std::vector<Request> users;
  for (int u = 0; u < 6; ++u) {
    Request r{fmt::format("u{}", u), concat(system, range_tokens(60 + u * 3, 3 + u)), {}, 4, {}};
    users.push_back(r);
    scheduler.submit(r, [&out, id = r.id](int32_t t, const SampledToken&, std::optional<FinishReason>) { out[id].push_back(t); },
                     [&cached, id = r.id](int64_t c) { cached[id] = c; });
  }
  while (scheduler.has_work()) {
    scheduler.step();
    scheduler.check_integrity();
  }
  for (const Request& r : users) {
    EXPECT_EQ(cached.at(r.id), 40) << r.id;
    // Alone and cold, prefilled as the hit was: the system prompt in one step, then the rest.
    ReferenceBackend solo(model_->graph, *model_->weights, DType::F32, 1);
    StepInputs step;
    step.token_ids = system;
    step.sequences = {{0, 40}};
    solo.step(step);
    step.token_ids.assign(r.prompt.begin() + 40, r.prompt.end());
    step.sequences = {{0, static_cast<int64_t>(step.token_ids.size())}};
    std::vector<int32_t> greedy;
    for (int n = 0; n < 4; ++n) {
      greedy.push_back(argmax(solo.step(step).logits));
      step.token_ids = {greedy.back()};
      step.sequences = {{0, 1}};
    }
    EXPECT_EQ(greedy, out.at(r.id)) << r.id;
  }
  EXPECT_EQ(scheduler.prefix_cache()->stats().locks, 0);
  EXPECT_EQ(scheduler.free_slots(), 4);
}

TEST_F(PrefixCacheHitTest, PlanInterpreterRestoresBitExactly) {
  InterpreterOptions options;
  options.workers = 2;
  options.num_slots = 2;
  options.max_context_tokens = 64;
  std::vector<Plan> plans;
  plans.push_back(compile_plan(*model_, PlanPhase::kDecode, 2, 2, 64));
  plans.push_back(compile_plan(*model_, PlanPhase::kPrefill, 32, 2, 64));
  PlanInterpreter interp(*model_->weights, std::move(plans), options);
  StepInputs prompt;
  prompt.token_ids = range_tokens(7, 21);
  prompt.sequences = {{0, 21}};
  interp.step(prompt);
  interp.restore_slot(1, interp.save_slot(0, 0));
  EXPECT_EQ(interp.context_tokens(1), 21);
  StepInputs next;
  next.token_ids = {9, 9};
  next.sequences = {{0, 1}, {1, 1}};
  const StepOutput out = interp.step(next);
  ASSERT_EQ(out.rows, 2);
  EXPECT_EQ(0, std::memcmp(out.logits.data(), out.logits.data() + out.vocab, static_cast<size_t>(out.vocab) * sizeof(float)));
  // The reference, restored from the interpreter's snapshot, computes the same logits (they are
  // bit-identical backends).
  ReferenceBackend reference(model_->graph, *model_->weights, DType::F32, 1);
  reference.restore_slot(0, interp.save_slot(1, 0));
  StepInputs one;
  one.token_ids = {4};
  one.sequences = {{0, 1}};
  next.token_ids = {4};
  next.sequences = {{1, 1}};
  const StepOutput a = interp.step(next), b = reference.step(one);
  EXPECT_EQ(a.logits, b.logits);
  // A snapshot longer than the interpreter's context is refused by name.
  SlotSnapshot too_long = reference.save_slot(0, 0);
  too_long.tokens = 100;
  EXPECT_THROW(interp.restore_slot(0, too_long), Error);
}

}  // namespace
