// The device sampler (runtime/cuda/sample.cuh) on the host emulator (a block's 512 threads as fibers,
// shared memory poisoned before every row) against the host sampler's specification
// (engine/sampler.h reference_distribution): for each case, uniforms placed in the middle of kept
// tokens' intervals of the id-order walk must draw exactly those tokens, so the kept set, its
// probabilities and the walk are all checked; greedy rows must give the argmax.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "runtime/cuda/sample.cuh"
#include "unit/sampling_test_util.h"

namespace plow::cuda {
namespace {

// Every thread's answer for one row (they must agree).
int device_draw(const std::vector<float>& row, const RowSampling& c) {
  static EmuBlock block;
  static sampling::Shared shared;
  std::memset(&shared, 0xA5, sizeof shared);
  std::vector<int> ids(kSampleThreads, -2);
  block.run([&] { ids[threadIdx.x] = sampling::sample_row(row.data(), static_cast<int>(row.size()), c, shared); }, kSampleThreads);
  for (int t = 1; t < kSampleThreads; ++t) EXPECT_EQ(ids[static_cast<size_t>(t)], ids[0]) << "thread " << t;
  return ids[0];
}

using sampling_test::random_logits;

TEST(DeviceSampler, DrawsTheSpecificationsKeptTokensInIdOrder) {
  struct Shape {
    size_t vocab;
    float sigma, step;
    bool masked;
    int probes;  // kept tokens probed
  };
  const std::vector<Shape> shapes = {{1, 1, 0, false, 4},      {2, 1, 0, false, 4},       {7, 2, 0.5f, false, 8},   {300, 0.5f, 0, true, 24},
                                     {5000, 3, 0, false, 16},  {5000, 3, 0.25f, true, 16}, {40000, 8, 0, false, 6}, {163840, 2.5f, 0, false, 3}};
  struct Controls {
    float temperature, top_p, min_p;
    int32_t top_k;
  };
  const std::vector<Controls> controls = {{1.0f, 1.0f, 0.0f, 0},  {0.6f, 0.95f, 0.0f, 0},  {1.7f, 0.9f, 0.0f, 0},   {0.7f, 1.0f, 0.0f, 40},
                                          {1.0f, 0.8f, 0.0f, 50}, {1.0f, 1.0f, 0.05f, 0}, {0.3f, 0.99f, 0.01f, 0}, {1.2f, 0.003f, 0.0f, 0},
                                          {1.0f, 0.9f, 0.2f, 7},  {1.0f, 1.0f, 0.0f, 1000000}};
  int probes = 0;
  for (size_t s = 0; s < shapes.size(); ++s) {
    const Shape& sh = shapes[s];
    const std::vector<float> logits = random_logits(sh.vocab, sh.sigma, sh.step, sh.masked, 100 + s);
    for (const Controls& c : controls) {
      const auto kept = sampling_test::kept_by_id(reference_distribution(logits, sampling_test::controls(c.temperature, c.top_p, c.min_p, c.top_k), {}, {}));
      std::vector<double> below(kept.size() + 1, 0.0);
      for (size_t i = 0; i < kept.size(); ++i) below[i + 1] = below[i] + kept[i].second;
      RowSampling row{c.temperature, c.top_p, c.min_p, c.top_k, 0.0};
      const std::string where = "vocab " + std::to_string(sh.vocab) + " T " + std::to_string(c.temperature) + " top_p " + std::to_string(c.top_p) +
                                " top_k " + std::to_string(c.top_k) + " min_p " + std::to_string(c.min_p);
      // Kept tokens spread over the walk, each drawn by the uniform in the middle of its interval; the
      // first and the last by u = 0 and u just below 1.
      const int n = std::min<int>(sh.probes, static_cast<int>(kept.size()));
      for (int j = 0; j < n; ++j) {
        const size_t i = n == 1 ? 0 : static_cast<size_t>(j) * (kept.size() - 1) / static_cast<size_t>(n - 1);
        if (kept[i].second < 1e-6) continue;  // an interval narrower than the fixed-point masses resolve
        row.u = 0.5 * (below[i] + below[i + 1]);
        EXPECT_EQ(device_draw(logits, row), kept[i].first) << where << " u " << row.u;
        ++probes;
      }
      // The ends of the walk: its first and last tokens that the masses resolve (a weight below 2^−40
      // of the top one counts 0 on the device: at most vocab · 2^−40 of the mass, dropped).
      double top = 0.0;
      for (const auto& k : kept) top = std::max(top, k.second);
      auto resolved = [&](size_t i) { return kept[i].second / top >= std::ldexp(1.0, -40); };  // w / w_max, w_max = 1
      size_t first = 0, last = kept.size() - 1;
      while (!resolved(first)) ++first;
      while (!resolved(last)) --last;
      row.u = 0.0;
      EXPECT_EQ(device_draw(logits, row), kept[first].first) << where;
      row.u = 1.0 - 1e-12;
      EXPECT_EQ(device_draw(logits, row), kept[last].first) << where;
      probes += 2;
    }
  }
  EXPECT_GT(probes, 600);
}

TEST(DeviceSampler, GreedyRowsTakeTheFirstMaximum) {
  std::vector<float> logits = random_logits(3000, 2.0f, 0.5f, true, 9);  // ties at the top
  const int want = static_cast<int>(argmax(logits));
  EXPECT_EQ(device_draw(logits, RowSampling{0.0f, 1.0f, 0.0f, 0, 0.7}), want);
  EXPECT_EQ(device_draw(logits, RowSampling{1.0f, 0.5f, 0.0f, 1, 0.7}), want);  // top_k 1
  logits[17] = INFINITY;                                                      // an infinite logit wins
  EXPECT_EQ(device_draw(logits, RowSampling{1.0f, 1.0f, 0.0f, 0, 0.3}), 17);
  const std::vector<float> zeros = {-0.0f, 0.0f, -1.0f};  // −0 and +0 are one key
  EXPECT_EQ(device_draw(zeros, RowSampling{0.0f, 1.0f, 0.0f, 0, 0.0}), 0);
  EXPECT_EQ(device_draw(zeros, RowSampling{1.0f, 1.0f, 0.0f, 2, 0.75}), 1);  // the two zeros, half each
}

}  // namespace
}  // namespace plow::cuda
