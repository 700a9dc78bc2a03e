// plow chat --model DIR: a terminal chat. Each line read is a user turn; the conversation is rendered
// with the model's chat template and the reply streams to stdout as it is sampled. Runs in-process on
// the scheduler with the prefix cache, so a turn prefills only what the previous turn did not see.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "core/error.h"
#include "engine/model.h"
#include "engine/scheduler.h"
#include "runtime/cpu/reference.h"
#include "serve/chat_template.h"
#include "serve/openai_params.h"
#include "serve/tokenizer.h"
#include "subcommands.h"

namespace plow {

namespace {

struct ChatArgs {
  std::string model_dir;
  std::string system;
  int64_t max_tokens = 256;
  float temperature = 0.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
  int64_t prefix_cache_mb = 256;
};

int run_chat(const ChatArgs& args) {
  if (args.max_tokens < 1) fail("--max-tokens must be >= 1, found {}", args.max_tokens);
  if (args.temperature < 0) fail("--temperature must be >= 0, found {}", args.temperature);
  if (!(args.top_p > 0 && args.top_p <= 1)) fail("--top-p must be in (0, 1], found {}", args.top_p);
  if (args.prefix_cache_mb < 0) fail("--prefix-cache-mb must be >= 0, found {}", args.prefix_cache_mb);
  auto model = LoadedModel::load(args.model_dir);
  const std::filesystem::path dir(args.model_dir);
  if (!std::filesystem::exists(dir / "tokenizer.json") && !std::filesystem::exists(dir / "tiktoken.model")) {
    fail("chat: model directory '{}' has no tokenizer.json or tiktoken.model", args.model_dir);
  }
  const Tokenizer tokenizer = Tokenizer::load(args.model_dir);
  if (!std::filesystem::exists(dir / "tokenizer_config.json")) fail("chat: model directory '{}' has no tokenizer_config.json (chat template)", args.model_dir);
  const ChatTemplate chat_template = ChatTemplate::from_tokenizer_config((dir / "tokenizer_config.json").string());
  ServedModel served;
  served.name = dir.filename().string();
  served.vocab_size = model->config.vocab_size;
  served.max_context_tokens = int64_t{1} << 30;
  served.max_tokens_limit = args.max_tokens;
  for (int64_t id : model->config.eos_token_ids) served.eos_ids.push_back(static_cast<int32_t>(id));
  served.tokenizer = &tokenizer;
  served.chat_template = &chat_template;

  ReferenceBackend backend(model->graph, *model->weights, model->weights->storage_dtype(), 1);
  Scheduler scheduler(backend, {.prefix_cache_bytes = args.prefix_cache_mb << 20});
  nlohmann::json messages = nlohmann::json::array();
  if (!args.system.empty()) messages.push_back({{"role", "system"}, {"content", args.system}});
  std::fprintf(stderr, "plow chat: %s (one line per turn; an empty line or end of input quits)\n", args.model_dir.c_str());
  std::string line;
  for (int turn = 0;; ++turn) {
    std::fprintf(stderr, "> ");
    std::fflush(stderr);
    if (!std::getline(std::cin, line) || line.empty()) break;
    messages.push_back({{"role", "user"}, {"content", line}});
    std::vector<int32_t> prompt;
    try {
      prompt = chat_prompt(messages, served);
    } catch (const std::exception& e) {
      fail("chat: {}", e.what());
    }
    Request request{fmt::format("turn-{}", turn), prompt, {args.temperature, args.top_p, 0, args.seed + static_cast<uint64_t>(turn)}, args.max_tokens,
                    served.eos_ids};
    StreamDecoder decoder(tokenizer, true);
    std::string reply;
    int64_t cached = 0, generated = 0;
    const auto start = std::chrono::steady_clock::now();
    scheduler.submit(
        request,
        [&](int32_t token, const SampledToken&, std::optional<FinishReason> finished) {
          if (token < 0) return;
          ++generated;
          std::string piece = finished == FinishReason::kStop ? std::string() : decoder.push(token);
          if (finished) piece += decoder.flush();
          reply += piece;
          std::fwrite(piece.data(), 1, piece.size(), stdout);
          std::fflush(stdout);
        },
        [&](int64_t c) { cached = c; });
    while (scheduler.has_work()) scheduler.step();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("\n");
    std::fprintf(stderr, "[%lld prompt tokens, %lld from the prefix cache; %lld generated, %.1f tokens/s]\n", static_cast<long long>(prompt.size()),
                 static_cast<long long>(cached), static_cast<long long>(generated), static_cast<double>(generated) / seconds);
    messages.push_back({{"role", "assistant"}, {"content", reply}});
  }
  return 0;
}

}  // namespace

Subcommand add_chat_command(CLI::App& app) {
  auto args = std::make_shared<ChatArgs>();
  CLI::App* cmd = app.add_subcommand("chat", "chat with a model in the terminal (streams replies; uses its chat template)");
  cmd->add_option("--model", args->model_dir, "model directory (weights, tokenizer, tokenizer_config.json with a chat template)")->required();
  cmd->add_option("--system", args->system, "a system message opening the conversation");
  cmd->add_option("--max-tokens", args->max_tokens, "longest reply in tokens");
  cmd->add_option("--temperature", args->temperature, "0 = greedy");
  cmd->add_option("--top-p", args->top_p);
  cmd->add_option("--seed", args->seed, "sampling seed (turn n uses seed + n)");
  cmd->add_option("--prefix-cache-mb", args->prefix_cache_mb, "prefix cache budget in MiB (0: none)");
  return {cmd, [args] { return run_chat(*args); }};
}

}  // namespace plow
