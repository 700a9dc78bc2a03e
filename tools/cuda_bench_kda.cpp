// `plow bench kda`: the planned KDA prefill launches (kda_prefill.h: prep, then scan) on one layer's
// shape over synthetic inputs drawn as bench/peers/fla_kda.py draws its own (q, k, v ~ N(0, 1) in bf16,
// β = σ(N(0, 1)) in bf16), with the log-decay g from a named distribution, beside fla's chunk_kda in the
// same run. `bench prefill` times the same launches inside a model, on the gates its random weights
// give; here the gates are chosen, so the comparison with fla is on equal inputs and the prep's steep
// diagonal blocks (kKdaDiagMmaSpread) can be counted and varied. Records are appended to a JSON array
// (bench/results/kda.json), one per (length, gate).
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <random>

#include "core/dtype.h"
#include "core/error.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/kda_prefill.h"
#include "tools/cuda_commands.h"

namespace plow::tools {

namespace {

using nlohmann::json;
using cuda::check;
using cuda::DeviceBuffer;
using cuda::kABF16;
using cuda::kAF32;
using cuda::kKdaChunk;
using cuda::kKdaDiagMmaSpread;
using cuda::kKdaMaxHeadDim;
using cuda::kKdaRecFloats;

constexpr const char* kGates[] = {"logsigmoid", "kimi-form"};

// g[t, h·d + c] for `gate`: "logsigmoid", log σ(x) with x ~ N(0, 1) (fla_kda.py's); "kimi-form", the
// Kimi gate's form −exp(A_log[h])·softplus(x) with A_log[h] = ln U(1, 16) (the model's initialization, and
// the random weights') and x ~ N(0, 1), which falls several times faster.
std::vector<float> draw_gate(const std::string& gate, int64_t rows, int64_t heads, int64_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(1.0f, 16.0f);
  const auto softplus = [](float y) { return y > 0 ? y + std::log1p(std::exp(-y)) : std::log1p(std::exp(y)); };
  const bool logsigmoid = gate == "logsigmoid";  // log σ(x) = −softplus(−x)
  std::vector<float> decay_scale(static_cast<size_t>(heads), 1.0f);
  if (!logsigmoid) {
    for (float& s : decay_scale) s = uniform(rng);  // exp(ln U(1, 16))
  }
  std::vector<float> g(static_cast<size_t>(rows * heads * d));
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t c = 0; c < d; ++c) {
        const float x = normal(rng);
        g[static_cast<size_t>((t * heads + h) * d + c)] = logsigmoid ? -softplus(-x) : -decay_scale[static_cast<size_t>(h)] * softplus(x);
      }
    }
  }
  return g;
}

// The prep's steep diagonal blocks among (chunk, head, half of the channels, block row) of a
// `tokens`-token sequence: γ of some channel of the half falls by more than kKdaDiagMmaSpread across
// the block's 16 positions (γ the sum of g from the chunk's start; positions past the end add 0).
double steep_fraction(const std::vector<float>& g, int64_t tokens, int64_t heads, int64_t d) {
  int64_t steep = 0, blocks = 0;
  for (int64_t c0 = 0; c0 < tokens; c0 += kKdaChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kKdaChunk, tokens - c0));
    for (int64_t h = 0; h < heads; ++h) {
      const float* chunk = g.data() + (c0 * heads + h) * d;
      for (int half = 0; 64 * half < d; ++half) {
        for (int first = 0; first < n; first += 16) {
          steep += cuda::kda_diag_block_steep(chunk, heads * d, first, n, 64 * half, static_cast<int>(std::min<int64_t>(d, 64 * half + 64))) ? 1 : 0;
          blocks += 1;
        }
      }
    }
  }
  return blocks > 0 ? static_cast<double>(steep) / static_cast<double>(blocks) : 0.0;
}

std::vector<float> draw_bf16(int64_t count, uint64_t seed, bool sigmoid) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> out(static_cast<size_t>(count));
  for (float& x : out) {
    const float v = normal(rng);
    x = round_bf16(sigmoid ? 1.0f / (1.0f + std::exp(-v)) : v);
  }
  return out;
}

}  // namespace

void add_bench_kda_options(CLI::App* cmd, BenchKdaArgs& args) {
  cmd->add_option("--tokens", args.tokens, "sequence lengths, comma-separated")->delimiter(',');
  cmd->add_option("--heads", args.heads, "KDA heads of the layer (the 48B's 32)");
  cmd->add_option("--dim", args.dim, "head dim (the 48B's 128)");
  cmd->add_option("--gate", args.gates, "log-decay distributions, comma-separated: logsigmoid (fla_kda.py's), kimi-form")->delimiter(',');
  cmd->add_option("--reps", args.reps, "timed layers per point (after two warm-up layers)");
  cmd->add_option("--seed", args.seed, "inputs' seed");
  cmd->add_option("--kda-peer", args.kda_peer,
                  "command printing fla chunk_kda's records for --tokens/--heads/--dim, e.g. 'python3 bench/peers/fla_kda.py' (run before plow takes the GPU)");
  cmd->add_option("-o,--output", args.output, "JSON array the records are appended to");
}

int run_bench_kda(const BenchKdaArgs& args) {
  if (args.tokens.empty()) fail("bench kda: --tokens needs at least one length");
  for (int64_t t : args.tokens) {
    if (t < 1 || t > (int64_t{1} << 20)) fail("bench kda: --tokens {}: expected 1..1048576", t);
  }
  if (args.heads < 1 || args.heads > 256) fail("bench kda: --heads {}: expected 1..256", args.heads);
  if (args.dim < 1 || args.dim > kKdaMaxHeadDim) fail("bench kda: --dim {}: expected 1..{}", args.dim, kKdaMaxHeadDim);
  if (args.reps < 1) fail("bench kda: --reps must be >= 1, found {}", args.reps);
  if (args.gates.empty()) fail("bench kda: --gate needs at least one distribution");
  for (const std::string& gate : args.gates) {
    if (std::find(std::begin(kGates), std::end(kGates), gate) == std::end(kGates)) fail("bench kda: --gate {}: expected logsigmoid or kimi-form", gate);
  }
  const int gpu = 0;
  const std::string device = cuda::CudaBackend::device_name(gpu);
  const std::string rev = git_revision();
  const int64_t rows = *std::max_element(args.tokens.begin(), args.tokens.end()), heads = args.heads, d = args.dim, width = heads * d;
  std::cerr << fmt::format("bench kda: {}, {} heads of {}, up to {} tokens\n", device, heads, d, rows);

  std::string lengths;
  for (int64_t t : args.tokens) lengths += (lengths.empty() ? "" : ",") + std::to_string(t);
  const std::map<int64_t, json> peer =
      args.kda_peer.empty() ? std::map<int64_t, json>{} : run_length_peer("bench kda", "KDA", fmt::format("{} --tokens {} --heads {} --dim {}", args.kda_peer, lengths, heads, d));
  const double roofline_gbps = cuda::measure_read_bandwidth_gbps(int64_t{4} << 30, gpu);
  std::cerr << fmt::format("read roofline {:.0f} GB/s\n", roofline_gbps);

  // The arena: q, k, v, g, out [rows, width], β [rows, heads] (fp32, as a plan's arena holds them).
  check(cudaSetDevice(gpu), "selecting the device");
  const int64_t plane = rows * width;
  DeviceBuffer arena(static_cast<size_t>(5 * plane + rows * heads) * sizeof(float), "bench kda inputs");
  float* base = arena.as<float>();
  const auto upload_at = [&](int64_t offset, const std::vector<float>& host) {
    check(cudaMemcpy(base + offset, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), "bench kda inputs");
  };
  upload_at(0, draw_bf16(plane, args.seed * 8 + 1, false));          // q
  upload_at(plane, draw_bf16(plane, args.seed * 8 + 2, false));      // k
  upload_at(2 * plane, draw_bf16(plane, args.seed * 8 + 3, false));  // v
  upload_at(5 * plane, draw_bf16(rows * heads, args.seed * 8 + 4, true));  // β
  cuda::KdaPrefillOp op;
  op.q_offset = 0;
  op.k_offset = plane;
  op.v_offset = 2 * plane;
  op.g_offset = 3 * plane;
  op.out_offset = 4 * plane;
  op.beta_offset = 5 * plane;
  op.q_stride = op.k_stride = op.v_stride = op.g_stride = width;
  op.beta_stride = heads;
  op.width = width;
  op.heads = heads;
  op.d = d;
  op.state = 0;
  op.out_act = kABF16;  // the bf16 models' output rounding
  DeviceBuffer state_buffer(static_cast<size_t>(width * d) * sizeof(float), "bench kda state");
  const cuda::DeviceState state{state_buffer.ptr, width * d, width, d, kAF32};
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  json records = json::array();
  {
    cuda::KdaPrefillRunner runner(cuda::KdaPrefillCapacity{rows, heads}, stream);
    for (const std::string& gate : args.gates) {
      const std::vector<float> g = draw_gate(gate, rows, heads, d, args.seed * 8 + 5);
      upload_at(3 * plane, g);
      for (int64_t tokens : args.tokens) {
        runner.new_step({cuda::MlaSequence{0, 0, tokens, 0}});
        const auto layer = [&] {
          check(cudaMemsetAsync(state_buffer.ptr, 0, state_buffer.bytes, stream), "bench kda state");  // a fresh prompt's
          runner.run(op, base, state);
        };
        runner.set_timing(false);
        for (int i = 0; i < 2; ++i) layer();
        runner.set_timing(true);
        runner.reset_timed_ms();
        for (int i = 0; i < args.reps; ++i) layer();
        const double ms = runner.timed_ms() / args.reps, prep_ms = runner.prep_ms() / args.reps;
        runner.set_timing(false);
        // What the two launches must move through DRAM at least: the prep reads q, k, v, g and β and
        // writes the records, the scan reads them back and writes the output.
        const int64_t chunks = (tokens + kKdaChunk - 1) / kKdaChunk;
        const double bytes = 4.0 * static_cast<double>(5 * tokens * width + tokens * heads + 2 * chunks * heads * kKdaRecFloats);
        const double floor_ms = bytes / (roofline_gbps * 1e6);
        const double steep = steep_fraction(g, tokens, heads, d);
        std::cerr << fmt::format("tokens {:6d}, gate {:10s}: {:.3f} ms a layer (prep {:.3f}, scan {:.3f}); {:.0f}% of the diagonal blocks steep; "
                                 "DRAM floor {:.3f} ms, {:.0f}% of the time\n",
                                 tokens, gate, ms, prep_ms, ms - prep_ms, 100 * steep, floor_ms, 100 * floor_ms / ms);
        json record = {{"kind", "kda"},
                       {"tokens", tokens},
                       {"heads", heads},
                       {"dim", d},
                       {"gate", gate},
                       {"ms_per_layer", ms},
                       {"prep_ms", prep_ms},
                       {"scan_ms", ms - prep_ms},
                       {"steep_block_fraction", steep},
                       {"dram_bytes_floor", bytes},
                       {"dram_floor_ms", floor_ms},
                       {"roofline_read_gbps", roofline_gbps},
                       {"device", device},
                       {"git_rev", rev},
                       {"command", args.command_line}};
        if (!args.kda_peer.empty()) {
          record["peers"] = {{"fla_chunk_kda", peer_entry(peer, tokens, ms, "fla chunk_kda on its own inputs of this shape (log σ(N(0, 1)) gates; its time does not depend on them)",
                                                          fmt::format("KDA {} tokens, {} gates", tokens, gate))}};
        }
        records.push_back(record);
        append_records(args.output, json::array({record}));
      }
    }
  }
  cudaStreamDestroy(stream);
  std::cout << records.dump(1) << "\n";
  return 0;
}

}  // namespace plow::tools
