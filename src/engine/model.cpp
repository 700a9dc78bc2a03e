#include "engine/model.h"

#include <filesystem>

#include "core/error.h"
#include "graph/models/registry.h"
#include "graph/random_weights.h"

namespace plow {

std::unique_ptr<LoadedModel> LoadedModel::load(const std::string& model_dir) {
  if (!std::filesystem::is_directory(model_dir)) fail("model directory '{}' does not exist", model_dir);
  auto model = describe((std::filesystem::path(model_dir) / "config.json").string());
  model->checkpoint.emplace(Checkpoint::open(model_dir));
  model->weights = std::make_unique<BoundWeights>(model->graph, *model->checkpoint, model->config.tensor_prefix);
  return model;
}

std::unique_ptr<LoadedModel> LoadedModel::random(const std::string& config_path, uint64_t seed, DType dtype) {
  auto model = describe(config_path);
  model->checkpoint.emplace(random_checkpoint(model->graph, seed, dtype, config_path + " (random weights)"));
  model->weights = std::make_unique<BoundWeights>(model->graph, *model->checkpoint, model->config.tensor_prefix);
  return model;
}

std::unique_ptr<LoadedModel> LoadedModel::describe(const std::string& config_path) {
  auto model = std::make_unique<LoadedModel>();
  model->config = load_model_config(config_path);
  model->graph = build_model_graph(model->config);
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
