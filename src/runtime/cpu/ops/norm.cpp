// RMSNorm (HF KimiLinearRMSNorm: cast back to the activation dtype BEFORE the weight multiply) and the
// KDA gated RMSNorm (fp32 throughout, sigmoid gate, one rounding: spec/MODEL.md §4.2 K7, §11).
#include <cmath>

#include "runtime/cpu/op_context.h"

namespace plow {

namespace {
float inverse_rms(const float* x, int64_t n, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}
}  // namespace

void cpu_rms_norm(OpContext& ctx) {
  const TensorView& weight = *ctx.weights[0]->parts[0];
  const int64_t n = ctx.node.width;
  const float eps = ctx.node.attrs.f("eps");
  for (int64_t t = 0; t < ctx.rows; ++t) {
    const float* x = ctx.in(0, t);
    float* out = ctx.out_row(t);
    const float scale = inverse_rms(x, n, eps);
    for (int64_t i = ctx.begin(); i < ctx.end(); ++i) out[i] = ctx.round_out(weight.at(static_cast<size_t>(i)) * ctx.round_act(x[i] * scale));
  }
}

void cpu_gated_rms_norm(OpContext& ctx) {
  const TensorView& weight = *ctx.weights[0]->parts[0];
  const int64_t d = ctx.node.attrs.i("head_dim");
  const float eps = ctx.node.attrs.f("eps");
  for (int64_t t = 0; t < ctx.rows; ++t) {
    for (int64_t h = ctx.begin() / d; h < ctx.end() / d; ++h) {
      const float* o = ctx.in(0, t) + h * d;
      const float* z = ctx.in(1, t) + h * d;
      float* out = ctx.out_row(t) + h * d;
      const float scale = inverse_rms(o, d, eps);
      for (int64_t j = 0; j < d; ++j) out[j] = ctx.round_out(weight.at(static_cast<size_t>(j)) * (o[j] * scale) * sigmoid(z[j]));
    }
  }
}

}  // namespace plow
