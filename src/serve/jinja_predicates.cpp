// jinja2's builtin tests (`x is defined`, `x is string`, `x is equalto y`, ...) with jinja2 3.1's
// definitions, including its quirks: bools are numbers, Undefined is iterable and a sequence.
#include <fmt/format.h>

#include <functional>
#include <map>

#include "serve/jinja_ops.h"
#include "serve/jinja_parser.h"
#include "serve/jinja_strings.h"

namespace plow::jinja {

namespace {

using Test = std::function<bool(const Value&, const CallArgs&)>;

Test unary(bool (*predicate)(const Value&)) {
  return [predicate](const Value& v, const CallArgs& args) {
    if (!args.positional.empty() || !args.keywords.empty()) raise("this test takes no arguments");
    return predicate(v);
  };
}

Test comparison(CompareOp op) {
  return [op](const Value& v, const CallArgs& args) {
    auto a = bind(args, "test", {"other"}, 1);
    const Value& other = *a[0];
    switch (op) {
      case CompareOp::kEq: return equal(v, other);
      case CompareOp::kNe: return !equal(v, other);
      case CompareOp::kLt: return compare(v, other, "<") < 0;
      case CompareOp::kLe: return compare(v, other, "<=") <= 0;
      case CompareOp::kGt: return compare(v, other, ">") > 0;
      case CompareOp::kGe: return compare(v, other, ">=") >= 0;
      default: return false;
    }
  };
}

bool is_iterable(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
    case Kind::kString:
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kGenerator:
    case Kind::kDict: return true;
    default: return false;
  }
}

bool divisible(const Value& v, const Value& by) { return equal(binary_op(BinaryOp::kMod, v, by), Value::integer(0)); }

const std::map<std::string, Test, std::less<>>& tests() {
  static const std::map<std::string, Test, std::less<>> table = {
      {"defined", unary([](const Value& v) { return !v.is_undefined(); })},
      {"undefined", unary([](const Value& v) { return v.is_undefined(); })},
      {"none", unary([](const Value& v) { return v.is_none(); })},
      {"boolean", unary([](const Value& v) { return v.kind() == Kind::kBool; })},
      {"true", unary([](const Value& v) { return v.kind() == Kind::kBool && v.as_bool(); })},
      {"false", unary([](const Value& v) { return v.kind() == Kind::kBool && !v.as_bool(); })},
      {"integer", unary([](const Value& v) { return v.kind() == Kind::kInt; })},
      {"float", unary([](const Value& v) { return v.kind() == Kind::kFloat; })},
      {"number", unary([](const Value& v) { return v.is_number(); })},
      {"string", unary([](const Value& v) { return v.is_string(); })},
      {"mapping", unary([](const Value& v) { return v.is_dict(); })},
      {"iterable", unary(is_iterable)},
      {"sequence", unary([](const Value& v) {
         return v.kind() == Kind::kUndefined || v.is_string() || v.kind() == Kind::kList ||
                v.kind() == Kind::kTuple || v.is_dict();
       })},
      {"callable", unary([](const Value& v) { return v.kind() == Kind::kCallable || v.is_undefined(); })},
      {"escaped", unary([](const Value&) { return false; })},
      {"lower", unary([](const Value& v) { return py_is_cased(to_str(v), false); })},
      {"upper", unary([](const Value& v) { return py_is_cased(to_str(v), true); })},
      {"even", unary([](const Value& v) { return divisible(v, Value::integer(2)); })},
      {"odd", unary([](const Value& v) { return equal(binary_op(BinaryOp::kMod, v, Value::integer(2)), Value::integer(1)); })},
      {"divisibleby", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "divisibleby", {"num"}, 1);
         return divisible(v, *a[0]);
       }},
      {"sameas", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "sameas", {"other"}, 1);
         return v.same_object(*a[0]);
       }},
      {"in", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "in", {"seq"}, 1);
         return contains(*a[0], v);
       }},
      {"filter", [](const Value& v, const CallArgs& args) {
         bind(args, "filter", {});
         return v.is_string() && is_known_filter(v.as_string());
       }},
      {"test", [](const Value& v, const CallArgs& args) {
         bind(args, "test", {});
         return v.is_string() && is_known_test(v.as_string());
       }},
      {"eq", comparison(CompareOp::kEq)},
      {"equalto", comparison(CompareOp::kEq)},
      {"==", comparison(CompareOp::kEq)},
      {"ne", comparison(CompareOp::kNe)},
      {"!=", comparison(CompareOp::kNe)},
      {"lt", comparison(CompareOp::kLt)},
      {"lessthan", comparison(CompareOp::kLt)},
      {"<", comparison(CompareOp::kLt)},
      {"le", comparison(CompareOp::kLe)},
      {"<=", comparison(CompareOp::kLe)},
      {"gt", comparison(CompareOp::kGt)},
      {"greaterthan", comparison(CompareOp::kGt)},
      {">", comparison(CompareOp::kGt)},
      {"ge", comparison(CompareOp::kGe)},
      {">=", comparison(CompareOp::kGe)},
  };
  return table;
}

}  // namespace

bool is_known_test(std::string_view name) { return tests().count(name) > 0; }

bool apply_test(const std::string& name, const Value& input, const CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) raise(fmt::format("no test named '{}'", name));
  return it->second(input, args);
}

}  // namespace plow::jinja
