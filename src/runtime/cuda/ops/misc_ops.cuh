// The non-GEMV op bodies in one include for the megakernel's translation unit, and their dispatch:
// run_misc_op runs the body of ctx.op->opcode and returns true, or returns false for an opcode it does
// not own (the caller's switch handles the linear family, experts and tokens).
#pragma once

#include "graph/op_table.h"
#include "runtime/cuda/ops/all_reduce.cuh"
#include "runtime/cuda/ops/attn_res.cuh"
#include "runtime/cuda/ops/elementwise.cuh"
#include "runtime/cuda/ops/embedding.cuh"
#include "runtime/cuda/ops/kda.cuh"
#include "runtime/cuda/ops/kda_fused.cuh"
#include "runtime/cuda/ops/mla.cuh"
#include "runtime/cuda/ops/moe_topk.cuh"
#include "runtime/cuda/ops/norm.cuh"
#include "runtime/cuda/ops_attrs.h"

namespace plow::cuda {

static_assert(kPackedAttrs == kMaxAttrs, "ops_attrs.h and device.cuh disagree on the attribute count");

__device__ inline bool run_misc_op(const TaskCtx& ctx) {
  switch (static_cast<Op>(ctx.op->opcode)) {
    case Op::kEmbedding: op_embedding(ctx); return true;
    case Op::kRmsNorm: op_rms_norm(ctx); return true;
    case Op::kGatedRmsNorm: op_gated_rms_norm(ctx); return true;
    case Op::kAddNorm: op_add_norm(ctx); return true;
    case Op::kShortConvSilu: op_short_conv_silu(ctx); return true;
    case Op::kKdaGate: op_kda_gate(ctx); return true;
    case Op::kKdaDeltaRule: op_kda_delta_rule(ctx); return true;
    case Op::kKdaFusedCore: op_kda_fused_core(ctx); return true;
    case Op::kMlaAttention: op_mla_attention(ctx); return true;
    case Op::kSigmoid: op_sigmoid(ctx); return true;
    case Op::kSiluMul: op_silu_mul(ctx); return true;
    case Op::kAdd: op_add(ctx); return true;
    case Op::kSituMul: op_situ_mul(ctx); return true;
    case Op::kSigmoidMul: op_sigmoid_mul(ctx); return true;
    case Op::kMoeTopK: op_moe_topk(ctx); return true;
    case Op::kAttnResMix: op_attn_res_mix(ctx); return true;
    case Op::kAttnResNorm: op_attn_res_norm(ctx); return true;
    case Op::kAllReduce: op_all_reduce(ctx); return true;
    default: return false;
  }
}

// Whether run_misc_op has a body for `opcode` (host side too: for CudaBackend::has_op).
__host__ __device__ constexpr bool is_misc_op(uint8_t opcode) {
  switch (static_cast<Op>(opcode)) {
    case Op::kEmbedding: case Op::kRmsNorm: case Op::kGatedRmsNorm: case Op::kAddNorm: case Op::kShortConvSilu: case Op::kKdaGate:
    case Op::kKdaDeltaRule: case Op::kKdaFusedCore: case Op::kMlaAttention: case Op::kSigmoid: case Op::kSiluMul: case Op::kAdd:
    case Op::kSituMul: case Op::kSigmoidMul: case Op::kMoeTopK: case Op::kAttnResMix:
    case Op::kAttnResNorm: case Op::kAllReduce:
      return true;
    default:
      return false;
  }
}

}  // namespace plow::cuda
