// What the device sampler (sample.cuh) takes for a row, host-visible: the controls of a draw at
// temperature > 0 (engine/sampler.h) and the uniform the host drew for it.
#pragma once

#include <cstdint>

namespace plow::cuda {

inline constexpr int kSampleThreads = 512;  // a block a row

struct RowSampling {
  float temperature = 0.0f;  // ≤ 0: the argmax
  float top_p = 1.0f;
  float min_p = 0.0f;
  int32_t top_k = 0;         // 0, or ≥ the vocabulary: no limit
  double u = 0.0;            // the draw's uniform in [0, 1)
};

}  // namespace plow::cuda
