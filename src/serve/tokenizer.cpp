// encode / decode / streaming decode over a loaded TokenizerModel. The HF path follows
// tokenizers' order exactly: added tokens without normalization, added tokens with it (no normalizer
// is supported, so both see the input text), each pre-tokenizer step over the pieces left, then BPE.
// The tiktoken path follows tokenization_kimi.py: 400k-character windows, whitespace/non-whitespace
// runs of at most 25k characters, special tokens, then the pattern's matches (unmatched text dropped).
#include "serve/tokenizer.h"

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "serve/tokenizer_model.h"
#include "serve/utf8.h"

namespace plow {

namespace {

constexpr size_t kKimiWindowChars = 400'000;  // TIKTOKEN_MAX_ENCODE_CHARS
constexpr size_t kKimiMaxRunChars = 25'000;   // MAX_NO_WHITESPACES_CHARS

struct Piece {
  std::string text;
  int32_t id = -1;  // >= 0: an added token, never split further
};

// Rust regex `\w` (HF checks single_word with it): Alphabetic, marks, decimal digits, connectors.
const PretokenRegex& word_char() {
  static const PretokenRegex regex("\\w", RegexDialect::kRust, "tokenizer single_word check");
  return regex;
}

bool ends_with_word(std::string_view s) {
  return !s.empty() && word_char().matches_at_start(s.substr(utf8::last_code_point_start(s)));
}

bool starts_with_word(std::string_view s) { return !s.empty() && word_char().matches_at_start(s); }

// Start of the White_Space run that ends s.
size_t space_run_at_end(std::string_view s) {
  size_t pos = 0, run_start = 0;
  while (pos < s.size()) {
    if (!utf8::is_white_space(utf8::next_code_point(s, pos))) run_start = pos;
  }
  return run_start;
}

size_t space_run_at_start(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t next = pos;
    if (!utf8::is_white_space(utf8::next_code_point(s, next))) break;
    pos = next;
  }
  return pos;
}

// tokenizers' AddedVocabulary::find_matches for one piece, flags and all.
void split_on_added(const TokenizerModel& m, const AddedTokenMatcher& matcher, const std::string& sentence,
                    bool allow_special, std::vector<Piece>& out) {
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < sentence.size()) {
    const int64_t index = matcher.match_at(m.added_tokens, sentence, pos);
    if (index < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = m.added_tokens[index];
    size_t start = pos, stop = pos + token.content.size();
    pos = stop;  // the matcher moves on past a match even when the flags below discard it
    if (token.special && !allow_special) continue;
    if (token.single_word) {
      const std::string_view s = sentence;
      if ((start > 0 && ends_with_word(s.substr(0, start))) || (stop < s.size() && starts_with_word(s.substr(stop)))) {
        continue;
      }
    }
    if (token.lstrip) start = std::max(space_run_at_end(std::string_view(sentence).substr(0, start)), start_offset);
    if (token.rstrip) stop += space_run_at_start(std::string_view(sentence).substr(stop));
    if (start_offset < start) out.push_back({sentence.substr(start_offset, start - start_offset)});
    out.push_back({sentence.substr(start, stop - start), token.id});
    start_offset = stop;
  }
  if (start_offset < sentence.size()) out.push_back({sentence.substr(start_offset)});
}

// tokenizers' NormalizedString::split: the pattern's matches and the gaps between them, merged or
// dropped by behavior; empty pieces vanish.
void split_piece(const PreTokenizerStep& step, const std::string& text, std::vector<Piece>& out) {
  struct Span {
    size_t begin, end;
    bool is_match;
  };
  std::vector<MatchSpan> matches;
  step.regex->find_all(text, matches);
  std::vector<Span> spans;
  size_t prev = 0;
  for (const MatchSpan& m : matches) {
    if (prev != m.begin) spans.push_back({prev, m.begin, false});
    spans.push_back({m.begin, m.end, true});
    prev = m.end;
  }
  if (prev != text.size()) spans.push_back({prev, text.size(), false});
  if (step.invert) {
    for (Span& s : spans) s.is_match = !s.is_match;
  }
  std::vector<Span> kept;  // is_match here means "remove"
  bool previous_match = false;
  switch (step.behavior) {
    case SplitBehavior::kIsolated:
      for (const Span& s : spans) kept.push_back({s.begin, s.end, false});
      break;
    case SplitBehavior::kRemoved:
      kept = spans;
      break;
    case SplitBehavior::kContiguous:
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !kept.empty()) kept.back().end = s.end;
        else kept.push_back({s.begin, s.end, false});
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !kept.empty()) kept.back().end = s.end;
        else kept.push_back({s.begin, s.end, false});
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !kept.empty()) kept.back().begin = it->begin;
        else kept.push_back({it->begin, it->end, false});
        previous_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  for (const Span& s : kept) {
    if (!s.is_match && s.end > s.begin) out.push_back({text.substr(s.begin, s.end - s.begin)});
  }
}

void apply_step(const PreTokenizerStep& step, std::vector<Piece>& pieces) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& piece : pieces) {
    if (piece.id >= 0) {
      out.push_back(std::move(piece));
      continue;
    }
    if (step.kind == PreTokenizerStep::Kind::kByteLevel) {
      if (step.add_prefix_space && piece.text.front() != ' ') piece.text = ' ' + piece.text;
      if (!step.regex) {
        out.push_back(std::move(piece));
        continue;
      }
    }
    split_piece(step, piece.text, out);
  }
  pieces = std::move(out);
}

void encode_hf(const TokenizerModel& m, std::string_view text, bool allow_special, std::vector<int32_t>& ids) {
  std::vector<Piece> pieces{{std::string(text)}};
  for (const AddedTokenMatcher* matcher : {&m.raw_matcher, &m.normalized_matcher}) {
    if (matcher->empty()) continue;
    std::vector<Piece> split;
    for (Piece& piece : pieces) {
      if (piece.id >= 0) split.push_back(std::move(piece));
      else split_on_added(m, *matcher, piece.text, allow_special, split);
    }
    pieces = std::move(split);
  }
  for (const PreTokenizerStep& step : m.pre_tokenizer) apply_step(step, pieces);
  for (const Piece& piece : pieces) {
    if (piece.id >= 0) ids.push_back(piece.id);
    else m.bpe.encode(piece.text, ids);
  }
}

void encode_tiktoken_ordinary(const TokenizerModel& m, std::string_view text, std::vector<int32_t>& ids) {
  std::vector<MatchSpan> matches;
  m.tiktoken_regex->find_all(text, matches);
  for (const MatchSpan& s : matches) m.bpe.encode(text.substr(s.begin, s.end - s.begin), ids);
}

void encode_tiktoken_segment(const TokenizerModel& m, std::string_view text, bool allow_special,
                             std::vector<int32_t>& ids) {
  size_t start = 0;
  if (allow_special) {
    for (size_t pos = 0; pos < text.size();) {
      const int64_t index = m.raw_matcher.match_at(m.added_tokens, text, pos);
      if (index < 0) {
        ++pos;
        continue;
      }
      encode_tiktoken_ordinary(m, text.substr(start, pos - start), ids);
      ids.push_back(m.added_tokens[index].id);
      pos += m.added_tokens[index].content.size();
      start = pos;
    }
  }
  encode_tiktoken_ordinary(m, text.substr(start), ids);
}

// tokenization_kimi.py: _split_whitespaces_or_nonwhitespaces over 400k-character windows, counting
// characters (code points) and classifying them with Python's str.isspace.
void encode_tiktoken(const TokenizerModel& m, std::string_view text, bool allow_special, std::vector<int32_t>& ids) {
  size_t window_start = 0;
  while (window_start < text.size()) {
    size_t window_end = window_start, chars = 0;
    while (window_end < text.size() && chars < kKimiWindowChars) {
      utf8::next_code_point(text, window_end);
      ++chars;
    }
    const std::string_view window = text.substr(window_start, window_end - window_start);
    size_t pos = 0, run_chars = 0, slice_start = 0;
    bool run_is_space = false;
    if (!window.empty()) {
      size_t probe = 0;
      run_is_space = utf8::is_python_space(utf8::next_code_point(window, probe));
    }
    while (pos < window.size()) {
      const size_t char_start = pos;
      const bool is_space = utf8::is_python_space(utf8::next_code_point(window, pos));
      if (is_space != run_is_space) {
        run_chars = 1;
        run_is_space = is_space;
      } else if (++run_chars > kKimiMaxRunChars) {
        encode_tiktoken_segment(m, window.substr(slice_start, char_start - slice_start), allow_special, ids);
        slice_start = char_start;
        run_chars = 1;
      }
    }
    encode_tiktoken_segment(m, window.substr(slice_start), allow_special, ids);
    window_start = window_end;
  }
}

void check_id(const TokenizerModel& m, int32_t id) {
  if (id < 0 || static_cast<size_t>(id) >= m.token_present.size() || !m.token_present[id]) {
    fail("{}: token id {} is not in the vocabulary (size {})", m.source, id, m.token_present.size());
  }
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const fs::path dir(model_dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("{}: not a directory (expected a model directory with a tokenizer)", model_dir);
  if (fs::exists(dir / "tokenizer.json", ec)) return Tokenizer(load_hf_tokenizer((dir / "tokenizer.json").string()));
  if (fs::exists(dir / "tiktoken.model", ec)) {
    return Tokenizer(load_tiktoken_tokenizer((dir / "tiktoken.model").string(), (dir / "tokenizer_config.json").string()));
  }
  fail("{}: no tokenizer.json or tiktoken.model in this directory", model_dir);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  if (const auto bad = utf8::first_invalid(text)) {
    fail("{}: cannot encode text that is not valid UTF-8 (byte {} of {}: 0x{:02X})", model_->source, *bad, text.size(),
         static_cast<uint8_t>(text[*bad]));
  }
  std::vector<int32_t> ids;
  if (text.empty()) return ids;
  if (model_->format == TokenizerFormat::kHuggingFace) encode_hf(*model_, text, allow_special, ids);
  else encode_tiktoken(*model_, text, allow_special, ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    check_id(*model_, id);
    if (skip_special && model_->token_special[id]) continue;
    bytes += model_->token_bytes[id];
  }
  std::string text;
  utf8::append_lossy(bytes, text);
  return text;
}

int32_t Tokenizer::token_id(std::string_view text) const {
  auto it = model_->id_by_text.find(text);
  return it == model_->id_by_text.end() ? -1 : it->second;
}

std::string Tokenizer::token_text(int32_t id) const {
  check_id(*model_, id);
  return model_->token_bytes[id];
}

bool Tokenizer::is_special(int32_t id) const {
  check_id(*model_, id);
  return model_->token_special[id] != 0;
}

size_t Tokenizer::vocab_size() const { return model_->token_present.size(); }

std::string StreamDecoder::push(int32_t id) {
  const TokenizerModel& m = tokenizer_.model();
  check_id(m, id);
  if (skip_special_ && m.token_special[id]) return {};
  pending_ += m.token_bytes[id];
  const size_t ready = pending_.size() - utf8::incomplete_tail(pending_);
  std::string text;
  utf8::append_lossy(std::string_view(pending_).substr(0, ready), text);
  pending_.erase(0, ready);
  return text;
}

std::string StreamDecoder::flush() {
  std::string text;
  utf8::append_lossy(pending_, text);
  pending_.clear();
  return text;
}

void AddedTokenMatcher::build(const std::vector<AddedToken>& tokens, const std::vector<size_t>& members) {
  for (auto& bucket : by_first_byte_) bucket.clear();
  for (size_t index : members) by_first_byte_[static_cast<uint8_t>(tokens[index].content[0])].push_back(index);
  for (auto& bucket : by_first_byte_) {
    std::stable_sort(bucket.begin(), bucket.end(),
                     [&](size_t a, size_t b) { return tokens[a].content.size() > tokens[b].content.size(); });
  }
  count_ = members.size();
}

int64_t AddedTokenMatcher::match_at(const std::vector<AddedToken>& tokens, std::string_view text, size_t pos) const {
  for (size_t index : by_first_byte_[static_cast<uint8_t>(text[pos])]) {
    const std::string& content = tokens[index].content;
    if (text.compare(pos, content.size(), content) == 0) return static_cast<int64_t>(index);
  }
  return -1;
}

void TokenizerModel::finish_load() {
  for (const AddedToken& t : added_tokens) id_by_text.emplace(t.content, t.id);
  for (size_t id = 0; id < token_bytes.size(); ++id) {
    if (token_present[id]) id_by_text.emplace(token_bytes[id], static_cast<int32_t>(id));
  }
  std::vector<size_t> raw, normalized;
  for (size_t i = 0; i < added_tokens.size(); ++i) {
    const bool normalized_match = format == TokenizerFormat::kHuggingFace && added_tokens[i].normalized;
    (normalized_match ? normalized : raw).push_back(i);
  }
  raw_matcher.build(added_tokens, raw);
  normalized_matcher.build(added_tokens, normalized);
}

}  // namespace plow
