// Fused ops (rows of the op table produced by the compiler's rules). Each is computed as the exact
// composition it replaces — intermediate roundings included — by running the unfused kernels on a
// scratch buffer, so a fused plan is bit-identical to the unfused graph on the CPU. Column slices:
// intermediates that every output column needs (a norm, an activation) are computed whole.
#include <algorithm>

#include "core/error.h"
#include "runtime/cpu/op_context.h"

namespace plow {

namespace {

// Runs the kernel of `op` as a sub-step of `ctx`; returns [rows, width] (only columns [begin, end) are
// written when a slice is asked for). A stateful op reads and updates the slots' state `state`.
std::vector<float> run_sub(const OpContext& ctx, Op op, Attrs attrs, int64_t width, std::vector<Activation> inputs,
                           std::vector<const BoundWeight*> weights, int64_t begin = 0, int64_t end = -1, int state = -1) {
  Node sub;
  sub.op = op;
  sub.state = state;
  sub.attrs = std::move(attrs);
  sub.width = width;
  sub.dtype = op_info(op).out_dtype;
  sub.label = ctx.node.label;
  std::vector<float> out(static_cast<size_t>(ctx.rows * width), 0.0f);
  OpContext sub_ctx{sub, inputs, weights, out.data(), ctx.rows, ctx.act_dtype, ctx.step, ctx.slots, begin, end};
  cpu_kernel(op)(sub_ctx);
  return out;
}

int64_t out_rows(const BoundWeight* w) { return w->decl->shape[0]; }

void copy_columns(const OpContext& ctx, const std::vector<float>& from, int64_t from_width, int64_t from_offset, int64_t begin, int64_t end) {
  for (int64_t t = 0; t < ctx.rows; ++t) {
    for (int64_t c = begin; c < end; ++c) ctx.out_row(t)[c] = from[static_cast<size_t>(t * from_width + from_offset + c)];
  }
}

// concat_i linear(x; W_i) for the columns of ctx's slice; x: [rows, in].
void multi_linear_into(OpContext& ctx, Activation x, std::span<const BoundWeight* const> weights) {
  int64_t offset = 0;
  for (const BoundWeight* w : weights) {
    const int64_t width = out_rows(w);
    const int64_t begin = std::max(ctx.begin(), offset), end = std::min(ctx.end(), offset + width);
    if (begin < end) {
      const auto part = run_sub(ctx, Op::kLinear, {}, width, {x}, {w}, begin - offset, end - offset);
      copy_columns(ctx, part, width, -offset, begin, end);
    }
    offset += width;
  }
}

Attrs eps_of(const OpContext& ctx, const char* name = "eps") { return {{"eps", ctx.node.attrs.get(name)}}; }

// The activation of kGateUpAct / kActLinear: attr "act" 0 = SiLU·mul, 1 = SiTU, 2 = a·σ(b).
Op activation_op(const OpContext& ctx) {
  switch (ctx.node.attrs.i("act")) {
    case 0: return Op::kSiluMul;
    case 1: return Op::kSituMul;
    case 2: return Op::kSigmoidMul;
  }
  PLOW_CHECK(false, "{}: unknown activation {}", ctx.node.label, ctx.node.attrs.i("act"));
}

}  // namespace

void cpu_norm_linear(OpContext& ctx) {
  const int64_t in = ctx.inputs[0].width;
  const auto normed = run_sub(ctx, Op::kRmsNorm, eps_of(ctx), in, {ctx.inputs[0]}, {ctx.weights[0]});
  const auto out = run_sub(ctx, Op::kLinear, {}, ctx.node.width, {{normed.data(), in}}, {ctx.weights[1]}, ctx.begin(), ctx.end());
  copy_columns(ctx, out, ctx.node.width, 0, ctx.begin(), ctx.end());
}

void cpu_multi_linear(OpContext& ctx) { multi_linear_into(ctx, ctx.inputs[0], ctx.weights); }

void cpu_norm_multi_linear(OpContext& ctx) {
  const int64_t in = ctx.inputs[0].width;
  const auto normed = run_sub(ctx, Op::kRmsNorm, eps_of(ctx), in, {ctx.inputs[0]}, {ctx.weights[0]});
  multi_linear_into(ctx, {normed.data(), in}, ctx.weights.subspan(1));
}

namespace {

// rms_norm(a + b; w) over whole rows, the sum rounded as kAdd rounds it: [rows, in].
std::vector<float> add_then_norm(const OpContext& ctx) {
  const int64_t in = ctx.inputs[0].width;
  const auto sum = run_sub(ctx, Op::kAdd, {}, in, {ctx.inputs[0], ctx.inputs[1]}, {});
  return run_sub(ctx, Op::kRmsNorm, eps_of(ctx), in, {{sum.data(), in}}, {ctx.weights[0]});
}

}  // namespace

void cpu_add_norm_multi_linear(OpContext& ctx) {
  const auto normed = add_then_norm(ctx);
  multi_linear_into(ctx, {normed.data(), ctx.inputs[0].width}, ctx.weights.subspan(1));
}

void cpu_add_norm_router_logits(OpContext& ctx) {
  const auto normed = add_then_norm(ctx);
  const auto out = run_sub(ctx, Op::kRouterLogits, {}, ctx.node.width, {{normed.data(), ctx.inputs[0].width}}, {ctx.weights[1]}, ctx.begin(),
                           ctx.end());
  copy_columns(ctx, out, ctx.node.width, 0, ctx.begin(), ctx.end());
}

void cpu_slice(OpContext& ctx) {
  const int64_t offset = ctx.node.attrs.i("offset");
  for (int64_t t = 0; t < ctx.rows; ++t) {
    for (int64_t c = ctx.begin(); c < ctx.end(); ++c) ctx.out_row(t)[c] = ctx.in(0, t)[offset + c];
  }
}

void cpu_linear_add(OpContext& ctx) {
  const auto projected = run_sub(ctx, Op::kLinear, {}, ctx.node.width, {ctx.inputs[0]}, {ctx.weights[0]}, ctx.begin(), ctx.end());
  const auto sum = run_sub(ctx, Op::kAdd, {}, ctx.node.width, {ctx.inputs[1], {projected.data(), ctx.node.width}}, {}, ctx.begin(), ctx.end());
  copy_columns(ctx, sum, ctx.node.width, 0, ctx.begin(), ctx.end());
}

void cpu_linear_kda_gate(OpContext& ctx) {
  const int64_t width = ctx.node.width;
  const auto f = run_sub(ctx, Op::kLinear, {}, width, {ctx.inputs[0]}, {ctx.weights[0]}, ctx.begin(), ctx.end());
  const auto gate = run_sub(ctx, Op::kKdaGate, ctx.node.attrs, width, {{f.data(), width}}, {ctx.weights[1], ctx.weights[2]}, ctx.begin(), ctx.end());
  copy_columns(ctx, gate, width, 0, ctx.begin(), ctx.end());
}

// The three convs (each over the slice's channels, with its own window), the gate's projection and
// gate over them, β over every head, then the delta rule over the slice's heads (whole heads:
// Slicing::kHeads, so the channels whose windows this call rewrites are read by no other task); with a
// sixth input, the output gate's projection and the gated norm over them.
void cpu_kda_fused_core(OpContext& ctx) {
  const int64_t width = ctx.node.width, heads = ctx.inputs[4].width, begin = ctx.begin(), end = ctx.end();
  const Attrs conv_attrs{{"kernel", ctx.node.attrs.get("kernel")}};
  const std::vector<int> windows = extra_states(ctx.node);
  std::vector<float> conv[3];
  for (size_t i = 0; i < 3; ++i) {
    conv[i] = run_sub(ctx, Op::kShortConvSilu, conv_attrs, width, {ctx.inputs[i]}, {ctx.weights[i]}, begin, end, windows[i]);
  }
  const auto f = run_sub(ctx, Op::kLinear, {}, width, {ctx.inputs[3]}, {ctx.weights[3]}, begin, end);
  const auto gate = run_sub(ctx, Op::kKdaGate, ctx.node.attrs, width, {{f.data(), width}}, {ctx.weights[4], ctx.weights[5]}, begin, end);
  const auto beta = run_sub(ctx, Op::kSigmoid, {}, heads, {ctx.inputs[4]}, {});
  const auto core = run_sub(ctx, Op::kKdaDeltaRule, ctx.node.attrs, width,
                            {{conv[0].data(), width}, {conv[1].data(), width}, {conv[2].data(), width}, {gate.data(), width}, {beta.data(), heads}}, {},
                            begin, end, ctx.node.state);
  if (ctx.inputs.size() == 5) {
    copy_columns(ctx, core, width, 0, begin, end);
    return;
  }
  const auto z = run_sub(ctx, Op::kLinear, {}, width, {ctx.inputs[5]}, {ctx.weights[6]}, begin, end);
  const auto normed = run_sub(ctx, Op::kGatedRmsNorm, ctx.node.attrs, width, {{core.data(), width}, {z.data(), width}}, {ctx.weights[7]}, begin, end);
  copy_columns(ctx, normed, width, 0, begin, end);
}

void cpu_gate_up_act(OpContext& ctx) {
  const int64_t width = ctx.node.width;
  const auto gate = run_sub(ctx, Op::kLinear, {}, width, {ctx.inputs[0]}, {ctx.weights[0]}, ctx.begin(), ctx.end());
  const auto up = run_sub(ctx, Op::kLinear, {}, width, {ctx.inputs[0]}, {ctx.weights[1]}, ctx.begin(), ctx.end());
  const auto act = run_sub(ctx, activation_op(ctx), ctx.node.attrs, width, {{gate.data(), width}, {up.data(), width}}, {}, ctx.begin(), ctx.end());
  copy_columns(ctx, act, width, 0, ctx.begin(), ctx.end());
}

void cpu_act_linear(OpContext& ctx) {
  const int64_t in = ctx.inputs[0].width;
  const auto act = run_sub(ctx, activation_op(ctx), ctx.node.attrs, in, {ctx.inputs[0], ctx.inputs[1]}, {});
  const auto out = run_sub(ctx, Op::kLinear, {}, ctx.node.width, {{act.data(), in}}, {ctx.weights[0]}, ctx.begin(), ctx.end());
  copy_columns(ctx, out, ctx.node.width, 0, ctx.begin(), ctx.end());
}

void cpu_moe_down_add(OpContext& ctx) {
  const int64_t width = ctx.node.width;
  const auto routed = run_sub(ctx, Op::kMoeDown, ctx.node.attrs, width, {ctx.inputs[0], ctx.inputs[1]}, {ctx.weights[0]}, ctx.begin(), ctx.end());
  const auto sum = run_sub(ctx, Op::kAdd, {}, width, {{routed.data(), width}, ctx.inputs[2]}, {}, ctx.begin(), ctx.end());
  copy_columns(ctx, sum, width, 0, ctx.begin(), ctx.end());
}

void cpu_gated_norm_linear(OpContext& ctx) {
  const int64_t in = ctx.inputs[0].width;
  const auto normed = run_sub(ctx, Op::kGatedRmsNorm, ctx.node.attrs, in, {ctx.inputs[0], ctx.inputs[1]}, {ctx.weights[0]});
  const auto out = run_sub(ctx, Op::kLinear, {}, ctx.node.width, {{normed.data(), in}}, {ctx.weights[1]}, ctx.begin(), ctx.end());
  copy_columns(ctx, out, ctx.node.width, 0, ctx.begin(), ctx.end());
}

void cpu_add_norm(OpContext& ctx) {
  const int64_t half = ctx.node.width / 2;
  const auto sum = run_sub(ctx, Op::kAdd, {}, half, {ctx.inputs[0], ctx.inputs[1]}, {});
  const auto normed = run_sub(ctx, Op::kRmsNorm, eps_of(ctx), half, {{sum.data(), half}}, {ctx.weights[0]});
  for (int64_t t = 0; t < ctx.rows; ++t) {
    for (int64_t c = ctx.begin(); c < ctx.end(); ++c) {
      ctx.out_row(t)[c] = c < half ? sum[static_cast<size_t>(t * half + c)] : normed[static_cast<size_t>(t * half + c - half)];
    }
  }
}

void cpu_attn_res_norm(OpContext& ctx) {
  const int64_t width = ctx.node.width;
  const std::vector<Activation> values(ctx.inputs.begin(), ctx.inputs.end());
  const auto mixed = run_sub(ctx, Op::kAttnResMix, eps_of(ctx), width, values, {ctx.weights[0], ctx.weights[1]});
  const auto normed = run_sub(ctx, Op::kRmsNorm, eps_of(ctx, "norm_eps"), width, {{mixed.data(), width}}, {ctx.weights[2]}, ctx.begin(), ctx.end());
  copy_columns(ctx, normed, width, 0, ctx.begin(), ctx.end());
}

}  // namespace plow
