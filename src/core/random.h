// Counter-based pseudo-random numbers: the same (seed, index) gives the same value on every backend.
#pragma once

#include <cstdint>
#include <string_view>

namespace mlaserve {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform on [-sqrt(3), sqrt(3)): zero mean, unit variance.
inline float unit_uniform(uint64_t seed, uint64_t index) {
  const uint64_t r = splitmix64(seed ^ splitmix64(index));
  const float u01 = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // 24 bits
  return (u01 * 2.0f - 1.0f) * 1.7320508f;
}

inline uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace mlaserve
