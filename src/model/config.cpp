#include "model/config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <set>

#include "core/error.h"

namespace plow {

namespace {

using nlohmann::json;

// Reads config fields by their Moonshot name or an HF alias, checking type and range, so that every
// error names the file, the field and the offending value.
class FieldReader {
 public:
  FieldReader(const json& object, std::string source, std::string scope)
      : object_(object), source_(std::move(source)), scope_(std::move(scope)) {}

  const json* find(std::initializer_list<const char*> names, std::string* found_name = nullptr) const {
    const json* result = nullptr;
    for (const char* name : names) {
      auto it = object_.find(name);
      if (it == object_.end() || it->is_null()) continue;
      if (result && *result != *it) {
        fail("{}: fields '{}' and '{}' disagree ({} vs {})", source_, qualified(*found_name), qualified(name),
             result->dump(), it->dump());
      }
      if (!result && found_name) *found_name = name;
      if (!result) result = &*it;
    }
    return result;
  }

  int64_t integer(std::initializer_list<const char*> names, std::optional<int64_t> fallback, int64_t min_value) const {
    std::string name = *names.begin();
    const json* value = find(names, &name);
    if (!value) {
      if (fallback) return *fallback;
      fail("{}: required field '{}' is missing", source_, qualified(*names.begin()));
    }
    if (!value->is_number_integer()) fail("{}: field '{}' must be an integer, found {}", source_, qualified(name), value->dump());
    const auto result = value->get<int64_t>();
    if (result < min_value) fail("{}: field '{}' must be >= {}, found {}", source_, qualified(name), min_value, result);
    return result;
  }

  std::optional<int64_t> optional_integer(std::initializer_list<const char*> names, int64_t min_value) const {
    if (!find(names)) return std::nullopt;
    return integer(names, std::nullopt, min_value);
  }

  double number(std::initializer_list<const char*> names, std::optional<double> fallback) const {
    std::string name = *names.begin();
    const json* value = find(names, &name);
    if (!value) {
      if (fallback) return *fallback;
      fail("{}: required field '{}' is missing", source_, qualified(*names.begin()));
    }
    if (!value->is_number()) fail("{}: field '{}' must be a number, found {}", source_, qualified(name), value->dump());
    return value->get<double>();
  }

  bool boolean(std::initializer_list<const char*> names, bool fallback) const {
    std::string name = *names.begin();
    const json* value = find(names, &name);
    if (!value) return fallback;
    if (!value->is_boolean()) fail("{}: field '{}' must be true or false, found {}", source_, qualified(name), value->dump());
    return value->get<bool>();
  }

  std::optional<std::string> string(std::initializer_list<const char*> names) const {
    std::string name = *names.begin();
    const json* value = find(names, &name);
    if (!value) return std::nullopt;
    if (!value->is_string()) fail("{}: field '{}' must be a string, found {}", source_, qualified(name), value->dump());
    return value->get<std::string>();
  }

  std::string qualified(const std::string& name) const { return scope_.empty() ? name : scope_ + "." + name; }
  const std::string& source() const { return source_; }

 private:
  const json& object_;
  std::string source_;
  std::string scope_;
};

// A 1-based layer list from linear_attn_config: integers in 1..L, no duplicates.
std::vector<int64_t> read_layer_list(const json& object, const char* field, int64_t num_layers, const std::string& source) {
  const auto& value = object.at(field);
  if (!value.is_array()) fail("{}: field 'linear_attn_config.{}' must be a list of 1-based layer numbers, found {}", source, field, value.dump());
  std::vector<int64_t> layers;
  for (const auto& entry : value) {
    if (!entry.is_number_integer()) fail("{}: 'linear_attn_config.{}' holds {}, expected integers", source, field, entry.dump());
    const auto layer = entry.get<int64_t>();
    if (layer < 1 || layer > num_layers) {
      fail("{}: 'linear_attn_config.{}' holds layer {}, expected 1-based numbers in 1..{} (num_hidden_layers)", source,
           field, layer, num_layers);
    }
    if (std::find(layers.begin(), layers.end(), layer) != layers.end()) fail("{}: 'linear_attn_config.{}' lists layer {} twice", source, field, layer);
    layers.push_back(layer);
  }
  return layers;
}

std::vector<MixerKind> mixers_from_lists(const json& linear, int64_t num_layers, const std::string& source) {
  const auto kda = read_layer_list(linear, "kda_layers", num_layers, source);
  const auto full = read_layer_list(linear, "full_attn_layers", num_layers, source);
  std::vector<int> seen(static_cast<size_t>(num_layers), 0);
  std::vector<MixerKind> mixers(static_cast<size_t>(num_layers), MixerKind::kKda);
  for (int64_t layer : kda) seen[static_cast<size_t>(layer - 1)] += 1;
  for (int64_t layer : full) {
    if (seen[static_cast<size_t>(layer - 1)]) fail("{}: layer {} (1-based) is in both 'linear_attn_config.kda_layers' and 'full_attn_layers'", source, layer);
    seen[static_cast<size_t>(layer - 1)] += 1;
    mixers[static_cast<size_t>(layer - 1)] = MixerKind::kMla;
  }
  for (int64_t i = 0; i < num_layers; ++i) {
    if (!seen[static_cast<size_t>(i)]) {
      fail("{}: layer {} (1-based) is in neither 'linear_attn_config.kda_layers' nor 'full_attn_layers'; together they must cover 1..{}",
           source, i + 1, num_layers);
    }
  }
  return mixers;
}

template <typename Kind>
std::vector<Kind> kinds_from_strings(const json& value, const char* field, int64_t num_layers, const std::string& source,
                                     const char* first_name, Kind first, const char* second_name, Kind second) {
  if (!value.is_array() || static_cast<int64_t>(value.size()) != num_layers) {
    fail("{}: field '{}' must be a list of {} entries (num_hidden_layers), found {}", source, field, num_layers, value.dump());
  }
  std::vector<Kind> kinds;
  for (const auto& entry : value) {
    if (entry == first_name) kinds.push_back(first);
    else if (entry == second_name) kinds.push_back(second);
    else fail("{}: field '{}' holds {}, expected \"{}\" or \"{}\"", source, field, entry.dump(), first_name, second_name);
  }
  return kinds;
}

void read_schedule(const json& root, const json* linear, ModelConfig& config) {
  const std::string& source = config.source;
  std::optional<std::vector<MixerKind>> from_lists;
  if (linear && linear->contains("kda_layers") && linear->contains("full_attn_layers")) {
    from_lists = mixers_from_lists(*linear, config.num_layers, source);
  } else if (linear && (linear->contains("kda_layers") || linear->contains("full_attn_layers"))) {
    fail("{}: 'linear_attn_config' must give both 'kda_layers' and 'full_attn_layers' (1-based), found only one", source);
  }
  std::optional<std::vector<MixerKind>> explicit_types;
  if (auto it = root.find("layer_types"); it != root.end() && !it->is_null()) {
    explicit_types = kinds_from_strings(*it, "layer_types", config.num_layers, source, "linear_attention", MixerKind::kKda,
                                        "full_attention", MixerKind::kMla);
  }
  if (from_lists && explicit_types && *from_lists != *explicit_types) {
    fail("{}: 'layer_types' contradicts 'linear_attn_config.kda_layers'/'full_attn_layers' (1-based)", source);
  }
  if (!from_lists && !explicit_types) {
    fail("{}: no layer schedule: expected 'linear_attn_config.kda_layers' and 'full_attn_layers' (1-based) or 'layer_types'", source);
  }
  config.mixers = from_lists ? *from_lists : *explicit_types;

  FieldReader fields(root, source, "");
  const int64_t first_dense = fields.integer({"first_k_dense_replace"}, 0, 0);
  const int64_t moe_freq = fields.integer({"moe_layer_freq"}, 1, 1);
  std::vector<FfnKind> derived;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    derived.push_back(i >= first_dense && i % moe_freq == 0 ? FfnKind::kMoe : FfnKind::kDense);
  }
  if (auto it = root.find("mlp_layer_types"); it != root.end() && !it->is_null()) {
    auto explicit_ffns = kinds_from_strings(*it, "mlp_layer_types", config.num_layers, source, "dense", FfnKind::kDense,
                                            "sparse", FfnKind::kMoe);
    if (root.contains("first_k_dense_replace") && explicit_ffns != derived) {
      fail("{}: 'mlp_layer_types' contradicts 'first_k_dense_replace'={} / 'moe_layer_freq'={}", source, first_dense, moe_freq);
    }
    config.ffns = explicit_ffns;
  } else {
    config.ffns = derived;
  }
}

void read_token_ids(const FieldReader& fields, const json& root, ModelConfig& config) {
  config.bos_token_id = fields.optional_integer({"bos_token_id"}, 0);
  config.pad_token_id = fields.optional_integer({"pad_token_id"}, 0);
  if (auto it = root.find("eos_token_id"); it != root.end() && !it->is_null()) {
    if (it->is_number_integer()) {
      config.eos_token_ids.push_back(it->get<int64_t>());
    } else if (it->is_array() && std::all_of(it->begin(), it->end(), [](const json& e) { return e.is_number_integer(); })) {
      for (const auto& e : *it) config.eos_token_ids.push_back(e.get<int64_t>());
    } else {
      fail("{}: field 'eos_token_id' must be an integer or a list of integers, found {}", config.source, it->dump());
    }
  }
}

}  // namespace

int64_t ModelConfig::num_layers_of(MixerKind kind) const {
  return std::count(mixers.begin(), mixers.end(), kind);
}

ModelConfig parse_model_config(const json& root, const std::string& source) {
  if (!root.is_object()) fail("{}: expected a JSON object at the top level", source);
  ModelConfig config;
  config.source = source;
  FieldReader fields(root, source, "");
  config.model_type = fields.string({"model_type"}).value_or("");
  if (config.model_type != "kimi_linear") {
    fail("{}: field 'model_type' is \"{}\", expected \"kimi_linear\"", source, config.model_type);
  }
  config.torch_dtype = fields.string({"torch_dtype", "dtype"});

  config.vocab_size = fields.integer({"vocab_size"}, std::nullopt, 1);
  config.hidden_size = fields.integer({"hidden_size"}, std::nullopt, 1);
  config.num_layers = fields.integer({"num_hidden_layers"}, std::nullopt, 1);
  config.intermediate_size = fields.integer({"intermediate_size"}, std::nullopt, 1);
  config.rms_norm_eps = static_cast<float>(fields.number({"rms_norm_eps"}, 1e-5));
  if (!(config.rms_norm_eps > 0)) fail("{}: field 'rms_norm_eps' must be > 0, found {}", source, config.rms_norm_eps);
  config.tie_word_embeddings = fields.boolean({"tie_word_embeddings"}, false);
  config.hidden_act = fields.string({"hidden_act"}).value_or("silu");
  if (config.hidden_act != "silu") fail("{}: field 'hidden_act' is \"{}\", expected \"silu\"", source, config.hidden_act);

  config.moe_intermediate_size = fields.integer({"moe_intermediate_size"}, std::nullopt, 1);
  config.num_experts = fields.integer({"num_experts", "num_local_experts"}, std::nullopt, 1);
  config.experts_per_token = fields.integer({"num_experts_per_token", "num_experts_per_tok"}, std::nullopt, 1);
  config.num_shared_experts = fields.integer({"num_shared_experts", "n_shared_experts"}, 0, 0);
  const std::string router = fields.string({"moe_router_activation_func"}).value_or("sigmoid");
  if (router == "sigmoid") config.router_activation = RouterActivation::kSigmoid;
  else if (router == "softmax") config.router_activation = RouterActivation::kSoftmax;
  else fail("{}: field 'moe_router_activation_func' is \"{}\", expected \"sigmoid\" or \"softmax\"", source, router);
  config.moe_renormalize = fields.boolean({"moe_renormalize", "norm_topk_prob"}, true);
  config.routed_scaling_factor = static_cast<float>(fields.number({"routed_scaling_factor"}, 1.0));
  config.num_expert_group = fields.integer({"num_expert_group", "n_group"}, 1, 1);
  config.topk_group = fields.integer({"topk_group"}, config.num_expert_group, 1);
  if (config.experts_per_token > config.num_experts) {
    fail("{}: 'num_experts_per_token'={} exceeds 'num_experts'={}", source, config.experts_per_token, config.num_experts);
  }
  if (config.num_experts % config.num_expert_group != 0) {
    fail("{}: 'num_experts'={} is not divisible by 'num_expert_group'={}", source, config.num_experts, config.num_expert_group);
  }
  if (config.topk_group > config.num_expert_group) {
    fail("{}: 'topk_group'={} exceeds 'num_expert_group'={}", source, config.topk_group, config.num_expert_group);
  }
  if (config.experts_per_token > config.topk_group * (config.num_experts / config.num_expert_group)) {
    fail("{}: 'num_experts_per_token'={} exceeds the experts in the kept groups ({} groups of {})", source,
         config.experts_per_token, config.topk_group, config.num_experts / config.num_expert_group);
  }

  config.num_attention_heads = fields.integer({"num_attention_heads"}, std::nullopt, 1);
  const int64_t kv_heads = fields.integer({"num_key_value_heads"}, config.num_attention_heads, 1);
  if (kv_heads != config.num_attention_heads) {
    fail("{}: 'num_key_value_heads'={} must equal 'num_attention_heads'={} (MLA)", source, kv_heads, config.num_attention_heads);
  }
  config.q_lora_rank = fields.optional_integer({"q_lora_rank"}, 1);
  config.kv_lora_rank = fields.integer({"kv_lora_rank"}, std::nullopt, 1);
  config.qk_nope_head_dim = fields.integer({"qk_nope_head_dim"}, std::nullopt, 1);
  config.qk_rope_head_dim = fields.integer({"qk_rope_head_dim"}, std::nullopt, 0);
  config.v_head_dim = fields.integer({"v_head_dim"}, std::nullopt, 1);
  if (!fields.boolean({"mla_use_nope"}, true)) {
    fail("{}: 'mla_use_nope' is false; plow implements the NoPE MLA of Kimi Linear only (expected true)", source);
  }

  const json* linear = nullptr;
  if (auto it = root.find("linear_attn_config"); it != root.end() && !it->is_null()) {
    if (!it->is_object()) fail("{}: field 'linear_attn_config' must be an object, found {}", source, it->dump());
    linear = &*it;
  }
  // KDA sizes: linear_attn_config.{num_heads,head_dim,short_conv_kernel_size} or HF's flat aliases.
  const json empty = json::object();
  FieldReader linear_fields(linear ? *linear : empty, source, "linear_attn_config");
  auto kda_field = [&](const char* nested, const char* flat) {
    auto nested_value = linear_fields.optional_integer({nested}, 1);
    auto flat_value = fields.optional_integer({flat}, 1);
    if (nested_value && flat_value && *nested_value != *flat_value) {
      fail("{}: 'linear_attn_config.{}'={} disagrees with '{}'={}", source, nested, *nested_value, flat, *flat_value);
    }
    if (!nested_value && !flat_value) fail("{}: required field 'linear_attn_config.{}' is missing", source, nested);
    return nested_value ? *nested_value : *flat_value;
  };
  config.kda.num_heads = kda_field("num_heads", "linear_num_heads");
  config.kda.head_dim = kda_field("head_dim", "linear_head_dim");
  config.kda.conv_kernel = kda_field("short_conv_kernel_size", "linear_conv_kernel_dim");

  read_schedule(root, linear, config);
  read_token_ids(fields, root, config);
  return config;
}

ModelConfig load_model_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("cannot open config file '{}'", path);
  json root;
  try {
    root = json::parse(in);
  } catch (const json::parse_error& e) {
    fail("{}: malformed JSON: {}", path, e.what());
  }
  return parse_model_config(root, path);
}

}  // namespace plow
