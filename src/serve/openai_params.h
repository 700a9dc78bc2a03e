// The OpenAI request bodies plow serves (/v1/completions, /v1/chat/completions), parsed and checked:
// every wrong type, out-of-range number, unknown model, bad prompt or context overflow is an ApiError
// (400) naming the field, so a handler only ever sees a request it can run.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "serve/chat_template.h"
#include "serve/tokenizer.h"

namespace plow {

struct ServedModel {
  std::string name;                 // what clients pass as "model"
  int64_t vocab_size = 0;
  int64_t max_context_tokens = 0;   // prompt + generated tokens of one sequence
  int64_t max_tokens_limit = 0;     // largest max_tokens a request may ask for
  std::vector<int32_t> eos_ids;
  const Tokenizer* tokenizer = nullptr;      // absent: token-id prompts only
  const ChatTemplate* chat_template = nullptr;
  // What a request that omits a sampling field gets: OpenAI's temperature 1 unless the model's
  // generation_config.json says otherwise (generation_config.h).
  SamplingParams sampling_defaults{.temperature = 1.0f};
};

struct CompletionParams {
  bool chat = false;
  std::vector<std::vector<int32_t>> prompts;  // one choice per prompt
  int64_t max_tokens = 16;
  SamplingParams sampling;
  std::vector<std::string> stop;        // stop strings, cut from the text
  std::vector<int32_t> stop_token_ids;  // plus the model's eos ids unless ignore_eos
  bool stream = false;
  bool include_usage = false;
  int logprobs = -1;  // −1: none; else top alternatives per token (0..20)
};

// Throws ApiError. `body` is the parsed request JSON.
CompletionParams parse_completion(const nlohmann::json& body, const ServedModel& model, bool chat);
// Renders `messages` with the chat template (add_generation_prompt) and encodes them.
std::vector<int32_t> chat_prompt(const nlohmann::json& messages, const ServedModel& model);
// A prompt field: text, token ids (one prompt); throws ApiError naming `param`.
std::vector<int32_t> parse_prompt(const nlohmann::json& prompt, const ServedModel& model, const std::string& param);

}  // namespace plow
