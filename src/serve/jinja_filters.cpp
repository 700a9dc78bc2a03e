// jinja2's builtin filters that chat templates use, with jinja2 3.1's argument names and results
// (lazy ones such as map/select return generator values, like jinja2's generators), and HF's `tojson`
// override: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cmath>
#include <functional>
#include <map>

#include "serve/jinja_ops.h"
#include "serve/jinja_parser.h"
#include "serve/jinja_strings.h"

namespace plow::jinja {

namespace {

using Filter = std::function<Value(const Value&, const CallArgs&)>;

// jinja2's make_attrgetter: "a.b.0" looks up a, then b, then index 0, each through obj[key].
Value lookup_path(const Value& item, const Value& attribute, const std::optional<Value>& fallback = std::nullopt) {
  Value current = item;
  std::vector<Value> parts;
  if (attribute.is_string()) {
    for (const std::string& part : py_split(attribute.as_string(), std::string("."), -1, false)) {
      bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
      parts.push_back(numeric && part.size() < 18 ? Value::integer(std::stoll(part)) : Value::string(part));
    }
  } else if (!attribute.is_none()) {
    parts.push_back(attribute);
  }
  for (const Value& part : parts) {
    current = get_item(current, part);
    if (fallback && !fallback->is_none() && current.is_undefined()) current = *fallback;
  }
  return current;
}

Value sort_key(const Value& value, bool case_sensitive) {
  if (!case_sensitive && value.is_string()) return Value::string(py_lower(value.as_string()));
  return value;
}

// sorted(items, key=..., reverse=...) with CPython's comparison order (count_run, then binary
// insertion below 64 items) so that a list mixing unorderable types fails with Python's message.
void python_sort(std::vector<std::pair<Value, Value>>& items, bool reverse) {
  auto lt = [](const Value& a, const Value& b) { return compare(a, b, "<") < 0; };
  if (reverse) std::reverse(items.begin(), items.end());
  size_t n = items.size();
  if (n >= 64) {
    std::stable_sort(items.begin(), items.end(), [&](const auto& x, const auto& y) { return lt(x.first, y.first); });
  } else if (n >= 2) {
    size_t run = 2;
    if (lt(items[1].first, items[0].first)) {
      while (run < n && lt(items[run].first, items[run - 1].first)) ++run;
      std::reverse(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(run));
    } else {
      while (run < n && !lt(items[run].first, items[run - 1].first)) ++run;
    }
    for (size_t start = run; start < n; ++start) {
      auto pivot = std::move(items[start]);
      size_t left = 0, right = start;
      while (left < right) {
        size_t mid = left + ((right - left) >> 1);
        if (lt(pivot.first, items[mid].first)) right = mid;
        else left = mid + 1;
      }
      for (size_t p = start; p > left; --p) items[p] = std::move(items[p - 1]);
      items[left] = std::move(pivot);
    }
  }
  if (reverse) std::reverse(items.begin(), items.end());
}

std::vector<Value> attribute_list(const std::optional<Value>& attribute) {
  if (!attribute || attribute->is_none()) return {Value::none()};
  if (!attribute->is_string()) return {*attribute};
  std::vector<Value> out;
  for (const std::string& part : py_split(attribute->as_string(), std::string(","), -1, false)) {
    out.push_back(Value::string(py_strip(part, std::nullopt, true, true)));
  }
  return out;
}

Value filter_tojson(const Value& value, const CallArgs& args) {
  auto a = bind(args, "tojson", {"ensure_ascii", "indent", "separators", "sort_keys"});
  DumpOptions options;
  options.ensure_ascii = a[0] && truthy(*a[0]);
  if (a[1] && !a[1]->is_none()) {
    if (a[1]->is_string()) {
      options.indent = a[1]->as_string();
    } else if (a[1]->is_integral()) {
      options.indent = std::string(static_cast<size_t>(std::clamp<int64_t>(a[1]->as_int(), 0, 256)), ' ');
    } else {
      raise(fmt::format("can't multiply sequence by non-int of type '{}'", type_name(*a[1])));
    }
    options.item_separator = ",";
  }
  if (a[2] && !a[2]->is_none()) {
    if (!a[2]->is_sequence() || a[2]->items().size() != 2 || !a[2]->items()[0].is_string() ||
        !a[2]->items()[1].is_string()) {
      raise("tojson separators must be a pair of strings");
    }
    options.item_separator = a[2]->items()[0].as_string();
    options.key_separator = a[2]->items()[1].as_string();
  }
  options.sort_keys = a[3] && truthy(*a[3]);
  return make_string_checked(dumps(value, options));
}

Value filter_indent(const Value& value, const CallArgs& args) {
  auto a = bind(args, "indent", {"width", "first", "blank"});
  std::string indention = " ";
  if (a[0] && a[0]->is_string()) {
    indention = a[0]->as_string();
  } else {
    int64_t width = a[0] ? int_arg(*a[0], "indent width") : 4;
    indention = std::string(static_cast<size_t>(std::clamp<int64_t>(width, 0, 1024)), ' ');
  }
  // do_indent starts with `s += "\n"` and then calls s.splitlines(): what that does to other types.
  if (value.is_undefined()) value.fail_undefined();
  if (value.kind() == Kind::kList) raise("'list' object has no attribute 'splitlines'");
  if (value.kind() == Kind::kTuple) raise("can only concatenate tuple (not \"str\") to tuple");
  if (!value.is_string()) raise(fmt::format("unsupported operand type(s) for +=: '{}' and 'str'", type_name(value)));
  std::vector<std::string> lines = py_splitlines(value.as_string() + "\n", false);
  std::string out;
  if (a[2] && truthy(*a[2])) {
    for (size_t i = 0; i < lines.size(); ++i) out += (i ? "\n" + indention : "") + lines[i];
  } else {
    out = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) out += "\n" + (lines[i].empty() ? "" : indention + lines[i]);
  }
  if (a[1] && truthy(*a[1])) out = indention + out;
  return make_string_checked(std::move(out));
}

Value filter_round(const Value& value, const CallArgs& args) {
  auto a = bind(args, "round", {"precision", "method"});
  int64_t precision = a[0] ? int_arg(*a[0], "precision") : 0;
  std::string method = a[1] && a[1]->is_string() ? a[1]->as_string() : "common";
  if (method != "common" && method != "ceil" && method != "floor") raise("method must be common, ceil or floor");
  if (!value.is_number()) raise(fmt::format("type {} doesn't define __round__ method", type_name(value)));
  if (method == "common") {
    if (value.is_integral() && precision >= 0) return Value::integer(value.as_int());
    double x = value.as_float();
    if (precision < 0 || !std::isfinite(x)) {
      double scale = std::pow(10.0, static_cast<double>(precision));
      double r = std::nearbyint(x * scale) / scale;
      return value.is_integral() ? Value::integer(static_cast<int64_t>(r)) : Value::number(r);
    }
    char buffer[512];
    std::snprintf(buffer, sizeof buffer, "%.*f", static_cast<int>(std::min<int64_t>(precision, 300)), x);
    return Value::number(std::strtod(buffer, nullptr));
  }
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = value.as_float() * scale;
  return Value::number((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
}

Value filter_int(const Value& value, const CallArgs& args) {
  auto a = bind(args, "int", {"default", "base"});
  Value fallback = a[0].value_or(Value::integer(0));
  int base = a[1] ? static_cast<int>(int_arg(*a[1], "base")) : 10;
  if (value.is_undefined()) value.fail_undefined();
  if (value.is_integral()) return Value::integer(value.as_int());
  if (value.kind() == Kind::kFloat) {
    double x = value.as_float();
    if (!std::isfinite(x) || std::fabs(x) >= 9.2e18) raise("cannot convert float to a 64-bit integer");
    return Value::integer(static_cast<int64_t>(x));
  }
  if (!value.is_string()) return fallback;
  std::string text = py_strip(value.as_string(), std::nullopt, true, true);
  text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
  if (!text.empty()) {
    errno = 0;
    char* end = nullptr;
    long long n = std::strtoll(text.c_str(), &end, base);
    if (end && *end == '\0' && errno == 0) return Value::integer(n);
    double x = std::strtod(text.c_str(), &end);
    if (end && *end == '\0' && std::isfinite(x) && std::fabs(x) < 9.2e18) return Value::integer(static_cast<int64_t>(x));
  }
  return fallback;
}

Value filter_float(const Value& value, const CallArgs& args) {
  auto a = bind(args, "float", {"default"});
  if (value.is_undefined()) value.fail_undefined();
  if (value.is_number()) return Value::number(value.as_float());
  if (value.is_string()) {
    std::string text = py_strip(value.as_string(), std::nullopt, true, true);
    char* end = nullptr;
    double x = std::strtod(text.c_str(), &end);
    if (!text.empty() && end && *end == '\0') return Value::number(x);
  }
  return a[0].value_or(Value::number(0.0));
}

// select/reject/selectattr/rejectattr: keep items whose (attribute's) test result equals `keep`.
Value select_items(const Value& value, const CallArgs& args, bool keep, bool by_attribute) {
  size_t first = by_attribute ? 1 : 0;
  if (by_attribute && args.positional.empty()) raise("selectattr/rejectattr need an attribute name");
  std::optional<std::string> test;
  if (args.positional.size() > first) {
    if (!args.positional[first].is_string()) raise("the test name must be a string");
    test = args.positional[first].as_string();
    if (!is_known_test(*test)) raise(fmt::format("no test named '{}'", *test));
  }
  CallArgs test_args;
  for (size_t i = first + 1; i < args.positional.size(); ++i) test_args.positional.push_back(args.positional[i]);
  test_args.keywords = args.keywords;
  ValueList out;
  if (!truthy(value)) return Value::generator({});  // jinja2 iterates only a true value
  for (const Value& item : iterate(value)) {
    Value subject = by_attribute ? lookup_path(item, args.positional[0]) : item;
    bool result = test ? apply_test(*test, subject, test_args) : truthy(subject);
    if (result == keep) out.push_back(item);
  }
  return Value::generator(std::move(out));
}

Value filter_map(const Value& value, const CallArgs& args) {
  ValueList out;
  if (!truthy(value)) return Value::generator({});  // jinja2 iterates only a true value
  if (args.positional.empty()) {
    std::optional<Value> attribute, fallback;
    for (const auto& [key, v] : args.keywords) {
      if (key == "attribute") attribute = v;
      else if (key == "default") fallback = v;
      else raise(fmt::format("Unexpected keyword argument '{}'", key));
    }
    if (!attribute) raise("map() needs a filter name or attribute=");
    for (const Value& item : iterate(value)) out.push_back(lookup_path(item, *attribute, fallback));
    return Value::generator(std::move(out));
  }
  if (!args.positional[0].is_string()) raise("the filter name must be a string");
  std::string name = args.positional[0].as_string();
  if (!is_known_filter(name)) raise(fmt::format("no filter named '{}'", name));
  CallArgs rest{ValueList(args.positional.begin() + 1, args.positional.end()), args.keywords};
  for (const Value& item : iterate(value)) out.push_back(apply_filter(name, item, rest));
  return Value::generator(std::move(out));
}

Value filter_sort(const Value& value, const CallArgs& args, bool unique) {
  auto a = unique ? bind(args, "unique", {"case_sensitive", "attribute"})
                  : bind(args, "sort", {"reverse", "case_sensitive", "attribute"});
  bool reverse = !unique && a[0] && truthy(*a[0]);
  const auto& case_arg = unique ? a[0] : a[1];
  bool case_sensitive = case_arg && truthy(*case_arg);
  std::vector<Value> attributes = attribute_list(unique ? a[1] : a[2]);
  ValueList items = iterate(value);
  auto key_of = [&](const Value& item) {
    ValueList keys;
    for (const Value& attribute : attributes) keys.push_back(sort_key(lookup_path(item, attribute), case_sensitive));
    return Value::list(std::move(keys));
  };
  if (unique) {
    ValueList out, seen;
    for (const Value& item : items) {
      Value key = key_of(item);
      for (const Value& part : key.items()) {  // jinja2 collects keys in a set
        if (part.kind() == Kind::kList || part.is_dict() || part.kind() == Kind::kGenerator) {
          raise(fmt::format("unhashable type: '{}'", type_name(part)));
        }
      }
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, key); })) {
        seen.push_back(key);
        out.push_back(item);
      }
    }
    return Value::generator(std::move(out));
  }
  std::vector<std::pair<Value, Value>> keyed;
  for (const Value& item : items) {
    Value key = key_of(item);
    keyed.emplace_back(key.items().size() == 1 ? key.items()[0] : key, item);
  }
  python_sort(keyed, reverse);
  ValueList out;
  for (auto& [key, item] : keyed) out.push_back(std::move(item));
  return Value::list(std::move(out));
}

Value filter_dictsort(const Value& value, const CallArgs& args) {
  auto a = bind(args, "dictsort", {"case_sensitive", "by", "reverse"});
  if (value.is_undefined()) value.fail_undefined();
  if (!value.is_dict()) raise(fmt::format("'{}' object has no attribute 'items'", type_name(value)));
  bool case_sensitive = a[0] && truthy(*a[0]);
  std::string by = a[1] && a[1]->is_string() ? a[1]->as_string() : "key";
  if (by != "key" && by != "value") raise("You can only sort by either \"key\" or \"value\"");
  bool reverse = a[2] && truthy(*a[2]);
  std::vector<std::pair<Value, Value>> keyed;
  for (const auto& [k, v] : value.as_dict().entries) {
    keyed.emplace_back(sort_key(by == "key" ? k : v, case_sensitive), Value::tuple({k, v}));
  }
  python_sort(keyed, reverse);
  ValueList out;
  for (auto& entry : keyed) out.push_back(std::move(entry.second));
  return Value::list(std::move(out));
}

Value filter_min_max(const Value& value, const CallArgs& args, bool max) {
  auto a = bind(args, max ? "max" : "min", {"case_sensitive", "attribute"});
  bool case_sensitive = a[0] && truthy(*a[0]);
  Value attribute = a[1].value_or(Value::none());
  ValueList items = iterate(value);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    int c = compare(sort_key(lookup_path(items[i], attribute), case_sensitive),
                    sort_key(lookup_path(items[best], attribute), case_sensitive), max ? ">" : "<");
    if (max ? c > 0 : c < 0) best = i;
  }
  return items[best];
}

Value escape_filter(const Value& value) {
  if (value.is_markup()) return value;
  return Value::markup(html_escape(to_str(value)));
}

Value text_filter(const Value& value, const CallArgs& args, const char* name, std::string (*fn)(std::string_view)) {
  bind(args, name, {});
  return Value::string(fn(to_str(value)));
}

const std::map<std::string, Filter, std::less<>>& filters() {
  static const std::map<std::string, Filter, std::less<>> table = {
      {"tojson", filter_tojson},
      {"trim", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "trim", {"chars"});
         std::optional<std::string> chars;
         if (a[0] && !a[0]->is_none()) chars = to_str(*a[0]);
         return Value::string(py_strip(to_str(v), chars, true, true));
       }},
      {"length", [](const Value& v, const CallArgs& args) { bind(args, "length", {}); return Value::integer(length(v)); }},
      {"count", [](const Value& v, const CallArgs& args) { bind(args, "count", {}); return Value::integer(length(v)); }},
      {"string", [](const Value& v, const CallArgs& args) {
         bind(args, "string", {});
         return v.is_markup() ? v : Value::string(to_str(v));
       }},
      {"upper", [](const Value& v, const CallArgs& a) { return text_filter(v, a, "upper", py_upper); }},
      {"lower", [](const Value& v, const CallArgs& a) { return text_filter(v, a, "lower", py_lower); }},
      {"capitalize", [](const Value& v, const CallArgs& a) { return text_filter(v, a, "capitalize", py_capitalize); }},
      {"title", [](const Value& v, const CallArgs& a) { return text_filter(v, a, "title", jinja_title); }},
      {"replace", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "replace", {"old", "new", "count"}, 2);
         int64_t count = a[2] && !a[2]->is_none() ? int_arg(*a[2], "count") : -1;
         return make_string_checked(py_replace(to_str(v), to_str(*a[0]), to_str(*a[1]), count));
       }},
      {"default", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "default", {"default_value", "boolean"});
         bool boolean = a[1] && truthy(*a[1]);
         if (v.is_undefined() || (boolean && !truthy(v))) return a[0].value_or(Value::string(""));
         return v;
       }},
      {"join", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "join", {"d", "attribute"});
         std::string separator = a[0] ? to_str(*a[0]) : "", out;
         ValueList items = iterate(v);
         for (size_t i = 0; i < items.size(); ++i) {
           if (i) out += separator;
           out += to_str(a[1] ? lookup_path(items[i], *a[1]) : items[i]);
           if (out.size() > kMaxStringBytes) raise(fmt::format("string longer than {} bytes", kMaxStringBytes));
         }
         return Value::string(std::move(out));
       }},
      {"first", [](const Value& v, const CallArgs& args) {
         bind(args, "first", {});
         ValueList items = iterate(v);
         return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
       }},
      {"last", [](const Value& v, const CallArgs& args) {
         bind(args, "last", {});
         bool reversible = v.is_undefined() || v.is_string() || v.kind() == Kind::kList ||
                           v.kind() == Kind::kTuple || v.is_dict();
         if (!reversible) raise(fmt::format("'{}' object is not reversible", type_name(v)));
         ValueList items = iterate(v);
         return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
       }},
      {"list", [](const Value& v, const CallArgs& args) { bind(args, "list", {}); return Value::list(iterate(v)); }},
      {"items", [](const Value& v, const CallArgs& args) {
         bind(args, "items", {});
         if (v.is_undefined()) return Value::generator({});
         if (!v.is_dict()) raise("Can only get item pairs from a mapping.");
         ValueList out;
         for (const auto& [key, value] : v.as_dict().entries) out.push_back(Value::tuple({key, value}));
         return Value::generator(std::move(out));
       }},
      {"dictsort", filter_dictsort},
      {"selectattr", [](const Value& v, const CallArgs& a) { return select_items(v, a, true, true); }},
      {"rejectattr", [](const Value& v, const CallArgs& a) { return select_items(v, a, false, true); }},
      {"select", [](const Value& v, const CallArgs& a) { return select_items(v, a, true, false); }},
      {"reject", [](const Value& v, const CallArgs& a) { return select_items(v, a, false, false); }},
      {"map", filter_map},
      {"safe", [](const Value& v, const CallArgs& args) { bind(args, "safe", {}); return Value::markup(to_str(v)); }},
      {"int", filter_int},
      {"float", filter_float},
      {"abs", [](const Value& v, const CallArgs& args) {
         bind(args, "abs", {});
         if (v.kind() == Kind::kFloat) return Value::number(std::fabs(v.as_float()));
         if (!v.is_integral()) raise(fmt::format("bad operand type for abs(): '{}'", type_name(v)));
         return v.as_int() < 0 ? negate(v) : Value::integer(v.as_int());
       }},
      {"round", filter_round},
      {"indent", filter_indent},
      {"reverse", [](const Value& v, const CallArgs& args) {
         bind(args, "reverse", {});
         if (v.is_string()) {
           std::vector<uint32_t> cps = decode_utf8(v.as_string());
           std::reverse(cps.begin(), cps.end());
           return Value::string(encode_utf8(cps, 0, cps.size()));
         }
         ValueList items;
         try {
           items = iterate(v);
         } catch (const TemplateError&) {
           raise("argument must be iterable");
         }
         std::reverse(items.begin(), items.end());
         return v.kind() == Kind::kGenerator ? Value::list(std::move(items)) : Value::generator(std::move(items));
       }},
      {"sort", [](const Value& v, const CallArgs& a) { return filter_sort(v, a, false); }},
      {"unique", [](const Value& v, const CallArgs& a) { return filter_sort(v, a, true); }},
      {"min", [](const Value& v, const CallArgs& a) { return filter_min_max(v, a, false); }},
      {"max", [](const Value& v, const CallArgs& a) { return filter_min_max(v, a, true); }},
      {"sum", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "sum", {"attribute", "start"});
         Value total = a[1].value_or(Value::integer(0));
         for (const Value& item : iterate(v)) total = binary_op(BinaryOp::kAdd, total, a[0] ? lookup_path(item, *a[0]) : item);
         return total;
       }},
      {"batch", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "batch", {"linecount", "fill_with"}, 1);
         int64_t size = int_arg(*a[0], "linecount");
         if (size <= 0) raise("batch size must be positive");
         ValueList out, row;
         for (const Value& item : iterate(v)) {
           row.push_back(item);
           if (static_cast<int64_t>(row.size()) == size) out.push_back(Value::list(std::exchange(row, {})));
         }
         if (!row.empty()) {
           while (a[1] && !a[1]->is_none() && static_cast<int64_t>(row.size()) < size) row.push_back(*a[1]);
           out.push_back(Value::list(std::move(row)));
         }
         return Value::generator(std::move(out));
       }},
      {"center", [](const Value& v, const CallArgs& args) {
         auto a = bind(args, "center", {"width"});
         CallArgs width{{a[0].value_or(Value::integer(80))}, {}};
         return call_method(Value::string(to_str(v)), "center", width);
       }},
      {"escape", [](const Value& v, const CallArgs& args) { bind(args, "escape", {}); return escape_filter(v); }},
      {"e", [](const Value& v, const CallArgs& args) { bind(args, "e", {}); return escape_filter(v); }},
      {"format", [](const Value& v, const CallArgs& args) {
         if (!args.keywords.empty()) raise("the format filter takes positional arguments here");
         return percent_format(to_str(v), Value::tuple(args.positional));
       }},
      {"attr", [](const Value& v, const CallArgs& args) {
         // Python getattr only: dict keys are not attributes here (unlike obj.name in a template).
         auto a = bind(args, "attr", {"name"}, 1);
         std::string name = to_str(*a[0]);
         if (v.is_undefined()) v.fail_undefined();
         if (v.kind() == Kind::kNamespace) {
           if (const Value* found = v.as_namespace()->find(name)) return *found;
         } else if (auto method = bound_method(v, name)) {
           return *method;
         }
         return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_type_repr(v), name));
       }},
  };
  return table;
}

}  // namespace

bool is_known_filter(std::string_view name) { return filters().count(name) > 0 || name == "d"; }

Value apply_filter(const std::string& name, const Value& input, const CallArgs& args) {
  const auto& table = filters();
  auto it = table.find(name == "d" ? std::string_view("default") : std::string_view(name));
  if (it == table.end()) raise(fmt::format("no filter named '{}'", name));
  return it->second(input, args);
}

}  // namespace plow::jinja
