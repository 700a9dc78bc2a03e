// Token sampling from one row of logits, with the OpenAI/vLLM controls: repetition (prompt and
// output), presence and frequency (output) penalties, temperature, top-k, top-p, min-p, a per-request
// seed (a seed reproduces a run), and logprobs of the model's own distribution (before any of the
// controls, as vLLM reports them). Temperature 0 is greedy, ties to the lower id.
//
// What a draw at temperature T > 0 chooses among (reference_distribution is this, written plainly):
// the penalized logits ℓ in the sampler's order (larger first, the lower id on equal ones), weights
// w = exp((ℓ − max ℓ) / T); top-k keeps the first k; top-p keeps the shortest prefix of those whose
// weight reaches top_p of theirs; min-p keeps the tokens with w ≥ min_p (w = 1 at the top). The draw
// picks a kept token with probability w / Σ kept w. Sampler gets the same tokens without sorting the
// vocabulary: top-k by a partial sort, top-p by sorting only the tokens above a weight threshold that
// already holds the mass, neither by one pass.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "core/argmax.h"
#include "runtime/step.h"

namespace plow {

struct SamplingParams {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int64_t top_k = 0;  // 0: no limit
  uint64_t seed = 0;
  float min_p = 0.0f;               // keep tokens with p ≥ min_p · p_max
  float repetition_penalty = 1.0f;  // > 1 discourages tokens seen in prompt or output (HF form)
  float presence_penalty = 0.0f;    // subtracted once from tokens present in the output
  float frequency_penalty = 0.0f;   // subtracted per occurrence in the output
  int top_logprobs = -1;            // −1: no logprobs; 0..20: the chosen token's and this many best
};

struct SampledToken {
  int32_t id = 0;
  float logprob = 0.0f;                            // of `id` under the model's distribution (if requested)
  std::vector<std::pair<int32_t, float>> top;      // best `top_logprobs` (id, logprob), best first
};

// The tokens a draw at temperature > 0 chooses among and their probabilities (summing to 1).
struct TokenDistribution {
  std::vector<int32_t> ids;
  std::vector<double> probs;
};

class Sampler {
 public:
  explicit Sampler(SamplingParams params) : params_(params), rng_(params.seed) {}
  int32_t sample(std::span<const float> logits) { return sample(logits, {}, {}).id; }
  // prompt/output: the sequence so far, for the penalties.
  SampledToken sample(std::span<const float> logits, std::span<const int32_t> prompt, std::span<const int32_t> output);
  // sample() returns the raw logits' argmax and nothing else (greedy, no penalties, no logprobs).
  bool picks_argmax() const;
  // A backend may draw this sequence's tokens itself (no penalties, no logprobs: the controls and a
  // uniform are all it needs); next_draw() gives them, taking the uniform sample() would have taken.
  bool draws_anywhere() const;
  RowDraw next_draw();
  // What sample() draws from at temperature > 0 (ids in the order the draw walks them); for tests.
  TokenDistribution distribution(std::span<const float> logits, std::span<const int32_t> prompt, std::span<const int32_t> output);

 private:
  std::span<const float> penalized(std::span<const float> raw, std::span<const int32_t> prompt, std::span<const int32_t> output);
  void keep(std::span<const float> logits);  // fills the kept tokens below
  int32_t draw();

  SamplingParams params_;
  std::mt19937_64 rng_;
  // Per-call buffers, kept to spare a vocabulary-sized allocation a token.
  std::vector<float> penalized_;
  std::vector<uint8_t> seen_;      // repetition penalty: ids already penalized in this call
  std::vector<float> weight_;      // dense: w per token id (0: not kept); sorted: w per kept_ entry
  std::vector<int32_t> kept_;      // sorted: the kept ids in the sampler's order
  bool dense_ = false;             // the kept tokens are every id with weight_[id] > 0, walked by id
  double kept_total_ = 0.0;        // Σ of the kept weights, in walk order
};

// The specification of the controls above: sorts the whole vocabulary (ids in the sampler's order).
// For the tests and as the peer of `plow bench sample`.
TokenDistribution reference_distribution(std::span<const float> logits, const SamplingParams& params, std::span<const int32_t> prompt,
                                         std::span<const int32_t> output);

}  // namespace plow
