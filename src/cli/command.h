// CLI command registry: each cli/cmd_*.cpp registers one subcommand (name, help, a setup function that adds
// its options to the CLI11 subcommand and returns the function that runs it).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace mlaserve::cli {

using Runner = std::function<int()>;
using Setup = std::function<Runner(CLI::App&)>;

struct CommandSpec {
  std::string name;
  std::string help;
  Setup setup;
};

std::vector<CommandSpec>& command_registry();

struct RegisterCommand {
  RegisterCommand(std::string name, std::string help, Setup setup) {
    command_registry().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

}  // namespace mlaserve::cli
