// Python operators and jinja2 sandbox access for template values. Integer arithmetic is 64-bit and
// fails on overflow instead of wrapping (Python's ints are unbounded); sizes of built strings and
// lists are bounded by kMaxStringBytes.
#include "serve/jinja_ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "serve/jinja_strings.h"

namespace plow::jinja {

std::vector<std::optional<Value>> bind(const CallArgs& args, std::string_view function,
                                       std::initializer_list<std::string_view> names, size_t required) {
  std::vector<std::string_view> params(names);
  std::vector<std::optional<Value>> bound(params.size());
  if (args.positional.size() > params.size()) {
    raise(fmt::format("{}() takes at most {} arguments ({} given)", function, params.size(), args.positional.size()));
  }
  for (size_t i = 0; i < args.positional.size(); ++i) bound[i] = args.positional[i];
  for (const auto& [key, value] : args.keywords) {
    auto it = std::find(params.begin(), params.end(), key);
    if (it == params.end()) raise(fmt::format("{}() got an unexpected keyword argument '{}'", function, key));
    size_t index = static_cast<size_t>(it - params.begin());
    if (bound[index]) raise(fmt::format("{}() got multiple values for argument '{}'", function, key));
    bound[index] = value;
  }
  for (size_t i = 0; i < required; ++i) {
    if (!bound[i]) raise(fmt::format("{}() missing required argument '{}'", function, params[i]));
  }
  return bound;
}

int64_t int_arg(const Value& value, std::string_view what) {
  if (value.is_undefined()) value.fail_undefined();
  if (!value.is_integral()) raise(fmt::format("{} must be an integer, not '{}'", what, type_name(value)));
  return value.as_int();
}

namespace {

[[noreturn]] void overflow() { raise("integer overflow: results beyond 64 bits are not supported"); }

[[noreturn]] void unsupported(const char* op, const Value& a, const Value& b) {
  raise(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a), type_name(b)));
}

Value repeat(const Value& sequence, int64_t times) {
  times = std::max<int64_t>(times, 0);
  if (sequence.is_string()) {
    const std::string& text = sequence.as_string();
    if (!text.empty() && static_cast<uint64_t>(times) > kMaxStringBytes / text.size()) {
      raise(fmt::format("string longer than {} bytes", kMaxStringBytes));
    }
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += text;
    return Value::string(std::move(out));
  }
  const ValueList& items = sequence.items();
  if (!items.empty() && static_cast<uint64_t>(times) > kMaxStringBytes / 16 / items.size()) {
    raise("list repetition too large");
  }
  ValueList out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), items.begin(), items.end());
  return sequence.kind() == Kind::kTuple ? Value::tuple(std::move(out)) : Value::list(std::move(out));
}

Value add(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind() == Kind::kFloat || b.kind() == Kind::kFloat) return Value::number(a.as_float() + b.as_float());
    int64_t r;
    if (__builtin_add_overflow(a.as_int(), b.as_int(), &r)) overflow();
    return Value::integer(r);
  }
  if (a.is_string() && b.is_string()) {
    if (!a.is_markup() && !b.is_markup()) return make_string_checked(a.as_string() + b.as_string());
    // markupsafe: Markup + str escapes the plain side.
    std::string left = a.is_markup() ? a.as_string() : html_escape(a.as_string());
    std::string right = b.is_markup() ? b.as_string() : html_escape(b.as_string());
    Value joined = make_string_checked(left + right);
    return Value::markup(joined.as_string());
  }
  if ((a.kind() == Kind::kList || a.kind() == Kind::kTuple) && a.kind() == b.kind()) {
    ValueList items = a.items();
    items.insert(items.end(), b.items().begin(), b.items().end());
    return a.kind() == Kind::kTuple ? Value::tuple(std::move(items)) : Value::list(std::move(items));
  }
  if (a.is_string() || a.kind() == Kind::kList || a.kind() == Kind::kTuple) {
    raise(fmt::format("can only concatenate {} (not \"{}\") to {}", type_name(a), type_name(b), type_name(a)));
  }
  unsupported("+", a, b);
}

Value floor_div(const Value& a, const Value& b) {
  if (!a.is_number() || !b.is_number()) unsupported("//", a, b);
  if (a.kind() == Kind::kFloat || b.kind() == Kind::kFloat) {
    double x = a.as_float(), y = b.as_float();
    if (y == 0.0) raise("float floor division by zero");
    // CPython's float_floor_div.
    double mod = std::fmod(x, y);
    double div = (x - mod) / y;
    if (mod != 0.0 && ((y < 0) != (mod < 0))) div -= 1.0;
    if (div == 0.0) return Value::number(std::copysign(0.0, x / y));
    double floored = std::floor(div);
    if (div - floored > 0.5) floored += 1.0;
    return Value::number(floored);
  }
  int64_t x = a.as_int(), y = b.as_int();
  if (y == 0) raise("integer division or modulo by zero");
  if (x == INT64_MIN && y == -1) overflow();
  int64_t q = x / y;
  if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
  return Value::integer(q);
}

Value modulo(const Value& a, const Value& b) {
  if (a.is_string()) return percent_format(a.as_string(), b);
  if (!a.is_number() || !b.is_number()) unsupported("%", a, b);
  if (a.kind() == Kind::kFloat || b.kind() == Kind::kFloat) {
    double x = a.as_float(), y = b.as_float();
    if (y == 0.0) raise("float modulo");
    double mod = std::fmod(x, y);
    if (mod != 0.0 && ((y < 0) != (mod < 0))) mod += y;
    if (mod == 0.0) mod = std::copysign(0.0, y);
    return Value::number(mod);
  }
  int64_t x = a.as_int(), y = b.as_int();
  if (y == 0) raise("integer modulo by zero");
  if (y == -1) return Value::integer(0);
  int64_t m = x % y;
  if (m != 0 && ((m < 0) != (y < 0))) m += y;
  return Value::integer(m);
}

Value power(const Value& a, const Value& b) {
  if (!a.is_number() || !b.is_number()) unsupported("** or pow()", a, b);
  if (a.kind() == Kind::kFloat || b.kind() == Kind::kFloat || b.as_int() < 0) {
    double x = a.as_float(), y = b.as_float();
    if (x == 0.0 && y < 0) raise("0.0 cannot be raised to a negative power");
    return Value::number(std::pow(x, y));
  }
  int64_t base = a.as_int(), exponent = b.as_int(), result = 1;
  while (exponent > 0) {
    if (exponent & 1) {
      if (__builtin_mul_overflow(result, base, &result)) overflow();
    }
    exponent >>= 1;
    if (exponent > 0 && __builtin_mul_overflow(base, base, &base)) overflow();
  }
  return Value::integer(result);
}

}  // namespace

Value binary_op(BinaryOp op, const Value& a, const Value& b) {
  if (op == BinaryOp::kMod && a.is_string()) return percent_format(a.as_string(), b);  // str % Undefined is fine
  if (a.is_undefined()) a.fail_undefined();
  if (b.is_undefined()) b.fail_undefined();
  switch (op) {
    case BinaryOp::kAdd: return add(a, b);
    case BinaryOp::kSub: {
      if (!a.is_number() || !b.is_number()) unsupported("-", a, b);
      if (a.kind() == Kind::kFloat || b.kind() == Kind::kFloat) return Value::number(a.as_float() - b.as_float());
      int64_t r;
      if (__builtin_sub_overflow(a.as_int(), b.as_int(), &r)) overflow();
      return Value::integer(r);
    }
    case BinaryOp::kMul: {
      if (a.is_number() && b.is_number()) {
        if (a.kind() == Kind::kFloat || b.kind() == Kind::kFloat) return Value::number(a.as_float() * b.as_float());
        int64_t r;
        if (__builtin_mul_overflow(a.as_int(), b.as_int(), &r)) overflow();
        return Value::integer(r);
      }
      bool a_seq = a.is_string() || a.kind() == Kind::kList || a.kind() == Kind::kTuple;
      bool b_seq = b.is_string() || b.kind() == Kind::kList || b.kind() == Kind::kTuple;
      if (a_seq && b.is_integral()) return repeat(a, b.as_int());
      if (b_seq && a.is_integral()) return repeat(b, a.as_int());
      if (a_seq || b_seq) {
        raise(fmt::format("can't multiply sequence by non-int of type '{}'", type_name(a_seq ? b : a)));
      }
      unsupported("*", a, b);
    }
    case BinaryOp::kDiv: {
      if (!a.is_number() || !b.is_number()) unsupported("/", a, b);
      if (b.as_float() == 0.0) {
        raise(a.kind() == Kind::kFloat || b.kind() == Kind::kFloat ? "float division by zero" : "division by zero");
      }
      return Value::number(a.as_float() / b.as_float());
    }
    case BinaryOp::kFloorDiv: return floor_div(a, b);
    case BinaryOp::kMod: return modulo(a, b);
    case BinaryOp::kPow: return power(a, b);
  }
  raise("unknown operator");
}

Value negate(const Value& value) {
  if (value.is_undefined()) value.fail_undefined();
  if (value.kind() == Kind::kFloat) return Value::number(-value.as_float());
  if (value.is_integral()) {
    if (value.as_int() == INT64_MIN) overflow();
    return Value::integer(-value.as_int());
  }
  raise(fmt::format("bad operand type for unary -: '{}'", type_name(value)));
}

Value unary_plus(const Value& value) {
  if (value.is_undefined()) value.fail_undefined();
  if (value.kind() == Kind::kFloat) return value;
  if (value.is_integral()) return Value::integer(value.as_int());
  raise(fmt::format("bad operand type for unary +: '{}'", type_name(value)));
}

Value get_attribute(const Value& object, const std::string& name) {
  switch (object.kind()) {
    case Kind::kUndefined: object.fail_undefined();
    case Kind::kDict: {
      if (auto method = bound_method(object, name)) return *method;
      if (const Value* value = object.as_dict().find(name)) return *value;
      break;
    }
    case Kind::kNamespace:
      if (const Value* value = object.as_namespace()->find(name)) return *value;
      break;
    default:
      if (auto method = bound_method(object, name)) return *method;
      break;
  }
  return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_type_repr(object), name));
}

Value get_item(const Value& object, const Value& key) {
  if (object.is_undefined()) object.fail_undefined();
  const bool hashable = key.is_string() || key.is_number() || key.is_none();
  if (object.is_dict() && hashable) {
    if (const Value* value = object.as_dict().find(key)) return *value;
  } else if ((object.kind() == Kind::kList || object.kind() == Kind::kTuple || object.is_string()) &&
             key.is_integral()) {
    int64_t index = key.as_int();
    if (object.is_string()) {
      std::vector<uint32_t> cps = decode_utf8(object.as_string());
      int64_t size = static_cast<int64_t>(cps.size());
      if (index < 0) index += size;
      if (index >= 0 && index < size) {
        return Value::string(encode_utf8(cps, static_cast<size_t>(index), static_cast<size_t>(index) + 1));
      }
    } else {
      int64_t size = static_cast<int64_t>(object.items().size());
      if (index < 0) index += size;
      if (index >= 0 && index < size) return object.items()[static_cast<size_t>(index)];
    }
  }
  if (key.is_string()) {
    // jinja2 falls back to the attribute of that name: methods, namespace and loop attributes.
    Value attribute = get_attribute(object, key.as_string());
    if (!attribute.is_undefined() || attribute.undefined_info()->security) return attribute;
    return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_type_repr(object), key.as_string()));
  }
  return Value::undefined(fmt::format("{} has no element {}", object_type_repr(object), repr(key)));
}

Value get_slice(const Value& object, const Value& start_value, const Value& stop_value, const Value& step_value) {
  if (object.is_undefined()) object.fail_undefined();
  // jinja2 compiles slices to a plain Python subscript (not the sandbox getitem), so what cannot be
  // sliced raises instead of giving Undefined.
  bool is_text = object.is_string();
  if (object.is_dict()) raise("unhashable type: 'slice'");
  if (!is_text && object.kind() != Kind::kList && object.kind() != Kind::kTuple) {
    raise(fmt::format("'{}' object is not subscriptable", type_name(object)));
  }
  auto index_of = [](const Value& v) -> std::optional<int64_t> {
    if (v.is_none()) return std::nullopt;
    return v.as_int();
  };
  for (const Value* v : {&start_value, &stop_value, &step_value}) {
    if (!v->is_integral() && !v->is_none()) raise("slice indices must be integers or None or have an __index__ method");
  }
  std::vector<uint32_t> cps;
  if (is_text) cps = decode_utf8(object.as_string());
  int64_t size = static_cast<int64_t>(is_text ? cps.size() : object.items().size());
  int64_t step = index_of(step_value).value_or(1);
  if (step == 0) raise("slice step cannot be zero");
  auto adjust = [&](std::optional<int64_t> v, int64_t if_none) {
    if (!v) return if_none;
    int64_t i = *v;
    if (i < 0) {
      i += size;
      if (i < 0) i = step < 0 ? -1 : 0;
    } else if (i >= size) {
      i = step < 0 ? size - 1 : size;
    }
    return i;
  };
  int64_t start = adjust(index_of(start_value), step < 0 ? size - 1 : 0);
  int64_t stop = adjust(index_of(stop_value), step < 0 ? -1 : size);
  std::vector<size_t> picked;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) picked.push_back(static_cast<size_t>(i));
  if (is_text) {
    std::string out;
    for (size_t i : picked) append_utf8(out, cps[i]);
    return Value::string(std::move(out));
  }
  ValueList items;
  for (size_t i : picked) items.push_back(object.items()[i]);
  return object.kind() == Kind::kTuple ? Value::tuple(std::move(items)) : Value::list(std::move(items));
}

}  // namespace plow::jinja
