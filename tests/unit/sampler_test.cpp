#include <gtest/gtest.h>

#include <vector>

#include "engine/sampler.h"

namespace plow {
namespace {

TEST(Sampler, GreedyPicksMaxWithLowerIdOnTies) {
  Sampler sampler({0.0f, 1.0f, 0, 0});
  EXPECT_EQ(sampler.sample(std::vector<float>{0.1f, 3.0f, 3.0f, -1.0f}), 1);
}

TEST(Sampler, TopKOneIsGreedy) {
  Sampler sampler({1.0f, 1.0f, 1, 7});
  const std::vector<float> logits = {0.5f, 0.2f, 0.9f, 0.1f};
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sampler.sample(logits), 2);
}

TEST(Sampler, SeedReproducesAndTopPExcludesTail) {
  const std::vector<float> logits = {2.0f, 1.9f, -8.0f, -9.0f};
  Sampler a({1.0f, 0.9f, 0, 42}), b({1.0f, 0.9f, 0, 42});
  int first_two = 0;
  for (int i = 0; i < 200; ++i) {
    const int32_t x = a.sample(logits);
    EXPECT_EQ(x, b.sample(logits));
    first_two += x <= 1;
  }
  EXPECT_EQ(first_two, 200);  // the tail holds < 0.1% of the mass and lies outside top-p 0.9
}

}  // namespace
}  // namespace plow
