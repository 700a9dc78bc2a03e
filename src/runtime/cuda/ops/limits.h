// Shape limits of the CUDA op bodies (plain C++: read by the device bodies in ops/*.cuh and by the host
// attribute packing in ops_attrs.cpp, which refuses a plan beyond them at load).
#pragma once

namespace plow::cuda {

inline constexpr int kKdaMaxHeadDim = 128;      // KDA state of one head on chip: 128×128 fp32 in registers
inline constexpr int kMlaMaxRank = 512;         // kv_lora_rank (Kimi Linear, K3: 512)
inline constexpr int kMlaMaxLatent = 576;       // rank + rope (512 + 64)
inline constexpr int kMlaHeadsMaxContext = 512;  // MLA: steps of ≤ kMlaHeadsMaxRows rows over ≤ this many positions
inline constexpr int kMlaHeadsMaxRows = 2;       // per sequence run per head (mla_heads.cuh); measured: batch 1 faster, batch 8 slower
inline constexpr int kMlaGroupQueries = 16;     // MLA split-KV: (token, head) queries per work item (host sizes the workspace)
inline constexpr int kRouterMaxExperts = 1024;  // moe_topk candidates: 32 per lane
inline constexpr int kRouterMaxTopK = 64;
inline constexpr int kShortConvMaxKernel = 64;

}  // namespace plow::cuda
