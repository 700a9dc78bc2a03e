#include "engine/model.h"

#include <filesystem>

#include "core/error.h"
#include "graph/models/registry.h"
#include "graph/random_weights.h"

namespace plow {

std::unique_ptr<LoadedModel> LoadedModel::load(const std::string& model_dir, TpShard shard) {
  if (!std::filesystem::is_directory(model_dir)) fail("model directory '{}' does not exist", model_dir);
  auto model = describe((std::filesystem::path(model_dir) / "config.json").string(), shard);
  model->checkpoint.emplace(Checkpoint::open(model_dir));
  model->weights = std::make_unique<BoundWeights>(model->graph, *model->checkpoint, model->config.tensor_prefix);
  return model;
}

std::unique_ptr<LoadedModel> LoadedModel::random(const std::string& config_path, uint64_t seed, DType dtype, TpShard shard) {
  auto model = describe(config_path, shard);
  const Graph whole = shard.size > 1 ? build_model_graph(model->config) : Graph{};
  model->checkpoint.emplace(random_checkpoint(shard.size > 1 ? whole : model->graph, seed, dtype, config_path + " (random weights)"));
  model->weights = std::make_unique<BoundWeights>(model->graph, *model->checkpoint, model->config.tensor_prefix);
  return model;
}

std::unique_ptr<LoadedModel> LoadedModel::describe(const std::string& config_path, TpShard shard) {
  auto model = std::make_unique<LoadedModel>();
  model->config = load_model_config(config_path);
  model->shard = shard;
  model->graph = build_model_graph(model->config, shard);
  return model;
}

DType config_dtype(const ModelConfig& config) {
  const std::string name = config.torch_dtype.value_or("bfloat16");
  if (name == "bfloat16") return DType::BF16;
  if (name == "float32") return DType::F32;
  if (name == "float16") return DType::F16;
  fail("{}: field 'torch_dtype' is \"{}\", expected \"bfloat16\", \"float32\" or \"float16\"", config.source, name);
}

}  // namespace plow
