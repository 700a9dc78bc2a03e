#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

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

namespace {

// log-softmax of the raw logits, for the logprobs the API reports.
std::vector<float> log_softmax(std::span<const float> logits) {
  const float top = *std::max_element(logits.begin(), logits.end());
  double total = 0.0;
  for (float x : logits) total += std::exp(static_cast<double>(x - top));
  const auto log_total = static_cast<float>(std::log(total));
  std::vector<float> out(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - top - log_total;
  return out;
}

void apply_penalties(std::vector<float>& logits, const SamplingParams& p, std::span<const int32_t> prompt,
                     std::span<const int32_t> output) {
  if (p.repetition_penalty != 1.0f) {
    std::vector<bool> seen(logits.size(), false);
    for (auto span : {prompt, output}) {
      for (int32_t id : span) seen[static_cast<size_t>(id)] = true;
    }
    for (size_t i = 0; i < logits.size(); ++i) {
      if (seen[i]) logits[i] = logits[i] > 0 ? logits[i] / p.repetition_penalty : logits[i] * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;
    for (int32_t id : output) counts[id] += 1;
    for (const auto& [id, n] : counts) {
      logits[static_cast<size_t>(id)] -= p.presence_penalty + p.frequency_penalty * static_cast<float>(n);
    }
  }
}

}  // namespace

SampledToken Sampler::sample(std::span<const float> raw, std::span<const int32_t> prompt, std::span<const int32_t> output) {
  PLOW_CHECK(!raw.empty(), "sampling from no logits");
  std::vector<float> logits(raw.begin(), raw.end());
  apply_penalties(logits, params_, prompt, output);
  SampledToken result;
  if (params_.temperature <= 0.0f) {
    result.id = argmax(logits);
  } else {
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
    size_t keep = order.size();
    if (params_.min_p > 0.0f) {  // probs[0] is the largest: keep p ≥ min_p · p_max
      keep = static_cast<size_t>(std::count_if(probs.begin(), probs.end(), [&](double q) { return q >= params_.min_p * probs[0]; }));
    }
    if (params_.top_p < 1.0f) {  // the smallest prefix whose mass reaches p (always at least one token)
      double mass = 0.0;
      for (size_t i = 0; i < keep; ++i) {
        mass += probs[i] / total;
        if (mass >= params_.top_p) {
          keep = i + 1;
          break;
        }
      }
    }
    std::discrete_distribution<size_t> pick(probs.begin(), probs.begin() + static_cast<std::ptrdiff_t>(std::max<size_t>(keep, 1)));
    result.id = order[pick(rng_)];
  }
  if (params_.top_logprobs >= 0) {
    const std::vector<float> logprobs = log_softmax(raw);
    result.logprob = logprobs[static_cast<size_t>(result.id)];
    std::vector<int32_t> order(logprobs.size());
    std::iota(order.begin(), order.end(), 0);
    const auto n = std::min<size_t>(static_cast<size_t>(params_.top_logprobs), order.size());
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n), order.end(),
                      [&](int32_t a, int32_t b) { return logprobs[static_cast<size_t>(a)] > logprobs[static_cast<size_t>(b)] || (logprobs[static_cast<size_t>(a)] == logprobs[static_cast<size_t>(b)] && a < b); });
    for (size_t i = 0; i < n; ++i) result.top.emplace_back(order[i], logprobs[static_cast<size_t>(order[i])]);
  }
  return result;
}

}  // namespace plow
