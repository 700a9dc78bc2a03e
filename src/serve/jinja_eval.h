// Rendering of a parsed chat template with jinja2's scoping (a scope per for-loop iteration, macros
// that see the scope they were defined in) and HF's globals. Work is bounded: evaluation steps, loop
// iterations, call and recursion depth and output size are bounded (ChatTemplateLimits, kMaxEvalDepth).
#pragma once

#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "serve/chat_template.h"
#include "serve/jinja_ast.h"
#include "serve/jinja_ops.h"
#include "serve/jinja_value.h"

namespace plow::jinja {

// Recursion of the evaluator itself; fixed, since it protects the C++ stack (ASan builds included).
constexpr int kMaxEvalDepth = 1500;

// Variables visible to a template; a for-loop iteration, macro call or with-block gets a child scope.
struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;
  void set(const std::string& name, Value value);
};

using Clock = std::function<std::tm()>;

// Renders `program` with `variables` as the template context. Failures are plow::Error naming the
// program's origin, line and column.
std::string render_program(const Program& program, std::vector<std::pair<std::string, Value>> variables,
                           const Clock& clock, const ChatTemplateLimits& limits);

// HF's globals (jinja_globals.cpp). Namespaces call_global creates are appended to `namespaces`, so
// the renderer can clear them (and any cycle through them) when it finishes.
bool is_global(std::string_view name);
Value call_global(const std::string& name, const CallArgs& args, const Clock& clock,
                  std::vector<std::shared_ptr<Namespace>>& namespaces);
void check_namespace_name(const std::string& name);  // HF's rule: no underscore-prefixed attributes

// strftime() as Python's datetime.strftime on a naive local time (%f is 000000, %z and %Z empty).
std::string python_strftime(const std::string& format, const std::tm& time);

}  // namespace plow::jinja
