#include "server/serial_worker.h"

#include "core/log.h"

namespace mlaserve::server {

std::shared_ptr<SerialWorker> SerialWorker::start(std::string name) {
  std::shared_ptr<SerialWorker> w(new SerialWorker(std::move(name)));
  // The thread holds the worker until stop() ends its loop (the owner's destructor calls stop()).
  w->thread_ = Thread(kInputStackBytes, [self = w] { self->loop(); });
  return w;
}

SerialWorker::~SerialWorker() { stop(); }

void SerialWorker::post(std::function<void()> fn) {
  {
    std::lock_guard lk(mu_);
    if (stop_) return;  // the owner is gone: late answers are dropped
    tasks_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

Executor SerialWorker::executor() {
  return [w = shared_from_this()](std::function<void()> fn) { w->post(std::move(fn)); };
}

void SerialWorker::stop() {
  std::deque<std::function<void()>> dropped;  // destroyed outside the lock: they may hold what posts here
  {
    std::lock_guard lk(mu_);
    stop_ = true;
    dropped.swap(tasks_);
  }
  cv_.notify_all();
  if (!thread_.joinable()) return;
  if (thread_.is_current()) {
    thread_.detach();  // the last reference went in one of its own tasks: the loop ends after it
  } else {
    thread_.join();
  }
}

void SerialWorker::loop() {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !tasks_.empty(); });
      if (stop_) return;
      fn = std::move(tasks_.front());
      tasks_.pop_front();
    }
    try {
      fn();
    } catch (const std::exception& e) {
      MLA_LOG_ERROR("{}: {}", name_, e.what());
    }
  }
}

}  // namespace mlaserve::server
