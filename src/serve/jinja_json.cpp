// JSON at the template boundary: context JSON to values (object key order kept, as Python dicts keep
// it), and Python's json.dumps for HF's `tojson` override: same separators, indentation, escapes,
// float repr and errors for values JSON cannot hold.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "serve/jinja_strings.h"
#include "serve/jinja_value.h"

namespace plow::jinja {

Value from_json(const nlohmann::ordered_json& json, uint32_t depth) {
  if (depth >= kMaxValueDepth) raise(fmt::format("context nests deeper than {} levels", kMaxValueDepth));
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = json.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Value::number(static_cast<double>(u));
      }
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::number(json.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList items;
      items.reserve(json.size());
      for (const auto& element : json) items.push_back(from_json(element, depth + 1));
      return Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      dict.entries.reserve(json.size());
      for (const auto& [key, element] : json.items()) {
        Value value = from_json(element, depth + 1);
        dict.depth = std::max(dict.depth, value.depth() + 1);
        dict.entries.emplace_back(Value::string(key), std::move(value));
      }
      return Value::dict(std::move(dict));
    }
    default: raise("context holds a value JSON templates cannot see (binary or discarded)");
  }
}

namespace {

void append_escaped(std::string& out, const std::string& text, bool ensure_ascii) {
  out += '"';
  for (size_t pos = 0; pos < text.size();) {
    size_t start = pos;
    uint32_t c = next_code_point(text, pos);
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (c < 0x20 || (ensure_ascii && c > 0x7E)) {
      if (c >= 0x10000) {
        uint32_t v = c - 0x10000;
        out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      } else {
        out += fmt::format("\\u{:04x}", c);
      }
      continue;
    }
    out.append(text, start, pos - start);
  }
  out += '"';
}

std::string float_json(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  return format_float(value);
}

std::string key_json(const Value& key) {
  switch (key.kind()) {
    case Kind::kString: return key.as_string();
    case Kind::kNone: return "null";
    case Kind::kBool: return key.as_bool() ? "true" : "false";
    case Kind::kInt: return std::to_string(key.as_int());
    case Kind::kFloat: return float_json(key.as_float());
    default: raise(fmt::format("keys must be str, int, float, bool or None, not {}", type_name(key)));
  }
}

class Dumper {
 public:
  explicit Dumper(const DumpOptions& options) : options_(options) {}

  void dump(const Value& value, uint32_t level) {
    if (level > kMaxValueDepth + 8) raise(fmt::format("value nests deeper than {} levels", kMaxValueDepth));
    if (out.size() > kMaxStringBytes) raise(fmt::format("tojson output longer than {} bytes", kMaxStringBytes));
    switch (value.kind()) {
      case Kind::kNone: out += "null"; return;
      case Kind::kBool: out += value.as_bool() ? "true" : "false"; return;
      case Kind::kInt: out += std::to_string(value.as_int()); return;
      case Kind::kFloat: out += float_json(value.as_float()); return;
      case Kind::kString: append_escaped(out, value.as_string(), options_.ensure_ascii); return;
      case Kind::kList:
      case Kind::kTuple: dump_list(value.items(), level); return;
      case Kind::kDict: dump_dict(value.as_dict(), level); return;
      default: raise(fmt::format("Object of type {} is not JSON serializable", type_name(value)));
    }
  }

  std::string out;

 private:
  void newline(uint32_t level) {
    if (!options_.indent) return;
    out += '\n';
    for (uint32_t i = 0; i < level; ++i) out += *options_.indent;
  }

  void dump_list(const ValueList& items, uint32_t level) {
    if (items.empty()) {
      out += "[]";
      return;
    }
    out += '[';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += options_.item_separator;
      newline(level + 1);
      dump(items[i], level + 1);
    }
    newline(level);
    out += ']';
  }

  void dump_dict(const Dict& dict, uint32_t level) {
    if (dict.entries.empty()) {
      out += "{}";
      return;
    }
    std::vector<std::pair<std::string, const Value*>> entries;
    for (const auto& [key, value] : dict.entries) entries.emplace_back(key_json(key), &value);
    if (options_.sort_keys) {
      for (const auto& [key, value] : dict.entries) {
        if (!key.is_string()) raise("'<' not supported between instances of mixed key types");
      }
      std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    out += '{';
    for (size_t i = 0; i < entries.size(); ++i) {
      if (i) out += options_.item_separator;
      newline(level + 1);
      append_escaped(out, entries[i].first, options_.ensure_ascii);
      out += options_.key_separator;
      dump(*entries[i].second, level + 1);
    }
    newline(level);
    out += '}';
  }

  const DumpOptions& options_;
};

}  // namespace

std::string dumps(const Value& value, const DumpOptions& options) {
  Dumper dumper(options);
  dumper.dump(value, 0);
  return std::move(dumper.out);
}

}  // namespace plow::jinja
