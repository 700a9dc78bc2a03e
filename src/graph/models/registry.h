// Model architectures: one file per architecture plus one line in registry.cpp.
#pragma once

#include "graph/graph.h"
#include "model/config.h"

namespace plow {

// Builds the forward graph of the architecture `config.model_type` names; output = logits [T,V]. For
// a rank of a tensor-parallel group: that rank's part (its weights are blocks of the checkpoint's,
// all_reduce ops join the partial sums) and its block of the vocabulary's logits [T, V / size].
Graph build_model_graph(const ModelConfig& config, TpShard shard = {});

Graph build_kimi_linear(const ModelConfig& config, TpShard shard);

}  // namespace plow
