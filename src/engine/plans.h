// Plans for a loaded model: the fingerprint that ties a plan to the model it was compiled from.
#pragma once

#include <cstdint>

#include "engine/model.h"

namespace plow {

// model_fingerprint(text of config.source, model.graph): the same for a checkpoint directory and for
// its config with random weights (the weights' values are not hashed, their names and shapes are).
uint64_t fingerprint_of(const LoadedModel& model);

}  // namespace plow
