// Statement grammar of chat templates (jinja2's parser.py): if/elif/else, for (with `if` filter and
// else), set (plain, tuple, namespace attribute, block), macro, call, filter, with, print, and the
// break/continue and generation tags HF enables. Tags that need other templates (include, extends,
// import, block) or that HF does not enable are load-time errors.
#include "serve/jinja_parser.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "serve/jinja_parser_impl.h"

namespace plow::jinja {

std::shared_ptr<const Program> parse_program(std::string_view source, const std::string& origin) {
  if (source.size() > kMaxSourceBytes) {
    fail("{}: template is {} bytes, larger than the {} bytes accepted", origin, source.size(), kMaxSourceBytes);
  }
  std::string normalized = normalize_newlines(source);
  Parser parser(tokenize(normalized, origin), origin);
  auto program = std::make_shared<Program>();
  program->body = parser.parse_template();
  program->origin = origin;
  return program;
}

bool Parser::skip_op(std::string_view op) {
  if (!at_op(op)) return false;
  next();
  return true;
}

bool Parser::skip_name(std::string_view name) {
  if (!at_name(name)) return false;
  next();
  return true;
}

void Parser::expect_op(std::string_view op) {
  if (!skip_op(op)) unexpected(fmt::format("'{}'", op));
}

void Parser::expect_name(std::string_view name) {
  if (!skip_name(name)) unexpected(fmt::format("'{}'", name));
}

const Token& Parser::expect_type(TokenType type) {
  if (current().type != type) unexpected(type == TokenType::kName ? "a name" : "a value");
  return next();
}

void Parser::expect_block_end() {
  if (current().type != TokenType::kBlockEnd) unexpected("end of statement block '%}'");
  next();
}

void Parser::error(const SourcePos& pos, const std::string& message) const {
  fail("{}:{}:{}: {}", origin_, pos.line, pos.column, message);
}

std::string Parser::describe(const Token& token) {
  switch (token.type) {
    case TokenType::kData: return "template text";
    case TokenType::kVariableBegin: return "'{{'";
    case TokenType::kVariableEnd: return "end of print statement '}}'";
    case TokenType::kBlockBegin: return "'{%'";
    case TokenType::kBlockEnd: return "end of statement block '%}'";
    case TokenType::kEof: return "end of template";
    case TokenType::kString: return "string literal";
    case TokenType::kInteger:
    case TokenType::kFloat: return "number " + token.text;
    default: return "'" + token.text + "'";
  }
}

void Parser::unexpected(std::string_view expected) const {
  error(current().pos, fmt::format("expected {}, got {}", expected, describe(current())));
}

Body Parser::parse_template() {
  Body body = subparse({});
  if (current().type != TokenType::kEof) unexpected("end of template");
  return body;
}

Body Parser::subparse(const std::vector<std::string_view>& end_tags) {
  Body body;
  while (current().type != TokenType::kEof) {
    const Token& token = current();
    if (token.type == TokenType::kData) {
      auto stmt = std::make_unique<Stmt>();
      stmt->kind = StmtKind::kText;
      stmt->pos = token.pos;
      stmt->text = token.text;
      body.push_back(std::move(stmt));
      next();
    } else if (token.type == TokenType::kVariableBegin) {
      auto stmt = std::make_unique<Stmt>();
      stmt->kind = StmtKind::kOutput;
      stmt->pos = next().pos;
      stmt->expr = parse_tuple();
      if (current().type != TokenType::kVariableEnd) unexpected("end of print statement '}}'");
      next();
      body.push_back(std::move(stmt));
    } else if (token.type == TokenType::kBlockBegin) {
      next();
      if (current().type == TokenType::kName &&
          std::find(end_tags.begin(), end_tags.end(), current().text) != end_tags.end()) {
        return body;
      }
      body.push_back(parse_statement());
      expect_block_end();
    } else {
      unexpected("template text, '{{' or '{%'");
    }
  }
  return body;
}

Body Parser::parse_statements(const std::vector<std::string_view>& end_tags, const Token& opener,
                              bool drop_needle) {
  expect_block_end();
  Body body = subparse(end_tags);
  if (current().type == TokenType::kEof) {
    std::string wanted;
    for (size_t i = 0; i < end_tags.size(); ++i) wanted += (i ? " or '" : "'") + std::string(end_tags[i]) + "'";
    error(opener.pos, fmt::format("'{}' block is never closed (expected {})", opener.text, wanted));
  }
  if (drop_needle) next();
  return body;
}

// Macro and call-block bodies run as functions: loop controls of the caller do not reach into them.
Body Parser::parse_function_body(const std::vector<std::string_view>& end_tags, const Token& opener) {
  int saved = loop_depth_;
  loop_depth_ = 0;
  Body body = parse_statements(end_tags, opener, true);
  loop_depth_ = saved;
  return body;
}

StmtPtr Parser::parse_statement() {
  const Token& token = current();
  DepthGuard guard(*this, token.pos);
  if (token.type != TokenType::kName) error(token.pos, "tag name expected, got " + describe(token));
  const std::string& tag = token.text;
  if (tag == "for") return parse_for(next());
  if (tag == "if") return parse_if(next());
  if (tag == "set") return parse_set(next());
  if (tag == "macro") return parse_macro(next());
  if (tag == "call") return parse_call_block(next());
  if (tag == "filter") return parse_filter_block(next());
  if (tag == "with") return parse_with(next());
  if (tag == "print") {
    auto stmt = std::make_unique<Stmt>();
    stmt->kind = StmtKind::kOutput;
    stmt->pos = next().pos;
    stmt->expr = parse_expression();
    if (at_op(",")) {
      auto concat = make(ExprKind::kConcat, stmt->pos);
      concat->children.push_back(std::move(stmt->expr));
      while (skip_op(",")) concat->children.push_back(parse_expression());
      stmt->expr = std::move(concat);
    }
    return stmt;
  }
  if (tag == "break" || tag == "continue") {
    if (loop_depth_ == 0) error(token.pos, fmt::format("'{}' outside of a for loop", tag));
    auto stmt = std::make_unique<Stmt>();
    stmt->kind = tag == "break" ? StmtKind::kBreak : StmtKind::kContinue;
    stmt->pos = next().pos;
    return stmt;
  }
  if (tag == "generation") {
    auto stmt = std::make_unique<Stmt>();
    stmt->kind = StmtKind::kScope;
    const Token& opener = next();
    stmt->pos = opener.pos;
    stmt->body = parse_function_body({"endgeneration"}, opener);
    return stmt;
  }
  if (tag == "include" || tag == "extends" || tag == "import" || tag == "from" || tag == "block") {
    error(token.pos, fmt::format("unsupported tag '{}': a chat template is rendered on its own, without other "
                                 "templates or blocks", tag));
  }
  if (tag == "autoescape") error(token.pos, "unsupported tag 'autoescape': chat templates render without escaping");
  error(token.pos, fmt::format("unknown tag '{}'", tag));
}

StmtPtr Parser::parse_for(const Token& opener) {
  auto stmt = std::make_unique<Stmt>();
  stmt->kind = StmtKind::kFor;
  stmt->pos = opener.pos;
  stmt->target = parse_target(false);
  expect_name("in");
  stmt->expr = parse_tuple(false, {"recursive"});
  if (skip_name("if")) stmt->condition = parse_expression();
  if (at_name("recursive")) error(current().pos, "recursive for loops are not supported");
  ++loop_depth_;
  stmt->body = parse_statements({"endfor", "else"}, opener, false);
  --loop_depth_;
  if (next().text == "else") stmt->else_body = parse_statements({"endfor"}, opener, true);
  return stmt;
}

StmtPtr Parser::parse_if(const Token& opener) {
  auto stmt = std::make_unique<Stmt>();
  stmt->kind = StmtKind::kIf;
  stmt->pos = opener.pos;
  ExprPtr test = parse_tuple(false);
  while (true) {
    Body body = parse_statements({"elif", "else", "endif"}, opener, false);
    stmt->branches.emplace_back(std::move(test), std::move(body));
    const Token& tag = next();
    if (tag.text == "elif") {
      test = parse_tuple(false);
      continue;
    }
    if (tag.text == "else") stmt->else_body = parse_statements({"endif"}, opener, true);
    break;
  }
  return stmt;
}

Target Parser::parse_target(bool with_namespace) {
  Target target;
  if (with_namespace && current().type == TokenType::kName && look().type == TokenType::kOperator &&
      look().text == ".") {
    target.kind = Target::Kind::kNamespaceAttr;
    target.names.push_back(next().text);
    next();
    target.attribute = expect_type(TokenType::kName).text;
    return target;
  }
  bool parenthesized = skip_op("(");
  while (true) {
    const Token& name = current();
    if (name.type != TokenType::kName || name.text == "in") unexpected("a variable name");
    if (name.text == "true" || name.text == "false" || name.text == "none" || name.text == "True" ||
        name.text == "False" || name.text == "None") {
      error(name.pos, fmt::format("cannot assign to '{}'", name.text));
    }
    target.names.push_back(next().text);
    if (!skip_op(",")) break;
    if (at_name("in") || at_op("=") || at_op(")") || current().type == TokenType::kBlockEnd) break;
  }
  if (parenthesized) expect_op(")");
  bool tuple = parenthesized || target.names.size() > 1 || tokens_[index_ - 1].text == ",";
  target.kind = tuple ? Target::Kind::kTuple : Target::Kind::kName;
  return target;
}

StmtPtr Parser::parse_set(const Token& opener) {
  auto stmt = std::make_unique<Stmt>();
  stmt->pos = opener.pos;
  stmt->target = parse_target(true);
  if (skip_op("=")) {
    stmt->kind = StmtKind::kSet;
    stmt->expr = parse_tuple();
    return stmt;
  }
  stmt->kind = StmtKind::kSetBlock;
  if (stmt->target.kind == Target::Kind::kTuple) error(opener.pos, "a block set assigns a single name");
  if (at_op("|")) stmt->expr = parse_filter(nullptr, false);
  stmt->body = parse_function_body({"endset"}, opener);
  return stmt;
}

void Parser::parse_signature(Stmt& stmt) {
  expect_op("(");
  while (!at_op(")")) {
    if (!stmt.params.empty()) expect_op(",");
    const Token& name = expect_type(TokenType::kName);
    stmt.params.push_back(name.text);
    if (skip_op("=")) {
      stmt.defaults.push_back(parse_expression());
    } else if (!stmt.defaults.empty()) {
      error(name.pos, "non-default argument follows default argument");
    }
  }
  expect_op(")");
}

namespace {

// Which of varargs/kwargs/caller a macro body reads (jinja2 only accepts extra arguments then).
void scan_names(const Expr* expr, Stmt& macro) {
  if (!expr) return;
  if (expr->kind == ExprKind::kName) {
    macro.uses_varargs |= expr->name == "varargs";
    macro.uses_kwargs |= expr->name == "kwargs";
    macro.uses_caller |= expr->name == "caller";
  }
  for (const auto& child : expr->children) scan_names(child.get(), macro);
  for (const auto& keyword : expr->keywords) scan_names(keyword.value.get(), macro);
}

void scan_body(const Body& body, Stmt& macro) {
  for (const auto& stmt : body) {
    scan_names(stmt->expr.get(), macro);
    scan_names(stmt->condition.get(), macro);
    for (const auto& [test, branch] : stmt->branches) {
      scan_names(test.get(), macro);
      scan_body(branch, macro);
    }
    for (const auto& value : stmt->defaults) scan_names(value.get(), macro);
    for (const auto& assignment : stmt->assignments) scan_names(assignment.second.get(), macro);
    scan_body(stmt->body, macro);
    scan_body(stmt->else_body, macro);
  }
}

}  // namespace

StmtPtr Parser::parse_macro(const Token& opener) {
  auto stmt = std::make_unique<Stmt>();
  stmt->kind = StmtKind::kMacro;
  stmt->pos = opener.pos;
  stmt->name = expect_type(TokenType::kName).text;
  parse_signature(*stmt);
  stmt->body = parse_function_body({"endmacro"}, opener);
  scan_body(stmt->body, *stmt);
  return stmt;
}

StmtPtr Parser::parse_call_block(const Token& opener) {
  auto stmt = std::make_unique<Stmt>();
  stmt->kind = StmtKind::kCallBlock;
  stmt->pos = opener.pos;
  stmt->name = "caller";
  if (at_op("(")) parse_signature(*stmt);
  stmt->expr = parse_expression();
  if (stmt->expr->kind != ExprKind::kCall) error(stmt->expr->pos, "expected a call after 'call'");
  stmt->body = parse_function_body({"endcall"}, opener);
  scan_body(stmt->body, *stmt);
  return stmt;
}

StmtPtr Parser::parse_filter_block(const Token& opener) {
  auto stmt = std::make_unique<Stmt>();
  stmt->kind = StmtKind::kFilterBlock;
  stmt->pos = opener.pos;
  stmt->expr = parse_filter(nullptr, true);
  stmt->body = parse_function_body({"endfilter"}, opener);
  return stmt;
}

StmtPtr Parser::parse_with(const Token& opener) {
  auto stmt = std::make_unique<Stmt>();
  stmt->kind = StmtKind::kWith;
  stmt->pos = opener.pos;
  while (current().type != TokenType::kBlockEnd) {
    if (!stmt->assignments.empty()) expect_op(",");
    Target target = parse_target(false);
    expect_op("=");
    stmt->assignments.emplace_back(std::move(target), parse_expression());
  }
  stmt->body = parse_statements({"endwith"}, opener, true);
  return stmt;
}

}  // namespace plow::jinja
