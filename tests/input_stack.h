// Runs test code on a thread with the stack of the threads that take clients' input (kInputStackBytes), as the
// server does: the parsers' nesting limits are set for it, and code that recurses through deeply nested input (the
// fuzz test's mutator) must not depend on the main thread's `ulimit -s` (a sanitizer's larger frames overflow 8 MiB).
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>

#include "core/thread.h"

namespace mlaserve::test {

inline void on_input_stack(const std::function<void()>& fn) {
  Thread t(kInputStackBytes, [&] {
    try {
      fn();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "uncaught: " << e.what();
    }
  });
  t.join();
}

}  // namespace mlaserve::test
