// One thread running posted tasks in order: the executor of exchanges that are not a client's connection (a batch's
// lines, background responses). Tasks posted after stop() are dropped.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "core/thread.h"
#include "server/generation.h"

namespace mlaserve::server {

class SerialWorker : public std::enable_shared_from_this<SerialWorker> {
 public:
  // name: what a task's exception is logged under.
  static std::shared_ptr<SerialWorker> start(std::string name);
  ~SerialWorker();
  void post(std::function<void()> fn);
  // Runs a function on this worker; holds the worker alive, so it may outlive its owner (late tasks are dropped).
  Executor executor();
  // Ends the thread (joined; detached when called from a task of its own): tasks still queued are dropped, later
  // posts too. The owner calls it: the thread holds the worker until then.
  void stop();

 private:
  explicit SerialWorker(std::string name) : name_(std::move(name)) {}
  void loop();

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  Thread thread_;  // kInputStackBytes: its tasks parse clients' input (batch lines)
};

}  // namespace mlaserve::server
