#include "runtime/cuda/peer_reduce.h"

#include <unistd.h>

#include <fmt/format.h>

#include <cstring>

#include "runtime/cuda/nccl_comm.h"

namespace plow::cuda {

namespace {

// What a rank tells the others about its area (all-gathered as bytes).
struct AreaRecord {
  int32_t pid = 0;
  int32_t device = 0;
  uint64_t address = 0;
  cudaIpcMemHandle_t handle{};
  int32_t has_handle = 0;
};

int64_t flag_bytes(int ranks, int ops) { return (int64_t{2} * ops * ranks * static_cast<int64_t>(sizeof(unsigned)) + 255) / 256 * 256; }

// The ranks' `bytes` of `mine`, in rank order, through the group.
std::vector<uint8_t> gather(NcclComm& comm, const void* mine, size_t bytes, cudaStream_t stream) {
  DeviceBuffer send(bytes, "a peer exchange"), recv(bytes * static_cast<size_t>(comm.size()), "a peer exchange");
  check(cudaMemcpyAsync(send.ptr, mine, bytes, cudaMemcpyHostToDevice, stream), "peer exchange");
  comm.all_gather(send.ptr, recv.ptr, static_cast<int64_t>(bytes), stream);
  std::vector<uint8_t> all(recv.bytes);
  check(cudaMemcpyAsync(all.data(), recv.ptr, all.size(), cudaMemcpyDeviceToHost, stream), "peer exchange");
  check(cudaStreamSynchronize(stream), "peer exchange");
  return all;
}

}  // namespace

PeerReduceArea::PeerReduceArea(int device, int ranks, int ops, int64_t slot_floats)
    : device_(device), ranks_(ranks), ops_(ops), slot_floats_((slot_floats + 3) / 4 * 4) {
  if (ranks < 2 || ranks > kMaxPeerRanks) fail("cuda: in-kernel all_reduce over {} ranks (expected 2..{})", ranks, kMaxPeerRanks);
  const int64_t bytes = flag_bytes(ranks, ops) + int64_t{2} * ops * ranks * slot_floats_ * static_cast<int64_t>(sizeof(float));
  check(cudaSetDevice(device), "selecting the device");
  area_ = DeviceBuffer(static_cast<size_t>(bytes), "the all_reduce receive area");
  check(cudaMemset(area_.ptr, 0, area_.bytes), "all_reduce area");  // epochs start at 1: no flag is raised
}

PeerReduceArea::~PeerReduceArea() {
  cudaSetDevice(device_);
  for (void* p : opened_) cudaIpcCloseMemHandle(p);
}

bool PeerReduceArea::connect(NcclComm& comm, cudaStream_t stream, std::string* why) {
  if (comm.size() != ranks_) fail("cuda: the all_reduce area is for {} ranks, the group has {}", ranks_, comm.size());
  check(cudaSetDevice(device_), "selecting the device");
  AreaRecord mine;
  mine.pid = static_cast<int32_t>(getpid());
  mine.device = device_;
  mine.address = reinterpret_cast<uintptr_t>(area_.ptr);
  mine.has_handle = cudaIpcGetMemHandle(&mine.handle, area_.ptr) == cudaSuccess ? 1 : 0;
  cudaGetLastError();  // a failed handle is reported below, if a peer in another process needs it
  const std::vector<uint8_t> bytes = gather(comm, &mine, sizeof(mine), stream);
  std::vector<AreaRecord> records(static_cast<size_t>(ranks_));
  std::memcpy(records.data(), bytes.data(), records.size() * sizeof(AreaRecord));

  // Map every peer's area: the pointer itself within one process (peer access), an IPC mapping across.
  PeerTable table;
  table.rank = comm.rank();
  table.size = ranks_;
  table.ops = ops_;
  table.slot_floats = slot_floats_;
  std::string problem;
  std::vector<void*> opened;
  for (int q = 0; q < ranks_ && problem.empty(); ++q) {
    const AreaRecord& peer = records[static_cast<size_t>(q)];
    void* base = nullptr;
    if (q == comm.rank()) {
      base = area_.ptr;
    } else if (peer.pid == mine.pid) {
      int can = 0;
      check(cudaDeviceCanAccessPeer(&can, device_, peer.device), "peer query");
      if (!can) {
        problem = fmt::format("GPU {} cannot access GPU {}'s memory (no peer access)", device_, peer.device);
        break;
      }
      const cudaError_t enabled = cudaDeviceEnablePeerAccess(peer.device, 0);
      if (enabled != cudaSuccess && enabled != cudaErrorPeerAccessAlreadyEnabled) {
        problem = fmt::format("enabling GPU {}'s access to GPU {}: {}", device_, peer.device, cudaGetErrorString(enabled));
      }
      cudaGetLastError();
      base = reinterpret_cast<void*>(static_cast<uintptr_t>(peer.address));
    } else if (!peer.has_handle) {
      problem = fmt::format("rank {} could not export its area for IPC", q);
    } else {
      const cudaError_t error = cudaIpcOpenMemHandle(&base, peer.handle, cudaIpcMemLazyEnablePeerAccess);
      cudaGetLastError();
      if (error != cudaSuccess) {
        problem = fmt::format("opening rank {}'s area (pid {}, GPU {}) through CUDA IPC: {}", q, peer.pid, peer.device, cudaGetErrorString(error));
      } else {
        opened.push_back(base);
      }
    }
    if (base != nullptr) {
      table.flags[q] = static_cast<unsigned*>(base);
      table.slots[q] = reinterpret_cast<float*>(static_cast<uint8_t*>(base) + flag_bytes(ranks_, ops_));
    }
  }
  // Every rank decides alike: the in-kernel path only when every rank mapped every peer.
  const int32_t ok = problem.empty() ? 1 : 0;
  const std::vector<uint8_t> oks = gather(comm, &ok, sizeof(ok), stream);
  int bad_rank = -1;
  for (int q = 0; q < ranks_; ++q) {
    int32_t v = 0;
    std::memcpy(&v, oks.data() + static_cast<size_t>(q) * sizeof(v), sizeof(v));
    if (v == 0 && bad_rank < 0) bad_rank = q;
  }
  if (bad_rank >= 0) {
    for (void* p : opened) cudaIpcCloseMemHandle(p);
    if (why != nullptr) *why = problem.empty() ? fmt::format("rank {} could not map its peers' memory", bad_rank) : problem;
    return false;
  }
  opened_ = std::move(opened);
  table_ = upload(std::vector<PeerTable>{table}, "the peer table");
  return true;
}

}  // namespace plow::cuda
