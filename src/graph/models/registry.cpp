#include "graph/models/registry.h"

#include "core/error.h"

namespace plow {

Graph build_model_graph(const ModelConfig& config, TpShard shard) {
  if (config.model_type == "kimi_linear") return build_kimi_linear(config, shard);
  fail("{}: no graph builder for model_type \"{}\"", config.source, config.model_type);
}

}  // namespace plow
