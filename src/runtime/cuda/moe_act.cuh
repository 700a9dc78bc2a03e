// The activation of a gate_up op from one gate and one up dot as its GEMMs left them (rounded to their
// output type), with op_moe_gate_up's rounding points (ops/gemv.cuh): shared by the activation kernel
// (moe_gemm.cu) and the wgmma kernel's fused epilogue (moe_wgmma.cu), so both write the same bits.
#pragma once

#include <cstdint>

#include "runtime/cuda/device.cuh"

namespace plow::cuda {

__device__ __forceinline__ float moe_act_value(float g, float u, int32_t act, bool round_out, bool situ, float beta, float linear_beta) {
  const float ge = round_act(act, g), ue = round_act(act, u);
  const float v = situ ? round_act(act, situf_(ge, ue, beta, linear_beta)) : round_act(act, round_act(act, siluf_(ge)) * ue);
  return round_out ? round_act(act, v) : v;
}

}  // namespace plow::cuda
