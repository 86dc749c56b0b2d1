// Logging: spdlog behind a thin facade so the level is set once from --log-level.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace mlaserve {
void set_log_level(const std::string& level);  // trace|debug|info|warning|error|critical|off
}  // namespace mlaserve

#define MLA_LOG_DEBUG(...) SPDLOG_DEBUG(__VA_ARGS__)
// Step tracing (--log-level trace): where each rank is, flushed at once, so a hang shows its last position.
#define MLA_LOG_TRACE(...)                                                      \
  do {                                                                          \
    if (spdlog::should_log(spdlog::level::trace)) spdlog::trace(__VA_ARGS__);   \
  } while (0)
#define MLA_LOG_INFO(...) spdlog::info(__VA_ARGS__)
#define MLA_LOG_WARN(...) spdlog::warn(__VA_ARGS__)
#define MLA_LOG_ERROR(...) spdlog::error(__VA_ARGS__)
