// Slot snapshots for the CPU backends: a SlotState is plain vectors, so a snapshot is a copy. The
// copy is exact (floats moved, never recomputed), which is what makes a prefix-cache hit bit-identical.
#include "core/error.h"
#include "runtime/backend.h"
#include "runtime/cpu/op_context.h"

namespace plow {

SlotSnapshot save_slot_state(const SlotState& state, const std::vector<StateDecl>& decls, int64_t rows_begin) {
  PLOW_CHECK(state.buffers.size() == decls.size(), "slot has {} buffers for {} states", state.buffers.size(), decls.size());
  if (rows_begin < 0 || rows_begin > state.context_tokens) {
    fail("save_slot: rows_begin {} outside the slot's 0..{} tokens", rows_begin, state.context_tokens);
  }
  SlotSnapshot snap;
  snap.tokens = state.context_tokens;
  snap.rows_begin = rows_begin;
  for (size_t i = 0; i < decls.size(); ++i) {
    const std::vector<float>& buffer = state.buffers[i];
    if (decls[i].kind == StateKind::kMlaLatent) {
      const int64_t width = decls[i].width;
      PLOW_CHECK(static_cast<int64_t>(buffer.size()) == state.context_tokens * width, "latent cache '{}' holds {} floats for {} tokens",
                 decls[i].label, buffer.size(), state.context_tokens);
      snap.row_floats.push_back(width);
      snap.fixed.emplace_back();
      snap.rows.emplace_back(buffer.begin() + rows_begin * width, buffer.end());
    } else {
      snap.row_floats.push_back(0);
      snap.fixed.push_back(buffer);
      snap.rows.emplace_back();
    }
  }
  return snap;
}

void restore_slot_state(SlotState& state, const std::vector<StateDecl>& decls, const SlotSnapshot& snapshot, int64_t max_context_tokens) {
  if (snapshot.rows_begin != 0) fail("restore_slot: the snapshot starts at row {}, a restore needs every row from 0", snapshot.rows_begin);
  if (snapshot.fixed.size() != decls.size() || snapshot.rows.size() != decls.size()) {
    fail("restore_slot: the snapshot has {} states, this model {}", snapshot.fixed.size(), decls.size());
  }
  if (max_context_tokens > 0 && snapshot.tokens > max_context_tokens) {
    fail("restore_slot: the snapshot holds {} tokens, the maximum context is {}", snapshot.tokens, max_context_tokens);
  }
  PLOW_CHECK(state.buffers.size() == decls.size(), "slot has {} buffers for {} states", state.buffers.size(), decls.size());
  for (size_t i = 0; i < decls.size(); ++i) {
    std::vector<float>& buffer = state.buffers[i];
    const std::vector<float>& source = decls[i].kind == StateKind::kMlaLatent ? snapshot.rows[i] : snapshot.fixed[i];
    const size_t expected = decls[i].kind == StateKind::kMlaLatent ? static_cast<size_t>(snapshot.tokens * decls[i].width) : buffer.size();
    if (source.size() != expected) {
      fail("restore_slot: state '{}' has {} floats in the snapshot, expected {}", decls[i].label, source.size(), expected);
    }
    buffer.assign(source.begin(), source.end());  // keeps capacity: reserved caches never reallocate
  }
  state.context_tokens = snapshot.tokens;
}

}  // namespace plow
