// Collectives of a tensor-parallel group (DESIGN.md §5), as the backends see them: the sum over the
// group's ranks of one buffer per rank. In-process ranks (the CPU backends, tests) use LocalGroup
// (runtime/cpu/local_group.h); GPU ranks use NCCL inside runtime/cuda.
#pragma once

#include <cstdint>

namespace plow {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: data[0, count) ← Σ over ranks in rank order, in fp32, the same bits on every rank. Every
  // rank makes the same calls in the same order; plow::Error when the group was aborted.
  virtual void all_reduce_sum(float* data, int64_t count) = 0;
};

}  // namespace plow
