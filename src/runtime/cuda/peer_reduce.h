// Tensor parallelism inside the megakernel (DESIGN.md §5, docs/tensor-parallel.md): the all_reduce of
// a decode step as a task of the kernel instead of an NCCL call between launches. Every rank owns one
// receive area in its GPU's memory, mapped into every other rank (peer access between threads of one
// process, CUDA IPC between processes). The all_reduce task of rank r stores its fp32 partial sums into
// slot (parity, k, r) of every peer's area over NVLink, raises flag (parity, k, r) there to the step's
// collective epoch (release, system scope), waits for every peer's flag in its own area (acquire), and
// sums the ranks' partials in rank order, so every rank gets the same bits (ops/all_reduce.cuh).
//
// Slots are keyed by the op's ordinal k among the step's all_reduces and by the epoch's parity: a rank
// can be at most one step ahead of a peer (step e + 1 cannot finish before every peer has reached op k
// of step e + 1, which each peer does only after reading its slots of step e), so two parities suffice.
// The host maps the areas once, at the first step that runs an all_reduce (connect is collective: every
// rank of the group must call it at the same step).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/cuda/device_memory.h"
#include "runtime/cuda/device_types.h"

namespace plow::cuda {

class NcclComm;

class PeerReduceArea {
 public:
  // Room for `ops` all_reduces of up to `slot_floats` floats (rows × width) per step.
  PeerReduceArea(int device, int ranks, int ops, int64_t slot_floats);
  ~PeerReduceArea();
  PeerReduceArea(const PeerReduceArea&) = delete;
  PeerReduceArea& operator=(const PeerReduceArea&) = delete;

  // Collective over `comm` (on its device; uses `stream`): exchanges the areas' addresses and maps the
  // peers' areas. Returns true on every rank, or false on every rank with `why` set when some pair of
  // GPUs cannot reach each other's memory (the caller keeps the NCCL path).
  bool connect(NcclComm& comm, cudaStream_t stream, std::string* why);
  bool connected() const { return table_.ptr != nullptr; }
  const PeerTable* table() const { return table_.as<PeerTable>(); }  // device memory, after connect
  int ops() const { return ops_; }
  int64_t slot_floats() const { return slot_floats_; }

 private:
  int device_ = 0, ranks_ = 1, ops_ = 0;
  int64_t slot_floats_ = 0;
  DeviceBuffer area_;                // flags, then slots
  std::vector<void*> opened_;        // peers' areas opened through CUDA IPC (closed in the destructor)
  DeviceBuffer table_;
};

}  // namespace plow::cuda
