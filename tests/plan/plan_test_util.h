// Shared by the plan tests: fixtures with an oracle.json, plans for a model, a watchdog that fails a
// hung test instead of letting it hang CI, and bitwise logit comparison.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/model.h"
#include "engine/plans.h"
#include "plan/lower.h"
#include "runtime/cpu/interpreter.h"

namespace plow::plan_test {

namespace fs = std::filesystem;
using nlohmann::json;

inline json manifest(const std::string& fixture) {
  std::ifstream in(fs::path(PLOW_TEST_DATA) / fixture / "oracle.json");
  return json::parse(in);
}

inline std::vector<std::string> oracle_fixtures() {
  std::vector<std::string> fixtures;
  if (!fs::is_directory(PLOW_TEST_DATA)) return fixtures;
  for (const auto& entry : fs::directory_iterator(PLOW_TEST_DATA)) {
    if (fs::exists(entry.path() / "oracle.json")) fixtures.push_back(entry.path().filename().string());
  }
  std::sort(fixtures.begin(), fixtures.end());
  return fixtures;
}

inline const LoadedModel& fixture_model(const std::string& fixture) {
  static std::map<std::string, std::unique_ptr<LoadedModel>> cache;
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  auto& slot = cache[fixture];
  if (!slot) slot = LoadedModel::load((fs::path(PLOW_TEST_DATA) / fixture).string());
  return *slot;
}

// Plans of the compiled (fused) graph, as `plow generate --backend cpu-plan` runs them; fuse = false
// lowers the graph as built.
inline Plan make_plan(const LoadedModel& model, PlanPhase phase, int64_t max_tokens, int workers, bool fuse = true) {
  return compile_plan(model, phase, max_tokens, workers, 0, fuse);
}

inline std::unique_ptr<PlanInterpreter> make_interpreter(const LoadedModel& model, std::vector<Plan> plans, int workers, DType act,
                                                         int slots, int64_t max_context, int64_t delay_us = 0, uint64_t seed = 1) {
  InterpreterOptions options = plan_interpreter_options(model, workers, act, slots, max_context);
  options.inject_delay_max_us = delay_us;
  options.inject_delay_seed = seed;
  return std::make_unique<PlanInterpreter>(*model.weights, std::move(plans), options);
}

// Largest |a − b| (NaN anywhere: infinity); sizes must match.
inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  float worst = 0.0f;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::isnan(a[i]) || std::isnan(b[i]) ? INFINITY : std::max(worst, std::fabs(a[i] - b[i]));
  }
  return worst;
}

// Fails the test run (exit code 3, a line on stderr) when the guarded scope outlives `limit`: a
// deadlocked protocol must fail CI, not hang it.
class Watchdog {
 public:
  Watchdog(std::chrono::seconds limit, std::string what) : what_(std::move(what)) {
    thread_ = std::thread([this, limit] {
      std::unique_lock lock(mutex_);
      if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
        std::fprintf(stderr, "watchdog: '%s' still running after %lld s: the plan protocol hung\n", what_.c_str(),
                     static_cast<long long>(limit.count()));
        std::fflush(stderr);
        std::_Exit(3);
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

 private:
  std::string what_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace plow::plan_test
