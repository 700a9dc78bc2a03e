// Server counters in Prometheus text format, named like vLLM's (plow: prefix): gauges for running and
// waiting requests, prefix-cache usage, token counters (prefix-cache queries and hits count tokens,
// as in vLLM), and latency histograms. Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace plow {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds_seconds) : bounds_(std::move(bounds_seconds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double seconds);
  void write(std::string& out, const std::string& name, const std::string& labels) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); last = above every bound
  double sum_ = 0;
  uint64_t count_ = 0;
};

// What the engine reports at scrape time.
struct EngineGauges {
  int64_t running = 0;
  int64_t waiting = 0;
  double kv_cache_usage = 0;  // fraction of the prefix cache's budget in use (pages + snapshots)
};

class Metrics {
 public:
  Metrics();
  void add_prompt_tokens(int64_t n);
  void add_generation_tokens(int64_t n);
  void observe_ttft(double seconds);
  void observe_tpot(double seconds);
  void add_prefix_cache(int64_t queried_tokens, int64_t hit_tokens);
  // Text exposition; running/waiting are the scheduler's counts at scrape time.
  std::string render(const std::string& model_name, const EngineGauges& gauges) const;

 private:
  mutable std::mutex mu_;
  uint64_t prompt_tokens_ = 0;
  uint64_t generation_tokens_ = 0;
  uint64_t prefix_queries_ = 0;  // prompt tokens looked up in the prefix cache
  uint64_t prefix_hits_ = 0;     // of those, found
  Histogram ttft_;
  Histogram tpot_;
};

}  // namespace plow
