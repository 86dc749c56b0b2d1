// Profiling (SGLang's and vLLM's /start_profile and /stop_profile): the engine's trace of its steps between a start
// and a stop, or of num_steps steps, as a Chrome trace; refusals; DP replicas writing one trace each.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <future>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "test_util.h"

using namespace mlaserve;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

ProfileResult profile(EngineClient& e, bool start, const std::string& dir = "", int64_t num_steps = 0) {
  ProfileRequest r;
  r.start = start;
  r.output_dir = dir;
  r.num_steps = num_steps;
  return test::callback_result<ProfileResult>([&](auto cb) { e.profile(r, std::move(cb)); });
}

// The complete events named `name` of a trace file.
std::vector<json> spans(const std::string& path, const std::string& name) {
  std::ifstream in(path);
  const json t = json::parse(in);
  std::vector<json> out;
  for (const json& e : t.at("traceEvents"))
    if (e.at("ph") == "X" && e.at("name") == name) out.push_back(e);
  return out;
}

void run(EngineClient& e, const std::string& tag, int n, int32_t max_new) {
  std::vector<std::future<std::vector<int32_t>>> fs;
  for (int i = 0; i < n; ++i)
    fs.push_back(test::submit_ids(e, tag + std::to_string(i), {5, 17, 300, 2, 99, static_cast<int32_t>(i)}, max_new));
  for (auto& f : fs) EXPECT_EQ(test::wait_ids(f).size(), static_cast<size_t>(max_new));
}

}  // namespace

// Every step between start and stop is one "step" span with its batch (tokens per DP group); the engine thread's own
// spans are there (launch and the wait for the device with overlap scheduling, one run without).
TEST(Profile, TraceOfTheStepsBetweenStartAndStop) {
  for (bool overlap : {true, false}) {
    SCOPED_TRACE(overlap ? "overlap" : "no overlap");
    const fs::path dir = test::temp_dir(overlap ? "profile-o" : "profile");
    Engine e(test::cpu_ranks("v2lite"), test::small_engine_options(overlap));
    run(e, "before", 1, 3);
    const int64_t before = e.stats()[0].forward_steps;
    ProfileResult r = profile(e, true, dir.string());
    ASSERT_TRUE(r.ok) << r.message;
    EXPECT_TRUE(r.paths.empty());
    EXPECT_FALSE(profile(e, true, dir.string()).ok);  // already recording
    run(e, "during", 2, 5);
    test::expect_engine_idle_and_clean(e);
    const int64_t steps = e.stats()[0].forward_steps - before;
    r = profile(e, false);
    ASSERT_TRUE(r.ok) << r.message;
    ASSERT_EQ(r.paths.size(), 1u);
    EXPECT_EQ(fs::path(r.paths[0]).parent_path(), dir);
    const std::vector<json> st = spans(r.paths[0], "step");
    EXPECT_EQ(static_cast<int64_t>(st.size()), steps);
    int64_t tokens = 0;
    for (const json& s : st) {
      EXPECT_GE(s.at("dur").get<double>(), 0.0);
      tokens += s.at("args").at("tokens").at(0).get<int64_t>();
    }
    EXPECT_EQ(tokens, 2 * 6 + 2 * 4);  // two prompts of 6, then 4 more tokens each (the last one never forwarded)
    EXPECT_TRUE(st.front().at("args").at("prefill").get<bool>());
    EXPECT_FALSE(st.back().at("args").at("prefill").get<bool>());
    EXPECT_EQ(spans(r.paths[0], overlap ? "launch" : "run on the device").size(), st.size());
    if (overlap) {
      EXPECT_EQ(spans(r.paths[0], "wait for the device").size(), st.size());
    }
    EXPECT_FALSE(profile(e, false).ok);  // none running
  }
}

// num_steps: the trace is written after that many steps by itself; a later stop finds none running.
TEST(Profile, NumStepsEndsByItself) {
  const fs::path dir = test::temp_dir("profile-n");
  Engine e(test::cpu_ranks("v2lite"), test::small_engine_options(true));
  ASSERT_TRUE(profile(e, true, dir.string(), 3).ok);
  run(e, "a", 1, 8);
  std::vector<fs::path> files;
  for (const auto& f : fs::directory_iterator(dir)) files.push_back(f.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_NE(files[0].filename().string().find("-mlaserve.trace.json"), std::string::npos) << files[0];
  EXPECT_EQ(spans(files[0].string(), "step").size(), 3u);
  EXPECT_FALSE(profile(e, false).ok);
  EXPECT_FALSE(profile(e, true, dir.string(), -1).ok);
}

// --dp replicas: one trace each, named by replica.
TEST(Profile, ReplicasWriteOneTraceEach) {
  const fs::path dir = test::temp_dir("profile-dp");
  EngineArgs a;
  a.model_path = test::golden_dir("v2lite");
  a.device = "cpu";
  a.dp_size = 2;
  a.max_total_tokens = 512;
  auto e = make_engine(a);
  ASSERT_TRUE(profile(*e, true, dir.string()).ok);
  run(*e, "r", 4, 3);
  ProfileResult r = profile(*e, false);
  ASSERT_TRUE(r.ok) << r.message;
  ASSERT_EQ(r.paths.size(), 2u);
  // (the replicas answer in any order)
  const bool in_order = r.paths[0].find("replica0") != std::string::npos;
  EXPECT_NE(r.paths[in_order ? 0 : 1].find("-mlaserve-replica0.trace.json"), std::string::npos) << r.paths[0];
  EXPECT_NE(r.paths[in_order ? 1 : 0].find("-mlaserve-replica1.trace.json"), std::string::npos) << r.paths[1];
  for (const std::string& p : r.paths) EXPECT_FALSE(spans(p, "step").empty()) << p;
  e->shutdown();
}
