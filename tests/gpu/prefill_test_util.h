// Helpers the GPU prefill tests share (cuda_prefill_test.cpp, cuda_prefill_kda_test.cpp): small test
// graphs' weights, the bf16 rounding check and the scripted steps' token ids.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "graph/graph.h"
#include "runtime/step.h"

namespace plow::gpu_test {

// A one-part weight `name` of shape `dims` declared in `g`.
inline int declare_weight(Graph& g, const std::string& name, std::vector<int64_t> dims) {
  WeightDecl decl;
  decl.name = name;
  decl.parts = {name};
  decl.shape = std::move(dims);
  return g.add_weight(std::move(decl));
}

// Whether v is a bf16 value (its low 16 bits zero).
inline bool exact_bf16(float v) {
  uint32_t bits = 0;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0xFFFFu) == 0;
}

// Step k of a script over these sequences: every row's output returned, token ids from slot, position
// and step (ids < 50, the test graphs' vocabulary).
inline StepInputs script_step(const std::vector<SequenceStep>& seqs, size_t k) {
  StepInputs in;
  in.all_logits = true;
  in.sequences = seqs;
  for (const SequenceStep& seq : seqs) {
    for (int64_t t = 0; t < seq.query_tokens; ++t) in.token_ids.push_back(static_cast<int32_t>((t * 13 + seq.slot * 7 + static_cast<int64_t>(k) * 5) % 50));
  }
  return in;
}

}  // namespace plow::gpu_test
