#include <gtest/gtest.h>

#include <cmath>
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

namespace plow {
namespace {

TEST(Sampler, PenaltiesFollowVllmSemantics) {
  const std::vector<float> logits = {1.0f, 1.9f, -1.0f, 0.5f};  // token 1 wins unpenalized
  const std::vector<int32_t> none, prompt_has_1 = {1}, output_has_1_twice = {1, 1};
  EXPECT_EQ(Sampler(SamplingParams{}).sample(logits, prompt_has_1, output_has_1_twice).id, 1);
  SamplingParams repetition;
  repetition.repetition_penalty = 2.0f;  // prompt or output: 1.9 → 0.95 < 1.0
  EXPECT_EQ(Sampler(repetition).sample(logits, prompt_has_1, none).id, 0);
  EXPECT_EQ(Sampler(repetition).sample(logits, none, output_has_1_twice).id, 0);
  SamplingParams frequency;
  frequency.frequency_penalty = 0.3f;    // per occurrence in the output: 1.9 − 0.6 = 1.3 > 1.0, then 3 times: 1.0 − …
  EXPECT_EQ(Sampler(frequency).sample(logits, none, output_has_1_twice).id, 1);
  EXPECT_EQ(Sampler(frequency).sample(logits, none, std::vector<int32_t>{1, 1, 1, 1}).id, 0);  // 1.9 − 1.2 = 0.7
  SamplingParams presence;
  presence.presence_penalty = 1.0f;      // once, output only: prompt tokens are not penalized
  EXPECT_EQ(Sampler(presence).sample(logits, prompt_has_1, none).id, 1);
  EXPECT_EQ(Sampler(presence).sample(logits, none, output_has_1_twice).id, 0);  // 1.9 − 1.0 = 0.9
}

TEST(Sampler, MinPKeepsOnlyTokensNearTheTop) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.min_p = 0.5f;
  Sampler sampler(p);
  const std::vector<float> logits = {1.0f, 0.9f, -3.0f, -3.0f};  // p2/p0 ≈ 0.018 < 0.5
  for (int i = 0; i < 100; ++i) EXPECT_LE(sampler.sample(logits, {}, {}).id, 1);
}

TEST(Sampler, LogprobsAreOfTheRawDistribution) {
  SamplingParams p;
  p.top_logprobs = 2;
  p.repetition_penalty = 3.0f;  // penalties change the choice, not the reported logprobs
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  const SampledToken t = Sampler(p).sample(logits, std::vector<int32_t>{0}, {});
  EXPECT_EQ(t.id, 1);
  EXPECT_NEAR(t.logprob, std::log(0.3f), 1e-6);
  ASSERT_EQ(t.top.size(), 2u);
  EXPECT_EQ(t.top[0].first, 0);
  EXPECT_NEAR(t.top[0].second, std::log(0.5f), 1e-6);
  EXPECT_EQ(t.top[1].first, 1);
}

}  // namespace
}  // namespace plow
