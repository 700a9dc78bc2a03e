// Shape limits of the CUDA op bodies (plain C++: read by the device bodies in ops/*.cuh and by the host
// attribute packing in ops_attrs.cpp, which refuses a plan beyond them at load).
#pragma once

namespace plow::cuda {

inline constexpr int kKdaMaxHeadDim = 128;      // KDA state of one head on chip: 128×128 fp32 in registers
inline constexpr int kMlaMaxRank = 512;         // kv_lora_rank (Kimi Linear, K3: 512)
inline constexpr int kMlaMaxLatent = 576;       // rank + rope (512 + 64)
inline constexpr int kMlaGroupQueries = 16;     // MLA split-KV: (token, head) queries per work item (host sizes the workspace)
inline constexpr int kRouterMaxExperts = 1024;  // moe_topk candidates: 32 per lane
inline constexpr int kRouterMaxTopK = 64;
// moe_gemm.h's device routing sort: one block, an expert per thread, the step's expert ids in shared memory.
inline constexpr int kMoeDeviceMaxExperts = 1024, kMoeDeviceMaxPairs = 2048;
inline constexpr int kMoeGemvMaxStagedBytes = 200 * 1024;  // its GEMV's staged rows of a block (an SM holds 227 KB)
inline constexpr int kShortConvMaxKernel = 64;

// Block AttnRes (attn_res.cuh): rows of a work item, the values (depth) a mix takes at most, and the
// workspace floats of a step of `rows` rows whose items cut the columns into `chunks` (none for one).
inline constexpr int kAttnResItemRows = 8;
inline constexpr int kAttnResMaxValues = 1024;
constexpr long long attn_res_workspace_floats(long long rows, long long values, long long chunks) {
  return chunks > 1 ? rows * chunks * (2 * values + 1) + rows * values : 0;
}

// Chunked KDA prefill (kda_chunked.cuh): positions per chunk, and the workspace record of one (chunk,
// head) for head dim d, whose bodies run at the padded dim (16, 32, 64 or 128): T' and M [C][C], then
// Q⊙e^γ, K⊙e^γ and K⊙e^{γ_C−γ} [C][D], then e^{γ_C} [D].
inline constexpr int kKdaChunk = 64;
inline constexpr int kKdaChunkedMinTokens = 16;  // a sequence's tokens in a step from which it runs chunked
constexpr int kda_padded_dim(int d) { return d <= 16 ? 16 : d <= 32 ? 32 : d <= 64 ? 64 : 128; }
constexpr long long kda_record_floats(int padded_dim) { return 2LL * kKdaChunk * kKdaChunk + 3LL * kKdaChunk * padded_dim + padded_dim; }

}  // namespace plow::cuda
