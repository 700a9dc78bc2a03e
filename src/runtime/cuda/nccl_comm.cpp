#include "runtime/cuda/nccl_comm.h"

#include <nccl.h>

#include <cstring>

#include "core/error.h"

namespace plow::cuda {

namespace {

void check_nccl(ncclResult_t result, const char* what) {
  if (result != ncclSuccess) fail("nccl: {} failed: {}", what, ncclGetErrorString(result));
}

}  // namespace

std::string NcclComm::new_unique_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "creating the group's unique id");
  return std::string(id.internal, sizeof(id.internal));
}

NcclComm::NcclComm(const std::string& unique_id, int rank, int size, int device) : rank_(rank), size_(size), device_(device) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) fail("nccl: a unique id has {} bytes, this one {}", sizeof(id.internal), unique_id.size());
  if (size < 1 || rank < 0 || rank >= size) fail("nccl: rank {} of a group of {}", rank, size);
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  if (cudaSetDevice(device) != cudaSuccess) fail("nccl: rank {} cannot select device {}", rank, device);
  check_nccl(ncclCommInitRank(&comm_, size, id, rank), "joining the group");
}

std::vector<std::unique_ptr<NcclComm>> NcclComm::init_all(int size) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < size) fail("nccl: {} ranks need {} GPUs, this machine has {}", size, size, devices);
  std::vector<ncclComm_t> comms(static_cast<size_t>(size));
  std::vector<int> ids(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ids[static_cast<size_t>(r)] = r;
  check_nccl(ncclCommInitAll(comms.data(), size, ids.data()), "creating the group");
  std::vector<std::unique_ptr<NcclComm>> ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(std::unique_ptr<NcclComm>(new NcclComm(comms[static_cast<size_t>(r)], r, size, r)));
  return ranks;
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr) return;
  if (aborted_) return;  // ncclCommAbort released it
  ncclCommDestroy(comm_);
}

void NcclComm::all_reduce_sum(const float* send, float* recv, int64_t count, cudaStream_t stream) {
  check_nccl(ncclAllReduce(send, recv, static_cast<size_t>(count), ncclFloat32, ncclSum, comm_, stream), "all_reduce");
}

void NcclComm::all_gather(const void* send, void* recv, int64_t bytes, cudaStream_t stream) {
  check_nccl(ncclAllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, comm_, stream), "all_gather");
}

void NcclComm::abort() {
  if (aborted_ || comm_ == nullptr) return;
  aborted_ = true;
  ncclCommAbort(comm_);
}

}  // namespace plow::cuda
