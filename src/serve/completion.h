// One HTTP completion request in flight: per choice, the generated tokens, the text decoded so far
// (StreamDecoder), stop-string detection that cuts the text at the stop string, and the OpenAI JSON
// for whole responses and SSE chunks. While a choice runs, the last (longest stop − 1) bytes are held
// back from streaming so a stop string split across tokens is never sent.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "serve/engine_loop.h"
#include "serve/openai_params.h"

namespace plow {

class Completion {
 public:
  Completion(CompletionParams params, const ServedModel& model, std::string id);

  const CompletionParams& params() const { return params_; }
  size_t num_choices() const { return choices_.size(); }
  // The scheduler id of choice i.
  std::string request_id(size_t choice) const { return id_ + "-" + std::to_string(choice); }
  // Applies one engine event. Returns true when a stop string ended the choice while the scheduler
  // still runs it (the caller aborts request_id(choice)).
  bool apply(const EngineEvent& event);
  bool done() const;
  bool done(size_t choice) const { return choices_[choice].finish_reason.has_value(); }

  // The SSE chunk for what choice i produced since the last call, or none when there is nothing new.
  std::optional<nlohmann::json> next_chunk(size_t choice);
  nlohmann::json usage_chunk() const;  // choices: [], usage
  nlohmann::json response() const;     // the whole non-streamed response

 private:
  struct Choice {
    std::vector<int32_t> tokens;
    std::vector<SampledToken> sampled;
    std::vector<size_t> text_offsets;  // per token: bytes of text before it
    std::optional<StreamDecoder> decoder;
    std::string text;          // decoded text, cut at a stop string
    size_t sent_bytes = 0;     // of text, streamed already
    size_t sent_tokens = 0;    // of sampled, whose logprobs were streamed
    bool sent_role = false;
    bool sent_finish = false;
    std::optional<std::string> finish_reason;
    int64_t cached_tokens = 0;  // prompt tokens the prefix cache supplied
  };

  bool check_stop(Choice& c, size_t from);
  nlohmann::json logprobs_json(const Choice& c, size_t begin, size_t end) const;
  std::string token_string(int32_t id) const;
  nlohmann::json usage() const;
  nlohmann::json envelope(const char* object) const;

  CompletionParams params_;
  const ServedModel& model_;
  std::string id_;
  int64_t created_;
  size_t max_stop_bytes_ = 0;
  std::vector<Choice> choices_;
};

}  // namespace plow
