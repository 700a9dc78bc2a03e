// Pre-tokenizer regexes on PCRE2 (UTF + Unicode properties, JIT when available). Patterns come in the
// dialect of the library that defined them (Oniguruma for HF tokenizer.json, Rust's regex crate for
// tiktoken) and are translated to an equivalent PCRE2 pattern first; what cannot be translated is a
// plow::Error naming the file and field, never a silently different split.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

struct pcre2_real_code_8;

namespace plow {

enum class RegexDialect { kOniguruma, kRust };

// Rewrites pattern into PCRE2 syntax with the dialect's meaning: class intersections (`[a&&[^b]]`)
// and Rust differences (`[a--b]`) become lookahead-guarded classes, `\p{Han}` becomes `\p{sc:Han}`
// (PCRE2's bare script name means Script_Extensions), `\s`/`\w`/`\d` get the dialect's Unicode sets,
// Oniguruma's `^`/`$` become line anchors, `\h` a hex digit, `(?m)` dot-all. `where` prefixes errors.
std::string translate_regex(std::string_view pattern, RegexDialect dialect, const std::string& where);

struct MatchSpan {
  size_t begin;
  size_t end;
};

class PretokenRegex {
 public:
  PretokenRegex(std::string_view pattern, RegexDialect dialect, std::string where);
  // Matches text literally (HF Split's {"String": ...} pattern); an empty literal never matches.
  static PretokenRegex literal(std::string_view text, std::string where);
  ~PretokenRegex();
  PretokenRegex(PretokenRegex&& other) noexcept;
  PretokenRegex(const PretokenRegex&) = delete;
  PretokenRegex& operator=(const PretokenRegex&) = delete;
  PretokenRegex& operator=(PretokenRegex&&) = delete;

  // Non-overlapping matches left to right, leftmost-first alternation; an empty match that starts
  // where the previous match ended is skipped (Rust regex and the onig crate do the same).
  // text must be valid UTF-8. Thread-safe.
  void find_all(std::string_view text, std::vector<MatchSpan>& out) const;
  // Whether a match starts at byte 0.
  bool matches_at_start(std::string_view text) const;
  const std::string& pcre2_pattern() const { return pcre2_pattern_; }

 private:
  PretokenRegex(std::string pcre2_pattern, std::string where, bool dollar_end_only);
  int match(std::string_view text, size_t start, uint32_t options) const;

  pcre2_real_code_8* code_ = nullptr;
  std::string pcre2_pattern_;
  std::string where_;
};

}  // namespace plow
