// UTF-8 decoding rules shared by validation, lossy replacement and streaming: one table-free
// function (sequence_length) decides how many bytes form a valid sequence or an invalid subpart.
#include "serve/utf8.h"

namespace plow::utf8 {

namespace {

struct Sequence {
  size_t length;  // bytes consumed: the whole sequence, or the maximal invalid subpart (>= 1)
  bool valid;
  bool truncated;  // a valid prefix cut off by the end of the input
};

// Unicode 15 §3.9 table 3-7: the allowed range of the second byte depends on the lead byte.
Sequence sequence_at(std::string_view s, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t lead = byte(pos);
  if (lead < 0x80) return {1, true, false};
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    return {1, false, false};
  }
  for (size_t k = 1; k <= need; ++k) {
    if (pos + k >= s.size()) return {k, false, true};
    const uint8_t b = byte(pos + k);
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return {k, false, false};
  }
  return {need + 1, true, false};
}

}  // namespace

std::optional<size_t> first_invalid(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    if (static_cast<uint8_t>(s[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Sequence seq = sequence_at(s, pos);
    if (!seq.valid) return pos;
    pos += seq.length;
  }
  return std::nullopt;
}

void append_lossy(std::string_view s, std::string& out) {
  size_t pos = 0;
  while (pos < s.size()) {
    const Sequence seq = sequence_at(s, pos);
    if (seq.valid) {
      out.append(s.substr(pos, seq.length));
    } else {
      out.append("\xEF\xBF\xBD");
    }
    pos += seq.length;
  }
}

size_t incomplete_tail(std::string_view s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const uint8_t b = static_cast<uint8_t>(s[n - back]);
    if (b >= 0x80 && b <= 0xBF) continue;  // continuation byte: the lead is further back
    const Sequence seq = sequence_at(s, n - back);
    return seq.truncated ? back : 0;
  }
  return 0;
}

uint32_t next_code_point(std::string_view s, size_t& pos) {
  const auto byte = [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i])); };
  const uint32_t lead = byte(pos);
  if (lead < 0x80) {
    pos += 1;
    return lead;
  }
  if (lead < 0xE0) {
    const uint32_t cp = ((lead & 0x1F) << 6) | (byte(pos + 1) & 0x3F);
    pos += 2;
    return cp;
  }
  if (lead < 0xF0) {
    const uint32_t cp = ((lead & 0x0F) << 12) | ((byte(pos + 1) & 0x3F) << 6) | (byte(pos + 2) & 0x3F);
    pos += 3;
    return cp;
  }
  const uint32_t cp = ((lead & 0x07) << 18) | ((byte(pos + 1) & 0x3F) << 12) | ((byte(pos + 2) & 0x3F) << 6) |
                      (byte(pos + 3) & 0x3F);
  pos += 4;
  return cp;
}

size_t last_code_point_start(std::string_view s) {
  size_t pos = s.size() - 1;
  while (pos > 0 && (static_cast<uint8_t>(s[pos]) & 0xC0) == 0x80) --pos;
  return pos;
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

bool is_python_space(uint32_t cp) { return is_white_space(cp) || (cp >= 0x1C && cp <= 0x1F); }

void append_code_point(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace plow::utf8
