// What a CPU reference op sees: its node, input activations [T, width] (f32 values already rounded
// to their dtype), bound weights, the output buffer, the step's sequences and their states.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "graph/graph.h"
#include "graph/weights.h"
#include "runtime/collective.h"
#include "runtime/step.h"

namespace plow {

struct SlotState {
  int64_t context_tokens = 0;  // tokens consumed before the current step (updated after it)
  std::vector<std::vector<float>> buffers;  // one per graph StateDecl
};

struct SlotSnapshot;
// The CPU backends' Backend::save_slot / restore_slot over one SlotState (slot_snapshot.cpp).
// restore_slot_state keeps each buffer's capacity (the interpreter reserves MLA caches once) and
// fails when the snapshot's tokens exceed max_context_tokens (> 0).
SlotSnapshot save_slot_state(const SlotState& state, const std::vector<StateDecl>& decls, int64_t rows_begin);
void restore_slot_state(SlotState& state, const std::vector<StateDecl>& decls, const SlotSnapshot& snapshot, int64_t max_context_tokens);

// Rows of `width` floats, row r at data + r × stride (stride 0 = width: a buffer of its own; a plan's
// view of another op's columns has that op's width as its stride).
struct Activation {
  const float* data = nullptr;
  int64_t width = 0;
  int64_t stride = 0;

  const float* row(int64_t r) const { return data + r * (stride > 0 ? stride : width); }
};

struct OpContext {
  const Node& node;
  std::span<const Activation> inputs;
  std::span<const BoundWeight* const> weights;
  float* out;                 // [rows, node.width]
  int64_t rows;               // T
  DType act_dtype;
  const StepInputs& step;
  std::span<SlotState> slots;
  // The slice of output columns this call computes: [col_begin, col_end), col_end < 0 = all. Plans
  // split ops over workers this way (heads-aligned for per-head ops); the reference computes it all.
  int64_t col_begin = 0;
  int64_t col_end = -1;
  Collective* collective = nullptr;  // the tensor-parallel group (all_reduce), null on one rank

  int64_t begin() const { return col_begin; }
  int64_t end() const { return col_end < 0 ? node.width : col_end; }

  // Rounds to the dtype of this node's output.
  float round_out(float value) const { return node.dtype == OutDType::kAct ? round_to(act_dtype, value) : value; }
  // Rounds to the activation dtype (an intermediate rounding point inside an op).
  float round_act(float value) const { return round_to(act_dtype, value); }
  const float* in(size_t i, int64_t row) const { return inputs[i].row(row); }
  float* out_row(int64_t row) const { return out + row * node.width; }
  std::vector<float>& state(int slot) const { return slots[static_cast<size_t>(slot)].buffers[static_cast<size_t>(node.state)]; }
};

using CpuOpFn = void (*)(OpContext&);

// The kernel for `op`, or nullptr when the CPU backends lack it (kTokens is filled by the backend).
CpuOpFn cpu_kernel(Op op);

// Kernel registration: each ops/*.cpp defines the functions for its rows of the op table.
void cpu_embedding(OpContext&);
void cpu_rms_norm(OpContext&);
void cpu_linear(OpContext&);
void cpu_short_conv_silu(OpContext&);
void cpu_kda_gate(OpContext&);
void cpu_sigmoid(OpContext&);
void cpu_kda_delta_rule(OpContext&);
void cpu_gated_rms_norm(OpContext&);
void cpu_mla_attention(OpContext&);
void cpu_silu_mul(OpContext&);
void cpu_add(OpContext&);
void cpu_router_logits(OpContext&);
void cpu_moe_topk(OpContext&);
void cpu_moe_gate_up(OpContext&);
void cpu_moe_down(OpContext&);
void cpu_situ_mul(OpContext&);
void cpu_sigmoid_mul(OpContext&);
void cpu_attn_res_mix(OpContext&);
void cpu_norm_linear(OpContext&);
void cpu_multi_linear(OpContext&);
void cpu_norm_multi_linear(OpContext&);
void cpu_add_norm_multi_linear(OpContext&);
void cpu_add_norm_router_logits(OpContext&);
void cpu_slice(OpContext&);
void cpu_linear_add(OpContext&);
void cpu_linear_kda_gate(OpContext&);
void cpu_kda_fused_core(OpContext&);
void cpu_gate_up_act(OpContext&);
void cpu_act_linear(OpContext&);
void cpu_moe_down_add(OpContext&);
void cpu_gated_norm_linear(OpContext&);
void cpu_add_norm(OpContext&);
void cpu_attn_res_norm(OpContext&);
void cpu_all_reduce(OpContext&);

// Shared helpers (ops/math.h would be one more file for two functions).
float dot_weight_row(const TensorView& weight, int64_t row, const float* x, int64_t n);
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }
// SiTU (spec/MODEL.md §7.6) in fp32; linear_beta <= 0 means the up branch is b itself.
inline float situ(float a, float b, float beta, float linear_beta) {
  const float up = linear_beta > 0 ? linear_beta * std::tanh(b / linear_beta) : b;
  return beta * std::tanh(a / beta) * sigmoid(a) * up;
}

}  // namespace plow
