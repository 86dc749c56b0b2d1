// mlaserve: the single binary. Subcommands register themselves (cli/command.h).
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <algorithm>
#include <iostream>
#include <map>

#include "cli/command.h"
#include "core/error.h"
#include "core/log.h"

namespace mlaserve::cli {
std::vector<CommandSpec>& command_registry() {
  static std::vector<CommandSpec> r;
  return r;
}
}  // namespace mlaserve::cli

int main(int argc, char** argv) {
  using namespace mlaserve;
  // CUDA's default lazy module loading stays: measured on 2 x H200 (docs/perf.md), one process driving both GPUs
  // with NCCL deadlocked in the first step under CUDA_MODULE_LOADING=EAGER (TP 2 bench and DP attention, every
  // attempt) and ran clean under LAZY; the kernels' shared-memory attributes are set when each backend starts.
  // Establish NCCL connections at communicator init rather than inside the first collective (which then allocates
  // and maps peer memory while the other rank threads launch kernels).
  ::setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
  // Logs go to stderr: stdout carries command output (token ids, JSON lines).
  auto logger = spdlog::stderr_color_mt("mlaserve");
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
  spdlog::set_default_logger(logger);

  CLI::App app{"mlaserve: a serving engine for DeepSeek MLA models"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace|debug|info|warning|error")->capture_default_str();
  auto& reg = cli::command_registry();
  std::sort(reg.begin(), reg.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  std::map<CLI::App*, cli::Runner> runners;
  for (auto& spec : reg) {
    CLI::App* sub = app.add_subcommand(spec.name, spec.help);
    sub->fallthrough();
    runners[sub] = spec.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    set_log_level(log_level);
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
