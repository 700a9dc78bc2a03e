// The globals HF's chat-template environment defines (range, namespace, dict, raise_exception,
// strftime_now), with jinja2's sandbox limit on range() and HF's refusal of underscore-prefixed
// namespace attributes.
#include <fmt/format.h>

#include <algorithm>

#include "serve/jinja_eval.h"

namespace plow::jinja {

bool is_global(std::string_view name) {
  return name == "range" || name == "namespace" || name == "dict" || name == "raise_exception" ||
         name == "strftime_now";
}

void check_namespace_name(const std::string& name) {
  if (!name.empty() && name[0] == '_') {
    raise(fmt::format("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '{}'. "
                      "Please rename the attribute.", name));
  }
}

Value call_global(const std::string& name, const CallArgs& args, const Clock& clock,
                  std::vector<std::shared_ptr<Namespace>>& namespaces) {
  if (name == "raise_exception") {
    auto a = bind(args, name, {"message"}, 1);
    raise(to_str(*a[0]));
  }
  if (name == "strftime_now") {
    auto a = bind(args, name, {"format"}, 1);
    if (!a[0]->is_string()) raise("strftime() argument 1 must be str");
    return make_string_checked(python_strftime(a[0]->as_string(), clock()));
  }
  if (name == "range") {
    if (!args.keywords.empty()) raise("range() takes no keyword arguments");
    const ValueList& p = args.positional;
    if (p.empty() || p.size() > 3) raise(fmt::format("range expected 1 to 3 arguments, got {}", p.size()));
    int64_t start = p.size() > 1 ? int_arg(p[0], "range() argument") : 0;
    int64_t stop = int_arg(p.size() > 1 ? p[1] : p[0], "range() argument");
    int64_t step = p.size() > 2 ? int_arg(p[2], "range() argument") : 1;
    if (step == 0) raise("range() arg 3 must not be zero");
    int64_t span = 0;  // stop - start in the direction of step, when that is positive
    bool too_big = step > 0 ? __builtin_sub_overflow(stop, start, &span) : __builtin_sub_overflow(start, stop, &span);
    int64_t stride = step > 0 ? step : (step == INT64_MIN ? INT64_MAX : -step);
    int64_t count = too_big || span <= 0 ? (too_big ? INT64_MAX : 0) : (span - 1) / stride + 1;
    if (count > 100000) raise("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    ValueList items;
    for (int64_t i = 0; i < count; ++i) items.push_back(Value::integer(start + i * step));
    return Value::list(std::move(items));
  }
  // namespace(...) and dict(...): a mapping and/or keyword arguments.
  if (args.positional.size() > 1) raise(fmt::format("{} expected at most 1 argument, got {}", name, args.positional.size()));
  Dict dict;
  if (!args.positional.empty()) {
    const Value& source = args.positional[0];
    if (source.is_dict()) {
      dict = source.as_dict();
    } else {
      for (const Value& pair : iterate(source)) {
        ValueList kv = iterate(pair);
        if (kv.size() != 2) raise("dictionary update sequence element has the wrong length; 2 is required");
        dict.set(kv[0], kv[1]);
      }
    }
  }
  for (const auto& [key, value] : args.keywords) dict.set(Value::string(key), value);
  if (name == "dict") return Value::dict(std::move(dict));
  auto ns = std::make_shared<Namespace>();
  for (auto& [key, value] : dict.entries) {
    std::string attribute = to_str(key);
    check_namespace_name(attribute);
    ns->set(attribute, value);
  }
  namespaces.push_back(ns);
  return Value::ns(std::move(ns));
}


std::string python_strftime(const std::string& format, const std::tm& time) {
  std::string c_format;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] == '%' && i + 1 < format.size()) {
      char spec = format[++i];
      if (spec == 'f') c_format += "000000";
      else if (spec != 'z' && spec != 'Z') c_format += {'%', spec};
      continue;
    }
    c_format += format[i];
  }
  if (c_format.empty()) return "";
  for (size_t size = 256; size <= 65536; size *= 4) {
    std::string buffer(size, '\0');
    size_t n = std::strftime(buffer.data(), buffer.size(), c_format.c_str(), &time);
    if (n > 0) return buffer.substr(0, n);
  }
  return "";
}

}  // namespace plow::jinja
