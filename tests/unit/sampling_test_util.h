// Shared by the sampling tests (the host sampler, the scheduler's draws, the device sampler on the
// emulator and on the GPU): random logit rows, the specification's kept tokens walked in id order as
// the device draws them, and a Backend that forwards to another (for decorators that count or answer).
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "engine/sampler.h"
#include "runtime/backend.h"

namespace plow::sampling_test {

// `vocab` logits, normal with spread `sigma`, rounded to `step` when step > 0 (ties), every 97th at −∞
// when `masked`.
inline std::vector<float> random_logits(size_t vocab, float sigma, float step, bool masked, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> logits(vocab);
  for (size_t i = 0; i < vocab; ++i) {
    float x = normal(rng);
    if (step > 0) x = std::round(x / step) * step;
    logits[i] = masked && i % 97 == 5 ? -INFINITY : x;
  }
  return logits;
}

inline SamplingParams controls(float temperature, float top_p, float min_p, int64_t top_k) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_p = top_p;
  p.min_p = min_p;
  p.top_k = top_k;
  return p;
}

// The kept tokens (id, probability) in id order: the walk a device draw takes.
inline std::vector<std::pair<int32_t, double>> kept_by_id(const TokenDistribution& d) {
  std::vector<std::pair<int32_t, double>> kept;
  for (size_t i = 0; i < d.ids.size(); ++i) kept.emplace_back(d.ids[i], d.probs[i]);
  std::sort(kept.begin(), kept.end());
  return kept;
}

// The token the id-order walk reaches at uniform u: the first whose running probability exceeds u.
inline int32_t draw_by_id(const TokenDistribution& d, double u) {
  const auto kept = kept_by_id(d);
  double mass = 0.0;
  for (const auto& [id, prob] : kept) {
    mass += prob;
    if (mass > u) return id;
  }
  return kept.back().first;
}

// A Backend passing everything to `inner`; decorators override step().
class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(Backend& inner) : inner_(inner) {}
  StepOutput step(const StepInputs& inputs) override { return inner_.step(inputs); }
  void reset_slot(int slot) override { inner_.reset_slot(slot); }
  int64_t context_tokens(int slot) const override { return inner_.context_tokens(slot); }
  int num_slots() const override { return inner_.num_slots(); }
  DType act_dtype() const override { return inner_.act_dtype(); }
  bool draws_rows() const override { return inner_.draws_rows(); }

 protected:
  Backend& inner_;
};

}  // namespace plow::sampling_test
