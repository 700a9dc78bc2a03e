#include "serve/engine_loop.h"

#include <fmt/format.h>

#include <cstdio>

#include "serve/api_error.h"

namespace plow {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
}  // namespace

void EventQueue::push(EngineEvent event) {
  {
    std::lock_guard lock(mu_);
    events_.push_back(std::move(event));
  }
  cv_.notify_one();
}

std::optional<EngineEvent> EventQueue::pop(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  EngineEvent event = std::move(events_.front());
  events_.pop_front();
  return event;
}

EngineLoop::EngineLoop(Backend& backend, SchedulerOptions options, int64_t max_waiting, Metrics& metrics)
    : scheduler_(backend, options), max_waiting_(max_waiting), metrics_(metrics), thread_([this] { run(); }) {}

EngineLoop::~EngineLoop() {
  {
    const auto lock = lock_between_steps();
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

void EngineLoop::submit(std::vector<Request> requests, std::shared_ptr<EventQueue> queue) {
  const auto lock = lock_between_steps();
  if (draining_ || stop_) throw ApiError(503, "the server is shutting down");
  if (scheduler_.num_waiting() + static_cast<int64_t>(requests.size()) > max_waiting_) {
    throw ApiError(429, fmt::format("the waiting queue is full ({} requests); retry later", max_waiting_));
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto prompt_tokens = static_cast<int64_t>(requests[i].prompt.size());
    metrics_.add_prompt_tokens(prompt_tokens);
    auto last = std::make_shared<std::optional<Clock::time_point>>();
    const Clock::time_point submitted = Clock::now();
    scheduler_.submit(std::move(requests[i]), [this, queue, i, last, submitted](int32_t token, const SampledToken& sampled, std::optional<FinishReason> finished) {
      const Clock::time_point now = Clock::now();
      if (token >= 0) {
        metrics_.add_generation_tokens(1);
        if (*last) {
          metrics_.observe_tpot(seconds_between(**last, now));
        } else {
          metrics_.observe_ttft(seconds_between(submitted, now));
        }
        *last = now;
      }
      queue->push({i, token, sampled, finished, std::nullopt});
    }, [this, queue, i, prompt_tokens, cached_enabled = scheduler_.prefix_cache() != nullptr](int64_t cached) {
      if (cached_enabled) metrics_.add_prefix_cache(prompt_tokens, cached);
      queue->push({i, -1, SampledToken{}, std::nullopt, cached});
    });
  }
  work_cv_.notify_one();
}

void EngineLoop::abort(const std::string& id) {
  const auto lock = lock_between_steps();
  scheduler_.abort(id);
  if (!scheduler_.has_work()) idle_cv_.notify_all();
}

void EngineLoop::drain() {
  auto lock = lock_between_steps();
  draining_ = true;
  idle_cv_.wait(lock, [&] { return !scheduler_.has_work() || stop_; });
}

bool EngineLoop::stopped() const { return stop_.load(); }

int64_t EngineLoop::num_running() const {
  const auto lock = lock_between_steps();
  return scheduler_.num_running();
}

int64_t EngineLoop::num_waiting() const {
  const auto lock = lock_between_steps();
  return scheduler_.num_waiting();
}

EngineGauges EngineLoop::gauges() const {
  const auto lock = lock_between_steps();
  EngineGauges g;
  g.running = scheduler_.num_running();
  g.waiting = scheduler_.num_waiting();
  if (const PrefixCache* cache = scheduler_.prefix_cache()) {
    const PrefixCacheStats stats = cache->stats();
    g.kv_cache_usage = static_cast<double>(stats.bytes_used) / static_cast<double>(stats.budget_bytes);
  }
  return g;
}

void EngineLoop::check_integrity() const {
  const auto lock = lock_between_steps();
  scheduler_.check_integrity();
}

std::unique_lock<std::mutex> EngineLoop::lock_between_steps() const {
  contenders_.fetch_add(1, std::memory_order_acq_rel);
  std::unique_lock lock(mu_);
  contenders_.fetch_sub(1, std::memory_order_acq_rel);
  return lock;
}

void EngineLoop::run() {
  std::unique_lock lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stop_ || scheduler_.has_work(); });
    if (stop_) break;
    try {
      scheduler_.step();  // a failing step finishes its sequences with kError
    } catch (const std::exception& e) {
      std::fprintf(stderr, "plow serve: step failed: %s\n", e.what());
    }
    if (!scheduler_.has_work()) idle_cv_.notify_all();
    // Let waiting submitters, aborts and readers in between steps (lock_between_steps).
    lock.unlock();
    do {
      std::this_thread::yield();
    } while (contenders_.load(std::memory_order_acquire) > 0);
    lock.lock();
  }
  idle_cv_.notify_all();
}

}  // namespace plow
