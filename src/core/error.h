// Errors: every failure the user can cause is an mlaserve::Error whose message names the thing at fault
// (file, tensor, flag, field). Internal invariants use MLA_CHECK too, so nothing fails silently.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace mlaserve {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <typename... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace mlaserve

// MLA_CHECK(cond, "format {}", args...) throws mlaserve::Error with the formatted message.
#define MLA_CHECK(cond, ...)                  \
  do {                                        \
    if (!(cond)) ::mlaserve::fail(__VA_ARGS__); \
  } while (0)
