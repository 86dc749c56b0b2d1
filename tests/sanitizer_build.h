// What tests adjust for sanitizer builds (README): the factor on the time limits they put on work they wait for (an
// answer, a server's startup, a soak's requests), MLASERVE_TEST_TIME_SCALE, default 1 (such a build runs 5-20 times
// slower); whether ThreadSanitizer is on.
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

// Under ThreadSanitizer every thread's static TLS holds libtsan's 785 KiB: glibc's pthread_create refuses a smaller
// stack (EINVAL; seen at 256 and 512 KiB).
#ifdef __SANITIZE_THREAD__
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif

}  // namespace mlaserve::test
