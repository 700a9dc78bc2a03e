#include "serve/openai_params.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "core/error.h"
#include "serve/api_error.h"

namespace plow {

namespace {

using nlohmann::json;

constexpr size_t kMaxStopStrings = 4;
constexpr size_t kMaxStopBytes = 256;
constexpr int kMaxLogprobs = 20;

[[noreturn]] void bad(const std::string& param, const std::string& message) { throw ApiError(400, message, param); }

const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

double number(const json& body, const char* name, double fallback, double lo, double hi) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number()) bad(name, fmt::format("'{}' must be a number, found {}", name, v->type_name()));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi) bad(name, fmt::format("'{}' must be in [{}, {}], found {}", name, lo, hi, v->dump()));
  return x;
}

int64_t integer(const json& body, const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number_integer()) bad(name, fmt::format("'{}' must be an integer, found {}", name, v->dump()));
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi)) {
    bad(name, fmt::format("'{}' must be in [{}, {}], found {}", name, lo, hi, v->dump()));
  }
  const auto x = v->get<int64_t>();
  if (x < lo || x > hi) bad(name, fmt::format("'{}' must be in [{}, {}], found {}", name, lo, hi, x));
  return x;
}

bool boolean(const json& body, const char* name, bool fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_boolean()) bad(name, fmt::format("'{}' must be a boolean, found {}", name, v->type_name()));
  return v->get<bool>();
}

std::vector<int32_t> encode(const std::string& text, const ServedModel& model, const std::string& param) {
  if (!model.tokenizer) bad(param, fmt::format("model '{}' has no tokenizer: pass token ids", model.name));
  try {
    return model.tokenizer->encode(text);
  } catch (const Error& e) {
    bad(param, e.what());
  }
}

void check_ids(const std::vector<int32_t>& ids, const ServedModel& model, const std::string& param) {
  if (ids.empty()) bad(param, fmt::format("'{}' is empty", param));
  if (static_cast<int64_t>(ids.size()) >= model.max_context_tokens) {
    bad(param, fmt::format("This model's maximum context length is {} tokens; the prompt has {} tokens", model.max_context_tokens, ids.size()));
  }
}

void parse_stop(const json& body, CompletionParams& p, const ServedModel& model) {
  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      p.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array() && stop->size() <= kMaxStopStrings) {
      for (const json& s : *stop) {
        if (!s.is_string()) bad("stop", "'stop' must be a string or a list of strings");
        p.stop.push_back(s.get<std::string>());
      }
    } else {
      bad("stop", fmt::format("'stop' must be a string or a list of at most {} strings", kMaxStopStrings));
    }
    for (const std::string& s : p.stop) {
      if (s.empty() || s.size() > kMaxStopBytes) bad("stop", fmt::format("each stop string must have 1 to {} bytes, found {}", kMaxStopBytes, s.size()));
    }
    if (!p.stop.empty() && !model.tokenizer) bad("stop", fmt::format("model '{}' has no tokenizer: use stop_token_ids", model.name));
  }
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array() || ids->size() > 64) bad("stop_token_ids", "'stop_token_ids' must be a list of at most 64 token ids");
    for (const json& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= model.vocab_size) {
        bad("stop_token_ids", fmt::format("'stop_token_ids' entries must be ids in [0, {}), found {}", model.vocab_size, id.dump()));
      }
      p.stop_token_ids.push_back(id.get<int32_t>());
    }
  }
  if (!boolean(body, "ignore_eos", false)) p.stop_token_ids.insert(p.stop_token_ids.end(), model.eos_ids.begin(), model.eos_ids.end());
}

void parse_sampling(const json& body, const SamplingParams& defaults, CompletionParams& p) {
  SamplingParams& s = p.sampling;
  s.temperature = static_cast<float>(number(body, "temperature", defaults.temperature, 0.0, 2.0));
  s.top_p = static_cast<float>(number(body, "top_p", defaults.top_p, 0.0, 1.0));
  if (s.top_p <= 0) bad("top_p", "'top_p' must be in (0, 1], found 0");
  const int64_t top_k = integer(body, "top_k", defaults.top_k, -1, 1 << 30);
  s.top_k = top_k < 0 ? 0 : top_k;
  s.min_p = static_cast<float>(number(body, "min_p", defaults.min_p, 0.0, 1.0));
  s.seed = static_cast<uint64_t>(integer(body, "seed", 0, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()));
  s.presence_penalty = static_cast<float>(number(body, "presence_penalty", 0.0, -2.0, 2.0));
  s.frequency_penalty = static_cast<float>(number(body, "frequency_penalty", 0.0, -2.0, 2.0));
  s.repetition_penalty = static_cast<float>(number(body, "repetition_penalty", defaults.repetition_penalty, 0.01, 10.0));
}

}  // namespace

std::vector<int32_t> parse_prompt(const json& prompt, const ServedModel& model, const std::string& param) {
  std::vector<int32_t> ids;
  if (prompt.is_string()) {
    ids = encode(prompt.get<std::string>(), model, param);
  } else if (prompt.is_array()) {
    for (const json& id : prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= model.vocab_size) {
        bad(param, fmt::format("'{}' must be text or token ids in [0, {}), found {}", param, model.vocab_size, id.dump()));
      }
      ids.push_back(id.get<int32_t>());
    }
  } else {
    bad(param, fmt::format("'{}' must be a string or a list of token ids, found {}", param, prompt.type_name()));
  }
  check_ids(ids, model, param);
  return ids;
}

std::vector<int32_t> chat_prompt(const json& messages, const ServedModel& model) {
  if (!messages.is_array() || messages.empty()) bad("messages", "'messages' must be a non-empty list");
  if (!model.tokenizer || !model.chat_template) bad("messages", fmt::format("model '{}' has no tokenizer or chat template", model.name));
  nlohmann::ordered_json rendered_messages = nlohmann::ordered_json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) bad(param, fmt::format("'{}' must be an object with a string 'role'", param));
    std::string content;
    const json* c = field(m, "content");
    if (c && c->is_string()) {
      content = c->get<std::string>();
    } else if (c && c->is_array()) {
      for (const json& part : *c) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string()) {
          bad(param + ".content", "content parts must be {\"type\": \"text\", \"text\": string}");
        }
        content += part["text"].get<std::string>();
      }
    } else if (c) {
      bad(param + ".content", "'content' must be a string or a list of text parts");
    }
    rendered_messages.push_back({{"role", m["role"].get<std::string>()}, {"content", content}});
  }
  std::string text;
  try {
    text = model.chat_template->render(nlohmann::ordered_json{{"messages", rendered_messages}, {"add_generation_prompt", true}});
  } catch (const Error& e) {
    bad("messages", fmt::format("chat template: {}", e.what()));
  }
  std::vector<int32_t> ids = encode(text, model, "messages");
  check_ids(ids, model, "messages");
  return ids;
}

CompletionParams parse_completion(const json& body, const ServedModel& model, bool chat) {
  if (!body.is_object()) bad("", "the request body must be a JSON object");
  CompletionParams p;
  p.chat = chat;
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) bad("model", fmt::format("'model' must be a string, found {}", m->dump()));
    // 404 as OpenAI and vLLM answer an unknown model (the openai client raises NotFoundError).
    if (m->get<std::string>() != model.name) throw ApiError(404, fmt::format("The model '{}' does not exist; this server serves '{}'", m->get<std::string>(), model.name), "model");
  }
  if (chat) {
    const json* messages = field(body, "messages");
    if (!messages) bad("messages", "'messages' is required");
    p.prompts.push_back(chat_prompt(*messages, model));
  } else {
    const json* prompt = field(body, "prompt");
    if (!prompt) bad("prompt", "'prompt' is required");
    const bool batch = prompt->is_array() && !prompt->empty() && ((*prompt)[0].is_string() || (*prompt)[0].is_array());
    if (batch) {
      if (prompt->size() > 64) bad("prompt", "at most 64 prompts per request");
      for (size_t i = 0; i < prompt->size(); ++i) p.prompts.push_back(parse_prompt((*prompt)[i], model, fmt::format("prompt[{}]", i)));
    } else {
      p.prompts.push_back(parse_prompt(*prompt, model, "prompt"));
    }
  }
  if (integer(body, "n", 1, 1, 1) != 1) bad("n", "only n = 1 is supported");
  const char* max_name = chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  const int64_t default_max = chat ? model.max_tokens_limit : 16;
  p.max_tokens = integer(body, max_name, default_max, 1, model.max_tokens_limit);
  for (const auto& prompt : p.prompts) {
    const int64_t room = model.max_context_tokens - static_cast<int64_t>(prompt.size());
    if (p.max_tokens > room) {
      if (chat && !field(body, max_name)) {
        p.max_tokens = room;
      } else {
        bad(max_name, fmt::format("This model's maximum context length is {} tokens; the prompt has {} tokens and {} = {} asks for more",
                                  model.max_context_tokens, prompt.size(), max_name, p.max_tokens));
      }
    }
  }
  parse_sampling(body, model.sampling_defaults, p);
  parse_stop(body, p, model);
  p.stream = boolean(body, "stream", false);
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) bad("stream_options", "'stream_options' must be an object");
    p.include_usage = boolean(*options, "include_usage", false);
  }
  if (chat) {
    if (boolean(body, "logprobs", false)) p.logprobs = static_cast<int>(integer(body, "top_logprobs", 0, 0, kMaxLogprobs));
  } else {
    p.logprobs = static_cast<int>(integer(body, "logprobs", -1, 0, kMaxLogprobs));
  }
  p.sampling.top_logprobs = p.logprobs;
  return p;
}

}  // namespace plow
