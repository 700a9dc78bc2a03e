// jinja2's lexer rules (lexer.py) for the default delimiters, trim_blocks and lstrip_blocks: text
// before a block or comment tag loses its trailing spaces on that line, a block or comment end eats
// one newline, `-` strips all whitespace on that side and `+` disables both. String literals are
// decoded like Python's unicode-escape, numbers like Python literals.
#include "serve/jinja_lexer.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "serve/jinja_strings.h"

namespace plow::jinja {

SourceMap::SourceMap(std::string_view source) : source_(source) {
  line_starts_.push_back(0);
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\n') line_starts_.push_back(i + 1);
  }
}

SourcePos SourceMap::at(size_t offset) const {
  offset = std::min(offset, source_.size());
  auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
  size_t line = static_cast<size_t>(it - line_starts_.begin());
  size_t start = line_starts_[line - 1];
  if (last_pos_.line == line && last_offset_ <= offset) {
    last_pos_.column += static_cast<uint32_t>(code_point_count(source_.substr(last_offset_, offset - last_offset_)));
  } else {
    last_pos_ = {static_cast<uint32_t>(line),
                 static_cast<uint32_t>(code_point_count(source_.substr(start, offset - start)) + 1)};
  }
  last_offset_ = offset;
  return last_pos_;
}

std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }
bool is_tag_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& origin) : src_(source), origin_(origin), map_(source) {}

  std::vector<Token> run() {
    size_t pos = 0;
    while (pos < src_.size()) {
      size_t tag = next_tag(pos);
      if (tag == std::string_view::npos) {
        emit_data(pos, std::string(src_.substr(pos)));
        break;
      }
      char kind = src_[tag + 1];
      size_t after = tag + 2;
      char sign = 0;
      if (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];
      size_t raw_body = kind == '%' ? match_raw_open(after) : std::string_view::npos;
      emit_data(pos, strip_before(src_.substr(pos, tag - pos), sign, kind != '{'));
      if (raw_body != std::string_view::npos) {
        pos = lex_raw(tag, raw_body);
      } else if (kind == '#') {
        pos = lex_comment(tag, after);
      } else {
        pos = lex_tag(tag, after, kind == '%');
      }
    }
    Token eof;
    eof.type = TokenType::kEof;
    eof.pos = map_.at(src_.size());
    tokens_.push_back(eof);
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void error(size_t offset, const std::string& message) const {
    SourcePos p = map_.at(offset);
    fail("{}:{}:{}: {}", origin_, p.line, p.column, message);
  }

  size_t next_tag(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string_view::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return std::string_view::npos;
  }

  // Python's \s* after a `-` end marker; returns the new position.
  size_t skip_python_space(size_t pos) const {
    while (pos < src_.size()) {
      size_t next = pos;
      if (!is_python_space(next_code_point(src_, next))) break;
      pos = next;
    }
    return pos;
  }

  // The lstrip/`-` rules for the text in front of a tag (OptionalLStrip in jinja2).
  std::string strip_before(std::string_view text, char sign, bool block_or_comment) const {
    if (sign == '-') return py_strip(text, std::nullopt, false, true);
    if (sign == '+' || !block_or_comment) return std::string(text);
    size_t line_start = text.rfind('\n');
    line_start = line_start == std::string_view::npos ? 0 : line_start + 1;
    if (line_start == 0 && !line_starting_) return std::string(text);
    std::string_view tail = text.substr(line_start);
    if (tail.empty()) return std::string(text);
    for (size_t p = 0; p < tail.size();) {
      if (!is_python_space(next_code_point(tail, p))) return std::string(text);
    }
    return std::string(text.substr(0, line_start));
  }

  void emit_data(size_t offset, std::string text) {
    if (text.empty()) return;
    Token token;
    token.type = TokenType::kData;
    token.text = std::move(text);
    token.pos = map_.at(offset);
    tokens_.push_back(std::move(token));
  }

  void emit(TokenType type, size_t offset, std::string text = {}) {
    Token token;
    token.type = type;
    token.text = std::move(text);
    token.pos = map_.at(offset);
    tokens_.push_back(std::move(token));
  }

  // After `{%` and its sign: `\s*raw\s*` then `-%}` or `%}`; returns where the raw body starts.
  size_t match_raw_open(size_t pos) const {
    while (pos < src_.size() && is_tag_space(src_[pos])) ++pos;
    if (src_.compare(pos, 3, "raw") != 0) return std::string_view::npos;
    pos += 3;
    while (pos < src_.size() && is_tag_space(src_[pos])) ++pos;
    if (src_.compare(pos, 3, "-%}") == 0) return skip_python_space(pos + 3);
    if (src_.compare(pos, 2, "%}") == 0) return pos + 2;
    return std::string_view::npos;
  }

  size_t lex_raw(size_t tag, size_t body) {
    line_starting_ = body > 0 && src_[body - 1] == '\n';
    for (size_t open = src_.find("{%", body); open != std::string_view::npos; open = src_.find("{%", open + 1)) {
      size_t p = open + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      while (p < src_.size() && is_tag_space(src_[p])) ++p;
      if (src_.compare(p, 6, "endraw") != 0) continue;
      p += 6;
      while (p < src_.size() && is_tag_space(src_[p])) ++p;
      size_t end = match_block_end(p);
      if (end == std::string_view::npos) continue;
      emit_data(body, strip_before(src_.substr(body, open - body), sign, true));
      line_starting_ = src_[end - 1] == '\n';
      return end;
    }
    error(tag, "missing end of raw directive");
  }

  // `+%}`, `-%}\s*` or `%}\n?` at pos (trim_blocks); returns the position after it, or npos.
  size_t match_block_end(size_t pos) const {
    if (src_.compare(pos, 3, "+%}") == 0) return pos + 3;
    if (src_.compare(pos, 3, "-%}") == 0) return skip_python_space(pos + 3);
    if (src_.compare(pos, 2, "%}") == 0) return (pos + 2 < src_.size() && src_[pos + 2] == '\n') ? pos + 3 : pos + 2;
    return std::string_view::npos;
  }

  size_t lex_comment(size_t tag, size_t content) {
    size_t close = src_.find("#}", content);
    if (close == std::string_view::npos) error(tag, "missing end of comment tag");
    size_t end;
    if (close > content && src_[close - 1] == '-') {
      end = skip_python_space(close + 2);
    } else if (close > content && src_[close - 1] == '+') {
      end = close + 2;
    } else {
      end = (close + 2 < src_.size() && src_[close + 2] == '\n') ? close + 3 : close + 2;
    }
    line_starting_ = src_[end - 1] == '\n';
    return end;
  }

  size_t lex_tag(size_t tag, size_t pos, bool block) {
    emit(block ? TokenType::kBlockBegin : TokenType::kVariableBegin, tag);
    std::vector<char> balance;
    while (true) {
      if (pos >= src_.size()) error(tag, block ? "missing '%}' to close this tag" : "missing '}}' to close this tag");
      if (balance.empty()) {
        size_t end = block ? match_block_end(pos) : match_variable_end(pos);
        if (end != std::string_view::npos) {
          emit(block ? TokenType::kBlockEnd : TokenType::kVariableEnd, pos);
          line_starting_ = src_[end - 1] == '\n';
          return end;
        }
      }
      char c = src_[pos];
      if (is_tag_space(c)) {
        ++pos;
      } else if (is_digit(c)) {
        pos = lex_number(pos);
      } else if (is_name_start(c)) {
        size_t end = pos;
        while (end < src_.size() && is_name_char(src_[end])) ++end;
        emit(TokenType::kName, pos, std::string(src_.substr(pos, end - pos)));
        pos = end;
      } else if (c == '\'' || c == '"') {
        pos = lex_string(pos);
      } else {
        pos = lex_operator(pos, balance);
      }
    }
  }

  size_t match_variable_end(size_t pos) const {
    if (src_.compare(pos, 3, "-}}") == 0) return skip_python_space(pos + 3);
    if (src_.compare(pos, 2, "}}") == 0) return pos + 2;
    return std::string_view::npos;
  }

  // (\d+_)*\d+ starting at pos; returns the end, or pos when there is no digit.
  size_t scan_digits(size_t pos) const {
    size_t p = pos;
    while (p < src_.size() && is_digit(src_[p])) {
      ++p;
      if (p + 1 < src_.size() && src_[p] == '_' && is_digit(src_[p + 1])) ++p;
    }
    return p;
  }

  size_t lex_number(size_t pos) {
    size_t int_end = scan_digits(pos);
    bool after_dot = pos > 0 && src_[pos - 1] == '.';
    if (!after_dot) {
      size_t frac_end = int_end;
      if (int_end + 1 < src_.size() && src_[int_end] == '.' && is_digit(src_[int_end + 1])) {
        frac_end = scan_digits(int_end + 1);
      }
      size_t end = std::string_view::npos;
      if (frac_end < src_.size() && (src_[frac_end] == 'e' || src_[frac_end] == 'E')) {
        size_t q = frac_end + 1;
        if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
        if (q < src_.size() && is_digit(src_[q])) end = scan_digits(q);
      }
      if (end == std::string_view::npos && frac_end != int_end) end = frac_end;
      if (end != std::string_view::npos) {
        std::string digits = without_underscores(pos, end);
        emit(TokenType::kFloat, pos, digits);
        tokens_.back().number = std::strtod(digits.c_str(), nullptr);
        return end;
      }
    }
    int base = 10;
    size_t end = int_end;
    if (src_[pos] == '0' && pos + 1 < src_.size()) {
      char prefix = static_cast<char>(src_[pos + 1] | 0x20);
      base = prefix == 'b' ? 2 : prefix == 'o' ? 8 : prefix == 'x' ? 16 : 10;
      if (base != 10) {
        end = pos + 2;
        auto digit_ok = [&](char d) {
          int v = is_digit(d) ? d - '0' : ((d | 0x20) >= 'a' && (d | 0x20) <= 'f') ? (d | 0x20) - 'a' + 10 : 99;
          return v < base;
        };
        while (end < src_.size() && (digit_ok(src_[end]) ||
                                     (src_[end] == '_' && end + 1 < src_.size() && digit_ok(src_[end + 1])))) {
          ++end;
        }
        if (end == pos + 2) base = 10, end = pos + 1;
      } else {
        end = pos + 1;  // 0(_?0)*
        while (end < src_.size() && (src_[end] == '0' || (src_[end] == '_' && end + 1 < src_.size() &&
                                                          src_[end + 1] == '0'))) {
          ++end;
        }
      }
    }
    std::string digits = without_underscores(base == 10 ? pos : pos + 2, end);
    errno = 0;
    char* parse_end = nullptr;
    long long value = std::strtoll(digits.c_str(), &parse_end, base);
    if (errno == ERANGE) error(pos, "integer literal out of the 64-bit range");
    emit(TokenType::kInteger, pos, std::string(src_.substr(pos, end - pos)));
    tokens_.back().integer = value;
    return end;
  }

  std::string without_underscores(size_t begin, size_t end) const {
    std::string out;
    for (size_t i = begin; i < end; ++i) {
      if (src_[i] != '_') out += src_[i];
    }
    return out;
  }

  size_t lex_string(size_t pos) {
    char quote = src_[pos];
    size_t end = pos + 1;
    while (end < src_.size() && src_[end] != quote) end += src_[end] == '\\' ? 2 : 1;
    if (end >= src_.size()) error(pos, std::string("unexpected char ") + (quote == '"' ? "'\"'" : "\"'\""));
    emit(TokenType::kString, pos, decode_string(pos + 1, end));
    return end + 1;
  }

  // Python's unicode-escape on the literal's body (what jinja2 applies to string literals).
  std::string decode_string(size_t begin, size_t end) const {
    std::string out;
    size_t p = begin;
    auto hex_escape = [&](size_t digits) {
      if (p + digits > end) error(p, "truncated escape in string literal");
      uint32_t cp = 0;
      for (size_t i = 0; i < digits; ++i) {
        char d = static_cast<char>(src_[p + i] | 0x20);
        int v = is_digit(src_[p + i]) ? src_[p + i] - '0' : (d >= 'a' && d <= 'f') ? d - 'a' + 10 : -1;
        if (v < 0) error(p, "truncated escape in string literal");
        cp = cp * 16 + static_cast<uint32_t>(v);
      }
      if (cp > 0x10FFFF) error(p, "escape beyond U+10FFFF in string literal");
      p += digits;
      append_utf8(out, cp);
    };
    while (p < end) {
      if (src_[p] != '\\') {
        out += src_[p++];
        continue;
      }
      char c = src_[p + 1];
      p += 2;
      switch (c) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x': hex_escape(2); break;
        case 'u': hex_escape(4); break;
        case 'U': hex_escape(8); break;
        case 'N': error(p - 2, "\\N{...} escapes are not supported");
        default:
          if (c >= '0' && c <= '7') {
            uint32_t cp = static_cast<uint32_t>(c - '0');
            for (int i = 0; i < 2 && p < end && src_[p] >= '0' && src_[p] <= '7'; ++i) cp = cp * 8 + (src_[p++] - '0');
            append_utf8(out, cp);
          } else if (static_cast<unsigned char>(c) >= 0x80) {
            // Non-ASCII after a backslash: jinja2 first rewrites it as \xNN/\uNNNN, so the backslash
            // pairs with that one and the escape's letters stay as text.
            size_t q = p - 1;
            uint32_t cp = next_code_point(src_, q);
            p = q;
            char buffer[16];
            std::snprintf(buffer, sizeof buffer, cp < 0x100 ? "\\x%02x" : cp < 0x10000 ? "\\u%04x" : "\\U%08x", cp);
            out += buffer;
          } else {
            out += '\\';
            out += c;
          }
      }
    }
    return out;
  }

  size_t lex_operator(size_t pos, std::vector<char>& balance) {
    static const char* const kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* op : kTwo) {
      if (src_.compare(pos, 2, op) == 0) {
        emit(TokenType::kOperator, pos, op);
        return pos + 2;
      }
    }
    char c = src_[pos];
    if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) == std::string_view::npos) {
      size_t next = pos;
      uint32_t cp = next_code_point(src_, next);
      std::string shown;
      append_utf8(shown, cp);
      error(pos, "unexpected char " + py_repr_string(shown));
    }
    if (c == '(' || c == '[' || c == '{') balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) error(pos, std::string("unexpected '") + c + "'");
      if (balance.back() != c) error(pos, std::string("unexpected '") + c + "', expected '" + balance.back() + "'");
      balance.pop_back();
    }
    emit(TokenType::kOperator, pos, std::string(1, c));
    return pos + 1;
  }

  std::string_view src_;
  const std::string& origin_;
  SourceMap map_;
  std::vector<Token> tokens_;
  bool line_starting_ = true;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source, const std::string& origin) {
  return Lexer(source, origin).run();
}

}  // namespace plow::jinja
