// The parsed form of a chat template: expression and statement trees that the parser has already
// checked (known filters, tests, tags and methods; loop controls inside loops), so rendering never
// meets a construct it cannot evaluate. Nesting depth is bounded by the parser.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "serve/jinja_lexer.h"
#include "serve/jinja_value.h"

namespace plow::jinja {

enum class ExprKind : uint8_t {
  kLiteral,    // literal
  kName,       // name
  kGetattr,    // children[0].name
  kGetitem,    // children[0][children[1]]
  kSlice,      // start:stop:step, each child may be null
  kCall,       // children[0](children[1..], keywords)
  kFilter,     // children[0] | name(children[1..], keywords); children[0] null in a filter block
  kTest,       // children[0] is [not] name(children[1..], keywords)
  kNeg,
  kPos,
  kNot,
  kAnd,
  kOr,
  kBinary,     // children[0] op children[1]
  kConcat,     // children joined with ~
  kCompare,    // children[0] compare_ops[i] children[i + 1] ...
  kCondExpr,   // children[0] if children[1] else children[2] (null: undefined)
  kList,
  kTuple,
  kDict,       // key, value, key, value, ...
};

enum class BinaryOp : uint8_t { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum class CompareOp : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Keyword {
  std::string name;
  ExprPtr value;
};

struct Expr {
  ExprKind kind = ExprKind::kLiteral;
  SourcePos pos;
  Value literal;
  std::string name;
  BinaryOp op = BinaryOp::kAdd;
  std::vector<CompareOp> compare_ops;
  bool negated = false;
  std::vector<ExprPtr> children;
  std::vector<Keyword> keywords;
};

// Where `set`, `for` and `with` store values: a name, a tuple of names, or namespace.attribute.
struct Target {
  enum class Kind : uint8_t { kName, kTuple, kNamespaceAttr };
  Kind kind = Kind::kName;
  std::vector<std::string> names;
  std::string attribute;
};

enum class StmtKind : uint8_t {
  kText,         // text
  kOutput,       // {{ expr }} or {% print expr %}
  kIf,           // branches; else_body
  kFor,          // target in expr [if condition]: body; else_body
  kSet,          // target = expr
  kSetBlock,     // {% set target [| filter] %}body{% endset %}; expr is the filter or null
  kMacro,        // name(params = defaults): body
  kCallBlock,    // {% call(params) expr %}body: expr is the call, the body becomes `caller`
  kFilterBlock,  // {% filter expr %}body: expr is a filter chain whose innermost subject is null
  kWith,         // assignments; body
  kScope,        // a body rendered in its own scope ({% generation %})
  kBreak,
  kContinue,
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  StmtKind kind = StmtKind::kText;
  SourcePos pos;
  std::string text;
  ExprPtr expr;
  ExprPtr condition;
  Target target;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // for the last defaults.size() params
  bool uses_varargs = false;
  bool uses_kwargs = false;
  bool uses_caller = false;
  std::vector<std::pair<Target, ExprPtr>> assignments;
};

struct Program {
  Body body;
  std::string origin;
};

}  // namespace plow::jinja
