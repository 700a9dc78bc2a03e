// Continuous batching over one Backend: each step() builds ONE StepInputs that mixes the decode token
// of every running sequence with chunked prefill of newly admitted ones, under a per-step token budget.
// Request states: queued → prefilling → decoding → finished | aborted. Every slot is free or owned by
// exactly one running sequence (check_integrity() verifies it; tests call it after every step).
// With a prefix cache (options.prefix_cache_bytes > 0 and a backend with snapshots), admission
// restores the longest cached prefix that ends at a snapshot and leaves ≥ 1 prompt token to compute;
// snapshots are taken where a prefill chunk ends (inside the prompt and at its end) and when a
// sequence finishes (its turn end) or is aborted while decoding.
// Not thread-safe: the caller serializes submit/abort/step (the server holds one mutex).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "runtime/backend.h"

namespace plow {

enum class RequestState { kQueued, kPrefilling, kDecoding, kFinished, kAborted };
enum class FinishReason { kStop, kLength, kError };

const char* finish_reason_name(FinishReason reason);  // "stop", "length", "error"

struct Request {
  std::string id;
  std::vector<int32_t> prompt;   // token ids, non-empty
  SamplingParams sampling;       // seeded per request: the same request reproduces its tokens
  int64_t max_tokens = 16;       // ≥ 1
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
};

// Called on the scheduler's thread for every sampled token; `finished` is set on the last one.
// A step that throws finishes its sequences with kError (token −1, empty SampledToken).
using TokenCallback = std::function<void(int32_t token, const SampledToken& sampled, std::optional<FinishReason> finished)>;
// Called on the scheduler's thread when the request gets its slot: how many prompt tokens the prefix
// cache supplied (0 on a miss).
using AdmitCallback = std::function<void(int64_t cached_tokens)>;

struct SchedulerOptions {
  int64_t max_step_tokens = 256;    // tokens in one StepInputs (decode tokens + prefill chunks)
  int64_t max_prefill_chunk = 128;  // prompt tokens of one sequence in one step
  int64_t prefix_cache_bytes = 0;   // 0: no prefix cache
  int64_t prefix_cache_block_tokens = 16;
  // Threads that sample a step's rows on the host (each sequence has its own sampler: the tokens do
  // not depend on them). 0: one per core, up to 8, once a step's rows hold ≥ 2^20 logits; 1: serial.
  int sampling_threads = 0;
};

struct PrefixCacheCounters {
  int64_t queried_tokens = 0;  // prompt tokens of admitted requests
  int64_t hit_tokens = 0;      // of those, restored from the cache
};

class Scheduler {
 public:
  Scheduler(Backend& backend, SchedulerOptions options);
  ~Scheduler();

  // Queues a request; a plow::Error for an empty prompt, max_tokens < 1 or a duplicate live id.
  void submit(Request request, TokenCallback on_token, AdmitCallback on_admit = {});
  // Drops a queued or running request; its slot is free on return. False when the id is unknown
  // (already finished). The callback is not called again.
  bool abort(const std::string& id);
  // One forward step (admitting queued requests first). Returns the tokens the step consumed (0: idle).
  int64_t step();

  bool has_work() const { return !waiting_.empty() || !running_.empty(); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int free_slots() const { return static_cast<int>(free_slots_.size()); }
  std::optional<RequestState> state(const std::string& id) const;  // none once finished or aborted
  // Throws InternalError when a slot is leaked, double-owned, or owned by a sequence not running,
  // or when the prefix cache's tree, pages or locks are inconsistent.
  void check_integrity() const;

  const PrefixCache* prefix_cache() const { return cache_.get(); }  // null when disabled
  PrefixCacheCounters prefix_cache_counters() const { return counters_; }

 private:
  struct Sequence;
  bool can_admit() const;  // a request is queued and a slot is free
  void admit();            // moves the oldest queued request to a free, reset slot
  void release(Sequence& seq);
  void snapshot(const Sequence& seq, int64_t tokens);  // the slot has consumed `tokens` of prompt + output
  void finish_all_on_error(const std::vector<Sequence*>& batch);

  Backend& backend_;
  SchedulerOptions options_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order
  std::vector<const Sequence*> slot_owner_;         // [num_slots], nullptr = free
  std::vector<int> free_slots_;
  std::unique_ptr<PrefixCache> cache_;
  PrefixCacheCounters counters_;
};

}  // namespace plow
