// End-to-end: the real `mlaserve serve` binary, a tiny dummy-weight DeepSeek-V3 model, the real DeepSeek-V3
// tokenizer; checked over raw HTTP, with the official `openai` npm client and with `mlaserve bench-serving`.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cctype>
#include <fstream>
#include <mutex>
#include <random>
#include <regex>
#include <thread>

#include "e2e/server_process.h"
#include "http_test_client.h"
#include "io/safetensors.h"
#include "tls_test_util.h"
#include "structured/json_schema.h"
#include "structured/regex.h"

namespace mlaserve::test {
namespace {

// `timeout <seconds> <the mlaserve binary under test>` (MLASERVE_E2E_BINARY, else the one built here).
std::string mlaserve_cmd(int seconds) {
  return fmt::format("timeout {} {}", static_cast<int>(seconds * time_scale()),
                     e2e_env("MLASERVE_E2E_BINARY", MLASERVE_BINARY));
}

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

json get_json(int port, const std::string& path) {
  auto r = http_request(port, "GET", path);
  EXPECT_EQ(r.status, 200) << path << ": " << r.body;
  return json::parse(r.body);
}

json post_json(int port, const std::string& path, const std::string& body, int want_status = 200) {
  auto r = http_request(port, "POST", path, body);
  EXPECT_EQ(r.status, want_status) << path << " " << body.substr(0, 200) << ": " << r.body;
  return json::parse(r.body);
}

// Polls /get_server_info until no request runs or waits.
json wait_idle(int port, double seconds = 60) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds * time_scale());
  json st;
  while (std::chrono::steady_clock::now() < end) {
    st = get_json(port, "/get_server_info")["internal_states"][0];
    if (st["num_running_reqs"] == 0 && st["num_queue_reqs"] == 0) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "server not idle: " << st.dump();
  return st;
}

// Polls /get_load (rank 0) until `key` reaches n.
void wait_load(int port, const char* key, int n, double seconds = 60) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds * time_scale());
  json st;
  while (std::chrono::steady_clock::now() < end) {
    st = get_json(port, "/get_load")[0];
    if (st[key] == n) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << key << " never reached " << n << ": " << st.dump();
}
void wait_running(int port, int n) { wait_load(port, "num_reqs", n); }
void wait_waiting(int port, int n) { wait_load(port, "num_waiting_reqs", n); }

std::string ids_json(const std::vector<int32_t>& ids) { return json(ids).dump(); }

// One server for the suite (startup is the slow part); variants start their own.
class ServerE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_TRUE(have_deepseek_tokenizer())
        << "the DeepSeek-V3 tokenizer is missing at " << deepseek_tokenizer_dir() << ": run scripts/setup.sh";
    // (On a GPU 0.8 of its memory, so that the run-batch test's own engine fits beside it on an 80 GB card too.)
    server_ = new ServerProcess({"--chunked-prefill-size", "64", "--mem-fraction-static", "0.8"});
    ASSERT_TRUE(server_->running()) << server_->log();
  }
  static void TearDownTestSuite() {
    if (server_) {
      EXPECT_EQ(server_->stop(), 0) << server_->log();
    }
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    if (!server_ || !server_->running()) {
      GTEST_SKIP() << "server did not start";
    }
  }
  static int port() { return server_->port(); }
  static ServerProcess* server_;
};
ServerProcess* ServerE2E::server_ = nullptr;

// SGLang's /get_weights_by_name against the running server (dummy weights): a matrix's first truncate_size rows and a
// vector's first 100 elements (the default), the same on every read and on every DP rank (a list of one answer per
// rank under a DP layout); an unknown name is a 400 naming it.
TEST_F(ServerE2E, GetWeightsByName) {
  const int64_t dp = get_json(port(), "/get_server_info").value("dp_size", 1);
  std::ifstream cf(e2e_model_dir() + "/config.json");
  const json config = json::parse(cf);
  const int64_t H = config["hidden_size"];
  const int64_t kv_rows = config["kv_lora_rank"].get<int64_t>() + config["qk_rope_head_dim"].get<int64_t>();
  auto read = [&](const std::string& body) {
    const auto r = http_request(port(), "POST", "/get_weights_by_name", body);
    EXPECT_EQ(r.status, 200) << body << ": " << r.body;
    const json j = json::parse(r.body);
    std::vector<json> ranks = dp > 1 ? j.get<std::vector<json>>() : std::vector<json>{j};
    EXPECT_EQ(static_cast<int64_t>(ranks.size()), dp) << r.body.substr(0, 200);
    for (const json& x : ranks) EXPECT_EQ(x, ranks.front()) << "DP ranks differ";
    return ranks.front();
  };
  const std::string kv_a = R"({"name": "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "truncate_size": 3})";
  const json m = read(kv_a);
  ASSERT_TRUE(m.is_array());
  ASSERT_EQ(m.size(), 3u);
  double sum = 0.0;
  for (const json& row : m) {
    ASSERT_EQ(static_cast<int64_t>(row.size()), H);
    for (const json& v : row) sum += std::fabs(v.get<double>());
  }
  EXPECT_GT(sum, 0.0) << "dummy weights are not zeros";
  EXPECT_EQ(read(kv_a), m);
  EXPECT_EQ(read(R"({"name": "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "truncate_size": 100000})").size(),
            static_cast<size_t>(kv_rows));
  const json norm = read(R"({"name": "model.norm.weight"})");
  ASSERT_EQ(static_cast<int64_t>(norm.size()), std::min<int64_t>(100, H));
  EXPECT_TRUE(norm.front().is_number());
  const auto r = http_request(port(), "POST", "/get_weights_by_name", R"({"name": "model.nothing.weight"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("model.nothing.weight"), std::string::npos) << r.body;
}

TEST_F(ServerE2E, StartupInfoAndHealth) {
  EXPECT_NE(server_->log().find("mlaserve: serving 'tiny-v3' on http://127.0.0.1:"), std::string::npos);
  EXPECT_EQ(http_request(port(), "GET", "/health").status, 200);
  auto info = get_json(port(), "/get_model_info");
  EXPECT_EQ(info["tokenizer_path"], deepseek_tokenizer_dir());
  auto si = get_json(port(), "/get_server_info");
  EXPECT_EQ(si["chunked_prefill_size"], 64);
  EXPECT_EQ(si["internal_states"][0]["kv_tokens_total"], 65536);
  auto models = get_json(port(), "/v1/models");
  EXPECT_EQ(models["data"][0]["id"], "tiny-v3");
}

// The native stream, byte for byte: every event is `data: ` + the chunk JSON with keys in the documented order
// + "\n\n"; text and ids are cumulative; the last chunk carries finish_reason and e2e_latency; then [DONE].
TEST_F(ServerE2E, NativeStreamFormatByteForByte) {
  const std::string req = R"({"text": "The quick brown fox", "rid": "fmt-1", "sampling_params": {"max_new_tokens": 6,
      "temperature": 0, "ignore_eos": true}})";
  auto whole = post_json(port(), "/generate", req);
  auto r = http_request(port(), "POST", "/generate",
                        std::regex_replace(req, std::regex("fmt-1"), "fmt-2").insert(1, R"("stream": true, )"));
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.headers["content-type"], "text/event-stream");
  const std::vector<int32_t> ids = whole["output_ids"];
  const int prompt_tokens = whole["meta_info"]["prompt_tokens"];
  ASSERT_EQ(ids.size(), 6u);
  std::string expected;
  std::string last_text;
  size_t pos = 0;
  for (size_t k = 1; k <= ids.size(); ++k) {
    // The chunk's text is whatever the server sent (held-back bytes make it lag); check it is a growing prefix
    // of the final text and rebuild the exact bytes from the documented layout.
    const size_t s = r.body.find("data: ", pos);
    ASSERT_NE(s, std::string::npos);
    const size_t e = r.body.find("\n\n", s);
    json chunk = json::parse(r.body.substr(s + 6, e - s - 6));
    pos = e + 2;
    const std::string text = chunk["text"];
    EXPECT_EQ(whole["text"].get<std::string>().rfind(text, 0), 0u) << text;
    EXPECT_GE(text.size(), last_text.size());
    last_text = text;
    ojson c;
    c["text"] = text;
    c["output_ids"] = std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<long>(k));
    ojson meta;
    meta["id"] = "fmt-2";
    meta["finish_reason"] = k == ids.size() ? ojson::parse(R"({"type":"length","length":6})") : ojson(nullptr);
    meta["prompt_tokens"] = prompt_tokens;
    meta["completion_tokens"] = k;
    meta["cached_tokens"] = chunk["meta_info"]["cached_tokens"];
    if (k == ids.size()) meta["e2e_latency"] = chunk["meta_info"]["e2e_latency"];
    c["meta_info"] = meta;
    expected += "data: " + c.dump() + "\n\n";
  }
  EXPECT_EQ(last_text, whole["text"]);
  expected += "data: [DONE]\n\n";
  // Floats re-serialize identically (nlohmann round-trips doubles), so this compares bytes.
  EXPECT_EQ(r.body, expected);
}

// The preconditions of a test driving a real npm client (`package` under tests/npm/node_modules): defines `node`;
// skips where the build machine's node is absent (a test tree copied to another machine); fails without node or the
// package.
#define REQUIRE_NODE_CLIENT(package)                                                                             \
  const std::string node = MLASERVE_NODE;                                                                        \
  if (!e2e_env("MLASERVE_E2E_ROOT", "").empty() && !std::filesystem::exists(node))                               \
    GTEST_SKIP() << "the build machine's node is not on this machine";                                           \
  ASSERT_FALSE(node.empty() || node.find("NOTFOUND") != std::string::npos) << "node is needed for this test";   \
  ASSERT_TRUE(std::filesystem::exists(std::string(MLASERVE_SOURCE_DIR) + "/tests/npm/node_modules/" package))    \
      << "run scripts/setup.sh (npm packages)"

TEST_F(ServerE2E, OpenAINpmClient) {
  REQUIRE_NODE_CLIENT("openai");
  auto r = run_command("timeout 120 " + node + " " + MLASERVE_SOURCE_DIR + "/tests/e2e/openai_client.mjs " +
                       std::to_string(port()) + " tiny-v3");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("all checks passed"), std::string::npos) << r.output;
}

// Anthropic's Messages API through the official `@anthropic-ai/sdk` client (tests/e2e/anthropic_client.mjs): a message,
// streamed, counted, a forced tool call and its result, a 400; the key sent as x-api-key.
TEST(ServerE2EVariants, AnthropicNpmClient) {
  REQUIRE_NODE_CLIENT("@anthropic-ai/sdk");
  ASSERT_TRUE(have_deepseek_tokenizer());
  const std::string tmpl = e2e_source_file("examples/chat_templates/deepseek_v3_tools.jinja");
  ServerProcess s({"--chat-template", tmpl, "--tool-call-parser", "deepseekv3", "--api-key", "anthropic-key"});
  ASSERT_TRUE(s.running()) << s.log();
  auto r = run_command("timeout 120 " + node + " " + MLASERVE_SOURCE_DIR + "/tests/e2e/anthropic_client.mjs " +
                       std::to_string(s.port()) + " tiny-v3 anthropic-key");
  EXPECT_EQ(r.exit_code, 0) << r.output << "\n" << s.log();
  EXPECT_NE(r.output.find("all checks passed"), std::string::npos) << r.output;
}

// Greedy output is a function of the prompt alone: alone, inside a full batch, after a prefix-cache hit, and
// (ServerE2EChunked) with a small chunked-prefill size must all give the same tokens.
std::vector<int32_t> test_prompt(int salt, size_t len) {
  std::vector<int32_t> ids;
  std::mt19937 rng(1234 + salt);
  for (size_t i = 0; i < len; ++i) ids.push_back(static_cast<int32_t>(1000 + rng() % 100000));
  return ids;
}

std::vector<int32_t> greedy(int port, const std::vector<int32_t>& prompt, int n, int* cached = nullptr) {
  auto j = post_json(port, "/generate",
                     R"({"input_ids": )" + ids_json(prompt) + R"(, "sampling_params": {"max_new_tokens": )" +
                         std::to_string(n) + R"(, "temperature": 0, "ignore_eos": true}})");
  if (cached) *cached = j["meta_info"]["cached_tokens"];
  return j["output_ids"];
}

// SGLang's sessions on the real model: each turn sends its new tokens only and is answered as the whole conversation
// sent at once (greedy), its earlier turns found in the prefix cache.
TEST_F(ServerE2E, SessionTurnsAnswerAsTheWholeConversation) {
  wait_idle(port());
  const auto sid = http_request(port(), "POST", "/open_session", R"({"capacity_of_str_len": 4096})");
  ASSERT_EQ(sid.status, 200) << sid.body;
  const std::string session = json::parse(sid.body).get<std::string>();
  auto turn = [&](const std::vector<int32_t>& ids, const std::string& parent, int* cached) {
    auto j = post_json(port(), "/generate",
                       R"({"input_ids": )" + ids_json(ids) + R"(, "session_params": {"id": ")" + session + "\"" +
                           (parent.empty() ? "" : R"(, "rid": ")" + parent + "\"") +
                           R"(}, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}})");
    *cached = j["meta_info"]["cached_tokens"];
    return std::make_pair(j["meta_info"]["id"].get<std::string>(), j["output_ids"].get<std::vector<int32_t>>());
  };
  std::vector<int32_t> whole = test_prompt(31, 70);
  int cached = 0;
  auto [rid, out] = turn(whole, "", &cached);
  ASSERT_EQ(out.size(), 8u);
  EXPECT_EQ(out, greedy(port(), whole, 8));
  for (int k = 0; k < 2; ++k) {
    whole.insert(whole.end(), out.begin(), out.end());
    const std::vector<int32_t> next = test_prompt(32 + k, 20);
    whole.insert(whole.end(), next.begin(), next.end());
    std::tie(rid, out) = turn(next, rid, &cached);
    EXPECT_GE(cached, 64) << "turn " << k + 1 << ": the earlier turns' pages from the prefix cache";
    EXPECT_EQ(out, greedy(port(), whole, 8)) << "turn " << k + 1;
  }
  EXPECT_EQ(http_request(port(), "POST", "/close_session", R"({"session_id": ")" + session + "\"}").status, 200);
}

// vLLM's cache_salt and SGLang's extra_key: a request finds cached prefixes only from requests of the same salt,
// with the same answers.
TEST_F(ServerE2E, CacheSaltsKeepPrefixesApart) {
  const auto prompt = test_prompt(55, 150);
  wait_idle(port());
  ASSERT_EQ(http_request(port(), "POST", "/flush_cache").status, 200);
  auto run = [&](const std::string& salt_field) {
    const json j = post_json(port(), "/generate",
                             R"({"input_ids": )" + ids_json(prompt) + salt_field +
                                 R"(, "sampling_params": {"max_new_tokens": 4, "temperature": 0,)"
                                 R"( "ignore_eos": true}})");
    return std::make_pair(j["meta_info"]["cached_tokens"].get<int>(), j["output_ids"].get<std::vector<int32_t>>());
  };
  const auto [c1, first] = run(R"(, "cache_salt": "tenant-1")");
  EXPECT_EQ(c1, 0);
  const auto [c2, same] = run(R"(, "cache_salt": "tenant-1")");
  EXPECT_GT(c2, 0) << "the same salt shares its prefix";
  EXPECT_EQ(same, first);
  for (const char* other : {R"(, "cache_salt": "tenant-2")", "", R"(, "extra_key": "tenant-1")",
                            R"(, "cache_salt": "tenant-1", "extra_key": "x")"}) {
    const auto [c, out] = run(other);
    EXPECT_EQ(c, 0) << "another salt (or none) finds nothing: " << other;
    EXPECT_EQ(out, first) << other;
  }
  EXPECT_GT(run("").first, 0);  // the unsalted tree has it now
  // SGLang's extra_key as a list (a native batch): each prompt in its own tree.
  const json both = post_json(port(), "/generate",
                              R"({"input_ids": [)" + ids_json(prompt) + "," + ids_json(prompt) +
                                  R"(], "extra_key": ["tenant-1", "tenant-3"], "sampling_params":)"
                                  R"( {"max_new_tokens": 4, "temperature": 0, "ignore_eos": true}})");
  ASSERT_EQ(both.size(), 2u) << both.dump();
  EXPECT_GT(both[0]["meta_info"]["cached_tokens"].get<int>(), 0) << "extra_key tenant-1 cached it above";
  EXPECT_EQ(both[1]["meta_info"]["cached_tokens"], 0) << "tenant-3 has nothing yet";
  for (int i = 0; i < 2; ++i) EXPECT_EQ(both[i]["output_ids"].get<std::vector<int32_t>>(), first) << i;
  // OpenAI completions take cache_salt too; a bad one is a 400 naming it.
  const auto r = http_request(port(), "POST", "/v1/completions",
                              R"({"prompt": )" + ids_json(prompt) + R"(, "max_tokens": 1, "cache_salt": "tenant-2"})");
  EXPECT_EQ(r.status, 200) << r.body;
  for (const char* bad : {R"({"prompt": "a", "cache_salt": ""})", R"({"prompt": "a", "cache_salt": 7})"}) {
    const auto b = http_request(port(), "POST", "/v1/completions", bad);
    EXPECT_EQ(b.status, 400) << b.body;
    EXPECT_EQ(json::parse(b.body)["error"]["param"], "cache_salt") << b.body;
  }
}

// n samples of a long prompt compute it once: the first sample reads it, the others find its whole pages in the
// prefix cache.
TEST_F(ServerE2E, SamplesShareTheirPromptsPrefill) {
  const std::vector<int32_t> prompt = test_prompt(77, 150);
  auto r = post_json(port(), "/generate", R"({"input_ids": )" + ids_json(prompt) + R"(, "sampling_params":
      {"max_new_tokens": 4, "n": 4, "temperature": 0.8, "seed": 1, "ignore_eos": true}})");
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0]["meta_info"]["cached_tokens"], 0);
  for (size_t i = 1; i < 4; ++i) {
    EXPECT_GE(r[i]["meta_info"]["cached_tokens"].get<int>(), 128) << r[i]["meta_info"].dump();
    EXPECT_EQ(r[i]["output_ids"].size(), 4u);
  }
  wait_idle(port());
}

TEST_F(ServerE2E, GreedySameAloneInBatchAndWithPrefixHit) {
  const auto prompt = test_prompt(0, 150);
  wait_idle(port());
  ASSERT_EQ(http_request(port(), "POST", "/flush_cache").status, 200);
  int cached = -1;
  const auto alone = greedy(port(), prompt, 12, &cached);
  ASSERT_EQ(alone.size(), 12u);
  // Prefix-cache hit: the same prompt again.
  const auto again = greedy(port(), prompt, 12, &cached);
  EXPECT_EQ(again, alone);
  EXPECT_GT(cached, 0) << "expected a prefix-cache hit";
  // A prompt sharing the first 100 tokens, then diverging, is served partly from the cache.
  // In a full batch: 24 other requests of different lengths at the same time.
  std::vector<std::jthread> others;
  std::vector<int32_t> in_batch;
  for (int i = 0; i < 24; ++i)
    others.emplace_back([&, i] { greedy(port(), test_prompt(100 + i, 20 + 7 * i), 16); });
  std::jthread mine([&] { in_batch = greedy(port(), prompt, 12); });
  for (auto& t : others) t.join();
  mine.join();
  EXPECT_EQ(in_batch, alone);
  // Batch in one request (n prompts in one /generate).
  auto arr = post_json(port(), "/generate",
                       R"({"input_ids": [)" + ids_json(test_prompt(7, 30)) + "," + ids_json(prompt) +
                           R"(], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}})");
  ASSERT_EQ(arr.size(), 2u);
  EXPECT_EQ(arr[1]["output_ids"].get<std::vector<int32_t>>(), alone);
}

TEST_F(ServerE2E, ConcurrentStreamsWithRandomDisconnectsLeakNoPages) {
  constexpr int kStreams = 72;
  std::vector<std::jthread> threads;
  std::atomic<int> finished{0}, dropped{0}, failures{0};
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      try {
        std::mt19937 rng(i);
        HttpConnection c(port(), 120);
        const bool drop = rng() % 2 == 0;
        const int max_new = drop ? 400 : 8 + static_cast<int>(rng() % 16);
        const char* api = i % 3 == 0 ? "/v1/chat/completions" : i % 3 == 1 ? "/v1/completions" : "/generate";
        std::string body;
        const std::string text = "Request number " + std::to_string(i) + " says hello to the server.";
        if (i % 3 == 0)
          body = R"({"model": "tiny-v3", "stream": true, "max_tokens": )" + std::to_string(max_new) +
                 R"(, "ignore_eos": true, "messages": [{"role": "user", "content": ")" + text + R"("}]})";
        else if (i % 3 == 1)
          body = R"({"model": "tiny-v3", "stream": true, "max_tokens": )" + std::to_string(max_new) +
                 R"(, "ignore_eos": true, "prompt": ")" + text + R"("})";
        else
          body = R"({"stream": true, "text": ")" + text + R"(", "sampling_params": {"ignore_eos": true, "max_new_tokens": )" +
                 std::to_string(max_new) + "}}";
        c.send_request("POST", api, body);
        if (drop) {
          c.read_events(1 + rng() % 5);
          if (rng() % 2) c.reset();
          else c.close();
          ++dropped;
        } else {
          auto r = c.read_response();
          auto ev = sse_payloads(r.body);
          if (r.status == 200 && !ev.empty() && ev.back() == "[DONE]") {
            ++finished;
          } else {
            ++failures;
            ADD_FAILURE() << "stream " << i << ": HTTP " << r.status << " " << r.body.substr(0, 300);
          }
        }
      } catch (const std::exception& e) {
        ++failures;
        ADD_FAILURE() << "stream " << i << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(finished.load() + dropped.load(), kStreams);
  json st = wait_idle(port());
  // Only the prefix cache may hold pages now; flushing it frees everything. (Polled: the last aborts may land
  // a step after the request counters drop; a leak stays.)
  auto no_leak = [](const json& s) {
    return s["kv_tokens_free"].get<int64_t>() ==
           s["kv_tokens_total"].get<int64_t>() - s["kv_tokens_cached"].get<int64_t>();
  };
  for (int k = 0; k < 100 && !no_leak(st); ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    st = get_json(port(), "/get_server_info")["internal_states"][0];
  }
  EXPECT_TRUE(no_leak(st)) << st.dump();
  // /flush_cache refuses (400) while the engine still holds a request; the stats may trail it by a step.
  int flush_status = 0;
  for (int k = 0; k < 100 && flush_status != 200; ++k) {
    flush_status = http_request(port(), "POST", "/flush_cache").status;
    if (flush_status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(flush_status, 200);
  st = get_json(port(), "/get_server_info")["internal_states"][0];
  EXPECT_EQ(st["kv_tokens_free"], st["kv_tokens_total"]) << st.dump();
  EXPECT_EQ(st["kv_tokens_cached"], 0) << st.dump();
  auto metrics = http_request(port(), "GET", "/metrics").body;
  EXPECT_NE(metrics.find("mlaserve:aborted_requests_total"), std::string::npos);
}

TEST_F(ServerE2E, StopStringsOnRealTokens) {
  // Find what greedy decoding says, then stop on a string that straddles two tokens of it.
  auto j = post_json(port(), "/generate",
                     R"({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}})");
  const std::string full = j["text"];
  ASSERT_GE(full.size(), 6u);
  std::vector<std::string> pieces;
  // Text of the first 3 tokens alone, then a stop string that starts inside it and runs past it.
  auto first3 = post_json(port(), "/generate",
                          R"({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": true}})");
  const std::string prefix = first3["text"];
  ASSERT_LT(prefix.size(), full.size());
  ASSERT_GE(prefix.size(), 1u);
  // The last character of the first 3 tokens' text and the next character: straddles tokens 3 and 4.
  auto is_cont = [&](size_t i) { return (static_cast<unsigned char>(full[i]) & 0xC0) == 0x80; };
  size_t start = prefix.size() - 1;
  while (start > 0 && is_cont(start)) --start;
  size_t end = prefix.size() + 1;
  while (end < full.size() && is_cont(end)) ++end;
  ASSERT_LE(end, full.size());
  const std::string stop = full.substr(start, end - start);
  const size_t first = full.find(stop);
  for (bool stream : {false, true}) {
    auto r = http_request(port(), "POST", "/generate",
                          R"({"text": "Once upon a time", "stream": )" + std::string(stream ? "true" : "false") +
                              R"(, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true, "stop": )" +
                              json(stop).dump() + "}}");
    ASSERT_EQ(r.status, 200);
    json out;
    if (stream) {
      auto ev = sse_payloads(r.body);
      ASSERT_GE(ev.size(), 2u);
      for (const auto& e : ev) {
        if (e != "[DONE]") {
          EXPECT_EQ(json::parse(e)["text"].get<std::string>().find(stop), std::string::npos);
        }
      }
      out = json::parse(ev[ev.size() - 2]);
    } else {
      out = json::parse(r.body);
    }
    EXPECT_EQ(out["text"], full.substr(0, first)) << "stop=" << json(stop).dump();
    EXPECT_EQ(out["meta_info"]["finish_reason"]["type"], "stop");
    EXPECT_EQ(out["meta_info"]["finish_reason"]["matched"], stop);
  }
  // OpenAI: the same stop, kept in the text on request (vLLM's include_stop_str_in_output).
  auto c = post_json(port(), "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
      "ignore_eos": true, "include_stop_str_in_output": true, "stop": )" + json(stop).dump() + "}");
  EXPECT_EQ(c["choices"][0]["text"], full.substr(0, first) + stop);
  EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
  // SGLang's stop_regex (the same string, escaped): the output runs to the end of the first token whose text holds a
  // match, kept whole.
  std::string pattern;
  for (char ch : stop) {
    if (static_cast<unsigned char>(ch) < 0x80 && !std::isalnum(static_cast<unsigned char>(ch))) pattern += '\\';
    pattern += ch;
  }
  std::string until;  // the text of the fewest greedy tokens that holds the string
  for (int k = 1; k <= 12 && until.find(stop) == std::string::npos; ++k)
    until = post_json(port(), "/generate", R"({"text": "Once upon a time", "sampling_params": {"max_new_tokens": )" +
                                               std::to_string(k) + R"(, "temperature": 0, "ignore_eos": true}})")["text"];
  auto rx = post_json(port(), "/generate", R"({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12,
      "temperature": 0, "ignore_eos": true, "stop_regex": )" + json(pattern).dump() + "}}");
  EXPECT_EQ(rx["text"], until) << "stop_regex=" << json(pattern).dump();
  EXPECT_EQ(rx["meta_info"]["finish_reason"]["matched"], pattern);
  wait_idle(port());
}

// logit_bias through the native and the OpenAI API; min_new_tokens / min_tokens: a stop string in the first tokens'
// text is not looked for there (and the output runs on past it).
TEST_F(ServerE2E, LogitBiasAndMinTokens) {
  auto g = post_json(port(), "/generate", R"({"text": "Once upon a time",
      "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}})");
  const std::vector<int32_t> ids = g["output_ids"];
  const std::string full = g["text"];
  ASSERT_EQ(ids.size(), 8u);
  const int32_t forced = ids[0] == 300 ? 301 : 300;
  auto n = post_json(port(), "/generate", R"({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4,
      "temperature": 0, "ignore_eos": true, "logit_bias": {")" + std::to_string(forced) + R"(": 100}}})");
  EXPECT_EQ(n["output_ids"], json(std::vector<int32_t>(4, forced)));
  auto c = post_json(port(), "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0,
      "logit_bias": {")" + std::to_string(ids[0]) + R"(": -100}})");
  const std::string banned_text = c["choices"][0]["text"];
  EXPECT_NE(banned_text.substr(0, std::min(banned_text.size(), full.size())), full.substr(0, banned_text.size()))
      << "the greedy first token was not replaced";

  auto first = post_json(port(), "/generate",
                         R"({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})");
  const std::string stop = first["text"];  // the first token's text: the output's first piece
  ASSERT_FALSE(stop.empty());
  auto plain = post_json(port(), "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 8,
      "temperature": 0, "ignore_eos": true, "stop": )" + json(stop).dump() + "}");
  EXPECT_EQ(plain["choices"][0]["text"], "");
  EXPECT_EQ(plain["choices"][0]["finish_reason"], "stop");
  auto held = post_json(port(), "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 8,
      "temperature": 0, "ignore_eos": true, "min_tokens": 3, "stop": )" + json(stop).dump() + "}");
  const std::string text = held["choices"][0]["text"];
  EXPECT_EQ(text.substr(0, stop.size()), stop);  // the first piece stays
  EXPECT_GE(held["usage"]["completion_tokens"].get<int>(), 3);
  wait_idle(port());
}

// vLLM's allowed_token_ids and bad_words on the real tokenizer: sampled outputs only from the allowed set; with
// " cat" and " dog" allowed and the word "cat" bad, every token is " dog" (the word is banned in its spaced spelling
// too); a two-token bad word bans its second token right after its first; bad ids are a 400 naming the field.
TEST_F(ServerE2E, AllowedTokenIdsAndBadWords) {
  auto sentence = post_json(port(), "/tokenize", R"({"prompt": "the cat sat on a mat", "add_special_tokens": false})");
  const std::vector<int32_t> set = sentence["tokens"];
  for (int seed = 0; seed < 3; ++seed) {
    auto g = post_json(port(), "/generate", R"({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8,
        "temperature": 1.0, "ignore_eos": true, "seed": )" + std::to_string(seed) + R"(, "allowed_token_ids": )" +
                                                json(set).dump() + "}}");
    const std::vector<int32_t> out = g["output_ids"];
    EXPECT_EQ(out.size(), 8u);
    for (int32_t id : out) EXPECT_NE(std::find(set.begin(), set.end(), id), set.end()) << id;
  }
  const std::vector<int32_t> pets = post_json(port(), "/tokenize", R"({"prompt": " cat dog",
      "add_special_tokens": false})")["tokens"];
  ASSERT_EQ(pets.size(), 2u);
  auto c = post_json(port(), "/v1/completions", R"({"prompt": "My pet is a", "max_tokens": 5, "temperature": 0.7,
      "ignore_eos": true, "allowed_token_ids": )" + json(pets).dump() + R"(, "bad_words": ["cat"]})");
  EXPECT_EQ(c["choices"][0]["text"], " dog dog dog dog dog");

  // " cat" biased to win, the two-token word "cat cat" bad: " cat" may not follow " cat", so " dog" comes between.
  auto alt = post_json(port(), "/v1/completions", R"({"prompt": "My pet is a", "max_tokens": 5, "temperature": 0,
      "ignore_eos": true, "allowed_token_ids": )" + json(pets).dump() + R"(, "logit_bias": {")" +
                                                    std::to_string(pets[0]) + R"(": 50}, "bad_words": ["cat cat"]})");
  EXPECT_EQ(alt["choices"][0]["text"], " cat dog cat dog cat");
  auto bad = http_request(port(), "POST", "/v1/completions", R"({"prompt": "a", "max_tokens": 2,
      "allowed_token_ids": [1, 999999999]})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("allowed_token_ids"), std::string::npos) << bad.body;
  wait_idle(port());
}

// SGLang's token_ids_logprob on /generate: per position [logprob, id, text] of each id asked for, the generated
// token's equal to its own logprob, the prompt positions' too from logprob_start_len (null at position 0); in a batch
// one list per prompt.
TEST_F(ServerE2E, TokenIdsLogprob) {
  auto g = post_json(port(), "/generate", R"({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4,
      "temperature": 0, "ignore_eos": true}})");
  const std::vector<int32_t> out = g["output_ids"];
  ASSERT_EQ(out.size(), 4u);
  const std::vector<int32_t> asked{out[0], 11, out[2]};
  auto r = post_json(port(), "/generate", R"({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4,
      "temperature": 0, "ignore_eos": true}, "return_logprob": true, "logprob_start_len": 0,
      "return_text_in_logprobs": true, "token_ids_logprob": )" + json(asked).dump() + "}");
  EXPECT_EQ(r["output_ids"], g["output_ids"]);
  const json& meta = r["meta_info"];
  ASSERT_EQ(meta["output_token_ids_logprobs"].size(), 4u) << meta.dump();
  for (size_t t = 0; t < 4; ++t) {
    const json& at = meta["output_token_ids_logprobs"][t];
    ASSERT_EQ(at.size(), asked.size());
    for (size_t k = 0; k < asked.size(); ++k) {
      EXPECT_EQ(at[k][1], asked[k]);
      EXPECT_LE(at[k][0].get<double>(), 0.0);
      EXPECT_TRUE(at[k][2].is_string());
      if (asked[k] == out[t]) {
        EXPECT_NEAR(at[k][0].get<double>(), meta["output_token_logprobs"][t][0].get<double>(), 1e-5) << t;
      }
    }
  }
  const json& in = meta["input_token_ids_logprobs"];
  ASSERT_EQ(in.size(), meta["input_token_logprobs"].size());
  EXPECT_TRUE(in[0].is_null());
  for (size_t i = 1; i < in.size(); ++i) {
    ASSERT_EQ(in[i].size(), asked.size());
    const json& tok = meta["input_token_logprobs"][i];
    for (size_t k = 0; k < asked.size(); ++k) {
      if (asked[k] == tok[1].get<int32_t>()) {
        EXPECT_NEAR(in[i][k][0].get<double>(), tok[0].get<double>(), 1e-5);
      }
    }
  }
  auto batch = post_json(port(), "/generate", R"({"text": ["Once upon a time", "Hello"], "sampling_params":
      {"max_new_tokens": 2}, "return_logprob": true, "token_ids_logprob": [[5], [6, 7]]})");
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_EQ(batch[0]["meta_info"]["output_token_ids_logprobs"][0].size(), 1u);
  EXPECT_EQ(batch[1]["meta_info"]["output_token_ids_logprobs"][1].size(), 2u);
  EXPECT_EQ(batch[1]["meta_info"]["output_token_ids_logprobs"][1][1][1], 7);
  auto none = post_json(port(), "/generate", R"({"text": "Hi", "sampling_params": {"max_new_tokens": 1},
      "return_logprob": true})");
  EXPECT_FALSE(none["meta_info"].contains("output_token_ids_logprobs"));
  wait_idle(port());
}

// `mlaserve run-batch` (vLLM's offline batch): a file mixing chat and completions requests (and a bad one) answered
// into one file in the input's order, each answer what the server gives the same request (greedy, same dummy
// weights); a file with a line that is not a request exits non-zero naming the line.
TEST_F(ServerE2E, RunBatchAnswersAsTheServer) {
  // Per process: the test's layout variants run at once under ctest -j.
  const std::string dir = ::testing::TempDir(), pid = std::to_string(::getpid());
  const std::string in = dir + "/mlaserve_batch_in_" + pid + ".jsonl";
  const std::string out = dir + "/mlaserve_batch_out_" + pid + ".jsonl";
  const std::string chat =
      R"({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5, "temperature": 0})";
  const std::string completion = R"({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0})";
  {
    std::ofstream f(in);
    f << R"({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": )" << chat << "}\n"
      << R"({"custom_id": "p1", "method": "POST", "url": "/v1/completions", "body": )" << completion << "}\n"
      << R"({"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 0}})" << "\n"
      << R"({"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions", "body": )" << chat << "}\n";
  }
  const std::string cmd = mlaserve_cmd(300) + " run-batch -i " + in +
                          " -o " + out + " --model-path " + e2e_model_dir() + " --tokenizer-path " +
                          deepseek_tokenizer_dir() + " --load-format dummy --device " +
                          e2e_env("MLASERVE_E2E_DEVICE", "cpu") +
                          " --max-total-tokens 4096 --mem-fraction-static 0.05";  // beside the suite's server on a GPU
  auto r = run_command(cmd);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream f(out);
  std::vector<json> lines;
  for (std::string l; std::getline(f, l);) lines.push_back(json::parse(l));
  ASSERT_EQ(lines.size(), 4u);
  const std::vector<std::string> ids{"c1", "p1", "bad", "c2"};
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(lines[i]["custom_id"], ids[i]);
  const json direct_chat = post_json(port(), "/v1/chat/completions", chat);
  const json direct_completion = post_json(port(), "/v1/completions", completion);
  EXPECT_EQ(lines[0]["response"]["body"]["choices"][0]["message"]["content"],
            direct_chat["choices"][0]["message"]["content"]);
  EXPECT_EQ(lines[3]["response"]["body"]["choices"][0]["message"]["content"],
            direct_chat["choices"][0]["message"]["content"]);
  EXPECT_EQ(lines[1]["response"]["body"]["choices"][0]["text"], direct_completion["choices"][0]["text"]);
  EXPECT_EQ(lines[2]["response"]["status_code"], 400);
  EXPECT_EQ(lines[2]["response"]["body"]["error"]["param"], "n");
  {
    std::ofstream bad(in);
    bad << R"({"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}})" << "\n"
        << "not json\n";
  }
  r = run_command(cmd);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("line 2"), std::string::npos) << r.output;
  {
    std::ofstream twice(in);  // one custom_id for two endpoints' requests
    twice << R"({"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}})" << "\n"
          << R"({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": )" << chat << "}\n";
  }
  r = run_command(cmd);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("custom_id 'c1' appears twice"), std::string::npos) << r.output;
  {
    std::ofstream elsewhere(in);  // an endpoint the batch does not serve, named with its line
    elsewhere << R"({"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}})" << "\n"
              << R"({"custom_id": "e1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}})" << "\n";
  }
  r = run_command(cmd);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("line 2: url '/v1/embeddings' is not"), std::string::npos) << r.output;
  std::filesystem::remove(in);
  std::filesystem::remove(out);
  wait_idle(port());
}

// A thinking budget on the real tokenizer: a prompt ending in "<think>" gets `budget` tokens of the model, then the
// tokens of "</think>" as the tokenizer spells them; combined with structured output it is a 400.
TEST_F(ServerE2E, ThinkingBudgetEndsTheThinking) {
  const std::vector<int32_t> end = post_json(port(), "/tokenize", R"({"prompt": "</think>",
      "add_special_tokens": false})")["tokens"];
  ASSERT_FALSE(end.empty());
  auto g = post_json(port(), "/generate", R"({"text": "Question: why?<think>", "sampling_params": {"max_new_tokens":
      12, "temperature": 0.8, "seed": 4, "ignore_eos": true, "thinking_budget": 4}})");
  const std::vector<int32_t> out = g["output_ids"];
  ASSERT_EQ(out.size(), 12u);
  EXPECT_EQ(std::vector<int32_t>(out.begin() + 4, out.begin() + 4 + static_cast<int64_t>(end.size())), end);
  auto c = post_json(port(), "/v1/completions", R"({"prompt": "Q<think>", "max_tokens": 8, "temperature": 0,
      "ignore_eos": true, "thinking_token_budget": 0})");
  EXPECT_EQ(c["choices"][0]["text"].get<std::string>().substr(0, 8), "</think>");
  auto bad = http_request(port(), "POST", "/generate", R"({"text": "a", "sampling_params": {"thinking_budget": 3,
      "regex": "[a-z]+"}})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("thinking_budget"), std::string::npos) << bad.body;
  wait_idle(port());
}

// vLLM's /tokenize and /detokenize: the ids the server would feed the model (text: with BOS unless
// add_special_tokens is false; messages: the chat template), and back.
TEST_F(ServerE2E, TokenizeAndDetokenize) {
  const std::string text = "Once upon a time";
  auto g = post_json(port(), "/generate", R"({"text": ")" + text + R"(", "sampling_params": {"max_new_tokens": 1}})");
  auto t = post_json(port(), "/tokenize", R"({"prompt": ")" + text + R"("})");
  EXPECT_EQ(t["count"], g["meta_info"]["prompt_tokens"]);
  ASSERT_EQ(t["tokens"].size(), t["count"].get<size_t>());
  EXPECT_GT(t["max_model_len"].get<int64_t>(), 0);
  auto plain = post_json(port(), "/tokenize", R"({"prompt": ")" + text + R"(", "add_special_tokens": false})");
  EXPECT_EQ(plain["count"].get<size_t>() + 1, t["count"].get<size_t>());
  auto d = post_json(port(), "/detokenize", R"({"tokens": )" + plain["tokens"].dump() + "}");
  EXPECT_EQ(d["prompt"], text);
  // vLLM's return_token_strs: the vocabulary's strings (byte-level: a space is "Ġ"), the BOS's name first.
  auto strs = post_json(port(), "/tokenize", R"({"prompt": ")" + text + R"(", "return_token_strs": true})");
  ASSERT_EQ(strs["token_strs"].size(), t["count"].get<size_t>());
  EXPECT_EQ(strs["token_strs"][0], "<｜begin▁of▁sentence｜>");
  std::string joined;
  for (size_t i = 1; i < strs["token_strs"].size(); ++i) joined += strs["token_strs"][i].get<std::string>();
  EXPECT_EQ(std::regex_replace(joined, std::regex("Ġ"), " "), text);
  EXPECT_FALSE(t.contains("token_strs"));
  const std::string msgs = R"({"messages": [{"role": "user", "content": "Hi there"}])";
  auto c = post_json(port(), "/v1/chat/completions", msgs + R"(, "max_tokens": 1})");
  auto tc = post_json(port(), "/tokenize", msgs + "}");
  EXPECT_EQ(tc["count"], c["usage"]["prompt_tokens"]);
  // continue_final_message: DeepSeek's template closes an assistant message with <｜end▁of▁sentence｜> (id 1); a
  // continued one stops right after its content.
  const std::string open = R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content":
      "Once upon"}], "add_generation_prompt": false)";
  auto closed = post_json(port(), "/tokenize", open + "}");
  ASSERT_EQ(closed["tokens"].back(), 1);
  auto cont = post_json(port(), "/v1/chat/completions", open + R"(, "continue_final_message": true, "max_tokens": 1})");
  EXPECT_EQ(cont["usage"]["prompt_tokens"].get<int>() + 1, closed["count"].get<int>());
  EXPECT_EQ(http_request(port(), "POST", "/detokenize", R"({"tokens": [-1]})").status, 400);
  EXPECT_EQ(http_request(port(), "POST", "/tokenize", R"({})").status, 400);
  EXPECT_EQ(http_request(port(), "GET", "/tokenize").status, 405);
  wait_idle(port());
}

// Completions `suffix` is DeepSeek's fill in the middle: the same tokens and greedy text as the prompt written with
// the FIM markers as text (they are special tokens), for a text prompt and for its token ids (BOS first); an empty
// suffix is a plain completion.
TEST_F(ServerE2E, SuffixIsDeepSeekFillInTheMiddle) {
  const std::string pre = R"(def add(a, b):\n    return)", post = R"(\n\nprint(add(1, 2))\n)";
  const std::string tail = R"(, "max_tokens": 6, "temperature": 0})";
  auto fim = post_json(port(), "/v1/completions", R"({"prompt": ")" + pre + R"(", "suffix": ")" + post + "\"" + tail);
  const std::string marked = "<｜fim▁begin｜>" + pre + "<｜fim▁hole｜>" + post + "<｜fim▁end｜>";
  auto want = post_json(port(), "/v1/completions", R"({"prompt": ")" + marked + "\"" + tail);
  auto t = post_json(port(), "/tokenize", R"({"prompt": ")" + marked + R"("})");
  EXPECT_EQ(fim["usage"]["prompt_tokens"], want["usage"]["prompt_tokens"]);
  EXPECT_EQ(fim["usage"]["prompt_tokens"], t["count"]);
  EXPECT_EQ(fim["choices"][0]["text"], want["choices"][0]["text"]);
  auto ids = post_json(port(), "/tokenize", R"({"prompt": ")" + pre + R"("})")["tokens"];
  auto by_ids = post_json(port(), "/v1/completions",
                          R"({"prompt": )" + ids.dump() + R"(, "suffix": ")" + post + "\"" + tail);
  EXPECT_EQ(by_ids["usage"]["prompt_tokens"], t["count"]);
  EXPECT_EQ(by_ids["choices"][0]["text"], want["choices"][0]["text"]);
  auto plain = post_json(port(), "/v1/completions", R"({"prompt": ")" + pre + R"(", "suffix": "")" + tail);
  EXPECT_EQ(plain["usage"]["prompt_tokens"], ids.size());
  wait_idle(port());
}

// Structured output on the real tokenizer (byte-level tokens, some holding part of a UTF-8 character): SGLang's
// regex on /generate and on completions (n = 3) with a finite language always ends with a whole match; a chat answer
// under response_format json_schema / json_object is always a prefix of its language, and JSON of the schema when
// the model ended it; an integer schema's multipleOf holds; a bad pattern is a 400 naming the field.
TEST_F(ServerE2E, StructuredOutputsFollowTheirConstraints) {
  const std::string re = "(red|green|blue|[αβγ]{2}) [0-9]{1,2}!";
  structured::Dfa dfa(structured::compile_regex(re));
  for (int seed = 0; seed < 3; ++seed) {
    json body = {{"text", "Pick a colour and a number:"},
                 {"sampling_params", {{"max_new_tokens", 30}, {"temperature", 0.8}, {"seed", seed}, {"regex", re}}}};
    auto g = post_json(port(), "/generate", body.dump());
    EXPECT_TRUE(dfa.matches(g["text"].get<std::string>())) << g["text"];
    EXPECT_EQ(g["meta_info"]["finish_reason"]["type"], "stop") << g.dump();
  }
  // JSON Schema's multipleOf (SGLang's json_schema): a finite language, so every answer ends, a multiple of 7 within
  // the bounds.
  const std::string sevens = R"({"type": "integer", "multipleOf": 7, "minimum": 10, "maximum": 9999})";
  for (int seed = 0; seed < 4; ++seed) {
    json body = {{"text", "A number:"},
                 {"sampling_params",
                  {{"max_new_tokens", 8}, {"temperature", 1.0}, {"seed", seed}, {"json_schema", sevens}}}};
    auto g = post_json(port(), "/generate", body.dump());
    const std::string t = g["text"].get<std::string>();
    ASSERT_EQ(g["meta_info"]["finish_reason"]["type"], "stop") << g.dump();
    ASSERT_TRUE(!t.empty() && t.size() <= 4 && t.find_first_not_of("0123456789") == std::string::npos) << t;
    const int v = std::stoi(t);
    EXPECT_TRUE(v % 7 == 0 && v >= 10 && v <= 9999) << t;
  }
  // The same language as an EBNF grammar (SGLang's ebnf; vLLM's guided_grammar on completions).
  const std::string grammar =
      "root ::= colour \" \" [0-9]{1,2} \"!\"\ncolour ::= \"red\" | \"green\" | \"blue\" | [αβγ]{2}";
  for (int seed = 0; seed < 2; ++seed) {
    json body = {{"text", "Pick a colour and a number:"},
                 {"sampling_params",
                  {{"max_new_tokens", 30}, {"temperature", 0.8}, {"seed", seed}, {"ebnf", grammar}}}};
    auto g = post_json(port(), "/generate", body.dump());
    EXPECT_TRUE(dfa.matches(g["text"].get<std::string>())) << g["text"];
    EXPECT_EQ(g["meta_info"]["finish_reason"]["type"], "stop") << g.dump();
  }
  json gc = {{"prompt", "Pick:"}, {"guided_grammar", grammar}, {"max_tokens", 30}, {"temperature", 1.0}};
  EXPECT_TRUE(dfa.matches(post_json(port(), "/v1/completions", gc.dump())["choices"][0]["text"].get<std::string>()));
  json c = {{"prompt", "Pick:"}, {"regex", re}, {"n", 3}, {"max_tokens", 30}, {"temperature", 1.0}};
  auto cr = post_json(port(), "/v1/completions", c.dump());
  ASSERT_EQ(cr["choices"].size(), 3u);
  for (const auto& ch : cr["choices"]) {
    EXPECT_TRUE(dfa.matches(ch["text"].get<std::string>())) << ch["text"];
    EXPECT_EQ(ch["finish_reason"], "stop");
  }
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {"colour": {"enum": ["red", "green"]},
      "n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["colour"]})");  // n, ok optional
  for (const ojson& rf : {ojson{{"type", "json_schema"}, {"json_schema", {{"name", "pick"}, {"schema", schema}}}},
                          ojson{{"type", "json_object"}}}) {
    const bool with_schema = rf["type"] == "json_schema";
    structured::Dfa d(structured::compile_regex(with_schema ? structured::json_schema_regex(schema)
                                                            : structured::json_object_regex()));
    for (double temperature : {0.0, 1.0}) {
      ojson req = {{"messages", {{{"role", "user"}, {"content", "Answer in JSON."}}}}, {"max_tokens", 40},
                   {"temperature", temperature}, {"seed", 3}, {"response_format", rf}};
      auto r = post_json(port(), "/v1/chat/completions", req.dump());
      const std::string content = r["choices"][0]["message"]["content"].get<std::string>();
      EXPECT_GE(d.walk(0, content), 0) << content;
      if (r["choices"][0]["finish_reason"] == "stop") {
        EXPECT_TRUE(d.matches(content)) << content;
        const json doc = json::parse(content);
        if (with_schema) {
          EXPECT_TRUE(doc["colour"] == "red" || doc["colour"] == "green") << content;
        }
      }
    }
  }
  // A structural tag whose trigger is the letter e (in many of the vocabulary's tokens, so random weights write it):
  // free text without an e, and after each e the rest of "e<n>", an integer, "</n>"; at least one call writes one.
  const ojson tag = ojson::parse(R"({"type": "structural_tag", "structures": [{"begin": "e<n>",
      "schema": {"type": "integer"}, "end": "</n>"}], "triggers": ["e"]})");
  const std::string number = structured::json_schema_regex(tag["structures"][0]["schema"]);
  structured::Dfa td(structured::compile_regex("((?~e)e<n>(" + number + ")</n>)*(?~e)"));
  int tagged = 0;
  for (int seed = 0; seed < 3; ++seed) {
    ojson req = {{"messages", {{{"role", "user"}, {"content", "Tag the numbers."}}}}, {"max_tokens", 60},
                 {"temperature", 1.0}, {"seed", seed}, {"response_format", tag}};
    auto r = post_json(port(), "/v1/chat/completions", req.dump());
    const std::string content = r["choices"][0]["message"]["content"].get<std::string>();
    EXPECT_GE(td.walk(0, content), 0) << content;
    if (r["choices"][0]["finish_reason"] == "stop") {
      EXPECT_TRUE(td.matches(content)) << content;
    }
    tagged += content.find("e<n>") != std::string::npos;
  }
  EXPECT_GT(tagged, 0);
  auto bad = post_json(port(), "/generate", R"({"text": "a", "sampling_params": {"regex": "(a"}})", 400);
  EXPECT_EQ(bad["error"]["param"], "sampling_params.regex");
  bad = post_json(port(), "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string",
      "pattern": "(a"}}}})", 400);  // a schema's pattern: checked where the server builds the automaton
  EXPECT_EQ(bad["error"]["param"], "response_format.json_schema.schema");
  wait_idle(port());
}

// Prompt logprobs on real tokens, over chunks of 64 (the suite's chunked prefill): completions echo + logprobs gives
// at position i the distribution a request of the first i tokens gets for its first token (same top-3, same values),
// and the native API the same from logprob_start_len on; a start past the prompt is a 400.
TEST_F(ServerE2E, PromptLogprobsAreTheNextTokenDistributions) {
  std::string text;
  for (int i = 0; i < 12; ++i) text += "The quick brown fox jumps over the lazy dog number " + std::to_string(i) + ". ";
  const std::vector<int32_t> ids = post_json(port(), "/tokenize", R"({"prompt": ")" + text + R"("})")["tokens"];
  ASSERT_GT(ids.size(), 70u);
  auto echo = post_json(port(), "/v1/completions", R"({"prompt": )" + ids_json(ids) +
                                                        R"(, "max_tokens": 1, "echo": true, "logprobs": 3})");
  const json lp = echo["choices"][0]["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), ids.size() + 1);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t i : {size_t{1}, size_t{5}, size_t{63}, size_t{64}, size_t{70}, ids.size() - 1}) {
    SCOPED_TRACE("position " + std::to_string(i));
    const std::vector<int32_t> head(ids.begin(), ids.begin() + static_cast<int64_t>(i));
    auto one = post_json(port(), "/v1/completions", R"({"prompt": )" + ids_json(head) +
                                                       R"(, "max_tokens": 1, "temperature": 0, "logprobs": 3})");
    const json want = one["choices"][0]["logprobs"]["top_logprobs"][0], got = lp["top_logprobs"][i];
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [tok, v] : want.items()) {
      ASSERT_TRUE(got.contains(tok)) << tok;
      EXPECT_NEAR(got[tok].get<double>(), v.get<double>(), 1e-3) << tok;
    }
    EXPECT_LE(lp["token_logprobs"][i].get<double>(), 0.0);
  }
  auto native = post_json(port(), "/generate", R"({"input_ids": )" + ids_json(ids) +
                                                   R"(, "sampling_params": {"max_new_tokens": 0}, "return_logprob": true,
                                                     "logprob_start_len": 60})");
  const json in = native["meta_info"]["input_token_logprobs"];
  ASSERT_EQ(in.size(), ids.size() - 60);
  for (size_t k = 0; k < in.size(); ++k) {
    EXPECT_EQ(in[k][1], ids[60 + k]);
    EXPECT_NEAR(in[k][0].get<double>(), lp["token_logprobs"][60 + k].get<double>(), 1e-3) << k;
  }
  EXPECT_TRUE(native["output_ids"].empty());
  // vLLM's prompt_logprobs: the same logprobs, each token's rank (1 where it is the most likely).
  auto v = post_json(port(), "/v1/completions", R"({"prompt": )" + ids_json(ids) +
                                                    R"(, "max_tokens": 1, "prompt_logprobs": 2})");
  const json pl = v["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(pl.size(), ids.size());
  EXPECT_TRUE(pl[0].is_null());
  for (size_t i = 1; i < ids.size(); ++i) {
    const json& e = pl[i][std::to_string(ids[i])];
    EXPECT_NEAR(e["logprob"].get<double>(), lp["token_logprobs"][i].get<double>(), 1e-3) << i;
    double top = -1e30;  // the most likely token's logprob (the echo request's top 3)
    for (const auto& [k, val] : lp["top_logprobs"][i].items()) top = std::max(top, val.get<double>());
    EXPECT_EQ(e["rank"].get<int>() == 1, e["logprob"].get<double>() >= top - 1e-6) << i;
    EXPECT_LE(pl[i].size(), 3u);
  }
  auto bad = http_request(port(), "POST", "/generate",
                          R"({"input_ids": [1, 2, 3], "return_logprob": true, "logprob_start_len": 3})");
  EXPECT_EQ(bad.status, 400) << bad.body;
  EXPECT_NE(bad.body.find("logprob_start_len"), std::string::npos) << bad.body;
  wait_idle(port());
}

TEST_F(ServerE2E, BadRequestsGet4xx) {
  struct Case {
    std::string path, body;
    int status;
  };
  const std::string long_prompt = "[" + [] {
    std::string s;
    for (int i = 0; i < 6000; ++i) s += fmt::format("{}{}", i ? "," : "", 1000 + i);
    return s;
  }() + "]";
  const std::vector<Case> cases = {
      {"/generate", "{oops", 400},
      {"/generate", R"({"text": ["a", 3]})", 400},
      {"/generate", R"({"text": "a", "sampling_params": {"max_new_tokens": "10"}})", 400},
      {"/generate", R"({"text": "a", "sampling_params": {"temperature": -0.5}})", 400},
      {"/generate", R"({"text": "a", "sampling_params": {"top_k": -3}})", 400},
      {"/generate", R"({"text": "a", "sampling_params": {"max_new_tokens": 99999999}})", 400},
      {"/generate", R"({"text": "a", "sampling_params": {"n": 1000000}})", 400},
      {"/generate", R"({"input_ids": )" + long_prompt + "}", 400},
      {"/generate", R"({"input_ids": [5, 999999999]})", 400},
      {"/v1/completions", R"({"model": "gpt-4o", "prompt": "x"})", 404},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": -4})", 400},
      {"/v1/completions", R"({"prompt": "x", "presence_penalty": 99})", 400},
      {"/v1/completions", R"({"prompt": "x", "logit_bias": {"999999999": 5}})", 400},
      {"/v1/completions", R"({"prompt": "x", "logit_bias": {"5": 500}})", 400},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 2, "min_tokens": 9})", 400},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                   "min_tokens": 9})", 400},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": 1}]})", 400},
      {"/v1/chat/completions", R"({"messages": "hi"})", 400},
      {"/v1/chat/completions", R"({"model": "tiny-v3", "messages": [{"role": "user", "content": "x"}], "top_p": -1})", 400},
  };
  for (const auto& c : cases) {
    auto r = http_request(port(), "POST", c.path, c.body);
    EXPECT_EQ(r.status, c.status) << c.body.substr(0, 200) << " -> " << r.body;
    auto j = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << r.body;
    for (const char* k : {"message", "type", "param", "code"}) EXPECT_TRUE(j["error"].contains(k)) << r.body;
  }
  EXPECT_EQ(http_request(port(), "GET", "/nothing-here").status, 404);
  wait_idle(port());
}

TEST_F(ServerE2E, BenchServingPrintsTheMetricBlock) {
  for (const char* backend : {"sglang", "sglang-oai", "sglang-oai-chat"}) {
    const std::string out_file = (std::filesystem::temp_directory_path() /
                                  ("mlaserve_bench_" + std::to_string(::getpid()) + "_" + backend + ".jsonl"))
                                     .string();
    std::filesystem::remove(out_file);
    auto r = run_command(mlaserve_cmd(300) + " bench-serving --backend " + backend +
                         " --host 127.0.0.1 --port " + std::to_string(port()) +
                         " --dataset-name random --random-input 48 --random-output 8 --random-range-ratio 1"
                         " --num-prompts 24 --max-concurrency 12 --seed 3 --output-file " + out_file);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    for (const char* line :
         {"============ Serving Benchmark Result ============", "Backend:", "Traffic request rate:", "inf",
          "Successful requests:                     24", "Benchmark duration (s):",
          "Total input tokens:                      1152", "Total generated tokens:                  192",
          "Request throughput (req/s):", "Input token throughput (tok/s):", "Output token throughput (tok/s):",
          "Total token throughput (tok/s):", "Concurrency:", "Mean E2E Latency (ms):", "Median E2E Latency (ms):",
          "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean ITL (ms):", "Median ITL (ms):",
          "P95 ITL (ms):", "P99 ITL (ms):", "Max ITL (ms):", "Mean TPOT (ms):", "Median TPOT (ms):",
          "P99 TPOT (ms):"})
      EXPECT_NE(r.output.find(line), std::string::npos) << backend << ": missing '" << line << "'\n" << r.output;
    auto lines = read_text(out_file);
    auto j = json::parse(lines.substr(0, lines.find('\n')));
    EXPECT_EQ(j["completed"], 24);
    EXPECT_EQ(j["total_output_tokens"], 192);
    // The texts came through (the native stream's cumulative payloads are parsed in full only at the end).
    EXPECT_GT(j["total_output_tokens_retokenized"].get<int64_t>(), 120) << backend;
    EXPECT_GT(j["mean_ttft_ms"].get<double>(), 0.0);
    std::filesystem::remove(out_file);
  }
  wait_idle(port());
}

// bench-serving's generated-shared-prefix dataset (SGLang's) against a server of two DP-attention groups, one request
// at a time: groups x prompts-per-group requests, each group's prompts starting with its system prompt. With
// cache_aware each system prompt is computed on one group only (the later prompts of its group find it cached there);
// round_robin sends them to both groups. (The cache_aware server runs SGLang's --schedule-policy lpm too.)
TEST(ServerE2EVariants, SharedPrefixBenchAndCacheAwareRouting) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  MLASERVE_NEEDS_DEVICES(2);
  std::map<std::string, double> cached;
  for (const char* method : {"round_robin", "cache_aware"}) {
    SCOPED_TRACE(method);
    const std::string policy = std::string(method) == "cache_aware" ? "lpm" : "fcfs";  // (SGLang's, either way)
    // (cache_aware's thresholds given as SGLang's router flags; one request at a time keeps the ranks balanced)
    ServerProcess s({"--tp", "2", "--dp", "2", "--enable-dp-attention", "--load-balance-method", method,
                     "--schedule-policy", policy, "--mem-fraction-static", "0.4", "--cache-threshold", "0.25",
                     "--balance-abs-threshold", "4", "--balance-rel-threshold", "1.25"});
    ASSERT_TRUE(s.running()) << s.log();
    const json info = get_json(s.port(), "/get_server_info");
    EXPECT_EQ(info["load_balance_method"], method);
    EXPECT_EQ(info["cache_threshold"], 0.25);
    EXPECT_EQ(info["balance_abs_threshold"], 4);
    EXPECT_EQ(info["balance_rel_threshold"], 1.25);
    EXPECT_EQ(info["schedule_policy"], policy);
    const std::string out_file = (std::filesystem::temp_directory_path() /
                                  ("mlaserve_gsp_" + std::to_string(::getpid()) + "_" + method + ".jsonl"))
                                     .string();
    std::filesystem::remove(out_file);
    auto r = run_command(mlaserve_cmd(300) + " bench-serving --backend sglang --host 127.0.0.1 --port " +
                         std::to_string(s.port()) +
                         " --dataset-name generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 4"
                         " --gsp-system-prompt-len 256 --gsp-question-len 16 --gsp-output-len 4 --max-concurrency 1"
                         " --seed 5 --output-file " + out_file);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("Successful requests:                     16"), std::string::npos) << r.output;
    const std::string lines = read_text(out_file);
    const json j = json::parse(lines.substr(0, lines.find('\n')));
    EXPECT_EQ(j["completed"], 16);
    EXPECT_EQ(j["total_output_tokens"], 64);
    EXPECT_GT(j["total_input_tokens"].get<int64_t>(), 16 * 256);
    std::filesystem::remove(out_file);
    const std::string m = http_request(s.port(), "GET", "/metrics").body;
    const std::string name = "\nmlaserve:cached_prompt_tokens_total ";
    const size_t at = m.find(name);
    ASSERT_NE(at, std::string::npos) << m;
    cached[method] = std::stod(m.substr(at + name.size()));
    EXPECT_EQ(s.stop(), 0);
  }
  // cache_aware: 12 of the 16 prompts find their system prompt cached (its whole pages at least); round_robin fewer.
  EXPECT_GE(cached["cache_aware"], 12 * 192);
  EXPECT_LT(cached["round_robin"], cached["cache_aware"]);
}

// --stream-interval 3: a chunk every 3 tokens and one at the end, each covering everything since the one before (the
// native stream's cumulative ids; the OpenAI deltas add up to the whole text).
// --chat-template with the repo's DeepSeek-V3 tool template and --tool-call-parser deepseekv3 on the real tokenizer:
// the tools are described to the model, the history's calls and results are written in DeepSeek's marker tokens, and
// a chat request with tools is answered (the dummy model's random text parsed: no calls expected, a valid shape).
TEST(ServerE2EVariants, ToolTemplateAndParser) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const std::string tmpl = e2e_source_file("examples/chat_templates/deepseek_v3_tools.jinja");
  ServerProcess s({"--chat-template", tmpl, "--tool-call-parser", "deepseekv3", "--reasoning-parser", "deepseek-r1"});
  ASSERT_TRUE(s.running()) << s.log();
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "get_weather", "description":
      "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  const std::string history = R"("messages": [{"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function":
        {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}])";
  auto t = post_json(s.port(), "/tokenize", "{" + history + ", " + tools + "}");
  const std::vector<int32_t> ids = t["tokens"];
  auto text = post_json(s.port(), "/detokenize", R"({"tokens": )" + t["tokens"].dump() + "}")["prompt"];
  const std::string prompt = text.get<std::string>();
  EXPECT_NE(prompt.find("Be brief.\n\n## Tools"), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("### get_weather\nDescription: Weather of a city\nParameters: {"), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"), std::string::npos)
      << prompt;
  EXPECT_EQ(prompt.substr(prompt.size() - std::string("<｜tool▁outputs▁end｜>").size()), "<｜tool▁outputs▁end｜>");
  // The markers are single special tokens: calls begin / end, call begin / end, separator, outputs, output.
  for (int32_t special : {128806, 128807, 128808, 128809, 128814, 128810, 128811, 128812, 128813})
    EXPECT_NE(std::find(ids.begin(), ids.end(), special), ids.end()) << special;
  auto r = post_json(s.port(), "/v1/chat/completions", "{" + history + ", " + tools + R"(, "max_tokens": 6})");
  EXPECT_TRUE(r["choices"][0]["message"].contains("content"));
  EXPECT_TRUE(r["choices"][0]["message"].contains("reasoning_content"));
  EXPECT_EQ(r["usage"]["prompt_tokens"], t["count"]);
  // Without tools the template writes what DeepSeek-V3's own does (the second server once the first is gone: on a
  // GPU each takes its memory fraction).
  const std::string chat = R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]})";
  const json with_template = post_json(s.port(), "/tokenize", chat)["tokens"];
  s.stop();
  ServerProcess plain;
  ASSERT_TRUE(plain.running()) << plain.log();
  EXPECT_EQ(with_template, post_json(plain.port(), "/tokenize", chat)["tokens"]);
}

// tool_choice required / named on the real tokenizer and the tools template: the answer is DeepSeek's tool calls in
// its special tokens (V3's form, and V3.1's with --tool-call-parser deepseekv31), parsed into tool_calls
// (finish_reason "tool_calls"), their arguments JSON of the tool's parameters, greedy and sampled, one call with
// parallel_tool_calls false.
class ForcedToolCalls : public ::testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(ServerE2EVariants, ForcedToolCalls, ::testing::Values("deepseekv3", "deepseekv31"));
TEST_P(ForcedToolCalls, FollowTheTools) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const std::string tmpl = e2e_source_file("examples/chat_templates/deepseek_v3_tools.jinja");
  ServerProcess s({"--chat-template", tmpl, "--tool-call-parser", GetParam()});
  ASSERT_TRUE(s.running()) << s.log();
  const std::string base = R"({"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 120,
      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}},
      {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties":
        {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}])";
  for (const std::string& choice : {std::string(R"("tool_choice": {"type": "function", "function": {"name":
                                        "get_weather"}}, "temperature": 0)"),
                                    std::string(R"("tool_choice": "required", "temperature": 1.0, "seed": 7)"),
                                    std::string(R"("tool_choice": "required", "parallel_tool_calls": false,
                                        "temperature": 1.0, "seed": 8)")}) {
    SCOPED_TRACE(choice);
    auto r = post_json(s.port(), "/v1/chat/completions", base + ", " + choice + "}");
    const json& ch = r["choices"][0];
    const bool one = choice.find("parallel_tool_calls") != std::string::npos ||
                     choice.find("get_weather") != std::string::npos;
    // One call: the text is complete after it. Several allowed: a dummy model keeps calling until max_tokens.
    if (one) {
      EXPECT_EQ(ch["finish_reason"], "tool_calls") << r.dump();
    }
    ASSERT_TRUE(ch["message"].contains("tool_calls")) << r.dump();
    const json& calls = ch["message"]["tool_calls"];
    ASSERT_GE(calls.size(), 1u);
    if (one) {
      EXPECT_EQ(calls.size(), 1u);
    }
    for (const json& c : calls) {
      const std::string name = c["function"]["name"];
      const json args = json::parse(c["function"]["arguments"].get<std::string>());
      if (choice.find("get_weather") != std::string::npos) {
        EXPECT_EQ(name, "get_weather");
      }
      if (name == "get_weather") {
        EXPECT_TRUE(args["city"] == "Paris" || args["city"] == "Rome") << args;
        if (args.contains("unit")) {  // optional
          EXPECT_TRUE(args["unit"] == "C" || args["unit"] == "F") << args;
        }
        EXPECT_LE(args.size(), 2u) << args;
      } else {
        EXPECT_EQ(name, "get_time");
        EXPECT_TRUE(args["zone"] == "UTC" || args["zone"] == "CET") << args;
      }
    }
  }
  auto bad = post_json(s.port(), "/v1/chat/completions",
                       base + R"(, "tool_choice": {"type": "function", "function": {"name": "nope"}}})", 400);
  EXPECT_EQ(bad["error"]["param"], "tool_choice");
}

TEST(ServerE2EVariants, StreamIntervalGroupsTokens) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  ServerProcess s({"--stream-interval", "3"});
  ASSERT_TRUE(s.running()) << s.log();
  const std::string req = R"({"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 7,
      "temperature": 0, "ignore_eos": true}})";
  auto whole = post_json(s.port(), "/generate", req);
  auto r = http_request(s.port(), "POST", "/generate", std::string(req).insert(1, R"("stream": true, )"));
  ASSERT_EQ(r.status, 200);
  auto ev = sse_payloads(r.body);
  ASSERT_EQ(ev.size(), 4u) << r.body;  // 3, 6 and 7 tokens, then [DONE]
  std::vector<size_t> counts;
  for (size_t i = 0; i + 1 < ev.size(); ++i) counts.push_back(json::parse(ev[i])["output_ids"].size());
  EXPECT_EQ(counts, (std::vector<size_t>{3, 6, 7}));
  EXPECT_EQ(json::parse(ev[2])["output_ids"], whole["output_ids"]);
  EXPECT_EQ(json::parse(ev[2])["text"], whole["text"]);
  EXPECT_EQ(ev[3], "[DONE]");
  auto c = http_request(s.port(), "POST", "/v1/completions", R"({"prompt": "The quick brown fox", "max_tokens": 7,
      "temperature": 0, "ignore_eos": true, "stream": true})");
  ASSERT_EQ(c.status, 200);
  std::string text;
  int chunks = 0;
  for (const auto& e : sse_payloads(c.body))
    if (e != "[DONE]") {
      text += json::parse(e)["choices"][0]["text"].get<std::string>();
      ++chunks;
    }
  EXPECT_EQ(text, whole["text"].get<std::string>());
  EXPECT_LE(chunks, 4);  // 3 + 3 + 1 tokens (an empty last chunk may carry the finish reason)
}

TEST(ServerE2EVariants, ChunkedPrefillGivesTheSameGreedyTokens) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const auto prompt = test_prompt(0, 150);
  std::vector<int32_t> ref, small;
  {
    ServerProcess s({"--disable-radix-cache"});
    ASSERT_TRUE(s.running()) << s.log();
    ref = greedy(s.port(), prompt, 12);
  }
  {
    ServerProcess s({"--chunked-prefill-size", "16"});
    ASSERT_TRUE(s.running()) << s.log();
    small = greedy(s.port(), prompt, 12);
    EXPECT_EQ(greedy(s.port(), prompt, 12), small);  // and with a prefix hit
  }
  EXPECT_EQ(small, ref);
}

// CUDA graphs on and off (--disable-cuda-graph): decode steps replaying graphs sample inside them. Seeded draws
// (temperature, top-k / top-p / min-p, the penalties, a logit bias) and a greedy request, one at a time (one-row
// steps: the same kernels eager and in a graph), give the same tokens and logprobs. Only on a GPU (the CPU server
// has no graphs).
TEST(ServerE2EVariants, CudaGraphsOnAndOffSampleAlike) {
  if (e2e_env("MLASERVE_E2E_DEVICE", "cpu") != "cuda") GTEST_SKIP() << "CUDA graphs: MLASERVE_E2E_DEVICE=cuda only";
  ASSERT_TRUE(have_deepseek_tokenizer());
  const std::vector<json> params = {
      {{"temperature", 0.9}, {"top_k", 40}, {"top_p", 0.95}, {"frequency_penalty", 0.3}, {"sampling_seed", 7}},
      {{"temperature", 1.3}, {"min_p", 0.02}, {"repetition_penalty", 1.2}, {"presence_penalty", 0.5},
       {"logit_bias", {{"1234", 2.0}, {"4321", -3.0}}}, {"sampling_seed", 8}},
      {{"temperature", 0}}};
  auto run = [&](const std::vector<std::string>& flags) {
    ServerProcess s(flags);
    EXPECT_TRUE(s.running()) << s.log();
    std::vector<json> out;
    for (size_t r = 0; r < params.size(); ++r) {
      json sp = params[r];
      sp["max_new_tokens"] = 24;
      sp["ignore_eos"] = true;
      const json req{{"input_ids", test_prompt(static_cast<int>(r), 20 + 7 * r)}, {"sampling_params", sp},
                     {"return_logprob", true}};
      out.push_back(post_json(s.port(), "/generate", req.dump()));
    }
    return out;
  };
  const std::vector<json> graphs = run({"--disable-radix-cache"}),
                          eager = run({"--disable-radix-cache", "--disable-cuda-graph"});
  ASSERT_EQ(graphs.size(), eager.size());
  for (size_t r = 0; r < graphs.size(); ++r) {
    EXPECT_EQ(graphs[r]["output_ids"], eager[r]["output_ids"]) << "request " << r;
    const json &a = graphs[r]["meta_info"]["output_token_logprobs"], &b = eager[r]["meta_info"]["output_token_logprobs"];
    ASSERT_EQ(a.size(), b.size());
    ASSERT_EQ(a.size(), 24u);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_NEAR(a[i][0].get<double>(), b[i][0].get<double>(), 1e-3) << "request " << r << " token " << i;
  }
}

TEST(ServerE2EVariants, ApiKeyAndBodyLimit) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  ServerProcess s({"--api-key", "k3y", "--max-body-bytes", "100000"});
  ASSERT_TRUE(s.running()) << s.log();
  EXPECT_EQ(http_request(s.port(), "POST", "/generate", R"({"text": "hi"})").status, 401);
  EXPECT_EQ(http_request(s.port(), "GET", "/v1/models").status, 401);
  EXPECT_EQ(http_request(s.port(), "GET", "/health").status, 200);
  auto ok = http_request(s.port(), "POST", "/generate", R"({"text": "hi", "sampling_params": {"max_new_tokens": 2}})",
                         "Authorization: Bearer k3y\r\n");
  EXPECT_EQ(ok.status, 200) << ok.body;
  auto big = http_request(s.port(), "POST", "/generate", R"({"text": ")" + std::string(200000, 'a') + "\"}",
                          "Authorization: Bearer k3y\r\n");
  EXPECT_EQ(big.status, 413) << big.body;
}

TEST(ServerE2EVariants, LongPromptWithinTheBodyLimitWorks) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  ServerProcess s;
  ASSERT_TRUE(s.running()) << s.log();
  std::string words;
  for (int i = 0; i < 2000; ++i) words += "lorem ";
  auto j = post_json(s.port(), "/generate",
                     R"({"text": ")" + words + R"(", "sampling_params": {"max_new_tokens": 2, "ignore_eos": true}})");
  EXPECT_GT(j["meta_info"]["prompt_tokens"].get<int>(), 2000);
  EXPECT_EQ(j["meta_info"]["completion_tokens"], 2);
}

// Under --dp a session's turns follow their parent to its DP rank, whose prefix cache holds the earlier turns (round
// robin alone would send every other turn to the other rank, which caches none of them).
TEST(ServerE2EVariants, DataParallelSessionTurnsStayOnTheirRank) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  MLASERVE_NEEDS_DEVICES(2);
  ServerProcess s({"--dp", "2"});
  ASSERT_TRUE(s.running()) << s.log();
  ASSERT_EQ(http_request(s.port(), "POST", "/open_session", R"({"capacity_of_str_len": 0, "session_id": "dp"})").status,
            200);
  std::string parent;
  for (int turn = 0; turn < 4; ++turn) {
    const json j = post_json(s.port(), "/generate",
                             R"({"input_ids": )" + ids_json(test_prompt(90 + turn, turn == 0 ? 70 : 10)) +
                                 R"(, "session_params": {"id": "dp")" +
                                 (parent.empty() ? "" : R"(, "rid": ")" + parent + "\"") +
                                 R"(}, "sampling_params": {"max_new_tokens": 4, "ignore_eos": true}})");
    if (turn > 0) {
      EXPECT_GE(j["meta_info"]["cached_tokens"].get<int>(), 64) << "turn " << turn << ": " << j.dump();
    }
    parent = j["meta_info"]["id"].get<std::string>();
  }
}

TEST(ServerE2EVariants, DataParallelReportsOneStateObjectPerRank) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  MLASERVE_NEEDS_DEVICES(2);
  ServerProcess s({"--dp", "2"});
  ASSERT_TRUE(s.running()) << s.log();
  // While a long request runs, /get_load (SGLang's router reads it) shows it on its rank with its tokens.
  std::jthread busy([&] {
    post_json(s.port(), "/generate",
              R"({"text": "a long one", "sampling_params": {"max_new_tokens": 400, "ignore_eos": true}})");
  });
  json load;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(60 * time_scale());
  while (std::chrono::steady_clock::now() < end) {
    load = get_json(s.port(), "/get_load");
    if (load.size() == 2 && load[0]["num_reqs"].get<int>() + load[1]["num_reqs"].get<int>() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(load.size(), 2u) << load.dump();
  EXPECT_EQ(load[0]["dp_rank"], 0);
  EXPECT_EQ(load[1]["dp_rank"], 1);
  const json& running = load[0]["num_reqs"] == 1 ? load[0] : load[1];
  EXPECT_EQ(running["num_reqs"], 1) << load.dump();
  EXPECT_GT(running["num_tokens"].get<int64_t>(), 0) << load.dump();
  busy.join();
  std::vector<std::jthread> ts;
  for (int i = 0; i < 6; ++i)
    ts.emplace_back([&, i] { EXPECT_EQ(greedy(s.port(), test_prompt(i, 20), 4).size(), 4u); });
  for (auto& t : ts) t.join();
  auto st = get_json(s.port(), "/get_server_info")["internal_states"];
  ASSERT_EQ(st.size(), 2u) << st.dump();
  // Engine stats may trail the last output by a scheduler step: poll until both ranks are idle.
  const auto idle_by = std::chrono::steady_clock::now() + std::chrono::duration<double>(5 * time_scale());
  while (std::chrono::steady_clock::now() < idle_by) {
    st = get_json(s.port(), "/get_server_info")["internal_states"];
    if (st[0]["num_running_reqs"] == 0 && st[1]["num_running_reqs"] == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  for (const auto& r : st) {
    EXPECT_EQ(r["num_running_reqs"], 0) << st.dump();
    EXPECT_EQ(r["kv_tokens_free"].get<int64_t>(), r["kv_tokens_total"].get<int64_t>() - r["kv_tokens_cached"].get<int64_t>());
  }
}

// vLLM's names for the same settings, and SGLang's / vLLM's flags that only choose their own kernels or logging
// (accepted, logged as having no effect): their launch commands run as they are.
// `serve` with each of flag_sets (on the tiny model) exits non-zero, its output naming `needle`.
void expect_serve_refuses(std::initializer_list<std::string> flag_sets, const std::string& needle) {
  for (const std::string& flags : flag_sets) {
    auto r = run_command(mlaserve_cmd(60) + " serve --model-path " + e2e_model_dir() +
                         " --load-format dummy --port 0 " + flags);
    EXPECT_NE(r.exit_code, 0) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << flags << "\n" << r.output;
  }
}

// Expert parallelism (vLLM's --enable-expert-parallel, SGLang's --enable-ep-moe / --ep-size = --tp), with tp 2 and
// with DP attention: the answers of one rank (three allowed tokens keep the greedy choices far from ties, as the
// experts' partial sums add up in another order); an --ep-size other than 1 or --tp exits naming it.
TEST(ServeFlags, ExpertParallelKeepsTheAnswers) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const std::string greedy = R"({"prompt": "The quick brown fox jumps over", "max_tokens": 24, "temperature": 0,
      "ignore_eos": true, "logprobs": 1, "allowed_token_ids": [1000, 1001, 1002]})";
  json want;
  {
    ServerProcess plain;
    ASSERT_TRUE(plain.running()) << plain.log();
    want = post_json(plain.port(), "/v1/completions", greedy);
    EXPECT_EQ(plain.stop(), 0);
  }
  using Flags = std::vector<std::string>;
  MLASERVE_NEEDS_DEVICES(2);
  for (const Flags& flags : {Flags{"--tp", "2", "--enable-expert-parallel"},
                             Flags{"--tp", "2", "--dp", "2", "--enable-dp-attention", "--ep-size", "2"}}) {
    ServerProcess ep(flags);
    ASSERT_TRUE(ep.running()) << ep.log();
    EXPECT_EQ(get_json(ep.port(), "/get_server_info")["ep_size"], 2);
    const json got = post_json(ep.port(), "/v1/completions", greedy);
    EXPECT_EQ(got["choices"][0]["text"], want["choices"][0]["text"]) << flags.back();
    EXPECT_EQ(got["choices"][0]["logprobs"]["tokens"], want["choices"][0]["logprobs"]["tokens"]);
    EXPECT_EQ(ep.stop(), 0);
  }
  expect_serve_refuses({"--tp 2 --ep-size 3", "--ep-size 2"}, "--ep-size");
}

// vLLM's --hf-overrides and SGLang's --json-model-override-args replace config.json's keys: the context the server
// reports and enforces, the layers it loads (one of four: another answer); not an object, both flags, or a value the
// config refuses exit naming them.
// SGLang's /update_weights_from_disk on a running server (an RL trainer's loop), in one layout and (CPU) DP attention:
// the next generation is the new checkpoint's (what a server started on it answers), a bad folder is a 400 that keeps
// the weights, the model path and weight version follow, and loading the first checkpoint again (while generation is
// paused, a request waiting for it) gives its answers.
TEST(ServeFlags, UpdateWeightsFromDisk) {
  const auto b = temp_dir("e2e-wu");
  write_scaled_checkpoint("v3", b, 1.25f);
  const std::string req = R"({"input_ids": [5, 17, 300, 2, 99], "sampling_params": {"max_new_tokens": 8,
      "temperature": 0, "ignore_eos": true}})";
  std::vector<int32_t> want_new;
  {
    ServerProcess fresh({"--model-path", b.string()});
    ASSERT_TRUE(fresh.running()) << fresh.log();
    want_new = post_json(fresh.port(), "/generate", req)["output_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(fresh.stop(), 0);
  }
  using Flags = std::vector<std::string>;
  std::vector<Flags> layouts{Flags{}};
  if (e2e_devices() >= 2) layouts.push_back({"--tp", "2", "--dp", "2", "--enable-dp-attention"});
  for (const Flags& layout : layouts) {
    Flags flags{"--model-path", golden_dir("v3"), "--weight-version", "step1"};
    flags.insert(flags.end(), layout.begin(), layout.end());
    ServerProcess s(flags);
    ASSERT_TRUE(s.running()) << s.log();
    const std::vector<int32_t> want_old = post_json(s.port(), "/generate", req)["output_ids"];
    ASSERT_NE(want_old, want_new);
    EXPECT_EQ(get_json(s.port(), "/get_weight_version")["weight_version"], "step1");
    json r = post_json(s.port(), "/update_weights_from_disk",
                       json{{"model_path", b.string()}, {"weight_version", "step2"}}.dump());
    EXPECT_EQ(r["success"], true) << r.dump();
    EXPECT_EQ(post_json(s.port(), "/generate", req)["output_ids"], want_new);
    json info = get_json(s.port(), "/get_model_info");
    EXPECT_EQ(info["model_path"], b.string());
    EXPECT_EQ(info["weight_version"], "step2");

    r = post_json(s.port(), "/update_weights_from_disk", R"({"model_path": "/nonexistent/ckpt"})", 400);
    EXPECT_EQ(r["success"], false);
    EXPECT_NE(r["message"].get<std::string>().find("/nonexistent/ckpt"), std::string::npos) << r.dump();
    EXPECT_EQ(post_json(s.port(), "/generate", req)["output_ids"], want_new);
    EXPECT_EQ(get_json(s.port(), "/get_model_info")["model_path"], b.string());

    // The RL loop through HTTP: pause, a request sent while paused waits, the update runs at once, continue.
    EXPECT_EQ(post_json(s.port(), "/pause_generation", R"({"mode": "retract"})")["status"], "ok");
    EXPECT_EQ(get_json(s.port(), "/is_paused")["is_paused"], true);
    std::vector<int32_t> waited;
    std::jthread waiting(
        [&] { waited = post_json(s.port(), "/generate", req)["output_ids"].get<std::vector<int32_t>>(); });
    r = post_json(s.port(), "/update_weights_from_disk",
                  json{{"model_path", golden_dir("v3")}, {"abort_all_requests", true}}.dump());
    EXPECT_EQ(r["success"], true) << r.dump();
    EXPECT_EQ(post_json(s.port(), "/continue_generation", "{}")["status"], "ok");
    waiting.join();
    EXPECT_EQ(waited, want_old);
    EXPECT_EQ(post_json(s.port(), "/generate", req)["output_ids"], want_old);
    EXPECT_EQ(get_json(s.port(), "/get_weight_version")["weight_version"], "step2");
    // The memory given back and taken again (the weights loaded again, the graphs kept): the same answers.
    EXPECT_EQ(post_json(s.port(), "/release_memory_occupation", "{}")["success"], true);
    EXPECT_EQ(post_json(s.port(), "/resume_memory_occupation", R"({"tags": ["weights"]})")["success"], true);
    EXPECT_EQ(post_json(s.port(), "/generate", req)["output_ids"], want_old);
    // vLLM's sleep mode on the same path, and its prefix-cache reset.
    EXPECT_EQ(test::http_request(s.port(), "POST", "/sleep?level=2", "").status, 200);
    EXPECT_EQ(get_json(s.port(), "/is_sleeping")["is_sleeping"], true);
    EXPECT_EQ(test::http_request(s.port(), "POST", "/wake_up?tags=weights", "").status, 200);
    EXPECT_EQ(get_json(s.port(), "/is_sleeping")["is_sleeping"], false);
    EXPECT_EQ(post_json(s.port(), "/generate", req)["output_ids"], want_old);
    EXPECT_EQ(test::http_request(s.port(), "POST", "/reset_prefix_cache", "").status, 200);
    EXPECT_EQ(s.stop(), 0);
  }
}

// SGLang's expert distribution recorder on a running server: only the generations between start and stop count, each
// forwarded token once per MoE layer (k experts), none in dense layers; the dump is a JSON file in
// $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR. Without the flag the endpoints are 400s.
TEST(ServeFlags, ExpertDistributionRecord) {
  const auto dir = temp_dir("e2e-experts");
  ::setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", dir.string().c_str(), 1);
  ServerProcess s({"--model-path", golden_dir("v3"), "--expert-distribution-recorder-mode", "stat",
                   "--disable-radix-cache", "--disable-overlap-schedule"});
  ::unsetenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR");
  ASSERT_TRUE(s.running()) << s.log();
  auto generate = [&](int n) {  // the tokens it forwarded: the prompt and every new token but the last
    const json r = post_json(s.port(), "/generate", json{{"input_ids", {5, 17, 300, 2, 99, 41, 7}},
                                                          {"sampling_params", {{"max_new_tokens", n},
                                                                               {"temperature", 0},
                                                                               {"ignore_eos", true}}}}.dump());
    return r["meta_info"]["prompt_tokens"].get<int64_t>() + r["meta_info"]["completion_tokens"].get<int64_t>() - 1;
  };
  generate(5);  // before the recording
  auto text = [&](const std::string& path) {
    const test::HttpResponse r = test::http_request(s.port(), "POST", path, "");
    EXPECT_EQ(r.status, 200) << path << ": " << r.body;
    return r.body;
  };
  EXPECT_EQ(text("/start_expert_distribution_record"), "Start recording the expert distribution.\n");
  // Three at once: their decode steps batch (a graph of 4 rows replays with a padding row on CUDA).
  std::vector<int64_t> forwarded(3, 0);
  {
    std::vector<std::jthread> ts;
    for (int i = 0; i < 3; ++i) ts.emplace_back([&, i] { forwarded[static_cast<size_t>(i)] = generate(6 + 3 * i); });
    for (auto& t : ts) t.join();
  }
  const int64_t tokens = forwarded[0] + forwarded[1] + forwarded[2];
  EXPECT_EQ(text("/stop_expert_distribution_record"), "Stop recording the expert distribution.\n");
  generate(4);  // after it
  EXPECT_EQ(text("/dump_expert_distribution_record"), "Dump expert distribution record.\n");
  std::vector<std::filesystem::path> files;
  for (const auto& f : std::filesystem::directory_iterator(dir)) files.push_back(f.path());
  ASSERT_EQ(files.size(), 1u);
  std::ifstream in(files[0]);
  const json d = json::parse(in);
  const ModelConfig c = ModelConfig::from_file(golden_dir("v3"));
  ASSERT_EQ(d["num_layers"], c.num_hidden_layers);
  ASSERT_EQ(d["num_experts"], c.n_routed_experts);
  ASSERT_EQ(d["logical_count"].size(), static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::vector<int64_t> row = d["logical_count"][static_cast<size_t>(l)];
    ASSERT_EQ(row.size(), static_cast<size_t>(c.n_routed_experts));
    int64_t sum = 0, used = 0;
    for (int64_t v : row) {
      sum += v;
      used += v > 0;
    }
    EXPECT_EQ(sum, c.is_moe_layer(l) ? tokens * c.num_experts_per_tok : 0) << "layer " << l;
    if (c.is_moe_layer(l)) {
      EXPECT_GT(used, c.num_experts_per_tok) << "layer " << l;
    }
  }
  EXPECT_EQ(s.stop(), 0);
  std::filesystem::remove_all(dir);

  ServerProcess off({"--model-path", golden_dir("v3")});
  ASSERT_TRUE(off.running()) << off.log();
  const test::HttpResponse r = test::http_request(off.port(), "POST", "/start_expert_distribution_record", "");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("--expert-distribution-recorder-mode"), std::string::npos) << r.body;
  EXPECT_EQ(off.stop(), 0);
}

// /start_profile and /stop_profile on a running server: a Chrome trace in $SGLANG_TORCH_PROFILER_DIR with one "step"
// span per step of the generations in between.
TEST(ServeFlags, Profile) {
  const auto dir = temp_dir("e2e-profile");
  ::setenv("SGLANG_TORCH_PROFILER_DIR", dir.string().c_str(), 1);
  ServerProcess s(std::vector<std::string>{});
  ::unsetenv("SGLANG_TORCH_PROFILER_DIR");
  ASSERT_TRUE(s.running()) << s.log();
  auto text = [&](const std::string& path, const std::string& body) {
    const test::HttpResponse r = test::http_request(s.port(), "POST", path, body);
    EXPECT_EQ(r.status, 200) << path << ": " << r.body;
    return r.body;
  };
  EXPECT_EQ(text("/start_profile", "{}"), "Start profiling.\n");
  post_json(s.port(), "/generate", R"({"input_ids": [5, 17, 300], "sampling_params": {"max_new_tokens": 6,
      "ignore_eos": true}})");
  EXPECT_EQ(text("/stop_profile", ""), "Stop profiling. This will take some time.\n");
  std::vector<std::filesystem::path> files;
  for (const auto& f : std::filesystem::directory_iterator(dir)) files.push_back(f.path());
  ASSERT_EQ(files.size(), 1u);
  std::ifstream in(files[0]);
  const json t = json::parse(in);
  int steps = 0;
  for (const json& e : t["traceEvents"]) steps += e["ph"] == "X" && e["name"] == "step";
  EXPECT_GE(steps, 6);  // the prompt and five decode steps (the health check's step may precede)
  EXPECT_EQ(s.stop(), 0);
  std::filesystem::remove_all(dir);
}

// HTTPS with vLLM's and SGLang's flags (--ssl-certfile, --ssl-keyfile): Python's stdlib client (ssl checking the
// server's certificate against the test CA) completes, chats and streams, and bench-serving runs against an https://
// --base-url; unusable TLS files stop the server before it loads, naming the flag.
TEST(ServeFlags, Https) {
  const auto dir = temp_dir("e2e-tls");
  const TlsFiles t = write_tls_files(dir);
  ServerProcess s({"--ssl-certfile", t.cert, "--ssl-keyfile", t.key});
  ASSERT_TRUE(s.running()) << s.log();
  EXPECT_NE(s.log().find("on https://127.0.0.1:"), std::string::npos) << s.log();
  const std::string script = (dir / "client.py").string();
  {
    std::ofstream py(script);
    py << R"(import json, ssl, sys, urllib.request as u
port, ca = sys.argv[1], sys.argv[2]
ctx = ssl.create_default_context(cafile=ca)
def post(path, body):
    req = u.Request("https://127.0.0.1:%s%s" % (port, path), data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"})
    return u.urlopen(req, context=ctx, timeout=60)
c = json.load(post("/v1/completions", {"model": "tiny-v3", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}))
assert c["usage"]["completion_tokens"] == 3, c
m = json.load(post("/v1/chat/completions", {"model": "tiny-v3", "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "hello"}]}))
assert m["choices"][0]["message"]["role"] == "assistant", m
events = [l for l in post("/generate", {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4,
          "ignore_eos": True}}).read().decode().split("\n") if l.startswith("data: ")]
assert events[-1] == "data: [DONE]" and len(events) >= 3, events
try:
    u.urlopen("https://127.0.0.1:%s/health" % port, context=ssl.create_default_context(), timeout=60)
    sys.exit("a client without the test CA trusted the server")
except (ssl.SSLError, u.URLError):
    pass
print("https checks passed")
)";
  }
  const auto r = run_command(fmt::format("timeout 120 python3 {} {} {}", script, s.port(), t.ca_cert));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("https checks passed"), std::string::npos) << r.output;
  // bench-serving against the HTTPS server (OpenSSL's $SSL_CERT_FILE: the test CA), and refused without it.
  const std::string bench = fmt::format(" bench-serving --backend sglang-oai --base-url https://127.0.0.1:{}/ "
                                        "--dataset-name random --random-input 16 --random-output 4 "
                                        "--random-range-ratio 1 --num-prompts 6 --max-concurrency 3 --seed 3",
                                        s.port());
  const auto b = run_command("SSL_CERT_FILE=" + t.ca_cert + " " + mlaserve_cmd(300) + bench);
  EXPECT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("Successful requests:                     6"), std::string::npos) << b.output;
  const auto untrusted = run_command("SSL_CERT_FILE=" + t.cert + " " + mlaserve_cmd(120) + bench);
  EXPECT_NE(untrusted.exit_code, 0) << untrusted.output;
  EXPECT_NE(untrusted.output.find("certificate verify failed"), std::string::npos) << untrusted.output;
  EXPECT_EQ(s.stop(), 0);

  ServerProcess bad({"--ssl-certfile", t.cert, "--ssl-keyfile", (dir / "missing.pem").string()});
  EXPECT_FALSE(bad.running());
  EXPECT_NE(bad.log().find("--ssl-keyfile"), std::string::npos) << bad.log();
  EXPECT_EQ(bad.log().find("loading weights"), std::string::npos) << bad.log();
  std::filesystem::remove_all(dir);
}

// The official openai npm client over HTTPS (trusting the test CA through NODE_EXTRA_CA_CERTS).
TEST(ServeFlags, HttpsOpenAINpmClient) {
  REQUIRE_NODE_CLIENT("openai");
  const auto dir = temp_dir("e2e-tls-npm");
  const TlsFiles t = write_tls_files(dir);
  ServerProcess s({"--ssl-certfile", t.cert, "--ssl-keyfile", t.key});
  ASSERT_TRUE(s.running()) << s.log();
  auto r = run_command("NODE_EXTRA_CA_CERTS=" + t.ca_cert + " timeout 120 " + node + " " + MLASERVE_SOURCE_DIR +
                       "/tests/e2e/openai_client.mjs " + std::to_string(s.port()) + " tiny-v3 https");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("all checks passed"), std::string::npos) << r.output;
  EXPECT_EQ(s.stop(), 0);
  std::filesystem::remove_all(dir);
}

// SGLang's --enable-return-hidden-states against Hugging Face (tools/golden/make_hidden_golden.py): /generate's
// meta_info.hidden_states (the prompt's rows as one list, then a row per generated token but the last) and the OpenAI
// completion's last row, wherever the greedy tokens are the reference's; and each row is what the server's own logits
// come from: lm_head times the row gives the prompt logprobs the same request reports. On the CPU every row within
// rounding. On the GPU (bf16) a token whose routing tips to another expert moves its row and, through attention, later
// ones (measured 2026-12-04: median 0.049 / 0.071, 90th percentile 0.062 / 0.22, largest 0.11 / 3.2 on the two
// prompts; CudaModel.FinalHiddenStatesGolden bounds the rows with the routing forced), so the median is bounded.
TEST(ServeFlags, ReturnHiddenStatesEqualHuggingFace) {
  const std::string dir = golden_dir("v2");
  SafetensorsFile ref(dir + "/reference.safetensors"), hf(dir + "/hidden.safetensors");
  const Tensor lm_head = read_checkpoint(dir).at("lm_head.weight");  // [V, H] bf16
  const bool cpu = e2e_env("MLASERVE_E2E_DEVICE", "cpu") == "cpu";
  ServerProcess s({"--model-path", dir, "--enable-return-hidden-states", "--chunked-prefill-size", "64"});
  ASSERT_TRUE(s.running()) << s.log();
  for (int j : {2, 4}) {
    const Tensor p = ref.tensor(fmt::format("prompt_{}", j)), g = ref.tensor(fmt::format("greedy_{}", j));
    const Tensor h = hf.tensor(fmt::format("hidden_{}", j));
    const std::vector<int32_t> prompt(p.data_as<int32_t>(), p.data_as<int32_t>() + p.numel());
    const size_t P = prompt.size(), H = static_cast<size_t>(h.size(1)), V = static_cast<size_t>(lm_head.size(0));
    const size_t n = 8;
    std::vector<float> errors;  // per row compared: the largest difference from Hugging Face's
    auto compare = [&](const json& row, size_t pos) {
      ASSERT_EQ(row.size(), H) << "position " << pos;
      float e = 0.0f;
      for (size_t k = 0; k < H; ++k) e = std::max(e, std::abs(row[k].get<float>() - h.data_as<float>()[pos * H + k]));
      errors.push_back(e);
    };
    const json r = post_json(s.port(), "/generate",
                       json{{"input_ids", prompt}, {"return_hidden_states", true}, {"return_logprob", true},
                            {"logprob_start_len", 0},
                            {"sampling_params", {{"max_new_tokens", n}, {"temperature", 0}, {"ignore_eos", true}}}}
                           .dump());
    const std::vector<int32_t> out = r["output_ids"];
    size_t agree = 0;
    while (agree < out.size() && out[agree] == g.data_as<int32_t>()[agree]) ++agree;
    EXPECT_GE(agree, 4u) << "prompt " << j << ": the greedy tokens left the reference early";
    const json& hs = r["meta_info"]["hidden_states"];
    ASSERT_EQ(hs.size(), n) << "prompt " << j;
    ASSERT_EQ(hs[0].size(), P);
    for (size_t pos = 0; pos < P; ++pos) compare(hs[0][pos], pos);
    for (size_t i = 1; i < n && i <= agree; ++i) compare(hs[i], P + i - 1);  // the row at output token i - 1
    const json c = post_json(s.port(), "/v1/completions",
                             json{{"prompt", prompt}, {"max_tokens", 3}, {"temperature", 0},
                                  {"return_hidden_states", true}, {"ignore_eos", true}}
                                 .dump());
    if (agree >= 2) compare(c["choices"][0]["hidden_states"], P + 1);
    std::vector<float> sorted = errors;
    std::sort(sorted.begin(), sorted.end());
    const float median = sorted[sorted.size() / 2], p90 = sorted[sorted.size() * 9 / 10], worst = sorted.back();
    std::printf("return_hidden_states prompt %d: %zu rows, difference from Hugging Face: median %.3g, 90th percentile "
                "%.3g, largest %.3g\n", j, errors.size(), median, p90, worst);
    if (cpu) {
      EXPECT_LT(worst, 2e-4f) << "prompt " << j;
    } else {
      EXPECT_LT(median, 0.1f) << "prompt " << j;
    }
    // Prompt row p through lm_head: the logprob of prompt token p + 1 that the same request reported.
    const json& lps = r["meta_info"]["input_token_logprobs"];
    ASSERT_EQ(lps.size(), P);
    float lp_worst = 0.0f;
    for (size_t pos = 0; pos + 1 < P; ++pos) {
      std::vector<double> logits(V);
      for (size_t v = 0; v < V; ++v) {
        double acc = 0.0;
        for (size_t k = 0; k < H; ++k)
          acc += static_cast<double>(bf16_to_f32(lm_head.data_as<uint16_t>()[v * H + k])) *
                 hs[0][pos][k].get<double>();
        logits[v] = acc;
      }
      const double m = *std::max_element(logits.begin(), logits.end());
      double sum = 0.0;
      for (double x : logits) sum += std::exp(x - m);
      const double lp = logits[static_cast<size_t>(prompt[pos + 1])] - m - std::log(sum);
      lp_worst = std::max(lp_worst, static_cast<float>(std::abs(lp - lps[pos + 1][0].get<double>())));
    }
    std::printf("return_hidden_states prompt %d: lm_head of the rows against the prompt logprobs within %.3g\n", j,
                lp_worst);
    EXPECT_LT(lp_worst, cpu ? 1e-3f : 2e-2f) << "prompt " << j << ": lm_head of the rows against the prompt logprobs";
  }
  EXPECT_EQ(s.stop(), 0);
}

// Generative scoring against Hugging Face (the golden v2 checkpoint, token ids): each item's prompt is a prefix of a
// reference prompt, so its label probabilities are the softmax of the reference logits at the prefix's last position
// (over the vocabulary; over the labels with apply_softmax; vLLM's score the first label's), with the query before the
// items or after them.
TEST(ServeFlags, GenerativeScoringIsTheNextTokenProbability) {
  const std::string dir = golden_dir("v2");
  SafetensorsFile ref(dir + "/reference.safetensors");
  const bool cpu = e2e_env("MLASERVE_E2E_DEVICE", "cpu") == "cpu";
  const double tol = cpu ? 2e-3 : 0.1;  // on log-probabilities (bf16 on the GPU)
  ServerProcess s({"--model-path", dir});
  ASSERT_TRUE(s.running()) << s.log();
  const Tensor pt = ref.tensor("prompt_3"), lt = ref.tensor("logits_3");
  const std::vector<int32_t> prompt(pt.data_as<int32_t>(), pt.data_as<int32_t>() + pt.numel());
  const size_t V = static_cast<size_t>(lt.size(1));
  ASSERT_GE(prompt.size(), 60u);
  // Hugging Face's log-probability of `id` after the prompt's first m tokens.
  auto hf = [&](size_t m, int32_t id) {
    const float* row = lt.data_as<float>() + (m - 1) * V;
    const double top = *std::max_element(row, row + V);
    double sum = 0.0;
    for (size_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - top);
    return static_cast<double>(row[static_cast<size_t>(id)]) - top - std::log(sum);
  };
  auto span = [&](size_t a, size_t b) { return std::vector<int32_t>(prompt.begin() + a, prompt.begin() + b); };
  const size_t k = 20;
  const std::vector<size_t> ends = {k + 1, 41, 60};
  std::vector<int32_t> labels = {5, 17};
  {  // and the most likely token after the longest prefix
    const float* row = lt.data_as<float>() + (ends.back() - 1) * V;
    labels.push_back(static_cast<int32_t>(std::max_element(row, row + V) - row));
  }
  json items = json::array();
  for (size_t m : ends) items.push_back(span(k, m));
  json body{{"query", span(0, k)}, {"items", items}, {"label_token_ids", labels}};
  const json a = post_json(s.port(), "/v1/score", body.dump());
  ASSERT_EQ(a["scores"].size(), ends.size()) << a.dump();
  for (size_t i = 0; i < ends.size(); ++i)
    for (size_t l = 0; l < labels.size(); ++l)
      EXPECT_NEAR(std::log(a["scores"][i][l].get<double>()), hf(ends[i], labels[l]), tol) << i << " " << l;
  body["apply_softmax"] = true;
  const json b = post_json(s.port(), "/v1/score", body.dump());
  for (size_t i = 0; i < ends.size(); ++i) {
    double z = 0.0;
    for (int32_t id : labels) z += std::exp(hf(ends[i], id));
    for (size_t l = 0; l < labels.size(); ++l)
      EXPECT_NEAR(std::log(b["scores"][i][l].get<double>()), hf(ends[i], labels[l]) - std::log(z), tol);
  }
  body.erase("apply_softmax");
  const json c = post_json(s.port(), "/generative_scoring", body.dump());  // vLLM's: over the labels by default
  ASSERT_EQ(c["data"].size(), ends.size()) << c.dump();
  for (size_t i = 0; i < ends.size(); ++i)
    EXPECT_NEAR(c["data"][i]["score"].get<double>(), b["scores"][i][0].get<double>(), 1e-9);
  // The item first: the prompt's first k tokens as the item, the rest as the query.
  const json d = post_json(s.port(), "/v1/score",
                           json{{"query", span(k, 60)}, {"items", json::array({span(0, k)})},
                                {"label_token_ids", labels}, {"item_first", true}}
                               .dump());
  for (size_t l = 0; l < labels.size(); ++l)
    EXPECT_NEAR(d["scores"][0][l].get<double>(), a["scores"][2][l].get<double>(), cpu ? 1e-9 : 5e-2);
  EXPECT_EQ(s.stop(), 0);
}

// SGLang's --enable-return-routed-experts: /generate's meta_info.routed_experts decodes to [rows, layers, top-k]
// int32 ids, rows as return_hidden_states' (prompt + generated - 1); the dense layer's 0, each MoE layer's distinct
// experts of the model's; the same for the same prompt again (cached or not), and for the OpenAI completion.
TEST(ServeFlags, ReturnRoutedExperts) {
  const std::string dir = golden_dir("v2");
  const ModelConfig c = ModelConfig::from_file(dir);
  const size_t L = static_cast<size_t>(c.num_hidden_layers), k = static_cast<size_t>(c.num_experts_per_tok);
  ServerProcess s({"--model-path", dir, "--enable-return-routed-experts", "--chunked-prefill-size", "64"});
  ASSERT_TRUE(s.running()) << s.log();
  SafetensorsFile ref(dir + "/reference.safetensors");
  const Tensor p = ref.tensor("prompt_3");
  const std::vector<int32_t> prompt(p.data_as<int32_t>(), p.data_as<int32_t>() + p.numel());
  const std::string body = json{{"input_ids", prompt}, {"return_routed_experts", true},
                                {"sampling_params", {{"max_new_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}}}}
                               .dump();
  const json a = post_json(s.port(), "/generate", body), b = post_json(s.port(), "/generate", body);
  const std::vector<int32_t> ids = int32s_of_base64(a["meta_info"]["routed_experts"].get<std::string>());
  ASSERT_EQ(ids.size(), (prompt.size() + 5) * L * k);
  for (size_t r = 0; r < prompt.size() + 5; ++r)
    for (size_t l = 0; l < L; ++l) {
      std::vector<int32_t> row(ids.begin() + static_cast<int64_t>((r * L + l) * k),
                               ids.begin() + static_cast<int64_t>((r * L + l + 1) * k));
      if (!c.is_moe_layer(static_cast<int64_t>(l))) {
        EXPECT_EQ(row, std::vector<int32_t>(k, 0)) << "dense layer " << l;
        continue;
      }
      for (int32_t e : row) ASSERT_TRUE(e >= 0 && e < c.n_routed_experts) << "row " << r << " layer " << l << ": " << e;
      std::sort(row.begin(), row.end());
      EXPECT_EQ(std::adjacent_find(row.begin(), row.end()), row.end()) << "row " << r << " layer " << l;
    }
  EXPECT_EQ(b["meta_info"]["routed_experts"], a["meta_info"]["routed_experts"]);
  const json cmp = post_json(s.port(), "/v1/completions",
                             json{{"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true},
                                  {"return_routed_experts", true}}
                                 .dump());
  EXPECT_EQ(cmp["choices"][0]["routed_experts"], a["meta_info"]["routed_experts"]);
  EXPECT_EQ(s.stop(), 0);
}

TEST(ServeFlags, ModelConfigOverrides) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const std::string req = R"({"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
      "ignore_eos": true})";
  std::string plain_text;
  {
    ServerProcess plain;
    ASSERT_TRUE(plain.running()) << plain.log();
    plain_text = post_json(plain.port(), "/v1/completions", req)["choices"][0]["text"];
    EXPECT_EQ(plain.stop(), 0);
  }
  ServerProcess ctx({"--hf-overrides", R"({"max_position_embeddings": 1000})"});
  ASSERT_TRUE(ctx.running()) << ctx.log();
  EXPECT_EQ(get_json(ctx.port(), "/get_model_info")["max_context_length"], 1000);
  std::string long_prompt;
  for (int i = 0; i < 600; ++i) long_prompt += "fox jumps ";
  const auto too_long = http_request(ctx.port(), "POST", "/v1/completions",
                                     R"({"prompt": ")" + long_prompt + R"(", "max_tokens": 4})");
  EXPECT_EQ(too_long.status, 400) << too_long.body;
  EXPECT_EQ(post_json(ctx.port(), "/v1/completions", req)["choices"][0]["text"], plain_text) << "the same model";
  EXPECT_EQ(ctx.stop(), 0);
  ServerProcess one({"--json-model-override-args", R"({"num_hidden_layers": 1})"});
  ASSERT_TRUE(one.running()) << one.log();
  EXPECT_NE(one.log().find(": 1 layers,"), std::string::npos) << one.log();
  EXPECT_NE(post_json(one.port(), "/v1/completions", req)["choices"][0]["text"], plain_text);
  EXPECT_EQ(one.stop(), 0);
  expect_serve_refuses({"--hf-overrides '[1]'", "--hf-overrides '{\"x\": 1}' --json-model-override-args '{}'",
                        "--hf-overrides '{\"num_hidden_layers\": \"four\"}'", "--json-model-override-args '{'"},
                       "override");
}

TEST(ServeFlags, VllmNamesAndPerformanceOnlyFlags) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  ServerProcess s({"--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", "8", "--gpu-memory-utilization",
                   "0.5", "--no-enable-prefix-caching", "--block-size", "32", "--reasoning-parser", "deepseek_r1",
                   "--enable-auto-tool-choice", "--enable-torch-compile", "--attention-backend", "fa3",
                   "--cuda-graph-bs", "1", "2", "4", "--disable-log-requests", "--enable-dp-lm-head",
                   "--moe-dense-tp-size", "1", "--ep-size", "1", "--enable-two-batch-overlap", "--revision", "main",
                   "--base-gpu-id", "0", "--gpu-id-step", "1", "--enable-expert-parallel", "--enable-chunked-prefill",
                   "--swap-space", "16", "--uvicorn-log-level", "warning", "--compilation-config", R"({"level": 3})",
                   "--async-scheduling", "--enable-eplb", "--ep-num-redundant-experts", "32", "--pipeline-parallel-size",
                   "1", "--max-logprobs", "2", "--return-tokens-as-token-ids", "--served-model-name", "tiny-v3",
                   "org/tiny", "--default-chat-template-kwargs", R"({"thinking": false})", "--response-role",
                   "assistant", "--chat-template-content-format", "string", "--schedule-policy", "dfs-weight",
                   "--shared-experts-fusion", "on"});
  ASSERT_TRUE(s.running()) << s.log();
  // (fusion is asked for, but the experts are split by expert)
  EXPECT_NE(s.log().find("--shared-experts-fusion on: the shared experts stay apart (expert parallelism)"),
            std::string::npos) << s.log();
  // Two served names: both listed, either answered under its own name.
  const json models = get_json(s.port(), "/v1/models");
  ASSERT_EQ(models["data"].size(), 2u) << models.dump();
  EXPECT_EQ(models["data"][1]["id"], "org/tiny");
  EXPECT_EQ(post_json(s.port(), "/v1/completions", R"({"model": "org/tiny", "prompt": "a", "max_tokens": 1})")["model"],
            "org/tiny");
  const json info = get_json(s.port(), "/get_server_info");
  EXPECT_EQ(info["context_length"], 2048);
  EXPECT_EQ(info["max_running_requests"], 8);
  EXPECT_EQ(info["mem_fraction_static"], 0.5);
  EXPECT_EQ(info["disable_radix_cache"], true);
  EXPECT_EQ(info["page_size"], 32);
  EXPECT_EQ(info["base_gpu_id"], 0);
  EXPECT_EQ(info["gpu_id_step"], 1);
  EXPECT_EQ(info["ep_size"], 1);  // (--enable-expert-parallel over one rank, --ep-size 1)
  EXPECT_EQ(info["shared_experts_fusion"], "on");
  EXPECT_EQ(info["disable_shared_experts_fusion"], false);
  EXPECT_EQ(get_json(s.port(), "/get_model_info")["max_context_length"], 2048);
  for (const char* logged : {"--enable-torch-compile: accepted for compatibility, no effect here",
                             "--attention-backend fa3: accepted", "--cuda-graph-bs 1 2 4: accepted",
                             "--enable-dp-lm-head: accepted", "--moe-dense-tp-size 1: accepted",
                             "--enable-two-batch-overlap: accepted", "--revision main: accepted",
                             "--swap-space 16: accepted",
                             "--compilation-config {\"level\": 3}: accepted", "--ep-num-redundant-experts 32: accepted",
                             "--chat-template-content-format string: accepted",
                             "--schedule-policy dfs-weight: accepted"})
    EXPECT_NE(s.log().find(logged), std::string::npos) << logged << "\n" << s.log();
  // deepseek_r1 is the reasoning parser: chat answers carry reasoning_content.
  const json chat = post_json(s.port(), "/v1/chat/completions",
                              R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})");
  EXPECT_TRUE(chat["choices"][0]["message"].contains("reasoning_content")) << chat.dump();
  // --max-logprobs 2: two top logprobs pass, three are a 400 naming the field.
  const std::string lp = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": true,
      "top_logprobs": N})";
  const auto two = http_request(s.port(), "POST", "/v1/chat/completions", std::regex_replace(lp, std::regex("N"), "2"));
  ASSERT_EQ(two.status, 200) << two.body;
  // --return-tokens-as-token-ids: the tokens as "token_id:ID".
  const std::string token = json::parse(two.body)["choices"][0]["logprobs"]["content"][0]["token"];
  EXPECT_TRUE(std::regex_match(token, std::regex("token_id:[0-9]+"))) << token;
  const auto over = http_request(s.port(), "POST", "/v1/chat/completions", std::regex_replace(lp, std::regex("N"), "3"));
  EXPECT_EQ(over.status, 400);
  EXPECT_NE(over.body.find("top_logprobs"), std::string::npos) << over.body;
  EXPECT_EQ(s.stop(), 0);

  // `serve MODEL` (vLLM's form); the model named twice differently is an error.
  auto r = run_command(mlaserve_cmd(12) + " serve " + e2e_model_dir() + " --tokenizer " +
                       deepseek_tokenizer_dir() + " --load-format dummy --device cpu --port 0 --max-total-tokens 4096");
  EXPECT_NE(r.output.find("serving '" + e2e_model_dir() + "'"), std::string::npos) << r.output;
  r = run_command(mlaserve_cmd(60) + " serve " + e2e_model_dir() + " --model-path /x");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("the model is given twice"), std::string::npos) << r.output;
  r = run_command(mlaserve_cmd(60) + " serve --load-format dummy");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--model-path is required"), std::string::npos) << r.output;
  expect_serve_refuses({"--base-gpu-id -1"}, "--base-gpu-id must be >= 0");
  expect_serve_refuses({"--pipeline-parallel-size 2"}, "--pipeline-parallel-size 2");
  expect_serve_refuses({"--pipeline-parallel-size 0"}, "--pipeline-parallel-size must be >= 1");
  expect_serve_refuses({"--gpu-id-step 0"}, "--gpu-id-step must be >= 1");
  expect_serve_refuses({"--load-balance-method fastest"}, "--load-balance-method");
  expect_serve_refuses({"--schedule-policy fifo"}, "--schedule-policy");
  // On GPUs (SGLang's --base-gpu-id): a first GPU past the visible ones is refused, naming it.
  if (e2e_env("MLASERVE_E2E_DEVICE", "cpu") == "cuda")
    expect_serve_refuses({"--device cuda --skip-tokenizer-init --base-gpu-id 64"}, "GPU 64 requested");
}

// SGLang's --enable-priority-scheduling (higher values first) with one running request at a time: of two requests
// queued behind a long one, the higher priority runs first though it came later; vLLM's --scheduling-policy priority
// and bad combinations of the flags.
// N-gram speculative decoding through the real binary: SGLang's flags and vLLM's --speculative-config give the same
// greedy answers as a server without drafts (three allowed tokens make the dummy model loop, so drafts are kept),
// counted in /metrics and /get_server_info; unknown algorithms and keys are refused at startup.
TEST(ServeFlags, NgramSpeculativeDecodingKeepsTheAnswers) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const std::string req = R"({"prompt": "one two three one two three one two", "max_tokens": 48, "temperature": 0,
      "ignore_eos": true, "allowed_token_ids": [1000, 1001, 1002], "logprobs": 1})";
  ServerProcess plain;
  ASSERT_TRUE(plain.running()) << plain.log();
  const json want = post_json(plain.port(), "/v1/completions", req);
  EXPECT_EQ(plain.stop(), 0);
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"},
        std::vector<std::string>{"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 2, "disable_by_batch_size": 8})"}}) {
    ServerProcess spec(flags);
    ASSERT_TRUE(spec.running()) << spec.log();
    const json info = get_json(spec.port(), "/get_server_info");
    EXPECT_EQ(info["speculative_algorithm"], "NGRAM");
    const json got = post_json(spec.port(), "/v1/completions", req);
    EXPECT_EQ(got["choices"][0]["text"], want["choices"][0]["text"]) << flags[0];
    EXPECT_EQ(got["choices"][0]["logprobs"]["tokens"], want["choices"][0]["logprobs"]["tokens"]);
    EXPECT_EQ(got["usage"]["completion_tokens"], 48);
    const json states = get_json(spec.port(), "/get_server_info")["internal_states"];
    EXPECT_GT(states[0]["spec_accepted_tokens"].get<int64_t>(), 10) << states.dump();
    EXPECT_GT(states[0]["avg_spec_accept_length"].get<double>(), 1.2) << states.dump();
    EXPECT_NEAR(states[0]["avg_spec_accept_length"].get<double>(),
                1.0 + states[0]["spec_accepted_tokens"].get<double>() / states[0]["spec_checks"].get<double>(), 1e-9);
    const std::string metrics = http_request(spec.port(), "GET", "/metrics").body;
    EXPECT_NE(metrics.find("mlaserve:spec_decode_num_accepted_tokens_total "), std::string::npos);
    EXPECT_EQ(spec.stop(), 0);
  }
  expect_serve_refuses({"--speculative-algorithm EAGLE3", "--speculative-num-draft-tokens 3",
                        "--speculative-algorithm NGRAM --speculative-num-draft-tokens -1",
                        "--speculative-algorithm NGRAM --speculative-num-draft-tokens 65",
                        "--speculative-config '{\"method\": \"ngram\", \"bogus\": 1}'",
                        "--speculative-config '{\"method\": \"eagle3\", \"num_speculative_tokens\": 2}'",
                        "--speculative-config '{\"method\": \"ngram\", \"disable_by_batch_size\": -1}'",
                        "--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4294967297}'",
                        "--speculative-disable-by-batch-size 4",
                        "--speculative-algorithm NGRAM --speculative-ngram-min-match-window-size 4 "
                        "--speculative-ngram-max-match-window-size 2"},
                       "specul");
}

// Requests' sampling defaults from a generation_config.json (vLLM's --generation-config auto / a folder, SGLang's
// --sampling-defaults model): a request without a temperature gets the file's (0 here: greedy, so two such requests
// answer as an explicit temperature 0 does); its max_new_tokens limits OpenAI requests' tokens, as vLLM reads it
// (not SGLang's /generate); vLLM's --override-generation-config goes over the file's values (alone with `vllm`);
// `vllm` / `openai` take none; a bad file or value exits naming it.
TEST(ServeFlags, GenerationConfigSamplingDefaults) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const auto dir = std::filesystem::temp_directory_path() / ("mlaserve_gencfg_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "bad");
  std::ofstream(dir / "generation_config.json") << R"({"do_sample": true, "temperature": 0.0, "top_p": 0.9,
      "eos_token_id": 1, "max_new_tokens": 20})";
  std::ofstream(dir / "bad" / "generation_config.json") << R"({"temperature": "hot"})";
  const std::string free = R"({"prompt": "Tell me a story about", "max_tokens": 24, "ignore_eos": true})";
  const std::string greedy = R"({"prompt": "Tell me a story about", "max_tokens": 24, "ignore_eos": true,
      "temperature": 0})";
  {
    ServerProcess s({"--generation-config", dir.string()});
    ASSERT_TRUE(s.running()) << s.log();
    const json info = get_json(s.port(), "/get_server_info");
    EXPECT_EQ(info["default_sampling_params"], json::parse(R"({"temperature": 0.0, "top_p": 0.9, "max_tokens": 20})"))
        << info.dump();
    const json g = post_json(s.port(), "/v1/completions", greedy);
    EXPECT_EQ(g["usage"]["completion_tokens"], 20);
    EXPECT_EQ(g["choices"][0]["finish_reason"], "length");
    const std::string want = g["choices"][0]["text"];
    for (int k = 0; k < 2; ++k)
      EXPECT_EQ(post_json(s.port(), "/v1/completions", free)["choices"][0]["text"], want) << "run " << k;
    const json chat = post_json(s.port(), "/v1/chat/completions",
                                R"({"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": true})");
    EXPECT_EQ(chat["usage"]["completion_tokens"], 20);
    const json native = post_json(s.port(), "/generate", R"({"text": "Tell me a story about", "sampling_params":
        {"max_new_tokens": 24, "ignore_eos": true}})");
    EXPECT_EQ(native["meta_info"]["completion_tokens"], 24);
    EXPECT_NE(s.log().find("sampling defaults from generation_config.json"), std::string::npos) << s.log();
    EXPECT_EQ(s.stop(), 0);
  }
  for (const auto& [flags, want] :
       {std::pair{std::vector<std::string>{"--generation-config", dir.string(), "--override-generation-config",
                                           R"({"top_p": 0.5, "max_new_tokens": 6})"},
                  json::parse(R"({"temperature": 0.0, "top_p": 0.5, "max_tokens": 6})")},
        std::pair{std::vector<std::string>{"--generation-config", "vllm", "--override-generation-config",
                                           R"({"max_new_tokens": 6})"},
                  json::parse(R"({"max_tokens": 6})")}}) {
    ServerProcess s(flags);
    ASSERT_TRUE(s.running()) << s.log();
    EXPECT_EQ(get_json(s.port(), "/get_server_info")["default_sampling_params"], want) << flags[1];
    EXPECT_EQ(post_json(s.port(), "/v1/completions", greedy)["usage"]["completion_tokens"], 6) << flags[1];
    EXPECT_EQ(s.stop(), 0);
  }
  for (const std::vector<std::string>& none : {std::vector<std::string>{"--generation-config", "vllm"},
                                               std::vector<std::string>{"--generation-config", dir.string(),
                                                                        "--sampling-defaults", "openai"}}) {
    ServerProcess s(none);
    ASSERT_TRUE(s.running()) << s.log();
    EXPECT_EQ(get_json(s.port(), "/get_server_info")["default_sampling_params"], json::object()) << none[1];
    EXPECT_EQ(s.stop(), 0);
  }
  expect_serve_refuses({"--generation-config " + (dir / "missing").string()}, "--generation-config");
  expect_serve_refuses({"--sampling-defaults bogus"}, "--sampling-defaults");
  expect_serve_refuses({"--generation-config " + (dir / "bad").string()}, "'temperature' must be a number");
  expect_serve_refuses({"--override-generation-config '{bad'"}, "--override-generation-config: not JSON");
  expect_serve_refuses({"--override-generation-config '{\"top_p\": 7}'"},
                       "--override-generation-config: 'top_p' must be a number in [0, 1]");
  std::filesystem::remove_all(dir);
}

// vLLM's --trust-request-chat-template: a chat request's own Jinja template renders its prompt (the real tokenizer's
// special tokens and add_generation_prompt reach it); one that does not parse is a 400 naming chat_template.
TEST(ServeFlags, TrustRequestChatTemplate) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  ServerProcess s({"--trust-request-chat-template"});
  ASSERT_TRUE(s.running()) << s.log();
  const std::string tmpl =
      "{{ bos_token }}{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}"
      "{% if add_generation_prompt %}A:{% endif %}";
  const json messages = json::array({json{{"role", "user"}, {"content", "hi"}}});
  const json t = post_json(s.port(), "/tokenize", json{{"messages", messages}, {"chat_template", tmpl}}.dump());
  const json text = post_json(s.port(), "/detokenize", json{{"tokens", t["tokens"]}}.dump());
  EXPECT_EQ(text["prompt"], "<｜begin▁of▁sentence｜><<user:hi>>A:");
  const json c = post_json(s.port(), "/v1/chat/completions",
                           json{{"messages", messages}, {"max_tokens", 2}, {"chat_template_kwargs",
                                {{"chat_template", tmpl}}}}.dump());
  EXPECT_EQ(c["usage"]["prompt_tokens"], t["count"]);
  const json bad = post_json(s.port(), "/v1/chat/completions",
                             json{{"messages", messages}, {"chat_template", "{% for %}"}}.dump(), 400);
  EXPECT_EQ(bad["error"]["param"], "chat_template");
  EXPECT_EQ(s.stop(), 0);
}

// SGLang's --log-requests (vLLM's --enable-log-requests): a log line as each generation request arrives and one as it
// finishes, naming its id; none without the flag.
TEST(ServeFlags, LogRequests) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  // (flags, level: -1 none; max_log_len)
  const std::vector<std::tuple<std::vector<std::string>, int, int>> cases = {
      {{"--log-requests"}, 2, 2048},
      {{"--enable-log-requests", "--log-requests-level", "0"}, 0, 0},
      {{"--log-requests", "--log-requests-level", "3", "--max-log-len", "2"}, 3, 2},
      {{}, -1, 0}};
  for (const auto& [flags, level, max_len] : cases) {
    SCOPED_TRACE(::testing::PrintToString(flags));
    ServerProcess s(flags);
    ASSERT_TRUE(s.running()) << s.log();
    const json r = post_json(s.port(), "/generate", R"({"text": "Hello", "sampling_params": {"max_new_tokens": 3,
        "ignore_eos": true, "temperature": 0}})");
    const std::string id = r["meta_info"]["id"];
    EXPECT_EQ(s.stop(), 0);
    const std::string log = s.log();
    auto line = [&](const std::string& what) {  // the log line of request `id` that starts so ("" if none)
      const size_t at = log.find("request " + id + " " + what);
      return at == std::string::npos ? std::string() : log.substr(at, log.find('\n', at) - at);
    };
    const std::string received = line("received: POST /generate, 1 prompt(s) x n 1, ");
    const std::string finished = line("finished: ");
    EXPECT_EQ(!received.empty(), level >= 0) << log;
    EXPECT_EQ(!finished.empty(), level >= 0) << log;
    if (level < 0) continue;
    EXPECT_TRUE(finished.find(R"({"length":3,"type":"length"})") != std::string::npos ||
                finished.find(R"({"type":"length","length":3})") != std::string::npos)
        << finished;
    EXPECT_EQ(received.find("sampling: max_new_tokens 3, temperature 0, ") != std::string::npos, level >= 1)
        << received;
    const std::string text = r["text"];
    if (level < 2) {
      EXPECT_EQ(received.find(", prompt "), std::string::npos) << received;
      EXPECT_EQ(finished.find(", text "), std::string::npos) << finished;
    } else if (max_len >= 5) {
      EXPECT_NE(received.find(R"(, prompt "Hello")"), std::string::npos) << received;
      EXPECT_NE(finished.find(", text " + json(text).dump()), std::string::npos) << finished;
    } else {
      EXPECT_NE(received.find(R"(, prompt "He"...(3 more bytes))"), std::string::npos) << received;
      EXPECT_NE(finished.find(", text "), std::string::npos) << finished;
    }
  }
}

// SGLang's /configure_logging turns request logging on and off (and sets its level) while the server runs.
TEST(ServeFlags, ConfigureLogging) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  ServerProcess s(std::vector<std::string>{});
  ASSERT_TRUE(s.running()) << s.log();
  auto generate = [&] {
    return post_json(s.port(), "/generate", R"({"text": "Hi", "sampling_params": {"max_new_tokens": 2}})")["meta_info"]
                    ["id"]
        .get<std::string>();
  };
  const std::string quiet = generate();
  auto r = http_request(s.port(), "POST", "/configure_logging", R"({"log_requests": true, "log_requests_level": 1})");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.body.empty());
  const std::string logged = generate();
  EXPECT_EQ(http_request(s.port(), "POST", "/configure_logging", R"({"log_requests": false})").status, 200);
  const std::string quiet_again = generate();
  for (const char* bad : {R"({"log_requests_level": 4})", R"({"log_requests": "yes"})",
                          R"({"dump_requests_folder": "/tmp/dumps"})", R"({"verbose": true})", "[1]"}) {
    r = http_request(s.port(), "POST", "/configure_logging", bad);
    EXPECT_EQ(r.status, 400) << bad << " -> " << r.body;
    EXPECT_TRUE(json::parse(r.body)["error"]["message"].is_string()) << r.body;
  }
  EXPECT_EQ(s.stop(), 0);
  const std::string log = s.log();
  EXPECT_EQ(log.find("request " + quiet + " received"), std::string::npos) << log;
  const size_t at = log.find("request " + logged + " received");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string line = log.substr(at, log.find('\n', at) - at);
  EXPECT_NE(line.find("sampling: max_new_tokens 2"), std::string::npos) << line;
  EXPECT_EQ(line.find(", prompt "), std::string::npos) << line;  // (level 1)
  EXPECT_NE(log.find("request " + logged + " finished"), std::string::npos) << log;
  EXPECT_EQ(log.find("request " + quiet_again + " received"), std::string::npos) << log;
}

// vLLM's --enable-request-id-headers: responses carry X-Request-Id, the request's own or a new one (none without it).
TEST(ServeFlags, RequestIdHeaders) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  {
    ServerProcess s;
    ASSERT_TRUE(s.running()) << s.log();
    EXPECT_EQ(http_request(s.port(), "GET", "/health", "", "X-Request-Id: abc-1\r\n").headers.count("x-request-id"), 0u);
    EXPECT_EQ(s.stop(), 0);
  }
  ServerProcess s({"--enable-request-id-headers"});
  ASSERT_TRUE(s.running()) << s.log();
  EXPECT_EQ(http_request(s.port(), "GET", "/health", "", "X-Request-Id: abc-1\r\n").headers["x-request-id"], "abc-1");
  auto r = http_request(s.port(), "POST", "/v1/completions", R"({"prompt": "hi", "max_tokens": 2})");
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(std::regex_match(r.headers["x-request-id"], std::regex("[0-9a-f]{32}"))) << r.headers["x-request-id"];
  auto bad = http_request(s.port(), "GET", "/health", "", "X-Request-Id: " + std::string(200, 'x') + "\r\n");
  EXPECT_EQ(bad.headers["x-request-id"].size(), 32u) << "a given id over 128 characters is replaced";
  EXPECT_EQ(s.stop(), 0);
}

// SGLang's --allow-auto-truncate: a prompt too long for the context keeps its first tokens, room left for the tokens
// asked for, instead of a 400 (which a server without the flag answers).
TEST(ServeFlags, AllowAutoTruncateKeepsThePromptsFirstTokens) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  std::vector<int32_t> ids;
  for (int i = 0; i < 100; ++i) ids.push_back(1000 + i);
  const std::string body = R"({"input_ids": )" + json(ids).dump() +
                           R"(, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}})";
  const std::string plain = R"({"input_ids": )" + json(std::vector<int32_t>(ids.begin(), ids.begin() + 56)).dump() +
                            R"(, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}})";
  {
    ServerProcess s({"--context-length", "64"});
    ASSERT_TRUE(s.running()) << s.log();
    EXPECT_EQ(http_request(s.port(), "POST", "/generate", body).status, 400);
    EXPECT_EQ(s.stop(), 0);
  }
  ServerProcess s({"--context-length", "64", "--allow-auto-truncate"});
  ASSERT_TRUE(s.running()) << s.log();
  const json got = post_json(s.port(), "/generate", body);
  EXPECT_EQ(got["meta_info"]["prompt_tokens"], 56) << got.dump();  // 64 - 8
  EXPECT_EQ(got["output_ids"], post_json(s.port(), "/generate", plain)["output_ids"]) << "the first 56 tokens'";
  // Asking for more than the context: the prompt keeps one token, the answer what fits.
  const json most = post_json(s.port(), "/v1/completions", R"({"prompt": )" + json(ids).dump() +
                                                              R"(, "max_tokens": 500, "ignore_eos": true})");
  EXPECT_EQ(most["usage"]["prompt_tokens"], 1) << most.dump();
  EXPECT_EQ(most["usage"]["completion_tokens"], 63);
  EXPECT_NE(s.log().find("--allow-auto-truncate"), std::string::npos);
  EXPECT_EQ(s.stop(), 0);
}

// A --context-length past the model's max_position_embeddings exits naming SGLang's variable that allows it (as SGLang
// and vLLM refuse it); with the variable set the server serves that context, with a warning.
TEST(ServeFlags, ContextPastTheModelsNeedsTheVariable) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  expect_serve_refuses({"--context-length 100000 --tokenizer-path " + deepseek_tokenizer_dir()},
                       "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1");
  ::setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1", 1);  // (the server started next inherits it)
  ServerProcess s({"--context-length", "100000"});
  ::unsetenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN");
  ASSERT_TRUE(s.running()) << s.log();
  EXPECT_EQ(get_json(s.port(), "/get_model_info")["max_context_length"], 100000);
  EXPECT_NE(s.log().find("outputs past 5120 positions may be wrong"), std::string::npos) << s.log();
  EXPECT_EQ(s.stop(), 0);
}

// SGLang's --stream-output: a streamed /generate's chunks carry only what is new (text, output_ids, output logprobs;
// the prompt's logprobs in the first); joined they are the whole answer. Without the flag they are cumulative (the
// byte-for-byte test above); OpenAI streams are deltas either way.
TEST(ServeFlags, StreamOutputSendsDisjointSegments) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  ServerProcess s({"--stream-output", "--stream-interval", "3"});
  ASSERT_TRUE(s.running()) << s.log();
  EXPECT_EQ(get_json(s.port(), "/get_server_info")["stream_output"], true);
  const std::string body = R"({"text": "Once upon a time, in a land far away,", "sampling_params": {"max_new_tokens": 20,
      "temperature": 0, "ignore_eos": true}, "return_logprob": true, "logprob_start_len": 0})";
  const json whole = post_json(s.port(), "/generate", body);
  const auto r = http_request(s.port(), "POST", "/generate", std::string(body).insert(1, R"("stream": true, )"));
  ASSERT_EQ(r.status, 200);
  std::string text;
  std::vector<int32_t> ids;
  size_t chunks = 0, pos = 0, lps = 0, input_lps = 0;
  for (size_t at; (at = r.body.find("data: ", pos)) != std::string::npos;) {
    const size_t end = r.body.find("\n\n", at);
    ASSERT_NE(end, std::string::npos);
    pos = end + 2;
    const std::string data = r.body.substr(at + 6, end - at - 6);
    if (data == "[DONE]") break;
    const json c = json::parse(data);
    ++chunks;
    text += c["text"].get<std::string>();
    const std::vector<int32_t> part = c["output_ids"];
    EXPECT_LE(part.size(), 3u);
    EXPECT_EQ(c["meta_info"]["output_token_logprobs"].size(), part.size()) << "the chunk's tokens' logprobs";
    lps += part.size();
    ids.insert(ids.end(), part.begin(), part.end());
    if (c["meta_info"].contains("input_token_logprobs")) {
      EXPECT_EQ(chunks, 1u) << "the prompt's logprobs go with the first chunk";
      input_lps = c["meta_info"]["input_token_logprobs"].size();
    }
    EXPECT_EQ(c["meta_info"]["completion_tokens"], ids.size());
  }
  EXPECT_GE(chunks, 7u);
  EXPECT_EQ(text, whole["text"]);
  EXPECT_EQ(ids, whole["output_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(lps, 20u);
  EXPECT_EQ(input_lps, whole["meta_info"]["input_token_logprobs"].size());
  EXPECT_EQ(s.stop(), 0);
}

// Drafts from the checkpoint's MTP layer through the real binary (the tiny model's config has one, as DeepSeek-V3's):
// SGLang's DeepSeek recipes (EAGLE, 1 step, top-k 1, 2 draft tokens; 3 steps and 4 draft tokens, also its default
// with NEXTN), vLLM's deepseek_mtp with 1 and 3 tokens give the answers of a server without drafts (greedy tokens and
// logprobs; seeded sampling too on the CPU), every decode step checks drafts; trees and draft counts out of range
// are refused at startup. Three allowed tokens keep the greedy
// choices far from ties: on the GPU a step checking a draft computes its rows in another shape than a plain decode
// step (a rounding that can flip the near ties of random weights, as batch composition can; docs/perf.md).
TEST(ServeFlags, MtpSpeculativeDecodingKeepsTheAnswers) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const std::string greedy = R"({"prompt": "The quick brown fox jumps over", "max_tokens": 40, "temperature": 0,
      "ignore_eos": true, "logprobs": 1, "allowed_token_ids": [1000, 1001, 1002]})";
  const bool cpu = e2e_env("MLASERVE_E2E_DEVICE", "cpu") == "cpu";
  const std::string seeded = R"({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.9, "seed": 5,
      "ignore_eos": true})";
  ServerProcess plain;
  ASSERT_TRUE(plain.running()) << plain.log();
  const json want = post_json(plain.port(), "/v1/completions", greedy);
  const json want_seeded = post_json(plain.port(), "/v1/completions", seeded);
  EXPECT_EQ(plain.stop(), 0);
  using Flags = std::vector<std::string>;
  for (const auto& [flags, steps] :
       {std::pair{Flags{"--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1", "--speculative-eagle-topk",
                        "1", "--speculative-num-draft-tokens", "2"}, 1},
        std::pair{Flags{"--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk",
                        "1", "--speculative-num-draft-tokens", "4"}, 3},
        std::pair{Flags{"--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", e2e_model_dir() + "/"},
                  3},
        std::pair{Flags{"--speculative-config", R"({"method": "deepseek_mtp", "num_speculative_tokens": 1})"}, 1},
        std::pair{Flags{"--speculative-config", R"({"method": "mtp", "num_speculative_tokens": 3})"}, 3}}) {
    ServerProcess spec(flags);
    ASSERT_TRUE(spec.running()) << spec.log();
    const json info = get_json(spec.port(), "/get_server_info");
    EXPECT_EQ(info["speculative_algorithm"], "EAGLE");
    EXPECT_EQ(info["speculative_num_steps"], steps) << flags[1];
    EXPECT_EQ(info["speculative_num_draft_tokens"], steps + 1) << flags[1];
    const json got = post_json(spec.port(), "/v1/completions", greedy);
    EXPECT_EQ(got["choices"][0]["text"], want["choices"][0]["text"]) << flags[1];
    EXPECT_EQ(got["choices"][0]["logprobs"]["tokens"], want["choices"][0]["logprobs"]["tokens"]);
    if (cpu) {
      EXPECT_EQ(post_json(spec.port(), "/v1/completions", seeded)["choices"][0]["text"],
                want_seeded["choices"][0]["text"]);
    }
    const json states = get_json(spec.port(), "/get_server_info")["internal_states"];
    EXPECT_GE(states[0]["spec_checks"].get<int64_t>(), 30 / steps) << states.dump();
    EXPECT_GT(states[0]["spec_draft_tokens"].get<int64_t>(), states[0]["spec_checks"].get<int64_t>() * (steps - 1))
        << states.dump();
    EXPECT_EQ(spec.stop(), 0);
  }
  expect_serve_refuses({"--speculative-algorithm EAGLE --speculative-num-steps 9",
                        "--speculative-algorithm EAGLE --speculative-eagle-topk 4",
                        "--speculative-algorithm EAGLE --speculative-num-draft-tokens 1",
                        "--speculative-config '{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 9}'",
                        "--speculative-algorithm NGRAM --speculative-num-steps 1",
                        "--speculative-algorithm EAGLE --speculative-draft-model-path /tmp",
                        "--speculative-algorithm NGRAM --speculative-draft-model-path /tmp",
                        "--speculative-draft-model-path /tmp"},
                       "specul");
}

// --kv-cache-dtype fp8_e4m3 and fp8_e5m2 (SGLang's and vLLM's values; "fp8" too, here under DP attention): served,
// the same greedy answer again from the prefix cache's FP8 rows; unknown types refused with the flag named.
TEST(ServeFlags, Fp8KvCacheServes) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  std::string prompt;
  for (int i = 0; i < 12; ++i) prompt += "The capital of France is a city that the river divides in two. ";
  const std::string req = R"({"prompt": ")" + prompt + R"(", "max_tokens": 24, "temperature": 0, "ignore_eos": true})";
  std::vector<std::vector<std::string>> layouts = {{"--kv-cache-dtype", "fp8_e4m3"}, {"--kv-cache-dtype", "fp8_e5m2"}};
  if (e2e_devices() >= 2)
    layouts.push_back({"--kv-cache-dtype", "fp8", "--tp", "2", "--dp", "2", "--enable-dp-attention"});
  for (const std::vector<std::string>& flags : layouts) {
    ServerProcess s(flags);
    ASSERT_TRUE(s.running()) << s.log();
    EXPECT_EQ(get_json(s.port(), "/get_server_info")["kv_cache_dtype"], flags[1]);
    const json first = post_json(s.port(), "/v1/completions", req);
    const json second = post_json(s.port(), "/v1/completions", req);  // under DP attention the other group's cache
    const json again = post_json(s.port(), "/v1/completions", req);   // and the first group's again (round robin)
    EXPECT_EQ(first["usage"]["completion_tokens"], 24) << first.dump();
    EXPECT_EQ(second["choices"][0]["text"], first["choices"][0]["text"]);
    EXPECT_EQ(again["choices"][0]["text"], first["choices"][0]["text"]);
    ASSERT_TRUE(again["usage"].contains("prompt_tokens_details")) << again.dump();
    EXPECT_GT(again["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), 100) << again.dump();
    EXPECT_EQ(s.stop(), 0);
  }
  expect_serve_refuses({"--kv-cache-dtype int8", "--kv-cache-dtype fp8_e3m4"}, "--kv-cache-dtype");
}

// --enable-hierarchical-cache (SGLang's; vLLM's --kv-offloading-size): with a device pool that holds one of these
// prompts at a time, a prompt run again after five others still finds its prefix (copied back from the host tier) and
// answers the same; without the tier nothing of it is left. (Under DP attention the requests alternate between the
// groups: the prompt's group has run three others in between.) Bad sizes and policies are refused naming the flag.
TEST(ServeFlags, HierarchicalCacheKeepsEvictedPrefixes) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const auto req = [](const std::string& lead) {
    std::string prompt = lead;
    for (int i = 0; i < 20; ++i) prompt += " The capital of France is a city that the river divides in two.";
    return R"({"prompt": ")" + prompt + R"(", "max_tokens": 16, "temperature": 0, "ignore_eos": true})";
  };
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--enable-hierarchical-cache", "--hicache-ratio", "8", "--max-total-tokens", "448"},
        std::vector<std::string>{"--kv-offloading-size", "0.01", "--max-total-tokens", "448"},
        std::vector<std::string>{"--max-total-tokens", "448"}}) {
    const bool tier = flags.size() > 2;
    ServerProcess s(flags);
    ASSERT_TRUE(s.running()) << s.log();
    const json info = get_json(s.port(), "/get_server_info");
    EXPECT_EQ(info["enable_hierarchical_cache"], tier);
    const json first = post_json(s.port(), "/v1/completions", req("Alpha."));
    for (const char* lead : {"Xray.", "Beta.", "Yankee.", "Gamma.", "Zulu."})
      post_json(s.port(), "/v1/completions", req(lead));
    const json again = post_json(s.port(), "/v1/completions", req("Alpha."));
    ASSERT_EQ(first["usage"]["completion_tokens"], 16) << first.dump();
    EXPECT_EQ(again["choices"][0]["text"], first["choices"][0]["text"]) << flags[0];
    const int64_t prompt_tokens = first["usage"]["prompt_tokens"].get<int64_t>();
    ASSERT_GT(prompt_tokens, 250);
    const int64_t cached = again["usage"].contains("prompt_tokens_details")
                               ? again["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>()
                               : 0;
    const json st = get_json(s.port(), "/get_server_info")["internal_states"][0];
    const std::string metrics = http_request(s.port(), "GET", "/metrics").body;
    EXPECT_EQ(metrics.find("mlaserve:host_loaded_prompt_tokens_total ") != std::string::npos, tier) << metrics;
    if (tier) {
      EXPECT_GE(cached, prompt_tokens - 32) << again.dump();
      EXPECT_GT(st["kv_host_tokens_total"].get<int64_t>(), 0) << st.dump();
      EXPECT_GE(st["host_loaded_tokens_total"].get<int64_t>(), cached - 16) << st.dump();
    } else {
      EXPECT_LT(cached, 64) << again.dump();
      EXPECT_FALSE(st.contains("kv_host_tokens_total")) << st.dump();
    }
    EXPECT_EQ(s.stop(), 0);
  }
  const std::string no_tok = " --skip-tokenizer-init";
  expect_serve_refuses({"--enable-hierarchical-cache --hicache-write-policy sometimes" + no_tok},
                       "--hicache-write-policy");
  expect_serve_refuses({"--enable-hierarchical-cache --hicache-size 1000000" + no_tok}, "--hicache-size");
  expect_serve_refuses({"--enable-hierarchical-cache --disable-radix-cache" + no_tok}, "--disable-radix-cache");
  expect_serve_refuses({"--kv-offloading-size -1" + no_tok}, "--kv-offloading-size");
}

// Prefill / decode disaggregation as vLLM's proxies drive it (kv_transfer_params): the prefill server answers with
// parameters naming itself, the decode server reads the prompt's KV from it and computes only the rest: the same
// greedy text as computing it all, for completions and chat (streamed too), the decode side in DP attention as well;
// a prefill server that cannot be reached costs only the computation; bad parameters are 400s.
TEST(ServeFlags, PrefillDecodeDisaggregation) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  // (Two servers share a GPU: each takes at most 0.4 of its memory.)
  ServerProcess prefill({"--kv-transfer-addr", "127.0.0.1", "--mem-fraction-static", "0.4"});
  ServerProcess decode({"--mem-fraction-static", "0.4"});
  ASSERT_TRUE(prefill.running()) << prefill.log();
  ASSERT_TRUE(decode.running()) << decode.log();
  std::vector<ServerProcess*> decoders{&decode};
  std::unique_ptr<ServerProcess> decode_dpa;  // (on GPUs: when there are two)
  if (e2e_devices() >= 2) {
    decode_dpa = std::make_unique<ServerProcess>(std::vector<std::string>{
        "--tp", "2", "--dp", "2", "--enable-dp-attention", "--mem-fraction-static", "0.4"});
    ASSERT_TRUE(decode_dpa->running()) << decode_dpa->log();
    decoders.push_back(decode_dpa.get());
  }
  const auto text = [](const std::string& lead) {
    std::string t = lead;
    for (int i = 0; i < 12; ++i) t += " The quick brown fox jumps over the lazy dog near the river bank.";
    return t;
  };
  const json to_prefill{{"do_remote_decode", true}, {"do_remote_prefill", false}, {"remote_engine_id", nullptr},
                        {"remote_block_ids", nullptr}, {"remote_host", nullptr}, {"remote_port", nullptr}};
  const auto cached_of = [](const json& j) {
    const json& u = j["usage"];
    return u.contains("prompt_tokens_details") ? u["prompt_tokens_details"]["cached_tokens"].get<int>() : 0;
  };
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    SCOPED_TRACE(path);
    const bool chat = std::string(path) == "/v1/chat/completions";
    json req{{"temperature", 0}, {"ignore_eos", true}};
    if (chat) req["messages"] = json::array({json{{"role", "user"}, {"content", text(path)}}});
    else req["prompt"] = text(path);
    const auto content = [&](const json& j) {
      const json& c = j["choices"][0];
      return chat ? c["message"]["content"].get<std::string>() : c["text"].get<std::string>();
    };
    // The proxy's first request: one token, on the prefill server.
    json first = req;
    first["max_tokens"] = 1;
    first["kv_transfer_params"] = to_prefill;
    const json pre = post_json(prefill.port(), path, first.dump());
    ASSERT_TRUE(pre.contains("kv_transfer_params")) << pre.dump();
    const json params = pre["kv_transfer_params"];
    EXPECT_EQ(params["do_remote_prefill"], true);
    EXPECT_EQ(params["remote_host"], "127.0.0.1");
    EXPECT_EQ(params["remote_port"], prefill.port());
    // The reference: the whole request computed on one server.
    json whole = req;
    whole["max_tokens"] = 12;
    const json want = post_json(prefill.port(), path, whole.dump());
    const int prompt_tokens = want["usage"]["prompt_tokens"];
    ASSERT_GT(prompt_tokens, 100);
    // The proxy's second request, on the decode servers, with the prefill's parameters.
    json second = whole;
    second["kv_transfer_params"] = params;
    for (ServerProcess* d : decoders) {
      const json got = post_json(d->port(), path, second.dump());
      EXPECT_EQ(content(got), content(want));
      EXPECT_FALSE(got.contains("kv_transfer_params"));
      EXPECT_GE(cached_of(got), prompt_tokens - 16) << got.dump();  // all whole pages but the last token's
    }
    // Streamed on the decode side.
    json streamed = second;
    streamed["stream"] = true;
    req["max_tokens"] = 12;
    const auto r = http_request(decode.port(), "POST", path, streamed.dump());
    EXPECT_EQ(r.status, 200);
    EXPECT_NE(r.body.find("data: [DONE]"), std::string::npos);
    // A prefill server that is gone: the prompt is computed here, with the same answer.
    json gone = whole;
    if (chat) gone["messages"][0]["content"] = text("gone");
    else gone["prompt"] = text("gone");
    const json gone_want = post_json(prefill.port(), path, gone.dump());
    gone["kv_transfer_params"] = json{{"do_remote_prefill", true}, {"remote_host", "127.0.0.1"}, {"remote_port", 1}};
    const json gone_got = post_json(decode.port(), path, gone.dump());
    EXPECT_EQ(content(gone_got), content(gone_want));
    EXPECT_EQ(cached_of(gone_got), 0) << gone_got.dump();
  }
  EXPECT_NE(decode.log().find("no KV read from the prefill server"), std::string::npos) << decode.log();
  // Bad parameters.
  const std::string base = R"({"prompt": "hi", "max_tokens": 2, "kv_transfer_params": )";
  for (const char* bad : {R"("yes")", R"({"do_remote_prefill": true, "remote_port": 5})",
                          R"({"do_remote_prefill": true, "remote_host": "h", "remote_port": 0})",
                          R"({"do_remote_prefill": true, "do_remote_decode": true, "remote_host": "h",)"
                          R"( "remote_port": 5})",
                          R"({"do_remote_decode": "true"})"}) {
    const json e = post_json(decode.port(), "/v1/completions", base + bad + "}", 400);
    EXPECT_EQ(e["error"]["param"], "kv_transfer_params") << bad;
  }
  // The export route itself: bad bodies are 400s; a prompt never seen has no rows.
  post_json(prefill.port(), "/kv_transfer/export", R"({"token_ids": "x"})", 400);
  post_json(prefill.port(), "/kv_transfer/export", R"({"token_ids": [1, -2]})", 400);
  post_json(prefill.port(), "/kv_transfer/export", R"({"token_ids": [1], "begin": -1})", 400);
  post_json(prefill.port(), "/kv_transfer/export", R"({"tokens": [1]})", 400);
  const auto none = http_request(prefill.port(), "POST", "/kv_transfer/export", R"({"token_ids": [5, 6, 7]})");
  EXPECT_EQ(none.status, 200);
  const json header = json::parse(none.body.substr(0, none.body.find('\n')));
  EXPECT_EQ(header["cached"], 0);
  EXPECT_EQ(header["end"], 0);
  EXPECT_EQ(none.body.find('\n') + 1, none.body.size());
  EXPECT_EQ(prefill.stop(), 0);
  EXPECT_EQ(decode.stop(), 0);
  if (decode_dpa) {
    EXPECT_EQ(decode_dpa->stop(), 0);
  }
  expect_serve_refuses({"--kv-transfer-timeout 0 --skip-tokenizer-init"}, "--kv-transfer-timeout");
}

// A port nothing listens on now (bound and let go).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), len), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

// SGLang's prefill / decode disaggregation as its router drives it: the same request, with bootstrap_host /
// bootstrap_port / bootstrap_room, to a prefill server (--disaggregation-mode prefill: it runs one token and ends the
// room) and a decode server (--disaggregation-mode decode: it reads the prompt's rows from the prefill server's
// bootstrap port once the room has ended, then generates). The decode request may come first. Native batches carry a
// room per prompt; OpenAI requests the same fields.
TEST(ServeFlags, SglangPrefillDecodeDisaggregation) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  const int boot = free_port();
  ServerProcess prefill({"--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", std::to_string(boot),
                         "--disaggregation-transfer-backend", "mooncake", "--mem-fraction-static", "0.4"});
  ServerProcess decode({"--disaggregation-mode", "decode", "--mem-fraction-static", "0.4"});
  ASSERT_TRUE(prefill.running()) << prefill.log();
  ASSERT_TRUE(decode.running()) << decode.log();
  const json info = get_json(prefill.port(), "/get_server_info");
  EXPECT_EQ(info["disaggregation_mode"], "prefill");
  EXPECT_EQ(info["disaggregation_bootstrap_port"], boot);
  const auto prompt = [](int salt) { return test_prompt(300 + salt, 150); };
  const auto body = [&](const json& input, const json& room) {
    return json{{"input_ids", input},       {"bootstrap_host", "127.0.0.1"}, {"bootstrap_port", boot},
                {"bootstrap_room", room},   {"sampling_params", {{"max_new_tokens", 10}, {"temperature", 0},
                                                                 {"ignore_eos", true}}}}
        .dump();
  };
  // One prompt, the decode request first (it waits for the room).
  const std::vector<int32_t> want = greedy(prefill.port(), prompt(0), 10);
  EXPECT_EQ(prefill.stop(), 0);
  ServerProcess prefill2({"--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", std::to_string(boot),
                          "--mem-fraction-static", "0.4", "--kv-transfer-timeout", "900"});  // (a fresh cache)
  ASSERT_TRUE(prefill2.running()) << prefill2.log();
  json got;
  std::jthread d([&] { got = post_json(decode.port(), "/generate", body(prompt(0), 12345)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // (either order works; this one makes the wait run)
  const json pre = post_json(prefill2.port(), "/generate", body(prompt(0), 12345));
  d.join();
  EXPECT_EQ(pre["output_ids"].size(), 1u) << pre.dump();  // the prefill server runs the first token only
  EXPECT_EQ(got["output_ids"].get<std::vector<int32_t>>(), want);
  EXPECT_GE(got["meta_info"]["cached_tokens"].get<int>(), 150 - 16) << got.dump();
  // A batch: a room per prompt, the prefill first this time.
  const json rooms = json::array({7, 8});
  const json batch_ids = json::array({prompt(1), prompt(2)});
  const json pre2 = post_json(prefill2.port(), "/generate", body(batch_ids, rooms));
  ASSERT_EQ(pre2.size(), 2u);
  const json got2 = post_json(decode.port(), "/generate", body(batch_ids, rooms));
  ASSERT_EQ(got2.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(got2[i]["output_ids"].get<std::vector<int32_t>>(), greedy(prefill2.port(), prompt(1 + i), 10)) << i;
    EXPECT_GE(got2[i]["meta_info"]["cached_tokens"].get<int>(), 150 - 16) << i;
  }
  // The three prompts' transfers in the metrics: read on the decode side, exported on the prefill side.
  const auto metric = [](int port, const std::string& name) {
    const std::string m = http_request(port, "GET", "/metrics").body;
    const size_t at = m.find("\nmlaserve:" + name + " ");
    return at == std::string::npos ? -1.0 : std::stod(m.substr(at + name.size() + 11));
  };
  EXPECT_GE(metric(decode.port(), "kv_transfer_received_tokens_total"), 3 * (150 - 16));
  EXPECT_GT(metric(decode.port(), "kv_transfer_received_bytes_total"), 0);
  EXPECT_EQ(metric(decode.port(), "kv_transfer_seconds_count"), 3);
  EXPECT_EQ(metric(decode.port(), "kv_transfer_failed_total"), 0);
  EXPECT_EQ(metric(decode.port(), "kv_transfer_sent_bytes_total"), 0);
  EXPECT_GE(metric(prefill2.port(), "kv_transfer_sent_bytes_total"),
            metric(decode.port(), "kv_transfer_received_bytes_total"));
  // A later turn of the first prompt's conversation: the decode server caches that turn (it generated it), so only the
  // rest of the rows is read.
  std::vector<int32_t> turn2 = prompt(0);
  turn2.insert(turn2.end(), want.begin(), want.end());
  for (int32_t t : test_prompt(900, 20)) turn2.push_back(t);
  const double read_before = metric(decode.port(), "kv_transfer_received_tokens_total");
  post_json(prefill2.port(), "/generate", body(turn2, 4242));
  const json got4 = post_json(decode.port(), "/generate", body(turn2, 4242));
  const double read = metric(decode.port(), "kv_transfer_received_tokens_total") - read_before;
  EXPECT_GT(read, 0);
  EXPECT_LE(read, 180 - 128) << "tokens read: the first turn's whole pages were cached here";
  EXPECT_GE(got4["meta_info"]["cached_tokens"].get<int>(), 180 - 16) << got4.dump();
  EXPECT_EQ(got4["output_ids"].get<std::vector<int32_t>>(), greedy(prefill2.port(), turn2, 10));
  // OpenAI completions with the same fields.
  const json oa{{"prompt", prompt(3)}, {"max_tokens", 10}, {"temperature", 0}, {"ignore_eos", true},
                {"bootstrap_host", "127.0.0.1"}, {"bootstrap_port", boot}, {"bootstrap_room", 99}};
  post_json(prefill2.port(), "/v1/completions", oa.dump());
  const json got3 = post_json(decode.port(), "/v1/completions", oa.dump());
  EXPECT_EQ(got3["usage"]["completion_tokens"], 10);
  EXPECT_GE(got3["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 150 - 16) << got3.dump();
  // Bad fields.
  post_json(decode.port(), "/generate", body(prompt(4), -1), 400);
  post_json(decode.port(), "/generate", body(batch_ids, json::array({1})), 400);
  // A prefill request refused before it runs (a bad field) ends its rooms: a read waiting on one (here for up to 900 s,
  // longer than this client waits) answers at once, with no rows.
  json refused = json::parse(body(json::array({prompt(5), prompt(6)}), json::array({555, 556})));
  refused["sampling_params"]["temperature"] = -1;
  post_json(prefill2.port(), "/generate", refused.dump(), 400);
  for (int room : {555, 556}) {
    const auto r = http_request(prefill2.port(), "POST", "/kv_transfer/export",
                                json{{"token_ids", prompt(5)}, {"bootstrap_room", room}, {"wait_ms", 900000}}.dump());
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_NE(r.body.find(R"("cached":0)"), std::string::npos) << r.body.substr(0, 300);
  }
  EXPECT_EQ(decode.stop(), 0);
  // The conversation on a decode server of two DP-attention groups (cache_aware): its later turn goes to the group
  // that generated the first (round_robin would pick the other) and only the rest of the rows is read.
  if (e2e_devices() >= 2) {
    ServerProcess dpa({"--disaggregation-mode", "decode", "--tp", "2", "--dp", "2", "--enable-dp-attention",
                       "--load-balance-method", "cache_aware", "--mem-fraction-static", "0.4"});
    ASSERT_TRUE(dpa.running()) << dpa.log();
    post_json(prefill2.port(), "/generate", body(prompt(0), 5001));
    const json t1 = post_json(dpa.port(), "/generate", body(prompt(0), 5001));
    EXPECT_EQ(t1["output_ids"].get<std::vector<int32_t>>(), want);
    const double dpa_before = metric(dpa.port(), "kv_transfer_received_tokens_total");
    EXPECT_GE(dpa_before, 150 - 16);
    post_json(prefill2.port(), "/generate", body(turn2, 5002));
    const json t2 = post_json(dpa.port(), "/generate", body(turn2, 5002));
    const double dpa_read = metric(dpa.port(), "kv_transfer_received_tokens_total") - dpa_before;
    EXPECT_GT(dpa_read, 0);
    EXPECT_LE(dpa_read, 180 - 128) << "tokens read: the first turn's whole pages were cached in its group";
    EXPECT_EQ(t2["output_ids"].get<std::vector<int32_t>>(), greedy(prefill2.port(), turn2, 10));
    EXPECT_EQ(dpa.stop(), 0);
  }
  EXPECT_EQ(prefill2.stop(), 0);
  expect_serve_refuses({"--disaggregation-mode both --skip-tokenizer-init"}, "--disaggregation-mode");
}

// /generate requests of a priority (EOS ignored) on one server, each name recorded once its request has all its
// tokens: `done` in finishing order.
struct PriorityRuns {
  explicit PriorityRuns(int p) : port(p) {}
  int port;
  std::mutex mu;
  std::vector<std::string> done;
  void run(const std::string& name, int tokens, int priority) {
    const json r = post_json(port, "/generate", R"({"text": "Once upon a time", "sampling_params":
        {"max_new_tokens": )" + std::to_string(tokens) + R"(, "ignore_eos": true}, "priority": )" +
                                                  std::to_string(priority) + "}");
    std::lock_guard lk(mu);
    EXPECT_EQ(r["meta_info"]["completion_tokens"], tokens) << r.dump();
    done.push_back(name);
  }
};

TEST(ServeFlags, PrioritySchedulingOrdersTheQueue) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  ServerProcess s({"--enable-priority-scheduling", "--max-running-requests", "1"});
  ASSERT_TRUE(s.running()) << s.log();
  EXPECT_EQ(get_json(s.port(), "/get_server_info")["enable_priority_scheduling"], true);
  PriorityRuns runs(s.port());
  std::jthread longest([&] { runs.run("long", 400, 0); });
  wait_running(s.port(), 1);  // the long one holds the only running slot
  std::jthread low([&] { runs.run("low", 4, 1); });
  wait_waiting(s.port(), 1);
  std::jthread high([&] { runs.run("high", 4, 10); });
  wait_waiting(s.port(), 2);
  longest.join();
  low.join();
  high.join();
  EXPECT_EQ(runs.done, (std::vector<std::string>{"long", "high", "low"}));
  EXPECT_EQ(s.stop(), 0);

  ServerProcess v({"--scheduling-policy", "priority"});
  ASSERT_TRUE(v.running()) << v.log();
  EXPECT_EQ(post_json(v.port(), "/v1/completions", R"({"prompt": "a", "max_tokens": 1, "priority": -5})")["usage"]
                ["completion_tokens"],
            1);
  EXPECT_EQ(v.stop(), 0);
  expect_serve_refuses({"--scheduling-policy lottery", "--schedule-low-priority-values-first",
                        "--enable-priority-scheduling --scheduling-policy priority"},
                       "priority");
}

// SGLang's priority preemption (on with --enable-priority-scheduling): with one running slot, a request whose
// priority exceeds the running one's by more than --priority-scheduling-preemption-threshold (default 10) retracts it
// and finishes first; the retracted request still gets all its tokens. --disable-priority-preemption (or a difference
// within the threshold, as in PrioritySchedulingOrdersTheQueue) leaves it waiting; a negative threshold is refused.
TEST(ServeFlags, PriorityPreemptionRetractsFarLowerRequests) {
  ASSERT_TRUE(have_deepseek_tokenizer());
  for (const bool preempt : {true, false}) {
    std::vector<std::string> flags{"--enable-priority-scheduling", "--max-running-requests", "1"};
    if (!preempt) flags.push_back("--disable-priority-preemption");
    ServerProcess s(flags);
    ASSERT_TRUE(s.running()) << s.log();
    const json info = get_json(s.port(), "/get_server_info");
    EXPECT_EQ(info["priority_scheduling_preemption_threshold"], 10);
    EXPECT_EQ(info["disable_priority_preemption"], !preempt);
    PriorityRuns runs(s.port());
    std::jthread longest([&] { runs.run("long", 400, 0); });
    wait_running(s.port(), 1);
    std::jthread urgent([&] { runs.run("urgent", 4, 50); });
    longest.join();
    urgent.join();
    const std::vector<std::string> want =
        preempt ? std::vector<std::string>{"urgent", "long"} : std::vector<std::string>{"long", "urgent"};
    EXPECT_EQ(runs.done, want);
    EXPECT_EQ(get_json(s.port(), "/get_server_info")["internal_states"][0]["num_retractions"].get<int64_t>() > 0,
              preempt);
    EXPECT_EQ(s.stop(), 0);
  }
  expect_serve_refuses({"--enable-priority-scheduling --priority-scheduling-preemption-threshold -1"},
                       "--priority-scheduling-preemption-threshold");
}

TEST(ServeFlags, RecognisedButNotImplementedExitNonZero) {
  for (const std::string flags :
       {"--quantization gptq", "--dtype float16", "--completion-template qwen",
        "--enable-hierarchical-cache --hicache-storage-backend file --hicache-storage-prefetch-policy timeout"}) {
    auto r = run_command(mlaserve_cmd(60) + " serve --model-path " + e2e_model_dir() +
                         " --tokenizer-path " + deepseek_tokenizer_dir() + " --load-format dummy --port 0 " + flags);
    EXPECT_NE(r.exit_code, 0) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("not implemented"), std::string::npos) << flags << "\n" << r.output;
  }
  auto r = run_command(mlaserve_cmd(60) + " serve --model-path " + e2e_model_dir() +
                       " --no-such-flag 1");
  EXPECT_NE(r.exit_code, 0);
  // --quantization naming the checkpoint's own method is accepted (serving starts; the timeout ends it), fp8 on a
  // bf16 checkpoint quantizes at load, another method is refused. A small KV cache: startup within the timeout on a
  // busy machine (a 2 GiB cache took more than 8 s to set up while other builds ran).
  r = run_command(mlaserve_cmd(12) + " serve --model-path " + golden_dir("v3-fp8") +
                  " --skip-tokenizer-init --device cpu --port 0 --max-total-tokens 4096 --quantization fp8");
  EXPECT_NE(r.output.find("serving"), std::string::npos) << r.output;
  r = run_command(mlaserve_cmd(12) + " serve --model-path " + golden_dir("v3") +
                  " --skip-tokenizer-init --device cpu --port 0 --max-total-tokens 4096 --quantization fp8");
  EXPECT_NE(r.output.find("serving"), std::string::npos) << r.output;
  r = run_command(mlaserve_cmd(60) + " serve --model-path " + golden_dir("v3-fp8") +
                  " --skip-tokenizer-init --device cpu --port 0 --quantization awq");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--quantization awq (quantizing at load"), std::string::npos) << r.output;
  r = run_command(mlaserve_cmd(60) + " serve --model-path " + e2e_model_dir() +
                  " --load-format dummy --port 0 --stream-interval 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--stream-interval must be at least 1"), std::string::npos) << r.output;
  r = run_command(mlaserve_cmd(60) + " serve --model-path " + e2e_model_dir() +
                  " --load-format dummy --port 0 --allowed-origins '[\"https://a.example\", 1]'");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--allowed-origins: '[\"https://a.example\", 1]' must list non-empty strings"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace mlaserve::test
