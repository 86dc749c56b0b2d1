// Helpers shared by the tests: temp dirs, running the real binary, reading golden files.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <thread>

#include "engine/engine_api.h"
#include "io/safetensors.h"

namespace mlaserve::test {

inline std::filesystem::path temp_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = tag + "_" + (info ? std::string(info->test_suite_name()) + "_" + info->name() : "x");
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') c = '_';
  auto p = std::filesystem::temp_directory_path() / ("mlaserve_test_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line, capturing stdout+stderr.
inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* f = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!f) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) r.output.append(buf.data(), n);
  int st = ::pclose(f);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

inline std::string golden_dir(const std::string& family) { return std::string(MLASERVE_GOLDEN_DIR) + "/" + family; }

inline void write_text(const std::filesystem::path& p, const std::string& s) {
  std::ofstream o(p, std::ios::binary);
  o << s;
}

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream i(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(i)), std::istreambuf_iterator<char>());
}

// Waits until no DP rank runs or queues a request, flushes the prefix cache, and expects every KV page free.
inline void expect_engine_idle_and_clean(EngineClient& e) {
  for (int i = 0; i < 300; ++i) {
    bool idle = true;
    for (auto& s : e.stats()) idle &= s.num_running_reqs == 0 && s.num_queue_reqs == 0;
    if (idle) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(e.flush_cache());
  for (auto& s : e.stats()) EXPECT_EQ(s.kv_tokens_free, s.kv_tokens_total);
}

}  // namespace mlaserve::test
