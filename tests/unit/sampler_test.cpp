#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "sampling_test_util.h"

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

namespace plow {
namespace {

using sampling_test::random_logits;

// The fast sampler's kept tokens and probabilities against the sorting specification, over vocabulary
// sizes, spreads, ties, masked tokens, penalties and every control alone and together.
TEST(Sampler, DistributionEqualsTheReference) {
  struct Shape {
    size_t vocab;
    float sigma, step;
    bool masked;
  };
  const std::vector<Shape> shapes = {{1, 1, 0, false},   {2, 1, 0, false},   {7, 2, 0.5f, false}, {300, 0.5f, 0, true},
                                     {5000, 3, 0, false}, {5000, 3, 0.25f, true}, {40000, 8, 0, false}, {163840, 2.5f, 0, false}};
  struct Controls {
    float temperature, top_p, min_p;
    int64_t top_k;
    bool penalties;
  };
  const std::vector<Controls> controls = {{1.0f, 1.0f, 0.0f, 0, false},   {0.6f, 0.95f, 0.0f, 0, false}, {1.7f, 0.9f, 0.0f, 0, false},
                                          {0.7f, 1.0f, 0.0f, 40, false},  {1.0f, 0.8f, 0.0f, 50, false}, {1.0f, 1.0f, 0.05f, 0, false},
                                          {0.3f, 0.99f, 0.01f, 0, true},  {1.2f, 0.003f, 0.0f, 0, false}, {1.0f, 0.9f, 0.2f, 7, true},
                                          {1.0f, 1.0f, 0.0f, 1000000, false}};
  const std::vector<int32_t> prompt = {0, 3, 3, 150, 4999, 77}, output = {3, 9, 9, 9, 150};
  int cases = 0;
  for (size_t s = 0; s < shapes.size(); ++s) {
    const Shape& sh = shapes[s];
    const std::vector<float> logits = random_logits(sh.vocab, sh.sigma, sh.step, sh.masked, 100 + s);
    for (const Controls& c : controls) {
      SamplingParams p = sampling_test::controls(c.temperature, c.top_p, c.min_p, c.top_k);
      if (c.penalties) {
        p.repetition_penalty = 1.3f;
        p.presence_penalty = 0.4f;
        p.frequency_penalty = 0.2f;
      }
      const TokenDistribution want = reference_distribution(logits, p, prompt, output);
      const TokenDistribution got = Sampler(p).distribution(logits, prompt, output);
      const std::string where = "vocab " + std::to_string(sh.vocab) + " shape " + std::to_string(s) + " T " + std::to_string(c.temperature) +
                                " top_p " + std::to_string(c.top_p) + " top_k " + std::to_string(c.top_k) + " min_p " + std::to_string(c.min_p);
      std::vector<std::pair<int32_t, double>> a, b;
      for (size_t i = 0; i < want.ids.size(); ++i) a.emplace_back(want.ids[i], want.probs[i]);
      for (size_t i = 0; i < got.ids.size(); ++i) b.emplace_back(got.ids[i], got.probs[i]);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      ASSERT_EQ(a.size(), b.size()) << where;
      ASSERT_GT(a.size(), 0u) << where;
      double sum = 0.0;
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(a[i].first, b[i].first) << where;
        EXPECT_NEAR(b[i].second, a[i].second, 1e-6 * a[i].second + 1e-15) << where << " id " << a[i].first;
        sum += b[i].second;
      }
      EXPECT_NEAR(sum, 1.0, 1e-9) << where;
      ++cases;
    }
  }
  EXPECT_EQ(cases, 80);
}

// Draws land on each kept token as often as its probability says (a fixed seed: the counts are the
// same every run; the bound is five standard deviations).
TEST(Sampler, DrawsFollowTheDistribution) {
  const std::vector<float> logits = random_logits(1000, 1.5f, 0, false, 7);
  for (const float top_p : {1.0f, 0.7f}) {
    SamplingParams p;
    p.temperature = 0.8f;
    p.top_p = top_p;
    p.seed = 11;
    Sampler sampler(p);
    const TokenDistribution d = Sampler(p).distribution(logits, {}, {});
    std::vector<int> counts(logits.size(), 0);
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) counts[static_cast<size_t>(sampler.sample(logits))] += 1;
    int drawn = 0;
    for (size_t i = 0; i < d.ids.size(); ++i) {
      const double expected = d.probs[i] * draws;
      EXPECT_NEAR(counts[static_cast<size_t>(d.ids[i])], expected, 5.0 * std::sqrt(expected) + 1.0) << "token " << d.ids[i];
      drawn += counts[static_cast<size_t>(d.ids[i])];
    }
    EXPECT_EQ(drawn, draws) << "a draw fell outside the kept tokens (top_p " << top_p << ")";
  }
}

TEST(Sampler, TopLogprobsAreTheBestInOrder) {
  std::vector<float> logits = random_logits(5000, 2.0f, 0.5f, false, 3);  // many ties
  SamplingParams p;
  p.top_logprobs = 20;
  const SampledToken t = Sampler(p).sample(logits, {}, {});
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]; });
  ASSERT_EQ(t.top.size(), 20u);
  for (size_t i = 0; i < 20; ++i) EXPECT_EQ(t.top[i].first, order[i]) << i;
  EXPECT_EQ(t.id, order[0]);
  EXPECT_FLOAT_EQ(t.logprob, t.top[0].second);
}

}  // namespace
}  // namespace plow
