// Logits of two runs compared row by row (the oracle tests' measures): the largest |a − b| overall,
// the median over rows of each row's largest |a − b|, and how often the rows' argmaxes agree (lowest
// index on ties). NaN anywhere counts as an infinite difference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace plow::test {

struct Comparison {
  float max_abs = 0.0f;
  float median_row_max = 0.0f;
  float argmax_agreement = 0.0f;
};

inline Comparison compare(const std::vector<float>& a, const std::vector<float>& b, int64_t vocab) {
  Comparison result;
  std::vector<float> row_max;
  int agree = 0;
  const auto rows = static_cast<int64_t>(a.size()) / vocab;
  for (int64_t r = 0; r < rows; ++r) {
    float worst = 0.0f;
    int64_t best_a = 0, best_b = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      const auto i = static_cast<size_t>(r * vocab + v);
      worst = std::isnan(a[i]) || std::isnan(b[i]) ? INFINITY : std::max(worst, std::fabs(a[i] - b[i]));
      if (a[i] > a[static_cast<size_t>(r * vocab + best_a)]) best_a = v;
      if (b[i] > b[static_cast<size_t>(r * vocab + best_b)]) best_b = v;
    }
    row_max.push_back(worst);
    result.max_abs = std::max(result.max_abs, worst);
    agree += best_a == best_b;
  }
  std::sort(row_max.begin(), row_max.end());
  result.median_row_max = row_max[row_max.size() / 2];
  result.argmax_agreement = static_cast<float>(agree) / static_cast<float>(rows);
  return result;
}

}  // namespace plow::test
