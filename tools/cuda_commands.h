// The plow subcommands and options that need the cuda backend: `generate --backend cuda|cuda-eager`,
// `bench decode` and `bench prefill` (cuda_bench_prefill.cpp). Builds without CUDA link
// cuda_commands_none.cpp, which says so.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/model.h"
#include "runtime/backend.h"

namespace plow::tools {

// A cuda backend for one generation: a decode plan for batch 1 and a prefill plan for `prefill_chunk`
// tokens (none when ≤ 1), compiled for `workers` (0: one per SM).
std::unique_ptr<Backend> make_cuda_backend(const LoadedModel& model, DType act, int64_t max_context, int64_t prefill_chunk, bool eager, int workers);

// A cuda backend for the server: decode plans for batches 1, 2, 4, … up to num_slots and a prefill plan
// for steps of max_step_tokens (mixed prefill + decode steps run on it).
std::unique_ptr<Backend> make_cuda_serving_backend(const LoadedModel& model, int num_slots, int64_t max_context, int64_t max_step_tokens, bool eager,
                                                   int workers);

// The server's backend on `tp` GPUs: one rank per GPU, as threads of this process with NCCL
// communicators, each with the plans of make_cuda_serving_backend over its block of the model.
std::unique_ptr<Backend> make_cuda_tp_serving_backend(const std::string& model_dir, int tp, int num_slots, int64_t max_context, int64_t max_step_tokens,
                                                      bool eager, int workers);

struct BenchDecodeArgs {
  std::string model_dir, config_path;
  bool random_weights = false;
  uint64_t seed = 0;
  std::vector<int64_t> batches{1};
  std::vector<int64_t> contexts{0};
  int steps = 30;
  int workers = 0;
  bool profile = false;
  bool diagnose = false;
  bool bytes_only = false;  // run the first batch's decode ops one by one with a timeout, then stop
  std::string output = "bench/results/decode.json";
  std::string hf_peer;  // a command printing the HF transformers peer's JSON records (bench/peers/hf_decode.py)
  std::string command_line;
  std::vector<std::string> argv;  // as given: a tensor-parallel run starts itself once per rank
  int tp = 1;                     // tensor-parallel ranks, one process and one GPU each
  int tp_rank = -1;               // set in a rank's process (with tp_id_file)
  std::string tp_id_file;         // the NCCL unique id, written by the launching process
};

void add_bench_decode_options(CLI::App* cmd, BenchDecodeArgs& args);
int run_bench_decode(const BenchDecodeArgs& args);

struct BenchPrefillArgs {
  std::string config_path;
  bool random_weights = false;
  uint64_t seed = 0;
  std::vector<int64_t> prompts{1024};
  int64_t chunk = 0;  // 0: 1024, or the prompt when shorter
  int reps = 3;
  int workers = 0;
  bool gemv_peer = false;  // also time today's path: fused prefill plans on the GEMV bodies
  bool flops_only = false;  // print the FLOP model per prompt and stop (no GPU)
  std::string output = "bench/results/prefill.json";
  std::string command_line;
};

void add_bench_prefill_options(CLI::App* cmd, BenchPrefillArgs& args);
int run_bench_prefill(const BenchPrefillArgs& args);

// Shared by the benchmarks: the short git revision (−dirty when the tree has changes; PLOW_GIT_REV
// overrides), and records appended to the JSON array at `path` (created when missing).
std::string git_revision();
void append_records(const std::string& path, const nlohmann::json& records);

}  // namespace plow::tools
