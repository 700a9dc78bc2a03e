// A model's chat template (the Jinja program in tokenizer_config.json) rendered the way HF
// transformers' apply_chat_template renders it: jinja2 with trim_blocks/lstrip_blocks, its sandbox
// rules and HF's globals and tojson. The template is parsed completely at load, so any construct this
// renderer cannot evaluate is a plow::Error then (origin:line:column), never during a request.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <string>

namespace plow {

namespace jinja {
struct Program;
}

// Bounds on one render, so that no template (hostile or broken) can run unboundedly; exceeding one is
// a plow::Error. The defaults leave real templates orders of magnitude of headroom.
struct ChatTemplateLimits {
  int64_t max_steps = 20'000'000;           // evaluations, plus 1 per 16 bytes copied or scanned
  int64_t max_loop_iterations = 2'000'000;  // for-loop iterations, all loops together
  int max_call_depth = 100;                 // nested macro calls
  size_t max_output_bytes = size_t{64} << 20;
};

class ChatTemplate {
 public:
  // Local wall-clock time for the strftime_now() global; replaceable so renders are reproducible.
  using Clock = std::function<std::tm()>;

  // `origin` names the template in every error, e.g. "tokenizer_config.json: chat_template".
  static ChatTemplate parse(std::string source, std::string origin);

  // Reads `chat_template` from an HF tokenizer_config.json: a string, or the list form
  // [{"name": "default", "template": ...}, ...] (the "default" entry), or, when the file has none,
  // a chat_template.jinja beside it. bos_token/eos_token/unk_token/pad_token (strings or
  // {"content": ...} objects) become context defaults.
  static ChatTemplate from_tokenizer_config(const std::string& path);

  // Renders with `context` as the template variables (messages, tools, add_generation_prompt, ...).
  // Like apply_chat_template, tools and documents default to None and add_generation_prompt to
  // false; the tokenizer's special tokens are defaults the context may override. Object key order
  // is what `tojson` prints, as Python dicts keep it: pass ordered_json to keep the client's order
  // (a plain nlohmann::json has its keys sorted). Template errors (raise_exception, type errors,
  // use of undefined values, limits) are a plow::Error naming origin, line and column. Renders share
  // no mutable state: one ChatTemplate may render on several threads at once.
  std::string render(const nlohmann::ordered_json& context) const;
  std::string render(const nlohmann::json& context) const;

  void set_clock(Clock clock) { clock_ = std::move(clock); }
  void set_limits(const ChatTemplateLimits& limits) { limits_ = limits; }
  // Sets a context default such as bos_token (the context passed to render() wins).
  void set_default(const std::string& name, nlohmann::ordered_json value);

  const std::string& source() const { return source_; }
  const std::string& origin() const { return origin_; }
  const nlohmann::ordered_json& defaults() const { return defaults_; }

 private:
  ChatTemplate() = default;

  std::string source_;
  std::string origin_;
  std::shared_ptr<const jinja::Program> program_;
  nlohmann::ordered_json defaults_ = nlohmann::ordered_json::object();
  Clock clock_;
  ChatTemplateLimits limits_;
};

}  // namespace plow
