// plow bench serve: load on an OpenAI-compatible server (plow's own, started in-process from --model,
// or any at --url) through streamed /v1/completions with token-id prompts. Two phases: a concurrency
// sweep (independent requests, C in flight at a time) and a multi-turn agentic replay (users sharing a
// long system prompt, each conversation growing by the model's reply and a new user message per turn).
// Reports TTFT, TPOT and ITL at p50/p90/p99, per-user tokens/s and the prefix-cache hit rate, and writes
// them with the git revision, the CPU model and the command line to bench/results/serve-*.json.
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "core/error.h"
#include "serve/server.h"
#include "subcommands.h"
#include "tools/bench_records.h"

namespace plow {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct BenchArgs {
  std::string model_dir;
  std::string url;  // host:port of a running server instead of --model
  std::vector<int> concurrency{1, 4, 16};
  int requests = 16;          // per concurrency level
  int prompt_tokens = 64;
  int max_tokens = 32;
  int users = 8;              // agentic replay
  int turns = 4;
  int system_tokens = 256;
  int user_tokens = 32;
  int reply_tokens = 16;
  int slots = 16;
  int64_t prefix_cache_mb = 512;  // with --model (0: the cache off, the baseline for the hit rate's effect)
  int64_t vocab = 0;          // token ids are drawn below this (0: the model's vocab_size, or 256 with --url)
  uint64_t seed = 1;
  std::string output_dir = "bench/results";
};

struct Sample {  // one request
  double ttft_s = 0, e2e_s = 0;
  std::vector<double> itl_s;  // gaps between token-bearing chunks
  int64_t tokens = 0, prompt_tokens = 0, cached_tokens = 0;
  std::vector<int32_t> output;
};

// Streams one completion; token ids come from the chunks' "token_ids" (plow's extension) or count 1 per chunk.
Sample run_request(const std::string& host, int port, const std::string& model, const std::vector<int32_t>& prompt, int max_tokens) {
  httplib::Client client(host, port);
  client.set_read_timeout(600, 0);
  const json body = {{"model", model}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true},
                     {"stream", true}, {"stream_options", {{"include_usage", true}}}};
  Sample s;
  std::string buffer;
  const Clock::time_point start = Clock::now();
  std::optional<Clock::time_point> last;
  auto on_event = [&](const std::string& data) {
    if (data == "[DONE]") return;
    const json chunk = json::parse(data);
    if (chunk.contains("usage") && chunk["usage"].is_object()) {
      s.prompt_tokens = chunk["usage"].value("prompt_tokens", 0);
      if (chunk["usage"].contains("prompt_tokens_details")) s.cached_tokens = chunk["usage"]["prompt_tokens_details"].value("cached_tokens", 0);
    }
    if (!chunk.contains("choices") || chunk["choices"].empty()) return;
    const json& choice = chunk["choices"][0];
    const int64_t n = choice.contains("token_ids") ? static_cast<int64_t>(choice["token_ids"].size()) : 1;
    if (n == 0) return;
    if (choice.contains("token_ids")) {
      for (const json& id : choice["token_ids"]) s.output.push_back(id.get<int32_t>());
    }
    const Clock::time_point now = Clock::now();
    if (last) {
      s.itl_s.push_back(std::chrono::duration<double>(now - *last).count());
    } else {
      s.ttft_s = std::chrono::duration<double>(now - start).count();
    }
    last = now;
    s.tokens += n;
  };
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    buffer.append(data, size);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) == 0) on_event(event.substr(6));
    }
    return true;
  };
  auto res = client.send(req);
  if (!res) fail("bench serve: request to {}:{} failed ({})", host, port, httplib::to_string(res.error()));
  if (res->status != 200) fail("bench serve: HTTP {} from {}:{}: {}", res->status, host, port, res->body);
  s.e2e_s = std::chrono::duration<double>(Clock::now() - start).count();
  return s;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto at = static_cast<size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(at, v.size() - 1)];
}

json summarize(const std::vector<Sample>& samples, double wall_s) {
  std::vector<double> ttft, tpot, itl, per_user;
  int64_t tokens = 0, prompt = 0, cached = 0;
  for (const Sample& s : samples) {
    ttft.push_back(s.ttft_s);
    if (s.tokens > 1) tpot.push_back((s.e2e_s - s.ttft_s) / static_cast<double>(s.tokens - 1));
    itl.insert(itl.end(), s.itl_s.begin(), s.itl_s.end());
    per_user.push_back(static_cast<double>(s.tokens) / s.e2e_s);
    tokens += s.tokens;
    prompt += s.prompt_tokens;
    cached += s.cached_tokens;
  }
  auto pcts = [](const std::vector<double>& v, double scale) {
    return json{{"p50", percentile(v, 50) * scale}, {"p90", percentile(v, 90) * scale}, {"p99", percentile(v, 99) * scale}};
  };
  return {{"requests", samples.size()},
          {"wall_s", wall_s},
          {"output_tokens", tokens},
          {"output_tokens_per_s", static_cast<double>(tokens) / wall_s},
          {"ttft_ms", pcts(ttft, 1e3)},
          {"tpot_ms", pcts(tpot, 1e3)},
          {"itl_ms", pcts(itl, 1e3)},
          {"per_user_tokens_per_s", pcts(per_user, 1.0)},
          {"prompt_tokens", prompt},
          {"cached_prompt_tokens", cached},
          {"prefix_hit_rate", prompt > 0 ? static_cast<double>(cached) / static_cast<double>(prompt) : 0.0}};
}

std::vector<int32_t> random_ids(std::mt19937_64& rng, int n, int64_t vocab) {
  std::uniform_int_distribution<int64_t> id(0, vocab - 1);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(static_cast<int32_t>(id(rng)));
  return out;
}

// Runs `jobs` on `width` threads; each job returns a sample (or many, for a conversation).
std::vector<Sample> run_parallel(int width, int jobs, const std::function<std::vector<Sample>(int)>& job) {
  std::vector<std::vector<Sample>> out(static_cast<size_t>(jobs));
  std::atomic<int> next{0};
  std::mutex error_mu;
  std::exception_ptr error;
  std::vector<std::thread> threads;
  for (int t = 0; t < width; ++t) {
    threads.emplace_back([&] {
      for (int i; (i = next++) < jobs;) {
        try {
          out[static_cast<size_t>(i)] = job(i);
        } catch (...) {
          std::lock_guard lock(error_mu);
          error = std::current_exception();
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  std::vector<Sample> flat;
  for (auto& v : out) flat.insert(flat.end(), v.begin(), v.end());
  return flat;
}

int run_bench_serve(const BenchArgs& a) {
  if (a.model_dir.empty() == a.url.empty()) fail("bench serve: give exactly one of --model DIR (serve it here) or --url HOST:PORT");
  for (int c : a.concurrency) {
    if (c < 1) fail("--concurrency: levels must be >= 1, found {}", c);
  }
  for (auto [name, v] : {std::pair{"--requests", a.requests}, {"--prompt-tokens", a.prompt_tokens}, {"--max-tokens", a.max_tokens}, {"--users", a.users},
                         {"--turns", a.turns}, {"--system-tokens", a.system_tokens}, {"--user-tokens", a.user_tokens}, {"--reply-tokens", a.reply_tokens}}) {
    if (v < 1) fail("{} must be >= 1, found {}", name, v);
  }
  int64_t vocab = a.vocab;
  if (vocab == 0 && !a.model_dir.empty()) {
    std::ifstream in(std::filesystem::path(a.model_dir) / "config.json");
    const json config = json::parse(in, nullptr, false);
    if (config.is_object() && config.contains("vocab_size") && config["vocab_size"].is_number_integer()) vocab = config["vocab_size"].get<int64_t>();
  }
  if (vocab <= 0) vocab = 256;
  std::unique_ptr<Server> server;
  std::thread server_thread;
  std::string host = "127.0.0.1";
  int port = 0;
  if (!a.model_dir.empty()) {
    ServeOptions options;
    options.model_dir = a.model_dir;
    options.port = 0;
    options.num_slots = a.slots;
    options.prefix_cache_mb = a.prefix_cache_mb;
    options.max_waiting = 4096;
    server = std::make_unique<Server>(options);
    port = server->bind();
    server_thread = std::thread([&] { server->run(); });
  } else {
    const size_t colon = a.url.rfind(':');
    if (colon == std::string::npos) fail("--url '{}': expected HOST:PORT", a.url);
    host = a.url.substr(0, colon);
    port = std::stoi(a.url.substr(colon + 1));
  }
  httplib::Client probe(host, port);
  auto models = probe.Get("/v1/models");
  if (!models || models->status != 200) fail("bench serve: no OpenAI server answers at {}:{}", host, port);
  const std::string model = json::parse(models->body)["data"][0]["id"];

  json sweep = json::array();
  for (int c : a.concurrency) {
    std::mt19937_64 rng(a.seed + static_cast<uint64_t>(c));
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < a.requests; ++i) prompts.push_back(random_ids(rng, a.prompt_tokens, vocab));
    const auto start = Clock::now();
    const auto samples = run_parallel(c, a.requests, [&](int i) { return std::vector<Sample>{run_request(host, port, model, prompts[static_cast<size_t>(i)], a.max_tokens)}; });
    json level = summarize(samples, std::chrono::duration<double>(Clock::now() - start).count());
    level["concurrency"] = c;
    std::fprintf(stderr, "concurrency %d: %s\n", c, level.dump().c_str());
    sweep.push_back(level);
  }

  std::mt19937_64 rng(a.seed);
  const std::vector<int32_t> system = random_ids(rng, a.system_tokens, vocab);
  std::vector<std::vector<std::vector<int32_t>>> user_messages(static_cast<size_t>(a.users));
  for (auto& turns : user_messages) {
    for (int t = 0; t < a.turns; ++t) turns.push_back(random_ids(rng, a.user_tokens, vocab));
  }
  const auto start = Clock::now();
  const auto samples = run_parallel(a.users, a.users, [&](int u) {
    std::vector<Sample> conversation;
    std::vector<int32_t> context = system;
    for (int t = 0; t < a.turns; ++t) {
      const auto& message = user_messages[static_cast<size_t>(u)][static_cast<size_t>(t)];
      context.insert(context.end(), message.begin(), message.end());
      conversation.push_back(run_request(host, port, model, context, a.reply_tokens));
      context.insert(context.end(), conversation.back().output.begin(), conversation.back().output.end());
    }
    return conversation;
  });
  json agentic = summarize(samples, std::chrono::duration<double>(Clock::now() - start).count());
  agentic["users"] = a.users;
  agentic["turns"] = a.turns;
  agentic["system_tokens"] = a.system_tokens;
  std::fprintf(stderr, "agentic replay: %s\n", agentic.dump().c_str());
  if (server) {
    server->shutdown();
    server_thread.join();
  }

  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::gmtime(&t));
  const json result = {{"benchmark", "serve"},
                       {"git_revision", tools::git_revision()},
                       {"device", tools::cpu_model()},
                       {"backend", a.model_dir.empty() ? "remote server" : "cpu reference (plow serve in-process)"},
                       {"model", a.model_dir.empty() ? a.url : a.model_dir},
                       {"prefix_cache_mb", a.model_dir.empty() ? json(nullptr) : json(a.prefix_cache_mb)},
                       {"command", tools::process_command_line()},
                       {"utc", stamp},
                       {"concurrency_sweep", sweep},
                       {"agentic_replay", agentic}};
  std::filesystem::create_directories(a.output_dir);
  const std::string path = (std::filesystem::path(a.output_dir) / fmt::format("serve-{}.json", stamp)).string();
  std::ofstream(path) << result.dump(2) << "\n";
  std::printf("%s\n", json{{"results", path}, {"concurrency_sweep", sweep}, {"agentic_replay", agentic}}.dump().c_str());
  return 0;
}

}  // namespace

Subcommand add_bench_serve_command(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* bench = bench_group(app);
  CLI::App* cmd = bench->add_subcommand("serve", "load an OpenAI server: concurrency sweep and multi-turn agentic replay");
  auto* model = cmd->add_option("--model", args->model_dir, "model directory to serve in-process");
  cmd->add_option("--url", args->url, "HOST:PORT of a running server instead")->excludes(model);
  cmd->add_option("--concurrency", args->concurrency, "concurrency levels of the sweep")->delimiter(',');
  cmd->add_option("--requests", args->requests, "requests per concurrency level");
  cmd->add_option("--prompt-tokens", args->prompt_tokens, "prompt tokens of a sweep request");
  cmd->add_option("--max-tokens", args->max_tokens, "generated tokens of a sweep request");
  cmd->add_option("--users", args->users, "agentic replay: concurrent conversations");
  cmd->add_option("--turns", args->turns, "agentic replay: turns per conversation");
  cmd->add_option("--system-tokens", args->system_tokens, "agentic replay: shared system prompt tokens");
  cmd->add_option("--user-tokens", args->user_tokens, "agentic replay: tokens of each user message");
  cmd->add_option("--reply-tokens", args->reply_tokens, "agentic replay: generated tokens per turn");
  cmd->add_option("--slots", args->slots, "with --model: sequences decoding at once");
  cmd->add_option("--prefix-cache-mb", args->prefix_cache_mb, "with --model: prefix cache budget in MiB (0: off)");
  cmd->add_option("--vocab", args->vocab, "token ids are drawn from [0, vocab)");
  cmd->add_option("--seed", args->seed, "prompt seed");
  cmd->add_option("-o,--output-dir", args->output_dir, "where serve-*.json goes");
  return {cmd, [args] { return run_bench_serve(*args); }};
}

}  // namespace plow
