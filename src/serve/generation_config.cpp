#include "serve/generation_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace plow {

namespace {

using nlohmann::json;

double number_field(const json& config, const std::string& path, const char* name, double lo, double hi, double fallback) {
  auto it = config.find(name);
  if (it == config.end() || it->is_null()) return fallback;
  if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < lo || it->get<double>() > hi) {
    fail("{}: field '{}' must be a number in [{}, {}], found {}", path, name, lo, hi, it->dump());
  }
  return it->get<double>();
}

}  // namespace

void apply_generation_config(const std::string& model_dir, ServedModel& model) {
  const std::filesystem::path file = std::filesystem::path(model_dir) / "generation_config.json";
  if (!std::filesystem::exists(file)) return;
  const std::string path = file.string();
  std::ifstream in(file);
  const json config = json::parse(in, nullptr, false);
  if (config.is_discarded() || !config.is_object()) fail("{}: not a JSON object", path);
  SamplingParams& d = model.sampling_defaults;
  d.temperature = static_cast<float>(number_field(config, path, "temperature", 0.0, 2.0, d.temperature));
  d.top_p = static_cast<float>(number_field(config, path, "top_p", 1e-9, 1.0, d.top_p));
  d.min_p = static_cast<float>(number_field(config, path, "min_p", 0.0, 1.0, d.min_p));
  d.repetition_penalty = static_cast<float>(number_field(config, path, "repetition_penalty", 0.01, 10.0, d.repetition_penalty));
  if (auto it = config.find("top_k"); it != config.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0) fail("{}: field 'top_k' must be an integer >= 0, found {}", path, it->dump());
    d.top_k = it->get<int64_t>();
  }
  if (auto it = config.find("eos_token_id"); it != config.end() && !it->is_null()) {
    const json ids = it->is_array() ? *it : json::array({*it});
    for (const json& id : ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= model.vocab_size) {
        fail("{}: field 'eos_token_id' must hold ids in [0, {}), found {}", path, model.vocab_size, id.dump());
      }
      const auto eos = id.get<int32_t>();
      if (std::find(model.eos_ids.begin(), model.eos_ids.end(), eos) == model.eos_ids.end()) model.eos_ids.push_back(eos);
    }
  }
}

}  // namespace plow
