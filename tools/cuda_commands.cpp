// generate --backend cuda|cuda-eager, and `plow bench decode`: decode steps of the megakernel and of
// cuda-eager on the same weights and state, the read roofline measured in the same run, an optional
// HF transformers peer run after the engine has given its memory back, and an optional per-opcode
// profile. Records are appended to a JSON array in bench/results. With --tp N the command starts
// itself once per GPU (rank r on device r); the ranks join one NCCL group through a unique id written
// to a file, run the same points in lockstep, and rank 0 writes the records.
#include "tools/cuda_commands.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/error.h"
#include "engine/plans.h"
#include "engine/scheduler.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/nccl_comm.h"

namespace plow::tools {

double weight_bytes(const WeightDecl& decl, DType dtype) {
  double n = 1;
  for (int64_t d : decl.shape) n *= static_cast<double>(d);
  if (decl.mxfp4) return n * (0.5 + 1.0 / 32.0);
  const bool f32 = decl.name.ends_with("A_log") || decl.name.ends_with("dt_bias") || decl.name.ends_with("e_score_correction_bias");
  return n * (f32 ? 4.0 : static_cast<double>(dtype_size(dtype)));
}

namespace {

using nlohmann::json;

// Bytes one decode step of `batch` sequences at `context` must read at least: every dense weight once,
// the expected number of distinct experts under uniform routing (E·(1 − (1 − k/E)^B)) per expert
// stack, B embedding rows, the MLA latent caches (rows of the activation dtype, `dtype` here: the cuda
// backend's DeviceState) and the fp32 KDA/conv state read and written.
double decode_bytes(const LoadedModel& model, int64_t batch, int64_t context, DType dtype) {
  const Graph& graph = model.graph;
  double bytes = 0;
  std::set<int> counted;
  for (const Node& node : graph.nodes()) {
    for (int w : node.weights) {
      const WeightDecl& decl = graph.weights()[static_cast<size_t>(w)];
      if (node.op == Op::kEmbedding) {
        bytes += static_cast<double>(batch) * weight_bytes(decl, dtype) / static_cast<double>(decl.shape[0]);
        continue;
      }
      if (!counted.insert(w).second) continue;
      const double total = weight_bytes(decl, dtype) * static_cast<double>(decl.parts.size());  // every part of a stack
      if (decl.parts.size() > 1) {
        const double experts = static_cast<double>(decl.parts.size());
        const double k = static_cast<double>(model.config.experts_per_token);
        bytes += total * (1.0 - std::pow(1.0 - k / experts, static_cast<double>(batch)));
      } else {
        bytes += total;
      }
    }
  }
  for (const StateDecl& state : graph.states()) {
    switch (state.kind) {
      case StateKind::kMlaLatent: bytes += static_cast<double>(batch * context * state.width * static_cast<int64_t>(dtype_size(dtype))); break;
      case StateKind::kKdaRecurrent: bytes += 2.0 * static_cast<double>(batch * state.width * (state.width / state.depth)) * 4.0; break;
      case StateKind::kConvWindow: bytes += 2.0 * static_cast<double>(batch * state.width * state.depth) * 4.0; break;
    }
  }
  return bytes;
}

// Decode steps the profile traces for the critical path (their figures are averaged).
constexpr int kTracedSteps = 5;

// The traced steps' critical paths, averaged a step: the span, what its bodies, hops (a producer's end
// to its consumer's start) and queue gaps take, and the same by opcode.
json critical_path_record(const std::vector<CriticalPath>& paths) {
  const double n = std::max<double>(1.0, static_cast<double>(paths.size()));
  double span = 0, run = 0, hop = 0, queue = 0, lead = 0, tasks = 0, hops = 0;
  std::map<std::string, CriticalPathOp> by_op;
  for (const CriticalPath& path : paths) {
    span += path.span_ns, run += path.run_ns, hop += path.hop_ns, queue += path.queue_ns, lead += path.lead_ns;
    tasks += static_cast<double>(path.tasks), hops += static_cast<double>(path.hops);
    for (const CriticalPathOp& op : path.ops) {
      CriticalPathOp& sum = by_op[op.op];
      sum.op = op.op;
      sum.tasks += op.tasks, sum.run_ns += op.run_ns, sum.hop_ns += op.hop_ns, sum.queue_ns += op.queue_ns;
    }
  }
  std::vector<CriticalPathOp> ops;
  for (auto& [name, op] : by_op) ops.push_back(op);
  std::sort(ops.begin(), ops.end(), [](const CriticalPathOp& a, const CriticalPathOp& b) { return a.run_ns + a.hop_ns + a.queue_ns > b.run_ns + b.hop_ns + b.queue_ns; });
  json rows = json::array();
  for (const CriticalPathOp& op : ops) {
    rows.push_back({{"op", op.op}, {"tasks", static_cast<double>(op.tasks) / n}, {"run_ms", op.run_ns / n * 1e-6}, {"hop_ms", op.hop_ns / n * 1e-6},
                    {"queue_ms", op.queue_ns / n * 1e-6}});
  }
  return {{"steps", paths.size()}, {"span_ms", span / n * 1e-6}, {"tasks", tasks / n}, {"hops", hops / n}, {"run_ms", run / n * 1e-6},
          {"hop_ms", hop / n * 1e-6}, {"queue_ms", queue / n * 1e-6}, {"lead_ms", lead / n * 1e-6}, {"by_op", rows}};
}

void print_critical_path(int64_t batch, int64_t context, const json& path) {
  std::cerr << fmt::format("batch {} context {}: critical path {:.3f} ms over {:.0f} tasks: bodies {:.3f} ms, {:.0f} hops {:.3f} ms ({:.2f} us each), queue gaps {:.3f} ms\n",
                           batch, context, path["span_ms"].get<double>(), path["tasks"].get<double>(), path["run_ms"].get<double>(), path["hops"].get<double>(),
                           path["hop_ms"].get<double>(), 1e3 * path["hop_ms"].get<double>() / std::max(1.0, path["hops"].get<double>()), path["queue_ms"].get<double>());
  for (const json& op : path["by_op"]) {
    std::cerr << fmt::format("  {:<24} {:6.1f} tasks  run {:7.3f} ms  hops {:7.3f} ms  queue {:7.3f} ms\n", op["op"].get<std::string>(), op["tasks"].get<double>(),
                             op["run_ms"].get<double>(), op["hop_ms"].get<double>(), op["queue_ms"].get<double>());
  }
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const LoadedModel& model, DType act, int64_t max_context, int64_t prefill_chunk, bool eager, int workers) {
  if (workers <= 0) workers = cuda::CudaBackend::sm_count();
  std::vector<Plan> plans;
  plans.push_back(compile_plan(model, PlanPhase::kDecode, 1, workers, max_context));
  // Prefill plans unfused: their plain linears run as cuBLAS GEMMs (runtime/cuda/prefill_gemm.h).
  if (prefill_chunk > 1) plans.push_back(compile_plan(model, PlanPhase::kPrefill, prefill_chunk, workers, max_context, false));
  cuda::CudaOptions options;
  options.act_dtype = act;
  options.num_slots = 1;
  options.max_context_tokens = max_context;
  options.eager = eager;
  return std::make_unique<cuda::CudaBackend>(model.graph, cuda::upload_weights(model.graph, *model.weights), std::move(plans), options);
}

void add_bench_decode_options(CLI::App* cmd, BenchDecodeArgs& args) {
  auto* dir = cmd->add_option("--model", args.model_dir, "model directory (config.json + safetensors)");
  auto* config = cmd->add_option("--config", args.config_path, "config.json of a model to draw on the device")->excludes(dir);
  cmd->add_flag("--random-weights", args.random_weights, "with --config: draw every weight on the device from --seed")->needs(config);
  cmd->add_option("--seed", args.seed, "weights' seed");
  cmd->add_option("--batch", args.batches, "decode batch sizes, comma-separated")->delimiter(',');
  cmd->add_option("--context", args.contexts, "cached tokens per sequence, comma-separated")->delimiter(',');
  cmd->add_option("--steps", args.steps, "timed decode steps per point");
  cmd->add_option("--workers", args.workers, "megakernel blocks (default: one per SM)");
  cmd->add_option("--light-task-elements", args.light_task_elements, "decode plans: at most one task of a light op per this many output elements")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--attn-res-chunk", args.attn_res_chunk, "AttnRes work items: at least this many columns a chunk (0: about one item a task a phase)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--shadow-tail-workers", args.shadow_tail_workers,
                  "decode plans: workers that run a top-k's shadow tail (the shared expert's down projection) beside the routed experts (0: in the shadow)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--disable-rule", args.disabled_rules, "decode plans: compile without this compiler rule (docs/compiler.md; repeatable), to time a fusion against its absence");
  cmd->add_flag("--profile", args.profile, "per-opcode time, bytes and bandwidth; the megakernel's wait and run time");
  cmd->add_flag("--served-sampling", args.served_sampling,
                "also time each batch's steps through the scheduler (host work included): greedy ids vs logits, sampling on the host vs the device");
  cmd->add_flag_callback("--gemm-plans", [&args] { args.gemm_plans = true; },
                         "also time batches of at least --gemm-min-rows sequences on an unfused prefill plan (projections and experts as GEMMs, the rest on op "
                         "bodies), as `plow serve` runs them: peer cuda-gemm-plan, and the record's served_ms_per_step (default: on for one GPU, off with --tp)");
  cmd->add_flag_callback("--no-gemm-plans", [&args] { args.gemm_plans = false; }, "time the decode plans only");
  cmd->add_option("--gemm-min-rows", args.gemm_min_rows, "with --gemm-plans: the fewest rows a step runs on the GEMM path with (default: serving's, 8)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--gemm-plan-tokens", args.gemm_plan_tokens,
                  fmt::format("with --gemm-plans: one prefill plan of this many rows for every such batch (default {}, serve's --max-num-batched-tokens; 0: one "
                              "per batch, of its size)",
                              kGpuPrefillChunk))
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--bytes-only", args.bytes_only, "print the bytes each point must read (the roofline's numerator) and stop; needs no GPU");
  cmd->add_flag("--diagnose", args.diagnose, "time the first batch's decode ops one launch at a time (10 s timeout each), then stop");
  cmd->add_option("-o,--output", args.output, "JSON array the records are appended to");
  cmd->add_option("--hf-peer", args.hf_peer, "command printing the HF transformers peer's records (run after the engine frees the GPU)");
  cmd->add_option("--tp", args.tp, "tensor-parallel ranks: one process per GPU, all-reduce over NCCL")->check(CLI::Range(1, 8));
  // Set by a --tp run for the processes it starts (not for users).
  cmd->add_option("--tp-rank", args.tp_rank)->group("");
  cmd->add_option("--tp-id", args.tp_id_file)->group("");
}

namespace {

// --tp N: the NCCL group's id into a file, then this command once per rank with --tp-rank r --tp-id
// FILE; waits for all of them. When one rank fails the others are stopped (they would wait for it in
// a collective forever).
int launch_ranks(const BenchDecodeArgs& args) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < args.tp) fail("bench decode --tp {}: needs {} GPUs, this machine has {}", args.tp, args.tp, devices);
  if (!args.hf_peer.empty()) fail("bench decode --tp: --hf-peer measures one GPU; run it without --tp");
  const std::string path = write_nccl_id_file("bench decode --tp");
  std::vector<pid_t> children;
  for (int r = 0; r < args.tp; ++r) {
    std::vector<std::string> argv = args.argv;
    argv[0] = "/proc/self/exe";
    for (const std::string& extra : {std::string("--tp-rank"), std::to_string(r), std::string("--tp-id"), std::string(path)}) argv.push_back(extra);
    std::vector<char*> c_argv;
    for (std::string& a : argv) c_argv.push_back(a.data());
    c_argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, c_argv.data(), environ) != 0) {
      for (pid_t child : children) kill(child, SIGKILL);
      fail("bench decode --tp: cannot start rank {}", r);
    }
    children.push_back(pid);
  }
  int failed = 0;
  for (size_t done = 0; done < children.size(); ++done) {
    int status = 0;
    const pid_t pid = wait(&status);
    if (pid < 0) break;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed += 1;
      for (pid_t child : children) {
        if (child != pid) kill(child, SIGKILL);
      }
    }
  }
  unlink(path.c_str());
  if (failed) fail("bench decode --tp {}: a rank failed (its error is above); the other ranks were stopped", args.tp);
  return 0;
}

// A backend that never answers with ids: greedy steps as they ran before StepInputs::argmax_only.
class LogitsOnly : public Backend {
 public:
  explicit LogitsOnly(Backend& inner) : inner_(inner) {}
  StepOutput step(const StepInputs& inputs) override {
    StepInputs copy = inputs;
    copy.argmax_only = false;
    return inner_.step(copy);
  }
  void reset_slot(int slot) override { inner_.reset_slot(slot); }
  int64_t context_tokens(int slot) const override { return inner_.context_tokens(slot); }
  int num_slots() const override { return inner_.num_slots(); }
  DType act_dtype() const override { return inner_.act_dtype(); }

 private:
  Backend& inner_;
};

// Wall-clock ms of a scheduler step with `batch` sequences decoding (one-token prompts, so context ~0),
// `steps` of them after the prompt step and one more: what `serve` spends a step, host work included.
double served_step_ms(Backend& backend, int64_t batch, int steps, const SamplingParams& sampling) {
  Scheduler scheduler(backend, {});
  for (int64_t i = 0; i < batch; ++i) {
    Request r;
    r.id = fmt::format("bench-{}", i);
    r.prompt = {static_cast<int32_t>(1 + i)};
    r.sampling = sampling;
    r.sampling.seed = static_cast<uint64_t>(i);
    r.max_tokens = steps + 3;
    scheduler.submit(r, [](int32_t, const SampledToken&, std::optional<FinishReason>) {});
  }
  scheduler.step();
  scheduler.step();
  const auto start = std::chrono::steady_clock::now();
  for (int n = 0; n < steps; ++n) scheduler.step();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
  while (scheduler.has_work()) scheduler.step();
  return ms;
}

}  // namespace

int run_bench_decode(const BenchDecodeArgs& args) {
  if (args.model_dir.empty() && args.config_path.empty()) fail("bench decode: one of --model DIR or --config FILE is required");
  if (!args.config_path.empty() && !args.random_weights) fail("bench decode: --config {} needs --random-weights", args.config_path);
  if (args.steps < 1) fail("--steps must be >= 1, found {}", args.steps);
  for (int64_t b : args.batches) {
    if (b < 1 || b > 1024) fail("--batch {}: expected 1..1024", b);
  }
  for (int64_t c : args.contexts) {
    if (c < 0 || c > (int64_t{1} << 20)) fail("--context {}: expected 0..1048576", c);
  }
  if (args.tp > 1 && args.tp_rank < 0 && !args.bytes_only) return launch_ranks(args);
  const bool ranked = args.tp > 1 && args.tp_rank >= 0;
  if (ranked && (args.tp_rank >= args.tp || args.tp_id_file.empty())) fail("bench decode: --tp-rank {} of --tp {} needs --tp-id", args.tp_rank, args.tp);
  const TpShard shard{ranked ? args.tp_rank : 0, args.tp};
  const bool quiet = ranked && args.tp_rank != 0;  // rank 0 reports
  const std::unique_ptr<LoadedModel> model = args.model_dir.empty() ? LoadedModel::describe(args.config_path, shard) : LoadedModel::load(args.model_dir, shard);
  const DType dtype = args.model_dir.empty() ? config_dtype(model->config) : model->weights->storage_dtype();
  if (args.bytes_only) {  // the byte model alone (no GPU needed): one line per point
    for (int64_t b : args.batches) {
      for (int64_t c : args.contexts) std::cout << json{{"batch", b}, {"context", c}, {"bytes_per_step", decode_bytes(*model, b, c, dtype)}}.dump() << "\n";
    }
    return 0;
  }
  const int gpu = shard.rank;
  if (cudaSetDevice(gpu) != cudaSuccess) fail("bench decode: cannot select GPU {}", gpu);
  std::unique_ptr<cuda::NcclComm> comm;
  if (ranked) comm = std::make_unique<cuda::NcclComm>(read_nccl_id_file(args.tp_id_file), shard.rank, shard.size, gpu);
  const int sms = cuda::CudaBackend::sm_count(gpu);
  const int workers = args.workers > 0 ? args.workers : sms;
  // lower_to_plan takes a tail only where the plan has kWorkersPerTailWorker × its workers; a record of a D it ignored would mislead.
  const int64_t tail_needs = LowerOptions::kWorkersPerTailWorker * args.shadow_tail_workers;
  if (tail_needs > workers) fail("bench decode: --shadow-tail-workers {} needs at least {} workers; the plans have {}", args.shadow_tail_workers, tail_needs, workers);
  const std::string device = cuda::CudaBackend::device_name(gpu);
  const std::string rev = git_revision();
  const double roofline_gbps = cuda::measure_read_bandwidth_gbps(int64_t{4} << 30, gpu);
  if (!quiet) {
    std::cerr << fmt::format("bench decode: {} ({} SMs), read roofline {:.0f} GB/s{}\n", device, sms, roofline_gbps,
                             ranked ? fmt::format(", rank 0 of {}", args.tp) : "");
  }

  const int64_t max_batch = *std::max_element(args.batches.begin(), args.batches.end());
  const int64_t gemm_min_rows = args.gemm_min_rows > 0 ? args.gemm_min_rows : cuda::kGemmMinRows;
  // The GEMM path is timed where some batch takes it (serve's default on one GPU).
  const bool gemm_plans = args.gemm_plans.value_or(args.tp == 1) && max_batch >= gemm_min_rows;
  // Every plan's bucket must fit a slot's context (lower_to_plan): at context 0 a batch of 32 alone
  // failed ("max_context 8 is below the bucket's 32 tokens").
  const int64_t max_context = std::max({*std::max_element(args.contexts.begin(), args.contexts.end()) + 8, max_batch,
                                        gemm_plans ? args.gemm_plan_tokens : int64_t{0}});
  json records = json::array();
  {
    // The decode plans before the weights: a bad --disable-rule fails before ~100 GB are drawn.
    std::vector<Plan> plans;
    for (int64_t b : args.batches) plans.push_back(compile_plan(*model, PlanPhase::kDecode, b, workers, max_context, true,
                                                                   {args.light_task_elements, args.shadow_tail_workers, args.disabled_rules}));
    auto weights = args.model_dir.empty() ? cuda::random_device_weights(model->graph, args.seed, dtype) : cuda::upload_weights(model->graph, *model->weights);
    // The GEMM path's prefill plans after the decode plans (plan_info[bi] stays the batch's decode plan).
    const auto on_gemm_path = [&](int64_t b) { return gemm_plans && b >= gemm_min_rows; };
    if (gemm_plans && args.gemm_plan_tokens > 0) {
      if (args.gemm_plan_tokens < max_batch) fail("bench decode: --gemm-plan-tokens {} holds no batch of {}", args.gemm_plan_tokens, max_batch);
      plans.push_back(compile_plan(*model, PlanPhase::kPrefill, args.gemm_plan_tokens, workers, max_context, false));
    } else {
      for (int64_t b : args.batches) {
        if (on_gemm_path(b)) plans.push_back(compile_plan(*model, PlanPhase::kPrefill, b, workers, max_context, false));
      }
    }
    std::vector<json> plan_info;
    for (const Plan& p : plans) plan_info.push_back({{"max_tokens", p.max_tokens}, {"tasks", p.tasks.size()}, {"ops", p.ops.size()}});
    cuda::CudaOptions options;
    options.act_dtype = dtype;
    options.num_slots = static_cast<int>(max_batch);
    options.max_context_tokens = max_context;
    options.device = gpu;
    options.comm = comm.get();
    options.gemm_min_rows = gemm_min_rows;
    options.attn_res_min_chunk = args.attn_res_chunk;
    cuda::CudaBackend backend(model->graph, weights, std::move(plans), options);
    if (!quiet) std::cerr << fmt::format("weights on the device: {:.2f} GB\n", static_cast<double>(cuda::device_weight_bytes(*weights)) / 1e9);
    if (args.diagnose) {
      backend.fake_context(args.contexts.front());
      const int stuck = backend.diagnose_decode_step(static_cast<int>(args.batches.front()), 10000.0);
      if (stuck >= 0) std::_Exit(3);  // a kernel that does not finish cannot be reclaimed
      return 0;
    }
    for (size_t bi = 0; bi < args.batches.size(); ++bi) {
      const int64_t batch = args.batches[bi];
      for (int64_t context : args.contexts) {
        backend.fake_context(context);
        backend.set_eager(false);
        const double mega = backend.timed_decode_steps(static_cast<int>(batch), args.steps);
        const bool in_kernel = backend.last_step_peer_all_reduce();
        double nccl = 0;
        if (in_kernel) {  // the same point with the all_reduces as NCCL calls between segments
          backend.set_peer_all_reduce(false);
          nccl = backend.timed_decode_steps(static_cast<int>(batch), args.steps);
          backend.set_peer_all_reduce(true);
        }
        backend.set_eager(true);
        const double eager = backend.timed_decode_steps(static_cast<int>(batch), std::max(5, args.steps / 3));
        backend.set_eager(false);
        const bool on_gemm = on_gemm_path(batch);
        backend.reset_expert_routing_stats();
        const double gemm = on_gemm ? backend.timed_decode_steps(static_cast<int>(batch), args.steps, true) : 0.0;
        const cuda::CudaBackend::ExpertRouting routing = backend.expert_routing();
        const double bytes = decode_bytes(*model, batch, context, dtype);
        const double gbps = bytes / (mega * 1e-3) / 1e9;
        json record = {{"kind", "decode"},
                       {"config", args.model_dir.empty() ? args.config_path : args.model_dir},
                       {"backend", "cuda"},
                       {"dtype", std::string(dtype_name(dtype))},
                       {"batch", batch},
                       {"context", context},
                       {"ms_per_step", mega},
                       {"tokens_per_second", static_cast<double>(batch) / mega * 1e3},
                       {"bytes_per_step", bytes},
                       {"read_bw_gbps", gbps},
                       {"roofline_read_gbps", roofline_gbps},
                       {"roofline_fraction", gbps / roofline_gbps},
                       {"roofline_ms_per_step", bytes / (roofline_gbps * 1e9) * 1e3},
                       {"workers", workers},
                       {"plan", plan_info[bi]},
                       {"light_task_elements", args.light_task_elements},
                       {"disabled_rules", args.disabled_rules},
                       {"shadow_tail_workers", args.shadow_tail_workers},
                       {"attn_res_chunk", args.attn_res_chunk},
                       {"device", device},
                       {"git_rev", rev},
                       {"command", args.command_line},
                       {"peers", {{"cuda-eager", {{"ms_per_step", eager}}}}}};
        // What `plow serve` runs for this batch (choose_step: the GEMM path from gemm_min_rows rows),
        // where this run timed it.
        if (on_gemm || batch < gemm_min_rows) {
          record["served_ms_per_step"] = on_gemm ? gemm : mega;
          record["served_path"] = on_gemm ? "cuda-gemm-plan" : "decode plan (megakernel)";
        }
        if (on_gemm) {
          record["peers"]["cuda-gemm-plan"] = {{"ms_per_step", gemm},
                                               {"plan", fmt::format("prefill of {} rows, unfused, GEMM path from {} rows", args.gemm_plan_tokens > 0 ? args.gemm_plan_tokens : batch, gemm_min_rows)}};
          if (routing.reads > 0) {
            // The routing these steps actually took, against the uniform routing bytes_per_step assumes.
            const double experts = static_cast<double>(model->config.num_experts), k = static_cast<double>(model->config.experts_per_token);
            record["peers"]["cuda-gemm-plan"]["experts_per_moe_op"] = static_cast<double>(routing.experts) / static_cast<double>(routing.reads);
            record["peers"]["cuda-gemm-plan"]["experts_per_moe_op_uniform"] = experts * (1.0 - std::pow(1.0 - k / experts, static_cast<double>(batch)));
          }
        }
        if (args.tp > 1) {
          // Bytes and the roofline are one rank's (every rank reads its own block at the same time).
          record["tp"] = args.tp;
          record["gpus"] = args.tp;
          record["collectives"] = in_kernel ? "all_reduce inside the megakernel over peer-mapped memory (NVLink stores, flags); argmax fold by NCCL all-gather"
                                            : "NCCL all-reduce between megakernel segments (eager: before the op's launch); argmax fold by NCCL all-gather";
          if (in_kernel) record["peers"]["cuda-nccl-segments"] = {{"ms_per_step", nccl}};
        }
        if (args.served_sampling && args.tp == 1 && context == args.contexts.front()) {
          // serve's loop at context ~0 (the prompt and warm-up steps take the slots from their fake context).
          SamplingParams greedy, sampled;
          sampled.temperature = 0.6f;
          sampled.top_p = 0.95f;
          LogitsOnly logits_only(backend);
          json served = {{"context", "~0 (one-token prompts)"}, {"steps", args.steps}, {"sampled_controls", "temperature 0.6, top_p 0.95"}};
          served["greedy_ids_ms"] = served_step_ms(backend, batch, args.steps, greedy);
          served["greedy_logits_ms"] = served_step_ms(logits_only, batch, args.steps, greedy);
          backend.set_device_sampling(false);
          served["sampled_host_ms"] = served_step_ms(backend, batch, args.steps, sampled);
          backend.set_device_sampling(true);  // serve's default
          served["sampled_device_ms"] = served_step_ms(backend, batch, args.steps, sampled);
          record["served_sampling"] = served;
          if (!quiet) std::cerr << fmt::format("batch {}: served steps {}\n", batch, served.dump());
        }
        if (args.profile) {
          backend.set_eager(false);
          const auto profile = backend.profile_decode_step(static_cast<int>(batch));
          double total = 0;
          for (const auto& p : profile) total += p.op.starts_with("megakernel:") ? 0.0 : p.ms;
          json rows = json::array();
          for (const auto& p : profile) {
            rows.push_back({{"op", p.op}, {"tasks", p.tasks}, {"ms", p.ms}, {"share", p.op.starts_with("megakernel:") ? json(nullptr) : json(p.ms / total)},
                            {"weight_gbps", p.ms > 0 ? p.bytes / (p.ms * 1e-3) / 1e9 : 0.0}});
          }
          record["profile"] = {{"eager_ops_ms", total}, {"rows", rows}};
          const std::vector<CriticalPath> paths = on_gemm ? std::vector<CriticalPath>{} : backend.trace_decode_steps(static_cast<int>(batch), kTracedSteps);
          if (!paths.empty()) {
            record["critical_path"] = critical_path_record(paths);
            if (!quiet) print_critical_path(batch, context, record["critical_path"]);
          }
          if (on_gemm) {
            // The GEMM path's step, every op its own launch between events (host GEMMs included):
            // timed_decode_steps' warm-up steps and two timed ones, all of them timed here.
            constexpr int kProfiledSteps = cuda::CudaBackend::kDecodeWarmupSteps + 2;
            backend.set_eager(true);
            backend.set_op_timing(true);
            backend.reset_op_times();
            backend.timed_decode_steps(static_cast<int>(batch), kProfiledSteps - cuda::CudaBackend::kDecodeWarmupSteps, true);
            backend.set_op_timing(false);
            backend.set_eager(false);
            double gemm_total = 0;
            for (const cuda::OpcodeProfile& o : backend.op_times()) gemm_total += o.ms / kProfiledSteps;
            json gemm_rows = json::array();
            for (const cuda::OpcodeProfile& o : backend.op_times()) {
              gemm_rows.push_back({{"op", o.op}, {"tasks", o.tasks / kProfiledSteps}, {"ms", o.ms / kProfiledSteps}, {"share", o.ms / kProfiledSteps / gemm_total}});
            }
            record["profile_gemm_plan"] = {{"ops_ms", gemm_total}, {"rows", gemm_rows}};
          }
        }
        if (!quiet) {
          std::cerr << fmt::format("batch {:3d} context {:6d}: {:8.3f} ms/step (eager {:8.3f}{}{}), {:7.1f} GB/s = {:5.1f}% of {:.0f}\n", batch, context, mega,
                                   eager, in_kernel ? fmt::format(", NCCL segments {:8.3f}", nccl) : "", on_gemm ? fmt::format(", GEMM plan {:8.3f}{}", gemm,
                                                                   routing.reads > 0 ? fmt::format(" routing to {:.1f} experts an op", static_cast<double>(routing.experts) / static_cast<double>(routing.reads)) : "")
                                           : "",
                                   gbps, 100.0 * gbps / roofline_gbps, roofline_gbps);
        }
        records.push_back(std::move(record));
      }
    }
  }  // the engine's device memory is free before the peer runs

  if (quiet) return 0;
  // The engine's records land first, so a peer that runs out of time loses nothing; with a peer they
  // are rewritten with its figures merged in.
  append_records(args.output, records);
  if (!args.hf_peer.empty()) {
    int status = 0;
    const std::string out = run_and_capture(args.hf_peer, &status);
    json peer;
    try {
      peer = json::parse(out.substr(out.find('[') == std::string::npos ? 0 : out.find('[')));
    } catch (const json::exception& e) {
      std::cerr << fmt::format("bench decode: the HF peer printed no JSON array (status {}): {}\n", status, e.what());
    }
    for (json& record : records) {
      json entry = {{"skipped", "the peer did not report this point"}};
      if (peer.is_array()) {
        for (const json& p : peer) {
          if (p.value("batch", -1) == record["batch"].get<int64_t>() && p.value("context", -1) == record["context"].get<int64_t>()) entry = p;
        }
      }
      record["peers"]["hf-transformers"] = entry;
    }
    std::ifstream in(args.output);
    json all = json::parse(in);
    all.erase(all.end() - static_cast<std::ptrdiff_t>(records.size()), all.end());
    std::ofstream(args.output) << all.dump(1) << "\n";
    append_records(args.output, records);
  }
  for (const json& record : records) std::cout << record.dump() << "\n";
  return 0;
}

}  // namespace plow::tools
