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

  TpShard shard;                          // the tensor-parallel rank this graph and these weights are for

  // With a shard of a group of more than one: that rank's graph, bound to its blocks of the weights.
  static std::unique_ptr<LoadedModel> load(const std::string& model_dir, TpShard shard = {});
  // Weights drawn from `seed` in `dtype` (F32/BF16/F16) for every tensor of the whole model (so every
  // rank of a group cuts its blocks out of the same model).
  static std::unique_ptr<LoadedModel> random(const std::string& config_path, uint64_t seed, DType dtype, TpShard shard = {});
  // Config and graph only (for sizes of models too large to materialize here).
  static std::unique_ptr<LoadedModel> describe(const std::string& config_path, TpShard shard = {});
};

// The dtype a config asks for (torch_dtype / dtype), BF16 when it names none.
DType config_dtype(const ModelConfig& config);

}  // namespace plow
