// Single-sequence generation over any Backend: prefill (optionally split into chunks), then decode.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/sampler.h"
#include "runtime/backend.h"
#include "runtime/cpu/reference.h"  // callers construct the reference backend alongside generate()

namespace plow {

struct GenerateOptions {
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 16;
  SamplingParams sampling;
  int64_t prefill_chunk_tokens = 0;  // 0: the whole prompt in one step
  std::vector<int64_t> stop_ids;     // generation ends after emitting one of these
  bool keep_logits = false;          // collect [P+N−1, V] teacher-forced-equivalent logits
  std::vector<int32_t> forced_tokens;  // teacher forcing: step n consumes forced_tokens[n] instead of its own choice
};

struct GenerateResult {
  std::vector<int32_t> generated;
  std::vector<float> logits;  // when keep_logits: row i = logits after token i of prompt ++ generated[:-1]
  int64_t vocab = 0;
  double prefill_seconds = 0;
  double decode_seconds = 0;
};

GenerateResult generate(Backend& backend, int slot, const GenerateOptions& options);

}  // namespace plow
