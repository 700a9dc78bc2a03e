#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace plow {

int32_t argmax(std::span<const float> logits) {
  PLOW_CHECK(!logits.empty(), "argmax of no logits");
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (params_.temperature <= 0.0f) return argmax(logits);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]; });
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < order.size()) order.resize(static_cast<size_t>(params_.top_k));
  std::vector<double> probs(order.size());
  const double top = logits[static_cast<size_t>(order[0])];
  double total = 0.0;
  for (size_t i = 0; i < order.size(); ++i) {
    total += probs[i] = std::exp((logits[static_cast<size_t>(order[i])] - top) / params_.temperature);
  }
  // top-p: the smallest prefix whose mass reaches p (always at least one token)
  size_t keep = order.size();
  if (params_.top_p < 1.0f) {
    double mass = 0.0;
    for (size_t i = 0; i < order.size(); ++i) {
      mass += probs[i] / total;
      if (mass >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  std::discrete_distribution<size_t> pick(probs.begin(), probs.begin() + static_cast<std::ptrdiff_t>(keep));
  return order[pick(rng_)];
}

}  // namespace plow
