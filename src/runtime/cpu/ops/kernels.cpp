// The CPU kernel of each op of the op table, shared by the reference backend (whole ops) and the plan
// interpreter (column slices). An op without a kernel maps to nullptr; backends refuse it at load.
#include "runtime/cpu/op_context.h"

namespace plow {

CpuOpFn cpu_kernel(Op op) {
  switch (op) {
    case Op::kTokens: return nullptr;  // filled from StepInputs, not computed
    case Op::kEmbedding: return cpu_embedding;
    case Op::kRmsNorm: return cpu_rms_norm;
    case Op::kLinear: return cpu_linear;
    case Op::kShortConvSilu: return cpu_short_conv_silu;
    case Op::kKdaGate: return cpu_kda_gate;
    case Op::kSigmoid: return cpu_sigmoid;
    case Op::kKdaDeltaRule: return cpu_kda_delta_rule;
    case Op::kGatedRmsNorm: return cpu_gated_rms_norm;
    case Op::kMlaAttention: return cpu_mla_attention;
    case Op::kSiluMul: return cpu_silu_mul;
    case Op::kAdd: return cpu_add;
    case Op::kRouterLogits: return cpu_router_logits;
    case Op::kMoeTopK: return cpu_moe_topk;
    case Op::kMoeGateUp: return cpu_moe_gate_up;
    case Op::kMoeDown: return cpu_moe_down;
    case Op::kSituMul: return cpu_situ_mul;
    case Op::kSigmoidMul: return cpu_sigmoid_mul;
    case Op::kAttnResMix: return cpu_attn_res_mix;
    case Op::kInput: return nullptr;  // filled by the caller (evaluate_graph), not computed
    case Op::kNormLinear: return cpu_norm_linear;
    case Op::kMultiLinear: return cpu_multi_linear;
    case Op::kNormMultiLinear: return cpu_norm_multi_linear;
    case Op::kSlice: return cpu_slice;
    case Op::kLinearAdd: return cpu_linear_add;
    case Op::kLinearKdaGate: return cpu_linear_kda_gate;
    case Op::kKdaFusedCore: return cpu_kda_fused_core;
    case Op::kGateUpAct: return cpu_gate_up_act;
    case Op::kActLinear: return cpu_act_linear;
    case Op::kMoeDownAdd: return cpu_moe_down_add;
    case Op::kGatedNormLinear: return cpu_gated_norm_linear;
    case Op::kAddNorm: return cpu_add_norm;
    case Op::kAttnResNorm: return cpu_attn_res_norm;
    case Op::kAllReduce: return cpu_all_reduce;
    case Op::kAddNormMultiLinear: return cpu_add_norm_multi_linear;
    case Op::kAddNormRouterLogits: return cpu_add_norm_router_logits;
    case Op::kCount: break;
  }
  return nullptr;
}

}  // namespace plow
