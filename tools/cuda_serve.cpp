// The server's cuda backends: one GPU, or `--tp N` ranks as one process per GPU. The server process
// is rank 0 (a CudaBackend on GPU 0); ranks 1..N−1 are `plow tp-worker` children, each a CudaBackend
// on its GPU served over a socket (engine/remote_rank), all joined in one NCCL group through a unique
// id written to a file, as `plow bench decode --tp` does. The children die with the server.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>

#include <unistd.h>

#include "core/error.h"
#include "engine/plans.h"
#include "engine/remote_rank.h"
#include "engine/tensor_parallel.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/nccl_comm.h"
#include "tools/cuda_commands.h"

namespace plow::tools {

namespace {

// Rank `rank`'s serving backend on GPU `rank`: its plans (those of make_cuda_serving_backend) and
// weights on the device first, then `join` gives its communicator (null: no group).
std::unique_ptr<Backend> rank_serving_backend(const LoadedModel& model, int rank, const ServingShape& shape, const std::function<cuda::NcclComm*()>& join) {
  if (cudaSetDevice(rank) != cudaSuccess) fail("tensor-parallel rank {}: cannot select GPU {}", rank, rank);
  const int blocks = shape.workers > 0 ? shape.workers : cuda::CudaBackend::sm_count(rank);
  // Prefill plans unfused: their plain linears run as cuBLAS GEMMs (runtime/cuda/prefill_gemm.h).
  std::vector<Plan> plans = compile_serving_plans(model, shape.num_slots, shape.max_context, shape.max_step_tokens, blocks, /*fuse_prefill=*/false);
  std::shared_ptr<cuda::DeviceWeightSet> weights = cuda::upload_weights(model.graph, *model.weights);
  cuda::CudaOptions options;
  options.act_dtype = shape.act.value_or(model.weights->storage_dtype());
  options.num_slots = shape.num_slots;
  options.max_context_tokens = shape.max_context;
  options.eager = shape.eager;
  options.device_sampling = shape.device_sampling;
  options.device = rank;
  options.comm = join();
  return std::make_unique<cuda::CudaBackend>(model.graph, std::move(weights), std::move(plans), options);
}

// The NCCL id file of one server's group: removed when the group has formed (or failed to).
struct IdFile {
  std::string path = write_nccl_id_file("serve --tp");
  ~IdFile() { unlink(path.c_str()); }
};

}  // namespace

std::string write_nccl_id_file(const std::string& what) {
  char path[] = "/tmp/plow-nccl-id-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) fail("{}: cannot create the NCCL id file in /tmp", what);
  const std::string id = cuda::NcclComm::new_unique_id();
  const bool written = write(fd, id.data(), id.size()) == static_cast<ssize_t>(id.size());
  close(fd);
  if (!written) fail("{}: cannot write the NCCL id file {}", what, path);
  return path;
}

std::string read_nccl_id_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read the NCCL id file {}", path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::unique_ptr<Backend> make_cuda_serving_backend(const LoadedModel& model, const ServingShape& shape) {
  return rank_serving_backend(model, 0, shape, [] { return nullptr; });
}

std::unique_ptr<Backend> make_cuda_tp_serving_backend(const std::string& model_dir, int tp, const ServingShape& shape, const std::string& plow_binary) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < tp) fail("serve --tp {}: needs {} GPUs, this machine has {}", tp, tp, devices);
  const IdFile id;
  std::vector<std::unique_ptr<RemoteRankBackend>> remotes;  // started first: they load while rank 0 does
  for (int r = 1; r < tp; ++r) {
    remotes.push_back(RemoteRankBackend::spawn(r, [&](int fd) {
      std::vector<std::string> argv = {plow_binary, "tp-worker", "--model", model_dir, "--tp", std::to_string(tp), "--tp-rank", std::to_string(r),
                                       "--tp-id", id.path, "--fd", std::to_string(fd), "--slots", std::to_string(shape.num_slots),
                                       "--max-context", std::to_string(shape.max_context), "--step-tokens", std::to_string(shape.max_step_tokens),
                                       "--workers", std::to_string(shape.workers)};
      if (shape.eager) argv.push_back("--eager");
      if (shape.act) argv.insert(argv.end(), {"--act", std::string(dtype_name(*shape.act))});
      return argv;
    }));
  }
  std::vector<TpRank> ranks(1);
  ranks[0].model = LoadedModel::load(model_dir, {0, tp});
  std::shared_ptr<cuda::NcclComm> comm;
  ranks[0].backend = rank_serving_backend(*ranks[0].model, 0, shape, [&] {
    // Joining blocks until every rank joins: first every worker must have got as far (or said why not).
    for (auto& remote : remotes) remote->await("joining");
    comm = std::make_shared<cuda::NcclComm>(read_nccl_id_file(id.path), 0, tp, 0);
    return comm.get();
  });
  std::vector<RemoteRankBackend*> live;
  for (auto& remote : remotes) {
    remote->await("ready");
    live.push_back(remote.get());
    ranks.push_back({nullptr, std::move(remote)});
  }
  TpGroupControl control;
  control.abort = [c = comm.get(), live] {
    for (RemoteRankBackend* remote : live) remote->abort_rank();
    c->abort();
  };
  control.abort_after = std::chrono::seconds(30);  // an aborted NCCL group is gone: give healthy ranks time
  control.keep_alive = comm;
  return std::make_unique<TensorParallelBackend>(std::move(ranks), std::move(control));
}

void add_tp_worker_options(CLI::App* cmd, TpWorkerArgs& args) {
  cmd->add_option("--model", args.model_dir)->required();
  cmd->add_option("--tp", args.tp)->required();
  cmd->add_option("--tp-rank", args.rank)->required();
  cmd->add_option("--tp-id", args.id_file)->required();
  cmd->add_option("--fd", args.fd)->required();
  cmd->add_option("--slots", args.shape.num_slots);
  cmd->add_option("--max-context", args.shape.max_context);
  cmd->add_option("--step-tokens", args.shape.max_step_tokens);
  cmd->add_option("--workers", args.shape.workers);
  cmd->add_flag("--eager", args.shape.eager);
  cmd->add_option("--act", args.act);
}

int run_tp_worker(const TpWorkerArgs& args) {
  if (args.rank < 1 || args.rank >= args.tp || args.fd < 0) {
    fail("tp-worker: rank {} of {} on fd {}: `plow serve --tp N --backend cuda` starts the workers (ranks 1..N−1)", args.rank, args.tp, args.fd);
  }
  ServingShape shape = args.shape;
  if (!args.act.empty()) {
    shape.act = dtype_from_safetensors(args.act);
    if (!shape.act) fail("tp-worker: --act {}: expected a dtype such as F32 or BF16", args.act);
  }
  std::unique_ptr<LoadedModel> model;    // declared before what points into it:
  std::unique_ptr<cuda::NcclComm> comm;  // the backend uses both
  std::unique_ptr<Backend> backend;
  try {
    model = LoadedModel::load(args.model_dir, {args.rank, args.tp});
    backend = rank_serving_backend(*model, args.rank, shape, [&] {
      announce_rank_stage(args.fd, "joining");
      comm = std::make_unique<cuda::NcclComm>(read_nccl_id_file(args.id_file), args.rank, args.tp, args.rank);
      return comm.get();
    });
    serve_rank(args.fd, *backend, [&] { comm->abort(); });
  } catch (const std::exception& e) {
    report_rank_failure(args.fd, e.what());  // the server names this rank and says why
    return 1;
  }
  return 0;
}

}  // namespace plow::tools
