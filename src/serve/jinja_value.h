// Runtime values of the chat-template language: the part of Python's object model that jinja2
// templates see (Undefined, None, bool, int, float, str, list, tuple, dict, namespace, callables,
// the loop object). Containers are immutable once built, as HF's ImmutableSandboxedEnvironment makes
// them, so values share storage; their nesting depth is bounded so no operation recurses unboundedly.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace plow::jinja {

// A failure while rendering (type error, use of an undefined value, raise_exception). The renderer
// turns it into a plow::Error that names the template and the line.
class TemplateError : public std::runtime_error {
 public:
  explicit TemplateError(const std::string& message) : std::runtime_error(message) {}
};
[[noreturn]] void raise(const std::string& message);

// Work accounting: operations whose cost grows with their operands (copying, scanning, decoding)
// charge it here, so a render's total work, not only its number of steps, is bounded. A render
// installs a WorkMeter for its thread; outside one, charging is free.
void charge_work(size_t units);
class WorkMeter {
 public:
  explicit WorkMeter(int64_t limit);
  ~WorkMeter();
  WorkMeter(const WorkMeter&) = delete;
  WorkMeter& operator=(const WorkMeter&) = delete;

 private:
  WorkMeter* previous_;
  int64_t left_;
  int64_t limit_;
  friend void charge_work(size_t units);
};

constexpr uint32_t kMaxValueDepth = 256;               // nesting of lists/dicts a value may have
constexpr size_t kMaxStringBytes = size_t{64} << 20;  // largest string a render may build

enum class Kind : uint8_t {
  kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kTuple, kGenerator, kDict, kNamespace, kCallable, kLoop
};

class Value;
using ValueList = std::vector<Value>;
struct Dict;
struct Namespace;
struct Callable;
struct LoopState;

struct ListData {
  ValueList items;
  uint32_t depth = 1;
};

struct UndefinedInfo {
  std::string hint;       // the message raised when the value is used
  bool security = false;  // an attribute the sandbox blocks (SecurityError in jinja2)
};

class Value {
 public:
  Value() = default;  // Undefined without a hint
  static Value undefined(std::string hint, bool security = false);
  static Value none();
  static Value boolean(bool value);
  static Value integer(int64_t value);
  static Value number(double value);
  static Value string(std::string text);
  static Value markup(std::string text);  // markupsafe.Markup (from |safe, |escape): `+` escapes the other side
  static Value list(ValueList items);
  static Value tuple(ValueList items);
  static Value generator(ValueList items);  // what lazy filters return: always true, no len()
  static Value dict(Dict dict);
  static Value ns(std::shared_ptr<Namespace> ns);
  static Value callable(std::shared_ptr<const Callable> callable);
  static Value loop(std::shared_ptr<LoopState> loop);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_markup() const { return markup_; }
  bool is_number() const { return kind_ == Kind::kBool || kind_ == Kind::kInt || kind_ == Kind::kFloat; }
  bool is_integral() const { return kind_ == Kind::kBool || kind_ == Kind::kInt; }
  bool is_sequence() const { return kind_ == Kind::kList || kind_ == Kind::kTuple || kind_ == Kind::kGenerator; }
  bool is_dict() const { return kind_ == Kind::kDict; }

  bool as_bool() const { return scalar_.b; }
  int64_t as_int() const { return kind_ == Kind::kBool ? int64_t{scalar_.b} : scalar_.i; }
  double as_float() const;  // any number
  const std::string& as_string() const { return *std::get<std::shared_ptr<const std::string>>(ptr_); }
  const ValueList& items() const { return std::get<std::shared_ptr<const ListData>>(ptr_)->items; }
  const Dict& as_dict() const { return *std::get<std::shared_ptr<const Dict>>(ptr_); }
  const std::shared_ptr<Namespace>& as_namespace() const { return std::get<std::shared_ptr<Namespace>>(ptr_); }
  const Callable& as_callable() const { return *std::get<std::shared_ptr<const Callable>>(ptr_); }
  LoopState& as_loop() const { return *std::get<std::shared_ptr<LoopState>>(ptr_); }
  const UndefinedInfo* undefined_info() const;
  uint32_t depth() const;  // 1 for scalars, 1 + deepest element for lists, tuples and dicts
  bool same_object(const Value& other) const;  // Python `is`

  // Raises the error jinja2 raises when an Undefined is used (printing or testing it is not a use).
  [[noreturn]] void fail_undefined() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool markup_ = false;
  union {
    bool b;
    int64_t i;
    double f;
  } scalar_{};
  std::variant<std::monostate, std::shared_ptr<const std::string>, std::shared_ptr<const ListData>,
               std::shared_ptr<const Dict>, std::shared_ptr<Namespace>, std::shared_ptr<const Callable>,
               std::shared_ptr<LoopState>, std::shared_ptr<const UndefinedInfo>>
      ptr_;
};

// Insertion-ordered dict (Python 3.7+ order), keyed by hashable scalars; string keys are indexed.
struct Dict {
  std::vector<std::pair<Value, Value>> entries;
  uint32_t depth = 1;
  const Value* find(const Value& key) const;
  const Value* find(const std::string& key) const;
  void set(Value key, Value value);
};

// jinja2's namespace(): the one mutable object templates can build (`{% set ns.x = ... %}`).
struct Namespace {
  std::vector<std::pair<std::string, Value>> attributes;
  const Value* find(const std::string& name) const;
  void set(const std::string& name, Value value);
};

struct Stmt;
struct Scope;

// A function value: a macro (or a call block's `caller`), a global such as range(), or a method bound
// to its receiver ("abc".startswith).
struct Callable {
  enum class Type : uint8_t { kMacro, kBuiltin, kMethod };
  Type type = Type::kBuiltin;
  std::string name;
  const Stmt* definition = nullptr;  // kMacro: the macro or call block (parameters, defaults, body)
  std::shared_ptr<Scope> closure;    // kMacro: the scope it was defined in
  Value self;                        // kMethod: the receiver
};

// The `loop` variable of a for loop.
struct LoopState {
  std::shared_ptr<const ListData> items;
  int64_t index0 = 0;
  int64_t depth0 = 0;
  std::optional<ValueList> changed_last;  // arguments of the last loop.changed() call
};

// Python semantics, used by every operator, filter and test.
bool truthy(const Value& value);
bool equal(const Value& a, const Value& b);
int compare(const Value& a, const Value& b, const char* op);  // <0, 0, >0; raises when unorderable
std::string to_str(const Value& value);                      // str(value)
std::string repr(const Value& value);
std::string format_float(double value);  // float.__repr__
std::string type_name(const Value& value);
std::string object_type_repr(const Value& value);  // jinja2's "'dict object'" phrasing
int64_t length(const Value& value);                // len(value)
ValueList iterate(const Value& value);             // iter(value), materialized
bool contains(const Value& container, const Value& item);
Value make_string_checked(std::string text);  // a str value, refusing sizes over kMaxStringBytes

// JSON in and out: context values (insertion order kept) and Python's json.dumps for `tojson`.
Value from_json(const nlohmann::ordered_json& json, uint32_t depth = 0);
struct DumpOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // json.dumps(indent=...) normalized to the indent string
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
std::string dumps(const Value& value, const DumpOptions& options);

}  // namespace plow::jinja
