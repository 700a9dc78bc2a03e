// Backend: what the engine drives. One step() = one forward step over a batch (step.h); per-sequence
// state lives in slots. Implemented by cpu/reference (graph-level, the specification) and by the
// plan-level backends (cpu/interpreter, later cuda/*). A step that throws leaves the slots of its
// sequences undefined: reset them before reuse.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "runtime/step.h"

namespace plow {

class Backend {
 public:
  virtual ~Backend() = default;

  virtual StepOutput step(const StepInputs& inputs) = 0;
  virtual void reset_slot(int slot) = 0;               // a new sequence: zero state, empty caches
  virtual int64_t context_tokens(int slot) const = 0;  // tokens this slot has consumed
  virtual int num_slots() const = 0;
  virtual DType act_dtype() const = 0;                 // the precision activations are rounded to
};

}  // namespace plow
