// How a bound weight lies in device memory, without CUDA headers: the cuda backend's upload
// (device_weights.cpp) and the host emulator's (tests/gpu/emu) lay weights out by these rules.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "graph/graph.h"
#include "graph/weights.h"
#include "runtime/cuda/device_types.h"

namespace plow::cuda {

inline int32_t weight_type(DType dtype, const std::string& name) {
  switch (dtype) {
    case DType::F32: return kWF32;
    case DType::BF16: return kWBF16;
    case DType::F16: return kWF16;
    default: fail("cuda: weight '{}' has dtype {}, expected F32, BF16 or F16 (or MXFP4)", name, dtype_name(dtype));
  }
}

// [rows, cols] of one part: 2-D as is; higher rank folds the trailing dimensions; 1-D is one row.
inline std::pair<int64_t, int64_t> matrix_shape(const std::vector<int64_t>& shape) {
  if (shape.size() <= 1) return {1, shape.empty() ? 1 : shape[0]};
  int64_t cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
  return {shape[0], cols};
}

inline size_t type_size(int32_t type) { return type == kWF32 ? 4 : 2; }

// The DeviceWeight of a bound weight, its pointers null: shape, type and the bytes of a part (stacked
// parts lie back to back; MXFP4 codes and scales in two buffers). Throws when the parts' dtypes differ.
inline DeviceWeight weight_layout(const WeightDecl& decl, const BoundWeight& bound) {
  const auto [rows, cols] = matrix_shape(decl.shape);
  DeviceWeight w;
  w.rows = rows;
  w.cols = cols;
  w.parts = static_cast<int32_t>(bound.parts.size());
  const TensorView& first = *bound.parts.front();
  if (first.is_mxfp4()) {
    w.type = kWMXFP4;
    w.part_bytes = rows * cols / 2;
    w.scale_part_bytes = rows * cols / 32;
  } else {
    w.type = weight_type(first.dtype, first.name);
    w.part_bytes = rows * cols * static_cast<int64_t>(type_size(w.type));
  }
  for (const TensorView* part : bound.parts) {
    if ((w.type == kWMXFP4) != part->is_mxfp4() || (w.type != kWMXFP4 && weight_type(part->dtype, part->name) != w.type)) {
      fail("cuda: the parts of stacked weight '{}' differ in dtype ('{}')", decl.name, part->name);
    }
  }
  return w;
}

}  // namespace plow::cuda
