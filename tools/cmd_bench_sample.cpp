// plow bench sample: the host sampler's time per token over a vocabulary-sized row of logits, for the
// controls agents send (greedy, temperature, top-p, top-k, min-p, penalties with logprobs), against
// the sorting specification (reference_distribution and a draw from it, what the sampler did before)
// and one plain read pass over the same rows (the floor of any pass over them), all in one run.
// Appends a record per setting to bench/results/sample.json.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/sampler.h"
#include "subcommands.h"
#include "tools/bench_records.h"

namespace plow {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct BenchSampleArgs {
  int64_t vocab = 163840;  // Kimi Linear's
  int iterations = 200;    // tokens timed per setting (the reference: a tenth of them, at least 5)
  int rows = 16;           // distinct logit rows cycled through (as a server's fresh rows, not one cached)
  float spread = 2.5f;     // the logits' standard deviation
  int history = 2048;      // prompt + output tokens the penalties see
  uint64_t seed = 1;
  std::string output = "bench/results/sample.json";
};

struct Setting {
  const char* name;
  SamplingParams params;
};

std::vector<Setting> settings() {
  auto make = [](float t, float top_p, int64_t top_k, float min_p) {
    SamplingParams p;
    p.temperature = t;
    p.top_p = top_p;
    p.top_k = top_k;
    p.min_p = min_p;
    p.seed = 7;
    return p;
  };
  SamplingParams penalized = make(0.6f, 0.95f, 0, 0.0f);
  penalized.repetition_penalty = 1.05f;
  penalized.frequency_penalty = 0.1f;
  penalized.top_logprobs = 5;
  return {{"greedy", make(0.0f, 1.0f, 0, 0.0f)},
          {"temperature 1", make(1.0f, 1.0f, 0, 0.0f)},
          {"temperature 0.6, top_p 0.95", make(0.6f, 0.95f, 0, 0.0f)},
          {"temperature 0.7, top_k 40", make(0.7f, 1.0f, 40, 0.0f)},
          {"temperature 1, min_p 0.05", make(1.0f, 1.0f, 0, 0.05f)},
          {"temperature 0.6, top_p 0.95, penalties, top_logprobs 5", penalized}};
}

template <class F>
double ms_per_call(int calls, F&& f) {
  const auto start = Clock::now();
  for (int i = 0; i < calls; ++i) f(i);
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count() / calls;
}

int run_bench_sample(const BenchSampleArgs& a) {
  if (a.vocab < 2) fail("--vocab must be >= 2, found {}", a.vocab);
  if (a.iterations < 1 || a.rows < 1 || a.history < 0) fail("--iterations and --rows must be >= 1 and --history >= 0");
  std::mt19937_64 rng(a.seed);
  std::normal_distribution<float> normal(0.0f, a.spread);
  std::vector<std::vector<float>> rows(static_cast<size_t>(a.rows), std::vector<float>(static_cast<size_t>(a.vocab)));
  for (auto& row : rows) {
    for (float& x : row) x = normal(rng);
  }
  std::vector<int32_t> prompt(static_cast<size_t>(a.history) / 2), output(static_cast<size_t>(a.history) - prompt.size());
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(a.vocab - 1));
  for (auto& t : prompt) t = token(rng);
  for (auto& t : output) t = token(rng);
  auto row = [&](int i) -> const std::vector<float>& { return rows[static_cast<size_t>(i % a.rows)]; };

  // The floor: one read of each row, summed so the compiler keeps it.
  volatile float sink = 0.0f;
  const double read_ms = ms_per_call(a.iterations, [&](int i) {
    float s = 0.0f;
    for (float x : row(i)) s += x;
    sink = sink + s;
  });

  const std::string rev = tools::git_revision(), device = tools::cpu_model(), command = tools::process_command_line();
  json records = json::array();
  for (const Setting& setting : settings()) {
    Sampler sampler(setting.params);
    const double ms = ms_per_call(a.iterations, [&](int i) { sink = sink + static_cast<float>(sampler.sample(row(i), prompt, output).id); });
    json peers = json::object();
    int64_t kept = 1;
    if (setting.params.temperature > 0.0f) {
      std::mt19937_64 peer_rng(setting.params.seed);
      const int calls = std::max(5, a.iterations / 10);
      const double peer_ms = ms_per_call(calls, [&](int i) {
        const TokenDistribution d = reference_distribution(row(i), setting.params, prompt, output);
        std::discrete_distribution<size_t> pick(d.probs.begin(), d.probs.end());
        sink = sink + static_cast<float>(d.ids[pick(peer_rng)]);
      });
      peers["reference_sort"] = {{"ms_per_token", peer_ms}, {"tokens", calls}};
      kept = static_cast<int64_t>(Sampler(setting.params).distribution(row(0), prompt, output).ids.size());
    }
    const json record = {{"kind", "sample"},
                         {"setting", setting.name},
                         {"vocab", a.vocab},
                         {"logit_spread", a.spread},
                         {"history_tokens", a.history},
                         {"kept_tokens_first_row", kept},
                         {"tokens", a.iterations},
                         {"ms_per_token", ms},
                         {"read_pass_ms", read_ms},
                         {"peers", peers},
                         {"device", device},
                         {"git_rev", rev},
                         {"command", command}};
    std::printf("%-56s %8.3f ms a token (kept %lld; reference sort %s; one read pass %.3f ms)\n", setting.name, ms, static_cast<long long>(kept),
                peers.contains("reference_sort") ? fmt::format("{:.3f} ms", peers["reference_sort"]["ms_per_token"].get<double>()).c_str() : "-",
                read_ms);
    records.push_back(record);
  }
  tools::append_records(a.output, records);
  std::printf("appended %zu records to %s\n", records.size(), a.output.c_str());
  return 0;
}

}  // namespace

Subcommand add_bench_sample_command(CLI::App& app) {
  auto args = std::make_shared<BenchSampleArgs>();
  CLI::App* bench = bench_group(app);
  CLI::App* cmd = bench->add_subcommand("sample", "the host sampler's time per token over a vocabulary-sized row, against the sorting specification");
  cmd->add_option("--vocab", args->vocab, "logits a row (default: Kimi Linear's 163,840)");
  cmd->add_option("--iterations", args->iterations, "tokens timed per setting");
  cmd->add_option("--rows", args->rows, "distinct rows of logits cycled through");
  cmd->add_option("--spread", args->spread, "standard deviation of the random logits");
  cmd->add_option("--history", args->history, "prompt + output tokens the penalties see");
  cmd->add_option("--seed", args->seed, "seed of the logits and history");
  cmd->add_option("-o,--output", args->output, "JSON array the records are appended to");
  return {cmd, [args] { return run_bench_sample(*args); }};
}

}  // namespace plow
