// PCRE2 compile and match for pre-tokenizer regexes. Matching uses per-thread scratch (match data,
// a JIT stack that grows to kJitStackMaxBytes); a piece that exhausts the JIT stack is retried in
// the interpreter, and one that exhausts PCRE2's limits there is a plow::Error, never a wrong split.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "serve/pretoken_regex.h"

#include <pcre2.h>

#include <cctype>

#include "core/error.h"

namespace plow {

namespace {

constexpr size_t kJitStackStartBytes = size_t{64} << 10;
constexpr size_t kJitStackMaxBytes = size_t{64} << 20;
constexpr uint32_t kHeapLimitKib = uint32_t{1} << 20;  // 1 GiB for the interpreter's backtracking frames
constexpr uint32_t kMatchLimit = uint32_t{1} << 30;

struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(kJitStackStartBytes, kJitStackMaxBytes, nullptr);

  MatchScratch() {
    PLOW_CHECK(data && context, "PCRE2 could not allocate match data");
    if (jit_stack) pcre2_jit_stack_assign(context, nullptr, jit_stack);
    pcre2_set_heap_limit(context, kHeapLimitKib);
    pcre2_set_match_limit(context, kMatchLimit);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  MatchScratch(const MatchScratch&) = delete;
  MatchScratch& operator=(const MatchScratch&) = delete;
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

}  // namespace

PretokenRegex::PretokenRegex(std::string_view pattern, RegexDialect dialect, std::string where)
    : PretokenRegex(translate_regex(pattern, dialect, where), std::move(where), dialect == RegexDialect::kRust) {}

PretokenRegex PretokenRegex::literal(std::string_view text, std::string where) {
  std::string pattern;
  for (char c : text) {
    if (static_cast<unsigned char>(c) < 0x80 && !std::isalnum(static_cast<unsigned char>(c))) pattern.push_back('\\');
    pattern.push_back(c);
  }
  // An empty literal matches nowhere: (*FAIL) keeps the one code path.
  return PretokenRegex(text.empty() ? std::string("(*FAIL)") : pattern, std::move(where), false);
}

PretokenRegex::PretokenRegex(std::string pcre2_pattern, std::string where, bool dollar_end_only)
    : pcre2_pattern_(std::move(pcre2_pattern)), where_(std::move(where)) {
  pcre2_compile_context* context = pcre2_compile_context_create(nullptr);
  PLOW_CHECK(context, "PCRE2 could not allocate a compile context");
  pcre2_set_newline(context, PCRE2_NEWLINE_LF);
  int error = 0;
  PCRE2_SIZE offset = 0;
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | (dollar_end_only ? PCRE2_DOLLAR_ENDONLY : 0);
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pcre2_pattern_.data()), pcre2_pattern_.size(), options, &error,
                        &offset, context);
  pcre2_compile_context_free(context);
  if (!code_) {
    fail("{}: regex is not supported: PCRE2 rejects '{}' at offset {}: {}", where_, pcre2_pattern_, offset,
         pcre2_message(error));
  }
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // failure leaves the interpreter, which is correct too
}

PretokenRegex::~PretokenRegex() {
  if (code_) pcre2_code_free(code_);
}

PretokenRegex::PretokenRegex(PretokenRegex&& other) noexcept
    : code_(other.code_), pcre2_pattern_(std::move(other.pcre2_pattern_)), where_(std::move(other.where_)) {
  other.code_ = nullptr;
}

int PretokenRegex::match(std::string_view text, size_t start, uint32_t options) const {
  MatchScratch& s = scratch();
  const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  options |= PCRE2_NO_UTF_CHECK;  // callers validated the whole input once
  int rc = pcre2_match(code_, subject, text.size(), start, options, s.data, s.context);
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    rc = pcre2_match(code_, subject, text.size(), start, options | PCRE2_NO_JIT, s.data, s.context);
  }
  if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {
    fail("{}: pre-tokenizer regex failed on a {}-byte piece: PCRE2: {}", where_, text.size(), pcre2_message(rc));
  }
  return rc;
}

void PretokenRegex::find_all(std::string_view text, std::vector<MatchSpan>& out) const {
  size_t pos = 0;
  bool have_previous = false;
  size_t previous_end = 0;
  while (pos <= text.size()) {
    if (match(text, pos, 0) == PCRE2_ERROR_NOMATCH) break;
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch().data);
    const size_t begin = ovector[0], end = ovector[1];
    if (begin == end && have_previous && begin == previous_end) {
      if (begin >= text.size()) break;
      pos = begin + 1;
      while (pos < text.size() && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    out.push_back({begin, end});
    have_previous = true;
    previous_end = end;
    pos = end;
  }
}

bool PretokenRegex::matches_at_start(std::string_view text) const {
  return match(text, 0, PCRE2_ANCHORED) >= 0;
}

}  // namespace plow
