// Element types of tensors on disk and in activations, with exact conversions.
// bf16/f16 <-> f32 conversions round to nearest-even (the rounding points of spec/MODEL.md §1).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace plow {

enum class DType : uint8_t { F32, BF16, F16, U8, I32, I64 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // safetensors spelling: "F32", "BF16", ...
std::optional<DType> dtype_from_safetensors(std::string_view name);

inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

inline uint16_t f32_to_bf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // keep NaN a NaN
  uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

inline float round_bf16(float value) { return bf16_to_f32(f32_to_bf16(value)); }
inline float round_f16(float value) { return f16_to_f32(f32_to_f16(value)); }

// Rounds to the precision of `dtype` (F32: unchanged). Only float dtypes are valid here.
float round_to(DType dtype, float value);

// Reads element i of a raw buffer of `dtype` as f32 (exact upcast).
inline float load_as_f32(DType dtype, const uint8_t* data, size_t i) {
  switch (dtype) {
    case DType::F32: { float v; std::memcpy(&v, data + 4 * i, 4); return v; }
    case DType::BF16: { uint16_t b; std::memcpy(&b, data + 2 * i, 2); return bf16_to_f32(b); }
    case DType::F16: { uint16_t b; std::memcpy(&b, data + 2 * i, 2); return f16_to_f32(b); }
    case DType::U8: return static_cast<float>(data[i]);
    case DType::I32: { int32_t v; std::memcpy(&v, data + 4 * i, 4); return static_cast<float>(v); }
    case DType::I64: { int64_t v; std::memcpy(&v, data + 8 * i, 8); return static_cast<float>(v); }
  }
  return 0.0f;
}

}  // namespace plow
