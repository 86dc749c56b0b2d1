#include "engine/step_trace.h"

#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"
#include "core/files.h"

namespace mlaserve {

void StepTrace::start(std::string dir, int64_t num_steps, std::string tag) {
  active_ = true;
  dir_ = std::move(dir);
  tag_ = std::move(tag);
  num_steps_ = num_steps;
  steps_ = 0;
  origin_ = Clock::now();
  wall_origin_ = std::chrono::system_clock::now();
  events_ = nlohmann::json::array();
  for (int tid : {1, 2})
    events_.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", 1}, {"tid", tid},
                       {"args", {{"name", tid == 1 ? "engine thread" : "steps (launch to results)"}}}});
}

void StepTrace::span(const char* name, bool step_track, Clock::time_point t0, Clock::time_point t1,
                     nlohmann::json args) {
  if (!active_) return;
  const auto us = [&](Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - origin_).count();
  };
  events_.push_back({{"ph", "X"}, {"name", name}, {"pid", 1}, {"tid", step_track ? 2 : 1}, {"ts", us(t0)},
                     {"dur", std::max(0.0, us(t1) - us(t0))}, {"args", std::move(args)}});
}

bool StepTrace::step_done() {
  if (!active_) return false;
  ++steps_;
  return num_steps_ > 0 && steps_ >= num_steps_;
}

std::string StepTrace::stop() {
  MLA_CHECK(active_, "no profile is being recorded");
  active_ = false;
  const double t = std::chrono::duration<double>(wall_origin_.time_since_epoch()).count();
  const std::string name = fmt::format("{:.6f}-mlaserve{}{}.trace.json", t, tag_.empty() ? "" : "-", tag_);
  const std::string path = (std::filesystem::path(dir_) / name).string();
  nlohmann::json doc = {{"traceEvents", std::move(events_)},
                        {"displayTimeUnit", "ms"},
                        {"otherData", {{"steps", steps_}, {"start_unix_time", t}}}};
  events_ = nlohmann::json::array();
  write_file(path, doc.dump() + "\n");
  return path;
}

}  // namespace mlaserve
