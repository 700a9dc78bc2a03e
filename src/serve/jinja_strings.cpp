// Python str semantics over UTF-8 (see jinja_strings.h). Case mapping covers ASCII, Latin-1, Latin
// Extended-A, Greek and Cyrillic; other scripts pass through unchanged (a documented gap).
#include "serve/jinja_strings.h"

#include "serve/jinja_value.h"

#include <algorithm>
#include <cstdio>

namespace plow::jinja {

uint32_t next_code_point(std::string_view text, size_t& pos) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  uint8_t lead = byte(pos);
  size_t length = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 0;
  if (length == 1) return text[pos++] & 0x7F;
  if (length == 0 || pos + length > text.size()) return byte(pos++);
  uint32_t cp = lead & (0x7F >> length);
  for (size_t i = 1; i < length; ++i) {
    if ((byte(pos + i) & 0xC0) != 0x80) return byte(pos++);
    cp = (cp << 6) | (byte(pos + i) & 0x3F);
  }
  pos += length;
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | ((cp >> 18) & 0x07));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::vector<uint32_t> decode_utf8(std::string_view text) {
  charge_work(text.size() / 16);
  std::vector<uint32_t> out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) out.push_back(next_code_point(text, pos));
  return out;
}

std::string encode_utf8(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) append_utf8(out, cps[i]);
  return out;
}

size_t code_point_count(std::string_view text) {
  charge_work(text.size() / 16);
  size_t count = 0;
  for (size_t pos = 0; pos < text.size(); ++count) next_code_point(text, pos);
  return count;
}

bool is_python_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string py_strip(std::string_view text, const std::optional<std::string>& chars, bool left, bool right) {
  std::vector<uint32_t> cps = decode_utf8(text);
  std::vector<uint32_t> set = chars ? decode_utf8(*chars) : std::vector<uint32_t>{};
  auto strip_it = [&](uint32_t c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : is_python_space(c);
  };
  size_t begin = 0, end = cps.size();
  while (left && begin < end && strip_it(cps[begin])) ++begin;
  while (right && end > begin && strip_it(cps[end - 1])) --end;
  return encode_utf8(cps, begin, end);
}

namespace {

std::vector<std::string> split_whitespace(std::string_view text, int64_t max_split, bool from_right) {
  std::vector<uint32_t> cps = decode_utf8(text);
  std::vector<std::string> parts;
  if (!from_right) {
    size_t i = 0, n = cps.size();
    while (true) {
      while (i < n && is_python_space(cps[i])) ++i;
      if (i == n) break;
      if (max_split >= 0 && static_cast<int64_t>(parts.size()) == max_split) {
        parts.push_back(encode_utf8(cps, i, n));
        break;
      }
      size_t start = i;
      while (i < n && !is_python_space(cps[i])) ++i;
      parts.push_back(encode_utf8(cps, start, i));
    }
    return parts;
  }
  size_t i = cps.size();
  while (true) {
    while (i > 0 && is_python_space(cps[i - 1])) --i;
    if (i == 0) break;
    if (max_split >= 0 && static_cast<int64_t>(parts.size()) == max_split) {
      parts.push_back(encode_utf8(cps, 0, i));
      break;
    }
    size_t end = i;
    while (i > 0 && !is_python_space(cps[i - 1])) --i;
    parts.push_back(encode_utf8(cps, i, end));
  }
  std::reverse(parts.begin(), parts.end());
  return parts;
}

}  // namespace

std::vector<std::string> py_split(std::string_view text, const std::optional<std::string>& sep, int64_t max_split,
                                  bool from_right) {
  if (!sep) return split_whitespace(text, max_split, from_right);
  std::vector<std::string> parts;
  const std::string& s = *sep;  // non-empty: the caller rejects an empty separator
  if (!from_right) {
    size_t start = 0;
    while (max_split < 0 || static_cast<int64_t>(parts.size()) < max_split) {
      size_t hit = text.find(s, start);
      if (hit == std::string_view::npos) break;
      parts.emplace_back(text.substr(start, hit - start));
      start = hit + s.size();
    }
    parts.emplace_back(text.substr(start));
    return parts;
  }
  size_t end = text.size();
  while (max_split < 0 || static_cast<int64_t>(parts.size()) < max_split) {
    if (end < s.size()) break;
    size_t hit = text.rfind(s, end - s.size());
    if (hit == std::string_view::npos) break;
    parts.emplace_back(text.substr(hit + s.size(), end - hit - s.size()));
    end = hit;
  }
  parts.emplace_back(text.substr(0, end));
  std::reverse(parts.begin(), parts.end());
  return parts;
}

std::vector<std::string> py_splitlines(std::string_view text, bool keep_ends) {
  std::vector<std::string> lines;
  size_t start = 0, pos = 0;
  while (pos < text.size()) {
    size_t here = pos;
    uint32_t c = next_code_point(text, pos);
    bool boundary = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
                    c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!boundary) continue;
    if (c == '\r' && pos < text.size() && text[pos] == '\n') ++pos;
    lines.emplace_back(text.substr(start, (keep_ends ? pos : here) - start));
    start = pos;
  }
  if (start < text.size()) lines.emplace_back(text.substr(start));
  return lines;
}

std::string py_replace(std::string_view text, std::string_view old_text, std::string_view new_text, int64_t count) {
  std::string out;
  if (old_text.empty()) {
    int64_t done = 0;
    size_t pos = 0;
    while (true) {
      if (count < 0 || done < count) {
        out += new_text;
        ++done;
      }
      if (pos >= text.size()) break;
      size_t start = pos;
      next_code_point(text, pos);
      out += text.substr(start, pos - start);
    }
    return out;
  }
  size_t start = 0;
  for (int64_t done = 0; count < 0 || done < count; ++done) {
    size_t hit = text.find(old_text, start);
    if (hit == std::string_view::npos) break;
    out += text.substr(start, hit - start);
    out += new_text;
    start = hit + old_text.size();
  }
  out += text.substr(start);
  return out;
}

int64_t py_find(std::string_view text, std::string_view needle, bool from_right) {
  charge_work(text.size() / 16);
  size_t hit = from_right ? text.rfind(needle) : text.find(needle);
  if (hit == std::string_view::npos) return -1;
  return static_cast<int64_t>(code_point_count(text.substr(0, hit)));
}

int64_t py_count(std::string_view text, std::string_view needle) {
  charge_work(text.size() / 16);
  if (needle.empty()) return static_cast<int64_t>(code_point_count(text)) + 1;
  int64_t count = 0;
  for (size_t pos = text.find(needle); pos != std::string_view::npos; pos = text.find(needle, pos + needle.size())) {
    ++count;
  }
  return count;
}

namespace {

// Simple one-to-one case mappings; 0 when the code point has no mapping in that direction.
uint32_t upper_of(uint32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 32;
  if (c == 0xFF) return 0x178;
  if (c == 0xB5) return 0x39C;
  if (c >= 0x100 && c <= 0x17F) {
    if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) return (c % 2 == 0) ? c - 1 : 0;
    if (c == 0x131) return 'I';
    if (c == 0x17F) return 'S';
    if (c == 0x130 || c == 0x138 || c == 0x149 || c == 0x178) return 0;
    return (c % 2 == 1) ? c - 1 : 0;
  }
  if (c >= 0x3B1 && c <= 0x3C9) return c == 0x3C2 ? 0x3A3 : c - 32;
  if (c >= 0x430 && c <= 0x44F) return c - 32;
  if (c >= 0x450 && c <= 0x45F) return c - 80;
  return 0;
}

uint32_t lower_of(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 32;
  if (c == 0x178) return 0xFF;
  if (c >= 0x100 && c <= 0x17F) {
    if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) return (c % 2 == 1) ? c + 1 : 0;
    if (c == 0x130) return 'i';
    if (c == 0x131 || c == 0x138 || c == 0x149 || c == 0x17F) return 0;
    return (c % 2 == 0) ? c + 1 : 0;
  }
  if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 32;
  if (c >= 0x410 && c <= 0x42F) return c + 32;
  if (c >= 0x400 && c <= 0x40F) return c + 80;
  return 0;
}

bool is_cased(uint32_t c) { return upper_of(c) != 0 || lower_of(c) != 0 || c == 0xDF; }

void append_upper(std::string& out, uint32_t c) {
  if (c == 0xDF) {
    out += "SS";
    return;
  }
  uint32_t u = upper_of(c);
  append_utf8(out, u ? u : c);
}

void append_lower(std::string& out, uint32_t c) {
  uint32_t l = lower_of(c);
  append_utf8(out, l ? l : c);
}

}  // namespace

std::string py_upper(std::string_view text) {
  std::string out;
  for (size_t pos = 0; pos < text.size();) append_upper(out, next_code_point(text, pos));
  return out;
}

std::string py_lower(std::string_view text) {
  std::string out;
  for (size_t pos = 0; pos < text.size();) append_lower(out, next_code_point(text, pos));
  return out;
}

std::string py_capitalize(std::string_view text) {
  std::string out;
  for (size_t pos = 0; pos < text.size();) {
    bool first = pos == 0;
    uint32_t c = next_code_point(text, pos);
    first ? append_upper(out, c) : append_lower(out, c);
  }
  return out;
}

std::string py_title_method(std::string_view text) {
  std::string out;
  bool previous_cased = false;
  for (size_t pos = 0; pos < text.size();) {
    uint32_t c = next_code_point(text, pos);
    previous_cased ? append_lower(out, c) : append_upper(out, c);
    previous_cased = is_cased(c);
  }
  return out;
}

std::string jinja_title(std::string_view text) {
  std::string out;
  bool word_start = true;
  for (size_t pos = 0; pos < text.size();) {
    uint32_t c = next_code_point(text, pos);
    bool separator = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_python_space(c);
    if (separator) {
      append_utf8(out, c);
      word_start = true;
    } else {
      word_start ? append_upper(out, c) : append_lower(out, c);
      word_start = false;
    }
  }
  return out;
}

bool py_is_cased(std::string_view text, bool upper) {
  bool any_cased = false;
  for (size_t pos = 0; pos < text.size();) {
    uint32_t c = next_code_point(text, pos);
    if (!is_cased(c)) continue;
    any_cased = true;
    bool is_upper = lower_of(c) != 0;
    if (is_upper != upper) return false;
  }
  return any_cased;
}

std::string html_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

namespace {

// Python's str.isprintable(): false for control, format, separator (except ' '), surrogate and private
// use code points. Unassigned code points cannot be known without the Unicode database.
bool is_printable(uint32_t c) {
  if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
  if ((c >= 0x600 && c <= 0x605) || c == 0x61C || c == 0x6DD || c == 0x70F || c == 0x1680 || c == 0x180E) {
    return false;
  }
  if ((c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x206F)) return false;
  if (c == 0x3000 || (c >= 0xD800 && c <= 0xF8FF) || c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFB)) return false;
  if (c == 0xFFFE || c == 0xFFFF || (c >= 0x1D173 && c <= 0x1D17A) || (c >= 0xE0000 && c <= 0xE007F)) return false;
  return c < 0xF0000 && c <= 0x10FFFF;
}

}  // namespace

std::string py_repr_string(std::string_view text) {
  bool has_single = text.find('\'') != std::string_view::npos;
  bool has_double = text.find('"') != std::string_view::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (size_t pos = 0; pos < text.size();) {
    uint32_t c = next_code_point(text, pos);
    if (c == '\\' || c == static_cast<uint32_t>(quote)) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!is_printable(c)) {
      char buffer[16];
      const char* format = c < 0x100 ? "\\x%02x" : c < 0x10000 ? "\\u%04x" : "\\U%08x";
      std::snprintf(buffer, sizeof buffer, format, c);
      out += buffer;
    } else {
      append_utf8(out, c);
    }
  }
  out += quote;
  return out;
}

}  // namespace plow::jinja
