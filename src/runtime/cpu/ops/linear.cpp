// Embedding lookup and x·Wᵀ with weights upcast exactly and fp32 accumulation.
#include <cstring>

#include "core/error.h"
#include "runtime/cpu/op_context.h"

namespace plow {

namespace {
template <typename Load>
float dot_with(const uint8_t* row, const float* x, int64_t n, Load load) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += load(row, i) * x[i];
  return sum;
}
}  // namespace

float dot_weight_row(const TensorView& weight, int64_t row, const float* x, int64_t n) {
  if (weight.is_mxfp4()) {  // dequantize exactly, then multiply in fp32 (§7.7)
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += mxfp4_at(weight.data, weight.mx_scales, n, row, i) * x[i];
    return sum;
  }
  const uint8_t* base = weight.data + static_cast<size_t>(row * n) * dtype_size(weight.dtype);
  switch (weight.dtype) {
    case DType::F32:
      return dot_with(base, x, n, [](const uint8_t* p, int64_t i) { float v; std::memcpy(&v, p + 4 * i, 4); return v; });
    case DType::BF16:
      return dot_with(base, x, n, [](const uint8_t* p, int64_t i) { uint16_t b; std::memcpy(&b, p + 2 * i, 2); return bf16_to_f32(b); });
    case DType::F16:
      return dot_with(base, x, n, [](const uint8_t* p, int64_t i) { uint16_t b; std::memcpy(&b, p + 2 * i, 2); return f16_to_f32(b); });
    default:
      PLOW_CHECK(false, "weight '{}' has non-float dtype {}", weight.name, dtype_name(weight.dtype));
  }
}

void cpu_embedding(OpContext& ctx) {
  const TensorView& table = *ctx.weights[0]->parts[0];
  const int64_t vocab = table.shape[0], width = ctx.node.width;
  for (int64_t t = 0; t < ctx.rows; ++t) {
    const auto id = static_cast<int64_t>(ctx.in(0, t)[0]);
    PLOW_CHECK(id >= 0 && id < vocab, "token id {} outside the vocabulary of {}", id, vocab);
    float* out = ctx.out_row(t);
    for (int64_t j = ctx.begin(); j < ctx.end(); ++j) out[j] = ctx.round_out(table.at(static_cast<size_t>(id * width + j)));
  }
}

void cpu_linear(OpContext& ctx) {
  const TensorView& weight = *ctx.weights[0]->parts[0];
  const int64_t in_width = ctx.inputs[0].width;
  for (int64_t t = 0; t < ctx.rows; ++t) {
    const float* x = ctx.in(0, t);
    float* out = ctx.out_row(t);
    for (int64_t o = ctx.begin(); o < ctx.end(); ++o) out[o] = ctx.round_out(dot_weight_row(weight, o, x, in_width));
  }
}

}  // namespace plow
