// A model directory loaded for serving: validated config, mapped checkpoint, graph, bound weights.
// Loading runs every load-time gate (config checks, header validation, tensor coverage).
#pragma once

#include <memory>
#include <string>

#include "graph/graph.h"
#include "graph/weights.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace plow {

struct LoadedModel {
  ModelConfig config;
  Checkpoint checkpoint;
  Graph graph;
  std::unique_ptr<BoundWeights> weights;  // points into checkpoint and graph: LoadedModel is never moved

  static std::unique_ptr<LoadedModel> load(const std::string& model_dir);
};

}  // namespace plow
