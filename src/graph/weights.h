// Binding a graph's declared weights to checkpoint tensors: the structural coverage gate.
// Every declared weight must exist with its declared shape and a float dtype; every checkpoint
// tensor must be claimed by some declaration. Failures name the directory, tensor and shapes.
#pragma once

#include <deque>
#include <set>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "model/safetensors.h"

namespace plow {

struct BoundWeight {
  const WeightDecl* decl = nullptr;
  std::vector<const TensorView*> parts;  // one per stacked slice
};

class BoundWeights {
 public:
  // Tensors whose names do not start with `text_prefix` (a K3 wrapper's vision tower) are not claimed
  // and not required; with an empty prefix every tensor must be claimed.
  BoundWeights(const Graph& graph, const Checkpoint& checkpoint, const std::string& text_prefix = "");

  const BoundWeight& operator[](int id) const { return bound_.at(static_cast<size_t>(id)); }
  size_t size() const { return bound_.size(); }
  // The dtype most weights are stored in (that of the first declared weight, the embedding).
  DType storage_dtype() const;

 private:
  const TensorView* bind_mxfp4(const WeightDecl& decl, const std::vector<int64_t>& shape, const std::string& part,
                               const Checkpoint& checkpoint, std::set<const TensorView*>& claimed);
  // This rank's block of `whole` (decl.shard_*): a view into it for a block of rows (or of a flat
  // vector), a copy for a block of columns.
  const TensorView* shard_of(const TensorView& whole, const WeightDecl& decl);

  std::vector<BoundWeight> bound_;
  std::deque<TensorView> mxfp4_views_;  // logical views over packed + scale tensor pairs
  std::deque<TensorView> shard_views_;  // tensor-parallel blocks
  std::deque<std::vector<uint8_t>> shard_bytes_;  // column blocks, copied
};

}  // namespace plow
