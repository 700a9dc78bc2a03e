// What the routed-expert GEMMs' host code (moe_gemm.cpp) and their kernels (moe_gemm.cu, moe_wgmma.cu)
// share about the routing lists: the wgmma kernel's job size and the device routing sort's buffers.
// Plain C++: nvcc's translation units include it without the host headers of moe_gemm.h.
#pragma once

#include <cstddef>
#include <cstdint>

namespace plow::cuda {

// Sorted rows of one expert per wgmma job: an expert's rows past it take more jobs (each streams its
// weights again). A job of at most 64 rows is short (the BN = 64 kernel), a longer one long (BN = 128).
inline constexpr int kMoeWgmmaJobRows = 128;

// The wgmma kernel's jobs of a routing, as the host and the device sort write them: job_list[0] short
// jobs, job_list[1] long jobs, then the short jobs and the long ones, 3 ints each (expert, first sorted
// row, rows). At most experts + pairs / kMoeWgmmaJobRows jobs.
inline constexpr int64_t moe_job_list_ints(int64_t experts, int64_t pairs) { return 2 + 3 * (experts + pairs / kMoeWgmmaJobRows + 1); }

// Device scratch of the large-step routing sort (launch_moe_sort): keys (expert ids), the sorted keys,
// values (pair indices) for `pairs` pairs, and the radix sort's temporary storage.
struct MoeSortBuffers {
  int32_t *keys = nullptr, *sorted_keys = nullptr, *values = nullptr;
  void* temp = nullptr;
  size_t temp_bytes = 0;
};

}  // namespace plow::cuda
