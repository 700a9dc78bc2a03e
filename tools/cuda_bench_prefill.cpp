// `plow bench prefill`: time to first token of a P-token prompt on the GPU, run in chunks through
// prefill plans compiled without fusion (their linears run as cuBLAS GEMMs, prefill_gemm.h, their routed
// experts as grouped expert GEMMs, moe_gemm.h, their MLA attention as cuBLAS GEMMs, mla_gemm.h), on
// random device weights; the FLOPs it must do (dense projections, the experts actually routed,
// attention's QK/PV) over that time; the routed experts' and the MLA ops' own stream time; and,
// measured in the same run, our GEMM and cuBLAS alone at each projection shape of the chunk. Records
// are appended to a JSON array (bench/results/prefill.json).
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>

#include "core/error.h"
#include "engine/plans.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/prefill_gemm.h"
#include "tools/cuda_commands.h"

namespace plow::tools {

namespace {

using nlohmann::json;

struct PrefillFlops {
  double dense = 0, experts = 0, attention = 0;
  double total() const { return dense + experts + attention; }
};

// FLOPs of a `tokens`-token prompt after `prefix` cached positions: 2·(elements of every ≥ 2-D weight
// but the embedding table)·tokens, 2·(one expert's elements)·top_k·tokens per expert stack, and per MLA
// layer the QK and PV products of the standard (not absorbed) form over the prefix and the causal
// pairs: 2·heads·(qk_dim + v_dim)·tokens·(prefix + (tokens + 1)/2). KDA's chunked delta rule is not
// counted.
PrefillFlops prefill_flops(const LoadedModel& model, int64_t tokens, int64_t prefix = 0) {
  PrefillFlops flops;
  const auto t = static_cast<double>(tokens);
  for (const Node& node : model.graph.nodes()) {
    if (node.op == Op::kEmbedding) continue;
    for (int w : node.weights) {
      const WeightDecl& decl = model.graph.weights()[static_cast<size_t>(w)];
      if (decl.shape.size() < 2) continue;
      double elements = 1;
      for (int64_t d : decl.shape) elements *= static_cast<double>(d);
      if (decl.parts.size() > 1) {
        flops.experts += 2.0 * elements * static_cast<double>(model.config.experts_per_token) * t;
      } else {
        flops.dense += 2.0 * elements * t;
      }
    }
  }
  int64_t mla_layers = 0;
  for (const StateDecl& state : model.graph.states()) mla_layers += state.kind == StateKind::kMlaLatent ? 1 : 0;
  const ModelConfig& c = model.config;
  flops.attention = static_cast<double>(mla_layers) * 2.0 * static_cast<double>(c.num_attention_heads * (c.mla_qk_head_dim() + c.v_head_dim)) * t *
                    (static_cast<double>(prefix) + (t + 1) / 2);
  return flops;
}

// The [out, in] of op's one dense 2-D weight (not an expert stack, not MXFP4), or nullopt.
std::optional<std::pair<int64_t, int64_t>> dense_weight_shape(const Plan& plan, const PlanOp& op) {
  if (op.weights.size() != 1) return std::nullopt;
  const WeightDecl& decl = plan.weights[static_cast<size_t>(op.weights.front())];
  if (decl.parts.size() != 1 || decl.mxfp4 || decl.shape.size() != 2) return std::nullopt;
  return std::pair{decl.shape[0], decl.shape[1]};
}

// The plain linear shapes [out, in] of a plan with how often each occurs (the GEMMs of one chunk).
std::map<std::pair<int64_t, int64_t>, int> linear_shapes(const Plan& plan) {
  std::map<std::pair<int64_t, int64_t>, int> shapes;
  for (const PlanOp& op : plan.ops) {
    if (op.op() != Op::kLinear) continue;
    if (const auto shape = dense_weight_shape(plan, op)) shapes[*shape] += 1;
  }
  return shapes;
}

// A step's GEMM work over the plan's plain linears but its output op (a step's logits are its last
// rows', a GEMM of a few rows), and the input conversions it makes: the GEMMs in plan order (the router
// logits too: they share the copies) through GemmRunner's staging rule (StagingLru, keyed by the op
// read) say which convert.
struct StepGemms {
  std::map<std::pair<int64_t, int64_t>, int> shapes;  // (out, in) → linears
  std::map<int64_t, int> conversions;                  // in → inputs converted
};
StepGemms step_gemms(const Plan& plan) {
  StepGemms step;
  cuda::StagingLru<int32_t, cuda::GemmRunner::kStagingSlots> staged;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    if ((op.op() != Op::kLinear && op.op() != Op::kRouterLogits) || op.inputs.size() != 1 || static_cast<int32_t>(i) == plan.output_op) continue;
    const auto shape = dense_weight_shape(plan, op);
    if (!shape) continue;
    if (op.op() == Op::kLinear) step.shapes[*shape] += 1;
    if (!staged.use(op.inputs.front()).hit) step.conversions[shape->second] += 1;
  }
  return step;
}

// How unevenly a routing read spread its pairs: the busiest expert's pairs over the mean (1 = even).
double load_max_over_mean(const std::vector<int32_t>& tokens_per_expert) {
  if (tokens_per_expert.empty()) return 0.0;
  int64_t total = 0, most = 0;
  for (int32_t t : tokens_per_expert) {
    total += t;
    most = std::max<int64_t>(most, t);
  }
  return total == 0 ? 0.0 : static_cast<double>(most) * static_cast<double>(tokens_per_expert.size()) / static_cast<double>(total);
}

// A prompt's token ids: a fixed LCG sequence below `vocab`; `stream` picks another sequence (the
// cached prefix's).
std::vector<int32_t> prompt_ids(int64_t tokens, int64_t vocab, uint64_t stream = 1) {
  std::vector<int32_t> ids;
  uint64_t x = 0x9E3779B97F4A7C15ull * stream;
  for (int64_t i = 0; i < tokens; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    ids.push_back(static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab)));
  }
  return ids;
}

// Wall-clock ms of the whole prompt, chunk by chunk, up to the first token's logits on the host, per
// run; `reps` runs after a warm-up of the first chunk (kernels and cuBLAS loaded). Each run starts from
// an empty slot and first prefills `prefix` (untimed, in the same chunks: a cached prefix, as a later
// turn of a conversation finds it); `on_timed(true)` and `on_timed(false)` bracket each timed part.
std::vector<double> time_prompt(Backend& backend, const std::vector<int32_t>& prefix, const std::vector<int32_t>& ids, int64_t chunk, int reps,
                                const std::function<void(bool)>& on_timed = {}) {
  auto run = [&](const std::vector<int32_t>& tokens, size_t end) {
    for (size_t first = 0; first < end; first += static_cast<size_t>(chunk)) {
      StepInputs in;
      in.token_ids.assign(tokens.begin() + static_cast<std::ptrdiff_t>(first), tokens.begin() + static_cast<std::ptrdiff_t>(std::min(end, first + static_cast<size_t>(chunk))));
      in.sequences = {{0, static_cast<int64_t>(in.token_ids.size())}};
      backend.step(in);  // returns with the logits on the host: the GPU is idle after it
    }
  };
  std::vector<double> runs;
  for (int r = 0; r < reps + 1; ++r) {
    backend.reset_slot(0);
    run(prefix, prefix.size());
    if (r > 0 && on_timed) on_timed(true);
    const auto start = std::chrono::steady_clock::now();
    run(ids, r == 0 ? std::min(ids.size(), static_cast<size_t>(chunk)) : ids.size());
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (r > 0 && on_timed) on_timed(false);
    if (r > 0) runs.push_back(ms);
  }
  return runs;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A backend over `weights` with a decode plan (a one-token tail) and one prefill plan per chunk size;
// `gemm`: the GEMM path (else fused plans on the GEMV bodies); `mla_gemm`: MLA on it as GEMMs too;
// `kda_planned`: KDA on it as planned launches; `round_in_readers`: linears' outputs rounded by their readers.
std::unique_ptr<cuda::CudaBackend> make_backend(const LoadedModel& model, std::shared_ptr<cuda::DeviceWeightSet> weights, const std::set<int64_t>& chunks,
                                                int workers, int64_t max_context, DType dtype, bool gemm, bool mla_gemm = true, bool kda_planned = true,
                                                bool round_in_readers = true) {
  std::vector<Plan> plans;
  plans.push_back(compile_plan(model, PlanPhase::kDecode, 1, workers, max_context));
  // The GEMM path runs plain linears: prefill plans are compiled without fusion. The GEMV path keeps
  // the fused plans today's prefill runs.
  for (int64_t c : chunks) plans.push_back(compile_plan(model, PlanPhase::kPrefill, c, workers, max_context, !gemm));
  cuda::CudaOptions options;
  options.act_dtype = dtype;
  options.num_slots = 1;
  options.max_context_tokens = max_context;
  options.prefill_gemm = gemm;
  options.prefill_mla_gemm = mla_gemm;
  options.prefill_kda_planned = kda_planned;
  options.prefill_round_in_readers = round_in_readers;
  return std::make_unique<cuda::CudaBackend>(model.graph, std::move(weights), std::move(plans), options);
}

}  // namespace

void add_bench_prefill_options(CLI::App* cmd, BenchPrefillArgs& args) {
  auto* config = cmd->add_option("--config", args.config_path, "config.json of a model to draw on the device")->required();
  cmd->add_flag("--random-weights", args.random_weights, "draw every weight on the device from --seed (required)")->needs(config);
  cmd->add_option("--seed", args.seed, "weights' seed");
  cmd->add_option("--prompt", args.prompts, "prompt lengths in tokens, comma-separated")->delimiter(',');
  cmd->add_option("--chunk", args.chunk, fmt::format("tokens per prefill step (default {}, serve's, or the prompt when shorter)", kGpuPrefillChunk));
  cmd->add_option("--cached-prefix", args.cached_prefix, "tokens already in the slot before each prompt (prefilled untimed): a later turn's TTFT");
  cmd->add_option("--reps", args.reps, "timed runs per prompt (after a one-chunk warm-up); the median is reported");
  cmd->add_option("--workers", args.workers, "megakernel blocks (default: one per SM)");
  cmd->add_flag("--gemv-peer", args.gemv_peer, "also time today's path (fused prefill plans, GEMV bodies) on the same weights");
  cmd->add_flag("--mla-body-peer", args.mla_body_peer, "also time the GEMM path with mla_attention on its op body (split-KV, absorbed) instead of GEMMs");
  cmd->add_flag("--kda-body-peer", args.kda_body_peer, "also time the GEMM path with kda_delta_rule on its op body instead of planned launches");
  cmd->add_flag("--rounding-peer", args.rounding_peer,
                "also time the GEMM path with every linear's tasks rounding its output (no rounding by the readers as they load), --reps runs");
  cmd->add_flag("--mla-flash-peer", args.mla_flash_peer,
                "also time each prompt with MLA's fused attention on the mma.sync kernel instead of the wgmma one (same weights and plans)");
  cmd->add_flag("--expert-peer", args.expert_peer,
                "also time each prompt with the routed experts on cuBLAS's grouped GEMM instead of the wgmma kernel (same weights, plans and routing)");
  cmd->add_flag("--profile", args.profile, "also run each prompt once more one launch per op with events: per-opcode time (GEMMs and host ops included)");
  cmd->add_option("--kda-peer", args.kda_peer,
                  "command printing fla chunk_kda's times (bench/peers/fla_kda.py); given --tokens, --heads and --dim, run before the engine takes the GPU; "
                  "compared with kda_delta_rule's time per layer under --profile");
  cmd->add_option("--mla-peer", args.mla_peer,
                  "command printing PyTorch SDPA's causal attention times (bench/peers/sdpa_mla.py); given --tokens, --heads, --qk-dim and --v-dim, run "
                  "before the engine takes the GPU; compared with the MLA GEMM ops' time per layer");
  cmd->add_flag("--flops-only", args.flops_only, "print the FLOPs each prompt must do (TFLOP/s's numerator) and stop; needs no GPU");
  cmd->add_option("-o,--output", args.output, "JSON array the records are appended to");
}

int run_bench_prefill(const BenchPrefillArgs& args) {
  if (!args.random_weights) fail("bench prefill: --config {} needs --random-weights", args.config_path);
  if (args.prompts.empty()) fail("bench prefill: --prompt needs at least one length");
  for (int64_t p : args.prompts) {
    if (p < 1 || p > (int64_t{1} << 20)) fail("--prompt {}: expected 1..1048576", p);
  }
  if (args.chunk < 0 || args.chunk > PlanLimits::kMaxTokens) fail("--chunk {}: expected 1..{}", args.chunk, PlanLimits::kMaxTokens);
  if (args.cached_prefix < 0 || args.cached_prefix > (int64_t{1} << 20)) fail("--cached-prefix {}: expected 0..1048576", args.cached_prefix);
  if (args.reps < 1) fail("--reps must be >= 1, found {}", args.reps);
  const std::unique_ptr<LoadedModel> model = LoadedModel::describe(args.config_path);
  const DType dtype = config_dtype(model->config);
  if (args.flops_only) {
    for (int64_t p : args.prompts) {
      const PrefillFlops f = prefill_flops(*model, p, args.cached_prefix);
      std::cout << json{{"prompt_tokens", p}, {"dense", f.dense}, {"experts_routed", f.experts}, {"attention_qk_pv", f.attention}, {"total", f.total()}}.dump() << "\n";
    }
    return 0;
  }
  const int gpu = 0;
  const int sms = cuda::CudaBackend::sm_count(gpu);
  const int workers = args.workers > 0 ? args.workers : sms;
  const std::string device = cuda::CudaBackend::device_name(gpu);
  const std::string rev = git_revision();
  auto chunk_of = [&](int64_t prompt) { return std::min(args.chunk > 0 ? args.chunk : kGpuPrefillChunk, prompt); };
  std::set<int64_t> chunks;
  for (int64_t p : args.prompts) chunks.insert(chunk_of(p));
  const int64_t max_context = args.cached_prefix + *std::max_element(args.prompts.begin(), args.prompts.end()) + 8;
  std::cerr << fmt::format("bench prefill: {} ({} SMs), {} activations\n", device, sms, dtype_name(dtype));

  // The kernel peers first, on an idle GPU: one layer's shape at each prompt length.
  std::string lengths;
  for (int64_t p : args.prompts) lengths += (lengths.empty() ? "" : ",") + std::to_string(p);
  const ModelConfig& cfg = model->config;
  const int64_t kda_layers = cfg.num_layers_of(MixerKind::kKda), mla_layers = cfg.num_layers_of(MixerKind::kMla);
  const std::map<int64_t, json> kda_peer =
      args.kda_peer.empty() || kda_layers == 0
          ? std::map<int64_t, json>{}
          : run_length_peer("bench prefill", "KDA", fmt::format("{} --tokens {} --heads {} --dim {}", args.kda_peer, lengths, cfg.kda.num_heads, cfg.kda.head_dim));
  const std::map<int64_t, json> mla_peer =
      args.mla_peer.empty() || mla_layers == 0
          ? std::map<int64_t, json>{}
          : run_length_peer("bench prefill", "MLA", fmt::format("{} --tokens {} --heads {} --qk-dim {} --v-dim {}", args.mla_peer, lengths, cfg.num_attention_heads,
                                               cfg.mla_qk_head_dim(), cfg.v_head_dim));

  const double roofline_gbps = cuda::measure_read_bandwidth_gbps(int64_t{4} << 30, gpu);
  std::cerr << fmt::format("read roofline {:.0f} GB/s\n", roofline_gbps);
  // One routed expert's weights in one MoE layer (gate, up, down): a part of every expert stack, as
  // decode_bytes counts them, over the layers (moe_gate_up ops).
  double expert_bytes = 0;
  int64_t moe_layers = 0;
  for (const WeightDecl& decl : model->graph.weights()) {
    if (decl.parts.size() > 1) expert_bytes += weight_bytes(decl, dtype);
  }
  for (const Node& node : model->graph.nodes()) moe_layers += node.op == Op::kMoeGateUp ? 1 : 0;
  if (moe_layers > 0) expert_bytes /= static_cast<double>(moe_layers);
  auto weights = cuda::random_device_weights(model->graph, args.seed, dtype);
  auto backend = make_backend(*model, weights, chunks, workers, max_context, dtype, true);
  backend->set_expert_timing(true);  // two event records per MoE op: the routed experts' share of TTFT
  backend->set_mla_timing(true);     // and per MLA op: attention's share
  backend->set_kda_timing(true);     // and per planned KDA op: the delta rule's
  // Today's path on the same weights (its own plans and arena), timed after ours at each prompt.
  auto gemv = args.gemv_peer ? make_backend(*model, weights, chunks, workers, max_context, dtype, false) : nullptr;
  // The GEMM path with MLA on its op body, to see what the MLA GEMMs changed.
  auto mla_body = args.mla_body_peer ? make_backend(*model, weights, chunks, workers, max_context, dtype, true, false) : nullptr;
  // And with KDA on its op body (prep and scan inside the megakernel), to see what the planned launches changed.
  auto kda_body = args.kda_body_peer ? make_backend(*model, weights, chunks, workers, max_context, dtype, true, true, false) : nullptr;
  // And with each linear's tasks rounding its GEMM output in a pass of their own, as before the readers did.
  auto own_rounding = args.rounding_peer ? make_backend(*model, weights, chunks, workers, max_context, dtype, true, true, true, false) : nullptr;
  for (int64_t p : args.prompts) {
    const int64_t chunk = chunk_of(p);
    const int64_t mla_ops_before = backend->prefill_mla_ops(), kda_ops_before = backend->prefill_kda_ops();
    // The prefix: other ids than the prompt's (a different seed of the same generator).
    const std::vector<int32_t> prefix = prompt_ids(args.cached_prefix, model->config.vocab_size, 2);
    const std::vector<int32_t> ids = prompt_ids(p, model->config.vocab_size);
    double expert_sum = 0, mla_sum = 0, mla_attention_sum = 0, kda_sum = 0, kda_prep_sum = 0;  // the timed parts' shares (the prefix's ops excluded)
    double sort_sum = 0, expert_gemm_sum = 0;
    int64_t experts_streamed = 0;        // distinct experts over the timed runs' MoE ops
    const std::vector<double> runs = time_prompt(*backend, prefix, ids, chunk, args.reps, [&](bool start) {
      expert_sum += start ? -backend->expert_ms() : backend->expert_ms();
      const cuda::CudaBackend::ExpertParts parts = backend->expert_parts_ms();
      sort_sum += start ? -parts.sort_ms : parts.sort_ms;
      expert_gemm_sum += start ? -parts.gemm_ms : parts.gemm_ms;
      mla_sum += start ? -backend->mla_ms() : backend->mla_ms();
      mla_attention_sum += start ? -backend->mla_attention_ms() : backend->mla_attention_ms();
      kda_sum += start ? -backend->kda_ms() : backend->kda_ms();
      kda_prep_sum += start ? -backend->kda_prep_ms() : backend->kda_prep_ms();
      if (start) backend->reset_expert_routing_stats();
      if (!start) experts_streamed += backend->expert_routing().experts;
    });
    const double expert_ms = expert_sum / args.reps;
    const std::string expert_gemm = expert_ms <= 0 ? "none (the op bodies)" : backend->last_expert_gemm();
    // Each op streams its distinct experts' weights once (gate_up reads w1 and w3, down w2).
    const double expert_weight_bytes = expert_bytes * static_cast<double>(experts_streamed) / args.reps;
    const double expert_gbps = expert_ms > 0 ? expert_weight_bytes / (expert_ms * 1e-3) / 1e9 : 0.0;
    const double mla_ms = mla_sum / args.reps, mla_attention_ms = mla_attention_sum / args.reps;
    const bool mla_gemm = backend->prefill_mla_ops() > mla_ops_before;
    const double kda_ms = kda_sum / args.reps, kda_prep_ms = kda_prep_sum / args.reps;
    const bool kda_planned = backend->prefill_kda_ops() > kda_ops_before;
    const double ttft = median(runs);
    const PrefillFlops flops = prefill_flops(*model, p, args.cached_prefix);
    const Plan* plan = &backend->plan(1);  // plans: decode, then the prefill chunks in ascending order
    for (int i = 2; plan->max_tokens != chunk; ++i) plan = &backend->plan(i);
    // Kernel level, at this chunk: every plain linear shape of the plan, ours vs cuBLAS alone.
    json shapes = json::array();
    double gemm_ms_per_chunk = 0;
    std::vector<double> of_cublas, gemm_of_cublas;  // cuBLAS's time over ours: with the input's conversion, and without
    // The step as a whole (its output op left out): every linear's GEMM on a converted input plus each
    // conversion the step makes (by its input's width, step_gemms), against cuBLAS alone on each linear.
    const StepGemms step = step_gemms(*plan);
    std::map<int64_t, double> convert_ms;  // by the input's width: its conversion at this chunk
    double step_gemm_ms = 0, step_cublas_ms = 0;
    for (const auto& [shape, count] : linear_shapes(*plan)) {
      const auto [out, in] = shape;
      const cuda::GemmTimes t = cuda::time_prefill_gemm(chunk, out, in, 20, gpu);
      const double f = 2.0 * static_cast<double>(chunk * out * in);
      gemm_ms_per_chunk += t.ours_ms * count;
      of_cublas.push_back(t.cublas_ms / t.ours_ms);
      gemm_of_cublas.push_back(t.cublas_ms / t.ours_gemm_ms);
      convert_ms.emplace(in, t.convert_ms);
      if (auto it = step.shapes.find(shape); it != step.shapes.end()) {
        step_gemm_ms += t.ours_gemm_ms * it->second;
        step_cublas_ms += t.cublas_ms * it->second;
      }
      shapes.push_back({{"rows", chunk}, {"in", in}, {"out", out}, {"count", count}, {"ours_ms", t.ours_ms}, {"ours_tflops", f / (t.ours_ms * 1e9)},
                        {"ours_gemm_ms", t.ours_gemm_ms}, {"ours_gemm_tflops", f / (t.ours_gemm_ms * 1e9)},
                        {"cublas_bf16_ms", t.cublas_ms}, {"cublas_bf16_tflops", f / (t.cublas_ms * 1e9)}, {"convert_ms", t.convert_ms}});
    }
    double step_convert_ms = 0;
    int step_conversions = 0;
    for (const auto& [in, count] : step.conversions) {
      const auto it = convert_ms.find(in);  // a width only router logits read: timed here
      const double ms = it != convert_ms.end() ? it->second : cuda::time_prefill_gemm(chunk, 1, in, 20, gpu).convert_ms;
      step_convert_ms += ms * count;
      step_conversions += count;
    }
    json step_record = nullptr;
    if (step_cublas_ms > 0) {
      step_record = {{"ours_ms", step_gemm_ms + step_convert_ms}, {"gemms_ms", step_gemm_ms}, {"conversions", step_conversions},
                     {"conversions_ms", step_convert_ms}, {"cublas_bf16_ms", step_cublas_ms},
                     {"of_cublas", step_cublas_ms / (step_gemm_ms + step_convert_ms)}};
    }
    if (!of_cublas.empty()) {
      std::cerr << fmt::format("  projection GEMMs, {} shapes at {} rows: {:.0f}–{:.0f}% of cuBLAS's speed (bf16 in and out) with the input's conversion, "
                               "{:.0f}–{:.0f}% on a converted input\n",
                               of_cublas.size(), chunk, 100 * std::ranges::min(of_cublas), 100 * std::ranges::max(of_cublas),
                               100 * std::ranges::min(gemm_of_cublas), 100 * std::ranges::max(gemm_of_cublas));
    }
    if (step_cublas_ms > 0) {
      std::cerr << fmt::format("  a step's linears but the LM head: {:.2f} ms of GEMMs and {:.2f} ms for its {} input conversions, {:.0f}% of cuBLAS's speed "
                               "({:.2f} ms, bf16 in and out)\n",
                               step_gemm_ms, step_convert_ms, step_conversions, 100 * step_cublas_ms / (step_gemm_ms + step_convert_ms), step_cublas_ms);
    }
    const double load = load_max_over_mean(backend->last_expert_tokens());
    json record = {{"kind", "prefill"},
                   {"config", args.config_path},
                   {"backend", "cuda"},
                   {"path", mla_gemm ? "unfused prefill plans, plain linears as cuBLAS GEMMs, routed experts as grouped expert GEMMs and MLA as cuBLAS GEMMs "
                                       "(expanded form) between megakernel segments"
                                     : "unfused prefill plans, plain linears as cuBLAS GEMMs and routed experts as grouped expert GEMMs between megakernel "
                                       "segments; MLA on its op body"},
                   {"dtype", std::string(dtype_name(dtype))},
                   {"prompt_tokens", p},
                   {"cached_prefix", args.cached_prefix},
                   {"chunk", chunk},
                   {"ttft_ms", ttft},
                   {"ttft_ms_runs", runs},
                   {"prompt_tokens_per_second", static_cast<double>(p) / ttft * 1e3},
                   {"flops", {{"dense", flops.dense}, {"experts_routed", flops.experts}, {"attention_qk_pv", flops.attention}, {"total", flops.total()}}},
                   {"tflops", flops.total() / (ttft * 1e9)},
                   {"gemm_ms_estimate", gemm_ms_per_chunk * static_cast<double>(p) / static_cast<double>(chunk)},
                   {"expert_ops_ms", expert_ms},
                   {"expert_gemm", expert_gemm},
                   {"expert_parts_ms",
                    {{"routing_sort", sort_sum / args.reps},
                     {"gemms", expert_gemm_sum / args.reps},
                     {"gathers_and_epilogues", (expert_sum - sort_sum - expert_gemm_sum) / args.reps}}},
                   {"expert_gemm_tflops", expert_gemm_sum > 0 ? json(flops.experts / (expert_gemm_sum / args.reps * 1e9)) : json(nullptr)},  // their multiply-adds ×2 over the GEMMs' time
                   {"expert_weight_bytes", expert_gbps > 0 ? json(expert_weight_bytes) : json(nullptr)},  // null: no dense expert GEMMs ran
                   {"expert_read_gbps", expert_gbps > 0 ? json(expert_gbps) : json(nullptr)},
                   {"roofline_read_gbps", roofline_gbps},
                   {"expert_roofline_fraction", expert_gbps > 0 ? json(expert_gbps / roofline_gbps) : json(nullptr)},
                   {"expert_load_max_over_mean", load},
                   {"mla_ops_ms", mla_ms},
                   {"mla_attention_ms", mla_gemm ? json(mla_attention_ms) : json(nullptr)},  // of mla_ops_ms, the attention alone
                   {"mla_gemm", mla_gemm},
                   {"kda_ops_ms", kda_planned ? json(kda_ms) : json(nullptr)},  // null: the op body ran (timed under --profile only)
                   {"kda_parts_ms", kda_planned ? json{{"prep", kda_prep_ms}, {"scan", kda_ms - kda_prep_ms}} : json(nullptr)},
                   {"workers", workers},
                   {"plan", {{"max_tokens", plan->max_tokens}, {"ops", plan->ops.size()}, {"tasks", plan->tasks.size()}, {"fusion", false}}},
                   {"device", device},
                   {"git_rev", rev},
                   {"command", args.command_line},
                   {"gemm_step", step_record},  // step_gemms: the step's linears (not its LM head) with each input's conversion once
                   {"peers", {{"gemm_shapes", shapes}}}};
    std::cerr << fmt::format("prompt {:6d}{} (chunk {:5d}): TTFT {:9.1f} ms, {:8.0f} tokens/s, {:6.1f} TFLOP/s; routed experts {:8.1f} ms (busiest expert {:.1f}x the mean); MLA {:8.1f} ms{}; KDA {}\n", p,
                             args.cached_prefix > 0 ? fmt::format(" after {} cached", args.cached_prefix) : "", chunk, ttft, static_cast<double>(p) / ttft * 1e3, flops.total() / (ttft * 1e9), expert_ms, load, mla_ms, mla_gemm ? "" : " (op body: not timed)",
                             kda_planned ? fmt::format("{:.1f} ms (prep {:.1f}, scan {:.1f})", kda_ms, kda_prep_ms, kda_ms - kda_prep_ms)
                                         : std::string("on its op body (not timed)"));
    if (expert_gbps > 0) {
      std::cerr << fmt::format("  routed experts ({}): {:.2f} GB of expert weights streamed, {:.0f} GB/s ({:.0f}% of the read roofline)\n", expert_gemm,
                               expert_weight_bytes / 1e9, expert_gbps, 100.0 * expert_gbps / roofline_gbps);
      const double gemm_ms = expert_gemm_sum / args.reps;  // 0 when every step took the expert GEMV
      std::cerr << fmt::format("  of their {:.1f} ms: routing sort {:.1f}, GEMMs {:.1f}{}, gathers and epilogues {:.1f}\n", expert_ms, sort_sum / args.reps,
                               gemm_ms, gemm_ms > 0 ? fmt::format(" ({:.0f} GB/s, {:.0f} TFLOP/s)", expert_weight_bytes / (gemm_ms * 1e-3) / 1e9, flops.experts / (gemm_ms * 1e9)) : "",
                               (expert_sum - sort_sum - expert_gemm_sum) / args.reps);
    }
    if (args.expert_peer && expert_gbps > 0) {
      // The same prompt once more with the expert GEMMs on cuBLAS's grouped call: the kernel's peer.
      backend->set_expert_gemm_cublas(true);
      double peer_sum = 0;
      const double ms = median(time_prompt(*backend, prefix, ids, chunk, 1, [&](bool start) { peer_sum += start ? -backend->expert_ms() : backend->expert_ms(); }));
      const std::string peer_path = backend->last_expert_gemm();
      backend->set_expert_gemm_cublas(false);
      const double peer_gbps = expert_weight_bytes / (peer_sum * 1e-3) / 1e9;
      record["peers"]["expert_gemm"] = {{"expert_gemm", peer_path},
                                        {"expert_ops_ms", peer_sum},
                                        {"expert_read_gbps", peer_gbps},
                                        {"expert_roofline_fraction", peer_gbps / roofline_gbps},
                                        {"ttft_ms", ms},
                                        {"speedup_vs_peer", peer_sum / expert_ms},
                                        {"what", "the expert ops (routing read and sort, gather, GEMMs, epilogues) with cuBLAS's grouped GEMM, one run after a "
                                                 "one-chunk warm-up"}};
      std::cerr << fmt::format("  routed experts on {}: {:.1f} ms ({:.0f} GB/s), ours {:.2f}x; TTFT {:.1f} ms\n", peer_path, peer_sum, peer_gbps,
                               peer_sum / expert_ms, ms);
    }
    if (args.mla_flash_peer && mla_gemm) {
      // The same prompt once more with the attention on the mma.sync flash kernel: the wgmma kernel's peer.
      backend->set_mla_flash_mma_sync(true);
      double peer_sum = 0;
      const double ms = median(time_prompt(*backend, prefix, ids, chunk, 1, [&](bool start) { peer_sum += start ? -backend->mla_ms() : backend->mla_ms(); }));
      backend->set_mla_flash_mma_sync(false);
      record["peers"]["mla_flash_mma_sync"] = {{"mla_ops_ms", peer_sum},
                                               {"ttft_ms", ms},
                                               {"speedup_vs_peer", mla_ms > 0 ? peer_sum / mla_ms : 0.0},
                                               {"what", "the MLA ops (append, K/V expansion, attention) with the attention on the mma.sync flash kernel "
                                                        "(values expanded row by row), one run after a one-chunk warm-up"}};
      std::cerr << fmt::format("  MLA with the mma.sync flash kernel: {:.1f} ms, ours {:.2f}x; TTFT {:.1f} ms\n", peer_sum, mla_ms > 0 ? peer_sum / mla_ms : 0.0, ms);
    }
    if (gemv) {
      const double ms = median(time_prompt(*gemv, prefix, ids, chunk, 1));
      record["peers"]["gemv_path"] = {{"ttft_ms", ms}, {"tflops", flops.total() / (ms * 1e9)}, {"plans", "fused prefill plans, GEMV bodies (one run after a one-chunk warm-up)"}};
      std::cerr << fmt::format("  today's path (fused plans, GEMV bodies): TTFT {:9.1f} ms\n", ms);
    }
    if (mla_body) {
      const double ms = median(time_prompt(*mla_body, prefix, ids, chunk, 1));
      record["peers"]["mla_body"] = {{"ttft_ms", ms}, {"tflops", flops.total() / (ms * 1e9)},
                                     {"plans", "the same GEMM path with mla_attention on its op body (one run after a one-chunk warm-up)"}};
      std::cerr << fmt::format("  MLA on its op body: TTFT {:9.1f} ms\n", ms);
    }
    if (kda_body) {
      const double ms = median(time_prompt(*kda_body, prefix, ids, chunk, 1));
      record["peers"]["kda_body"] = {{"ttft_ms", ms}, {"tflops", flops.total() / (ms * 1e9)},
                                     {"plans", "the same GEMM path with kda_delta_rule on its op body (one run after a one-chunk warm-up)"}};
      std::cerr << fmt::format("  KDA on its op body: TTFT {:9.1f} ms (planned: {:.1f} ms of KDA ops, {:.2f} ms a layer)\n", ms, kda_ms,
                               kda_ms / static_cast<double>(std::max<int64_t>(kda_layers, 1)));
    }
    if (own_rounding) {
      const std::vector<double> own = time_prompt(*own_rounding, prefix, ids, chunk, args.reps);
      const double ms = median(own);
      record["peers"]["linears_round_own_output"] = {
          {"ttft_ms", ms}, {"ttft_ms_runs", own}, {"tflops", flops.total() / (ms * 1e9)},
          {"linears_rounded_by_readers", backend->prefill_linears_rounded_by_readers()},
          {"plans", "the same GEMM path with every plain linear's tasks rounding its output (--reps runs after a one-chunk warm-up)"}};
      std::cerr << fmt::format("  linears rounding their own outputs: TTFT {:9.1f} ms ({} linears' outputs rounded by their readers here)\n", ms,
                               backend->prefill_linears_rounded_by_readers());
    }
    if (args.profile) {
      // One more run, every op its own launch between events: where the time goes (slower than the
      // timed runs: no megakernel, a host wait per step).
      backend->set_op_timing(true);
      backend->reset_op_times();
      const double ms = median(time_prompt(*backend, prefix, ids, chunk, 1, [&](bool start) {
        if (start) backend->reset_op_times();
      }));
      backend->set_op_timing(false);
      json rows = json::array();
      double total = 0;
      for (const cuda::OpcodeProfile& o : backend->op_times()) total += o.ms;
      std::cerr << fmt::format("  profile (one launch per op, {:.1f} ms in all, {:.1f} ms of ops):\n", ms, total);
      for (const cuda::OpcodeProfile& o : backend->op_times()) {
        rows.push_back({{"op", o.op}, {"ms", o.ms}, {"tasks", o.tasks}, {"share", o.ms / total}});
        std::cerr << fmt::format("    {:<22} {:9.2f} ms {:5.1f}%  {:9d} tasks\n", o.op, o.ms, 100.0 * o.ms / total, o.tasks);
      }
      record["profile"] = {{"ttft_ms_one_launch_per_op", ms}, {"rows", rows}};
    }
    if (!args.kda_peer.empty()) {
      // Equal work: the prompt through one KDA layer's delta rule (ours: the planned KDA ops' stream
      // time, or else the profile's kda_delta_rule time, over the prompt's chunks, per layer; fla: one
      // chunk_kda call over the whole prompt).
      double ours = kda_planned ? kda_ms / static_cast<double>(kda_layers) : -1;
      if (!kda_planned && args.profile) {
        for (const cuda::OpcodeProfile& o : backend->op_times()) {
          if (o.op == "kda_delta_rule") ours = o.ms / static_cast<double>(kda_layers);
        }
      }
      record["peers"]["fla_chunk_kda"] =
          peer_entry(kda_peer, p, ours,
                     fmt::format("fla chunk_kda, one layer: {} tokens x {} heads x {} (bf16 q/k/v, fp32 g and state, l2norm in kernel); "
                                 "ours: kda_ops_ms (planned launches) or kda_delta_rule under --profile, per layer",
                                 p, cfg.kda.num_heads, cfg.kda.head_dim),
                     "KDA");
    }
    if (!args.mla_peer.empty()) {
      // The causal pairs of the prompt through one MLA layer (ours: the MLA GEMM ops' stream time over
      // the prompt's chunks, per layer, which also expands K and V from the latents; SDPA: one causal
      // call over the whole prompt).
      const double ours = mla_gemm ? mla_ms / static_cast<double>(mla_layers) : -1;
      record["peers"]["sdpa_attention"] =
          peer_entry(mla_peer, p, ours,
                     fmt::format("PyTorch SDPA, causal, one layer: {} tokens x {} heads, q/k {} and v {} wide, bf16; ours: mla_ops_ms per layer "
                                 "(expansion of K/V included), ours_attention_ms_per_layer the attention alone{}",
                                 p, cfg.num_attention_heads, cfg.mla_qk_head_dim(), cfg.v_head_dim,
                                 args.cached_prefix > 0 ? fmt::format("; ours also attends to the {} cached positions, SDPA does not", args.cached_prefix) : ""),
                     "MLA");
      // The same work as SDPA's: the attention alone, without the latents' append and the K/V expansion.
      json& sdpa = record["peers"]["sdpa_attention"];
      if (mla_gemm && mla_attention_ms > 0 && sdpa.contains("ms")) {
        const double attention = mla_attention_ms / static_cast<double>(mla_layers);
        sdpa["ours_attention_ms_per_layer"] = attention;
        sdpa["attention_speedup_vs_peer"] = sdpa["ms"].get<double>() / attention;
        std::cerr << fmt::format("  MLA attention alone, one layer: ours {:.3f} ms, peer {:.3f} ms ({:.2f}x)\n", attention, sdpa["ms"].get<double>(),
                                 sdpa["ms"].get<double>() / attention);
      }
    }
    append_records(args.output, json::array({record}));  // each prompt's record as soon as it is measured
    std::cout << record.dump() << "\n";
  }
  return 0;
}

}  // namespace plow::tools
