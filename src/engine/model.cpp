#include "engine/model.h"

#include <filesystem>

#include "core/error.h"
#include "graph/models/registry.h"

namespace plow {

std::unique_ptr<LoadedModel> LoadedModel::load(const std::string& model_dir) {
  if (!std::filesystem::is_directory(model_dir)) fail("model directory '{}' does not exist", model_dir);
  auto model = std::make_unique<LoadedModel>(LoadedModel{
      load_model_config((std::filesystem::path(model_dir) / "config.json").string()), Checkpoint::open(model_dir), Graph{}, nullptr});
  model->graph = build_model_graph(model->config);
  model->weights = std::make_unique<BoundWeights>(model->graph, model->checkpoint);
  return model;
}

}  // namespace plow
