// Token sampling from one row of logits: greedy at temperature 0 (ties to the lower id), otherwise
// temperature, top-k, top-p over a seeded generator, so a seed reproduces a run.
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace plow {

struct SamplingParams {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int64_t top_k = 0;  // 0: no limit
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(SamplingParams params) : params_(params), rng_(params.seed) {}
  int32_t sample(std::span<const float> logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

int32_t argmax(std::span<const float> logits);

}  // namespace plow
