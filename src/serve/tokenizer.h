// Text <-> token ids for byte-level BPE models: HF tokenizer.json (BPE + ByteLevel, Split regex
// pre-tokenizers, added tokens) and tiktoken.model + tokenizer_config.json (Kimi). encode() equals HF
// `encode(text, add_special_tokens=False)` / Kimi's `encode(text)`, decode() equals their decode with
// U+FFFD for invalid bytes; tests/unit/tokenizer_test.cpp holds plow to both on committed fixtures.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace plow {

struct TokenizerModel;  // serve/tokenizer_model.h

class Tokenizer {
 public:
  // Reads model_dir/tokenizer.json if present, else model_dir/tiktoken.model plus
  // model_dir/tokenizer_config.json. Anything malformed or unsupported is a plow::Error naming the
  // file and field.
  static Tokenizer load(const std::string& model_dir);

  // allow_special = false encodes special-token text as plain text (HF encode_special_tokens,
  // tiktoken disallowed_special=()); non-special added tokens of tokenizer.json still match.
  // Throws plow::Error when text is not valid UTF-8. Thread-safe.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const;
  // Always valid UTF-8. Throws plow::Error on an id that names no token.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // The id of the token whose text is `text` (added tokens first), or -1.
  int32_t token_id(std::string_view text) const;
  // The bytes a token decodes to (a special token's content; maybe a partial UTF-8 sequence).
  std::string token_text(int32_t id) const;
  bool is_special(int32_t id) const;
  // One past the largest id (ids without a token, if any, are rejected by decode).
  size_t vocab_size() const;

  // The loaded tables (serve/tokenizer_model.h), for StreamDecoder and tests.
  const TokenizerModel& model() const { return *model_; }

 private:
  explicit Tokenizer(std::shared_ptr<const TokenizerModel> model) : model_(std::move(model)) {}
  std::shared_ptr<const TokenizerModel> model_;
};

// Incremental decode of a generated stream: push() returns only complete UTF-8 characters, holding
// back the bytes of a character split across tokens; flush() returns the rest, with U+FFFD for
// bytes that never completed. The concatenated output equals Tokenizer::decode of all ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(Tokenizer tokenizer, bool skip_special = false)
      : tokenizer_(std::move(tokenizer)), skip_special_(skip_special) {}
  std::string push(int32_t id);
  std::string flush();

 private:
  Tokenizer tokenizer_;
  bool skip_special_;
  std::string pending_;  // undecided bytes: at most a 3-byte incomplete sequence between calls
};

}  // namespace plow
