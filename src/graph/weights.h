// Binding a graph's declared weights to checkpoint tensors: the structural coverage gate.
// Every declared weight must exist with its declared shape and a float dtype; every checkpoint
// tensor must be claimed by some declaration. Failures name the directory, tensor and shapes.
#pragma once

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
  BoundWeights(const Graph& graph, const Checkpoint& checkpoint);

  const BoundWeight& operator[](int id) const { return bound_.at(static_cast<size_t>(id)); }
  size_t size() const { return bound_.size(); }
  // The dtype most weights are stored in (that of the first declared weight, the embedding).
  DType storage_dtype() const;

 private:
  std::vector<BoundWeight> bound_;
};

}  // namespace plow
