// Which op last wrote each part of the activation arena (shared by lower.cpp and validate.cpp, which
// must agree on the write-after-read edges that arena reuse needs).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace plow {

// Claiming a range returns the previous occupants of any part of it: the ops whose readers must
// finish before the new owner writes there.
class OccupantMap {
 public:
  // The occupants of any part of [begin, end), without claiming it.
  std::vector<int32_t> owners(int64_t begin, int64_t end) const {
    std::vector<int32_t> found;
    auto it = segments_.upper_bound(begin);
    if (it != segments_.begin()) --it;
    for (; it != segments_.end() && it->first < end; ++it) {
      if (it->second.first > begin) found.push_back(it->second.second);
    }
    return found;
  }

  std::vector<int32_t> claim(int64_t begin, int64_t end, int32_t op) {
    std::vector<int32_t> previous;
    auto it = segments_.upper_bound(begin);
    if (it != segments_.begin()) --it;
    while (it != segments_.end() && it->first < end) {
      const int64_t seg_begin = it->first, seg_end = it->second.first;
      const int32_t owner = it->second.second;
      if (seg_end <= begin) {
        ++it;
        continue;
      }
      previous.push_back(owner);
      it = segments_.erase(it);
      if (seg_begin < begin) segments_[seg_begin] = {begin, owner};
      if (seg_end > end) segments_[end] = {seg_end, owner};
    }
    segments_[begin] = {end, op};
    std::sort(previous.begin(), previous.end());
    previous.erase(std::unique(previous.begin(), previous.end()), previous.end());
    return previous;
  }

 private:
  std::map<int64_t, std::pair<int64_t, int32_t>> segments_;  // begin → (end, op)
};

}  // namespace plow
