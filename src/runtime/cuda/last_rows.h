// The rows whose logits a step returns: the last row of each of its sequences (prefill_gemm.h). Plain
// data, seen by host code and nvcc alike.
#pragma once

#include <cstdint>

namespace plow::cuda {

// Device arrays of the step upload (StepView): first row and tokens per sequence.
struct LastRows {
  const int32_t* first_row = nullptr;
  const int32_t* tokens = nullptr;
  int num_seqs = 0;
};

}  // namespace plow::cuda
