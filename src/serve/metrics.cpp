#include "serve/metrics.h"

#include <fmt/format.h>

namespace plow {

void Histogram::observe(double seconds) {
  size_t bucket = 0;
  while (bucket < bounds_.size() && seconds > bounds_[bucket]) ++bucket;
  ++counts_[bucket];
  sum_ += seconds;
  ++count_;
}

void Histogram::write(std::string& out, const std::string& name, const std::string& labels) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, bounds_[i], cumulative);
  }
  out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, count_);
  out += fmt::format("{}_sum{{{}}} {}\n{}_count{{{}}} {}\n", name, labels, sum_, name, labels, count_);
}

Metrics::Metrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}),
      tpot_({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}) {}

void Metrics::add_prompt_tokens(int64_t n) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += static_cast<uint64_t>(n);
}

void Metrics::add_generation_tokens(int64_t n) {
  std::lock_guard lock(mu_);
  generation_tokens_ += static_cast<uint64_t>(n);
}

void Metrics::observe_ttft(double seconds) {
  std::lock_guard lock(mu_);
  ttft_.observe(seconds);
}

void Metrics::observe_tpot(double seconds) {
  std::lock_guard lock(mu_);
  tpot_.observe(seconds);
}

void Metrics::add_prefix_cache(int64_t queried_tokens, int64_t hit_tokens) {
  std::lock_guard lock(mu_);
  prefix_queries_ += static_cast<uint64_t>(queried_tokens);
  prefix_hits_ += static_cast<uint64_t>(hit_tokens);
}

std::string Metrics::render(const std::string& model_name, const EngineGauges& gauges) const {
  std::lock_guard lock(mu_);
  const std::string labels = fmt::format("model_name=\"{}\"", model_name);
  std::string out;
  auto scalar = [&](const char* name, const char* type, const char* help, auto value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{}{{{}}} {}\n", name, help, name, type, name, labels, value);
  };
  scalar("plow:num_requests_running", "gauge", "Requests holding a slot (prefilling or decoding).", gauges.running);
  scalar("plow:num_requests_waiting", "gauge", "Requests queued for a slot.", gauges.waiting);
  scalar("plow:kv_cache_usage_perc", "gauge", "Fraction of the prefix cache's memory budget in use (1 = full).", gauges.kv_cache_usage);
  scalar("plow:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", prefix_queries_);
  scalar("plow:prefix_cache_hits_total", "counter", "Prompt tokens restored from the prefix cache.", prefix_hits_);
  scalar("plow:prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", prompt_tokens_);
  scalar("plow:generation_tokens_total", "counter", "Generated tokens.", generation_tokens_);
  out += "# HELP plow:time_to_first_token_seconds Time from submit to the first token.\n# TYPE plow:time_to_first_token_seconds histogram\n";
  ttft_.write(out, "plow:time_to_first_token_seconds", labels);
  out += "# HELP plow:time_per_output_token_seconds Time between consecutive tokens of a request.\n# TYPE plow:time_per_output_token_seconds histogram\n";
  tpot_.write(out, "plow:time_per_output_token_seconds", labels);
  return out;
}

}  // namespace plow
