#include "graph/graph.h"

#include "core/error.h"

namespace plow {

int Graph::add_weight(WeightDecl decl) {
  PLOW_CHECK(!decl.parts.empty(), "weight '{}' has no parts", decl.name);
  weights_.push_back(std::move(decl));
  return static_cast<int>(weights_.size()) - 1;
}

int Graph::add_state(StateDecl decl) {
  states_.push_back(std::move(decl));
  return static_cast<int>(states_.size()) - 1;
}

int Graph::add(Op op, std::vector<int> inputs, std::vector<int> weights, Attrs attrs, std::string label, int state) {
  const OpInfo& info = op_info(op);
  PLOW_CHECK(info.num_inputs < 0 ? !inputs.empty() : static_cast<int>(inputs.size()) == info.num_inputs,
             "{} '{}': {} inputs, op takes {}", info.name, label, inputs.size(), info.num_inputs);
  PLOW_CHECK(info.num_weights < 0 ? !weights.empty() : static_cast<int>(weights.size()) == info.num_weights,
             "{} '{}': {} weights, op takes {}", info.name, label, weights.size(), info.num_weights);
  PLOW_CHECK(info.stateful == (state >= 0), "{} '{}': state {} does not match the op's statefulness", info.name, label, state);
  Node node;
  node.op = op;
  node.inputs = std::move(inputs);
  node.weights = std::move(weights);
  node.attrs = std::move(attrs);
  node.state = state;
  node.dtype = out_dtype_of(op, node.attrs);
  node.label = std::move(label);
  std::vector<int64_t> widths;
  for (int input : node.inputs) {
    PLOW_CHECK(input >= 0 && input < static_cast<int>(nodes_.size()), "{} '{}': input {} is not an earlier node", info.name, node.label, input);
    widths.push_back(nodes_[static_cast<size_t>(input)].width);
  }
  std::vector<const WeightDecl*> weight_decls;
  for (int weight : node.weights) {
    PLOW_CHECK(weight >= 0 && weight < static_cast<int>(weights_.size()), "{} '{}': unknown weight {}", info.name, node.label, weight);
    weight_decls.push_back(&weights_[static_cast<size_t>(weight)]);
  }
  node.width = info.shape_rule(node, widths, weight_decls);
  nodes_.push_back(std::move(node));
  return static_cast<int>(nodes_.size()) - 1;
}

std::vector<int> extra_states(const Node& node) {
  if (node.op != Op::kKdaFusedCore) return {};
  return {static_cast<int>(node.attrs.i("conv_q")), static_cast<int>(node.attrs.i("conv_k")), static_cast<int>(node.attrs.i("conv_v"))};
}

void Graph::verify() const {
  PLOW_CHECK(output_ >= 0 && output_ < static_cast<int>(nodes_.size()), "graph output {} not set", output_);
  for (size_t id = 0; id < nodes_.size(); ++id) {
    const Node& node = nodes_[id];
    const OpInfo& info = op_info(node.op);
    PLOW_CHECK(info.num_inputs < 0 ? !node.inputs.empty() : static_cast<int>(node.inputs.size()) == info.num_inputs,
               "node {} ({}) arity", id, info.name);
    for (int input : node.inputs) PLOW_CHECK(input >= 0 && static_cast<size_t>(input) < id, "node {} reads later node {}", id, input);
    if (info.stateful) PLOW_CHECK(node.state >= 0 && node.state < static_cast<int>(states_.size()), "node {} state", id);
    for (const int extra : extra_states(node)) PLOW_CHECK(extra >= 0 && extra < static_cast<int>(states_.size()), "node {} state {}", id, extra);
  }
}

}  // namespace plow
