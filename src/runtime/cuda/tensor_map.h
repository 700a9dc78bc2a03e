// 2D tensor maps for the tensor memory accelerator (TMA), encoded on the host through the driver's
// cuTensorMapEncodeTiled (found through the runtime: no libcuda link). The kernels read them with
// mbarrier.cuh's tensor_g2s_2d.
#pragma once

#include <cudaTypedefs.h>  // CUtensorMap and the driver's types

#include <cstdint>

namespace plow::cuda {

// A row-major [rows][cols] matrix of `type` (elem_bytes each, row stride ld elements) in boxes of
// box_cols × box_rows, zeros outside the matrix (a box may pass its last column: its rows land padded
// with zeros), L2 promotion of 256 bytes. `who` names the caller in the error when the driver refuses
// the shape.
CUtensorMap tensor_map_2d(CUtensorMapDataType type, int elem_bytes, const void* data, int64_t rows, int64_t cols, int64_t ld, uint32_t box_cols,
                          uint32_t box_rows, CUtensorMapSwizzle swizzle, const char* who);

}  // namespace plow::cuda
