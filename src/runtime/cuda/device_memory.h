// Device memory for the cuda backend's host code (internal to src/runtime/cuda): checked CUDA calls,
// an owning device buffer, the weight shapes and types as the device sees them, and the weight set.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "runtime/cuda/device_types.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/weight_layout.h"

namespace plow::cuda {

inline void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) cuda_failure(what, error);
}

// A device allocation freed with its owner.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n, const char* what) : bytes(n) {
    if (n == 0) return;
    const cudaError_t error = cudaMalloc(&ptr, n);
    if (error != cudaSuccess) {
      size_t free_bytes = 0, total = 0;
      cudaMemGetInfo(&free_bytes, &total);
      fail("cuda: cannot allocate {:.2f} GiB for {} ({:.2f} GiB free of {:.2f}): {}", static_cast<double>(n) / (1 << 30), what,
           static_cast<double>(free_bytes) / (1 << 30), static_cast<double>(total) / (1 << 30), cudaGetErrorString(error));
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(std::exchange(o.ptr, nullptr)), bytes(std::exchange(o.bytes, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

template <typename T>
DeviceBuffer upload(const std::vector<T>& host, const char* what) {
  DeviceBuffer buffer(std::max<size_t>(host.size() * sizeof(T), 16), what);
  if (!host.empty()) check(cudaMemcpy(buffer.ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), what);
  return buffer;
}

inline int32_t act_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return kAF32;
    case DType::BF16: return kABF16;
    case DType::F16: return kAF16;
    default: fail("cuda: activation dtype {} is not supported (expected F32, BF16 or F16)", dtype_name(dtype));
  }
}

inline int sm_count_of(int device) {
  int count = 0;
  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "device query");
  return count;
}


struct DeviceWeightSet {
  std::vector<DeviceWeight> by_id;  // graph weight id → device weight
  std::map<std::string, int> by_name;
  std::vector<DeviceBuffer> buffers;
  int64_t bytes = 0;
};

}  // namespace plow::cuda
