// Random weights for a graph: every tensor the graph declares, drawn at load from a seed (no
// checkpoint on disk), at scales where each part of the model matters (spec/MODEL.md §8).
#pragma once

#include <cstdint>

#include "graph/graph.h"
#include "model/safetensors.h"

namespace plow {

// dtype: storage of the float weights (F32, BF16 or F16); A_log, dt_bias and the router bias stay
// F32 as in real checkpoints; MXFP4 declarations get random codes and scales.
Checkpoint random_checkpoint(const Graph& graph, uint64_t seed, DType dtype, const std::string& label);

}  // namespace plow
