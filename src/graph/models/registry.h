// Model architectures: one file per architecture plus one line in registry.cpp.
#pragma once

#include "graph/graph.h"
#include "model/config.h"

namespace plow {

// Builds the forward graph of the architecture `config.model_type` names; output = logits [T,V].
Graph build_model_graph(const ModelConfig& config);

Graph build_kimi_linear(const ModelConfig& config);

}  // namespace plow
