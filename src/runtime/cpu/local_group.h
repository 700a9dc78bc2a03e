// LocalGroup: the ranks of a tensor-parallel group as threads of one process (the CPU backends'
// collectives, and the sharding tests of CI). all_reduce_sum meets every rank at a barrier, sums
// the ranks' buffers in rank order (the same bits everywhere), and meets again before anyone writes.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/collective.h"

namespace plow {

class LocalGroup {
 public:
  explicit LocalGroup(int size);
  ~LocalGroup();
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  Collective& rank(int r);
  // A rank failed: ranks waiting in a collective (now or later) get plow::Error instead of a hang.
  void abort();
  // After every rank has left its collectives: clears the abort so the group runs again.
  void reset();

 private:
  class Member;
  friend class Member;

  // Blocks until all ranks arrived at this barrier generation (or the group is aborted).
  void arrive_and_wait();

  std::vector<std::unique_ptr<Member>> members_;
  std::vector<float*> buffers_;
  std::vector<int64_t> counts_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
};

}  // namespace plow
