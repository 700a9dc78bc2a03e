#include "engine/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace plow {

namespace {
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

GenerateResult generate(Backend& backend, int slot, const GenerateOptions& options) {
  PLOW_CHECK(!options.prompt.empty(), "empty prompt");
  GenerateResult result;
  Sampler sampler(options.sampling);
  backend.reset_slot(slot);

  const auto prompt_tokens = static_cast<int64_t>(options.prompt.size());
  const int64_t chunk = options.prefill_chunk_tokens > 0 ? options.prefill_chunk_tokens : prompt_tokens;
  auto start = std::chrono::steady_clock::now();
  StepOutput last;
  for (int64_t begin = 0; begin < prompt_tokens; begin += chunk) {
    const int64_t count = std::min(chunk, prompt_tokens - begin);
    StepInputs step;
    step.token_ids.assign(options.prompt.begin() + begin, options.prompt.begin() + begin + count);
    step.sequences = {{slot, count}};
    step.all_logits = options.keep_logits;
    last = backend.step(step);
    if (options.keep_logits) result.logits.insert(result.logits.end(), last.logits.begin(), last.logits.end());
  }
  result.vocab = last.vocab;
  result.prefill_seconds = seconds_since(start);

  start = std::chrono::steady_clock::now();
  std::span<const float> row(last.logits.data() + (last.rows - 1) * last.vocab, static_cast<size_t>(last.vocab));
  for (int64_t n = 0; n < options.max_new_tokens; ++n) {
    const int32_t token = sampler.sample(row, options.prompt, result.generated).id;  // penalties see the history
    result.generated.push_back(token);
    const bool stop = std::find(options.stop_ids.begin(), options.stop_ids.end(), token) != options.stop_ids.end();
    if (stop || n + 1 == options.max_new_tokens) break;
    StepInputs step;
    step.token_ids = {n < static_cast<int64_t>(options.forced_tokens.size()) ? options.forced_tokens[static_cast<size_t>(n)] : token};
    step.sequences = {{slot, 1}};
    last = backend.step(step);
    if (options.keep_logits) result.logits.insert(result.logits.end(), last.logits.begin(), last.logits.end());
    row = std::span<const float>(last.logits.data(), static_cast<size_t>(last.vocab));
  }
  result.decode_seconds = seconds_since(start);
  return result;
}

}  // namespace plow
