// Backend: what the engine drives. One step() = one forward step over a batch (step.h); per-sequence
// state lives in slots. Implemented by cpu/reference (graph-level, the specification) and by the
// plan-level backends (cpu/interpreter, later cuda/*). A step that throws leaves the slots of its
// sequences undefined: reset them before reuse.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "runtime/step.h"

namespace plow {

// A slot's whole state after exactly `tokens` tokens, in host memory as f32, one entry per graph
// StateDecl (same order). Fixed-size states (conv windows, KDA recurrent state) are copied whole;
// per-token states (the MLA latent cache, `row_floats` floats per token) carry only the rows of
// positions [rows_begin, tokens), so a prefix cache can keep the shared rows once, in pages.
struct SlotSnapshot {
  int64_t tokens = 0;
  int64_t rows_begin = 0;
  std::vector<int64_t> row_floats;         // per state: floats per token (0: a fixed-size state)
  std::vector<std::vector<float>> fixed;   // per state: the whole buffer of a fixed-size state, else empty
  std::vector<std::vector<float>> rows;    // per state: [tokens − rows_begin, row_floats] of a per-token state

  int64_t bytes() const {
    int64_t floats = 0;
    for (const auto& f : fixed) floats += static_cast<int64_t>(f.size());
    for (const auto& r : rows) floats += static_cast<int64_t>(r.size());
    return floats * static_cast<int64_t>(sizeof(float));
  }
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual StepOutput step(const StepInputs& inputs) = 0;
  virtual void reset_slot(int slot) = 0;               // a new sequence: zero state, empty caches
  virtual int64_t context_tokens(int slot) const = 0;  // tokens this slot has consumed
  virtual int num_slots() const = 0;
  virtual DType act_dtype() const = 0;                 // the precision activations are rounded to

  // Whether step() draws the rows of StepInputs::draws itself (sampling on the device).
  virtual bool draws_rows() const { return false; }

  // Prefix caching (DESIGN.md §6). save_slot exports the slot's state at its current length, per-token
  // rows from `rows_begin` (0 ≤ rows_begin ≤ context_tokens). restore_slot makes a slot exactly as it
  // was when `snapshot` (rows_begin 0) was taken: the next step computes bit-identical outputs.
  // plow::Error when the snapshot does not fit this backend (state table, sizes, max context).
  virtual bool has_snapshots() const { return false; }
  virtual SlotSnapshot save_slot(int /*slot*/, int64_t /*rows_begin*/) const { fail("this backend has no slot snapshots"); }
  virtual void restore_slot(int /*slot*/, const SlotSnapshot& /*snapshot*/) { fail("this backend has no slot snapshots"); }
};

}  // namespace plow
