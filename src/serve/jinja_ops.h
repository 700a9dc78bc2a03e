// Operations on template values with Python/jinja2 semantics: arithmetic, attribute and item access
// through HF's ImmutableSandboxedEnvironment (mutating methods are blocked), slicing, method calls,
// filters and tests. All are pure functions of their arguments; failures raise TemplateError.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "serve/jinja_ast.h"
#include "serve/jinja_value.h"

namespace plow::jinja {

struct CallArgs {
  ValueList positional;
  std::vector<std::pair<std::string, Value>> keywords;
};

// Binds Python-style arguments to parameter names; absent optional parameters are std::nullopt.
std::vector<std::optional<Value>> bind(const CallArgs& args, std::string_view function,
                                       std::initializer_list<std::string_view> names, size_t required = 0);
int64_t int_arg(const Value& value, std::string_view what);

Value binary_op(BinaryOp op, const Value& a, const Value& b);
Value negate(const Value& value);
Value unary_plus(const Value& value);
// jinja_format.cpp
Value percent_format(const std::string& format, const Value& args);  // "..." % args
Value str_format(const std::string& format, const CallArgs& args);    // "...".format(args)

Value get_attribute(const Value& object, const std::string& name);  // obj.name
Value get_item(const Value& object, const Value& key);              // obj[key]
Value get_slice(const Value& object, const Value& start, const Value& stop, const Value& step);

// Methods (jinja_methods.cpp): `bound_method` returns the attribute value for a method name, or
// std::nullopt when the type has no such method.
std::optional<Value> bound_method(const Value& object, const std::string& name);
Value call_method(const Value& self, const std::string& name, const CallArgs& args);

// Filters and tests (jinja_filters.cpp, jinja_predicates.cpp).
Value apply_filter(const std::string& name, const Value& input, const CallArgs& args);
bool apply_test(const std::string& name, const Value& input, const CallArgs& args);

}  // namespace plow::jinja
