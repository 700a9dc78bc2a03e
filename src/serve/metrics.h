// Server counters in Prometheus text format, named like vLLM's (plow: prefix): gauges for running and
// waiting requests, token counters, and latency histograms. Thread-safe.
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

class Metrics {
 public:
  Metrics();
  void add_prompt_tokens(int64_t n);
  void add_generation_tokens(int64_t n);
  void observe_ttft(double seconds);
  void observe_tpot(double seconds);
  // Text exposition; running/waiting are the scheduler's counts at scrape time.
  std::string render(const std::string& model_name, int64_t running, int64_t waiting) const;

 private:
  mutable std::mutex mu_;
  uint64_t prompt_tokens_ = 0;
  uint64_t generation_tokens_ = 0;
  Histogram ttft_;
  Histogram tpot_;
};

}  // namespace plow
