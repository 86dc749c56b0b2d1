// A thread whose stack size is chosen by the code, not by the process's `ulimit -s` (glibc gives new threads that
// limit, or 2 MiB where it is unlimited, so a shell's setting could decide whether a request crashes the server).
// The threads that take clients' input (HTTP handlers, the serial worker running batch lines) parse regexes,
// grammars, JSON Schemas and chat templates by recursion, one frame or more per level of nesting; their nesting
// limits (src/structured/) are set for kInputStackBytes.
#pragma once

#include <pthread.h>

#include <cstddef>
#include <functional>

namespace mlaserve {

// Enough for every nesting limit the parsers enforce several times over (a 1,024-group regex takes under 1 MiB in a
// release build); the pages are touched only as deep as a thread recurses.
inline constexpr size_t kInputStackBytes = size_t{64} << 20;

class Thread {
 public:
  Thread() = default;
  // Starts fn on a new thread with a stack of stack_bytes (rounded up to the page size); throws Error when the
  // thread cannot be made.
  Thread(size_t stack_bytes, std::function<void()> fn);
  Thread(Thread&& o) noexcept;
  Thread& operator=(Thread&& o) noexcept;  // std::terminate when this one is still joinable, as std::thread
  Thread(const Thread&) = delete;
  Thread& operator=(const Thread&) = delete;
  ~Thread();  // std::terminate when still joinable, as std::thread

  bool joinable() const { return joinable_; }
  void join();
  void detach();
  bool is_current() const;  // whether the caller runs on this thread

  // The stack size of the calling thread (what its attributes say), for tests and logs.
  static size_t current_stack_bytes();

 private:
  pthread_t id_{};
  bool joinable_ = false;
};

}  // namespace mlaserve
