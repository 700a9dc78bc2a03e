#include "compiler/rule.h"

#include "core/error.h"

namespace plow {

std::string definition_hash(const Rule& rule) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char ch : rule.name + "\n" + rule.definition) {
    h ^= static_cast<uint8_t>(ch);
    h *= 0x100000001b3ull;
  }
  return fmt::format("{:016x}", h);
}

const Symbol& symbol_of(const EGraph& graph, const Match& match, const std::string& bind) {
  auto it = match.nodes.find(bind);
  PLOW_CHECK(it != match.nodes.end(), "rule match has no node bound to '{}'", bind);
  return graph.symbol(it->second.symbol);
}

ClassId add_fused(EGraph& graph, Op op, Attrs attrs, std::vector<int> weights, std::vector<ClassId> children, int64_t width,
                  std::string label) {
  Symbol symbol;
  symbol.op = op;
  symbol.attrs = std::move(attrs);
  symbol.weights = std::move(weights);
  symbol.width = width;
  symbol.label = std::move(label);
  return graph.add(symbol, std::move(children));
}

const std::vector<Rule>& all_rules() {
  static const std::vector<Rule> rules = [] {
    std::vector<Rule> all;
    const std::pair<const char*, std::vector<Rule>> groups[] = {
        {"rules/linear_rules.cpp", linear_rules()}, {"rules/ffn_rules.cpp", ffn_rules()}, {"rules/attention_rules.cpp", attention_rules()}};
    for (const auto& [file, group] : groups) {
      for (Rule rule : group) {
        rule.file = file;
        all.push_back(std::move(rule));
      }
    }
    return all;
  }();
  return rules;
}

}  // namespace plow
