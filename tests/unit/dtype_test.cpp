#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/dtype.h"

namespace plow {
namespace {

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  // 1 + 2^-8 lies exactly between two bf16 values: ties to even keeps 1.0
  EXPECT_EQ(round_bf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);
  // 1 + 3·2^-8 ties between 1+2^-7 and 1+2^-6: even mantissa is 1+2^-6
  EXPECT_EQ(round_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(round_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(round_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(round_bf16(-2.5f), -2.5f);
}

TEST(DType, F16RoundTripsEveryCode) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = f16_to_f32(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    EXPECT_EQ(f32_to_f16(value), bits) << "code " << bits;
  }
}

TEST(DType, F16Rounding) {
  EXPECT_EQ(f16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);
  EXPECT_EQ(round_f16(65519.0f), 65504.0f);
  EXPECT_TRUE(std::isinf(round_f16(65520.0f)));
  EXPECT_EQ(round_f16(1.0f + std::ldexp(1.0f, -11)), 1.0f);  // tie to even
}

TEST(DType, SafetensorsNames) {
  EXPECT_EQ(dtype_from_safetensors("BF16"), DType::BF16);
  EXPECT_FALSE(dtype_from_safetensors("F8_E4M3").has_value());
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
}

}  // namespace
}  // namespace plow
