#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"
#include "core/random.h"
#include "test_util.h"

using namespace mlaserve;

TEST(DType, Bf16RoundTripAndRounding) {
  for (float v : {0.0f, 1.0f, -2.5f, 3.140625f, std::ldexp(1.5f, -100), 65536.0f}) EXPECT_EQ(bf16_to_f32(f32_to_bf16(v)), v) << v;
  // 1 + 2^-8 lies exactly between two bf16 values: ties to even (1.0); 1 + 3*2^-9 rounds up.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -9))), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
}

TEST(DType, F16Decode) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)));
}

TEST(DType, Fp8E4m3Decode) {
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);    // exp 7, mant 0
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);  // max finite
  EXPECT_EQ(f8e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)));
}

// An FP8 encoder against its decoder: every finite code's value is its own code (the sign of zero kept); halfway
// between neighbours the even code, either side of it the nearer; random magnitudes over the whole range (subnormals
// included, `exps` binary orders from 2^`exp0`) as the brute-force nearest code.
void expect_nearest_even(float (*value)(uint8_t), uint8_t (*code)(float), uint8_t (*nearest)(float), int max_code,
                         bool (*special)(int), int exps, int exp0, uint64_t seed) {
  for (int c = 0; c < 256; ++c) {
    if (special(c)) continue;
    EXPECT_EQ(code(value(static_cast<uint8_t>(c))), c) << c;
  }
  for (int c = 0; c < max_code; ++c) {
    const float lo = value(static_cast<uint8_t>(c)), hi = value(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;
    EXPECT_EQ(code(mid), c % 2 == 0 ? c : c + 1) << c;
    EXPECT_EQ(code(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(code(std::nextafter(mid, 1e9f)), c + 1) << c;
    EXPECT_EQ(code(-mid), (c % 2 == 0 ? c : c + 1) | 0x80) << c;
  }
  uint64_t st = seed;
  for (int i = 0; i < 20000; ++i) {
    st = splitmix64(st);
    const float x =
        std::ldexp(static_cast<float>(st >> 40) / 16777216.0f - 0.5f, static_cast<int>(st % exps) + exp0);
    ASSERT_EQ(code(x), nearest(x)) << x;
  }
}

TEST(DType, Fp8E4m3EncodeRoundsToNearestEven) {
  expect_nearest_even(f8e4m3_to_f32, f32_to_e4m3, test::nearest_e4m3, 0x7e, [](int c) { return (c & 0x7f) == 0x7f; },
                      22, -12, 7);
  EXPECT_EQ(f32_to_e4m3(460.0f), 0x7e);  // saturated, not NaN
  EXPECT_EQ(f32_to_e4m3(-1e9f), 0xfe);
  EXPECT_EQ(f32_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(f32_to_e4m3(std::nanf("")), 0x7f);
}

TEST(DType, Fp8E5m2Decode) {
  EXPECT_EQ(f8e5m2_to_f32(0x3c), 1.0f);      // exp 15, mant 0
  EXPECT_EQ(f8e5m2_to_f32(0x3e), 1.5f);
  EXPECT_EQ(f8e5m2_to_f32(0x7b), 57344.0f);  // max finite
  EXPECT_EQ(f8e5m2_to_f32(0xfb), -57344.0f);
  EXPECT_EQ(f8e5m2_to_f32(0x01), std::ldexp(1.0f, -16));  // smallest subnormal
  EXPECT_EQ(f8e5m2_to_f32(0x04), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_TRUE(std::isinf(f8e5m2_to_f32(0x7c)));
  EXPECT_TRUE(std::isnan(f8e5m2_to_f32(0x7d)));
}

TEST(DType, Fp8E5m2EncodeRoundsToNearestEven) {
  expect_nearest_even(f8e5m2_to_f32, f32_to_e5m2, test::nearest_e5m2, 0x7b, [](int c) { return (c & 0x7c) == 0x7c; },
                      32, -16, 11);
  EXPECT_EQ(f32_to_e5m2(60000.0f), 0x7b);  // saturated to the largest finite code, not infinity
  EXPECT_EQ(f32_to_e5m2(-1e9f), 0xfb);
  EXPECT_EQ(f32_to_e5m2(INFINITY), 0x7b);
  EXPECT_EQ(f32_to_e5m2(std::ldexp(1.0f, -18)), 0x00);  // a quarter of the smallest subnormal
  EXPECT_EQ(f32_to_e5m2(std::ldexp(3.0f, -18)), 0x01);
  EXPECT_TRUE(std::isnan(f8e5m2_to_f32(f32_to_e5m2(std::nanf("")))));
}

TEST(DType, NamesRoundTrip) {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::F8_E4M3, DType::F8_E5M2, DType::I64, DType::I32})
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  EXPECT_FALSE(dtype_from_name("F4").has_value());
}

TEST(Random, CounterBasedUnitVariance) {
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    float u = unit_uniform(42, static_cast<uint64_t>(i));
    s += u;
    s2 += u * u;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.01);
  EXPECT_EQ(unit_uniform(7, 123), unit_uniform(7, 123));
  EXPECT_NE(unit_uniform(7, 123), unit_uniform(8, 123));
}
