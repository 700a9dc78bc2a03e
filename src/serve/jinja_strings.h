// Python str semantics over UTF-8 std::string for the chat-template language: code-point length and
// slicing, str.isspace(), strip/split/splitlines, case mapping and repr(). Invalid UTF-8 bytes count
// as one code point each, so no input can make these functions fail or loop.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace plow::jinja {

// Decodes the code point starting at `pos` and advances `pos` past it (one byte for invalid input).
uint32_t next_code_point(std::string_view text, size_t& pos);
void append_utf8(std::string& out, uint32_t code_point);
std::vector<uint32_t> decode_utf8(std::string_view text);
std::string encode_utf8(const std::vector<uint32_t>& code_points, size_t begin, size_t end);
size_t code_point_count(std::string_view text);

// Python's str.isspace() for one code point, and \s in Python's re module.
bool is_python_space(uint32_t code_point);

// str.strip/lstrip/rstrip: `chars` absent strips whitespace, present strips any of its code points.
std::string py_strip(std::string_view text, const std::optional<std::string>& chars, bool left, bool right);
// str.split / str.rsplit; `sep` absent splits on runs of whitespace. max_split < 0: no limit.
std::vector<std::string> py_split(std::string_view text, const std::optional<std::string>& sep, int64_t max_split,
                                  bool from_right);
std::vector<std::string> py_splitlines(std::string_view text, bool keep_ends);
// str.replace; count < 0 replaces every occurrence.
std::string py_replace(std::string_view text, std::string_view old_text, std::string_view new_text, int64_t count);
// str.find / str.rfind / str.count on code-point indices.
int64_t py_find(std::string_view text, std::string_view needle, bool from_right);
int64_t py_count(std::string_view text, std::string_view needle);

std::string py_upper(std::string_view text);
std::string py_lower(std::string_view text);
std::string py_capitalize(std::string_view text);
std::string py_title_method(std::string_view text);  // str.title()
std::string jinja_title(std::string_view text);      // the `title` filter (capitalizes after - space ( { [ <)
bool py_is_cased(std::string_view text, bool upper);  // str.isupper() / str.islower()

// markupsafe.escape: & < > " ' as HTML entities.
std::string html_escape(std::string_view text);

// repr() of a str: single quotes unless the text has ' and no ", non-printable code points escaped.
std::string py_repr_string(std::string_view text);

}  // namespace plow::jinja
