// Attribute packing of the CUDA op bodies in runtime/cuda/ops/ (see ops_attrs.h). The layout of each op
// is documented at its device body; this file is the only writer. Integers travel as floats (exact
// below 2^24: widths are bounded by PlanLimits::kMaxWidth = 2^24).
#include "runtime/cuda/ops_attrs.h"

#include <algorithm>

#include "core/error.h"
#include "graph/op_table.h"
#include "runtime/cuda/ops/limits.h"

namespace plow::cuda {

namespace {

float value(const PlanOp& op, const char* name) { return op.attrs.f(name); }

int64_t integer(const PlanOp& op, const char* name) { return op.attrs.i(name); }

void pack_mla(const PlanOp& op, float* attr) {
  const int64_t rank = integer(op, "rank"), rope = integer(op, "rope");
  if (rank < 1 || rank > kMlaMaxRank || rope < 0 || rank + rope > kMlaMaxLatent) {
    fail("{}: cuda MLA supports kv_lora_rank ≤ {} and rank + rope ≤ {}, found rank {} and rope {}", op.label, kMlaMaxRank, kMlaMaxLatent,
         rank, rope);
  }
  attr[0] = value(op, "heads");
  attr[1] = value(op, "nope");
  attr[2] = value(op, "rope");
  attr[3] = value(op, "v");
  attr[4] = value(op, "rank");
  attr[5] = value(op, "eps");
}

void pack_router(const PlanOp& op, float* attr) {
  const int64_t experts = integer(op, "experts"), top_k = integer(op, "top_k");
  const int64_t groups = integer(op, "groups"), keep = integer(op, "topk_groups");
  if (experts < 1 || experts > kRouterMaxExperts || top_k < 1 || top_k > std::min<int64_t>(experts, kRouterMaxTopK)) {
    fail("{}: cuda moe_topk supports up to {} experts and top_k ≤ min(experts, {}), found {} experts and top_k {}", op.label,
         kRouterMaxExperts, kRouterMaxTopK, experts, top_k);
  }
  if (groups < 1 || experts % groups != 0 || keep < 1 || keep > groups) {
    fail("{}: router groups {} (keeping {}) must divide the {} experts and keep between 1 and all groups", op.label, groups, keep, experts);
  }
  attr[0] = static_cast<float>(experts);
  attr[1] = static_cast<float>(top_k);
  attr[2] = static_cast<float>(groups);
  attr[3] = static_cast<float>(keep);
  attr[4] = op.attrs.get("renormalize") != 0.0 ? 1.0f : 0.0f;
  attr[5] = value(op, "scale");
  attr[6] = op.attrs.get("softmax") != 0.0 ? 1.0f : 0.0f;
}

}  // namespace

bool pack_misc_attrs(const PlanOp& op, float* attr) {
  std::fill(attr, attr + kPackedAttrs, 0.0f);
  switch (op.op()) {
    case Op::kRmsNorm:
    case Op::kAddNorm:
      attr[0] = value(op, "eps");
      return true;
    case Op::kAttnResMix:
    case Op::kAttnResNorm:
      if (op.inputs.empty() || op.inputs.size() > static_cast<size_t>(kAttnResMaxValues)) {
        fail("{}: cuda AttnRes mixes 1 to {} values, found {}", op.label, kAttnResMaxValues, op.inputs.size());
      }
      attr[0] = value(op, "eps");
      attr[1] = op.op() == Op::kAttnResNorm ? value(op, "norm_eps") : 0.0f;
      return true;
    case Op::kGatedRmsNorm:
      attr[0] = value(op, "head_dim");
      attr[1] = value(op, "eps");
      return true;
    case Op::kShortConvSilu: {
      const int64_t kernel = integer(op, "kernel");
      if (kernel < 1 || kernel > kShortConvMaxKernel) fail("{}: conv kernel {} outside 1..{}", op.label, kernel, kShortConvMaxKernel);
      attr[0] = static_cast<float>(kernel);
      return true;
    }
    case Op::kKdaGate:
    case Op::kLinearKdaGate:  // the gate in a GEMV's epilogue (gemv.cuh): the same layout
      attr[0] = value(op, "head_dim");
      attr[1] = op.attrs.has("lower_bound") ? 1.0f : 0.0f;
      attr[2] = op.attrs.has("lower_bound") ? value(op, "lower_bound") : 0.0f;
      return true;
    case Op::kKdaDeltaRule: {
      const int64_t d = integer(op, "head_dim");
      if (d < 1 || d > kKdaMaxHeadDim) fail("{}: cuda KDA supports head_dim ≤ {}, found {}", op.label, kKdaMaxHeadDim, d);
      attr[0] = static_cast<float>(d);
      return true;
    }
    case Op::kKdaFusedCore: {
      const int64_t d = integer(op, "head_dim"), kernel = integer(op, "kernel");
      if (d < 1 || d > kKdaMaxHeadDim) fail("{}: cuda KDA supports head_dim ≤ {}, found {}", op.label, kKdaMaxHeadDim, d);
      if (kernel < 1 || kernel > kShortConvMaxKernel) fail("{}: conv kernel {} outside 1..{}", op.label, kernel, kShortConvMaxKernel);
      attr[0] = static_cast<float>(d);
      attr[1] = op.attrs.has("lower_bound") ? 1.0f : 0.0f;
      attr[2] = op.attrs.has("lower_bound") ? value(op, "lower_bound") : 0.0f;
      attr[3] = static_cast<float>(kernel);
      attr[4] = value(op, "conv_q");
      attr[5] = value(op, "conv_k");
      attr[6] = value(op, "conv_v");
      attr[7] = op.attrs.has("eps") ? value(op, "eps") : 0.0f;  // the output norm's (six inputs)
      return true;
    }
    case Op::kMlaAttention:
      pack_mla(op, attr);
      return true;
    case Op::kSituMul:
      attr[0] = value(op, "beta");
      attr[1] = value(op, "linear_beta");
      return true;
    case Op::kMoeTopK:
      pack_router(op, attr);
      return true;
    case Op::kEmbedding:
    case Op::kSigmoid:
    case Op::kSiluMul:
    case Op::kAdd:
    case Op::kSigmoidMul:
    case Op::kAllReduce:
      return true;
    default:
      return false;
  }
}

void pack_op_attrs(const PlanOp& op, float* attr) {
  std::fill(attr, attr + kPackedAttrs, 0.0f);
  const Attrs& a = op.attrs;
  auto get = [&](const char* name, double fallback = 0.0) { return static_cast<float>(a.has(name) ? a.get(name) : fallback); };
  switch (op.op()) {
    case Op::kTokens:
    case Op::kEmbedding:
    case Op::kLinear:
    case Op::kRouterLogits:
    case Op::kMultiLinear:
    case Op::kLinearAdd:
    case Op::kSlice:  // a view: no body
      return;
    case Op::kNormLinear:
    case Op::kNormMultiLinear:
    case Op::kAddNormMultiLinear:
    case Op::kAddNormRouterLogits:
      attr[0] = get("eps");
      return;
    case Op::kGateUpAct:
    case Op::kActLinear:
      attr[0] = get("act");
      attr[1] = get("beta");
      attr[2] = get("linear_beta");
      return;
    case Op::kGatedNormLinear:
      attr[0] = get("eps");
      attr[1] = get("head_dim");
      return;
    case Op::kMoeGateUp:
      attr[0] = get("top_k");
      attr[1] = get("situ");
      attr[2] = get("beta");
      attr[3] = get("linear_beta");
      return;
    case Op::kMoeDown:
    case Op::kMoeDownAdd:
      attr[0] = get("top_k");
      return;
    default:
      if (!pack_misc_attrs(op, attr)) fail("cuda: no attribute layout for op '{}' ({})", op.label, op_name(op.op()));
  }
}

bool cooperates(const PlanOp& op) {
  return op.op() == Op::kMlaAttention || op.op() == Op::kKdaDeltaRule || op.op() == Op::kAttnResMix || op.op() == Op::kAttnResNorm;
}

int64_t workspace_floats(const PlanOp& op, int64_t max_tokens, int64_t max_seqs, int32_t tasks) {
  if (op.op() == Op::kMlaAttention) {  // q_abs of every row (padded to 4 floats), then the partials of at most 2·tasks + Σ groups split items, Σ groups ≤ ⌈T·heads/16⌉ + T
    const int64_t heads = integer(op, "heads"), rank = integer(op, "rank");
    const int64_t latent = rank + integer(op, "rope");
    const int64_t items = 2 * int64_t{tasks} + (max_tokens * heads + kMlaGroupQueries - 1) / kMlaGroupQueries + max_tokens;
    return (max_tokens * heads * latent + 3) / 4 * 4 + items * kMlaGroupQueries * (2 + rank);
  }
  if (op.op() == Op::kKdaDeltaRule) {  // a record per (chunk, head); chunks ≤ Σ (tokens/C + 1) over the chunked sequences
    const int64_t d = integer(op, "head_dim");
    const int64_t chunks = (max_tokens + kKdaChunk - 1) / kKdaChunk + std::min(max_seqs, max_tokens / kKdaChunkedMinTokens);
    return chunks * (op.width / d) * kda_record_floats(kda_padded_dim(static_cast<int>(d)));
  }
  if (op.op() == Op::kAttnResMix || op.op() == Op::kAttnResNorm) {  // attn_res_workspace_floats, as attn_res_schedule cuts a step: rows · chunks ≤ tasks · item rows + rows
    const int64_t values = static_cast<int64_t>(op.inputs.size());
    return (int64_t{tasks} * kAttnResItemRows + max_tokens) * (2 * values + 1) + max_tokens * values;
  }
  return 0;
}

}  // namespace plow::cuda
