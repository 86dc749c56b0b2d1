// Helpers shared by the tests: temp dirs, running the real binary, reading golden files.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <pthread.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <thread>

#include "backend/cpu/cpu_kernels.h"
#include "core/dtype.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/engine_api.h"
#include "engine/rank_set.h"
#include "io/safetensors.h"
#include "sanitizer_build.h"

namespace mlaserve::test {

// The message of the mlaserve::Error that f throws, or "" when it throws none.
template <typename F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Sets the default stack size of new threads (what `ulimit -s` decides at startup; glibc: 2 MiB where unlimited) for
// its lifetime: the product's threads that recurse over clients' input must not depend on it.
class DefaultThreadStack {
 public:
  explicit DefaultThreadStack(size_t bytes) {
    EXPECT_EQ(pthread_getattr_default_np(&old_), 0);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, bytes);
    EXPECT_EQ(pthread_setattr_default_np(&a), 0);
    pthread_attr_destroy(&a);
  }
  ~DefaultThreadStack() {
    pthread_setattr_default_np(&old_);
    pthread_attr_destroy(&old_);
  }
  DefaultThreadStack(const DefaultThreadStack&) = delete;
  DefaultThreadStack& operator=(const DefaultThreadStack&) = delete;

 private:
  pthread_attr_t old_;
};

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

// The FP8 code of least |value - x| over the codes [0, max_code] of x's sign (value: the format's decoding), ties to
// the even code: a brute-force reference of the encoders within their finite range.
inline uint8_t nearest_fp8(float x, float (*value)(uint8_t), int max_code) {
  uint8_t best = 0;
  double bd = 1e30;
  for (int c = 0; c <= max_code; ++c) {
    const double d = std::fabs(static_cast<double>(value(static_cast<uint8_t>(c))) - std::fabs(x));
    if (d < bd || (d == bd && c % 2 == 0)) {
      bd = d;
      best = static_cast<uint8_t>(c);
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}
// f32_to_e4m3's reference (x within +-448), and the tests' own FP8 quantizer.
inline uint8_t nearest_e4m3(float x) { return nearest_fp8(x, f8e4m3_to_f32, 0x7e); }
// f32_to_e5m2's reference (x within +-57344).
inline uint8_t nearest_e5m2(float x) { return nearest_fp8(x, f8e5m2_to_f32, 0x7b); }

// A golden family's folder (MLASERVE_GOLDEN_DIR in the environment overrides the path baked in at build time, as on
// the device).
inline std::string golden_dir(const std::string& family) {
  const char* e = std::getenv("MLASERVE_GOLDEN_DIR");
  return std::string(e ? e : MLASERVE_GOLDEN_DIR) + "/" + family;
}

// Every tensor of the checkpoint in `dir`, copied to host memory.
inline std::map<std::string, Tensor> read_checkpoint(const std::string& dir) {
  Checkpoint src(dir);
  std::map<std::string, Tensor> ts;
  for (const auto& n : src.names()) {
    const TensorInfo& i = src.get(n);
    Tensor t = Tensor::empty_host(i.shape, i.dtype);
    std::memcpy(t.data(), i.data, i.nbytes);
    ts[n] = t;
  }
  return ts;
}

// The whole checkpoint tensor `name` of the checkpoint in `dir` as F32.
inline std::vector<float> checkpoint_values(const std::string& dir, const std::string& name) {
  const Checkpoint ck(dir);
  const TensorInfo& t = ck.get(name);
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  cpu::convert(t.data, t.dtype, v.data(), DType::F32, n);
  return v;
}

// Copies a golden checkpoint into `dir` as one model.safetensors after applying `edit` to the tensor map.
inline void rewrite_checkpoint(const std::string& family, const std::filesystem::path& dir,
                               const std::function<void(std::map<std::string, Tensor>&)>& edit) {
  std::filesystem::copy_file(golden_dir(family) + "/config.json", dir / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::map<std::string, Tensor> ts = read_checkpoint(golden_dir(family));
  edit(ts);
  write_safetensors((dir / "model.safetensors").string(), ts);
}

// Multiplies every projection matrix (names ending in "_proj.weight") of the tensor map by `factor`, each in its own
// dtype: the same model's shapes with other weights (another training step's, as an RL trainer writes them).
inline void scale_projections(std::map<std::string, Tensor>& ts, float factor) {
  for (auto& [name, t] : ts) {
    if (!name.ends_with("_proj.weight")) continue;
    std::vector<float> f(static_cast<size_t>(t.numel()));
    cpu::convert(t.data(), t.dtype(), f.data(), DType::F32, t.numel());
    for (float& x : f) x *= factor;
    cpu::convert(f.data(), DType::F32, t.data(), t.dtype(), t.numel());
  }
}
// A golden family's checkpoint with its projections scaled (scale_projections), written into `dir`.
inline void write_scaled_checkpoint(const std::string& family, const std::filesystem::path& dir, float factor) {
  rewrite_checkpoint(family, dir, [factor](std::map<std::string, Tensor>& ts) { scale_projections(ts, factor); });
}

inline void write_text(const std::filesystem::path& p, const std::string& s) {
  std::ofstream o(p, std::ios::binary);
  o << s;
}

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream i(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(i)), std::istreambuf_iterator<char>());
}

// max |a - b| / std(b): the logit error relative to the reference's scale.
inline double rel_err(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  const int64_t n = b.numel();
  const float* x = a.data_as<float>();
  const float* y = b.data_as<float>();
  double mean = 0, var = 0, worst = 0;
  for (int64_t i = 0; i < n; ++i) mean += y[i];
  mean /= static_cast<double>(n);
  for (int64_t i = 0; i < n; ++i) {
    var += (y[i] - mean) * (y[i] - mean);
    worst = std::max(worst, std::fabs(double(x[i]) - y[i]));
  }
  return worst / std::sqrt(var / static_cast<double>(n));
}

// The random configs kept as golden families (tests/golden/data/random, made on the device by
// tools/device/random_goldens_run.sh from tools/device/config_fuzz.py's seeds): one to sixteen heads, one to four
// layers, V2 and V3 forms, every routing kind with groups; three prompts each.
inline const std::vector<std::string> kRandomFamilies = {"random/s11-fuzz2", "random/s12-fuzz2", "random/s13-fuzz17",
                                                         "random/s14-fuzz4", "random/s16-fuzz3", "random/s18-fuzz6"};

// The prompt_j tensors of a golden family's reference file.
inline std::vector<std::vector<int32_t>> golden_prompts(const std::string& family) {
  SafetensorsFile f(golden_dir(family) + "/reference.safetensors");
  std::vector<std::vector<int32_t>> out;
  for (int j = 0; f.has("prompt_" + std::to_string(j)); ++j) {
    Tensor p = f.tensor("prompt_" + std::to_string(j));
    out.emplace_back(p.data_as<int32_t>(), p.data_as<int32_t>() + p.numel());
  }
  return out;
}

// "127.0.0.1:PORT" with a port nobody listens on right now (the kernel picks it), so parallel tests never collide.
inline std::string free_loopback_addr() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
}

// CPU ranks of the checkpoint in `dir` in a layout (tp ranks, dp attention-DP groups); graph_max_bs > 0 records
// decode graphs up to that many tokens (GraphRecorder); mtp: with the checkpoint's MTP layer (speculative decoding's
// drafts).
// `tune` (may be empty) changes the configuration last.
inline std::unique_ptr<RankSet> cpu_ranks_at(const std::string& dir, int32_t tp = 1, int32_t dp = 1,
                                             int32_t graph_max_bs = 0, bool mtp = false, bool expert_parallel = false,
                                             const std::function<void(ParallelConfig&)>& tune = {},
                                             const LoadOptions& lo = {}) {
  ParallelConfig pc;
  pc.tp_size = tp;
  pc.dp_size = dp;
  pc.expert_parallel = expert_parallel;
  pc.device = "cpu";
  pc.backend.cpu_graphs = graph_max_bs > 0;
  pc.cuda_graph_max_bs = graph_max_bs;
  if (tune) tune(pc);
  ModelConfig c = ModelConfig::from_file(dir);
  if (mtp) c.mtp_layers = 1;
  return std::make_unique<RankSet>(c, pc, dir, lo);
}
// The same for a golden family.
inline std::unique_ptr<RankSet> cpu_ranks(const std::string& family, int32_t tp = 1, int32_t dp = 1,
                                          int32_t graph_max_bs = 0, bool mtp = false, bool expert_parallel = false) {
  return cpu_ranks_at(golden_dir(family), tp, dp, graph_max_bs, mtp, expert_parallel);
}

// Engine options of the engine tests: pages of 8 tokens, integrity checks after every step.
inline EngineOptions small_engine_options(bool overlap, int32_t num_pages = 160) {
  EngineOptions o;
  o.page_size = 8;
  o.num_pages = num_pages;
  o.check_integrity = true;
  o.overlap = overlap;
  return o;
}

// A request of `ids` for max_new tokens (EOS ignored) with `sp`'s sampling (greedy when null), on DP rank dp_rank
// (-1: any); no output callback yet.
inline GenerateRequest ids_request(const std::string& rid, std::vector<int32_t> ids, int32_t max_new,
                                   int32_t dp_rank = -1, const SamplingParams* sp = nullptr) {
  GenerateRequest g;
  g.rid = rid;
  g.input_ids = std::move(ids);
  if (sp) g.sampling = *sp;
  else g.sampling.temperature = 0.0f;
  g.sampling.max_new_tokens = max_new;
  g.sampling.ignore_eos = true;
  g.data_parallel_rank = dp_rank;
  return g;
}

// Submits token ids for max_new new tokens (EOS ignored), greedy unless `sp` is given; the future holds every new
// token.
inline std::future<std::vector<int32_t>> submit_ids(EngineClient& e, const std::string& rid,
                                                    const std::vector<int32_t>& ids, int32_t max_new,
                                                    int32_t dp_rank = -1, const SamplingParams* sp = nullptr) {
  auto prom = std::make_shared<std::promise<std::vector<int32_t>>>();
  auto acc = std::make_shared<std::vector<int32_t>>();
  GenerateRequest g = ids_request(rid, ids, max_new, dp_rank, sp);
  g.on_output = [prom, acc](const GenerateOutput& o) {
    acc->insert(acc->end(), o.new_tokens.begin(), o.new_tokens.end());
    if (o.finished) prom->set_value(*acc);
  };
  e.submit(std::move(g));
  return prom->get_future();
}

// What an engine call hands its callback (update_weights, release_memory, expert_record, profile, ...), waited for
// (a hang fails the test instead of blocking it).
template <class R>
R callback_result(const std::function<void(std::function<void(const R&)>)>& call) {
  auto done = std::make_shared<std::promise<R>>();
  auto fut = done->get_future();
  call([done](const R& r) { done->set_value(r); });
  EXPECT_EQ(fut.wait_for(std::chrono::seconds(120)), std::future_status::ready) << "hang?";
  return fut.get();
}

// The memory released (release) or taken again through the engine.
inline WeightUpdateResult memory_op(EngineClient& e, bool release) {
  return callback_result<WeightUpdateResult>(
      [&](auto cb) { release ? e.release_memory(std::move(cb)) : e.resume_memory(std::move(cb)); });
}

// The tokens of submit_ids' future (a hang fails the test instead of blocking it).
inline std::vector<int32_t> wait_ids(std::future<std::vector<int32_t>>& f) {
  EXPECT_EQ(f.wait_for(std::chrono::seconds(120)), std::future_status::ready) << "hang?";
  return f.get();
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
