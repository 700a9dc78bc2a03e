// Python semantics for template values (see jinja_value.h): truth, ==, ordering, str()/repr(), len(),
// iteration and `in`. Every recursive walk is bounded by kMaxValueDepth.
#include "serve/jinja_value.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstring>

#include "serve/jinja_strings.h"

namespace plow::jinja {

void raise(const std::string& message) { throw TemplateError(message); }

namespace {
thread_local WorkMeter* t_meter = nullptr;
}  // namespace

WorkMeter::WorkMeter(int64_t limit) : previous_(t_meter), left_(limit), limit_(limit) { t_meter = this; }
WorkMeter::~WorkMeter() { t_meter = previous_; }

void charge_work(size_t units) {
  WorkMeter* meter = t_meter;
  if (!meter || units == 0) return;
  meter->left_ -= static_cast<int64_t>(std::min<size_t>(units, size_t{1} << 40));
  if (meter->left_ < 0) raise(fmt::format("render exceeded {} evaluation steps", meter->limit_));
}

Value Value::undefined(std::string hint, bool security) {
  Value v;
  v.ptr_ = std::make_shared<const UndefinedInfo>(UndefinedInfo{std::move(hint), security});
  return v;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value Value::boolean(bool value) {
  Value v;
  v.kind_ = Kind::kBool;
  v.scalar_.b = value;
  return v;
}

Value Value::integer(int64_t value) {
  Value v;
  v.kind_ = Kind::kInt;
  v.scalar_.i = value;
  return v;
}

Value Value::number(double value) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.scalar_.f = value;
  return v;
}

Value Value::string(std::string text) {
  charge_work(text.size() / 16);
  Value v;
  v.kind_ = Kind::kString;
  v.ptr_ = std::make_shared<const std::string>(std::move(text));
  return v;
}

Value Value::markup(std::string text) {
  Value v = string(std::move(text));
  v.markup_ = true;
  return v;
}

Value Value::list(ValueList items) {
  charge_work(items.size() / 4);
  Value v;
  v.kind_ = Kind::kList;
  uint32_t depth = 1;
  for (const Value& item : items) depth = std::max(depth, item.depth() + 1);
  if (depth > kMaxValueDepth) raise(fmt::format("value nests deeper than {} levels", kMaxValueDepth));
  v.ptr_ = std::make_shared<const ListData>(ListData{std::move(items), depth});
  return v;
}

Value Value::tuple(ValueList items) {
  Value v = list(std::move(items));
  v.kind_ = Kind::kTuple;
  return v;
}

Value Value::generator(ValueList items) {
  Value v = list(std::move(items));
  v.kind_ = Kind::kGenerator;
  return v;
}

Value Value::dict(Dict dict) {
  if (dict.depth > kMaxValueDepth) raise(fmt::format("value nests deeper than {} levels", kMaxValueDepth));
  Value v;
  v.kind_ = Kind::kDict;
  v.ptr_ = std::make_shared<const Dict>(std::move(dict));
  return v;
}

Value Value::ns(std::shared_ptr<Namespace> ns) {
  Value v;
  v.kind_ = Kind::kNamespace;
  v.ptr_ = std::move(ns);
  return v;
}

Value Value::callable(std::shared_ptr<const Callable> callable) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.ptr_ = std::move(callable);
  return v;
}

Value Value::loop(std::shared_ptr<LoopState> loop) {
  Value v;
  v.kind_ = Kind::kLoop;
  v.ptr_ = std::move(loop);
  return v;
}

double Value::as_float() const {
  if (kind_ == Kind::kFloat) return scalar_.f;
  return static_cast<double>(as_int());
}

const UndefinedInfo* Value::undefined_info() const {
  auto* info = std::get_if<std::shared_ptr<const UndefinedInfo>>(&ptr_);
  return info ? info->get() : nullptr;
}

uint32_t Value::depth() const {
  if (auto* list = std::get_if<std::shared_ptr<const ListData>>(&ptr_)) return (*list)->depth;
  if (auto* dict = std::get_if<std::shared_ptr<const Dict>>(&ptr_)) return (*dict)->depth;
  return 1;
}

bool Value::same_object(const Value& other) const {
  if (kind_ != other.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return true;
    case Kind::kBool: return scalar_.b == other.scalar_.b;
    case Kind::kInt: return scalar_.i == other.scalar_.i;
    case Kind::kFloat: return scalar_.f == other.scalar_.f;
    case Kind::kString: return as_string() == other.as_string();
    default: return ptr_ == other.ptr_;
  }
}

void Value::fail_undefined() const {
  const UndefinedInfo* info = undefined_info();
  if (info && info->security) raise(info->hint);
  raise(info && !info->hint.empty() ? info->hint : "value is undefined");
}

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(key.as_string());
  if (!key.is_number() && !key.is_none()) raise(fmt::format("unhashable type: '{}'", type_name(key)));
  charge_work(entries.size() / 16);
  for (const auto& [k, v] : entries) {
    if (!k.is_string() && equal(k, key)) return &v;
  }
  return nullptr;
}

const Value* Dict::find(const std::string& key) const {
  charge_work(entries.size() / 16);
  for (const auto& [k, v] : entries) {
    if (k.is_string() && k.as_string() == key) return &v;
  }
  return nullptr;
}

void Dict::set(Value key, Value value) {
  bool hashable = key.is_string() || key.is_number() || key.is_none() ||
                  (key.kind() == Kind::kTuple && key.depth() == 2);
  if (!hashable) raise(fmt::format("unhashable type: '{}'", type_name(key)));
  depth = std::max(depth, value.depth() + 1);
  for (auto& [k, v] : entries) {
    if (equal(k, key)) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

const Value* Namespace::find(const std::string& name) const {
  charge_work(attributes.size() / 16);
  for (const auto& [k, v] : attributes) {
    if (k == name) return &v;
  }
  return nullptr;
}

void Namespace::set(const std::string& name, Value value) {
  for (auto& [k, v] : attributes) {
    if (k == name) {
      v = std::move(value);
      return;
    }
  }
  attributes.emplace_back(name, std::move(value));
}

bool truthy(const Value& value) {
  switch (value.kind()) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool: return value.as_bool();
    case Kind::kInt: return value.as_int() != 0;
    case Kind::kFloat: return value.as_float() != 0.0;
    case Kind::kString: return !value.as_string().empty();
    case Kind::kList:
    case Kind::kTuple: return !value.items().empty();
    case Kind::kDict: return !value.as_dict().entries.empty();
    default: return true;  // generators, namespaces, callables, loop
  }
}

namespace {

void check_depth(uint32_t depth) {
  if (depth > kMaxValueDepth + 8) raise(fmt::format("value nests deeper than {} levels", kMaxValueDepth));
}

bool equal_at(const Value& a, const Value& b, uint32_t depth) {
  check_depth(depth);
  if (a.is_number() && b.is_number()) {
    if (a.kind() == Kind::kFloat || b.kind() == Kind::kFloat) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::kUndefined:
    case Kind::kNone: return true;
    case Kind::kString:
      charge_work(a.as_string().size() / 16);
      return a.as_string() == b.as_string();
    case Kind::kList:
    case Kind::kTuple: {
      const ValueList &x = a.items(), &y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!equal_at(x[i], y[i], depth + 1)) return false;
      }
      return true;
    }
    case Kind::kDict: {
      const Dict &x = a.as_dict(), &y = b.as_dict();
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& [key, value] : x.entries) {
        const Value* other = y.find(key);
        if (!other || !equal_at(value, *other, depth + 1)) return false;
      }
      return true;
    }
    default: return a.same_object(b);
  }
}

}  // namespace

bool equal(const Value& a, const Value& b) { return equal_at(a, b, 0); }

int compare(const Value& a, const Value& b, const char* op) {
  if (a.is_undefined()) a.fail_undefined();
  if (b.is_undefined()) b.fail_undefined();
  if (a.is_number() && b.is_number()) {
    if (a.kind() == Kind::kFloat || b.kind() == Kind::kFloat) {
      double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if ((a.kind() == Kind::kList || a.kind() == Kind::kTuple) && a.kind() == b.kind()) {
    const ValueList &x = a.items(), &y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equal(x[i], y[i])) return compare(x[i], y[i], op);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  raise(fmt::format("'{}' not supported between instances of '{}' and '{}'", op, type_name(a), type_name(b)));
}

std::string format_float(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::scientific);
  std::string text(buffer, result.ptr);
  std::string sign;
  if (text[0] == '-') {
    sign = "-";
    text.erase(0, 1);
  }
  size_t e = text.find('e');
  int exponent = std::atoi(text.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; ++i) {
    if (text[i] != '.') digits += text[i];
  }
  int point = exponent + 1;  // value = 0.DIGITS x 10^point
  int count = static_cast<int>(digits.size());
  if (point > -4 && point <= 16) {
    if (point <= 0) return sign + "0." + std::string(static_cast<size_t>(-point), '0') + digits;
    if (point >= count) return sign + digits + std::string(static_cast<size_t>(point - count), '0') + ".0";
    return sign + digits.substr(0, static_cast<size_t>(point)) + "." + digits.substr(static_cast<size_t>(point));
  }
  std::string mantissa = digits.substr(0, 1);
  if (count > 1) mantissa += "." + digits.substr(1);
  return fmt::format("{}{}e{}{:02d}", sign, mantissa, exponent < 0 ? '-' : '+', std::abs(exponent));
}

std::string type_name(const Value& value) {
  switch (value.kind()) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return value.is_markup() ? "Markup" : "str";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kGenerator: return "generator";
    case Kind::kDict: return "dict";
    case Kind::kNamespace: return "Namespace";
    case Kind::kCallable:
      return value.as_callable().type == Callable::Type::kMacro ? "Macro" : "builtin_function_or_method";
    case Kind::kLoop: return "LoopContext";
  }
  return "object";
}

std::string object_type_repr(const Value& value) {
  if (value.is_none()) return "None";
  return type_name(value) + " object";
}

namespace {

std::string repr_at(const Value& value, uint32_t depth);

std::string join_repr(const ValueList& items, uint32_t depth) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    out += repr_at(items[i], depth + 1);
  }
  return out;
}

std::string str_at(const Value& value, uint32_t depth) {
  check_depth(depth);
  switch (value.kind()) {
    case Kind::kUndefined: return "";
    case Kind::kNone: return "None";
    case Kind::kBool: return value.as_bool() ? "True" : "False";
    case Kind::kInt: return std::to_string(value.as_int());
    case Kind::kFloat: return format_float(value.as_float());
    case Kind::kString: return value.as_string();
    case Kind::kList: return "[" + join_repr(value.items(), depth) + "]";
    case Kind::kTuple:
      return "(" + join_repr(value.items(), depth) + (value.items().size() == 1 ? ",)" : ")");
    case Kind::kGenerator: return "<generator object>";
    case Kind::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : value.as_dict().entries) {
        if (!first) out += ", ";
        first = false;
        out += repr_at(k, depth + 1) + ": " + repr_at(v, depth + 1);
      }
      return out + "}";
    }
    case Kind::kNamespace: {
      std::string out = "<Namespace {";
      bool first = true;
      for (const auto& [k, v] : value.as_namespace()->attributes) {
        if (!first) out += ", ";
        first = false;
        out += py_repr_string(k) + ": " + repr_at(v, depth + 1);
      }
      return out + "}>";
    }
    case Kind::kCallable: {
      const Callable& c = value.as_callable();
      if (c.type == Callable::Type::kMacro) return "<Macro '" + c.name + "'>";
      if (c.type == Callable::Type::kMethod) return "<built-in method " + c.name + ">";
      return "<built-in function " + c.name + ">";
    }
    case Kind::kLoop: {
      const LoopState& loop = value.as_loop();
      return fmt::format("<LoopContext {}/{}>", loop.index0 + 1, loop.items->items.size());
    }
  }
  return "";
}

std::string repr_at(const Value& value, uint32_t depth) {
  if (value.is_markup()) return "Markup(" + py_repr_string(value.as_string()) + ")";
  if (value.is_string()) return py_repr_string(value.as_string());
  if (value.is_undefined()) return "Undefined";
  return str_at(value, depth);
}

}  // namespace

std::string to_str(const Value& value) { return str_at(value, 0); }
std::string repr(const Value& value) { return repr_at(value, 0); }

int64_t length(const Value& value) {
  switch (value.kind()) {
    case Kind::kUndefined: return 0;
    case Kind::kString: return static_cast<int64_t>(code_point_count(value.as_string()));
    case Kind::kList:
    case Kind::kTuple: return static_cast<int64_t>(value.items().size());
    case Kind::kDict: return static_cast<int64_t>(value.as_dict().entries.size());
    case Kind::kLoop: return static_cast<int64_t>(value.as_loop().items->items.size());
    default: raise(fmt::format("object of type '{}' has no len()", type_name(value)));
  }
}

ValueList iterate(const Value& value) {
  switch (value.kind()) {
    case Kind::kUndefined: return {};
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kGenerator: charge_work(value.items().size() / 4); return value.items();
    case Kind::kString: {
      ValueList chars;
      const std::string& text = value.as_string();
      for (size_t pos = 0; pos < text.size();) {
        size_t start = pos;
        next_code_point(text, pos);
        chars.push_back(Value::string(text.substr(start, pos - start)));
      }
      return chars;
    }
    case Kind::kDict: {
      ValueList keys;
      for (const auto& entry : value.as_dict().entries) keys.push_back(entry.first);
      return keys;
    }
    default: raise(fmt::format("'{}' object is not iterable", type_name(value)));
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::kUndefined: return false;
    case Kind::kString:
      if (!item.is_string()) {
        raise(fmt::format("'in <string>' requires string as left operand, not {}", type_name(item)));
      }
      charge_work(container.as_string().size() / 16);
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kGenerator:
      charge_work(container.items().size() / 4);
      for (const Value& element : container.items()) {
        if (equal(element, item)) return true;
      }
      return false;
    case Kind::kDict: return container.as_dict().find(item) != nullptr;
    default: raise(fmt::format("argument of type '{}' is not iterable", type_name(container)));
  }
}

Value make_string_checked(std::string text) {
  if (text.size() > kMaxStringBytes) raise(fmt::format("string longer than {} bytes", kMaxStringBytes));
  return Value::string(std::move(text));
}

}  // namespace plow::jinja
