#include "engine/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include "core/error.h"

namespace plow {

namespace {

// The sampler's order: the larger logit first, the lower id on equal ones.
struct Before {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); }
};

void apply_penalties(std::vector<float>& logits, std::vector<uint8_t>& seen, const SamplingParams& p, std::span<const int32_t> prompt,
                     std::span<const int32_t> output) {
  const auto vocab = static_cast<int64_t>(logits.size());
  if (p.repetition_penalty != 1.0f) {
    seen.resize(logits.size(), 0);
    for (auto span : {prompt, output}) {
      for (int32_t id : span) {
        if (id < 0 || id >= vocab || seen[static_cast<size_t>(id)]) continue;
        seen[static_cast<size_t>(id)] = 1;
        float& x = logits[static_cast<size_t>(id)];
        x = x > 0 ? x / p.repetition_penalty : x * p.repetition_penalty;
      }
    }
    for (auto span : {prompt, output}) {
      for (int32_t id : span) {
        if (id >= 0 && id < vocab) seen[static_cast<size_t>(id)] = 0;
      }
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;
    for (int32_t id : output) counts[id] += 1;
    for (const auto& [id, n] : counts) {
      if (id >= 0 && id < vocab) logits[static_cast<size_t>(id)] -= p.presence_penalty + p.frequency_penalty * static_cast<float>(n);
    }
  }
}

bool has_penalties(const SamplingParams& p) { return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f; }

// Of `order` (the sampler's order) with weights w(order[i]) and their total: how many the draw keeps
// (top-p's shortest prefix reaching top_p of the total, cut further by min-p). `reached` tells whether
// top-p's prefix ended inside `order` (false: its mass stayed short, as rounding may leave it).
template <class Weight>
size_t kept_prefix(std::span<const int32_t> order, Weight w, double total, const SamplingParams& p, bool& reached) {
  size_t keep = order.size();
  reached = p.top_p >= 1.0f;
  if (!reached) {
    double mass = 0.0;
    for (size_t i = 0; i < order.size(); ++i) {
      mass += w(order[i]) / total;
      if (mass >= p.top_p) {
        keep = i + 1;
        reached = true;
        break;
      }
    }
  }
  if (p.min_p > 0.0f) {  // weights fall along the order: min-p keeps a prefix too
    size_t n = 0;
    while (n < keep && w(order[n]) >= p.min_p) ++n;
    keep = std::max<size_t>(n, 1);
  }
  return keep;
}

}  // namespace

bool Sampler::picks_argmax() const { return (params_.temperature <= 0.0f || params_.top_k == 1) && !has_penalties(params_) && params_.top_logprobs < 0; }

bool Sampler::draws_anywhere() const { return !has_penalties(params_) && params_.top_logprobs < 0; }

RowDraw Sampler::next_draw() {
  RowDraw d;
  d.temperature = params_.temperature;
  d.top_p = params_.top_p;
  d.min_p = params_.min_p;
  d.top_k = params_.top_k;
  d.u = params_.temperature > 0.0f && params_.top_k != 1 ? std::uniform_real_distribution<double>(0.0, 1.0)(rng_) : 0.0;
  return d;
}

std::span<const float> Sampler::penalized(std::span<const float> raw, std::span<const int32_t> prompt, std::span<const int32_t> output) {
  if (!has_penalties(params_)) return raw;
  penalized_.assign(raw.begin(), raw.end());
  apply_penalties(penalized_, seen_, params_, prompt, output);
  return penalized_;
}

void Sampler::keep(std::span<const float> logits) {
  const auto vocab = logits.size();
  const float top = max_value(logits);
  const float t = params_.temperature;
  auto w = [&](int32_t id) {
    const float v = std::exp((logits[static_cast<size_t>(id)] - top) / t);
    return v >= 0.0f ? v : 0.0f;  // a NaN logit is never drawn
  };
  const bool top_k = params_.top_k > 0 && static_cast<size_t>(params_.top_k) < vocab;
  dense_ = false;
  kept_.clear();
  weight_.clear();
  if (!std::isfinite(top)) {  // +∞ (or no number at all): the first such token, as greedy would pick
    kept_.push_back(argmax(logits));
    weight_.push_back(1.0f);
    kept_total_ = 1.0;
    return;
  }
  if (top_k) {
    kept_.resize(vocab);
    std::iota(kept_.begin(), kept_.end(), 0);
    const auto k = static_cast<std::ptrdiff_t>(params_.top_k);
    std::partial_sort(kept_.begin(), kept_.begin() + k, kept_.end(), Before{logits.data()});
    kept_.resize(static_cast<size_t>(k));
    double total = 0.0;
    for (int32_t id : kept_) total += w(id);
    bool reached = false;
    kept_.resize(kept_prefix(kept_, w, total, params_, reached));
  } else {
    // Every token's weight, once (the pass that costs: an exp a token).
    weight_.resize(vocab);
    if (params_.top_p >= 1.0f) {  // min-p at most: a filter, walked by id
      dense_ = true;
      kept_total_ = 0.0;
      for (size_t i = 0; i < vocab; ++i) {
        float v = w(static_cast<int32_t>(i));
        if (v < params_.min_p) v = 0.0f;
        kept_total_ += weight_[i] = v;
      }
      return;
    }
    // Top-p's prefix lies among the tokens of weight ≥ τ once their mass reaches top_p of the total
    // (every other token comes after them in the order): sort only those. τ: a power of two, from the
    // mass of each binade of weights (w ∈ [2^−b, 2^(1−b)), b < kBinades; the rest in the last), summed
    // in the same pass as the total.
    constexpr int kBinades = 64;
    double binade_mass[kBinades + 1] = {};
    double total = 0.0;
    for (size_t i = 0; i < vocab; ++i) {
      const float v = weight_[i] = w(static_cast<int32_t>(i));
      const int exponent = static_cast<int>(std::bit_cast<uint32_t>(v) >> 23 & 0xFFu);  // v ∈ [2^(e−127), 2^(e−126))
      binade_mass[std::clamp(127 - exponent, 0, kBinades)] += v;
      total += v;
    }
    float tau = 0.0f;
    double mass_above = 0.0;
    for (int b = 0; b < kBinades; ++b) {
      mass_above += binade_mass[b];
      if (mass_above >= params_.top_p * total) {
        tau = std::ldexp(1.0f, -b);
        break;
      }
    }
    auto dense = [this](int32_t id) { return weight_[static_cast<size_t>(id)]; };
    for (const float threshold : {tau, 0.0f}) {  // 0: the sums' rounding left τ's tokens short
      kept_.clear();
      double mass = 0.0;
      for (size_t i = 0; i < vocab; ++i) {
        if (weight_[i] >= threshold) {
          kept_.push_back(static_cast<int32_t>(i));
          mass += weight_[i];
        }
      }
      if (threshold > 0.0f && mass < params_.top_p * total) continue;
      std::sort(kept_.begin(), kept_.end(), Before{logits.data()});
      bool reached = false;
      const size_t n = kept_prefix(kept_, dense, total, params_, reached);
      if (reached || threshold == 0.0f) {
        kept_.resize(n);
        break;
      }
    }
  }
  // The sorted form: weight_ holds the kept tokens' weights in kept_'s order.
  weight_.resize(kept_.size());
  kept_total_ = 0.0;
  for (size_t i = 0; i < kept_.size(); ++i) kept_total_ += weight_[i] = w(kept_[i]);
}

int32_t Sampler::draw() {
  const double target = std::uniform_real_distribution<double>(0.0, 1.0)(rng_) * kept_total_;
  double mass = 0.0;
  int32_t last = -1;
  for (size_t i = 0; i < weight_.size(); ++i) {
    if (weight_[i] <= 0.0f) continue;
    last = dense_ ? static_cast<int32_t>(i) : kept_[i];
    mass += weight_[i];
    if (mass > target) return last;
  }
  PLOW_CHECK(last >= 0, "sampling kept no token");
  return last;  // the target fell past the sum's rounding
}

SampledToken Sampler::sample(std::span<const float> raw, std::span<const int32_t> prompt, std::span<const int32_t> output) {
  PLOW_CHECK(!raw.empty(), "sampling from no logits");
  const std::span<const float> logits = penalized(raw, prompt, output);
  SampledToken result;
  if (params_.temperature <= 0.0f || params_.top_k == 1) {
    result.id = argmax(logits);
  } else {
    keep(logits);
    result.id = draw();
  }
  if (params_.top_logprobs >= 0) {  // log-softmax of the raw logits, one pass for the total
    const float top = max_value(raw);
    double total = 0.0;
    for (float x : raw) total += std::exp(x - top);
    const auto log_total = static_cast<float>(std::log(total));
    auto logprob = [&](int32_t id) { return raw[static_cast<size_t>(id)] - top - log_total; };
    result.logprob = logprob(result.id);
    // The best n by one pass, kept in the sampler's order (n ≤ 20).
    const auto n = std::min<size_t>(static_cast<size_t>(params_.top_logprobs), raw.size());
    std::vector<int32_t> best;
    best.reserve(n + 1);
    const Before before{raw.data()};
    for (size_t i = 0; i < raw.size() && n > 0; ++i) {
      const auto id = static_cast<int32_t>(i);
      if (best.size() == n && !before(id, best.back())) continue;
      best.insert(std::upper_bound(best.begin(), best.end(), id, before), id);
      if (best.size() > n) best.pop_back();
    }
    for (int32_t id : best) result.top.emplace_back(id, logprob(id));
  }
  return result;
}

TokenDistribution Sampler::distribution(std::span<const float> raw, std::span<const int32_t> prompt, std::span<const int32_t> output) {
  PLOW_CHECK(!raw.empty() && params_.temperature > 0.0f, "a distribution needs logits and a temperature above 0");
  keep(penalized(raw, prompt, output));
  TokenDistribution d;
  for (size_t i = 0; i < weight_.size(); ++i) {
    if (weight_[i] <= 0.0f) continue;
    d.ids.push_back(dense_ ? static_cast<int32_t>(i) : kept_[i]);
    d.probs.push_back(weight_[i] / kept_total_);
  }
  return d;
}

TokenDistribution reference_distribution(std::span<const float> raw, const SamplingParams& params, std::span<const int32_t> prompt,
                                         std::span<const int32_t> output) {
  PLOW_CHECK(!raw.empty() && params.temperature > 0.0f, "a distribution needs logits and a temperature above 0");
  std::vector<float> logits(raw.begin(), raw.end());
  std::vector<uint8_t> seen;
  apply_penalties(logits, seen, params, prompt, output);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), Before{logits.data()});
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < order.size()) order.resize(static_cast<size_t>(params.top_k));
  const double top = logits[static_cast<size_t>(order[0])];
  std::vector<double> weight(logits.size());
  double total = 0.0;
  for (int32_t id : order) total += weight[static_cast<size_t>(id)] = std::exp((logits[static_cast<size_t>(id)] - top) / params.temperature);
  bool reached = false;
  order.resize(kept_prefix(order, [&](int32_t id) { return weight[static_cast<size_t>(id)]; }, total, params, reached));
  double kept = 0.0;
  for (int32_t id : order) kept += weight[static_cast<size_t>(id)];
  TokenDistribution d;
  for (int32_t id : order) {
    if (weight[static_cast<size_t>(id)] <= 0.0) continue;
    d.ids.push_back(id);
    d.probs.push_back(weight[static_cast<size_t>(id)] / kept);
  }
  return d;
}

}  // namespace plow
