#include "core/dtype.h"

#include "core/error.h"

namespace plow {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::U8: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
  }
  PLOW_CHECK(false, "unknown dtype {}", static_cast<int>(dtype));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::U8: return "U8";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
  }
  PLOW_CHECK(false, "unknown dtype {}", static_cast<int>(dtype));
}

std::optional<DType> dtype_from_safetensors(std::string_view name) {
  if (name == "F32") return DType::F32;
  if (name == "BF16") return DType::BF16;
  if (name == "F16") return DType::F16;
  if (name == "U8") return DType::U8;
  if (name == "I32") return DType::I32;
  if (name == "I64") return DType::I64;
  return std::nullopt;
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1F;
  const uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0) {
    // zero or subnormal: mantissa · 2^-24, exact in f32
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t f32_to_f16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  if (std::isnan(value)) return static_cast<uint16_t>(sign | 0x7E00);
  float magnitude = std::fabs(value);
  if (magnitude >= 65520.0f) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to infinity
  if (magnitude < std::ldexp(1.0f, -14)) {
    // subnormal range: quantize to multiples of 2^-24 with round-to-nearest-even
    float scaled = magnitude * std::ldexp(1.0f, 24);
    auto q = static_cast<uint32_t>(std::nearbyint(scaled));
    return static_cast<uint16_t>(sign | q);  // q == 1024 rolls into the smallest normal, as it should
  }
  uint32_t mag_bits = std::bit_cast<uint32_t>(magnitude);
  uint32_t rounding = 0xFFF + ((mag_bits >> 13) & 1);
  mag_bits += rounding;
  uint32_t exponent = (mag_bits >> 23) - 112;
  uint32_t mantissa = (mag_bits >> 13) & 0x3FF;
  return static_cast<uint16_t>(sign | (exponent << 10) | mantissa);
}

float round_to(DType dtype, float value) {
  switch (dtype) {
    case DType::F32: return value;
    case DType::BF16: return round_bf16(value);
    case DType::F16: return round_f16(value);
    default: PLOW_CHECK(false, "round_to on non-float dtype {}", dtype_name(dtype));
  }
}

}  // namespace plow
