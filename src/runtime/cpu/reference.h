// cpu/reference: runs the graph op by op, naive loops, fp32 accumulation, rounding to the activation
// dtype at the points spec/MODEL.md fixes. This backend is THE SPECIFICATION every faster path is
// tested against: keep it simple (no tiling, no fusion, no threads).
#pragma once

#include <array>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "graph/graph.h"
#include "graph/weights.h"
#include "runtime/backend.h"
#include "runtime/cpu/op_context.h"
#include "runtime/step.h"

namespace plow {

class ReferenceBackend : public Backend {
 public:
  // act_dtype: F32, BF16 or F16 (the precision activations are rounded to). num_slots: sequences
  // that can hold state at once. collective: the tensor-parallel group of a rank's graph (all_reduce).
  ReferenceBackend(const Graph& graph, const BoundWeights& weights, DType act_dtype, int num_slots, Collective* collective = nullptr);

  StepOutput step(const StepInputs& inputs) override;
  void reset_slot(int slot) override;        // a new sequence: zero conv windows and KDA state, empty MLA cache
  int64_t context_tokens(int slot) const override;  // tokens this slot has consumed
  int num_slots() const override { return static_cast<int>(slots_.size()); }
  DType act_dtype() const override { return act_dtype_; }
  bool has_snapshots() const override { return true; }
  SlotSnapshot save_slot(int slot, int64_t rows_begin) const override;
  void restore_slot(int slot, const SlotSnapshot& snapshot) override;

 private:
  const Graph& graph_;
  const BoundWeights& weights_;
  DType act_dtype_;
  Collective* collective_;
  std::vector<SlotState> slots_;
  std::array<CpuOpFn, static_cast<size_t>(Op::kCount)> kernels_{};
};

// Runs a stateless graph (no KDA/MLA state) over `rows` tokens; each kInput node takes the values
// given under its label ([rows, width]). Returns the output node's values. Used to evaluate both
// sides of a rewrite rule for its certificate.
std::vector<float> evaluate_graph(const Graph& graph, const BoundWeights& weights, DType act_dtype, int64_t rows,
                                  const std::map<std::string, std::vector<float>>& inputs);

// The same for one step of `step.sequences` (rows: their tokens; token ids unused) over slots whose
// states stateful ops read and update (fresh_slot_states: zero windows and KDA states, empty MLA
// caches): the certificates of rules over stateful ops run two steps and compare the states too.
std::vector<float> evaluate_graph(const Graph& graph, const BoundWeights& weights, DType act_dtype, const StepInputs& step,
                                  std::span<SlotState> slots, const std::map<std::string, std::vector<float>>& inputs);
std::vector<SlotState> fresh_slot_states(const Graph& graph, int num_slots);

}  // namespace plow
