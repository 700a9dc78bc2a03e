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
std::vector<int64_t> read_layer_list(const json& object, const char* field, int64_t num_layers, const std::string& source,
                                     const std::string& scope) {
  const auto& value = object.at(field);
  if (!value.is_array()) fail("{}: field '{}linear_attn_config.{}' must be a list of 1-based layer numbers, found {}", source, scope, field, value.dump());
  std::vector<int64_t> layers;
  for (const auto& entry : value) {
    if (!entry.is_number_integer()) fail("{}: '{}linear_attn_config.{}' holds {}, expected integers", source, scope, field, entry.dump());
    const auto layer = entry.get<int64_t>();
    if (layer < 1 || layer > num_layers) {
      fail("{}: '{}linear_attn_config.{}' holds layer {}, expected 1-based numbers in 1..{} (num_hidden_layers)", source,
           scope, field, layer, num_layers);
    }
    if (std::find(layers.begin(), layers.end(), layer) != layers.end()) fail("{}: '{}linear_attn_config.{}' lists layer {} twice", source, scope, field, layer);
    layers.push_back(layer);
  }
  return layers;
}

std::vector<MixerKind> mixers_from_lists(const json& linear, int64_t num_layers, const std::string& source,
                                         const std::string& scope) {
  const auto kda = read_layer_list(linear, "kda_layers", num_layers, source, scope);
  const auto full = read_layer_list(linear, "full_attn_layers", num_layers, source, scope);
  std::vector<int> seen(static_cast<size_t>(num_layers), 0);
  std::vector<MixerKind> mixers(static_cast<size_t>(num_layers), MixerKind::kKda);
  for (int64_t layer : kda) seen[static_cast<size_t>(layer - 1)] += 1;
  for (int64_t layer : full) {
    if (seen[static_cast<size_t>(layer - 1)]) fail("{}: layer {} (1-based) is in both '{}linear_attn_config.kda_layers' and 'full_attn_layers'", source, layer, scope);
    seen[static_cast<size_t>(layer - 1)] += 1;
    mixers[static_cast<size_t>(layer - 1)] = MixerKind::kMla;
  }
  for (int64_t i = 0; i < num_layers; ++i) {
    if (!seen[static_cast<size_t>(i)]) {
      fail("{}: layer {} (1-based) is in neither '{}linear_attn_config.kda_layers' nor 'full_attn_layers'; together they must cover 1..{}",
           source, i + 1, scope, num_layers);
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

void read_schedule(const json& root, const json* linear, const std::string& scope, ModelConfig& config) {
  const std::string& source = config.source;
  std::optional<std::vector<MixerKind>> from_lists;
  if (linear && linear->contains("kda_layers") && linear->contains("full_attn_layers")) {
    from_lists = mixers_from_lists(*linear, config.num_layers, source, scope);
  } else if (linear && (linear->contains("kda_layers") || linear->contains("full_attn_layers"))) {
    fail("{}: '{}linear_attn_config' must give both 'kda_layers' and 'full_attn_layers' (1-based), found only one", source, scope);
  }
  std::optional<std::vector<MixerKind>> explicit_types;
  if (auto it = root.find("layer_types"); it != root.end() && !it->is_null()) {
    explicit_types = kinds_from_strings(*it, (scope + "layer_types").c_str(), config.num_layers, source, "linear_attention", MixerKind::kKda,
                                        "full_attention", MixerKind::kMla);
  }
  if (from_lists && explicit_types && *from_lists != *explicit_types) {
    fail("{}: '{}layer_types' contradicts 'linear_attn_config.kda_layers'/'full_attn_layers' (1-based)", source, scope);
  }
  if (!from_lists && !explicit_types) {
    fail("{}: no layer schedule: expected '{}linear_attn_config.kda_layers' and 'full_attn_layers' (1-based) or 'layer_types'", source, scope);
  }
  config.mixers = from_lists ? *from_lists : *explicit_types;

  FieldReader fields(root, source, scope.empty() ? "" : scope.substr(0, scope.size() - 1));
  const int64_t first_dense = fields.integer({"first_k_dense_replace"}, 1, 0);  // HF's default when absent
  const int64_t moe_freq = fields.integer({"moe_layer_freq"}, 1, 1);
  std::vector<FfnKind> derived;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    derived.push_back(i >= first_dense && i % moe_freq == 0 ? FfnKind::kMoe : FfnKind::kDense);
  }
  if (auto it = root.find("mlp_layer_types"); it != root.end() && !it->is_null()) {
    auto explicit_ffns = kinds_from_strings(*it, (scope + "mlp_layer_types").c_str(), config.num_layers, source, "dense", FfnKind::kDense,
                                            "sparse", FfnKind::kMoe);
    if (root.contains("first_k_dense_replace") && explicit_ffns != derived) {
      fail("{}: '{}mlp_layer_types' contradicts 'first_k_dense_replace'={} / 'moe_layer_freq'={}", source, scope, first_dense, moe_freq);
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

namespace {

// K3 fields of the text config (§7.1); all absent for Kimi Linear.
void read_k3_fields(const json& root, const FieldReader& fields, const FieldReader& linear_fields, ModelConfig& config) {
  const std::string& source = config.source;
  const std::string act = fields.string({"hidden_act"}).value_or("silu");
  if (act == "silu") config.activation = FfnActivation::kSilu;
  else if (act == "situ") config.activation = FfnActivation::kSitu;
  else fail("{}: field '{}' is \"{}\", expected \"silu\" or \"situ\"", source, fields.qualified("hidden_act"), act);
  config.situ.beta = static_cast<float>(fields.number({"activation_situ_beta"}, 4.0));
  if (auto it = root.find("activation_situ_linear_beta"); it != root.end() && it->is_null()) {
    config.situ.linear_beta.reset();  // explicit null: the up branch is b (§7.6)
  } else {
    config.situ.linear_beta = static_cast<float>(fields.number({"activation_situ_linear_beta"}, 25.0));
  }
  if (!(config.situ.beta > 0) || (config.situ.linear_beta && !(*config.situ.linear_beta > 0))) {
    fail("{}: SiTU betas must be > 0, found {} / {}", source, config.situ.beta, config.situ.linear_beta.value_or(0.0f));
  }
  config.mla_output_gate = fields.boolean({"mla_use_output_gate", "mla_output_gate"}, false);
  config.latent_moe_size = fields.optional_integer({"routed_expert_hidden_size", "moe_latent_size"}, 1);
  config.latent_moe_norm = fields.boolean({"latent_moe_use_norm"}, false);
  if (config.latent_moe_norm && !config.latent_moe_size) {
    fail("{}: '{}' is true but no latent width ('{}') is given", source, fields.qualified("latent_moe_use_norm"),
         fields.qualified("routed_expert_hidden_size"));
  }
  config.attn_res_block_size = fields.optional_integer({"attn_res_block_size"}, 1);
  if (auto bound = linear_fields.find({"gate_lower_bound"})) {
    if (!bound->is_number() || !(bound->get<double>() < 0)) {
      fail("{}: field '{}' must be a negative number, found {}", source, linear_fields.qualified("gate_lower_bound"), bound->dump());
    }
    config.kda.gate_lower_bound = bound->get<float>();
  }
  config.kda.full_rank_gate = linear_fields.boolean({"use_full_rank_gate"}, false);
  if (auto format = fields.string({"expert_weight_format"})) {
    if (*format != "mxfp4") fail("{}: field '{}' is \"{}\", expected \"mxfp4\"", source, fields.qualified("expert_weight_format"), *format);
    config.experts_mxfp4 = true;
  }
}

// quantization_config: only compressed-tensors MXFP4 (4 bits, group 32) on the routed experts.
void read_quantization(const json& quant, const std::string& where, ModelConfig& config) {
  const std::string& source = config.source;
  if (!quant.is_object()) fail("{}: field '{}' must be an object", source, where);
  const std::string method = quant.value("quant_method", "");
  const std::string format = quant.value("format", "");
  if (method != "compressed-tensors" || format != "mxfp4-pack-quantized") {
    fail("{}: '{}' has quant_method \"{}\" / format \"{}\", expected \"compressed-tensors\" / \"mxfp4-pack-quantized\"", source,
         where, method, format);
  }
  if (auto groups = quant.find("config_groups"); groups != quant.end() && groups->is_object()) {
    for (const auto& [name, group] : groups->items()) {
      const json weights = group.value("weights", json::object());
      const auto bits = weights.value("num_bits", 4);
      const auto group_size = weights.value("group_size", 32);
      if (bits != 4 || group_size != 32) {
        fail("{}: '{}.config_groups.{}.weights' has num_bits {} / group_size {}, expected 4 / 32 (MXFP4)", source, where, name, bits, group_size);
      }
    }
  }
  config.experts_mxfp4 = true;
}

void parse_text_config(const json& root, const std::string& scope, ModelConfig& config) {
  const std::string& source = config.source;
  if (!root.is_object()) fail("{}: '{}' must be a JSON object", source, scope.empty() ? "top level" : scope.substr(0, scope.size() - 1));
  FieldReader fields(root, source, scope.empty() ? "" : scope.substr(0, scope.size() - 1));
  config.model_type = fields.string({"model_type"}).value_or(scope.empty() ? "" : "kimi_linear");
  if (config.model_type != "kimi_linear") {
    fail("{}: field '{}' is \"{}\", expected \"kimi_linear\" (or \"kimi_k3\" with a text_config)", source,
         fields.qualified("model_type"), config.model_type);
  }
  config.torch_dtype = fields.string({"torch_dtype", "dtype"});

  config.vocab_size = fields.integer({"vocab_size"}, std::nullopt, 1);
  config.hidden_size = fields.integer({"hidden_size"}, std::nullopt, 1);
  config.num_layers = fields.integer({"num_hidden_layers"}, std::nullopt, 1);
  config.intermediate_size = fields.integer({"intermediate_size"}, std::nullopt, 1);
  config.rms_norm_eps = static_cast<float>(fields.number({"rms_norm_eps"}, 1e-5));
  if (!(config.rms_norm_eps > 0)) fail("{}: field 'rms_norm_eps' must be > 0, found {}", source, config.rms_norm_eps);
  config.tie_word_embeddings = fields.boolean({"tie_word_embeddings"}, false);

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
  FieldReader linear_fields(linear ? *linear : empty, source, scope + "linear_attn_config");
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

  read_k3_fields(root, fields, linear_fields, config);
  read_schedule(root, linear, scope, config);
  read_token_ids(fields, root, config);
}

}  // namespace

ModelConfig parse_model_config(const json& root, const std::string& source) {
  if (!root.is_object()) fail("{}: expected a JSON object at the top level", source);
  ModelConfig config;
  config.source = source;
  const json* quant = nullptr;
  std::string quant_where = "quantization_config";
  if (root.value("model_type", "") == "kimi_k3") {
    // K3: a multimodal wrapper around a kimi_linear text model; text tensors carry "language_model." (§7.1)
    const auto text = root.find("text_config");
    if (text == root.end()) fail("{}: model_type \"kimi_k3\" needs a 'text_config' object", source);
    config.wrapper_type = "kimi_k3";
    config.tensor_prefix = "language_model.";
    parse_text_config(*text, "text_config.", config);
    if (auto it = root.find("quantization_config"); it != root.end() && !it->is_null()) {
      quant = &*it;
    } else if (auto inner = text->find("quantization_config"); inner != text->end() && !inner->is_null()) {
      quant = &*inner;
      quant_where = "text_config.quantization_config";
    }
  } else {
    parse_text_config(root, "", config);
    if (auto it = root.find("quantization_config"); it != root.end() && !it->is_null()) quant = &*it;
  }
  if (quant) read_quantization(*quant, quant_where, config);
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
