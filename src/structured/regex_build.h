// Pieces shared by the converters that write regexes (json_schema.cpp, ebnf.cpp): groups and alternations, a regex
// that may be absent (nothing allowed within the recursion bound), and recursive references followed kRefDepth times.
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "structured/json_schema.h"

namespace mlaserve::structured::build {

using Rx = std::optional<std::string>;  // a regex, or none: nothing allowed within the recursion bound

inline std::string group(const std::string& r) {
  std::string out = "(";
  out += r;
  out += ')';
  return out;
}

// The alternation of alts, each grouped (appended, not prepended: GCC 12 warns falsely on "x" + a temporary).
inline std::string join(const std::vector<std::string>& alts) {
  std::string r;
  for (const auto& a : alts) {
    if (!r.empty()) r += '|';
    r += group(a);
  }
  return r;
}

// The references being expanded, outermost first. follow(target, expand, where): expand() for target unless target
// is already being expanded kRefDepth times on this path (then none: the recursion ends where the caller can do
// without it); more than 64 nested references are an error naming `where`.
class RefStack {
 public:
  template <typename F>
  Rx follow(const void* target, F&& expand, const std::string& where) {
    if (std::count(stack_.begin(), stack_.end(), target) >= kRefDepth) return std::nullopt;
    if (stack_.size() >= 64) fail("{}: references nest more than 64 deep", where);
    stack_.push_back(target);
    Rx r = expand();
    stack_.pop_back();
    return r;
  }

 private:
  std::vector<const void*> stack_;
};

}  // namespace mlaserve::structured::build
