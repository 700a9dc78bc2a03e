// Expression grammar of chat templates, rule for rule jinja2's parser.py (so precedence, chained
// comparisons, `x if c else y`, filters binding tighter than operators and `is` tests match), with
// the load-time checks: unknown filters and tests, unsupported globals and methods.
#include <fmt/format.h>

#include "serve/jinja_parser_impl.h"

namespace plow::jinja {

ExprPtr Parser::make(ExprKind kind, const SourcePos& pos) const {
  auto expr = std::make_unique<Expr>();
  expr->kind = kind;
  expr->pos = pos;
  return expr;
}

ExprPtr Parser::parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

ExprPtr Parser::parse_condexpr() {
  DepthGuard guard(*this, current().pos);
  ExprPtr expr = parse_or();
  while (at_name("if")) {
    SourcePos pos = next().pos;
    auto cond = make(ExprKind::kCondExpr, pos);
    ExprPtr test = parse_or();
    ExprPtr otherwise = skip_name("else") ? parse_condexpr() : nullptr;
    cond->children.push_back(std::move(expr));
    cond->children.push_back(std::move(test));
    cond->children.push_back(std::move(otherwise));
    expr = std::move(cond);
  }
  return expr;
}

ExprPtr Parser::parse_or() {
  ExprPtr left = parse_and();
  while (at_name("or")) {
    auto node = make(ExprKind::kOr, next().pos);
    node->children.push_back(std::move(left));
    node->children.push_back(parse_and());
    left = std::move(node);
  }
  return left;
}

ExprPtr Parser::parse_and() {
  ExprPtr left = parse_not();
  while (at_name("and")) {
    auto node = make(ExprKind::kAnd, next().pos);
    node->children.push_back(std::move(left));
    node->children.push_back(parse_not());
    left = std::move(node);
  }
  return left;
}

ExprPtr Parser::parse_not() {
  if (at_name("not")) {
    DepthGuard guard(*this, current().pos);
    auto node = make(ExprKind::kNot, next().pos);
    node->children.push_back(parse_not());
    return node;
  }
  return parse_compare();
}

ExprPtr Parser::parse_compare() {
  SourcePos pos = current().pos;
  ExprPtr expr = parse_math1();
  ExprPtr node;
  while (true) {
    CompareOp op;
    const Token& token = current();
    if (token.type == TokenType::kOperator && token.text == "==") {
      op = CompareOp::kEq;
    } else if (token.type == TokenType::kOperator && token.text == "!=") {
      op = CompareOp::kNe;
    } else if (token.type == TokenType::kOperator && token.text == "<") {
      op = CompareOp::kLt;
    } else if (token.type == TokenType::kOperator && token.text == "<=") {
      op = CompareOp::kLe;
    } else if (token.type == TokenType::kOperator && token.text == ">") {
      op = CompareOp::kGt;
    } else if (token.type == TokenType::kOperator && token.text == ">=") {
      op = CompareOp::kGe;
    } else if (at_name("in")) {
      op = CompareOp::kIn;
    } else if (at_name("not") && look().type == TokenType::kName && look().text == "in") {
      next();
      op = CompareOp::kNotIn;
    } else {
      break;
    }
    next();
    if (!node) {
      node = make(ExprKind::kCompare, pos);
      node->children.push_back(std::move(expr));
    }
    node->compare_ops.push_back(op);
    node->children.push_back(parse_math1());
  }
  return node ? std::move(node) : std::move(expr);
}

ExprPtr Parser::parse_math1() {
  ExprPtr left = parse_concat();
  while (at_op("+") || at_op("-")) {
    auto node = make(ExprKind::kBinary, current().pos);
    node->op = next().text == "+" ? BinaryOp::kAdd : BinaryOp::kSub;
    node->children.push_back(std::move(left));
    node->children.push_back(parse_concat());
    left = std::move(node);
  }
  return left;
}

ExprPtr Parser::parse_concat() {
  SourcePos pos = current().pos;
  ExprPtr first = parse_math2();
  if (!at_op("~")) return first;
  auto node = make(ExprKind::kConcat, pos);
  node->children.push_back(std::move(first));
  while (skip_op("~")) node->children.push_back(parse_math2());
  return node;
}

ExprPtr Parser::parse_math2() {
  ExprPtr left = parse_pow();
  while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
    auto node = make(ExprKind::kBinary, current().pos);
    const std::string& op = next().text;
    node->op = op == "*" ? BinaryOp::kMul : op == "/" ? BinaryOp::kDiv : op == "//" ? BinaryOp::kFloorDiv
                                                                                      : BinaryOp::kMod;
    node->children.push_back(std::move(left));
    node->children.push_back(parse_pow());
    left = std::move(node);
  }
  return left;
}

ExprPtr Parser::parse_pow() {
  ExprPtr left = parse_unary();
  while (at_op("**")) {
    auto node = make(ExprKind::kBinary, next().pos);
    node->op = BinaryOp::kPow;
    node->children.push_back(std::move(left));
    node->children.push_back(parse_unary());
    left = std::move(node);
  }
  return left;
}

ExprPtr Parser::parse_unary(bool with_filter) {
  DepthGuard guard(*this, current().pos);
  ExprPtr node;
  if (at_op("-") || at_op("+")) {
    node = make(current().text == "-" ? ExprKind::kNeg : ExprKind::kPos, current().pos);
    next();
    node->children.push_back(parse_unary(false));
  } else {
    node = parse_primary();
  }
  node = parse_postfix(std::move(node));
  if (with_filter) node = parse_filter_expr(std::move(node));
  return node;
}

ExprPtr Parser::parse_primary() {
  const Token& token = current();
  ExprPtr node;
  switch (token.type) {
    case TokenType::kName: {
      const std::string& name = token.text;
      node = make(ExprKind::kLiteral, token.pos);
      if (name == "true" || name == "True") {
        node->literal = Value::boolean(true);
      } else if (name == "false" || name == "False") {
        node->literal = Value::boolean(false);
      } else if (name == "none" || name == "None") {
        node->literal = Value::none();
      } else {
        node->kind = ExprKind::kName;
        node->name = name;
      }
      next();
      return node;
    }
    case TokenType::kString: {
      node = make(ExprKind::kLiteral, token.pos);
      std::string text;
      while (current().type == TokenType::kString) text += next().text;
      node->literal = Value::string(std::move(text));
      return node;
    }
    case TokenType::kInteger:
    case TokenType::kFloat:
      node = make(ExprKind::kLiteral, token.pos);
      node->literal = token.type == TokenType::kInteger ? Value::integer(token.integer) : Value::number(token.number);
      next();
      return node;
    case TokenType::kOperator:
      if (token.text == "(") {
        next();
        node = parse_tuple(true, {}, true);
        expect_op(")");
        return node;
      }
      if (token.text == "[") return parse_list();
      if (token.text == "{") return parse_dict();
      break;
    default: break;
  }
  error(token.pos, "unexpected " + describe(token));
}

ExprPtr Parser::parse_tuple(bool with_condexpr, std::vector<std::string_view> extra_end, bool explicit_parentheses) {
  SourcePos pos = current().pos;
  std::vector<ExprPtr> items;
  bool is_tuple = false;
  auto at_end = [&] {
    const Token& t = current();
    if (t.type == TokenType::kVariableEnd || t.type == TokenType::kBlockEnd || at_op(")")) return true;
    for (std::string_view name : extra_end) {
      if (at_name(name)) return true;
    }
    return false;
  };
  while (true) {
    if (!items.empty()) expect_op(",");
    if (at_end()) break;
    items.push_back(parse_expression(with_condexpr));
    if (!at_op(",")) break;
    is_tuple = true;
  }
  if (!is_tuple) {
    if (!items.empty()) return std::move(items[0]);
    if (!explicit_parentheses) unexpected("an expression");
  }
  auto node = make(ExprKind::kTuple, pos);
  node->children = std::move(items);
  return node;
}

ExprPtr Parser::parse_list() {
  auto node = make(ExprKind::kList, next().pos);
  while (!at_op("]")) {
    if (!node->children.empty()) expect_op(",");
    if (at_op("]")) break;
    node->children.push_back(parse_expression());
  }
  expect_op("]");
  return node;
}

ExprPtr Parser::parse_dict() {
  auto node = make(ExprKind::kDict, next().pos);
  while (!at_op("}")) {
    if (!node->children.empty()) expect_op(",");
    if (at_op("}")) break;
    node->children.push_back(parse_expression());
    expect_op(":");
    node->children.push_back(parse_expression());
  }
  expect_op("}");
  return node;
}

ExprPtr Parser::parse_postfix(ExprPtr node) {
  while (true) {
    if (at_op(".") || at_op("[")) {
      node = parse_subscript(std::move(node));
    } else if (at_op("(")) {
      node = parse_call(std::move(node));
    } else {
      return node;
    }
  }
}

ExprPtr Parser::parse_filter_expr(ExprPtr node) {
  while (true) {
    if (at_op("|")) {
      node = parse_filter(std::move(node), false);
    } else if (at_name("is")) {
      node = parse_test(std::move(node));
    } else if (at_op("(")) {
      node = parse_call(std::move(node));
    } else {
      return node;
    }
  }
}

ExprPtr Parser::parse_subscript(ExprPtr node) {
  const Token& token = next();
  if (token.text == ".") {
    const Token& attr = current();
    if (attr.type == TokenType::kName) {
      auto get = make(ExprKind::kGetattr, node->pos);
      get->name = next().text;
      get->children.push_back(std::move(node));
      return get;
    }
    if (attr.type != TokenType::kInteger) unexpected("a name or number after '.'");
    auto get = make(ExprKind::kGetitem, node->pos);
    auto index = make(ExprKind::kLiteral, attr.pos);
    index->literal = Value::integer(next().integer);
    get->children.push_back(std::move(node));
    get->children.push_back(std::move(index));
    return get;
  }
  std::vector<ExprPtr> args;
  while (!at_op("]")) {
    if (!args.empty()) expect_op(",");
    args.push_back(parse_subscribed());
  }
  expect_op("]");
  auto get = make(ExprKind::kGetitem, node->pos);
  get->children.push_back(std::move(node));
  if (args.size() == 1) {
    get->children.push_back(std::move(args[0]));
  } else {
    auto tuple = make(ExprKind::kTuple, token.pos);
    tuple->children = std::move(args);
    get->children.push_back(std::move(tuple));
  }
  return get;
}

ExprPtr Parser::parse_subscribed() {
  SourcePos pos = current().pos;
  auto slice = make(ExprKind::kSlice, pos);
  if (skip_op(":")) {
    slice->children.push_back(nullptr);
  } else {
    ExprPtr start = parse_expression();
    if (!skip_op(":")) return start;
    slice->children.push_back(std::move(start));
  }
  auto at_close = [&] { return at_op("]") || at_op(","); };
  slice->children.push_back(at_op(":") || at_close() ? nullptr : parse_expression());
  if (skip_op(":")) {
    slice->children.push_back(at_close() ? nullptr : parse_expression());
  } else {
    slice->children.push_back(nullptr);
  }
  return slice;
}

void Parser::parse_call_args(Expr& call) {
  expect_op("(");
  bool require_comma = false;
  while (!at_op(")")) {
    if (require_comma) {
      expect_op(",");
      if (at_op(")")) break;
    }
    if (at_op("*") || at_op("**")) error(current().pos, "*args and **kwargs in calls are not supported");
    if (current().type == TokenType::kName && look().type == TokenType::kOperator && look().text == "=") {
      std::string key = next().text;
      next();
      call.keywords.push_back({std::move(key), parse_expression()});
    } else {
      if (!call.keywords.empty()) error(current().pos, "positional argument follows keyword argument");
      call.children.push_back(parse_expression());
    }
    require_comma = true;
  }
  expect_op(")");
}

void Parser::check_call(const Expr& call) const {
  const Expr& callee = *call.children[0];
  if (callee.kind == ExprKind::kName &&
      (callee.name == "lipsum" || callee.name == "cycler" || callee.name == "joiner")) {
    error(callee.pos, fmt::format("the global '{}' is not supported", callee.name));
  }
  if (callee.kind == ExprKind::kName && callee.name == "loop") {
    error(callee.pos, "calling loop() needs a recursive for loop, which is not supported");
  }
  if (callee.kind == ExprKind::kName && callee.name == "super") error(callee.pos, "super() needs template blocks");
  if (callee.kind == ExprKind::kGetattr && is_unsupported_method(callee.name)) {
    error(callee.pos, fmt::format("the method '{}' is not supported", callee.name));
  }
}

// map('upper'), select('even'), selectattr('x', 'equalto', 1): a literal filter or test name is
// checked now, like the filter and test names written directly.
void Parser::check_named_callee(const Expr& filter) const {
  size_t index = filter.name == "selectattr" || filter.name == "rejectattr" ? 2 : 1;
  bool wants_filter = filter.name == "map";
  bool wants_test = filter.name == "select" || filter.name == "reject" || index == 2;
  if ((!wants_filter && !wants_test) || filter.children.size() <= index) return;
  const Expr& arg = *filter.children[index];
  if (arg.kind != ExprKind::kLiteral || !arg.literal.is_string()) return;
  const std::string& name = arg.literal.as_string();
  if (wants_filter && !is_known_filter(name)) error(arg.pos, fmt::format("no filter named '{}'", name));
  if (wants_test && !is_known_test(name)) error(arg.pos, fmt::format("no test named '{}'", name));
}

ExprPtr Parser::parse_call(ExprPtr node) {
  auto call = make(ExprKind::kCall, node->pos);
  call->children.push_back(std::move(node));
  parse_call_args(*call);
  check_call(*call);
  return call;
}

ExprPtr Parser::parse_filter(ExprPtr node, bool start_inline) {
  while (at_op("|") || start_inline) {
    if (!start_inline) next();
    start_inline = false;
    const Token& name_token = expect_type(TokenType::kName);
    std::string name = name_token.text;
    while (skip_op(".")) name += "." + expect_type(TokenType::kName).text;
    if (!is_known_filter(name)) error(name_token.pos, fmt::format("no filter named '{}'", name));
    auto filter = make(ExprKind::kFilter, name_token.pos);
    filter->name = std::move(name);
    filter->children.push_back(std::move(node));
    if (at_op("(")) parse_call_args(*filter);
    check_named_callee(*filter);
    node = std::move(filter);
  }
  return node;
}

ExprPtr Parser::parse_test(ExprPtr node) {
  next();  // `is`
  bool negated = skip_name("not");
  const Token& name_token = expect_type(TokenType::kName);
  std::string name = name_token.text;
  while (skip_op(".")) name += "." + expect_type(TokenType::kName).text;
  if (!is_known_test(name)) error(name_token.pos, fmt::format("no test named '{}'", name));
  auto test = make(ExprKind::kTest, name_token.pos);
  test->name = std::move(name);
  test->negated = negated;
  test->children.push_back(std::move(node));
  const Token& t = current();
  bool argument_start = t.type == TokenType::kName || t.type == TokenType::kString ||
                        t.type == TokenType::kInteger || t.type == TokenType::kFloat ||
                        (t.type == TokenType::kOperator && (t.text == "[" || t.text == "{"));
  if (at_op("(")) {
    parse_call_args(*test);
  } else if (argument_start && !at_name("else") && !at_name("or") && !at_name("and")) {
    if (at_name("is")) error(t.pos, "you cannot chain multiple tests with 'is'");
    DepthGuard guard(*this, t.pos);
    test->children.push_back(parse_postfix(parse_primary()));
  }
  return test;
}

}  // namespace plow::jinja
