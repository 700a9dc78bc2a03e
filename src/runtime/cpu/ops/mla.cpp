// MLA with NoPE over the latent cache (spec/MODEL.md §4.3, §5): the cache keeps the normed latent c
// and the raw shared key part k_r per past token; each step expands them through kv_b_proj.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "runtime/cpu/op_context.h"

namespace plow {

void cpu_mla_attention(OpContext& ctx) {
  const TensorView& norm_weight = *ctx.weights[0]->parts[0];
  const TensorView& kv_b = *ctx.weights[1]->parts[0];  // [heads·(nope+v), rank]
  const int64_t heads = ctx.node.attrs.i("heads"), nope = ctx.node.attrs.i("nope"), rope = ctx.node.attrs.i("rope");
  const int64_t dv = ctx.node.attrs.i("v"), rank = ctx.node.attrs.i("rank");
  const float eps = ctx.node.attrs.f("eps");
  const int64_t latent = rank + rope, qk = nope + rope, per_head = nope + dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(qk));  // (d_n + d_r)^(−1/2), no mscale

  if (ctx.end() <= ctx.begin()) return;  // a task of a plan's spread past the heads: no columns
  int64_t first = 0;
  for (const SequenceStep& seq : ctx.step.sequences) {
    std::vector<float>& cache = ctx.state(seq.slot);  // [context, rank + rope]
    const int64_t past = ctx.slots[static_cast<size_t>(seq.slot)].context_tokens;
    // This step's latent rows: c = RMSNorm_ε(c̃; w) rounded like every RMSNorm, k_r raw. Every slice
    // computes them; only the slice holding head 0 appends them to the cache (slices read rows < past).
    std::vector<float> fresh(static_cast<size_t>(seq.query_tokens * latent));
    for (int64_t t = 0; t < seq.query_tokens; ++t) {
      const float* kv_a = ctx.in(1, first + t);
      float* row = fresh.data() + t * latent;
      float sum = 0.0f;
      for (int64_t i = 0; i < rank; ++i) sum += kv_a[i] * kv_a[i];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(rank) + eps);
      for (int64_t i = 0; i < rank; ++i) row[i] = ctx.round_act(norm_weight.at(static_cast<size_t>(i)) * ctx.round_act(kv_a[i] * inv));
      for (int64_t i = 0; i < rope; ++i) row[rank + i] = kv_a[rank + i];
    }
    const int64_t context = past + seq.query_tokens;
    auto latent_row = [&](int64_t tau) { return tau < past ? cache.data() + tau * latent : fresh.data() + (tau - past) * latent; };
    const int64_t head_begin = ctx.begin() / dv, head_end = ctx.end() / dv;
    // Expand the cached latents for this slice's heads: kv[τ,h] = c_τ · kv_bᵀ, rounded (HF's kv_b_proj output).
    std::vector<float> kv(static_cast<size_t>(context * heads * per_head));
    for (int64_t tau = 0; tau < context; ++tau) {
      for (int64_t o = head_begin * per_head; o < head_end * per_head; ++o) {
        kv[static_cast<size_t>(tau * heads * per_head + o)] = ctx.round_act(dot_weight_row(kv_b, o, latent_row(tau), rank));
      }
    }
    std::vector<float> probs(static_cast<size_t>(context));
    for (int64_t t = 0; t < seq.query_tokens; ++t) {
      const int64_t visible = past + t + 1;  // causal: positions τ ≤ this token's
      const float* q_row = ctx.in(0, first + t);
      for (int64_t h = head_begin; h < head_end; ++h) {
        const float* q = q_row + h * qk;
        float max_score = -INFINITY;
        for (int64_t tau = 0; tau < visible; ++tau) {
          const float* k_nope = &kv[static_cast<size_t>((tau * heads + h) * per_head)];
          const float* k_rope = latent_row(tau) + rank;
          float s = 0.0f;
          for (int64_t i = 0; i < nope; ++i) s += q[i] * k_nope[i];
          for (int64_t i = 0; i < rope; ++i) s += q[nope + i] * k_rope[i];
          probs[static_cast<size_t>(tau)] = s * scale;
          max_score = std::max(max_score, s * scale);
        }
        float total = 0.0f;
        for (int64_t tau = 0; tau < visible; ++tau) total += (probs[static_cast<size_t>(tau)] = std::exp(probs[static_cast<size_t>(tau)] - max_score));
        float* out = ctx.out_row(first + t) + h * dv;
        for (int64_t i = 0; i < dv; ++i) out[i] = 0.0f;
        for (int64_t tau = 0; tau < visible; ++tau) {
          const float p = ctx.round_act(probs[static_cast<size_t>(tau)] / total);  // P rounded before PV
          const float* v = &kv[static_cast<size_t>((tau * heads + h) * per_head + nope)];
          for (int64_t i = 0; i < dv; ++i) out[i] += p * v[i];
        }
        for (int64_t i = 0; i < dv; ++i) out[i] = ctx.round_out(out[i]);
      }
    }
    if (head_begin == 0) {
      PLOW_CHECK(static_cast<int64_t>(cache.size()) == past * latent, "{}: latent cache of slot {} holds {} rows, context is {}",
                 ctx.node.label, seq.slot, static_cast<int64_t>(cache.size()) / latent, past);
      cache.insert(cache.end(), fresh.begin(), fresh.end());
    }
    first += seq.query_tokens;
  }
}

}  // namespace plow
