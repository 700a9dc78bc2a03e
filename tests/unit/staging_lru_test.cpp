// runtime/cuda/staging_lru.h: GemmRunner's rule for which staging buffer holds which input's copy.
#include "runtime/cuda/staging_lru.h"

#include <gtest/gtest.h>

#include <vector>

namespace plow::cuda {
namespace {

using Lru = StagingLru<int, 2>;

TEST(StagingLru, AKeyHeldIsAHitInItsSlot) {
  Lru lru;
  const Lru::Use first = lru.use(7);
  EXPECT_FALSE(first.hit);
  EXPECT_EQ(first.slot, 0);
  const Lru::Use again = lru.use(7);
  EXPECT_TRUE(again.hit);
  EXPECT_EQ(again.slot, 0);
}

TEST(StagingLru, TheLeastRecentlyUsedSlotIsOverwritten) {
  Lru lru;
  EXPECT_EQ(lru.use(1).slot, 0);
  EXPECT_EQ(lru.use(2).slot, 1);
  EXPECT_TRUE(lru.use(1).hit);  // 1 is now the more recent
  const Lru::Use third = lru.use(3);
  EXPECT_FALSE(third.hit);
  EXPECT_EQ(third.slot, 1);  // 2's slot
  EXPECT_TRUE(lru.use(1).hit);
  EXPECT_FALSE(lru.use(2).hit);  // overwritten
}

TEST(StagingLru, ForgetTakeAndClear) {
  Lru lru;
  lru.use(1);
  lru.use(2);
  lru.forget(1);  // slot 1 overwritten by something else
  EXPECT_FALSE(lru.use(2).hit);
  const int taken = lru.take();  // keyless: never a hit later
  EXPECT_EQ(taken, 0);           // 1's slot, the least recently used
  EXPECT_FALSE(lru.use(1).hit);
  lru.clear();
  EXPECT_FALSE(lru.use(1).hit);
  EXPECT_EQ(lru.use(5).slot, 1);
}

// A KDA layer's projections read one input, the o_proj another, the next layer's again the first
// kind: two slots convert each input once, and an input read again after two others is converted again.
TEST(StagingLru, ConversionsOfAStepInOrder) {
  Lru lru;
  const std::vector<int> reads = {10, 10, 10, 10, 11, 11, 10, 12, 13, 13, 12, 10};
  std::vector<bool> converted;
  for (const int key : reads) converted.push_back(!lru.use(key).hit);
  EXPECT_EQ(converted, (std::vector<bool>{true, false, false, false, true, false, false, true, true, false, false, true}));
}

}  // namespace
}  // namespace plow::cuda
