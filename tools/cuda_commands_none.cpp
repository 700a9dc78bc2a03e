// A build without the cuda backend (no CUDA toolkit, or a sanitizer build): the cuda options say so.
#include "core/error.h"
#include "tools/cuda_commands.h"

namespace plow::tools {

std::unique_ptr<Backend> make_cuda_backend(const LoadedModel&, DType, int64_t, int64_t, bool, int) {
  fail("--backend cuda: this build of plow has no cuda backend (configure with a CUDA toolkit and -DPLOW_CUDA=ON)");
}

std::unique_ptr<Backend> make_cuda_serving_backend(const LoadedModel&, const ServingShape&) {
  fail("--backend cuda: this build of plow has no cuda backend (configure with a CUDA toolkit and -DPLOW_CUDA=ON)");
}

std::unique_ptr<Backend> make_cuda_tp_serving_backend(const std::string&, int, const ServingShape&, const std::string&) {
  fail("--backend cuda: this build of plow has no cuda backend (configure with a CUDA toolkit and -DPLOW_CUDA=ON)");
}

void add_tp_worker_options(CLI::App* cmd, TpWorkerArgs&) { cmd->allow_extras(); }

int run_tp_worker(const TpWorkerArgs&) { fail("tp-worker: this build of plow has no cuda backend (configure with a CUDA toolkit and -DPLOW_CUDA=ON)"); }

void add_bench_decode_options(CLI::App* cmd, BenchDecodeArgs& args) {
  cmd->add_option("--config", args.config_path, "config.json of a model to draw on the device");
  cmd->allow_extras();
}

int run_bench_decode(const BenchDecodeArgs&) { fail("bench decode: this build of plow has no cuda backend (configure with a CUDA toolkit and -DPLOW_CUDA=ON)"); }

void add_bench_prefill_options(CLI::App* cmd, BenchPrefillArgs& args) {
  cmd->add_option("--config", args.config_path, "config.json of a model to draw on the device");
  cmd->allow_extras();
}

int run_bench_prefill(const BenchPrefillArgs&) { fail("bench prefill: this build of plow has no cuda backend (configure with a CUDA toolkit and -DPLOW_CUDA=ON)"); }

void add_bench_kda_options(CLI::App* cmd, BenchKdaArgs&) { cmd->allow_extras(); }

int run_bench_kda(const BenchKdaArgs&) { fail("bench kda: this build of plow has no cuda backend (configure with a CUDA toolkit and -DPLOW_CUDA=ON)"); }

}  // namespace plow::tools
