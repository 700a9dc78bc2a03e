// One rank's NCCL communicator (DESIGN.md §5): the all_reduce of a rank's partial sums between
// megakernel segments and the all-gather of the argmax fold. Ranks are one process per GPU (the id
// travels through a file: tools/cuda_commands.cpp, tests/gpu/cuda_tp_test.cpp) or threads of one
// process (init_all).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct ncclComm;  // nccl.h stays inside nccl_comm.cpp

namespace plow::cuda {

class NcclComm {
 public:
  // A new group's bootstrap id (NCCL's unique id, 128 bytes), to hand to every rank.
  static std::string new_unique_id();
  // Joins rank `rank` of `size` on `device` (all ranks call this with the same id, at about the same time).
  NcclComm(const std::string& unique_id, int rank, int size, int device);
  // `size` ranks as threads of this process, on devices 0..size−1 (ncclCommInitAll).
  static std::vector<std::unique_ptr<NcclComm>> init_all(int size);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }

  // Enqueued on `stream`: recv[0, count) = Σ over ranks of send[0, count) (fp32; every rank gets the
  // same bits: each element is reduced once and broadcast).
  void all_reduce_sum(const float* send, float* recv, int64_t count, cudaStream_t stream);
  // Enqueued on `stream`: recv = the ranks' `bytes` of send, in rank order.
  void all_gather(const void* send, void* recv, int64_t bytes, cudaStream_t stream);
  // A rank failed: pending and future operations on this communicator return errors instead of hanging.
  void abort();

 private:
  NcclComm(ncclComm* comm, int rank, int size, int device) : comm_(comm), rank_(rank), size_(size), device_(device) {}

  ncclComm* comm_ = nullptr;
  int rank_ = 0, size_ = 1, device_ = 0;
  bool aborted_ = false;
};

}  // namespace plow::cuda
