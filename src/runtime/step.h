// The Step contract shared by every backend (DESIGN.md §2): one call runs one forward step over a
// batch of sequences. Tokens of a sequence are contiguous in `token_ids`, in the order of `sequences`.
#pragma once

#include <cstdint>
#include <vector>

namespace plow {

struct SequenceStep {
  int slot = 0;                // which per-sequence state (caches) this sequence uses
  int64_t query_tokens = 0;    // tokens of this sequence in this step (prefill chunk or 1 for decode)
};

// A row a backend may draw itself (StepInputs::draws): a temperature draw's controls (engine/sampler.h,
// without penalties or logprobs) and the uniform in [0, 1) the engine drew for it from the sequence's
// generator.
struct RowDraw {
  float temperature = 0.0f;  // ≤ 0: the argmax
  float top_p = 1.0f;
  float min_p = 0.0f;
  int64_t top_k = 0;         // 0: no limit
  double u = 0.0;
};

struct StepInputs {
  std::vector<int32_t> token_ids;       // [T], T = Σ query_tokens
  std::vector<SequenceStep> sequences;
  bool all_logits = false;              // true: logits for every token; false: the last token of each sequence
  // The engine picks every returned row by its argmax (greedy, no penalties or logprobs): a backend may
  // answer with StepOutput::argmax instead of the rows' logits (cuda: found on the device, so a step
  // downloads an id a sequence instead of a vocabulary of floats). Ignored with all_logits.
  bool argmax_only = false;
  // Empty, or one per sequence (given only to a backend whose draws_rows() holds): that backend answers
  // with StepOutput::argmax holding each row's drawn id. Ignored with all_logits.
  std::vector<RowDraw> draws;
};

struct StepOutput {
  int64_t rows = 0;       // T when all_logits, else the number of sequences
  int64_t vocab = 0;
  std::vector<float> logits;  // [rows, vocab], upcast to f32; empty when `argmax` answers the step
  std::vector<int32_t> argmax;  // [rows]: StepInputs::argmax_only's ids (lowest on ties) or draws' drawn ids, else empty
};

}  // namespace plow
