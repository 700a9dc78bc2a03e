#include "runtime/cpu/local_group.h"

#include "core/error.h"

namespace plow {

class LocalGroup::Member : public Collective {
 public:
  Member(LocalGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }

  void all_reduce_sum(float* data, int64_t count) override {
    {
      std::lock_guard lock(group_.mutex_);
      group_.buffers_[static_cast<size_t>(rank_)] = data;
      group_.counts_[static_cast<size_t>(rank_)] = count;
    }
    group_.arrive_and_wait();  // every buffer is published
    for (int r = 0; r < size(); ++r) {
      if (group_.counts_[static_cast<size_t>(r)] != count) {
        group_.abort();
        fail("all_reduce: rank {} brings {} values, rank {} brings {}", rank_, count, r, group_.counts_[static_cast<size_t>(r)]);
      }
    }
    sum_.assign(static_cast<size_t>(count), 0.0f);
    for (int r = 0; r < size(); ++r) {
      const float* other = group_.buffers_[static_cast<size_t>(r)];
      for (int64_t i = 0; i < count; ++i) sum_[static_cast<size_t>(i)] += other[i];
    }
    group_.arrive_and_wait();  // nobody reads a buffer any more
    std::copy(sum_.begin(), sum_.end(), data);
  }

 private:
  LocalGroup& group_;
  int rank_;
  std::vector<float> sum_;
};

LocalGroup::LocalGroup(int size) : buffers_(static_cast<size_t>(size)), counts_(static_cast<size_t>(size)) {
  if (size < 1) fail("a tensor-parallel group needs at least one rank, got {}", size);
  for (int r = 0; r < size; ++r) members_.push_back(std::make_unique<Member>(*this, r));
}

LocalGroup::~LocalGroup() = default;

Collective& LocalGroup::rank(int r) {
  PLOW_CHECK(r >= 0 && r < size(), "rank {} of a group of {}", r, size());
  return *members_[static_cast<size_t>(r)];
}

void LocalGroup::abort() {
  std::lock_guard lock(mutex_);
  aborted_ = true;
  cv_.notify_all();
}

void LocalGroup::reset() {
  std::lock_guard lock(mutex_);
  aborted_ = false;
  arrived_ = 0;
  generation_ += 1;
}

void LocalGroup::arrive_and_wait() {
  std::unique_lock lock(mutex_);
  if (aborted_) fail("all_reduce: another rank of the tensor-parallel group failed");
  const uint64_t generation = generation_;
  if (++arrived_ == size()) {
    arrived_ = 0;
    generation_ += 1;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != generation || aborted_; });
  if (generation_ == generation) fail("all_reduce: another rank of the tensor-parallel group failed");
}

}  // namespace plow
