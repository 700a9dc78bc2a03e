// The chat-template interpreter: statements, expressions and macro calls under jinja2's scoping rules
// (HF's globals are in jinja_globals.cpp). Every evaluation counts against ChatTemplateLimits, and
// values that can form reference cycles (namespaces, scopes holding macros) are cleared when the render
// ends, so nothing leaks or runs unbounded.
#include "serve/jinja_eval.h"

#include <fmt/format.h>

#include "core/error.h"
#include "serve/jinja_ops.h"

namespace plow::jinja {

void Scope::set(const std::string& name, Value value) {
  for (auto& [k, v] : vars) {
    if (k == name) {
      v = std::move(value);
      return;
    }
  }
  vars.emplace_back(name, std::move(value));
}

namespace {

// A TemplateError that already carries the position of the innermost node that failed.
class PositionedError : public TemplateError {
 public:
  PositionedError(const std::string& message, SourcePos where) : TemplateError(message), pos(where) {}
  SourcePos pos;
};

using ScopePtr = std::shared_ptr<Scope>;

class Renderer {
 public:
  Renderer(const Program& program, const Clock& clock, const ChatTemplateLimits& limits)
      : program_(program), clock_(clock), limits_(limits) {}

  ~Renderer() {
    // Break the cycles a template can build (a namespace holding itself, a macro stored in the scope
    // it closes over) so that every value is freed.
    for (auto& ns : namespaces_) ns->attributes.clear();
    for (auto& scope : closure_scopes_) scope->vars.clear();
  }

  std::string render(const ScopePtr& root) {
    std::string out;
    WorkMeter meter(limits_.max_steps);
    try {
      exec_body(program_.body, root, out);
    } catch (const PositionedError& e) {
      fail("{}:{}:{}: {}", program_.origin, e.pos.line, e.pos.column, e.what());
    } catch (const TemplateError& e) {
      fail("{}: {}", program_.origin, e.what());
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // e.g. std::bad_alloc: still a plow::Error for the caller
      fail("{}: render failed: {}", program_.origin, e.what());
    }
    return out;
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  class DepthGuard {
   public:
    explicit DepthGuard(Renderer& r) : r_(r) {
      if (++r_.depth_ > kMaxEvalDepth) raise(fmt::format("template recursion deeper than {} levels", kMaxEvalDepth));
      charge_work(1);
    }
    ~DepthGuard() { --r_.depth_; }
    DepthGuard(const DepthGuard&) = delete;
    DepthGuard& operator=(const DepthGuard&) = delete;

   private:
    Renderer& r_;
  };

  Flow exec_body(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const StmtPtr& stmt : body) {
      Flow flow = exec(*stmt, scope, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& stmt, const ScopePtr& scope, std::string& out) {
    DepthGuard guard(*this);
    try {
      Flow flow = exec_inner(stmt, scope, out);
      if (out.size() > limits_.max_output_bytes) {
        raise(fmt::format("output longer than {} bytes", limits_.max_output_bytes));
      }
      return flow;
    } catch (const PositionedError&) {
      throw;
    } catch (const TemplateError& e) {
      throw PositionedError(e.what(), stmt.pos);
    }
  }

  static ScopePtr child(const ScopePtr& parent) {
    auto scope = std::make_shared<Scope>();
    scope->parent = parent;
    return scope;
  }

  Flow exec_inner(const Stmt& stmt, const ScopePtr& scope, std::string& out) {
    switch (stmt.kind) {
      case StmtKind::kText:
        charge_work(stmt.text.size() / 16);
        out += stmt.text;
        return Flow::kNormal;
      case StmtKind::kOutput: {
        std::string text = to_str(eval(*stmt.expr, scope));
        charge_work(text.size() / 16);
        out += text;
        return Flow::kNormal;
      }
      case StmtKind::kIf:
        for (const auto& [test, body] : stmt.branches) {
          if (truthy(eval(*test, scope))) return exec_body(body, scope, out);
        }
        return exec_body(stmt.else_body, scope, out);
      case StmtKind::kFor: return exec_for(stmt, scope, out);
      case StmtKind::kSet: assign(stmt.target, eval(*stmt.expr, scope), scope); return Flow::kNormal;
      case StmtKind::kSetBlock: {
        std::string text;
        exec_body(stmt.body, child(scope), text);
        Value value = Value::string(std::move(text));
        if (stmt.expr) value = eval_filter(*stmt.expr, scope, value);
        assign(stmt.target, value, scope);
        return Flow::kNormal;
      }
      case StmtKind::kMacro: {
        auto macro = std::make_shared<Callable>();
        macro->type = Callable::Type::kMacro;
        macro->name = stmt.name;
        macro->definition = &stmt;
        macro->closure = scope;
        scope->set(stmt.name, Value::callable(std::move(macro)));
        closure_scopes_.push_back(scope);
        return Flow::kNormal;
      }
      case StmtKind::kCallBlock: {
        auto caller = std::make_shared<Callable>();
        caller->type = Callable::Type::kMacro;
        caller->name = "caller";
        caller->definition = &stmt;
        caller->closure = scope;
        const Expr& call = *stmt.expr;
        Value callee = eval(*call.children[0], scope);
        CallArgs args = eval_args(call, scope);
        if (callee.kind() != Kind::kCallable || callee.as_callable().type != Callable::Type::kMacro) {
          raise("a call block must call a macro");
        }
        Value caller_value = Value::callable(std::move(caller));
        out += to_str(call_macro(callee.as_callable(), args, &caller_value));
        return Flow::kNormal;
      }
      case StmtKind::kFilterBlock: {
        std::string text;
        exec_body(stmt.body, child(scope), text);
        out += to_str(eval_filter(*stmt.expr, scope, Value::string(std::move(text))));
        return Flow::kNormal;
      }
      case StmtKind::kWith: {
        ScopePtr inner = child(scope);
        for (const auto& [target, value] : stmt.assignments) assign(target, eval(*value, scope), inner);
        return exec_body(stmt.body, inner, out);
      }
      case StmtKind::kScope: exec_body(stmt.body, child(scope), out); return Flow::kNormal;
      case StmtKind::kBreak: return Flow::kBreak;
      case StmtKind::kContinue: return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  Flow exec_for(const Stmt& stmt, const ScopePtr& scope, std::string& out) {
    ValueList items = iterate(eval(*stmt.expr, scope));
    if (stmt.condition) {
      ValueList kept;
      for (Value& item : items) {
        count_iteration();
        ScopePtr probe = child(scope);
        assign(stmt.target, item, probe);
        if (truthy(eval(*stmt.condition, probe))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec_body(stmt.else_body, child(scope), out);
      return Flow::kNormal;
    }
    auto loop = std::make_shared<LoopState>();
    loop->items = std::make_shared<const ListData>(ListData{std::move(items), 1});
    Value loop_value = Value::loop(loop);
    for (size_t i = 0; i < loop->items->items.size(); ++i) {
      count_iteration();
      loop->index0 = static_cast<int64_t>(i);
      ScopePtr iteration = child(scope);
      assign(stmt.target, loop->items->items[i], iteration);
      iteration->set("loop", loop_value);
      if (exec_body(stmt.body, iteration, out) == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  void count_iteration() {
    if (++iterations_ > limits_.max_loop_iterations) {
      raise(fmt::format("render exceeded {} loop iterations", limits_.max_loop_iterations));
    }
  }

  void assign(const Target& target, const Value& value, const ScopePtr& scope) {
    switch (target.kind) {
      case Target::Kind::kName: scope->set(target.names[0], value); return;
      case Target::Kind::kTuple: {
        ValueList items = iterate(value);
        size_t expected = target.names.size();
        if (items.size() > expected) raise(fmt::format("too many values to unpack (expected {})", expected));
        if (items.size() < expected) {
          raise(fmt::format("not enough values to unpack (expected {}, got {})", expected, items.size()));
        }
        for (size_t i = 0; i < expected; ++i) scope->set(target.names[i], items[i]);
        return;
      }
      case Target::Kind::kNamespaceAttr: {
        Value ns = lookup(target.names[0], scope);
        if (ns.kind() != Kind::kNamespace) raise("cannot assign attribute on non-namespace object");
        check_namespace_name(target.attribute);
        ns.as_namespace()->set(target.attribute, value);
        return;
      }
    }
  }

  Value lookup(const std::string& name, const ScopePtr& scope) {
    for (const Scope* s = scope.get(); s; s = s->parent.get()) {
      for (const auto& [k, v] : s->vars) {
        if (k == name) return v;
      }
    }
    if (is_global(name)) {
      auto builtin = std::make_shared<Callable>();
      builtin->type = Callable::Type::kBuiltin;
      builtin->name = name;
      return Value::callable(std::move(builtin));
    }
    return Value::undefined(fmt::format("'{}' is undefined", name));
  }

  Value eval(const Expr& expr, const ScopePtr& scope) {
    DepthGuard guard(*this);
    try {
      return eval_inner(expr, scope);
    } catch (const PositionedError&) {
      throw;
    } catch (const TemplateError& e) {
      throw PositionedError(e.what(), expr.pos);
    }
  }

  CallArgs eval_args(const Expr& call, const ScopePtr& scope) {
    CallArgs args;
    for (size_t i = 1; i < call.children.size(); ++i) args.positional.push_back(eval(*call.children[i], scope));
    for (const Keyword& keyword : call.keywords) args.keywords.emplace_back(keyword.name, eval(*keyword.value, scope));
    return args;
  }

  // Applies a filter chain whose innermost subject is null (filter and set blocks) to `input`.
  Value eval_filter(const Expr& expr, const ScopePtr& scope, const Value& input) {
    const Expr* inner = expr.children[0].get();
    Value subject = !inner ? input : inner->kind == ExprKind::kFilter ? eval_filter(*inner, scope, input)
                                                                      : eval(*inner, scope);
    return apply_filter(expr.name, subject, eval_args(expr, scope));
  }

  Value eval_inner(const Expr& expr, const ScopePtr& scope) {
    const auto& c = expr.children;
    switch (expr.kind) {
      case ExprKind::kLiteral: return expr.literal;
      case ExprKind::kName: return lookup(expr.name, scope);
      case ExprKind::kGetattr: return get_attribute(eval(*c[0], scope), expr.name);
      case ExprKind::kGetitem: {
        Value object = eval(*c[0], scope);
        const Expr& index = *c[1];
        if (index.kind != ExprKind::kSlice) return get_item(object, eval(index, scope));
        auto part = [&](size_t i) { return index.children[i] ? eval(*index.children[i], scope) : Value::none(); };
        return get_slice(object, part(0), part(1), part(2));
      }
      case ExprKind::kSlice: raise("a slice is only valid inside []");
      case ExprKind::kCall: {
        Value callee = eval(*c[0], scope);
        return call(callee, eval_args(expr, scope));
      }
      case ExprKind::kFilter: return eval_filter(expr, scope, Value());
      case ExprKind::kTest: {
        Value subject = eval(*c[0], scope);
        CallArgs args = eval_args(expr, scope);
        return Value::boolean(apply_test(expr.name, subject, args) != expr.negated);
      }
      case ExprKind::kNeg: return negate(eval(*c[0], scope));
      case ExprKind::kPos: return unary_plus(eval(*c[0], scope));
      case ExprKind::kNot: return Value::boolean(!truthy(eval(*c[0], scope)));
      case ExprKind::kAnd: {
        Value left = eval(*c[0], scope);
        return truthy(left) ? eval(*c[1], scope) : left;
      }
      case ExprKind::kOr: {
        Value left = eval(*c[0], scope);
        return truthy(left) ? left : eval(*c[1], scope);
      }
      case ExprKind::kBinary: {
        Value left = eval(*c[0], scope);
        return binary_op(expr.op, left, eval(*c[1], scope));
      }
      case ExprKind::kConcat: {
        std::string out;
        for (const ExprPtr& child : c) out += to_str(eval(*child, scope));
        return make_string_checked(std::move(out));
      }
      case ExprKind::kCompare: return eval_compare(expr, scope);
      case ExprKind::kCondExpr:
        if (truthy(eval(*c[1], scope))) return eval(*c[0], scope);
        if (c[2]) return eval(*c[2], scope);
        return Value::undefined("the inline if-expression evaluated to false and no else section was defined.");
      case ExprKind::kList:
      case ExprKind::kTuple: {
        ValueList items;
        for (const ExprPtr& child : c) items.push_back(eval(*child, scope));
        return expr.kind == ExprKind::kList ? Value::list(std::move(items)) : Value::tuple(std::move(items));
      }
      case ExprKind::kDict: {
        Dict dict;
        for (size_t i = 0; i + 1 < c.size(); i += 2) {
          Value key = eval(*c[i], scope);
          dict.set(std::move(key), eval(*c[i + 1], scope));
        }
        return Value::dict(std::move(dict));
      }
    }
    raise("unknown expression");
  }

  Value eval_compare(const Expr& expr, const ScopePtr& scope) {
    Value left = eval(*expr.children[0], scope);
    for (size_t i = 0; i < expr.compare_ops.size(); ++i) {
      Value right = eval(*expr.children[i + 1], scope);
      bool result = false;
      switch (expr.compare_ops[i]) {
        case CompareOp::kEq: result = equal(left, right); break;
        case CompareOp::kNe: result = !equal(left, right); break;
        case CompareOp::kLt: result = compare(left, right, "<") < 0; break;
        case CompareOp::kLe: result = compare(left, right, "<=") <= 0; break;
        case CompareOp::kGt: result = compare(left, right, ">") > 0; break;
        case CompareOp::kGe: result = compare(left, right, ">=") >= 0; break;
        case CompareOp::kIn: result = contains(right, left); break;
        case CompareOp::kNotIn: result = !contains(right, left); break;
      }
      if (!result) return Value::boolean(false);
      left = std::move(right);
    }
    return Value::boolean(true);
  }

  Value call(const Value& callee, const CallArgs& args) {
    if (callee.is_undefined()) callee.fail_undefined();
    if (callee.kind() != Kind::kCallable) raise(fmt::format("'{}' object is not callable", type_name(callee)));
    const Callable& callable = callee.as_callable();
    switch (callable.type) {
      case Callable::Type::kMacro: return call_macro(callable, args, nullptr);
      case Callable::Type::kMethod: return call_method(callable.self, callable.name, args);
      case Callable::Type::kBuiltin: return call_builtin(callable.name, args);
    }
    raise("unknown callable");
  }

  Value call_macro(const Callable& macro, const CallArgs& args, const Value* caller) {
    const Stmt& def = *macro.definition;
    if (call_depth_ >= limits_.max_call_depth) {
      raise(fmt::format("macro calls nested deeper than {} levels", limits_.max_call_depth));
    }
    ScopePtr scope = child(macro.closure);
    const size_t n = def.params.size();
    if (args.positional.size() > n && !def.uses_varargs) {
      raise(fmt::format("macro '{}' takes not more than {} argument(s)", macro.name, n));
    }
    std::vector<bool> given(n, false);
    for (size_t i = 0; i < n && i < args.positional.size(); ++i) {
      scope->set(def.params[i], args.positional[i]);
      given[i] = true;
    }
    Dict extra_keywords;
    for (const auto& [key, value] : args.keywords) {
      auto it = std::find(def.params.begin(), def.params.end(), key);
      if (it == def.params.end()) {
        if (!def.uses_kwargs) raise(fmt::format("macro '{}' takes no keyword argument '{}'", macro.name, key));
        extra_keywords.set(Value::string(key), value);
        continue;
      }
      size_t index = static_cast<size_t>(it - def.params.begin());
      if (given[index]) raise(fmt::format("macro '{}' got multiple values for argument '{}'", macro.name, key));
      scope->set(key, value);
      given[index] = true;
    }
    size_t first_default = n - def.defaults.size();
    for (size_t i = 0; i < n; ++i) {
      if (given[i]) continue;
      scope->set(def.params[i], i >= first_default ? eval(*def.defaults[i - first_default], scope)
                                                   : Value::undefined(fmt::format("parameter '{}' was not provided",
                                                                                  def.params[i])));
    }
    if (def.uses_varargs) {
      ValueList rest;
      for (size_t i = n; i < args.positional.size(); ++i) rest.push_back(args.positional[i]);
      scope->set("varargs", Value::tuple(std::move(rest)));
    }
    if (def.uses_kwargs) scope->set("kwargs", Value::dict(std::move(extra_keywords)));
    if (caller) scope->set("caller", *caller);
    std::string out;
    ++call_depth_;
    try {
      exec_body(def.body, scope, out);
    } catch (...) {
      --call_depth_;
      throw;
    }
    --call_depth_;
    return Value::string(std::move(out));
  }

  Value call_builtin(const std::string& name, const CallArgs& args) {
    return call_global(name, args, clock_, namespaces_);
  }

  const Program& program_;
  const Clock& clock_;
  const ChatTemplateLimits& limits_;
  int depth_ = 0;
  int call_depth_ = 0;
  int64_t iterations_ = 0;
  std::vector<std::shared_ptr<Namespace>> namespaces_;
  std::vector<ScopePtr> closure_scopes_;
};

}  // namespace

std::string render_program(const Program& program, std::vector<std::pair<std::string, Value>> variables,
                           const Clock& clock, const ChatTemplateLimits& limits) {
  auto root = std::make_shared<Scope>();
  root->vars = std::move(variables);
  Renderer renderer(program, clock, limits);
  std::string out = renderer.render(root);
  return out;
}

}  // namespace plow::jinja
