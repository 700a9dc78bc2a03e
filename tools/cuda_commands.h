// The plow subcommands and options that need the cuda backend: `generate --backend cuda|cuda-eager`,
// `bench decode`, `bench prefill` (cuda_bench_prefill.cpp), the server's backends and `tp-worker`
// (cuda_serve.cpp). Builds without CUDA link
// cuda_commands_none.cpp, which says so.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/model.h"
#include "plan/lower.h"
#include "runtime/backend.h"
#include "tools/bench_records.h"

namespace plow::tools {

// Tokens of one step and prompt tokens of one request in one step on the GPU: `serve`'s default
// (--max-num-batched-tokens, --max-prefill-chunk) and `bench prefill`'s (--chunk), vLLM's default for
// its OpenAI server on GPUs of ≥ 70 GiB. Each chunk streams every routed expert's weights once, and the
// prefill GEMMs need rows: at the 48B shape an 8K prompt's TTFT on the H200 (rev e1723e6) is 0.37 s in
// chunks of 2,048, 0.33 s of 4,096 and 0.30 s of 8,192. A larger chunk also holds the decode rows of a
// mixed step longer (a whole 8,192-token chunk: ~0.3 s); `--max-num-batched-tokens 2048` trades TTFT
// for steadier decode beside long prompts.
inline constexpr int64_t kGpuPrefillChunk = 8192;

// A cuda backend for one generation: a decode plan for batch 1 and a prefill plan for `prefill_chunk`
// tokens (none when ≤ 1), compiled for `workers` (0: one per SM).
std::unique_ptr<Backend> make_cuda_backend(const LoadedModel& model, DType act, int64_t max_context, int64_t prefill_chunk, bool eager, int workers);

// What a server's backend is compiled for: its slots, their longest context, the tokens of one step
// (its prefill plan), megakernel or eager, megakernel blocks (0: one per SM), the activations' dtype
// (unset: the checkpoint's, as `plow serve` runs; tests set F32 to compare with the reference).
struct ServingShape {
  int num_slots = 1;
  int64_t max_context = 4096;
  int64_t max_step_tokens = 512;
  bool eager = false;
  int workers = 0;
  std::optional<DType> act;
  bool device_sampling = true;  // CudaOptions::device_sampling (rows drawn on the GPU)
};

// A cuda backend for the server (cuda_serve.cpp): decode plans for batches 1, 2, 4, … up to num_slots
// and a prefill plan for steps of max_step_tokens (mixed prefill + decode steps run on it).
std::unique_ptr<Backend> make_cuda_serving_backend(const LoadedModel& model, const ServingShape& shape);

// The server's backend on `tp` GPUs: rank 0 in this process on GPU 0, ranks 1..tp−1 as `plow tp-worker`
// processes of `plow_binary` (GPU r each) behind RemoteRankBackend proxies, joined in one NCCL group;
// each rank has the plans of make_cuda_serving_backend over its block of the model.
std::unique_ptr<Backend> make_cuda_tp_serving_backend(const std::string& model_dir, int tp, const ServingShape& shape,
                                                      const std::string& plow_binary = "/proc/self/exe");

// `plow tp-worker` (hidden; started by make_cuda_tp_serving_backend): rank `rank` of `tp`, serving its
// backend over the socket `fd` until the server closes it.
struct TpWorkerArgs {
  std::string model_dir;
  int tp = 0;
  int rank = -1;
  std::string id_file;  // the NCCL unique id, written by the server
  int fd = -1;
  ServingShape shape;
  std::string act;  // the dtype's safetensors name; empty: the checkpoint's
};

void add_tp_worker_options(CLI::App* cmd, TpWorkerArgs& args);
int run_tp_worker(const TpWorkerArgs& args);

// A new NCCL group's unique id in a file of /tmp for the ranks' processes (`what` names the command in
// errors); the file's path. And reading it back in a rank.
std::string write_nccl_id_file(const std::string& what);
std::string read_nccl_id_file(const std::string& path);

struct BenchDecodeArgs {
  std::string model_dir, config_path;
  bool random_weights = false;
  uint64_t seed = 0;
  std::vector<int64_t> batches{1};
  std::vector<int64_t> contexts{0};
  int steps = 30;
  int workers = 0;
  int64_t light_task_elements = LowerOptions::kLightTaskElements;  // the decode plans' (plan/lower.h)
  std::vector<std::string> disabled_rules;                         // compiler rules the decode plans are compiled without
  int32_t shadow_tail_workers = LowerOptions::kShadowTailWorkers;  // the decode plans' (plan/lower.h)
  int64_t attn_res_chunk = 0;                                      // CudaOptions::attn_res_min_chunk
  bool profile = false;
  // Also time each batch's steps as `serve` runs them, through the scheduler at context ~0: greedy
  // (ids from the device, and the logits path before it) and sampled (host, and device sampling).
  bool served_sampling = false;
  // Also time batches of ≥ gemm_min_rows on a prefill plan's GEMM path, as `serve` runs them (unset:
  // on for one GPU; a tensor-parallel run times it only when asked).
  std::optional<bool> gemm_plans;
  int64_t gemm_min_rows = 0;                    // CudaOptions::gemm_min_rows (0: cuda::kGemmMinRows)
  int64_t gemm_plan_tokens = kGpuPrefillChunk;  // that prefill plan's rows, serve's (0: one plan per such batch, of its size)
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
  int64_t cached_prefix = 0;  // tokens already in the slot before each prompt (prefilled untimed): a later turn's TTFT
  int reps = 3;
  int workers = 0;
  bool gemv_peer = false;  // also time today's path: fused prefill plans on the GEMV bodies
  bool mla_body_peer = false;  // also time the GEMM path with mla_attention on its op body (split-KV)
  bool kda_body_peer = false;  // also time the GEMM path with kda_delta_rule on its op body
  bool rounding_peer = false;  // also time the GEMM path with every linear's tasks rounding its output
  bool expert_peer = false;    // also time the prompt with the expert GEMMs on cuBLAS's grouped call
  bool mla_flash_peer = false;  // also time the prompt with MLA's attention on the mma.sync kernel instead of wgmma
  bool profile = false;        // one more run per prompt, one launch per op between events: per-opcode time
  std::string kda_peer;        // command printing fla chunk_kda's records for --tokens/--heads/--dim (run before the engine takes the GPU)
  std::string mla_peer;        // command printing PyTorch SDPA's causal attention records for --tokens/--heads/--qk-dim/--v-dim (likewise)
  bool flops_only = false;  // print the FLOP model per prompt and stop (no GPU)
  std::string output = "bench/results/prefill.json";
  std::string command_line;
};

void add_bench_prefill_options(CLI::App* cmd, BenchPrefillArgs& args);
int run_bench_prefill(const BenchPrefillArgs& args);

// `plow bench kda` (cuda_bench_kda.cpp): the planned KDA prefill launches on one layer's shape over
// synthetic inputs, with chosen log-decay distributions, beside fla's chunk_kda.
struct BenchKdaArgs {
  std::vector<int64_t> tokens{1024, 8192, 32768};
  int64_t heads = 32, dim = 128;  // the 48B's KDA layers
  std::vector<std::string> gates{"logsigmoid", "kimi-form"};
  int reps = 10;
  uint64_t seed = 0;
  std::string kda_peer;  // command printing fla chunk_kda's records for --tokens/--heads/--dim
  std::string output = "bench/results/kda.json";
  std::string command_line;
};

void add_bench_kda_options(CLI::App* cmd, BenchKdaArgs& args);
int run_bench_kda(const BenchKdaArgs& args);

// Bytes of one part of `decl` on the device with activations/weights in `dtype` (MXFP4 parts packed,
// the fp32 gate and bias weights in fp32): a routed expert stack's part is one expert's matrix.
double weight_bytes(const WeightDecl& decl, DType dtype);

}  // namespace plow::tools
