// Graph: a DAG of ops from the op table over activations of shape [T, width] (T = tokens of the
// step, symbolic), with declared weights (checkpoint tensors and their expected shapes) and declared
// per-sequence state (KDA conv windows, KDA recurrent state, MLA latent cache).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "graph/op_table.h"

namespace plow {

// A weight the graph reads. `parts` holds one tensor name, or E names for a stacked expert weight.
// Each part must have `shape` (after the allowed reshape: same element count when `reshape_ok`).
struct WeightDecl {
  std::string name;                 // canonical name (first part for stacks)
  std::vector<std::string> parts;   // checkpoint names, one per stacked slice
  std::vector<int64_t> shape;       // shape of one part
  bool reshape_ok = false;          // accept any shape with the same element count (A_log, dt_bias)
  bool mxfp4 = false;               // stored as "<part>_packed" + "<part>_scale" (compressed-tensors MXFP4)
  // Tensor parallelism (DESIGN.md §5): this rank reads block `shard_rank` of `shard_count` equal blocks
  // of each part along `shard_axis` (0: rows, 1: columns; a `reshape_ok` weight is cut as a flat
  // vector); `shape` is the block's shape. −1: the whole tensor (replicated).
  int shard_axis = -1;
  int shard_rank = 0;
  int shard_count = 1;
};

// Which rank of a tensor-parallel group a graph is built for (size 1: the whole model on one device).
struct TpShard {
  int rank = 0;
  int size = 1;
};

enum class StateKind : uint8_t { kConvWindow, kKdaRecurrent, kMlaLatent };

// Per-sequence state. kConvWindow: [width, kernel−1] last pre-conv inputs; kKdaRecurrent: fp32
// [heads, d, d]; kMlaLatent: one row of `width` per past token (grows with the context).
struct StateDecl {
  StateKind kind;
  int64_t width = 0;
  int64_t depth = 0;  // conv: kernel−1 columns; KDA: heads (state is heads × d × d with d = width / heads)
  std::string label;
};

struct Node {
  Op op = Op::kTokens;
  std::vector<int> inputs;   // node ids
  std::vector<int> weights;  // weight ids
  Attrs attrs;
  int state = -1;            // state id for stateful ops
  int64_t width = 0;         // inferred output width
  OutDType dtype = OutDType::kAct;
  std::string label;         // e.g. "layers.3.mla"
};

// The states a node updates besides `state`, by id: the conv windows of kda_fused_core (attrs conv_q,
// conv_k, conv_v); empty for every other op.
std::vector<int> extra_states(const Node& node);

class Graph {
 public:
  int add_weight(WeightDecl decl);
  int add_state(StateDecl decl);
  // Appends a node; infers and checks its width through the op's shape rule.
  int add(Op op, std::vector<int> inputs, std::vector<int> weights, Attrs attrs, std::string label, int state = -1);
  void set_output(int node) { output_ = node; }

  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<WeightDecl>& weights() const { return weights_; }
  const std::vector<StateDecl>& states() const { return states_; }
  int output() const { return output_; }
  const Node& node(int id) const { return nodes_.at(static_cast<size_t>(id)); }

  // Structural check: inputs precede their users, arities match the op table, output set.
  void verify() const;

 private:
  std::vector<Node> nodes_;
  std::vector<WeightDecl> weights_;
  std::vector<StateDecl> states_;
  int output_ = -1;
};

}  // namespace plow
