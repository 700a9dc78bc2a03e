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
    for (auto group : {linear_rules(), ffn_rules(), attention_rules()}) all.insert(all.end(), group.begin(), group.end());
    return all;
  }();
  return rules;
}

}  // namespace plow
