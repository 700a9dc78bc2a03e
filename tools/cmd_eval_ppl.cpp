// plow eval-ppl --model DIR --text-file F: encodes F with DIR's tokenizer (HF encode: special-token
// text is matched), runs the ids as one sequence through a backend in chunks with all_logits, and
// prints one JSON line: tokens (ids in the text, after --max-tokens), predicted_tokens (tokens − 1:
// token 0 has no context and is not scored), nll (mean natural-log loss over the predicted tokens), ppl.
#include "cmd_eval_ppl.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "engine/model.h"
#include "engine/plans.h"
#include "runtime/cpu/interpreter.h"
#include "runtime/cpu/reference.h"
#include "serve/tokenizer.h"

namespace plow {

namespace {

struct EvalPplArgs {
  std::string model_dir;
  std::string text_file;
  std::string backend = "cpu";
  std::string dtype = "auto";
  int64_t max_tokens = 0;    // 0: the whole text
  int64_t chunk_tokens = 512;
  int workers = 0;           // cpu-plan: 0 = one per core
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("--text-file {}: cannot open", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

DType activation_dtype(const std::string& name, const LoadedModel& model) {
  if (name == "auto") return model.weights->storage_dtype();
  if (name == "f32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  if (name == "f16") return DType::F16;
  fail("--dtype '{}': expected auto, f32, bf16 or f16", name);
}

std::unique_ptr<Backend> make_backend(const EvalPplArgs& args, const LoadedModel& model, DType act, int64_t tokens) {
  if (args.backend == "cpu") return std::make_unique<ReferenceBackend>(model.graph, *model.weights, act, 1);
  const int workers = args.workers > 0 ? args.workers : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int64_t chunk = std::min(args.chunk_tokens, tokens);
  std::vector<Plan> plans;
  plans.push_back(compile_plan(model, PlanPhase::kPrefill, chunk, workers, tokens));
  if (tokens % chunk == 1) plans.push_back(compile_plan(model, PlanPhase::kDecode, 1, workers, tokens));  // a 1-token tail is a decode step
  return make_plan_interpreter(model, std::move(plans), workers, act, 1, tokens);
}

// Σ over rows of −log softmax(row)[next id], in double; rows [begin, begin + rows) of the sequence.
double chunk_nll(const StepOutput& out, const std::vector<int32_t>& ids, size_t begin, size_t& scored) {
  double sum = 0.0;
  for (int64_t r = 0; r < out.rows; ++r) {
    const size_t position = begin + static_cast<size_t>(r);
    if (position + 1 >= ids.size()) break;
    const float* row = out.logits.data() + r * out.vocab;
    const float peak = *std::max_element(row, row + out.vocab);
    double denom = 0.0;
    for (int64_t v = 0; v < out.vocab; ++v) denom += std::exp(static_cast<double>(row[v]) - peak);
    sum += std::log(denom) + peak - row[ids[position + 1]];
    ++scored;
  }
  return sum;
}

int run_eval_ppl(const EvalPplArgs& args) {
  if (args.backend != "cpu" && args.backend != "cpu-plan") fail("--backend '{}': this build has the 'cpu' and 'cpu-plan' backends", args.backend);
  if (args.backend == "cpu" && args.workers != 0) fail("--workers needs --backend cpu-plan");
  if (args.max_tokens < 0) fail("--max-tokens must be >= 0, found {}", args.max_tokens);
  if (args.chunk_tokens < 1) fail("--chunk must be >= 1, found {}", args.chunk_tokens);
  if (args.workers < 0) fail("--workers must be >= 1, found {}", args.workers);
  const std::string text = read_text(args.text_file);
  const std::filesystem::path dir(args.model_dir);
  if (!std::filesystem::exists(dir / "tokenizer.json") && !std::filesystem::exists(dir / "tiktoken.model")) {
    fail("--model {}: no tokenizer.json or tiktoken.model (eval-ppl tokenizes the text with the model's tokenizer)", args.model_dir);
  }
  auto model = LoadedModel::load(args.model_dir);
  const Tokenizer tokenizer = Tokenizer::load(args.model_dir);
  std::vector<int32_t> ids = tokenizer.encode(text);
  if (args.max_tokens > 0 && static_cast<int64_t>(ids.size()) > args.max_tokens) ids.resize(static_cast<size_t>(args.max_tokens));
  if (ids.size() < 2) fail("--text-file {}: encodes to {} token(s); perplexity needs at least 2", args.text_file, ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= model->config.vocab_size) {
      fail("--text-file {}: token id {} at position {} is outside the model's vocabulary (vocab_size {} in {})", args.text_file,
           ids[i], i, model->config.vocab_size, model->config.source);
    }
  }
  const DType act = activation_dtype(args.dtype, *model);
  const auto tokens = static_cast<int64_t>(ids.size());
  auto backend = make_backend(args, *model, act, tokens);
  backend->reset_slot(0);
  const auto start = std::chrono::steady_clock::now();
  double total = 0.0;
  size_t scored = 0;
  for (int64_t begin = 0; begin < tokens; begin += args.chunk_tokens) {
    const int64_t count = std::min(args.chunk_tokens, tokens - begin);
    StepInputs step;
    step.token_ids.assign(ids.begin() + begin, ids.begin() + begin + count);
    step.sequences = {{0, count}};
    step.all_logits = true;
    total += chunk_nll(backend->step(step), ids, static_cast<size_t>(begin), scored);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double nll = total / static_cast<double>(scored);
  if (!std::isfinite(nll)) fail("{}: the logits give a non-finite loss ({}) on --text-file {}", args.model_dir, nll, args.text_file);
  const nlohmann::json out = {{"tokens", tokens}, {"predicted_tokens", scored}, {"nll", nll}, {"ppl", std::exp(nll)},
                              {"backend", args.backend}, {"dtype", std::string(dtype_name(act))}, {"chunk", args.chunk_tokens},
                              {"seconds", seconds}, {"tokens_per_second", static_cast<double>(tokens) / seconds}};
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

SubcommandEntry add_eval_ppl_command(CLI::App& app) {
  auto args = std::make_shared<EvalPplArgs>();
  CLI::App* cmd = app.add_subcommand("eval-ppl", "perplexity of a text file (the model's tokenizer, teacher-forced)");
  cmd->add_option("--model", args->model_dir, "model directory (config.json, safetensors, tokenizer.json)")->required();
  cmd->add_option("--text-file", args->text_file, "UTF-8 text to score as one sequence")->required();
  cmd->add_option("--backend", args->backend, "cpu (the reference) or cpu-plan (compiled plans on worker threads)");
  cmd->add_option("--dtype", args->dtype, "activations: auto (the checkpoint's dtype), f32, bf16, f16");
  cmd->add_option("--max-tokens", args->max_tokens, "score only the first N tokens (0 = all)");
  cmd->add_option("--chunk", args->chunk_tokens, "tokens per forward step (the context carries over between steps)");
  cmd->add_option("--workers", args->workers, "cpu-plan: worker threads (default: one per core)");
  return {cmd, [args] { return run_eval_ppl(*args); }};
}

}  // namespace plow
