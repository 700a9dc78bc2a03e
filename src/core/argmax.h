// The largest of a row of floats and its first position: greedy decoding's pick (the lowest id on
// ties; NaN never wins over a number), shared by the sampler and the backends that answer a step with
// ids (StepInputs::argmax_only).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

namespace plow {

// The largest value (NaN ignored; −∞ when there is none), four compare chains at a time: one chain
// waited a compare's latency per value.
inline float max_value(std::span<const float> x) {
  float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
  const float* p = x.data();
  const size_t quads = x.size() / 4;
  for (size_t q = 0; q < quads; ++q, p += 4) {
    for (int j = 0; j < 4; ++j) m[j] = p[j] > m[j] ? p[j] : m[j];
  }
  for (size_t i = quads * 4; i < x.size(); ++i) m[0] = x[i] > m[0] ? x[i] : m[0];
  return std::max(std::max(m[0], m[1]), std::max(m[2], m[3]));
}

// The first position of the largest value; 0 for a row of NaNs (the caller checks the row is not empty).
inline int32_t argmax(std::span<const float> x) {
  const auto it = std::find(x.begin(), x.end(), max_value(x));
  return it == x.end() ? 0 : static_cast<int32_t>(it - x.begin());
}

}  // namespace plow
