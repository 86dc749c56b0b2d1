// Element types and the scalar conversions every backend shares (bf16 / f16 / fp8-e4m3 / fp8-e5m2 <-> f32).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace mlaserve {

enum class DType : uint8_t { F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // safetensors spelling: "F32", "BF16", "F8_E4M3", ...
std::optional<DType> dtype_from_name(std::string_view name);

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even, NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      u = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// OCP FP8 E4M3 (the "fn" variant: no infinities, 0x7f / 0xff are NaN, max 448).
inline float f8e4m3_to_f32(uint8_t v) {
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf;
  const int mant = v & 0x7;
  if (exp == 0xf && mant == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);  // subnormal: m/8 * 2^-6
  return sign * std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, exp - 7);
}

// The code nearest to x in an FP8 format of kExp exponent and kMant mantissa bits (bias 2^(kExp-1) - 1), ties to
// the even code, saturated to its largest finite value (max_finite, code max_code); NaN gives 0x7f. Normal codes keep
// f32's exponent (rebiased) and top kMant mantissa bits, rounded on the dropped bits (a carry moves into the
// exponent); below the smallest normal value the subnormal codes are steps of 2^(1 - bias - kMant).
template <int kExp, int kMant>
inline uint8_t f32_to_fp8(float x, float max_finite, uint8_t max_code) {
  constexpr uint32_t kBias = (1u << (kExp - 1)) - 1, kShift = 23 - kMant;
  constexpr float kSubnormalSteps = static_cast<float>(1u << (kBias - 1 + kMant));  // per unit, exact
  if (std::isnan(x)) return 0x7f;
  uint32_t u, max_bits;
  std::memcpy(&u, &x, 4);
  std::memcpy(&max_bits, &max_finite, 4);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u >= max_bits) return sign | max_code;  // infinities included
  if (u < (127u - kBias + 1) << 23)
    return sign | static_cast<uint8_t>(std::nearbyint(std::fabs(x) * kSubnormalSteps));
  return sign | static_cast<uint8_t>(((u + ((1u << (kShift - 1)) - 1) + ((u >> kShift) & 1u)) >> kShift) -
                                     ((127u - kBias) << kMant));
}

// The E4M3 code nearest to x (saturated to +-448).
inline uint8_t f32_to_e4m3(float x) { return f32_to_fp8<4, 3>(x, 448.0f, 0x7e); }

// OCP FP8 E5M2: the top byte of an f16 (5 exponent bits, 2 mantissa bits; infinities 0x7c / 0xfc, NaN above them).
inline float f8e5m2_to_f32(uint8_t v) { return f16_to_f32(static_cast<uint16_t>(v << 8)); }

// The E5M2 code nearest to x (saturated to +-57344, infinities included, as the GPU's satfinite conversion does).
inline uint8_t f32_to_e5m2(float x) { return f32_to_fp8<5, 2>(x, 57344.0f, 0x7b); }

}  // namespace mlaserve
