// plow: one binary, subcommands. Every user-facing failure prints one line "plow: error: …" to
// stderr and exits non-zero; nothing is printed on stdout in that case.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <map>

#include "core/error.h"
#include "core/npy.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "runtime/cpu/reference.h"

namespace {

using nlohmann::json;
using namespace plow;

struct GenerateArgs {
  std::string model_dir;
  std::vector<int64_t> prompt_ids;
  std::string prompt_text;
  int64_t max_new_tokens = 16;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int64_t top_k = 0;
  uint64_t seed = 0;
  std::string backend = "cpu";
  std::string dtype = "auto";
  int64_t prefill_chunk = 0;
  bool ignore_eos = false;
  std::string dump_logits;
};

DType compute_dtype(const std::string& name, const LoadedModel& model) {
  if (name == "auto") return model.weights->storage_dtype();
  if (name == "f32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  if (name == "f16") return DType::F16;
  fail("--dtype '{}': expected auto, f32, bf16 or f16", name);
}

int run_generate(const GenerateArgs& args) {
  if (args.backend != "cpu") fail("--backend '{}': this build has the 'cpu' backend only", args.backend);
  if (!args.prompt_text.empty()) fail("--prompt: text prompts need the model's tokenizer, which plow does not load yet; use --prompt-ids");
  if (args.prompt_ids.empty()) fail("one of --prompt-ids or --prompt is required");
  if (args.max_new_tokens < 1) fail("--max-new-tokens must be >= 1, found {}", args.max_new_tokens);
  if (args.temperature < 0) fail("--temperature must be >= 0, found {}", args.temperature);
  if (!(args.top_p > 0 && args.top_p <= 1)) fail("--top-p must be in (0, 1], found {}", args.top_p);
  if (args.top_k < 0) fail("--top-k must be >= 0, found {}", args.top_k);
  if (args.prefill_chunk < 0) fail("--prefill-chunk must be >= 0, found {}", args.prefill_chunk);

  auto model = LoadedModel::load(args.model_dir);
  GenerateOptions options;
  for (size_t i = 0; i < args.prompt_ids.size(); ++i) {
    const int64_t id = args.prompt_ids[i];
    if (id < 0 || id >= model->config.vocab_size) {
      fail("--prompt-ids: id {} at position {} is outside the vocabulary (vocab_size {} in {})", id, i, model->config.vocab_size,
           model->config.source);
    }
    options.prompt.push_back(static_cast<int32_t>(id));
  }
  options.max_new_tokens = args.max_new_tokens;
  options.sampling = {args.temperature, args.top_p, args.top_k, args.seed};
  options.prefill_chunk_tokens = args.prefill_chunk;
  options.keep_logits = !args.dump_logits.empty();
  if (!args.ignore_eos) options.stop_ids = model->config.eos_token_ids;

  ReferenceBackend backend(model->graph, *model->weights, compute_dtype(args.dtype, *model), 1);
  const GenerateResult result = generate(backend, 0, options);
  if (options.keep_logits) {
    const auto rows = static_cast<int64_t>(result.logits.size()) / result.vocab;
    write_npy_f32(args.dump_logits, result.logits.data(), {rows, result.vocab});
  }
  const double decode_steps = static_cast<double>(result.generated.size()) - 1.0;
  json out = {{"generated_ids", result.generated},
              {"prompt_tokens", options.prompt.size()},
              {"backend", args.backend},
              {"dtype", std::string(dtype_name(backend.act_dtype()))},
              {"prefill_seconds", result.prefill_seconds},
              {"decode_tokens_per_second", decode_steps > 0 ? decode_steps / result.decode_seconds : 0.0}};
  std::cout << out.dump() << std::endl;
  return 0;
}

int run_inspect(const std::string& model_dir) {
  auto model = LoadedModel::load(model_dir);
  const ModelConfig& c = model->config;
  json schedule = json::array();
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const auto at = static_cast<size_t>(i);
    schedule.push_back(std::string(c.mixers[at] == MixerKind::kKda ? "kda" : "mla") + "+" + (c.ffns[at] == FfnKind::kMoe ? "moe" : "dense"));
  }
  int64_t parameters = 0;
  std::map<std::string, int64_t> bytes_by_dtype;
  for (const auto& [name, view] : model->checkpoint.tensors()) {
    parameters += view->numel();
    bytes_by_dtype[std::string(dtype_name(view->dtype))] += static_cast<int64_t>(view->nbytes);
  }
  json out = {{"model_type", c.model_type},
              {"vocab_size", c.vocab_size},
              {"hidden_size", c.hidden_size},
              {"num_layers", c.num_layers},
              {"kda_layers", c.num_layers_of(MixerKind::kKda)},
              {"mla_layers", c.num_layers_of(MixerKind::kMla)},
              {"kda", {{"heads", c.kda.num_heads}, {"head_dim", c.kda.head_dim}, {"conv_kernel", c.kda.conv_kernel}}},
              {"mla", {{"heads", c.num_attention_heads}, {"q_lora_rank", c.q_lora_rank ? json(*c.q_lora_rank) : json(nullptr)},
                       {"kv_lora_rank", c.kv_lora_rank}, {"qk_nope_head_dim", c.qk_nope_head_dim},
                       {"qk_rope_head_dim", c.qk_rope_head_dim}, {"v_head_dim", c.v_head_dim}}},
              {"moe", {{"experts", c.num_experts}, {"experts_per_token", c.experts_per_token},
                       {"shared_experts", c.num_shared_experts}, {"intermediate_size", c.moe_intermediate_size},
                       {"groups", c.num_expert_group}, {"topk_group", c.topk_group}, {"renormalize", c.moe_renormalize},
                       {"routed_scaling_factor", c.routed_scaling_factor}}},
              {"tie_word_embeddings", c.tie_word_embeddings},
              {"layer_schedule", schedule},
              {"tensors", model->checkpoint.tensors().size()},
              {"graph_nodes", model->graph.nodes().size()},
              {"parameters", parameters},
              {"bytes_by_dtype", bytes_by_dtype}};
  std::cout << out.dump(2) << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"plow: compiled inference engine for Kimi Linear / K3 hybrid MoE models"};
  app.require_subcommand(1);

  GenerateArgs gen;
  CLI::App* generate_cmd = app.add_subcommand("generate", "generate tokens from a prompt");
  generate_cmd->add_option("--model", gen.model_dir, "model directory (config.json + safetensors)")->required();
  auto* ids_opt = generate_cmd->add_option("--prompt-ids", gen.prompt_ids, "comma-separated prompt token ids")->delimiter(',');
  generate_cmd->add_option("--prompt", gen.prompt_text, "prompt text (needs the model's tokenizer)")->excludes(ids_opt);
  generate_cmd->add_option("--max-new-tokens", gen.max_new_tokens, "tokens to generate");
  generate_cmd->add_option("--temperature", gen.temperature, "0 = greedy");
  generate_cmd->add_option("--top-p", gen.top_p);
  generate_cmd->add_option("--top-k", gen.top_k, "0 = no limit");
  generate_cmd->add_option("--seed", gen.seed);
  generate_cmd->add_option("--backend", gen.backend, "cpu");
  generate_cmd->add_option("--dtype", gen.dtype, "activation precision: auto (the weights' dtype), f32, bf16, f16");
  generate_cmd->add_option("--prefill-chunk", gen.prefill_chunk, "split the prompt into steps of this many tokens (0 = one step)");
  generate_cmd->add_flag("--ignore-eos", gen.ignore_eos, "do not stop at the config's eos_token_id");
  generate_cmd->add_option("--dump-logits", gen.dump_logits, "write [P+N-1, vocab] float32 logits to this .npy file");

  std::string inspect_dir;
  CLI::App* inspect_cmd = app.add_subcommand("inspect", "print a model's configuration, schedule and sizes as JSON");
  inspect_cmd->add_option("--model", inspect_dir, "model directory")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (generate_cmd->parsed()) return run_generate(gen);
    if (inspect_cmd->parsed()) return run_inspect(inspect_dir);
  } catch (const plow::Error& e) {
    std::fprintf(stderr, "plow: error: %s\n", e.what());
    return 1;
  } catch (const plow::InternalError& e) {
    std::fprintf(stderr, "plow: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "plow: error: %s\n", e.what());
    return 1;
  }
  return 1;
}
