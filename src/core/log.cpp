#include "core/log.h"

#include "core/error.h"

namespace mlaserve {

void set_log_level(const std::string& level) {
  std::string l = level == "warn" ? "warning" : level;
  auto lv = spdlog::level::from_str(l);
  MLA_CHECK(lv != spdlog::level::off || l == "off", "--log-level: unknown level '{}'", level);
  spdlog::set_level(lv);
  if (lv == spdlog::level::trace) spdlog::flush_on(spdlog::level::trace);
}

}  // namespace mlaserve
