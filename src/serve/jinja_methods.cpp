// Python methods that chat templates call on str, dict, list and tuple values, and the `loop`
// object's attributes. Methods that mutate a container are blocked as in
// HF's ImmutableSandboxedEnvironment; methods not implemented here are rejected by the parser.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "serve/jinja_ops.h"
#include "serve/jinja_parser.h"
#include "serve/jinja_strings.h"

namespace plow::jinja {

namespace {

const std::set<std::string, std::less<>> kStringMethods = {
    "startswith", "endswith", "strip",     "lstrip",     "rstrip",       "split",        "rsplit",
    "splitlines", "upper",    "lower",     "casefold",   "title",        "capitalize",   "replace",
    "find",       "rfind",    "index",     "rindex",     "count",        "join",         "format",
    "isdigit",    "isalpha",  "isalnum",   "isspace",    "islower",      "isupper",      "isdecimal",
    "isnumeric",  "isascii",  "center",    "ljust",      "rjust",        "zfill",        "partition",
    "rpartition", "removeprefix", "removesuffix"};
const std::set<std::string, std::less<>> kDictMethods = {"items", "keys", "values", "get", "copy"};
const std::set<std::string, std::less<>> kDictMutators = {"pop", "popitem", "update", "setdefault", "clear"};
const std::set<std::string, std::less<>> kListMethods = {"index", "count", "copy"};
const std::set<std::string, std::less<>> kListMutators = {"append", "extend", "insert", "pop",
                                                          "remove", "reverse", "sort",   "clear"};
const std::set<std::string, std::less<>> kUnsupported = {"encode",     "expandtabs", "format_map", "isidentifier",
                                                         "isprintable", "istitle",   "maketrans",  "translate",
                                                         "swapcase",    "fromkeys"};

Value method(const Value& self, const std::string& name) {
  auto callable = std::make_shared<Callable>();
  callable->type = Callable::Type::kMethod;
  callable->name = name;
  callable->self = self;
  return Value::callable(std::move(callable));
}

Value blocked(const std::string& name, const char* type) {
  return Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.", name, type), true);
}

std::optional<Value> loop_attribute(const Value& self, const std::string& name) {
  const LoopState& loop = self.as_loop();
  const ValueList& items = loop.items->items;
  int64_t length = static_cast<int64_t>(items.size());
  if (name == "index") return Value::integer(loop.index0 + 1);
  if (name == "index0") return Value::integer(loop.index0);
  if (name == "revindex") return Value::integer(length - loop.index0);
  if (name == "revindex0") return Value::integer(length - loop.index0 - 1);
  if (name == "first") return Value::boolean(loop.index0 == 0);
  if (name == "last") return Value::boolean(loop.index0 == length - 1);
  if (name == "length") return Value::integer(length);
  if (name == "depth") return Value::integer(loop.depth0 + 1);
  if (name == "depth0") return Value::integer(loop.depth0);
  if (name == "previtem") {
    if (loop.index0 == 0) return Value::undefined("there is no previous item");
    return items[static_cast<size_t>(loop.index0 - 1)];
  }
  if (name == "nextitem") {
    if (loop.index0 + 1 >= length) return Value::undefined("there is no next item");
    return items[static_cast<size_t>(loop.index0 + 1)];
  }
  if (name == "cycle" || name == "changed") return method(self, name);
  return std::nullopt;
}

std::string str_arg(const Value& value, std::string_view what) {
  if (value.is_undefined()) value.fail_undefined();
  if (!value.is_string()) raise(fmt::format("{} must be str, not {}", what, type_name(value)));
  return value.as_string();
}

std::optional<std::string> optional_str(const std::optional<Value>& value, std::string_view what) {
  if (!value || value->is_none()) return std::nullopt;
  return str_arg(*value, what);
}

// s[start:end] for the optional start/end arguments of find, startswith and friends.
std::string sub_range(const std::string& text, const std::optional<Value>& start, const std::optional<Value>& end) {
  if ((!start || start->is_none()) && (!end || end->is_none())) return text;
  return get_slice(Value::string(text), start ? *start : Value::none(), end ? *end : Value::none(), Value::none())
      .as_string();
}

bool all_code_points(const std::string& text, bool (*predicate)(uint32_t)) {
  if (text.empty()) return false;
  for (size_t pos = 0; pos < text.size();) {
    if (!predicate(next_code_point(text, pos))) return false;
  }
  return true;
}

bool is_digit_cp(uint32_t c) { return c >= '0' && c <= '9'; }
bool is_alpha_cp(uint32_t c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= 0xC0 && c != 0xD7 && c != 0xF7 && !is_python_space(c));
}
bool is_alnum_cp(uint32_t c) { return is_digit_cp(c) || is_alpha_cp(c); }

std::string pad(const std::string& text, int64_t width, const std::string& fill, int where) {
  int64_t length = static_cast<int64_t>(code_point_count(text));
  if (width <= length) return text;
  if (width > static_cast<int64_t>(kMaxStringBytes)) raise("padding width too large");
  int64_t total = width - length;
  int64_t left = where < 0 ? 0 : where > 0 ? total : total / 2 + (total & width & 1);
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += text;
  for (int64_t i = left; i < total; ++i) out += fill;
  return out;
}

Value string_method(const std::string& s, const std::string& name, const CallArgs& args);

}  // namespace

bool is_unsupported_method(std::string_view name) { return kUnsupported.count(name) > 0; }

std::optional<Value> bound_method(const Value& object, const std::string& name) {
  switch (object.kind()) {
    case Kind::kString:
      if (kStringMethods.count(name)) return method(object, name);
      break;
    case Kind::kDict:
      if (kDictMethods.count(name)) return method(object, name);
      if (kDictMutators.count(name)) return blocked(name, "dict");
      break;
    case Kind::kList:
      if (kListMethods.count(name)) return method(object, name);
      if (kListMutators.count(name)) return blocked(name, "list");
      break;
    case Kind::kTuple:
      if (name == "index" || name == "count") return method(object, name);
      break;
    case Kind::kLoop: return loop_attribute(object, name);
    default: break;
  }
  return std::nullopt;
}

Value call_method(const Value& self, const std::string& name, const CallArgs& args) {
  if (self.is_string()) return string_method(self.as_string(), name, args);
  if (self.is_dict()) {
    const Dict& dict = self.as_dict();
    if (name == "get") {
      auto a = bind(args, "get", {"key", "default"}, 1);
      const Value* found = dict.find(*a[0]);
      return found ? *found : a[1].value_or(Value::none());
    }
    bind(args, name, {});
    ValueList out;
    for (const auto& [key, value] : dict.entries) {
      if (name == "items") out.push_back(Value::tuple({key, value}));
      if (name == "keys") out.push_back(key);
      if (name == "values") out.push_back(value);
    }
    return name == "copy" ? self : Value::list(std::move(out));
  }
  if (self.kind() == Kind::kLoop) {
    LoopState& loop = self.as_loop();
    if (!args.keywords.empty()) raise(fmt::format("loop.{}() takes no keyword arguments", name));
    if (name == "cycle") {
      if (args.positional.empty()) raise("no items for cycling given");
      return args.positional[static_cast<size_t>(loop.index0) % args.positional.size()];
    }
    bool changed = !loop.changed_last || !equal(Value::list(*loop.changed_last), Value::list(args.positional));
    loop.changed_last = args.positional;
    return Value::boolean(changed);
  }
  // list / tuple
  if (name == "copy") return self;
  auto a = bind(args, name, {"value"}, 1);
  const ValueList& items = self.items();
  if (name == "count") {
    return Value::integer(std::count_if(items.begin(), items.end(), [&](const Value& v) { return equal(v, *a[0]); }));
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (equal(items[i], *a[0])) return Value::integer(static_cast<int64_t>(i));
  }
  if (self.kind() == Kind::kTuple) raise("tuple.index(x): x not in tuple");
  raise(fmt::format("{} is not in list", repr(*a[0])));
}

namespace {

Value string_method(const std::string& s, const std::string& name, const CallArgs& args) {
  if (name == "startswith" || name == "endswith") {
    auto a = bind(args, name, {"prefix", "start", "end"}, 1);
    std::string text = sub_range(s, a[1], a[2]);
    ValueList candidates = a[0]->kind() == Kind::kTuple ? a[0]->items() : ValueList{*a[0]};
    for (const Value& candidate : candidates) {
      std::string affix = str_arg(candidate, name + " argument");
      bool hit = name == "startswith" ? text.compare(0, affix.size(), affix) == 0
                                      : text.size() >= affix.size() &&
                                            text.compare(text.size() - affix.size(), affix.size(), affix) == 0;
      if (hit) return Value::boolean(true);
    }
    return Value::boolean(false);
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    auto a = bind(args, name, {"chars"});
    return Value::string(py_strip(s, optional_str(a[0], "chars"), name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    auto a = bind(args, name, {"sep", "maxsplit"});
    std::optional<std::string> sep = optional_str(a[0], "sep");
    if (sep && sep->empty()) raise("empty separator");
    int64_t max_split = a[1] ? int_arg(*a[1], "maxsplit") : -1;
    ValueList parts;
    for (auto& part : py_split(s, sep, max_split, name == "rsplit")) parts.push_back(Value::string(std::move(part)));
    return Value::list(std::move(parts));
  }
  if (name == "splitlines") {
    auto a = bind(args, name, {"keepends"});
    ValueList lines;
    for (auto& line : py_splitlines(s, a[0] && truthy(*a[0]))) lines.push_back(Value::string(std::move(line)));
    return Value::list(std::move(lines));
  }
  if (name == "upper" || name == "lower" || name == "casefold" || name == "title" || name == "capitalize" ||
      name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" || name == "islower" ||
      name == "isupper" || name == "isdecimal" || name == "isnumeric" || name == "isascii") {
    bind(args, name, {});
    if (name == "upper") return Value::string(py_upper(s));
    if (name == "lower" || name == "casefold") return Value::string(py_lower(s));
    if (name == "title") return Value::string(py_title_method(s));
    if (name == "capitalize") return Value::string(py_capitalize(s));
    if (name == "isdigit" || name == "isdecimal" || name == "isnumeric") {
      return Value::boolean(all_code_points(s, is_digit_cp));
    }
    if (name == "isalpha") return Value::boolean(all_code_points(s, is_alpha_cp));
    if (name == "isalnum") return Value::boolean(all_code_points(s, is_alnum_cp));
    if (name == "isspace") return Value::boolean(all_code_points(s, is_python_space));
    if (name == "isascii") return Value::boolean(std::all_of(s.begin(), s.end(), [](char c) { return c >= 0; }));
    return Value::boolean(py_is_cased(s, name == "isupper"));
  }
  if (name == "replace") {
    auto a = bind(args, name, {"old", "new", "count"}, 2);
    int64_t count = a[2] ? int_arg(*a[2], "count") : -1;
    return make_string_checked(py_replace(s, str_arg(*a[0], "old"), str_arg(*a[1], "new"), count));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    auto a = bind(args, name, {"sub", "start", "end"}, 1);
    std::string needle = str_arg(*a[0], "sub");
    std::string text = sub_range(s, a[1], a[2]);
    if (name == "count") return Value::integer(py_count(text, needle));
    int64_t found = py_find(text, needle, name[0] == 'r');
    if (found < 0 && (name == "index" || name == "rindex")) raise("substring not found");
    if (found >= 0 && a[1] && !a[1]->is_none()) {
      int64_t start = a[1]->as_int(), length = static_cast<int64_t>(code_point_count(s));
      found += start < 0 ? std::max<int64_t>(0, start + length) : std::min(start, length);
    }
    return Value::integer(found);
  }
  if (name == "join") {
    auto a = bind(args, name, {"iterable"}, 1);
    std::string out;
    ValueList items = iterate(*a[0]);
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].is_string()) {
        raise(fmt::format("sequence item {}: expected str instance, {} found", i, type_name(items[i])));
      }
      if (i) out += s;
      out += items[i].as_string();
      if (out.size() > kMaxStringBytes) raise(fmt::format("string longer than {} bytes", kMaxStringBytes));
    }
    return Value::string(std::move(out));
  }
  if (name == "format") return str_format(s, args);
  if (name == "center" || name == "ljust" || name == "rjust") {
    auto a = bind(args, name, {"width", "fillchar"}, 1);
    std::string fill = a[1] ? str_arg(*a[1], "fillchar") : " ";
    if (code_point_count(fill) != 1) raise("The fill character must be exactly one character long");
    return Value::string(pad(s, int_arg(*a[0], "width"), fill, name == "center" ? 0 : name == "ljust" ? -1 : 1));
  }
  if (name == "zfill") {
    auto a = bind(args, name, {"width"}, 1);
    bool sign = !s.empty() && (s[0] == '-' || s[0] == '+');
    std::string padded = pad(s.substr(sign ? 1 : 0), int_arg(*a[0], "width") - (sign ? 1 : 0), "0", 1);
    return Value::string((sign ? s.substr(0, 1) : "") + padded);
  }
  if (name == "partition" || name == "rpartition") {
    auto a = bind(args, name, {"sep"}, 1);
    std::string sep = str_arg(*a[0], "sep");
    if (sep.empty()) raise("empty separator");
    size_t hit = name == "partition" ? s.find(sep) : s.rfind(sep);
    if (hit == std::string::npos) {
      return name == "partition" ? Value::tuple({Value::string(s), Value::string(""), Value::string("")})
                                 : Value::tuple({Value::string(""), Value::string(""), Value::string(s)});
    }
    return Value::tuple({Value::string(s.substr(0, hit)), Value::string(sep), Value::string(s.substr(hit + sep.size()))});
  }
  // removeprefix / removesuffix
  auto a = bind(args, name, {"affix"}, 1);
  std::string affix = str_arg(*a[0], name);
  if (name == "removeprefix" && s.compare(0, affix.size(), affix) == 0) return Value::string(s.substr(affix.size()));
  if (name == "removesuffix" && !affix.empty() && s.size() >= affix.size() &&
      s.compare(s.size() - affix.size(), affix.size(), affix) == 0) {
    return Value::string(s.substr(0, s.size() - affix.size()));
  }
  return Value::string(s);
}

}  // namespace

}  // namespace plow::jinja
