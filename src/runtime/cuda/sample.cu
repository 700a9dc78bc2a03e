// The launch of sample.cuh's block: one per row drawn.
#include "runtime/cuda/kernels.h"  // cuda_failure, launch_sample
#include "runtime/cuda/sample.cuh"

namespace plow::cuda {

namespace {

__global__ void __launch_bounds__(kSampleThreads, 1)
    sample_kernel(const float* logits, int vocab, const int32_t* first_row, const int32_t* tokens, const RowSampling* rows, int32_t* ids) {
  __shared__ sampling::Shared shared;
  const int s = static_cast<int>(blockIdx.x);
  const int64_t r = first_row != nullptr ? static_cast<int64_t>(first_row[s]) + tokens[s] - 1 : s;
  const int id = sampling::sample_row(logits + r * vocab, vocab, rows[s], shared);
  if (threadIdx.x == 0) ids[s] = id;
}

}  // namespace

void launch_sample(const float* logits, int64_t vocab, const int32_t* first_row, const int32_t* tokens, const RowSampling* rows, int num_seqs,
                   int32_t* ids, cudaStream_t stream) {
  if (num_seqs < 1) return;
  // The masses are 40-bit fixed point in 64-bit sums (sample.cuh): room for 2^23 tokens.
  if (vocab < 1 || vocab > (int64_t{1} << 23)) cuda_failure("sampling: vocabulary size", cudaErrorInvalidValue);
  sample_kernel<<<num_seqs, kSampleThreads, 0, stream>>>(logits, static_cast<int>(vocab), first_row, tokens, rows, ids);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_failure("sampling", error);
}

}  // namespace plow::cuda
