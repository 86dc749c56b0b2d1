// StepTrace: the engine thread's spans (schedule, launch, wait for the device, resolve, and each step from its launch
// to its results) between SGLang's / vLLM's /start_profile and /stop_profile, written as a Chrome trace (JSON
// "traceEvents", viewable in Perfetto or chrome://tracing). Engine thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mlaserve {

class StepTrace {
 public:
  using Clock = std::chrono::steady_clock;
  // Starts recording into a trace for `dir` (made when written); num_steps > 0: done after that many steps; `tag`
  // goes into the file's name (several engines writing into one folder).
  void start(std::string dir, int64_t num_steps, std::string tag = "");
  bool active() const { return active_; }
  // A span of the engine thread (track "engine") or a step's lifetime (track "steps"), with its arguments.
  void span(const char* name, bool step_track, Clock::time_point t0, Clock::time_point t1,
            nlohmann::json args = nlohmann::json::object());
  // A step finished; true when num_steps steps have (the caller then calls stop()).
  bool step_done();
  // Writes the trace (<dir>/<unix time>-mlaserve[-tag].trace.json) and ends the recording: the file's path; throws
  // naming the file when it cannot be written.
  std::string stop();
  int64_t steps() const { return steps_; }

 private:
  bool active_ = false;
  std::string dir_, tag_;
  int64_t num_steps_ = 0, steps_ = 0;
  Clock::time_point origin_;
  std::chrono::system_clock::time_point wall_origin_;
  nlohmann::json events_ = nlohmann::json::array();
};

}  // namespace mlaserve
