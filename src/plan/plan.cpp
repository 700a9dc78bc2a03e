// Plan helpers: phase names, activation views, FNV-1a-64 and the model fingerprint.
#include "plan/plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace plow {

std::string_view phase_name(PlanPhase phase) { return phase == PlanPhase::kDecode ? "decode" : "prefill"; }

ActivationView activation_view(const Plan& plan, int32_t op_index) {
  const PlanOp& op = plan.op(op_index);
  int64_t column = 0;
  int32_t owner = op_index;
  while (plan.op(owner).is_view()) {  // inputs precede their users, so this walks to a buffer owner
    column += plan.op(owner).attrs.i("offset");
    owner = plan.op(owner).inputs.at(0);
  }
  const PlanOp& source = plan.op(owner);
  return {owner, source.offset + column, source.width, op.width};
}

uint64_t fnv1a64(std::string_view bytes, uint64_t hash) {
  for (char c : bytes) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

uint64_t model_fingerprint(std::string_view config_text, const Graph& model_graph) {
  uint64_t hash = fnv1a64(config_text);
  for (const WeightDecl& decl : model_graph.weights()) {
    // '\n' and ',' never occur in tensor names, so the encoding is unambiguous.
    std::string line = fmt::format("\n{}|{}|{}", decl.name, decl.mxfp4 ? "mxfp4" : "float", fmt::join(decl.shape, ","));
    for (const std::string& part : decl.parts) line += "|" + part;
    if (decl.shard_count > 1) line += fmt::format("|shard {} {}/{}", decl.shard_axis, decl.shard_rank, decl.shard_count);
    hash = fnv1a64(line, hash);
  }
  return hash;
}

}  // namespace plow
