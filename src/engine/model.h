// A model ready to run: validated config, graph, and weights bound with the coverage gate — loaded
// from a checkpoint directory, or drawn at random from a config alone (benchmarks).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "graph/graph.h"
#include "graph/weights.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace plow {

struct LoadedModel {
  ModelConfig config;
  Graph graph;
  std::optional<Checkpoint> checkpoint;   // absent for a config-only description
  std::unique_ptr<BoundWeights> weights;  // points into checkpoint and graph: LoadedModel is never moved

  static std::unique_ptr<LoadedModel> load(const std::string& model_dir);
  // Weights drawn from `seed` in `dtype` (F32/BF16/F16) for every tensor the graph declares.
  static std::unique_ptr<LoadedModel> random(const std::string& config_path, uint64_t seed, DType dtype);
  // Config and graph only (for sizes of models too large to materialize here).
  static std::unique_ptr<LoadedModel> describe(const std::string& config_path);
};

// The dtype a config asks for (torch_dtype / dtype), BF16 when it names none.
DType config_dtype(const ModelConfig& config);

}  // namespace plow
