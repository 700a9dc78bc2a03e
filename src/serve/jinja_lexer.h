// Tokenizer for chat templates with jinja2's default delimiters and the whitespace rules HF renders
// with (trim_blocks=True, lstrip_blocks=True, `-`/`+` markers, one trailing newline dropped). Every
// token carries its line and column; malformed input is a plow::Error naming origin:line:column.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace plow::jinja {

struct SourcePos {
  uint32_t line = 1;
  uint32_t column = 1;
};

enum class TokenType : uint8_t {
  kData, kVariableBegin, kVariableEnd, kBlockBegin, kBlockEnd, kName, kString, kInteger, kFloat, kOperator, kEof
};

struct Token {
  TokenType type = TokenType::kEof;
  std::string text;  // data, name, operator, or the decoded string literal
  int64_t integer = 0;
  double number = 0.0;
  SourcePos pos;
};

// Maps byte offsets of the (newline-normalized) source to 1-based line and code-point column.
class SourceMap {
 public:
  explicit SourceMap(std::string_view source);
  SourcePos at(size_t offset) const;

 private:
  std::string_view source_;
  std::vector<size_t> line_starts_;
  // Tokens are positioned in increasing order: resume counting from the last position on that line.
  mutable size_t last_offset_ = 0;
  mutable SourcePos last_pos_;
};

// jinja2's source normalization: \r\n and \r become \n, and one trailing newline is dropped.
std::string normalize_newlines(std::string_view source);

// `source` must already be normalized. Errors are formatted "<origin>:<line>:<column>: <message>".
std::vector<Token> tokenize(std::string_view source, const std::string& origin);

}  // namespace plow::jinja
