// Token sampling from one row of logits, with the OpenAI/vLLM controls: repetition (prompt and
// output), presence and frequency (output) penalties, temperature, top-k, top-p, min-p, a per-request
// seed (a seed reproduces a run), and logprobs of the model's own distribution (before any of the
// controls, as vLLM reports them). Temperature 0 is greedy, ties to the lower id.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

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

class Sampler {
 public:
  explicit Sampler(SamplingParams params) : params_(params), rng_(params.seed) {}
  int32_t sample(std::span<const float> logits) { return sample(logits, {}, {}).id; }
  // prompt/output: the sequence so far, for the penalties.
  SampledToken sample(std::span<const float> logits, std::span<const int32_t> prompt, std::span<const int32_t> output);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

int32_t argmax(std::span<const float> logits);

}  // namespace plow
