// The parser's internal state, shared by jinja_parser.cpp (statements) and jinja_parse_expr.cpp
// (expressions). Every recursive rule goes through DepthGuard, so nesting is bounded by
// kMaxParseDepth whatever the input.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "serve/jinja_ast.h"
#include "serve/jinja_parser.h"

namespace plow::jinja {

class Parser {
 public:
  Parser(std::vector<Token> tokens, std::string origin) : tokens_(std::move(tokens)), origin_(std::move(origin)) {}

  Body parse_template();

  // Expressions (jinja_parse_expr.cpp), named after jinja2's parser methods.
  ExprPtr parse_expression(bool with_condexpr = true);
  ExprPtr parse_tuple(bool with_condexpr = true, std::vector<std::string_view> extra_end = {},
                      bool explicit_parentheses = false);
  ExprPtr parse_filter(ExprPtr node, bool start_inline);

 private:
  friend class DepthGuard;

  // Token stream.
  const Token& current() const { return tokens_[index_]; }
  const Token& look() const { return tokens_[index_ + 1 < tokens_.size() ? index_ + 1 : index_]; }
  const Token& next() {
    const Token& token = tokens_[index_];
    if (index_ + 1 < tokens_.size()) ++index_;
    return token;
  }
  bool at_op(std::string_view op) const { return current().type == TokenType::kOperator && current().text == op; }
  bool at_name(std::string_view name) const { return current().type == TokenType::kName && current().text == name; }
  bool skip_op(std::string_view op);
  bool skip_name(std::string_view name);
  void expect_op(std::string_view op);
  void expect_name(std::string_view name);
  const Token& expect_type(TokenType type);
  void expect_block_end();
  [[noreturn]] void error(const SourcePos& pos, const std::string& message) const;
  [[noreturn]] void unexpected(std::string_view expected) const;
  static std::string describe(const Token& token);

  // Statements (jinja_parser.cpp).
  Body subparse(const std::vector<std::string_view>& end_tags);
  Body parse_statements(const std::vector<std::string_view>& end_tags, const Token& opener, bool drop_needle);
  StmtPtr parse_statement();
  StmtPtr parse_for(const Token& opener);
  StmtPtr parse_if(const Token& opener);
  StmtPtr parse_set(const Token& opener);
  StmtPtr parse_macro(const Token& opener);
  StmtPtr parse_call_block(const Token& opener);
  StmtPtr parse_filter_block(const Token& opener);
  StmtPtr parse_with(const Token& opener);
  Target parse_target(bool with_namespace);
  void parse_signature(Stmt& stmt);
  Body parse_function_body(const std::vector<std::string_view>& end_tags, const Token& opener);

  // Expression rules (jinja_parse_expr.cpp).
  ExprPtr parse_condexpr();
  ExprPtr parse_or();
  ExprPtr parse_and();
  ExprPtr parse_not();
  ExprPtr parse_compare();
  ExprPtr parse_math1();
  ExprPtr parse_concat();
  ExprPtr parse_math2();
  ExprPtr parse_pow();
  ExprPtr parse_unary(bool with_filter = true);
  ExprPtr parse_primary();
  ExprPtr parse_list();
  ExprPtr parse_dict();
  ExprPtr parse_postfix(ExprPtr node);
  ExprPtr parse_filter_expr(ExprPtr node);
  ExprPtr parse_subscript(ExprPtr node);
  ExprPtr parse_subscribed();
  ExprPtr parse_call(ExprPtr node);
  ExprPtr parse_test(ExprPtr node);
  void parse_call_args(Expr& call);
  ExprPtr make(ExprKind kind, const SourcePos& pos) const;
  void check_call(const Expr& call) const;
  void check_named_callee(const Expr& filter) const;

  std::vector<Token> tokens_;
  size_t index_ = 0;
  std::string origin_;
  int depth_ = 0;
  int loop_depth_ = 0;  // for loops enclosing the current statement within the current macro
};

// Counts one level of nesting for the lifetime of a recursive rule.
class DepthGuard {
 public:
  DepthGuard(Parser& parser, const SourcePos& pos) : parser_(parser) {
    if (++parser_.depth_ > kMaxParseDepth) {
      parser_.error(pos, "template nests deeper than " + std::to_string(kMaxParseDepth) + " levels");
    }
  }
  ~DepthGuard() { --parser_.depth_; }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;

 private:
  Parser& parser_;
};

}  // namespace plow::jinja
