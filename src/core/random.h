// Counter-based pseudo-random numbers: the same (seed, index) gives the same value on every backend.
// splitmix64 and unit_uniform are also compiled for the GPU (the CUDA backend's fill_random and sampler use them),
// so this header stays plain C++17.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/host_device.h"

namespace mlaserve {

MLA_HOST_DEVICE inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform on [-sqrt(3), sqrt(3)): zero mean, unit variance.
MLA_HOST_DEVICE inline float unit_uniform(uint64_t seed, uint64_t index) {
  const uint64_t r = splitmix64(seed ^ splitmix64(index));
  const float u01 = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // 24 bits
  return (u01 * 2.0f - 1.0f) * 1.7320508f;
}

// Uniform on (0, 1) (never 0 or 1): the sampler's Gumbel noise for token `index` at (seed, step).
MLA_HOST_DEVICE inline float open_uniform(uint64_t seed, uint64_t step, uint64_t index) {
  const uint64_t r = splitmix64(splitmix64(seed ^ splitmix64(step)) ^ splitmix64(index + 0x51ed270b27a4c3a5ull));
  return (static_cast<float>(r >> 41) + 0.5f) * (1.0f / 8388608.0f);  // 23 bits + 1/2: exact in a float
}

inline uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace mlaserve
