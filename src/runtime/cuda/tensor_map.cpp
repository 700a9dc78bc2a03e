#include "runtime/cuda/tensor_map.h"

#include <cuda_runtime.h>

#include <cstdio>

#include "runtime/cuda/kernels.h"  // cuda_failure

namespace plow::cuda {

namespace {

// The driver's cuTensorMapEncodeTiled through the runtime, found once.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found);
    if (error != cudaSuccess) cuda_failure("tensor maps: the driver's cuTensorMapEncodeTiled", error);
    if (found != cudaDriverEntryPointSuccess || entry == nullptr) cuda_failure("tensor maps: the driver has no cuTensorMapEncodeTiled", cudaErrorNotSupported);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  }();
  return fn;
}

}  // namespace

CUtensorMap tensor_map_2d(CUtensorMapDataType type, int elem_bytes, const void* data, int64_t rows, int64_t cols, int64_t ld, uint32_t box_cols,
                          uint32_t box_rows, CUtensorMapSwizzle swizzle, const char* who) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * static_cast<cuuint64_t>(elem_bytes)};
  const cuuint32_t box[2] = {box_cols, box_rows}, element_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, type, 2, const_cast<void*>(data), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {  // the driver's code and the shape it refused (the runtime's error names no cause of its own)
    char what[224];
    std::snprintf(what, sizeof what, "%s: cuTensorMapEncodeTiled returned CUresult %d for [%lld, %lld] (row stride %lld) in boxes of %u x %u", who,
                  static_cast<int>(r), static_cast<long long>(rows), static_cast<long long>(cols), static_cast<long long>(ld), box_rows, box_cols);
    cuda_failure(what, cudaErrorInvalidValue);
  }
  return map;
}

}  // namespace plow::cuda
