// The server's engine thread: owns the Scheduler, runs step() while there is work, and delivers each
// sampled token to the submitting handler's EventQueue. Handlers submit and abort from any thread;
// one mutex serializes them with the steps. Admission control: a full waiting queue is a 429.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/scheduler.h"
#include "serve/metrics.h"

namespace plow {

struct EngineEvent {
  size_t choice = 0;  // index of the request within its submit() call
  int32_t token = -1;
  SampledToken sampled;
  std::optional<FinishReason> finished;
  std::optional<int64_t> cached_tokens;  // set on the admission event (token −1): prompt tokens from the prefix cache
};

class EventQueue {
 public:
  void push(EngineEvent event);
  // The next event, or none after `timeout`.
  std::optional<EngineEvent> pop(std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<EngineEvent> events_;
};

class EngineLoop {
 public:
  EngineLoop(Backend& backend, SchedulerOptions options, int64_t max_waiting, Metrics& metrics);
  ~EngineLoop();  // stops the thread; requests still running get no more events

  // All or none: ApiError 429 when the waiting queue would exceed max_waiting, 503 when draining.
  void submit(std::vector<Request> requests, std::shared_ptr<EventQueue> queue);
  void abort(const std::string& id);
  // Refuses new requests from now on and returns once every admitted request has finished.
  void drain();
  bool stopped() const;
  int64_t num_running() const;
  int64_t num_waiting() const;
  EngineGauges gauges() const;
  // The scheduler's integrity check (slots, prefix cache tree, pages, locks); InternalError when broken.
  void check_integrity() const;

 private:
  void run();
  // mu_ for a caller outside the engine thread: counted in contenders_ while it waits, so that the
  // engine thread, between two steps, lets it in before taking mu_ back (std::mutex is not fair: with
  // only a yield between steps the engine thread took it back for seconds while an HTTP thread waited,
  // and a whole response's hang-up probes, new submissions and aborts waited with it).
  std::unique_lock<std::mutex> lock_between_steps() const;

  mutable std::mutex mu_;
  mutable std::atomic<int> contenders_{0};
  std::condition_variable work_cv_;  // the engine thread waits for work or stop
  std::condition_variable idle_cv_;  // drain() waits for the scheduler to empty
  Scheduler scheduler_;
  int64_t max_waiting_;
  Metrics& metrics_;
  bool draining_ = false;
  std::atomic<bool> stop_ = false;  // written under mu_; stopped() reads it without the lock
  std::thread thread_;
};

}  // namespace plow
