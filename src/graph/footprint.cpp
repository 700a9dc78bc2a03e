#include "graph/footprint.h"

#include <set>

namespace plow {

Footprint footprint(const Graph& graph, const std::function<DType(const WeightDecl&)>& storage, DType act_dtype) {
  Footprint result;
  std::set<std::string> counted;
  for (const WeightDecl& decl : graph.weights()) {
    int64_t numel = 1;
    for (int64_t d : decl.shape) numel *= d;
    const int64_t part_bytes = decl.mxfp4 ? numel / 2 + numel / 32 : numel * static_cast<int64_t>(dtype_size(storage(decl)));
    const std::string kind = decl.mxfp4 ? "MXFP4" : std::string(dtype_name(storage(decl)));
    for (const std::string& part : decl.parts) {
      if (!counted.insert(part).second) continue;
      result.parameters += numel;
      result.bytes_by_dtype[kind] += part_bytes;
    }
  }
  for (const Node& node : graph.nodes()) {
    for (int id : node.weights) {
      const WeightDecl& decl = graph.weights()[static_cast<size_t>(id)];
      int64_t numel = 1;
      for (int64_t d : decl.shape) numel *= d;
      const int64_t part_bytes = decl.mxfp4 ? numel / 2 + numel / 32 : numel * static_cast<int64_t>(dtype_size(storage(decl)));
      if (node.op == Op::kEmbedding) {
        result.weight_bytes_per_token += part_bytes / decl.shape[0];  // one row
      } else if (reads_routed_experts(node.op)) {
        result.weight_bytes_per_token += part_bytes * node.attrs.i("top_k");  // k of the E stacked experts
      } else {
        result.weight_bytes_per_token += part_bytes * static_cast<int64_t>(decl.parts.size());
      }
    }
  }
  const auto act_bytes = static_cast<int64_t>(dtype_size(act_dtype));
  for (const StateDecl& state : graph.states()) {
    switch (state.kind) {
      case StateKind::kKdaRecurrent: result.state_bytes_per_token += 2 * state.width * (state.width / state.depth) * 4; break;
      case StateKind::kConvWindow: result.state_bytes_per_token += 2 * state.width * state.depth * act_bytes; break;
      case StateKind::kMlaLatent:
        result.state_bytes_per_token += state.width * act_bytes;
        result.mla_cache_bytes_per_context_token += state.width * act_bytes;
        break;
    }
  }
  return result;
}

}  // namespace plow
