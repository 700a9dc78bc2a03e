// plow: one binary, subcommands. Every user-facing failure prints one line "plow: error: …" to
// stderr and exits non-zero; nothing is printed on stdout in that case.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <thread>

#include "cmd_eval_ppl.h"
#include "core/error.h"
#include "core/npy.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/plans.h"
#include "engine/tensor_parallel.h"
#include "graph/footprint.h"
#include "serve/server.h"
#include "serve/tokenizer.h"
#include "plan/lower.h"
#include "plan/summary.h"
#include "plan/validate.h"
#include "plan/wire.h"
#include "runtime/cpu/interpreter.h"
#include "runtime/cpu/reference.h"
#include "tools/cuda_commands.h"
#include "subcommands.h"

namespace {

using nlohmann::json;
using namespace plow;

// Where the model comes from: a checkpoint directory, or a config with random weights.
struct ModelSource {
  std::string model_dir;
  std::string config_path;
  bool random_weights = false;
  uint64_t seed = 0;
  std::string dtype = "auto";

  void add_options(CLI::App* cmd) {
    auto* dir = cmd->add_option("--model", model_dir, "model directory (config.json + safetensors)");
    auto* config = cmd->add_option("--config", config_path, "config.json of a model to build without a checkpoint")->excludes(dir);
    cmd->add_flag("--random-weights", random_weights, "with --config: draw every weight from --seed at load")->needs(config);
    cmd->add_option("--dtype", dtype, "weights/activations: auto (the checkpoint's or config's dtype), f32, bf16, f16");
  }
};

DType parse_dtype(const std::string& name) {
  if (name == "f32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  if (name == "f16") return DType::F16;
  fail("--dtype '{}': expected auto, f32, bf16 or f16", name);
}

std::unique_ptr<LoadedModel> load_model(const ModelSource& source) {
  if (!source.model_dir.empty()) return LoadedModel::load(source.model_dir);
  if (source.config_path.empty()) fail("one of --model DIR or --config FILE is required");
  if (!source.random_weights) fail("--config {} needs --random-weights (there is no checkpoint to read)", source.config_path);
  const auto described = LoadedModel::describe(source.config_path);
  const DType dtype = source.dtype == "auto" ? config_dtype(described->config) : parse_dtype(source.dtype);
  return LoadedModel::random(source.config_path, source.seed, dtype);
}

// Config and graph only: lowering needs no weights (--random-weights is accepted and unused).
std::unique_ptr<LoadedModel> describe_model(const ModelSource& source) {
  if (!source.model_dir.empty()) return LoadedModel::describe((std::filesystem::path(source.model_dir) / "config.json").string());
  if (source.config_path.empty()) fail("one of --model DIR or --config FILE is required");
  return LoadedModel::describe(source.config_path);
}

int default_workers() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }


struct GenerateArgs {
  ModelSource source;
  std::vector<int64_t> prompt_ids;
  std::string prompt_text;
  int64_t max_new_tokens = 16;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int64_t top_k = 0;
  std::string backend = "cpu";
  int workers = 0;                      // cpu-plan: 0 = the plans' worker count, or one per core
  bool no_fusion = false;               // cpu-plan: lower the graph as built
  std::vector<std::string> plan_files;  // cpu-plan: precompiled plans (else compiled here)
  int64_t prefill_chunk = 0;
  bool ignore_eos = false;
  std::string dump_logits;
};

DType compute_dtype(const std::string& name, const LoadedModel& model) {
  return name == "auto" ? model.weights->storage_dtype() : parse_dtype(name);
}

// --backend cpu-plan: the given plans (without --prefill-chunk, the prompt is split by the largest
// prefill bucket among them), or a decode plan for bucket 1 and a prefill plan for the prompt's chunk
// compiled here.
std::unique_ptr<Backend> make_plan_backend(const GenerateArgs& args, const LoadedModel& model, GenerateOptions& options, DType act) {
  const auto prompt_tokens = static_cast<int64_t>(options.prompt.size());
  const int64_t max_context = prompt_tokens + options.max_new_tokens;
  std::vector<Plan> plans;
  int workers = args.workers;
  for (const std::string& path : args.plan_files) {
    plans.push_back(read_plan(path));
    if (args.workers == 0) workers = std::max(workers, plans.back().workers);
    if (args.prefill_chunk == 0 && plans.back().phase == PlanPhase::kPrefill) {
      options.prefill_chunk_tokens = std::max(options.prefill_chunk_tokens, plans.back().max_tokens);
    }
  }
  if (plans.empty()) {
    if (workers == 0) workers = default_workers();
    const int64_t chunk = options.prefill_chunk_tokens > 0 ? std::min(options.prefill_chunk_tokens, prompt_tokens) : prompt_tokens;
    plans.push_back(compile_plan(model, PlanPhase::kDecode, 1, workers, max_context, !args.no_fusion));
    if (chunk > 1) plans.push_back(compile_plan(model, PlanPhase::kPrefill, chunk, workers, max_context, !args.no_fusion));
  }
  return make_plan_interpreter(model, std::move(plans), workers, act, 1, max_context);
}

bool has_tokenizer(const std::string& model_dir) {
  const std::filesystem::path dir(model_dir);
  return std::filesystem::exists(dir / "tokenizer.json") || std::filesystem::exists(dir / "tiktoken.model");
}

int run_generate(const GenerateArgs& args) {
  const bool cuda = args.backend == "cuda" || args.backend == "cuda-eager";
  if (args.backend != "cpu" && args.backend != "cpu-plan" && !cuda) fail("--backend '{}': expected cpu, cpu-plan, cuda or cuda-eager", args.backend);
  if (args.backend == "cpu" && (args.workers != 0 || !args.plan_files.empty())) fail("--workers and --plan need --backend cpu-plan or cuda");
  if (cuda && !args.plan_files.empty()) fail("--plan: the cuda backends compile their plans for this prompt");
  if (args.workers < 0) fail("--workers must be >= 1, found {}", args.workers);
  if (args.prompt_ids.empty() && args.prompt_text.empty()) fail("one of --prompt-ids or --prompt is required");
  if (!args.prompt_text.empty() && args.source.model_dir.empty()) fail("--prompt needs --model DIR (the tokenizer lives beside the weights)");
  if (args.max_new_tokens < 1) fail("--max-new-tokens must be >= 1, found {}", args.max_new_tokens);
  if (args.temperature < 0) fail("--temperature must be >= 0, found {}", args.temperature);
  if (!(args.top_p > 0 && args.top_p <= 1)) fail("--top-p must be in (0, 1], found {}", args.top_p);
  if (args.top_k < 0) fail("--top-k must be >= 0, found {}", args.top_k);
  if (args.prefill_chunk < 0) fail("--prefill-chunk must be >= 0, found {}", args.prefill_chunk);

  auto model = load_model(args.source);
  // The model's tokenizer, when its directory has one: encodes --prompt, decodes the output text.
  std::optional<Tokenizer> tokenizer;
  if (!args.source.model_dir.empty() && has_tokenizer(args.source.model_dir)) tokenizer = Tokenizer::load(args.source.model_dir);
  if (!args.prompt_text.empty() && !tokenizer) {
    fail("--prompt: model directory '{}' has no tokenizer.json or tiktoken.model; use --prompt-ids", args.source.model_dir);
  }
  std::vector<int64_t> prompt_ids = args.prompt_ids;
  if (!args.prompt_text.empty()) {
    for (int32_t id : tokenizer->encode(args.prompt_text)) prompt_ids.push_back(id);
    if (prompt_ids.empty()) fail("--prompt: the text encodes to no tokens");
  }
  GenerateOptions options;
  for (size_t i = 0; i < prompt_ids.size(); ++i) {
    const int64_t id = prompt_ids[i];
    if (id < 0 || id >= model->config.vocab_size) {
      fail("{}: id {} at position {} is outside the vocabulary (vocab_size {} in {})", args.prompt_text.empty() ? "--prompt-ids" : "--prompt",
           id, i, model->config.vocab_size, model->config.source);
    }
    options.prompt.push_back(static_cast<int32_t>(id));
  }
  options.max_new_tokens = args.max_new_tokens;
  options.sampling = {args.temperature, args.top_p, args.top_k, args.source.seed};
  options.prefill_chunk_tokens = args.prefill_chunk;
  options.keep_logits = !args.dump_logits.empty();
  if (!args.ignore_eos) options.stop_ids = model->config.eos_token_ids;

  const DType act = compute_dtype(args.source.dtype, *model);
  std::unique_ptr<Backend> backend;
  if (args.backend == "cpu") {
    backend = std::make_unique<ReferenceBackend>(model->graph, *model->weights, act, 1);
  } else if (cuda) {
    const auto prompt_tokens = static_cast<int64_t>(options.prompt.size());
    const int64_t chunk = options.prefill_chunk_tokens > 0 ? std::min(options.prefill_chunk_tokens, prompt_tokens) : prompt_tokens;
    backend = tools::make_cuda_backend(*model, act, prompt_tokens + options.max_new_tokens, chunk, args.backend == "cuda-eager", args.workers);
  } else {
    backend = make_plan_backend(args, *model, options, act);
  }
  const GenerateResult result = generate(*backend, 0, options);
  if (options.keep_logits) {
    const auto rows = static_cast<int64_t>(result.logits.size()) / result.vocab;
    write_npy_f32(args.dump_logits, result.logits.data(), {rows, result.vocab});
  }
  const double decode_steps = static_cast<double>(result.generated.size()) - 1.0;
  json out = {{"generated_ids", result.generated},
              {"prompt_tokens", options.prompt.size()},
              {"backend", args.backend},
              {"dtype", std::string(dtype_name(backend->act_dtype()))},
              {"prefill_seconds", result.prefill_seconds},
              {"decode_tokens_per_second", decode_steps > 0 ? decode_steps / result.decode_seconds : 0.0}};
  if (tokenizer) out["text"] = tokenizer->decode(result.generated);
  std::cout << out.dump() << std::endl;
  return 0;
}

int run_inspect(const ModelSource& source) {
  // A config alone is described without materializing its weights (real K3 shapes do not fit here).
  auto model = source.model_dir.empty() && !source.config_path.empty() ? LoadedModel::describe(source.config_path) : load_model(source);
  const ModelConfig& c = model->config;
  json schedule = json::array();
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const auto at = static_cast<size_t>(i);
    schedule.push_back(std::string(c.mixers[at] == MixerKind::kKda ? "kda" : "mla") + "+" + (c.ffns[at] == FfnKind::kMoe ? "moe" : "dense"));
  }
  const DType assumed = source.dtype == "auto" ? config_dtype(c) : parse_dtype(source.dtype);
  std::map<const WeightDecl*, DType> stored;
  if (model->weights) {
    for (size_t i = 0; i < model->weights->size(); ++i) {
      const BoundWeight& bound = (*model->weights)[static_cast<int>(i)];
      stored[bound.decl] = bound.parts.front()->dtype;
    }
  }
  const DType act = model->weights ? model->weights->storage_dtype() : assumed;
  const Footprint cost = footprint(model->graph, [&](const WeightDecl& decl) { return stored.count(&decl) ? stored[&decl] : assumed; }, act);
  json out = {{"model_type", c.wrapper_type.empty() ? c.model_type : c.wrapper_type},
              {"source", model->weights ? (source.model_dir.empty() ? "random weights" : "checkpoint") : "config only"},
              {"vocab_size", c.vocab_size},
              {"hidden_size", c.hidden_size},
              {"num_layers", c.num_layers},
              {"kda_layers", c.num_layers_of(MixerKind::kKda)},
              {"mla_layers", c.num_layers_of(MixerKind::kMla)},
              {"kda", {{"heads", c.kda.num_heads}, {"head_dim", c.kda.head_dim}, {"conv_kernel", c.kda.conv_kernel},
                       {"gate_lower_bound", c.kda.gate_lower_bound ? json(*c.kda.gate_lower_bound) : json(nullptr)},
                       {"full_rank_gate", c.kda.full_rank_gate}}},
              {"mla", {{"heads", c.num_attention_heads}, {"q_lora_rank", c.q_lora_rank ? json(*c.q_lora_rank) : json(nullptr)},
                       {"kv_lora_rank", c.kv_lora_rank}, {"qk_nope_head_dim", c.qk_nope_head_dim},
                       {"qk_rope_head_dim", c.qk_rope_head_dim}, {"v_head_dim", c.v_head_dim}, {"output_gate", c.mla_output_gate}}},
              {"moe", {{"experts", c.num_experts}, {"experts_per_token", c.experts_per_token},
                       {"shared_experts", c.num_shared_experts}, {"intermediate_size", c.moe_intermediate_size},
                       {"latent_size", c.latent_moe_size ? json(*c.latent_moe_size) : json(nullptr)},
                       {"groups", c.num_expert_group}, {"topk_group", c.topk_group}, {"renormalize", c.moe_renormalize},
                       {"routed_scaling_factor", c.routed_scaling_factor}, {"experts_mxfp4", c.experts_mxfp4}}},
              {"activation", c.activation == FfnActivation::kSitu ? "situ" : "silu"},
              {"attn_res_block_size", c.attn_res_block_size ? json(*c.attn_res_block_size) : json(nullptr)},
              {"tie_word_embeddings", c.tie_word_embeddings},
              {"layer_schedule", schedule},
              {"graph_nodes", model->graph.nodes().size()},
              {"parameters", cost.parameters},
              {"bytes_by_dtype", cost.bytes_by_dtype},
              {"decode_bytes_per_token", {{"weights", cost.weight_bytes_per_token},
                                          {"state", cost.state_bytes_per_token},
                                          {"mla_cache_per_context_token", cost.mla_cache_bytes_per_context_token}}}};
  std::cout << out.dump(2) << std::endl;
  return 0;
}

struct CompileArgs {
  ModelSource source;
  std::string phase = "decode";
  int64_t batch = 0;  // decode bucket (default 1)
  int64_t chunk = 0;  // prefill chunk (default 512)
  int workers = 0;    // 0: one per core
  int64_t max_context = 0;
  bool no_fusion = false;
  std::vector<std::string> disabled_rules;
  std::string output;
};

int run_compile(const CompileArgs& args) {
  if (args.phase != "decode" && args.phase != "prefill") fail("--phase '{}': expected decode or prefill", args.phase);
  const bool decode = args.phase == "decode";
  if (decode && args.chunk != 0) fail("--chunk sets a prefill plan's chunk; a decode plan takes --batch");
  if (!decode && args.batch != 0) fail("--batch sets a decode plan's batch; a prefill plan takes --chunk");
  const int64_t tokens = decode ? (args.batch ? args.batch : 1) : (args.chunk ? args.chunk : 512);
  const auto model = describe_model(args.source);
  const Plan plan = compile_plan(*model, decode ? PlanPhase::kDecode : PlanPhase::kPrefill, tokens,
                                 args.workers ? args.workers : default_workers(), args.max_context, !args.no_fusion,
                                 PlanTuning{.disabled_rules = args.disabled_rules});
  write_plan(args.output, plan);
  json out = {{"plan", args.output}, {"phase", args.phase}, {"max_tokens", plan.max_tokens}, {"workers", plan.workers},
              {"ops", plan.ops.size()}, {"tasks", plan.tasks.size()}, {"critical_path_tasks", critical_path_tasks(plan)},
              {"arena_bytes", plan.arena_bytes()}};
  std::cout << out.dump() << std::endl;
  return 0;
}

int run_inspect_plan(const std::string& path, const std::string& dtype) {
  const Plan plan = read_plan(path);
  validate_plan(plan, [](uint8_t) { return true; });  // the op table; the CPU backend's coverage is reported below
  const DType weight_dtype = dtype == "auto" ? DType::BF16 : parse_dtype(dtype);
  const PlanSummary summary = summarize_plan(plan, weight_dtype);
  json by_opcode = json::object();
  for (const auto& [name, counts] : summary.by_opcode) by_opcode[name] = {{"ops", counts.first}, {"tasks", counts.second}};
  json missing = json::array();
  for (const PlanOp& op : plan.ops) {
    if (!PlanInterpreter::has_op(op.opcode) && std::find(missing.begin(), missing.end(), op_name(op.op())) == missing.end()) missing.push_back(op_name(op.op()));
  }
  json out = {{"plan", path},
              {"format_version", plan.format_version},
              {"model_fingerprint", fmt::format("{:016x}", plan.model_fingerprint)},
              {"phase", std::string(phase_name(plan.phase))},
              {"bucket", plan.max_tokens},
              {"workers", plan.workers},
              {"ops_before_fusion", plan.compile.ops_before_fusion},
              {"ops_after_fusion", summary.ops},
              {"rules_fired", plan.compile.rules_fired},
              {"tasks", summary.tasks},
              {"counters", summary.counters},
              {"critical_path_tasks", summary.critical_path_tasks},
              {"queue_tasks", {{"min", summary.min_queue_tasks}, {"max", summary.max_queue_tasks}}},
              {"activation_arena_bytes", summary.arena_bytes},
              {"weight_bytes_per_step", summary.weight_bytes_per_step},
              {"weight_dtype_assumed", std::string(dtype_name(weight_dtype))},
              {"by_opcode", by_opcode},
              {"cpu_kernels_missing", missing}};
  std::cout << out.dump(2) << std::endl;
  return 0;
}

// serve's step budget: tokens of one step (decode rows and prefill chunks together) and prompt tokens of
// one request in one step; 0 takes the backend's default. The GPU prefills in large chunks
// (kGpuPrefillChunk); the CPU backends keep small steps, so decode rows beside a prefill wait less.
void choose_step_budget(ServeOptions& options, const std::string& backend, int64_t step_tokens, int64_t prefill_chunk) {
  if (step_tokens < 0) fail("--max-num-batched-tokens must be >= 1 (0: the backend's default), found {}", step_tokens);
  if (prefill_chunk < 0) fail("--max-prefill-chunk must be >= 1 (0: the backend's default), found {}", prefill_chunk);
  const bool gpu = backend == "cuda" || backend == "cuda-eager";
  options.scheduler.max_step_tokens = step_tokens > 0 ? step_tokens : gpu ? tools::kGpuPrefillChunk : 256;
  options.scheduler.max_prefill_chunk = prefill_chunk > 0 ? prefill_chunk : gpu ? tools::kGpuPrefillChunk : 128;
  if (options.scheduler.max_prefill_chunk > options.scheduler.max_step_tokens) {
    fail("--max-prefill-chunk {} exceeds the step's {} tokens (--max-num-batched-tokens)", options.scheduler.max_prefill_chunk, options.scheduler.max_step_tokens);
  }
}

// plow serve: SIGTERM/SIGINT stop accepting, finish in-flight requests, exit 0. The signals are
// blocked in every thread and taken by one waiter thread (no async-signal-safety concerns).
// serve --backend: the CPU reference (default), compiled plans on worker threads, or the GPU.
// serve --tp N: N tensor-parallel ranks (cuda: one GPU and one process each, NCCL; cpu, cpu-plan:
// simulated ranks, threads of this process).
void choose_serve_backend(ServeOptions& options, const std::string& backend, int workers, int tp, bool device_sampling) {
  if (workers < 0) fail("--workers must be >= 1, found {}", workers);
  if (tp < 1 || tp > 8) fail("--tp {}: expected 1..8", tp);
  if (tp > 1) {
    if (backend == "cuda" || backend == "cuda-eager") {
      const bool eager = backend == "cuda-eager";
      options.make_backend = [workers, eager, tp](const LoadedModel& model, int slots, int64_t max_context, int64_t step_tokens) {
        return tools::make_cuda_tp_serving_backend(model.checkpoint->dir(), tp, {slots, max_context, step_tokens, eager, workers, std::nullopt});
      };
      return;
    }
    if (backend != "cpu" && backend != "cpu-plan") fail("--backend '{}': expected cpu, cpu-plan, cuda or cuda-eager", backend);
    const bool plans = backend == "cpu-plan";
    options.make_backend = [workers, plans, tp](const LoadedModel& model, int slots, int64_t max_context, int64_t step_tokens) -> std::unique_ptr<Backend> {
      const std::string dir = model.checkpoint->dir();
      const DType act = model.weights->storage_dtype();
      return make_local_tp_backend(
          tp, [&](TpShard shard) { return LoadedModel::load(dir, shard); },
          [&](const LoadedModel& rank, Collective& collective) -> std::unique_ptr<Backend> {
            if (!plans) return std::make_unique<ReferenceBackend>(rank.graph, *rank.weights, act, slots, &collective);
            const int threads = std::max(1, (workers > 0 ? workers : default_workers()) / tp);
            return make_plan_interpreter(rank, compile_serving_plans(rank, slots, max_context, step_tokens, threads), threads, act, slots, max_context,
                                         &collective);
          });
    };
    return;
  }
  if (backend == "cpu") return;
  if (backend == "cpu-plan") {
    options.make_backend = [workers](const LoadedModel& model, int slots, int64_t max_context, int64_t step_tokens) -> std::unique_ptr<Backend> {
      const int threads = workers > 0 ? workers : default_workers();
      return make_plan_interpreter(model, compile_serving_plans(model, slots, max_context, step_tokens, threads), threads, model.weights->storage_dtype(),
                                   slots, max_context);
    };
    return;
  }
  if (backend == "cuda" || backend == "cuda-eager") {
    const bool eager = backend == "cuda-eager";
    options.make_backend = [workers, eager, device_sampling](const LoadedModel& model, int slots, int64_t max_context, int64_t step_tokens) {
      return tools::make_cuda_serving_backend(model, {slots, max_context, step_tokens, eager, workers, std::nullopt, device_sampling});
    };
    return;
  }
  fail("--backend '{}': expected cpu, cpu-plan, cuda or cuda-eager", backend);
}

int run_serve(ServeOptions options) {
  if (options.model_dir.empty()) fail("serve needs --model DIR");
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that hangs up is a failed write, not a dead server
  Server server(options);
  const int port = server.bind();
  std::fprintf(stderr, "plow serve: listening on http://%s:%d\n", options.host.c_str(), port);
  std::atomic<bool> done{false};
  std::thread waiter([&] {
    const timespec tick{0, 200'000'000};
    while (!done) {
      if (sigtimedwait(&signals, nullptr, &tick) > 0) {
        std::fprintf(stderr, "plow serve: shutting down after in-flight requests\n");
        server.shutdown();
        return;
      }
    }
  });
  server.run();
  done = true;
  waiter.join();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"plow: compiled inference engine for Kimi Linear / K3 hybrid MoE models"};
  app.require_subcommand(1);

  GenerateArgs gen;
  CLI::App* generate_cmd = app.add_subcommand("generate", "generate tokens from a prompt");
  gen.source.add_options(generate_cmd);
  auto* ids_opt = generate_cmd->add_option("--prompt-ids", gen.prompt_ids, "comma-separated prompt token ids")->delimiter(',');
  generate_cmd->add_option("--prompt", gen.prompt_text, "prompt text (needs the model's tokenizer)")->excludes(ids_opt);
  generate_cmd->add_option("--max-new-tokens", gen.max_new_tokens, "tokens to generate");
  generate_cmd->add_option("--temperature", gen.temperature, "0 = greedy");
  generate_cmd->add_option("--top-p", gen.top_p);
  generate_cmd->add_option("--top-k", gen.top_k, "0 = no limit");
  generate_cmd->add_option("--seed", gen.source.seed, "sampling seed, and the weights' seed with --random-weights");
  generate_cmd->add_option("--backend", gen.backend, "cpu (the reference), cpu-plan (compiled plans on worker threads), cuda (the megakernel) or cuda-eager");
  generate_cmd->add_option("--workers", gen.workers, "cpu-plan: worker threads (default: the plans', or one per core)");
  generate_cmd->add_flag("--no-fusion", gen.no_fusion, "cpu-plan: lower the graph without the compiler's fusion rules");
  generate_cmd->add_option("--plan", gen.plan_files, "cpu-plan: .plow files to run (default: compile for this prompt)");
  generate_cmd->add_option("--prefill-chunk", gen.prefill_chunk, "split the prompt into steps of this many tokens (0 = one step)");
  generate_cmd->add_flag("--ignore-eos", gen.ignore_eos, "do not stop at the config's eos_token_id");
  generate_cmd->add_option("--dump-logits", gen.dump_logits, "write [P+N-1, vocab] float32 logits to this .npy file");

  ModelSource inspect_source;
  CLI::App* inspect_cmd = app.add_subcommand("inspect", "print a model's configuration, schedule and sizes as JSON");
  inspect_source.add_options(inspect_cmd);
  inspect_cmd->add_option("--seed", inspect_source.seed, "weights' seed with --random-weights");
  std::string inspect_plan;
  inspect_cmd->add_option("plan", inspect_plan, "a .plow file: print its plan instead of a model");

  CompileArgs comp;
  CLI::App* compile_cmd = app.add_subcommand("compile", "lower a model to a plan for one bucket and write it to a .plow file");
  comp.source.add_options(compile_cmd);
  compile_cmd->add_option("--phase", comp.phase, "decode or prefill");
  compile_cmd->add_option("--batch", comp.batch, "decode: batch bucket (default 1)");
  compile_cmd->add_option("--chunk", comp.chunk, "prefill: chunk tokens (default 512)");
  compile_cmd->add_option("--workers", comp.workers, "worker queues (default: one per core)");
  compile_cmd->add_flag("--no-fusion", comp.no_fusion, "lower the graph without the compiler's fusion rules");
  compile_cmd->add_option("--disable-rule", comp.disabled_rules, "compile without this compiler rule (docs/compiler.md; repeatable)");
  compile_cmd->add_option("--max-context", comp.max_context, "longest context the plan will serve (0: unbounded)");
  compile_cmd->add_option("-o,--output", comp.output, "the .plow file to write")->required();

  ServeOptions serve;
  CLI::App* serve_cmd = app.add_subcommand("serve", "serve the model over an OpenAI-compatible HTTP API");
  serve_cmd->add_option("--model", serve.model_dir, "model directory (config.json + safetensors [+ tokenizer])")->required();
  serve_cmd->add_option("--host", serve.host, "address to bind (default 127.0.0.1: this machine only)");
  serve_cmd->add_option("--port", serve.port, "TCP port (0: any free port)");
  serve_cmd->add_option("--api-key", serve.api_key, "require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize");
  serve_cmd->add_option("--max-tokens-limit", serve.max_tokens_limit, "largest max_tokens a request may ask for");
  serve_cmd->add_option("--max-model-len", serve.max_context_tokens, "prompt + generated tokens of one request");
  serve_cmd->add_option("--slots", serve.num_slots, "requests decoding at once");
  serve_cmd->add_option("--max-waiting", serve.max_waiting, "queued requests beyond which new ones get 429");
  serve_cmd->add_option("--served-model-name", serve.served_model_name, "the model id clients pass (default: the directory's name)");
  std::string serve_backend = "cpu";
  int serve_workers = 0;
  serve_cmd->add_option("--backend", serve_backend, "cpu (the reference), cpu-plan (compiled plans on worker threads), cuda or cuda-eager");
  serve_cmd->add_option("--workers", serve_workers, "cpu-plan: worker threads; cuda: megakernel blocks (default: one per core / SM)");
  bool serve_host_sampling = false;
  serve_cmd->add_flag("--host-sampling", serve_host_sampling, "cuda, one GPU: download sampled rows' logits and draw on the host (default: drawn on the GPU, ids downloaded)");
  int serve_tp = 1;
  serve_cmd->add_option("--tp", serve_tp, "tensor-parallel ranks: cuda: one GPU and one process each, NCCL; cpu, cpu-plan: simulated ranks");
  serve_cmd->add_option("--prefix-cache-mb", serve.prefix_cache_mb, "prefix cache memory budget in MiB (0: no prefix cache; default 512)");
  int64_t serve_step_tokens = 0, serve_prefill_chunk = 0;
  serve_cmd->add_option("--max-num-batched-tokens", serve_step_tokens, "tokens of one step, decode rows and prefill chunks together (default: cuda 8192, cpu 256)");
  serve_cmd->add_option("--max-prefill-chunk", serve_prefill_chunk, "prompt tokens of one request in one step (default: cuda 8192, cpu 128)");
  serve_cmd->add_flag("--debug-endpoints", serve.debug_endpoints, "serve GET /debug/integrity (slot and page manager check)");

  // Rank r ≥ 1 of `serve --tp N --backend cuda`, started by the server (hidden: not for users).
  tools::TpWorkerArgs tp_worker;
  CLI::App* tp_worker_cmd = app.add_subcommand("tp-worker", "a tensor-parallel rank of plow serve")->group("");
  tools::add_tp_worker_options(tp_worker_cmd, tp_worker);

  const Subcommand chat_cmd = add_chat_command(app);
  const Subcommand bench_serve_cmd = add_bench_serve_command(app);
  const Subcommand bench_sample_cmd = add_bench_sample_command(app);

  CLI::App* bench_cmd = bench_group(app);
  tools::BenchDecodeArgs bench_decode;
  CLI::App* bench_decode_cmd = bench_cmd->add_subcommand("decode", "decode steps on the GPU: megakernel, cuda-eager, read roofline, HF peer");
  tools::add_bench_decode_options(bench_decode_cmd, bench_decode);
  for (int i = 0; i < argc; ++i) {  // as a shell would take it back: arguments with spaces or quotes in single quotes
    std::string arg = i == 0 ? "plow" : argv[i];
    if (arg.find_first_of(" \t'\"$") != std::string::npos) {
      std::string quoted = "'";
      for (char ch : arg) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
      arg = quoted + "'";
    }
    bench_decode.command_line += (i ? " " : "") + arg;
  }
  bench_decode.argv.assign(argv, argv + argc);
  tools::BenchPrefillArgs bench_prefill;
  CLI::App* bench_prefill_cmd = bench_cmd->add_subcommand("prefill", "time to first token on the GPU: prefill GEMMs on tensor cores, cuBLAS peer");
  tools::add_bench_prefill_options(bench_prefill_cmd, bench_prefill);
  bench_prefill.command_line = bench_decode.command_line;
  tools::BenchKdaArgs bench_kda;
  CLI::App* bench_kda_cmd = bench_cmd->add_subcommand("kda", "KDA prefill's planned launches on one layer's shape, synthetic inputs, fla peer");
  tools::add_bench_kda_options(bench_kda_cmd, bench_kda);
  bench_kda.command_line = bench_decode.command_line;

  const SubcommandEntry eval_ppl = add_eval_ppl_command(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (generate_cmd->parsed()) return run_generate(gen);
    if (inspect_cmd->parsed() && !inspect_plan.empty()) {
      if (!inspect_source.model_dir.empty() || !inspect_source.config_path.empty()) fail("inspect takes a .plow file or --model/--config, not both");
      return run_inspect_plan(inspect_plan, inspect_source.dtype);
    }
    if (inspect_cmd->parsed()) return run_inspect(inspect_source);
    if (compile_cmd->parsed()) return run_compile(comp);
    if (serve_cmd->parsed()) {
      if (serve_host_sampling && serve_backend != "cuda" && serve_backend != "cuda-eager") fail("--host-sampling needs --backend cuda or cuda-eager");
      choose_serve_backend(serve, serve_backend, serve_workers, serve_tp, !serve_host_sampling);
      choose_step_budget(serve, serve_backend, serve_step_tokens, serve_prefill_chunk);
      return run_serve(serve);
    }
    if (tp_worker_cmd->parsed()) return tools::run_tp_worker(tp_worker);
    if (bench_decode_cmd->parsed()) return tools::run_bench_decode(bench_decode);
    if (bench_prefill_cmd->parsed()) return tools::run_bench_prefill(bench_prefill);
    if (bench_kda_cmd->parsed()) return tools::run_bench_kda(bench_kda);
    if (chat_cmd.command->parsed()) return chat_cmd.run();
    if (bench_serve_cmd.command->parsed()) return bench_serve_cmd.run();
    if (bench_sample_cmd.command->parsed()) return bench_sample_cmd.run();
    if (eval_ppl.command->parsed()) return eval_ppl.run();
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
