// String formatting as Python does it: str.format (fields, conversions, format specs) and printf-style
// `%` (flags, width, precision, %(key)s). Unsupported specs fail with an error instead of rendering
// differently from Python.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

#include "serve/jinja_ops.h"

namespace plow::jinja {

namespace {

// Python's format-spec mini-language for str, int and float, through fmt, whose spec syntax is
// Python's ([[fill]align][sign][#][0][width][.precision][type]); what fmt lacks (',' grouping, '='
// alignment, precision without a type on floats) is an error rather than a different rendering.
std::string apply_format_spec(const Value& value, const std::string& spec) {
  if (spec.empty()) return to_str(value);
  char type = spec.back();
  bool has_type = std::string_view("sdxXobcneEfFgG%").find(type) != std::string_view::npos;
  try {
    if (value.is_string()) {
      if (has_type && type != 's') raise(fmt::format("Unknown format code '{}' for object of type 'str'", type));
      return fmt::format(fmt::runtime("{:" + spec + "}"), value.as_string());
    }
    if (value.is_integral() && (!has_type || std::string_view("dxXobc").find(type) != std::string_view::npos)) {
      return fmt::format(fmt::runtime("{:" + spec + "}"), value.as_int());
    }
    if (value.is_number() && has_type && std::string_view("eEfFgG%").find(type) != std::string_view::npos) {
      if (type == '%') {
        return fmt::format(fmt::runtime("{:" + spec.substr(0, spec.size() - 1) + "f}"), value.as_float() * 100) + "%";
      }
      return fmt::format(fmt::runtime("{:" + spec + "}"), value.as_float());
    }
  } catch (const fmt::format_error& e) {
    raise(fmt::format("format spec '{}' is not supported ({})", spec, e.what()));
  }
  raise(fmt::format("format spec '{}' is not supported for {}", spec, type_name(value)));
}

}  // namespace

// str.format with auto/explicit/named fields, !r/!s conversions, attribute/index lookups and specs.
Value str_format(const std::string& format, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  int numbering = 0;
  for (size_t i = 0; i < format.size(); ++i) {
    char c = format[i];
    if (c == '}') {
      if (i + 1 < format.size() && format[i + 1] == '}') ++i;
      else raise("Single '}' encountered in format string");
      out += '}';
      continue;
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < format.size() && format[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    size_t close = format.find('}', i);
    if (close == std::string::npos) raise("Single '{' encountered in format string");
    std::string field = format.substr(i + 1, close - i - 1);
    i = close;
    std::string spec;
    if (size_t colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field.resize(colon);
    }
    char conversion = 0;
    if (size_t bang = field.find('!'); bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 0;
      field.resize(bang);
    }
    size_t name_end = std::min(field.find('.'), field.find('['));
    std::string head = field.substr(0, name_end);
    Value value;
    bool numbered = !head.empty() && std::all_of(head.begin(), head.end(), [](char d) { return d >= '0' && d <= '9'; });
    if (head.empty() || numbered) {
      int style = head.empty() ? 1 : 2;  // automatic or manual numbering; Python refuses to mix them
      if (numbering && numbering != style) {
        raise("cannot switch from manual field specification to automatic field numbering");  // both ways
      }
      numbering = style;
    }
    if (head.empty()) {
      if (auto_index >= args.positional.size()) raise("Replacement index out of range for positional args tuple");
      value = args.positional[auto_index++];
    } else if (numbered) {
      if (head.size() > 6) raise("Replacement index out of range for positional args tuple");
      size_t index = std::stoul(head);
      if (index >= args.positional.size()) raise("Replacement index out of range for positional args tuple");
      value = args.positional[index];
    } else {
      auto it = std::find_if(args.keywords.begin(), args.keywords.end(), [&](const auto& kv) { return kv.first == head; });
      if (it == args.keywords.end()) raise(fmt::format("KeyError: '{}'", head));
      value = it->second;
    }
    for (size_t p = name_end; p < field.size();) {
      if (field[p] == '.') {
        size_t end = std::min(field.find('.', p + 1), field.find('[', p + 1));
        value = get_attribute(value, field.substr(p + 1, end - p - 1));
        p = end;
      } else {
        size_t end = field.find(']', p);
        if (end == std::string::npos) raise("Missing ']' in format string");
        std::string key = field.substr(p + 1, end - p - 1);
        bool numeric = !key.empty() && key.size() < 18 &&
                       std::all_of(key.begin(), key.end(), [](char d) { return d >= '0' && d <= '9'; });
        value = get_item(value, numeric ? Value::integer(std::stoll(key)) : Value::string(key));
        p = end + 1;
      }
    }
    if (conversion == 'r') value = Value::string(repr(value));
    if (conversion == 's') value = Value::string(to_str(value));
    out += apply_format_spec(value, spec);
    if (out.size() > kMaxStringBytes) raise(fmt::format("string longer than {} bytes", kMaxStringBytes));
  }
  return Value::string(std::move(out));
}

Value percent_format(const std::string& format, const Value& args) {
  ValueList values = args.kind() == Kind::kTuple ? args.items() : ValueList{args};
  size_t next = 0;
  std::string out;
  const Value* mapped = nullptr;
  bool used_mapping = false;
  auto take = [&]() -> const Value& {
    if (mapped) {
      used_mapping = true;
      return *mapped;
    }
    if (next >= values.size()) raise("not enough arguments for format string");
    return values[next++];
  };
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out += format[i];
      continue;
    }
    ++i;
    mapped = nullptr;  // %(key)s takes its value from a dict argument
    if (i < format.size() && format[i] == '(') {
      size_t close = format.find(')', i);
      if (close == std::string::npos) raise("incomplete format key");
      if (!args.is_dict()) raise("format requires a mapping");
      mapped = args.as_dict().find(format.substr(i + 1, close - i - 1));
      if (!mapped) raise(fmt::format("KeyError: '{}'", format.substr(i + 1, close - i - 1)));
      i = close + 1;
    }
    std::string flags;
    while (i < format.size() && std::string_view("-+ #0").find(format[i]) != std::string_view::npos) flags += format[i++];
    std::string width, precision;
    while (i < format.size() && format[i] >= '0' && format[i] <= '9') width += format[i++];
    if (i < format.size() && format[i] == '.') {
      ++i;
      precision = ".";
      while (i < format.size() && format[i] >= '0' && format[i] <= '9') precision += format[i++];
    }
    if (i >= format.size()) raise("incomplete format");
    char conv = format[i];
    if (width.size() > 4 || precision.size() > 4) raise("format width or precision too large");
    std::string spec = "%" + flags + width + precision;
    char buffer[512];
    if (conv == '%') {
      out += '%';
    } else if (conv == 's' || conv == 'r' || conv == 'a') {
      const Value& v = take();
      std::string text = conv == 's' ? to_str(v) : repr(v);
      out += fmt::format(fmt::runtime("{:" + std::string(flags.find('-') != std::string::npos ? "<" : ">") +
                                      (width.empty() ? "" : width) + "}"),
                         precision.empty() ? text : text.substr(0, std::stoul("0" + precision.substr(1))));
    } else if (std::string_view("diuxXoc").find(conv) != std::string_view::npos) {
      const Value& v = take();
      if (!v.is_number()) raise(fmt::format("%{} format: a number is required, not {}", conv, type_name(v)));
      long long n = v.kind() == Kind::kFloat ? static_cast<long long>(v.as_float()) : v.as_int();
      std::string c_spec = spec + "ll" + (conv == 'i' || conv == 'u' ? 'd' : conv == 'c' ? 'c' : conv);
      if (conv == 'c') c_spec = spec + "c";
      if (conv == 'c') std::snprintf(buffer, sizeof buffer, c_spec.c_str(), static_cast<int>(n));
      else std::snprintf(buffer, sizeof buffer, c_spec.c_str(), n);
      out += buffer;
    } else if (std::string_view("eEfFgG").find(conv) != std::string_view::npos) {
      const Value& v = take();
      if (!v.is_number()) raise(fmt::format("must be real number, not {}", type_name(v)));
      std::snprintf(buffer, sizeof buffer, (spec + conv).c_str(), v.as_float());
      out += buffer;
    } else {
      raise(fmt::format("unsupported format character '{}' (0x{:x}) at index {}", conv, static_cast<int>(conv), i));
    }
  }
  // A non-tuple argument with __getitem__ (dict, list, Undefined) counts as a mapping: unused, it is
  // no error.
  bool mapping = (args.is_dict() || args.kind() == Kind::kList || args.is_undefined()) && values.size() == 1;
  if (!used_mapping && next < values.size() && !mapping) {
    raise("not all arguments converted during string formatting");
  }
  return make_string_checked(std::move(out));
}

}  // namespace plow::jinja
