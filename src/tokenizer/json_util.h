// Small accessors for tokenizer.json / tokenizer_config.json fields, with errors that name the JSON path.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace mlaserve::tok {

class Regex;

inline const nlohmann::json& get_field(const nlohmann::json& j, const char* key, const std::string& where) {
  MLA_CHECK(j.is_object(), "{}: expected an object, got {}", where, j.type_name());
  auto it = j.find(key);
  MLA_CHECK(it != j.end(), "{}: missing field '{}'", where, key);
  return *it;
}

inline std::string get_string(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto& v = get_field(j, key, where);
  MLA_CHECK(v.is_string(), "{}.{}: expected a string, got {}", where, key, v.type_name());
  return v.get<std::string>();
}

// j[key] as a string, or nothing where it is missing or null.
inline std::optional<std::string> opt_string(const nlohmann::json& j, const char* key, const std::string& where) {
  MLA_CHECK(j.is_object(), "{}: expected an object, got {}", where, j.type_name());
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  MLA_CHECK(it->is_string(), "{}.{}: expected a string or null, got {}", where, key, it->type_name());
  return it->get<std::string>();
}

inline bool get_bool(const nlohmann::json& j, const char* key, const std::string& where, bool dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  MLA_CHECK(it->is_boolean(), "{}.{}: expected a boolean, got {}", where, key, it->type_name());
  return it->get<bool>();
}

// A {"String": s} or {"Regex": r} pattern object as a compiled regex (literal strings are escaped).
std::unique_ptr<Regex> make_pattern(const nlohmann::json& spec, const std::string& where);

}  // namespace mlaserve::tok
