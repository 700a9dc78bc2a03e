// MXFP4 (OCP MX v1.0; spec/MODEL.md §7.7): E2M1 codes, two per byte (low nibble = even element),
// one E8M0 scale 2^(e−127) per 32 consecutive elements along the input dimension; e = 0xFF is NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace plow {

inline float e2m1_value(uint8_t code) {
  static constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float magnitude = kMagnitudes[code & 0x7];
  return (code & 0x8) ? -magnitude : magnitude;
}

inline float e8m0_value(uint8_t e) {
  if (e == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(e) - 127);
}

// Element i of row `row` of an [out, in] MXFP4 matrix: packed [out, in/2], scales [out, in/32].
inline float mxfp4_at(const uint8_t* packed, const uint8_t* scales, int64_t in, int64_t row, int64_t i) {
  const uint8_t byte = packed[row * (in / 2) + i / 2];
  const auto code = static_cast<uint8_t>((i & 1) ? byte >> 4 : byte & 0xF);
  return e2m1_value(code) * e8m0_value(scales[row * (in / 32) + i / 32]);
}

}  // namespace plow
