// MXFP4 decode (spec/MODEL.md §7.7): every E2M1 code, the E8M0 scale edges, NaN blocks, nibble order.
#include <gtest/gtest.h>

#include <cmath>

#include "core/mxfp4.h"

namespace plow {
namespace {

TEST(Mxfp4, EveryCodeTimesEveryScaleEdge) {
  const float magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int code = 0; code < 16; ++code) {
    const float expected = (code & 8 ? -1.0f : 1.0f) * magnitudes[code & 7];
    EXPECT_EQ(e2m1_value(static_cast<uint8_t>(code)), expected) << code;
    EXPECT_EQ(std::signbit(e2m1_value(static_cast<uint8_t>(code))), code >= 8) << "code " << code << " sign (0x8 is −0)";
    for (int e : {0x00, 0x01, 0x7E, 0x7F, 0x80, 0xFD}) {
      EXPECT_EQ(e2m1_value(static_cast<uint8_t>(code)) * e8m0_value(static_cast<uint8_t>(e)), expected * std::ldexp(1.0f, e - 127));
    }
  }
  EXPECT_EQ(e8m0_value(0x7F), 1.0f);
  EXPECT_EQ(e8m0_value(0x00), std::ldexp(1.0f, -127));  // a float32 subnormal, exact
  EXPECT_EQ(e8m0_value(0xFE), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(e8m0_value(0xFF)));
}

TEST(Mxfp4, LowNibbleIsTheEvenElementAndScalesCoverBlocksOf32) {
  // One row of 64 inputs: byte j holds elements 2j (low nibble) and 2j+1 (high nibble).
  uint8_t packed[32] = {};
  packed[0] = 0x71;  // element 0 = code 1 (0.5), element 1 = code 7 (6)
  packed[16] = 0x0A; // element 32 = code 0xA (−1)
  const uint8_t scales[2] = {0x80, 0xFF};  // block 0 ×2, block 1 NaN
  EXPECT_EQ(mxfp4_at(packed, scales, 64, 0, 0), 1.0f);
  EXPECT_EQ(mxfp4_at(packed, scales, 64, 0, 1), 12.0f);
  EXPECT_EQ(mxfp4_at(packed, scales, 64, 0, 31), 0.0f);
  for (int i = 32; i < 64; ++i) EXPECT_TRUE(std::isnan(mxfp4_at(packed, scales, 64, 0, i))) << "0xFF scale makes the whole block NaN, code 0 too";
}

}  // namespace
}  // namespace plow
