// Random edits of JSON documents for the tests that feed corrupt files (config.json, safetensors headers) to the
// readers: a value replaced by one of another type or range, a key removed, or a member / element added.
#pragma once

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mlaserve::test {

// Every path (a JSON pointer) into j below its root, containers included.
inline void json_paths(const nlohmann::json& j, const nlohmann::json::json_pointer& at,
                       std::vector<nlohmann::json::json_pointer>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      out.push_back(at / it.key());
      json_paths(*it, at / it.key(), out);
    }
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) {
      out.push_back(at / i);
      json_paths(j[i], at / i, out);
    }
  }
}

// Values of every JSON type, at the edges of the ranges readers convert them to, plus `extra`.
inline std::vector<nlohmann::json> edge_values(std::vector<nlohmann::json> extra = {}) {
  using json = nlohmann::json;
  std::vector<json> v = {nullptr, true, false, 0, 1, 2, 3, 7, 64, -1, -7, int64_t{1} << 31, int64_t{1} << 62,
                         std::numeric_limits<int64_t>::min(), std::numeric_limits<uint64_t>::max(), 0.5, -0.0,
                         1e300, -1e300, 1e-300, "", "abc", json::array(), json::array({1, 2}),
                         json::array({"x"}), json::object(), json{{"a", 1}}};
  v.insert(v.end(), extra.begin(), extra.end());
  return v;
}

// One random edit of j (an object or array with at least one member): half the time a value replaced by one of
// `values`, else a key removed or a member / element added.
inline void mutate_json(nlohmann::json& j, std::mt19937_64& rng, const std::vector<nlohmann::json>& values) {
  std::vector<nlohmann::json::json_pointer> paths;
  json_paths(j, nlohmann::json::json_pointer(), paths);
  if (paths.empty()) return;
  const nlohmann::json::json_pointer p = paths[rng() % paths.size()];
  const nlohmann::json& v = values[rng() % values.size()];
  switch (rng() % 4) {
    case 0:
    case 1:
      j[p] = v;
      break;
    case 2:
      if (j[p.parent_pointer()].is_object()) j[p.parent_pointer()].erase(p.back());
      break;
    default:
      if (j[p].is_object()) j[p]["unexpected_" + std::to_string(rng() % 4)] = v;
      if (j[p].is_array()) j[p].push_back(v);
      break;
  }
}

}  // namespace mlaserve::test
