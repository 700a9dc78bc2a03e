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

struct StepInputs {
  std::vector<int32_t> token_ids;       // [T], T = Σ query_tokens
  std::vector<SequenceStep> sequences;
  bool all_logits = false;              // true: logits for every token; false: the last token of each sequence
};

struct StepOutput {
  int64_t rows = 0;       // T when all_logits, else the number of sequences
  int64_t vocab = 0;
  std::vector<float> logits;  // [rows, vocab], upcast to f32
};

}  // namespace plow
