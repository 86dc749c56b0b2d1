// The factor on the time limits tests put on work they wait for (an answer, a server's startup, a soak's requests):
// MLASERVE_TEST_TIME_SCALE, default 1 (a sanitizer build runs 5-20 times slower; README).
#pragma once

#include <cstdlib>

namespace mlaserve::test {

inline double time_scale() {
  static const double scale = [] {
    const char* e = std::getenv("MLASERVE_TEST_TIME_SCALE");
    const double v = e ? std::atof(e) : 1.0;
    return v > 0 ? v : 1.0;
  }();
  return scale;
}

}  // namespace mlaserve::test
