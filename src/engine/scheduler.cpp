#include "engine/scheduler.h"

#include <algorithm>
#include <exception>
#include <functional>
#include <span>
#include <thread>

#include "core/error.h"

namespace plow {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kError: return "error";
  }
  return "error";
}

namespace {

// job(0), …, job(n − 1) on up to `threads` threads, the caller's among them; rethrows the first
// exception a job threw once all have ended.
void run_jobs(size_t n, size_t threads, const std::function<void(size_t)>& job) {
  threads = std::clamp<size_t>(threads, 1, std::max<size_t>(n, 1));
  std::vector<std::exception_ptr> errors(threads);
  auto run_share = [&](size_t t) {
    try {
      for (size_t i = t; i < n; i += threads) job(i);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < threads; ++t) helpers.emplace_back(run_share, t);
  run_share(0);
  for (std::thread& h : helpers) h.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace

struct Scheduler::Sequence {
  Request request;
  TokenCallback on_token;
  AdmitCallback on_admit;
  Sampler sampler;
  RequestState state = RequestState::kQueued;
  int slot = -1;
  int64_t prefilled_tokens = 0;  // prompt tokens already consumed by the backend
  std::vector<int32_t> output;
  PrefixCache::Node* cache_lock = nullptr;  // the cached path this sequence restored (held until release)

  Sequence(Request r, TokenCallback cb, AdmitCallback admit)
      : request(std::move(r)), on_token(std::move(cb)), on_admit(std::move(admit)), sampler(request.sampling) {}
};

Scheduler::Scheduler(Backend& backend, SchedulerOptions options) : backend_(backend), options_(options) {
  PLOW_CHECK(options_.max_step_tokens >= 1 && options_.max_prefill_chunk >= 1, "scheduler budgets must be >= 1");
  slot_owner_.assign(static_cast<size_t>(backend_.num_slots()), nullptr);
  for (int slot = backend_.num_slots() - 1; slot >= 0; --slot) free_slots_.push_back(slot);
  if (options_.prefix_cache_bytes > 0 && backend_.has_snapshots()) {
    PLOW_CHECK(options_.prefix_cache_block_tokens >= 1, "prefix cache blocks must hold >= 1 token");
    cache_ = std::make_unique<PrefixCache>(options_.prefix_cache_bytes, options_.prefix_cache_block_tokens);
  }
}

Scheduler::~Scheduler() = default;

void Scheduler::submit(Request request, TokenCallback on_token, AdmitCallback on_admit) {
  if (request.prompt.empty()) fail("request '{}': empty prompt", request.id);
  if (request.max_tokens < 1) fail("request '{}': max_tokens must be >= 1, found {}", request.id, request.max_tokens);
  if (state(request.id)) fail("request '{}': an id already queued or running", request.id);
  waiting_.push_back(std::make_unique<Sequence>(std::move(request), std::move(on_token), std::move(on_admit)));
}

std::optional<RequestState> Scheduler::state(const std::string& id) const {
  for (const auto& seq : waiting_) {
    if (seq->request.id == id) return seq->state;
  }
  for (const auto& seq : running_) {
    if (seq->request.id == id) return seq->state;
  }
  return std::nullopt;
}

bool Scheduler::abort(const std::string& id) {
  auto queued = std::find_if(waiting_.begin(), waiting_.end(), [&](const auto& s) { return s->request.id == id; });
  if (queued != waiting_.end()) {
    waiting_.erase(queued);
    return true;
  }
  auto running = std::find_if(running_.begin(), running_.end(), [&](const auto& s) { return s->request.id == id; });
  if (running == running_.end()) return false;
  Sequence& seq = **running;
  // Between steps a decoding slot has consumed the prompt and all but the last output token.
  if (seq.state == RequestState::kDecoding) snapshot(seq, static_cast<int64_t>(seq.request.prompt.size() + seq.output.size()) - 1);
  seq.state = RequestState::kAborted;
  release(seq);
  running_.erase(running);
  return true;
}

bool Scheduler::can_admit() const { return !waiting_.empty() && !free_slots_.empty(); }

void Scheduler::admit() {
  PLOW_CHECK(can_admit(), "admit without a queued request and a free slot");
  std::unique_ptr<Sequence> seq = std::move(waiting_.front());
  waiting_.pop_front();
  seq->slot = free_slots_.back();
  free_slots_.pop_back();
  backend_.reset_slot(seq->slot);
  slot_owner_[static_cast<size_t>(seq->slot)] = seq.get();
  seq->state = RequestState::kPrefilling;
  const std::vector<int32_t>& prompt = seq->request.prompt;
  if (cache_) {
    // At most prompt − 1 tokens: the last prompt token is computed so its logits exist.
    if (auto hit = cache_->match(prompt, static_cast<int64_t>(prompt.size()) - 1)) {
      try {
        backend_.restore_slot(seq->slot, cache_->materialize(*hit));
        cache_->lock(hit->node);
        seq->cache_lock = hit->node;
        seq->prefilled_tokens = hit->tokens;
      } catch (const Error&) {
        backend_.reset_slot(seq->slot);  // a snapshot this backend cannot take (e.g. its context limit): run cold
      }
    }
    counters_.queried_tokens += static_cast<int64_t>(prompt.size());
    counters_.hit_tokens += seq->prefilled_tokens;
  }
  if (seq->on_admit) seq->on_admit(seq->prefilled_tokens);
  running_.push_back(std::move(seq));
}

void Scheduler::snapshot(const Sequence& seq, int64_t tokens) {
  if (!cache_ || tokens < 1) return;
  std::vector<int32_t> consumed(seq.request.prompt.begin(), seq.request.prompt.end());
  consumed.insert(consumed.end(), seq.output.begin(), seq.output.end());
  consumed.resize(static_cast<size_t>(tokens));
  cache_->insert(consumed, backend_, seq.slot);  // false: over the budget even when empty; nothing kept
}

void Scheduler::release(Sequence& seq) {
  PLOW_CHECK(seq.slot >= 0 && slot_owner_[static_cast<size_t>(seq.slot)] == &seq, "release of slot {} not owned by '{}'", seq.slot, seq.request.id);
  slot_owner_[static_cast<size_t>(seq.slot)] = nullptr;
  free_slots_.push_back(seq.slot);
  seq.slot = -1;
  if (seq.cache_lock) cache_->unlock(seq.cache_lock);
  seq.cache_lock = nullptr;
}

void Scheduler::finish_all_on_error(const std::vector<Sequence*>& batch) {
  for (Sequence* seq : batch) {
    seq->state = RequestState::kAborted;
    release(*seq);
    seq->on_token(-1, SampledToken{}, FinishReason::kError);
  }
  std::erase_if(running_, [](const auto& s) { return s->state == RequestState::kAborted; });
}

int64_t Scheduler::step() {
  while (can_admit()) admit();
  // Decode tokens first (one each, so running sequences never stall), then prefill chunks in
  // admission order with what is left of the budget.
  int64_t budget = options_.max_step_tokens;
  StepInputs inputs;
  std::vector<Sequence*> batch;
  std::vector<bool> samples;  // per batch entry: this step's row is sampled
  for (const auto& seq : running_) {
    if (seq->state != RequestState::kDecoding || budget == 0) continue;
    inputs.token_ids.push_back(seq->output.back());
    inputs.sequences.push_back({seq->slot, 1});
    batch.push_back(seq.get());
    samples.push_back(true);
    --budget;
  }
  for (const auto& seq : running_) {
    if (seq->state != RequestState::kPrefilling || budget == 0) continue;
    const auto prompt_tokens = static_cast<int64_t>(seq->request.prompt.size());
    const int64_t count = std::min({prompt_tokens - seq->prefilled_tokens, options_.max_prefill_chunk, budget});
    const auto begin = seq->request.prompt.begin() + seq->prefilled_tokens;
    inputs.token_ids.insert(inputs.token_ids.end(), begin, begin + count);
    inputs.sequences.push_back({seq->slot, count});
    batch.push_back(seq.get());
    seq->prefilled_tokens += count;
    samples.push_back(seq->prefilled_tokens == prompt_tokens);
    budget -= count;
  }
  if (batch.empty()) return 0;
  // When every row this step samples takes its argmax, the backend may answer with ids instead of logits.
  inputs.argmax_only = true;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (samples[i] && !batch[i]->sampler.picks_argmax()) inputs.argmax_only = false;
  }
  // Otherwise a backend that draws rows itself gets each sampled row's controls and uniform, when no
  // sampled row needs the host (penalties, logprobs).
  if (!inputs.argmax_only && backend_.draws_rows()) {
    bool anywhere = true;
    for (size_t i = 0; i < batch.size(); ++i) anywhere = anywhere && (!samples[i] || batch[i]->sampler.draws_anywhere());
    for (size_t i = 0; anywhere && i < batch.size(); ++i) inputs.draws.push_back(samples[i] ? batch[i]->sampler.next_draw() : RowDraw{});
  }

  StepOutput out;
  try {
    out = backend_.step(inputs);
  } catch (...) {
    finish_all_on_error(batch);  // the slots of a failed step are undefined: they are reset on reuse
    throw;
  }
  PLOW_CHECK(out.rows == static_cast<int64_t>(batch.size()), "step returned {} rows for {} sequences", out.rows, batch.size());
  const bool asked_ids = inputs.argmax_only || !inputs.draws.empty();
  PLOW_CHECK(out.argmax.empty() || (asked_ids && out.argmax.size() == batch.size()), "step returned {} ids for {} sequences{}", out.argmax.size(),
             batch.size(), asked_ids ? "" : " without being asked");
  // The rows the backend answered with logits are sampled on the host first, in parallel over
  // sequences when they are many; then each sequence takes its token in batch order.
  std::vector<SampledToken> sampled(batch.size());
  std::vector<size_t> host_rows;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!samples[i]) continue;
    if (out.argmax.empty()) {
      host_rows.push_back(i);
    } else {
      sampled[i].id = out.argmax[i];
    }
  }
  size_t threads = static_cast<size_t>(options_.sampling_threads);
  if (threads == 0) {
    const bool large = static_cast<int64_t>(host_rows.size()) * out.vocab >= (int64_t{1} << 20);
    threads = large ? std::min<size_t>(8, std::max(1u, std::thread::hardware_concurrency())) : 1;
  }
  run_jobs(host_rows.size(), threads, [&](size_t j) {
    const size_t i = host_rows[j];
    Sequence& seq = *batch[i];
    std::span<const float> row(out.logits.data() + static_cast<int64_t>(i) * out.vocab, static_cast<size_t>(out.vocab));
    sampled[i] = seq.sampler.sample(row, seq.request.prompt, seq.output);
  });
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence& seq = *batch[i];
    if (!samples[i]) {
      // A chunk ended inside the prompt: the slot holds exactly its first prefilled_tokens, so a later
      // prompt sharing only that much (a long system prompt) can resume here.
      snapshot(seq, seq.prefilled_tokens);
      continue;
    }
    if (seq.state == RequestState::kPrefilling) snapshot(seq, static_cast<int64_t>(seq.request.prompt.size()));  // prompt end
    seq.output.push_back(sampled[i].id);
    seq.state = RequestState::kDecoding;
    std::optional<FinishReason> finished;
    const auto& stops = seq.request.stop_ids;
    if (std::find(stops.begin(), stops.end(), sampled[i].id) != stops.end()) {
      finished = FinishReason::kStop;
    } else if (static_cast<int64_t>(seq.output.size()) >= seq.request.max_tokens) {
      finished = FinishReason::kLength;
    }
    if (finished) {
      snapshot(seq, static_cast<int64_t>(seq.request.prompt.size() + seq.output.size()) - 1);  // turn end
      seq.state = RequestState::kFinished;
      release(seq);
    }
    seq.on_token(sampled[i].id, sampled[i], finished);
  }
  std::erase_if(running_, [](const auto& s) { return s->state == RequestState::kFinished || s->state == RequestState::kAborted; });
  return static_cast<int64_t>(inputs.token_ids.size());
}

void Scheduler::check_integrity() const {
  size_t owned = 0;
  for (size_t slot = 0; slot < slot_owner_.size(); ++slot) {
    const Sequence* owner = slot_owner_[slot];
    const bool listed_free = std::count(free_slots_.begin(), free_slots_.end(), static_cast<int>(slot)) == 1;
    PLOW_CHECK((owner == nullptr) == listed_free, "slot {} is {} but {} the free list", slot, owner ? "owned" : "unowned", listed_free ? "in" : "not in");
    if (owner == nullptr) continue;
    ++owned;
    const bool live = std::any_of(running_.begin(), running_.end(), [&](const auto& s) { return s.get() == owner; });
    PLOW_CHECK(live && owner->slot == static_cast<int>(slot), "slot {} is owned by a sequence that is not running on it", slot);
  }
  PLOW_CHECK(free_slots_.size() + owned == slot_owner_.size(), "free list has {} entries, {} owned, {} slots", free_slots_.size(), owned, slot_owner_.size());
  PLOW_CHECK(owned == running_.size(), "{} running sequences own {} slots", running_.size(), owned);
  for (const auto& seq : waiting_) PLOW_CHECK(seq->slot == -1 && seq->state == RequestState::kQueued, "queued '{}' holds slot {}", seq->request.id, seq->slot);
  if (!cache_) return;
  const auto locks = std::count_if(running_.begin(), running_.end(), [](const auto& s) { return s->cache_lock != nullptr; });
  PLOW_CHECK(cache_->stats().locks == locks, "the prefix cache counts {} locks, {} running sequences hold one", cache_->stats().locks, locks);
  cache_->check_integrity();
}

}  // namespace plow
