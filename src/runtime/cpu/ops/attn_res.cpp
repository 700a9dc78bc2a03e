// Block Attention Residuals (spec/MODEL.md §7.2 A1–A3): each sublayer input is a softmax over depth
// of the completed block values and the current partial sum; keys are RMS-normed values, fp32 math.
#include <cmath>
#include <vector>

#include "runtime/cpu/op_context.h"

namespace plow {

void cpu_attn_res_mix(OpContext& ctx) {
  const TensorView& norm = *ctx.weights[0]->parts[0];   // w_n [H]
  const TensorView& query = *ctx.weights[1]->parts[0];  // w_q [1,H]: the pseudo-query
  const float eps = ctx.node.attrs.f("eps");
  const int64_t width = ctx.node.width;
  const size_t values = ctx.inputs.size();
  std::vector<float> scores(values);
  for (int64_t t = 0; t < ctx.rows; ++t) {
    float max_score = -INFINITY;
    for (size_t j = 0; j < values; ++j) {
      const float* v = ctx.in(j, t);
      float sum_sq = 0.0f;
      for (int64_t i = 0; i < width; ++i) sum_sq += v[i] * v[i];
      const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(width) + eps);
      float s = 0.0f;  // plain dot product: no 1/√H, no bias
      for (int64_t i = 0; i < width; ++i) s += query.at(static_cast<size_t>(i)) * (norm.at(static_cast<size_t>(i)) * v[i] * inv);
      scores[j] = s;
      max_score = std::max(max_score, s);
    }
    float total = 0.0f;
    for (float& s : scores) total += (s = std::exp(s - max_score));
    float* out = ctx.out_row(t);
    for (int64_t i = ctx.begin(); i < ctx.end(); ++i) {
      float mixed = 0.0f;
      for (size_t j = 0; j < values; ++j) mixed += scores[j] / total * ctx.in(j, t)[i];
      out[i] = ctx.round_out(mixed);
    }
  }
}

}  // namespace plow
