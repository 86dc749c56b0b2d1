// JSON integers read from files and messages: nlohmann's get<int32_t>() truncates a value past the type's range
// (4294967297 becomes 1) and get<int>() of a float converts it, so readers check the range first.
#pragma once

#include <cstdint>
#include <optional>

#include <nlohmann/json.hpp>

namespace mlaserve {

// v as an integer in [lo, hi]; nothing when it is not a JSON integer (a float such as 16.0 is not) or lies outside
// (unsigned values past int64 included).
template <typename Json>
std::optional<int64_t> json_integer(const Json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.template get<uint64_t>();
    if (hi < 0 || u > static_cast<uint64_t>(hi) || (lo > 0 && u < static_cast<uint64_t>(lo))) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (!v.is_number_integer()) return std::nullopt;
  const int64_t i = v.template get<int64_t>();
  if (i < lo || i > hi) return std::nullopt;
  return i;
}

}  // namespace mlaserve
