#include "serve/completion.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "serve/utf8.h"

namespace plow {

using nlohmann::json;

Completion::Completion(CompletionParams params, const ServedModel& model, std::string id)
    : params_(std::move(params)), model_(model), id_(std::move(id)),
      created_(std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count()) {
  for (const std::string& s : params_.stop) max_stop_bytes_ = std::max(max_stop_bytes_, s.size());
  choices_.resize(params_.prompts.size());
  if (model_.tokenizer) {
    for (Choice& c : choices_) c.decoder.emplace(*model_.tokenizer, true);
  }
}

bool Completion::done() const {
  return std::all_of(choices_.begin(), choices_.end(), [](const Choice& c) { return c.finish_reason.has_value(); });
}

// Looks for a stop string starting at or after `from`; on a match cuts the text there and finishes.
bool Completion::check_stop(Choice& c, size_t from) {
  size_t best = std::string::npos;
  for (const std::string& s : params_.stop) best = std::min(best, c.text.find(s, from));
  if (best == std::string::npos) return false;
  c.text.resize(best);
  c.finish_reason = "stop";
  return true;
}

bool Completion::apply(const EngineEvent& event) {
  Choice& c = choices_[event.choice];
  if (event.cached_tokens) {  // the admission event
    c.cached_tokens = *event.cached_tokens;
    return false;
  }
  if (c.finish_reason) return false;  // already cut by a stop string
  if (event.token >= 0) {
    c.tokens.push_back(event.token);
    c.sampled.push_back(event.sampled);
    c.text_offsets.push_back(c.text.size());
    if (c.decoder) {
      const size_t before = c.text.size();
      // The stop token (eos or stop_token_ids) counts as generated but adds no text, as in vLLM.
      if (event.finished != FinishReason::kStop) c.text += c.decoder->push(event.token);
      if (event.finished) c.text += c.decoder->flush();
      const size_t from = before >= max_stop_bytes_ ? before - max_stop_bytes_ + 1 : 0;
      if (check_stop(c, from)) return !event.finished;
    }
  }
  if (event.finished) c.finish_reason = finish_reason_name(*event.finished);
  return false;
}

// A token's text, or "bytes:\\xNN..." when it is not whole UTF-8 (a byte-level piece of a character),
// so that distinct tokens never print the same (as vLLM does); "token_id:N" without a tokenizer.
std::string Completion::token_string(int32_t id) const {
  if (!model_.tokenizer) return "token_id:" + std::to_string(id);
  const std::string text = model_.tokenizer->token_text(id);
  if (!utf8::first_invalid(text)) return text;
  std::string out = "bytes:";
  for (unsigned char b : text) out += fmt::format("\\x{:02x}", b);
  return out;
}

json Completion::logprobs_json(const Choice& c, size_t begin, size_t end) const {
  if (params_.chat) {
    json content = json::array();
    for (size_t i = begin; i < end; ++i) {
      auto entry = [&](int32_t id, float lp) {
        const std::string t = token_string(id);
        return json{{"token", t}, {"logprob", lp}, {"bytes", std::vector<uint8_t>(t.begin(), t.end())}};
      };
      json e = entry(c.sampled[i].id, c.sampled[i].logprob);
      e["top_logprobs"] = json::array();
      for (const auto& [id, lp] : c.sampled[i].top) e["top_logprobs"].push_back(entry(id, lp));
      content.push_back(e);
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  for (size_t i = begin; i < end; ++i) {
    tokens.push_back(token_string(c.sampled[i].id));
    token_logprobs.push_back(c.sampled[i].logprob);
    json alternatives = json::object();
    for (const auto& [id, lp] : c.sampled[i].top) alternatives[token_string(id)] = lp;
    top.push_back(alternatives);
    offsets.push_back(std::min(c.text_offsets[i], c.text.size()));
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

json Completion::envelope(const char* object) const {
  return {{"id", id_}, {"object", object}, {"created", created_}, {"model", model_.name}};
}

json Completion::usage() const {
  int64_t prompt = 0, completion = 0, cached = 0;
  for (const auto& p : params_.prompts) prompt += static_cast<int64_t>(p.size());
  for (const Choice& c : choices_) {
    completion += static_cast<int64_t>(c.tokens.size());
    cached += c.cached_tokens;
  }
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

std::optional<json> Completion::next_chunk(size_t choice) {
  Choice& c = choices_[choice];
  if (c.sent_finish) return std::nullopt;
  size_t end = c.text.size();
  if (!c.finish_reason) {
    end = end >= max_stop_bytes_ ? end - (max_stop_bytes_ > 0 ? max_stop_bytes_ - 1 : 0) : 0;
    end = std::max(end, c.sent_bytes);
    while (end > c.sent_bytes && (static_cast<unsigned char>(c.text[end]) & 0xC0) == 0x80) --end;  // whole characters only
  }
  const std::string delta = c.text.substr(c.sent_bytes, end - c.sent_bytes);
  const size_t new_tokens = c.sampled.size() - c.sent_tokens;
  if (delta.empty() && new_tokens == 0 && !c.finish_reason && c.sent_role) return std::nullopt;
  json item = {{"index", choice}};
  if (params_.chat) {
    json d = json::object();
    if (!c.sent_role) d["role"] = "assistant";
    if (!delta.empty()) d["content"] = delta;
    item["delta"] = d;
  } else {
    item["text"] = delta;
  }
  item["logprobs"] = params_.logprobs >= 0 && new_tokens > 0 ? logprobs_json(c, c.sent_tokens, c.sampled.size()) : json(nullptr);
  item["finish_reason"] = c.finish_reason ? json(*c.finish_reason) : json(nullptr);
  item["token_ids"] = std::vector<int32_t>(c.tokens.begin() + static_cast<long>(c.sent_tokens), c.tokens.end());
  c.sent_role = true;
  c.sent_bytes = end;
  c.sent_tokens = c.sampled.size();
  c.sent_finish = c.finish_reason.has_value();
  json chunk = envelope(params_.chat ? "chat.completion.chunk" : "text_completion");
  chunk["choices"] = json::array({item});
  if (params_.include_usage) chunk["usage"] = nullptr;
  return chunk;
}

json Completion::usage_chunk() const {
  json chunk = envelope(params_.chat ? "chat.completion.chunk" : "text_completion");
  chunk["choices"] = json::array();
  chunk["usage"] = usage();
  return chunk;
}

json Completion::response() const {
  json out = envelope(params_.chat ? "chat.completion" : "text_completion");
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    json item = {{"index", i}};
    if (params_.chat) {
      item["message"] = {{"role", "assistant"}, {"content", c.text}};
    } else {
      item["text"] = c.text;
    }
    item["logprobs"] = params_.logprobs >= 0 ? logprobs_json(c, 0, c.sampled.size()) : json(nullptr);
    item["finish_reason"] = c.finish_reason ? json(*c.finish_reason) : json(nullptr);
    item["token_ids"] = c.tokens;  // plow extension: the generated ids (tests compare them with `plow generate`)
    choices.push_back(item);
  }
  out["choices"] = choices;
  out["usage"] = usage();
  return out;
}

}  // namespace plow
