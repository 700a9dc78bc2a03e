// Parser for chat templates: jinja2's grammar (parser.py) for the statements and expressions chat
// templates use, plus load-time checks so that unsupported constructs fail here, with origin, line
// and column, instead of at render time.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "serve/jinja_ast.h"

namespace plow::jinja {

constexpr size_t kMaxSourceBytes = size_t{1} << 20;
constexpr int kMaxParseDepth = 96;  // nesting of blocks, parentheses and operators

std::shared_ptr<const Program> parse_program(std::string_view source, const std::string& origin);

// Registries the parser checks names against (implemented with the filters, tests and methods).
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);
// Python methods of str/list/dict this renderer does not implement: calling one is a parse error.
bool is_unsupported_method(std::string_view name);

}  // namespace plow::jinja
