#include "core/thread.h"

#include <unistd.h>

#include <cstring>
#include <exception>
#include <memory>

#include "core/error.h"

namespace mlaserve {

namespace {

void* run(void* arg) {
  const std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
  (*fn)();  // an exception escaping ends the process, as from a std::thread
  return nullptr;
}

}  // namespace

Thread::Thread(size_t stack_bytes, std::function<void()> fn) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  stack_bytes = (stack_bytes + page - 1) / page * page;
  pthread_attr_t attr;
  MLA_CHECK(pthread_attr_init(&attr) == 0, "thread: cannot make thread attributes");
  const int set = pthread_attr_setstacksize(&attr, stack_bytes);
  auto arg = std::make_unique<std::function<void()>>(std::move(fn));
  const int made = set == 0 ? pthread_create(&id_, &attr, run, arg.get()) : set;
  pthread_attr_destroy(&attr);
  MLA_CHECK(made == 0, "thread: cannot start a thread with a {} KiB stack: {}", stack_bytes >> 10, std::strerror(made));
  arg.release();  // run() owns it now
  joinable_ = true;
}

Thread::Thread(Thread&& o) noexcept : id_(o.id_), joinable_(o.joinable_) { o.joinable_ = false; }

Thread& Thread::operator=(Thread&& o) noexcept {
  if (this != &o) {
    if (joinable_) std::terminate();
    id_ = o.id_;
    joinable_ = o.joinable_;
    o.joinable_ = false;
  }
  return *this;
}

Thread::~Thread() {
  if (joinable_) std::terminate();
}

void Thread::join() {
  MLA_CHECK(joinable_, "thread: join of a thread that is not joinable");
  MLA_CHECK(!is_current(), "thread: a thread cannot join itself");
  const int rc = pthread_join(id_, nullptr);
  MLA_CHECK(rc == 0, "thread: join failed: {}", std::strerror(rc));
  joinable_ = false;
}

void Thread::detach() {
  MLA_CHECK(joinable_, "thread: detach of a thread that is not joinable");
  const int rc = pthread_detach(id_);
  MLA_CHECK(rc == 0, "thread: detach failed: {}", std::strerror(rc));
  joinable_ = false;
}

bool Thread::is_current() const { return joinable_ && pthread_equal(id_, pthread_self()) != 0; }

size_t Thread::current_stack_bytes() {
  pthread_attr_t attr;
  MLA_CHECK(pthread_getattr_np(pthread_self(), &attr) == 0, "thread: cannot read the thread's attributes");
  size_t size = 0;
  pthread_attr_getstacksize(&attr, &size);
  pthread_attr_destroy(&attr);
  return size;
}

}  // namespace mlaserve
