// UTF-8 helpers for the tokenizer: strict validation of encode input, the lossy decoding HF and
// tiktoken apply to decoded bytes (one U+FFFD per maximal invalid subpart, as Rust's from_utf8_lossy
// and Python's errors="replace" do), and the incomplete-tail test that streaming decode relies on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace plow::utf8 {

// Byte offset of the first byte that does not start a well-formed UTF-8 sequence, or nullopt.
std::optional<size_t> first_invalid(std::string_view s);

// Appends s to out with every maximal invalid subpart replaced by U+FFFD.
void append_lossy(std::string_view s, std::string& out);

// Length (0..3) of a trailing valid-but-incomplete sequence: the bytes a streaming decoder must hold
// back because more bytes may complete them.
size_t incomplete_tail(std::string_view s);

// Decodes the code point at s[pos] (s must be valid UTF-8) and advances pos past it.
uint32_t next_code_point(std::string_view s, size_t& pos);

// Start of the last code point in s (s valid UTF-8, non-empty).
size_t last_code_point_start(std::string_view s);

// Unicode White_Space (what `\s` means in Rust's regex crate and in Oniguruma).
bool is_white_space(uint32_t cp);

// Python's str.isspace(): White_Space plus U+001C..U+001F (checked against Python 3.11 over all code
// points); tokenization_kimi.py splits whitespace / non-whitespace runs by it.
bool is_python_space(uint32_t cp);

void append_code_point(uint32_t cp, std::string& out);

}  // namespace plow::utf8
