// core/thread.h: a thread with the stack size it is given, whatever the default for new threads.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "core/error.h"
#include "core/thread.h"
#include "test_util.h"

namespace mlaserve {
namespace {

size_t std_thread_stack() {
  size_t bytes = 0;
  std::thread([&] { bytes = Thread::current_stack_bytes(); }).join();
  return bytes;
}

TEST(Thread, HasTheStackItIsGivenWhateverTheDefault) {
  if (test::kThreadSanitizer) GTEST_SKIP() << "a 256 KiB stack cannot hold ThreadSanitizer's TLS";
  test::DefaultThreadStack small(size_t{256} << 10);
  EXPECT_EQ(std_thread_stack(), size_t{256} << 10);  // the default applies to std::thread
  for (size_t want : {kInputStackBytes, size_t{3} << 20, (size_t{1} << 20) + 1}) {
    size_t got = 0;
    Thread t(want, [&] { got = Thread::current_stack_bytes(); });
    t.join();
    EXPECT_GE(got, want);  // (glibc may hand a cached larger stack again)
    EXPECT_FALSE(t.joinable());
  }
}

// join / detach / is_current / moves as std::thread's; a stack too small to start on is an Error naming its size.
TEST(Thread, JoinDetachAndMove) {
  std::atomic<int> ran{0};
  Thread a(size_t{1} << 20, [&] { ++ran; });
  EXPECT_TRUE(a.joinable());
  EXPECT_FALSE(a.is_current());
  Thread b(std::move(a));
  EXPECT_FALSE(a.joinable());
  EXPECT_TRUE(b.joinable());
  b.join();
  EXPECT_EQ(ran.load(), 1);
  EXPECT_THROW(b.join(), Error);

  std::atomic<bool> current{false}, done{false};
  Thread* self = nullptr;
  std::atomic<bool> go{false};
  Thread c(size_t{1} << 20, [&] {
    while (!go.load()) std::this_thread::yield();
    current = self->is_current();
    done = true;
  });
  self = &c;
  go = true;
  while (!done.load()) std::this_thread::yield();
  EXPECT_TRUE(current.load());
  c.detach();
  EXPECT_FALSE(c.joinable());

  Thread d;
  EXPECT_FALSE(d.joinable());
  d = Thread(size_t{1} << 20, [&] { ++ran; });
  d.join();
  EXPECT_EQ(ran.load(), 2);
  try {
    Thread tiny(1, [] {});
    tiny.join();
    ADD_FAILURE() << "a 1-byte stack started";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KiB stack"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mlaserve
