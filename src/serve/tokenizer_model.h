// The loaded tokenizer as plain data, shared by the two loaders (tokenizer_hf.cpp, tokenizer_tiktoken.cpp)
// and the encoder (tokenizer.cpp). Immutable after load, so one instance serves any number of threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "serve/bpe.h"
#include "serve/pretoken_regex.h"

namespace plow {

enum class TokenizerFormat { kHuggingFace, kTiktoken };

// Ids at or above this are rejected at load: real vocabularies are < 1M, and the id tables are dense.
constexpr int64_t kMaxTokenIds = int64_t{1} << 24;

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

// Finds added tokens in text: leftmost match, longest on ties (Aho-Corasick LeftmostLongest, which HF uses).
class AddedTokenMatcher {
 public:
  // members: indices into tokens.
  void build(const std::vector<AddedToken>& tokens, const std::vector<size_t>& members);
  bool empty() const { return count_ == 0; }
  // Index (into the same tokens) of the longest member that matches at text[pos], or -1.
  int64_t match_at(const std::vector<AddedToken>& tokens, std::string_view text, size_t pos) const;

 private:
  std::vector<std::vector<size_t>> by_first_byte_ = std::vector<std::vector<size_t>>(256);  // longest first
  size_t count_ = 0;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel };
  Kind kind = Kind::kSplit;
  std::shared_ptr<const PretokenRegex> regex;  // kByteLevel: GPT-2's pattern, null when use_regex is off
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel
};

struct TokenizerModel {
  TokenizerFormat format = TokenizerFormat::kHuggingFace;
  std::string source;  // the file encode/decode errors name

  std::vector<AddedToken> added_tokens;
  AddedTokenMatcher raw_matcher;         // HF: normalized=false tokens, matched on the input text; tiktoken: all
  AddedTokenMatcher normalized_matcher;  // HF: normalized=true tokens, matched on what is left
  std::vector<PreTokenizerStep> pre_tokenizer;  // HF
  std::unique_ptr<PretokenRegex> tiktoken_regex;
  BpeModel bpe;

  // Per id: the bytes decode emits, whether the id names a token, whether it is special.
  std::vector<std::string> token_bytes;
  std::vector<uint8_t> token_present;
  std::vector<uint8_t> token_special;
  BytesToId id_by_text;  // token_id(): added tokens first, then the lowest id with those bytes

  // Fills id_by_text and the matchers from token_bytes and added_tokens.
  void finish_load();
};

// Loaders (throw plow::Error naming the file and field).
std::shared_ptr<const TokenizerModel> load_hf_tokenizer(const std::string& path);
std::shared_ptr<const TokenizerModel> load_tiktoken_tokenizer(const std::string& model_path, const std::string& config_path);

// tokenization_kimi.py's pat_str (Rust-regex dialect: tiktoken compiles it with fancy_regex).
extern const std::string_view kKimiPattern;

// GPT-2's byte <-> printable character table that byte-level BPE vocabularies are written in.
const std::vector<uint32_t>& byte_level_chars();

}  // namespace plow
