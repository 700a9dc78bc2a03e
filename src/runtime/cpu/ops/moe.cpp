// MoE router in two ops, logits (spec/MODEL.md §4.5 R1: fp32, never rounded) then top-k (R2–R7: select
// with s + bias, weight with unbiased s, renormalize then scale; ties go to the lower expert index), and
// routed experts in two ops, gate/up then down (X1–X2: fp32 sum over k, one rounding; SiLU or SiTU; in
// LatentMoE the experts read and write the latent width).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "runtime/cpu/op_context.h"

namespace plow {

namespace {

// Indices of the `count` largest values, larger first, ties to the lower index.
std::vector<int64_t> top_indices(const std::vector<float>& values, int64_t count) {
  std::vector<int64_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return values[static_cast<size_t>(a)] > values[static_cast<size_t>(b)]; });
  order.resize(static_cast<size_t>(count));
  return order;
}

}  // namespace

// Columns [begin, end) of the logits [T, E]: ℓ = x·W_eᵀ with W upcast exactly and fp32 accumulation
// (R1: HF upcasts both operands), kept in fp32 for moe_topk.
void cpu_router_logits(OpContext& ctx) {
  const TensorView& weight = *ctx.weights[0]->parts[0];
  const int64_t hidden = ctx.inputs[0].width;
  for (int64_t t = 0; t < ctx.rows; ++t) {
    const float* x = ctx.in(0, t);
    float* out = ctx.out_row(t);
    for (int64_t e = ctx.begin(); e < ctx.end(); ++e) out[e] = dot_weight_row(weight, e, x, hidden);
  }
}

// Logits [T, E] → [T, 2k]: k routing weights, then k expert ids (exact in fp32). Runs whole.
void cpu_moe_topk(OpContext& ctx) {
  const TensorView& bias = *ctx.weights[0]->parts[0];
  const Attrs& a = ctx.node.attrs;
  const int64_t experts = a.i("experts"), top_k = a.i("top_k"), groups = a.i("groups"), keep_groups = a.i("topk_groups");
  const int64_t per_group = experts / groups;
  if (ctx.end() <= ctx.begin()) return;  // a task of a plan's spread over rows (the GPU's share): no columns, the whole task does every row
  PLOW_CHECK(ctx.begin() == 0 && ctx.end() == ctx.node.width, "{}: moe_topk runs whole (top-k spans all experts)", ctx.node.label);
  PLOW_CHECK(ctx.inputs[0].width == experts, "{}: {} logits for {} experts", ctx.node.label, ctx.inputs[0].width, experts);
  std::vector<float> scores(static_cast<size_t>(experts)), choice(static_cast<size_t>(experts));
  for (int64_t t = 0; t < ctx.rows; ++t) {
    const float* logits = ctx.in(0, t);
    std::copy(logits, logits + experts, scores.begin());
    if (a.get("softmax") != 0.0) {
      const float max_logit = *std::max_element(scores.begin(), scores.end());
      float total = 0.0f;
      for (float& s : scores) total += (s = std::exp(s - max_logit));
      for (float& s : scores) s /= total;
    } else {
      for (float& s : scores) s = sigmoid(s);
    }
    for (int64_t e = 0; e < experts; ++e) choice[static_cast<size_t>(e)] = scores[static_cast<size_t>(e)] + bias.at(static_cast<size_t>(e));
    if (groups > 1) {
      std::vector<float> group_scores(static_cast<size_t>(groups));
      for (int64_t gi = 0; gi < groups; ++gi) {
        std::vector<float> members(choice.begin() + gi * per_group, choice.begin() + (gi + 1) * per_group);
        for (int64_t best : top_indices(members, std::min<int64_t>(2, per_group))) group_scores[static_cast<size_t>(gi)] += members[static_cast<size_t>(best)];
      }
      std::vector<bool> kept(static_cast<size_t>(groups), false);
      for (int64_t gi : top_indices(group_scores, keep_groups)) kept[static_cast<size_t>(gi)] = true;
      for (int64_t e = 0; e < experts; ++e) {
        if (!kept[static_cast<size_t>(e / per_group)]) choice[static_cast<size_t>(e)] = -INFINITY;
      }
    }
    const std::vector<int64_t> chosen = top_indices(choice, top_k);
    std::vector<float> weights(static_cast<size_t>(top_k));
    float total = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) total += (weights[static_cast<size_t>(k)] = scores[static_cast<size_t>(chosen[static_cast<size_t>(k)])]);
    float* out = ctx.out_row(t);
    for (int64_t k = 0; k < top_k; ++k) {
      float w = weights[static_cast<size_t>(k)];
      if (a.get("renormalize") != 0.0) w = w / (total + 1e-20f);
      out[k] = w * a.f("scale");
      out[top_k + k] = static_cast<float>(chosen[static_cast<size_t>(k)]);  // expert id, exact in f32
    }
  }
}

// Columns [begin, end) of [T, k·I]: column k·I + i is expert e_k's activation at i. A slice may
// span experts; each column needs only its own gate and up rows.
void cpu_moe_gate_up(OpContext& ctx) {
  const int64_t top_k = ctx.node.attrs.i("top_k"), width = ctx.inputs[0].width;
  const BoundWeight& w1 = *ctx.weights[0];  // gate [I,W] per expert
  const BoundWeight& w3 = *ctx.weights[1];  // up   [I,W]
  const int64_t inter = w1.decl->shape[0];
  const bool use_situ = ctx.node.attrs.get("situ") != 0.0;
  const float beta = ctx.node.attrs.f("beta"), linear_beta = ctx.node.attrs.f("linear_beta");
  for (int64_t t = 0; t < ctx.rows; ++t) {
    const float* x = ctx.in(0, t);
    const float* route = ctx.in(1, t);
    for (int64_t c = ctx.begin(); c < ctx.end(); ++c) {
      const auto e = static_cast<size_t>(route[top_k + c / inter]);
      const int64_t i = c % inter;
      const float gate = ctx.round_act(dot_weight_row(*w1.parts[e], i, x, width));
      const float up = ctx.round_act(dot_weight_row(*w3.parts[e], i, x, width));
      ctx.out_row(t)[c] = use_situ ? ctx.round_out(situ(gate, up, beta, linear_beta)) : ctx.round_out(ctx.round_act(silu(gate)) * up);
    }
  }
}

// Columns [begin, end) of [T, W]: Σ_k w_k·round(w2_{e_k}[o]·h_k), fp32 in k order, one rounding at
// the end; h_k = h[k·I, (k+1)·I) is moe_gate_up's output for the k-th routed expert. A tensor-parallel
// partial sum (fp32 output) rounds neither: its all_reduce rounds the whole sum.
void cpu_moe_down(OpContext& ctx) {
  const int64_t top_k = ctx.node.attrs.i("top_k");
  const BoundWeight& w2 = *ctx.weights[0];  // down [W,I] per expert
  const int64_t inter = w2.decl->shape[1];
  for (int64_t t = 0; t < ctx.rows; ++t) {
    const float* h = ctx.in(0, t);
    const float* route = ctx.in(1, t);
    for (int64_t o = ctx.begin(); o < ctx.end(); ++o) {
      float acc = 0.0f;
      for (int64_t k = 0; k < top_k; ++k) {
        const auto e = static_cast<size_t>(route[top_k + k]);
        acc += route[k] * ctx.round_out(dot_weight_row(*w2.parts[e], o, h + k * inter, inter));
      }
      ctx.out_row(t)[o] = ctx.round_out(acc);
    }
  }
}

}  // namespace plow
