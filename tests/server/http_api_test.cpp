// The HTTP API end to end in one process: real sockets and the Beast server, a fake engine (fakes.h).
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <thread>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/host_name_verification.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include "fakes.h"
#include "http_test_client.h"
#include "test_util.h"
#include "tls_test_util.h"
#include "server/api.h"
#include "server/api_error.h"
#include "server/batches.h"
#include "server/http_server.h"
#include "server/response_store.h"
#include "server/scoring.h"

namespace mlaserve::server {
namespace {

using json = nlohmann::json;
using test::http_request;
using test::HttpConnection;
using test::sse_payloads;

struct TestServer {
  explicit TestServer(const ServerOptions& o = ServerOptions(), int64_t context_len = 4096, int tokens_per_output = 1)
      : engine(context_len, 1 << 20, tokens_per_output), opts(fill(o)), api(engine, &codec, opts),
        http(api, opts) {
    http.start();
  }
  ~TestServer() {
    engine.shutdown();
    http.stop();
  }
  static ServerOptions fill(ServerOptions o) {
    o.host = "127.0.0.1";
    o.port = 0;
    o.model_path = "/models/fake";
    o.served_model_name = "fake";
    o.num_threads = 2;
    return o;
  }
  int port() const { return http.port(); }
  test::HttpResponse post(const std::string& path, const std::string& body, const std::string& headers = "") {
    return http_request(port(), "POST", path, body, headers);
  }
  test::HttpResponse get(const std::string& path) { return http_request(port(), "GET", path); }
  // Waits until the fake engine holds no request (aborts are asynchronous to the client).
  bool wait_idle(double seconds = 10) {
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      auto s = engine.stats()[0];
      if (engine.num_live() == 0 && s.kv_tokens_free == s.kv_tokens_total) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  test::FakeEngine engine;
  test::ByteCodec codec;
  ServerOptions opts;
  Api api;
  HttpServer http;
};

std::string mask_latency(std::string s) {
  return std::regex_replace(s, std::regex(R"("e2e_latency":[0-9.eE+-]+)"), R"("e2e_latency":L)");
}

TEST(HttpApi, InfoEndpoints) {
  TestServer s;
  EXPECT_EQ(s.get("/health").status, 200);
  auto models = json::parse(s.get("/v1/models").body);
  EXPECT_EQ(models["object"], "list");
  EXPECT_EQ(models["data"][0]["id"], "fake");
  auto info = json::parse(s.get("/get_model_info").body);
  EXPECT_EQ(info["model_path"], "/models/fake");
  EXPECT_EQ(info["is_generation"], true);
  auto si = json::parse(s.get("/get_server_info").body);
  ASSERT_EQ(si["internal_states"].size(), 1u);
  for (const char* k : {"kv_tokens_total", "kv_tokens_free", "kv_tokens_cached", "num_running_reqs", "num_queue_reqs"})
    EXPECT_TRUE(si["internal_states"][0].contains(k)) << k;
  EXPECT_EQ(s.get("/ping").status, 200);  // vLLM's
  EXPECT_EQ(s.post("/ping", "").status, 200);
  EXPECT_EQ(json::parse(s.get("/version").body)["version"], "mlaserve");
  EXPECT_EQ(json::parse(s.get("/model_info").body), info);  // SGLang's newer names
  EXPECT_EQ(json::parse(s.get("/server_info").body)["internal_states"].size(), 1u);
  auto load = json::parse(s.get("/get_load").body);
  ASSERT_EQ(load.size(), 1u);
  EXPECT_EQ(load[0]["dp_rank"], 0);
  EXPECT_EQ(load[0]["num_reqs"], 0);
  EXPECT_EQ(load[0]["num_waiting_reqs"], 0);
  EXPECT_EQ(load[0]["num_tokens"], 0);
  EXPECT_EQ(s.post("/flush_cache", "").status, 200);
  auto m = s.get("/metrics");
  EXPECT_EQ(m.status, 200);
  EXPECT_NE(m.body.find("mlaserve:num_running_reqs"), std::string::npos);
  EXPECT_EQ(s.get("/nope").status, 404);
  EXPECT_EQ(s.get("/generate").status, 405);
}

// The handlers parse clients' nested input (regexes, schemas) by recursion on threads whose stack the server sets
// (kInputStackBytes), not the default a thread gets from `ulimit -s`: with that default cut to 256 KiB, a regex of
// 1,000 nested groups (the limit is 1,024) and a schema of 500 optional properties before a required one (its regex
// nests once per optional property) are answered as with any stack, and a deeper regex gets its 400.
TEST(HttpApi, NestedInputDoesNotDependOnTheThreadStackDefault) {
  if (test::kThreadSanitizer) GTEST_SKIP() << "a 256 KiB stack cannot hold ThreadSanitizer's TLS";
  test::DefaultThreadStack small(size_t{256} << 10);
  TestServer s;
  auto generate = [&](const json& sampling) {
    return s.post("/generate", json{{"text", "hi"}, {"sampling_params", sampling}}.dump());
  };
  const std::string deep_regex = std::string(1000, '(') + "a" + std::string(1000, ')');
  const auto regex = generate({{"max_new_tokens", 2}, {"regex", deep_regex}});
  EXPECT_EQ(regex.status, 200) << regex.body;
  json schema = {{"type", "object"}, {"properties", json::object()}, {"required", {"p500"}}};
  for (int i = 0; i < 600; ++i) schema["properties"][fmt::format("p{}", i)] = {{"type", "integer"}};
  const auto nested = generate({{"max_new_tokens", 2}, {"json_schema", schema.dump()}});
  EXPECT_EQ(nested.status, 200) << nested.body;
  const std::string deeper = std::string(2000, '(') + "a" + std::string(2000, ')');
  const auto refused = generate({{"max_new_tokens", 2}, {"regex", deeper}});
  EXPECT_EQ(refused.status, 400) << refused.body;
  EXPECT_NE(refused.body.find("nest more than"), std::string::npos) << refused.body;
}

// vLLM's /invocations (SageMaker's inference route): a body with 'messages' is a chat request, one with 'prompt' a
// completions request, answered as those APIs answer them; anything else is a 400 naming what it takes.
TEST(HttpApi, InvocationsPickTheApiByTheBody) {
  TestServer s;
  const std::string chat = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})";
  const std::string completion = R"({"prompt": "hello", "max_tokens": 3, "temperature": 0})";
  for (const auto& [body, path, object] : {std::tuple{chat, "/v1/chat/completions", "chat.completion"},
                                           std::tuple{completion, "/v1/completions", "text_completion"}}) {
    auto r = s.post("/invocations", body);
    ASSERT_EQ(r.status, 200) << r.body;
    const json j = json::parse(r.body), direct = json::parse(s.post(path, body).body);
    EXPECT_EQ(j["object"], object);
    EXPECT_EQ(j["choices"], direct["choices"]);
    EXPECT_EQ(j["usage"], direct["usage"]);
  }
  auto bad = s.post("/invocations", R"({"input": "hi"})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(json::parse(bad.body)["error"]["message"].get<std::string>().find("'prompt'"), std::string::npos);
  EXPECT_EQ(s.post("/invocations", "{not json").status, 400);
  EXPECT_EQ(s.get("/invocations").status, 405);
}

// SGLang's /update_weights_from_disk: the engine's answer as {"success", "message", "num_paused_requests"} (200, or
// 400 when the update failed); the model path and weight version follow successful updates; bad bodies are a 400.
TEST(HttpApi, UpdateWeightsFromDisk) {
  TestServer s;
  EXPECT_EQ(json::parse(s.get("/get_weight_version").body)["weight_version"], "default");
  auto r = s.post("/update_weights_from_disk",
                  R"({"model_path": "/ckpt/step2", "weight_version": "step2", "abort_all_requests": true,
                      "flush_cache": false, "load_format": null})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body),
            json::parse(R"({"success": true, "message": "Succeeded to update model weights.", "num_paused_requests": 0})"));
  auto ups = s.engine.updates();
  ASSERT_EQ(ups.size(), 1u);
  EXPECT_EQ(ups[0].model_path, "/ckpt/step2");
  EXPECT_TRUE(ups[0].abort_all_requests);
  EXPECT_FALSE(ups[0].flush_cache);
  auto info = json::parse(s.get("/get_model_info").body);
  EXPECT_EQ(info["model_path"], "/ckpt/step2");
  EXPECT_EQ(info["weight_version"], "step2");
  EXPECT_EQ(json::parse(s.get("/get_server_info").body)["weight_version"], "step2");
  EXPECT_EQ(json::parse(s.get("/get_weight_version").body)["weight_version"], "step2");

  r = s.post("/update_weights_from_disk", R"({"model_path": "/ckpt/broken", "weight_version": "x"})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(json::parse(r.body)["success"], false);
  EXPECT_EQ(json::parse(r.body)["message"], "cannot read the checkpoint");
  info = json::parse(s.get("/get_model_info").body);
  EXPECT_EQ(info["model_path"], "/ckpt/step2");
  EXPECT_EQ(info["weight_version"], "step2");
  ups = s.engine.updates();
  ASSERT_EQ(ups.size(), 2u);
  EXPECT_FALSE(ups[1].abort_all_requests);
  EXPECT_TRUE(ups[1].flush_cache);  // SGLang's defaults

  for (const char* bad : {R"({})", R"({"model_path": 7})", R"({"model_path": ""})", R"([1])", "not json",
                          R"({"model_path": "/ckpt/a", "load_format": "dummy"})",
                          R"({"model_path": "/ckpt/a", "flush_cache": "yes"})"}) {
    r = s.post("/update_weights_from_disk", bad);
    EXPECT_EQ(r.status, 400) << bad << " " << r.body;
    EXPECT_TRUE(json::parse(r.body).contains("error")) << r.body;
  }
  EXPECT_EQ(s.engine.updates().size(), 2u);
  EXPECT_EQ(s.get("/update_weights_from_disk").status, 405);

  EXPECT_EQ(s.post("/update_weight_version", R"({"new_version": "step3"})").status, 200);
  EXPECT_EQ(json::parse(s.get("/get_weight_version").body)["weight_version"], "step3");
  EXPECT_EQ(s.post("/update_weight_version", R"({"version": "x"})").status, 400);
}

// SGLang's /pause_generation (mode abort by default, retract, in_place) and /continue_generation; vLLM's /pause
// (?wait_for_inflight_requests: drain, else abort), /resume and /is_paused.
TEST(HttpApi, PauseAndContinueGeneration) {
  TestServer s;
  EXPECT_EQ(json::parse(s.get("/is_paused").body)["is_paused"], false);
  auto r = s.post("/pause_generation", "");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body), json::parse(R"({"message": "Generation paused successfully.", "status": "ok"})"));
  EXPECT_EQ(json::parse(s.get("/is_paused").body)["is_paused"], true);
  r = s.post("/continue_generation", "{}");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["status"], "ok");
  EXPECT_EQ(json::parse(s.get("/is_paused").body)["is_paused"], false);
  EXPECT_EQ(s.post("/pause_generation", R"({"mode": "retract"})").status, 200);
  EXPECT_EQ(s.post("/pause_generation", R"({"mode": "in_place"})").status, 200);
  EXPECT_EQ(s.post("/pause_generation", R"({"mode": "abort"})").status, 200);
  EXPECT_EQ(s.post("/pause?wait_for_inflight_requests=true&clear_cache=false", "").status, 200);
  r = s.post("/pause", "");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(json::parse(r.body)["status"], "paused");
  EXPECT_EQ(json::parse(s.post("/resume", "").body)["status"], "resumed");
  using M = PauseMode;
  EXPECT_EQ(s.engine.pauses(), (std::vector<M>{M::Abort, M::Retract, M::InPlace, M::Abort, M::Drain, M::Abort}));
  for (const auto& [path, body] : {std::pair{"/pause_generation", R"({"mode": "later"})"},
                                   std::pair{"/pause_generation", R"({"mode": 3})"},
                                   std::pair{"/pause_generation", "[1]"},
                                   std::pair{"/pause?clear_cache=maybe", ""}})
    EXPECT_EQ(s.post(path, body).status, 400) << path << " " << body;
  EXPECT_EQ(s.engine.pauses().size(), 6u);
  EXPECT_EQ(s.get("/pause_generation").status, 405);

  // SGLang's /release_memory_occupation and /resume_memory_occupation (tags optional; any tag means all).
  auto m = s.post("/release_memory_occupation", R"({"tags": ["weights", "kv_cache"]})");
  EXPECT_EQ(m.status, 200) << m.body;
  EXPECT_EQ(json::parse(m.body), json::parse(R"({"success": true, "message": "released"})"));
  EXPECT_EQ(s.post("/resume_memory_occupation", "").status, 200);
  EXPECT_EQ(s.get("/resume_memory_occupation").status, 200);
  EXPECT_EQ(s.post("/release_memory_occupation", R"({"tags": ["gpu"]})").status, 400);
  EXPECT_EQ(s.post("/release_memory_occupation", R"({"tags": "weights"})").status, 400);
  EXPECT_EQ(s.engine.memory_ops(), (std::vector<bool>{true, false, false}));
}

TEST(HttpApi, ExpertDistributionRecord) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "mlaserve_expert_record" / "out";
  std::filesystem::remove_all(dir.parent_path());
  ServerOptions o;
  o.expert_distribution_dir = dir.string();  // made by the dump
  TestServer s(o);
  // Off (the server started without --expert-distribution-recorder-mode): a 400 naming why, no file.
  auto r = s.post("/start_expert_distribution_record", "");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(json::parse(r.body)["error"]["message"].get<std::string>().find("recording is off"), std::string::npos)
      << r.body;
  EXPECT_EQ(s.get("/dump_expert_distribution_record").status, 400);
  EXPECT_FALSE(std::filesystem::exists(dir));
  // On: SGLang's text answers; the dump is a file of [layer][expert] counts.
  s.engine.set_expert_counts(2, {0, 0, 0, 5, 1, 2});
  r = s.post("/start_expert_distribution_record", "");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "Start recording the expert distribution.\n");
  EXPECT_EQ(s.get("/stop_expert_distribution_record").body, "Stop recording the expert distribution.\n");
  r = s.post("/dump_expert_distribution_record", "");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "Dump expert distribution record.\n");
  std::vector<std::filesystem::path> files;
  for (const auto& f : std::filesystem::directory_iterator(dir)) files.push_back(f.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].filename().string().rfind("expert_distribution_recorder_", 0), 0u) << files[0];
  EXPECT_EQ(files[0].extension(), ".json");
  std::ifstream in(files[0]);
  const json d = json::parse(in);
  EXPECT_EQ(d["num_layers"], 2);
  EXPECT_EQ(d["num_experts"], 3);
  EXPECT_EQ(d["logical_count"], json::parse("[[0, 0, 0], [5, 1, 2]]"));
  EXPECT_EQ(http_request(s.port(), "DELETE", "/dump_expert_distribution_record").status, 405);
  using Op = ExpertRecordOp;
  EXPECT_EQ(s.engine.expert_ops(), (std::vector<Op>{Op::Start, Op::Dump, Op::Start, Op::Stop, Op::Dump}));
  std::filesystem::remove_all(dir.parent_path());
}

// SGLang's /get_weights_by_name: a matrix's first rows as nested lists, a vector's first elements as one list, a list
// of those per DP rank when there are several; GET with a JSON body as SGLang's clients send it; truncate_size 100
// when not given; what the engine refuses (no such tensor) and bad fields are 400s naming why.
TEST(HttpApi, GetWeightsByName) {
  TestServer s;
  WeightValues m;
  m.ok = true;
  m.shape = {4, 3};
  m.rows = 2;
  m.cols = 3;
  m.values = {1.0f, 2.0f, 3.0f, 4.5f, -5.0f, 0.25f};
  s.engine.set_weights({m});
  auto r = s.post("/get_weights_by_name", R"({"name": "model.layers.0.mlp.gate.weight", "truncate_size": 2})");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body), json::parse("[[1, 2, 3], [4.5, -5, 0.25]]"));
  r = http_request(s.port(), "GET", "/get_weights_by_name", R"({"name": "model.norm.weight"})");
  EXPECT_EQ(r.status, 200) << r.body;
  WeightValues v = m;
  v.shape = {5};
  v.rows = 1;
  v.cols = 3;
  v.values = {0.5f, 1.0f, -2.0f};
  s.engine.set_weights({v});
  r = s.post("/get_weights_by_name", R"({"name": "model.norm.weight", "truncate_size": 3})");
  EXPECT_EQ(json::parse(r.body), json::parse("[0.5, 1, -2]")) << r.body;
  s.engine.set_weights({v, v});  // two DP ranks
  r = s.post("/get_weights_by_name", R"({"name": "model.norm.weight", "truncate_size": 3})");
  EXPECT_EQ(json::parse(r.body), json::parse("[[0.5, 1, -2], [0.5, 1, -2]]")) << r.body;
  // Rows past the writer's chunk of 4,096 numbers; a NaN is written as null.
  WeightValues wide = m;
  wide.shape = {3, 9000};
  wide.rows = 2;
  wide.cols = 9000;
  wide.values.resize(18000);
  for (size_t i = 0; i < wide.values.size(); ++i) wide.values[i] = static_cast<float>(i) * 0.25f - 7.0f;
  wide.values[4096] = std::numeric_limits<float>::quiet_NaN();
  s.engine.set_weights({wide});
  r = s.post("/get_weights_by_name", R"({"name": "model.embed_tokens.weight", "truncate_size": 2})");
  ASSERT_EQ(r.status, 200) << r.body.substr(0, 200);
  const json got = json::parse(r.body);
  ASSERT_TRUE(got.is_array() && got.size() == 2 && got[0].size() == 9000 && got[1].size() == 9000) << r.body.size();
  int64_t wrong = 0;
  for (size_t i = 0; i < wide.values.size(); ++i) {
    const json& x = got[i / 9000][i % 9000];
    wrong += i == 4096 ? !x.is_null() : !x.is_number() || x.get<float>() != wide.values[i];
  }
  EXPECT_EQ(wrong, 0);
  using Read = std::pair<std::string, int64_t>;
  EXPECT_EQ(s.engine.weight_reads(), (std::vector<Read>{{"model.layers.0.mlp.gate.weight", 2},
                                                         {"model.norm.weight", 100},
                                                         {"model.norm.weight", 3},
                                                         {"model.norm.weight", 3},
                                                         {"model.embed_tokens.weight", 2}}));
  s.engine.set_weights({});
  r = s.post("/get_weights_by_name", R"({"name": "model.nothing.weight"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(json::parse(r.body)["error"]["message"].get<std::string>().find("no weight named 'model.nothing.weight'"),
            std::string::npos) << r.body;
  for (const char* bad : {"{}", R"({"name": 3})", R"({"name": "w", "truncate_size": -1})",
                          R"({"name": "w", "truncate_size": "all"})", "not json"}) {
    r = s.post("/get_weights_by_name", bad);
    EXPECT_EQ(r.status, 400) << bad << ": " << r.body;
  }
  EXPECT_EQ(s.engine.weight_reads().size(), 6u);  // (the bad requests never reached the engine)
  EXPECT_EQ(http_request(s.port(), "DELETE", "/get_weights_by_name").status, 405);
}

// SGLang's /start_profile and /stop_profile: the folder (the request's, else the server's), num_steps; SGLang's other
// fields accepted; bad values and a refused start are 400s; SGLang's text answers.
TEST(HttpApi, StartAndStopProfile) {
  ServerOptions o;
  o.profile_dir = "/srv/traces";
  TestServer s(o);
  auto r = s.post("/start_profile", "");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "Start profiling.\n");
  r = s.post("/start_profile", "");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(json::parse(r.body)["error"]["message"].get<std::string>().find("already"), std::string::npos) << r.body;
  r = s.get("/stop_profile");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "Stop profiling. This will take some time.\n");
  EXPECT_EQ(s.post("/stop_profile", "").status, 400);
  r = s.post("/start_profile", R"({"output_dir": "/data/prof", "num_steps": 5, "activities": ["CPU", "GPU"],
      "record_shapes": false})");
  EXPECT_EQ(r.status, 200) << r.body;
  for (const char* bad : {R"({"num_steps": 0})", R"({"num_steps": "5"})", R"({"output_dir": ""})", "[1]"})
    EXPECT_EQ(s.post("/start_profile", bad).status, 400) << bad;
  const std::vector<ProfileRequest> p = s.engine.profiles();
  ASSERT_EQ(p.size(), 5u);
  EXPECT_TRUE(p[0].start);
  EXPECT_EQ(p[0].output_dir, "/srv/traces");
  EXPECT_EQ(p[0].num_steps, 0);
  EXPECT_FALSE(p[2].start);
  EXPECT_EQ(p[4].output_dir, "/data/prof");
  EXPECT_EQ(p[4].num_steps, 5);
}

namespace {

namespace net = boost::asio;
namespace beast = boost::beast;

// HTTPS requests through Beast on one kept-alive connection (`times` the same request), the server's certificate
// checked against `ca` for 127.0.0.1 (and a client certificate presented when given): the last status and body.
// Throws when TLS fails (an untrusted server, a client certificate refused) or the connection ends without an answer.
test::HttpResponse https_request(int port, const std::string& method, const std::string& target,
                                 const std::string& body, const std::string& ca, const std::string& client_cert = "",
                                 const std::string& client_key = "", int times = 1) {
  net::io_context ioc;
  net::ssl::context ctx(net::ssl::context::tls_client);
  ctx.load_verify_file(ca);
  ctx.set_verify_mode(net::ssl::verify_peer);
  if (!client_cert.empty()) {
    ctx.use_certificate_chain_file(client_cert);
    ctx.use_private_key_file(client_key, net::ssl::context::pem);
  }
  beast::ssl_stream<beast::tcp_stream> s(ioc, ctx);
  s.set_verify_callback(net::ssl::host_name_verification("127.0.0.1"));
  beast::get_lowest_layer(s).expires_after(std::chrono::seconds(30));
  beast::get_lowest_layer(s).connect(net::ip::tcp::endpoint(net::ip::address_v4::loopback(),
                                                            static_cast<unsigned short>(port)));
  s.handshake(net::ssl::stream_base::client);
  beast::flat_buffer buf;
  test::HttpResponse out;
  for (int i = 0; i < times; ++i) {
    beast::http::request<beast::http::string_body> req{beast::http::string_to_verb(method), target, 11};
    req.set(beast::http::field::host, "127.0.0.1");
    req.set(beast::http::field::content_type, "application/json");
    req.keep_alive(true);
    req.body() = body;
    req.prepare_payload();
    beast::http::write(s, req);
    beast::http::response<beast::http::string_body> res;
    beast::http::read(s, buf, res);
    out.status = static_cast<int>(res.result_int());
    out.body = res.body();
    if (out.status != 200) break;
  }
  return out;
}

std::string check_tls_error(const ServerOptions& o) {
  try {
    HttpServer::check_tls(o);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// HTTPS (--ssl-certfile / --ssl-keyfile): requests through TLS answer as over plain HTTP; a plain-HTTP request to the
// TLS port gets no HTTP answer; an encrypted key with its password; client certificates required
// (--ssl-ca-certs, --ssl-cert-reqs 2) refuse a client without one; unusable files are errors naming the flag.
TEST(HttpApi, Tls) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "mlaserve_tls_api";
  const test::TlsFiles t = test::write_tls_files(dir);
  {
    ServerOptions o;
    o.ssl_certfile = t.cert;
    o.ssl_keyfile = t.key;
    TestServer s(o);
    auto r = https_request(s.port(), "GET", "/health", "", t.ca_cert);
    EXPECT_EQ(r.status, 200);
    r = https_request(s.port(), "POST", "/generate",
                      R"({"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})", t.ca_cert);
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["text"], "hel");
    // Keep-alive: five generations on one connection (each read ends the disconnect watch of the one before).
    r = https_request(s.port(), "POST", "/generate",
                      R"({"text": "abc", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})", t.ca_cert,
                      "", "", 5);
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["text"], "ab");
    r = https_request(s.port(), "POST", "/v1/completions", R"({"model": "fake", "prompt": "hi", "max_tokens": 2,
        "stream": true})", t.ca_cert);
    EXPECT_EQ(r.status, 200);
    EXPECT_NE(r.body.find("data: [DONE]"), std::string::npos) << r.body;
    // Plain HTTP to the TLS port: the handshake fails, no HTTP answer comes back.
    bool answered = false;
    try {
      answered = s.get("/health").status == 200;
    } catch (const std::exception&) {
    }
    EXPECT_FALSE(answered);
    // A client that does not trust the server's CA (its own certificate as the only CA) refuses it.
    EXPECT_THROW(https_request(s.port(), "GET", "/health", "", t.cert), std::exception);
    EXPECT_EQ(https_request(s.port(), "GET", "/health", "", t.ca_cert).status, 200);  // (the server goes on)
  }
  {
    ServerOptions o;
    o.ssl_certfile = t.cert;
    o.ssl_keyfile = t.key_encrypted;
    o.ssl_keyfile_password = test::kTlsKeyPassword;
    o.ssl_ca_certs = t.ca_cert;
    o.ssl_cert_reqs = 2;
    TestServer s(o);
    EXPECT_THROW(https_request(s.port(), "GET", "/health", "", t.ca_cert), std::exception);
    EXPECT_EQ(https_request(s.port(), "GET", "/health", "", t.ca_cert, t.cert, t.key).status, 200);
  }
  ServerOptions o;
  o.ssl_certfile = t.cert;
  EXPECT_NE(check_tls_error(o).find("--ssl-keyfile"), std::string::npos) << check_tls_error(o);
  o.ssl_keyfile = (dir / "missing.pem").string();
  EXPECT_NE(check_tls_error(o).find("missing.pem"), std::string::npos) << check_tls_error(o);
  o.ssl_keyfile = t.key_encrypted;  // no password
  EXPECT_NE(check_tls_error(o).find("--ssl-keyfile-password"), std::string::npos) << check_tls_error(o);
  o.ssl_keyfile = t.key;
  o.ssl_cert_reqs = 2;
  EXPECT_NE(check_tls_error(o).find("--ssl-ca-certs"), std::string::npos) << check_tls_error(o);
  o.ssl_ca_certs = t.ca_cert;
  EXPECT_EQ(check_tls_error(o), "");
  std::filesystem::remove_all(dir);
}

// vLLM's --enable-ssl-refresh: after the certificate files change, new connections get the new certificate (a client
// trusting only the new CA connects, one trusting only the old one does not); files that do not make a usable context
// yet (the new certificate beside the old key) keep the previous one; without the flag the first files stay in use.
TEST(HttpApi, TlsRefresh) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "mlaserve_tls_refresh";
  const test::TlsFiles a = test::write_tls_files(dir / "a"), b = test::write_tls_files(dir / "b");
  const fs::path live = dir / "live";
  fs::create_directories(live);
  int bumps = 0;
  auto install = [&](const std::string& from, const char* name) {  // a later modification time each time
    fs::copy_file(from, live / name, fs::copy_options::overwrite_existing);
    fs::last_write_time(live / name, fs::last_write_time(live / name) + std::chrono::seconds(10 * ++bumps));
  };
  for (const bool refresh : {true, false}) {
    SCOPED_TRACE(refresh);
    install(a.cert, "cert.pem");
    install(a.key, "key.pem");
    ServerOptions o;
    o.ssl_certfile = (live / "cert.pem").string();
    o.ssl_keyfile = (live / "key.pem").string();
    o.ssl_refresh = refresh;
    TestServer s(o);
    EXPECT_EQ(https_request(s.port(), "GET", "/health", "", a.ca_cert).status, 200);
    install(b.cert, "cert.pem");  // mid-rotation: b's certificate, a's key
    EXPECT_EQ(https_request(s.port(), "GET", "/health", "", a.ca_cert).status, 200);
    install(b.key, "key.pem");
    if (refresh) {
      EXPECT_EQ(https_request(s.port(), "GET", "/health", "", b.ca_cert).status, 200);
      EXPECT_THROW(https_request(s.port(), "GET", "/health", "", a.ca_cert), std::exception);
    } else {
      EXPECT_EQ(https_request(s.port(), "GET", "/health", "", a.ca_cert).status, 200);
      EXPECT_THROW(https_request(s.port(), "GET", "/health", "", b.ca_cert), std::exception);
    }
  }
  fs::remove_all(dir);
}

// vLLM's sleep mode on the memory's release and resumption: /sleep (level 1 or 2), /wake_up (tags), /is_sleeping;
// sleeping twice or waking an awake server is a no-op 200; /reset_prefix_cache is /flush_cache.
TEST(HttpApi, VllmSleepMode) {
  TestServer s;
  EXPECT_EQ(json::parse(s.get("/is_sleeping").body)["is_sleeping"], false);
  auto r = s.post("/sleep?level=1", "");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body, "");
  EXPECT_EQ(json::parse(s.get("/is_sleeping").body)["is_sleeping"], true);
  EXPECT_EQ(s.post("/sleep?level=2", "").status, 200);  // asleep already: nothing asked of the engine
  EXPECT_EQ(s.post("/wake_up?tags=weights&tags=kv_cache", "").status, 200);
  EXPECT_EQ(json::parse(s.get("/is_sleeping").body)["is_sleeping"], false);
  EXPECT_EQ(s.post("/wake_up?tags=kv_cache", "").status, 200);  // awake already
  EXPECT_EQ(s.post("/sleep", "").status, 200);
  EXPECT_EQ(s.post("/wake_up", "").status, 200);
  for (const char* bad : {"/sleep?level=3", "/wake_up?tags=gpu"}) EXPECT_EQ(s.post(bad, "").status, 400) << bad;
  EXPECT_EQ(s.get("/sleep").status, 405);
  EXPECT_EQ(s.engine.memory_ops(), (std::vector<bool>{true, false, true, false}));
  r = s.post("/reset_prefix_cache", "");
  EXPECT_EQ(r.status, 200) << r.body;
}

TEST(HttpApi, GenerateNonStream) {
  TestServer s;
  auto r = s.post("/generate", R"({"text": "hello", "sampling_params": {"max_new_tokens": 7, "temperature": 0}})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers["content-type"], "application/json");
  auto j = json::parse(r.body);
  EXPECT_EQ(j["text"], "hellohe");
  EXPECT_EQ(j["output_ids"], json::parse("[104,101,108,108,111,104,101]"));
  EXPECT_EQ(j["meta_info"]["finish_reason"], json::parse(R"({"type":"length","length":7})"));
  EXPECT_EQ(j["meta_info"]["prompt_tokens"], 6);
  EXPECT_EQ(j["meta_info"]["completion_tokens"], 7);
  EXPECT_EQ(j["meta_info"]["cached_tokens"], 0);
  EXPECT_TRUE(j["meta_info"]["e2e_latency"].is_number());
  EXPECT_TRUE(s.wait_idle());
}

TEST(HttpApi, GenerateStreamExactFormat) {
  TestServer s;
  auto r = s.post("/generate", R"({"text": "ab", "rid": "r1", "stream": true, "sampling_params": {"max_new_tokens": 3}})");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.headers["content-type"], "text/event-stream");
  const std::string expected =
      R"(data: {"text":"a","output_ids":[97],"meta_info":{"id":"r1","finish_reason":null,"prompt_tokens":3,"completion_tokens":1,"cached_tokens":0}})"
      "\n\n"
      R"(data: {"text":"ab","output_ids":[97,98],"meta_info":{"id":"r1","finish_reason":null,"prompt_tokens":3,"completion_tokens":2,"cached_tokens":0}})"
      "\n\n"
      R"(data: {"text":"aba","output_ids":[97,98,97],"meta_info":{"id":"r1","finish_reason":{"type":"length","length":3},"prompt_tokens":3,"completion_tokens":3,"cached_tokens":0,"e2e_latency":L}})"
      "\n\n"
      "data: [DONE]\n\n";
  EXPECT_EQ(mask_latency(r.body), expected);
}

TEST(HttpApi, StopStringAcrossTokensNeverShownAndAborts) {
  TestServer s;
  auto r = s.post("/generate", R"({"text": "abcSTOPdef", "rid": "s1", "sampling_params": {"max_new_tokens": 50, "stop": ["STOP", "zzz"]}})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["text"], "abc");
  EXPECT_EQ(j["meta_info"]["finish_reason"], json::parse(R"({"type":"stop","matched":"STOP"})"));
  EXPECT_EQ(j["meta_info"]["completion_tokens"], 7);
  EXPECT_EQ(s.engine.aborted(), std::vector<std::string>{"s1"});
  EXPECT_TRUE(s.wait_idle());

  // Streaming: no chunk ever shows a piece of the stop string.
  r = s.post("/generate", R"({"text": "abcSTOPdef", "stream": true, "sampling_params": {"max_new_tokens": 50, "stop": "STOP"}})");
  auto events = sse_payloads(r.body);
  ASSERT_GE(events.size(), 2u);
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    auto text = json::parse(events[i])["text"].get<std::string>();
    EXPECT_EQ(text.find('S'), std::string::npos) << text;
  }
  EXPECT_EQ(json::parse(events[events.size() - 2])["text"], "abc");
  EXPECT_EQ(events.back(), "[DONE]");

  // no_stop_trim keeps it.
  r = s.post("/generate", R"({"text": "abcSTOPdef", "sampling_params": {"max_new_tokens": 50, "stop": "STOP", "no_stop_trim": true}})");
  EXPECT_EQ(json::parse(r.body)["text"], "abcSTOP");
}

// SGLang's stop_regex: the output ends at the token that brings a match into view, its text kept (SGLang does not trim
// it), finish_reason matched: the pattern; the engine's request aborted; patterns across tokens; the other APIs take
// it too; a pattern that does not compile is a 400 naming the field.
TEST(HttpApi, StopRegex) {
  TestServer s;
  auto r = s.post("/generate", R"({"text": "take 12 or 345 now#", "rid": "x1", "sampling_params": {"max_new_tokens": 50,
      "stop_regex": ["zz+", "[0-9]{2} "]}})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["text"], "take 12 ");
  EXPECT_EQ(j["meta_info"]["finish_reason"], json::parse(R"({"type": "stop", "matched": "[0-9]{2} "})"));
  EXPECT_EQ(j["meta_info"]["completion_tokens"], 8);
  EXPECT_EQ(s.engine.aborted(), std::vector<std::string>{"x1"});
  EXPECT_TRUE(s.wait_idle());
  // Not before min_new_tokens, then over the earlier text too (as SGLang searches its tail); one string as the
  // pattern; no match: the request ends as it would.
  r = s.post("/generate", R"({"text": "take 12 or 345 now#", "sampling_params": {"max_new_tokens": 50,
      "stop_regex": "[0-9]+ ", "min_new_tokens": 10}})");
  EXPECT_EQ(json::parse(r.body)["text"], "take 12 or");
  r = s.post("/generate", R"({"text": "take 12#", "sampling_params": {"max_new_tokens": 50, "stop_regex": "x{3}"}})");
  EXPECT_EQ(json::parse(r.body)["text"], "take 12");
  EXPECT_EQ(json::parse(r.body)["meta_info"]["finish_reason"]["matched"], test::kEos);
  // Streamed: the chunks add up to the same text.
  r = s.post("/generate", R"({"text": "take 12 or 345 now#", "stream": true, "stream_output": true,
      "sampling_params": {"max_new_tokens": 50, "stop_regex": "or [0-9]"}})");
  const auto events = sse_payloads(r.body);
  ASSERT_GE(events.size(), 2u);
  const json last = json::parse(events[events.size() - 2]);
  EXPECT_EQ(last["text"], "take 12 or 3");
  EXPECT_EQ(last["meta_info"]["finish_reason"]["matched"], "or [0-9]");
  // OpenAI completions and chat.
  r = s.post("/v1/completions", R"({"prompt": "take 12 or 345 now#", "max_tokens": 50, "stop_regex": "1."})");
  j = json::parse(r.body);
  EXPECT_EQ(j["choices"][0]["text"], "take 12");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  r = s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "a1b2#"}], "max_tokens": 50,
      "stop_regex": ["b[0-9]"]})");
  EXPECT_EQ(json::parse(r.body)["choices"][0]["message"]["content"], "<bos>[user]a1b2");
  for (const auto& [path, body, param] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"/generate", R"({"text": "a", "sampling_params": {"stop_regex": "(unclosed"}})", "sampling_params.stop_regex"},
           {"/generate", R"({"text": "a", "sampling_params": {"stop_regex": [""]}})", "sampling_params.stop_regex"},
           {"/v1/completions", R"({"prompt": "a", "stop_regex": 5})", "stop_regex"}}) {
    r = s.post(path, body);
    EXPECT_EQ(r.status, 400) << body;
    EXPECT_EQ(json::parse(r.body)["error"]["param"], param) << r.body;
  }
  EXPECT_TRUE(s.wait_idle());
}

TEST(HttpApi, EosAndStopTokenIdsNotInText) {
  TestServer s;
  auto j = json::parse(s.post("/generate", R"({"text": "ab#", "sampling_params": {"max_new_tokens": 50}})").body);
  EXPECT_EQ(j["text"], "ab");
  EXPECT_EQ(j["output_ids"], json::parse("[97,98,257]"));
  EXPECT_EQ(j["meta_info"]["finish_reason"], json::parse(R"({"type":"stop","matched":257})"));
  j = json::parse(s.post("/generate", R"({"text": "abc", "sampling_params": {"max_new_tokens": 50, "stop_token_ids": [99]}})").body);
  EXPECT_EQ(j["text"], "ab");
  EXPECT_EQ(j["meta_info"]["finish_reason"], json::parse(R"({"type":"stop","matched":99})"));
  j = json::parse(s.post("/generate", R"({"text": "ab#", "sampling_params": {"max_new_tokens": 4, "ignore_eos": true}})").body);
  EXPECT_EQ(j["text"], "aba");  // the <eos> token is special: skipped in the text
  EXPECT_EQ(j["meta_info"]["completion_tokens"], 4);
}

TEST(HttpApi, BatchAndParallelSamplesArePromptMajor) {
  TestServer s;
  auto r = s.post("/generate", R"({"text": ["x", "y"], "sampling_params": {"max_new_tokens": 2, "n": 2}})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  ASSERT_EQ(j.size(), 4u);
  const char* want[] = {"xx", "xx", "yy", "yy"};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(j[i]["text"], want[i]);
    EXPECT_EQ(j[i]["index"], i);
  }
  r = s.post("/generate", R"({"input_ids": [[120], [121, 122]], "stream": true, "sampling_params": {"max_new_tokens": 2}})");
  auto events = sse_payloads(r.body);
  ASSERT_EQ(events.size(), 5u);
  std::map<int, std::string> last;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    auto e = json::parse(events[i]);
    last[e["index"].get<int>()] = e["text"];
  }
  EXPECT_EQ(last[0], "xx");
  EXPECT_EQ(last[1], "yz");
}

TEST(HttpApi, Logprobs) {
  TestServer s;
  auto j = json::parse(s.post("/generate", R"({"text": "ab", "return_logprob": true, "top_logprobs_num": 2,
      "return_text_in_logprobs": true, "sampling_params": {"max_new_tokens": 2}})").body);
  auto lp = j["meta_info"]["output_token_logprobs"];
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_EQ(lp[0], json::parse(R"([-0.25, 97, "a"])"));
  ASSERT_EQ(j["meta_info"]["output_top_logprobs"][1].size(), 2u);
  j = json::parse(s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 2, "logprobs": 1})").body);
  EXPECT_EQ(j["choices"][0]["logprobs"]["tokens"], json::parse(R"(["a", "b"])"));
  EXPECT_EQ(j["choices"][0]["logprobs"]["text_offset"], json::parse("[0, 1]"));
  EXPECT_EQ(j["choices"][0]["logprobs"]["top_logprobs"][0], json::parse(R"({"a": -0.0})"));
  j = json::parse(s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "q"}], "max_tokens": 1,
      "logprobs": true, "top_logprobs": 2})").body);
  auto c = j["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(c["token"], "<");  // the byte codec's template starts with "<bos>"
  EXPECT_EQ(c["bytes"], json::parse("[60]"));
  EXPECT_EQ(c["top_logprobs"].size(), 2u);
}

// vLLM's --return-tokens-as-token-ids and its request field return_tokens_as_token_ids: OpenAI logprobs name tokens
// "token_id:ID" (completions' top_logprobs keys too, text offsets over those strings, chat's bytes of them); a
// request's field wins over the server's flag; prompt logprobs' decoded_token and the native API keep the text.
TEST(HttpApi, TokensAsTokenIds) {
  ServerOptions o;
  o.parse.return_tokens_as_token_ids = true;
  TestServer s(o);
  auto j = json::parse(s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 2, "logprobs": 1,
      "prompt_logprobs": 0})").body);
  auto lp = j["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json::parse(R"(["token_id:97", "token_id:98"])"));
  EXPECT_EQ(lp["text_offset"], json::parse("[0, 11]"));
  EXPECT_EQ(lp["top_logprobs"][0], json::parse(R"({"token_id:97": -0.0})"));
  EXPECT_EQ(j["choices"][0]["prompt_logprobs"][1]["97"]["decoded_token"], "a") << j.dump();  // (after <bos>)
  j = json::parse(s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "q"}], "max_tokens": 1,
      "logprobs": true, "top_logprobs": 1})").body);
  auto c = j["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(c["token"], "token_id:60");
  EXPECT_EQ(c["bytes"].size(), std::string("token_id:60").size());
  EXPECT_EQ(c["top_logprobs"][0]["token"], "token_id:60");
  j = json::parse(s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 1, "logprobs": 0,
      "return_tokens_as_token_ids": false})").body);
  EXPECT_EQ(j["choices"][0]["logprobs"]["tokens"], json::parse(R"(["a"])"));
  j = json::parse(s.post("/generate", R"({"text": "ab", "return_logprob": true, "return_text_in_logprobs": true,
      "sampling_params": {"max_new_tokens": 1}})").body);
  EXPECT_EQ(j["meta_info"]["output_token_logprobs"][0], json::parse(R"([-0.25, 97, "a"])"));
  TestServer plain;
  j = json::parse(plain.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 1, "logprobs": 0,
      "return_tokens_as_token_ids": true})").body);
  EXPECT_EQ(j["choices"][0]["logprobs"]["tokens"], json::parse(R"(["token_id:97"])"));
  EXPECT_EQ(plain.post("/v1/completions", R"({"prompt": "ab", "return_tokens_as_token_ids": 1})").status, 400);
}

// SGLang's return_hidden_states (with --enable-return-hidden-states, else a 400): /generate's meta_info.hidden_states
// is the prompt's rows as one list, then one row per generated token but the last (all so far in every streamed
// chunk, or with --stream-output the new ones); OpenAI choices carry the last row ([] with one token), streams a
// chunk of it after the text. Per prompt of a batch; a bad value is a 400.
TEST(HttpApi, ReturnHiddenStates) {
  auto expect_row = [](const json& row, int32_t p, const std::string& what) {
    const std::vector<float> want = test::FakeEngine::fake_hidden_row(p);
    ASSERT_TRUE(row.is_array()) << what << ": " << row.dump();
    ASSERT_EQ(row.size(), want.size()) << what;
    for (size_t k = 0; k < want.size(); ++k)
      EXPECT_EQ(static_cast<float>(row[k].get<double>()), want[k]) << what << " position " << p << " value " << k;
  };
  // The native layout for a prompt of P tokens and n generated tokens.
  auto expect_native = [&](const json& hs, int32_t P, int32_t n, const std::string& what) {
    ASSERT_EQ(hs.size(), static_cast<size_t>(n)) << what << ": " << hs.dump();
    ASSERT_EQ(hs[0].size(), static_cast<size_t>(P)) << what;
    for (int32_t p = 0; p < P; ++p) expect_row(hs[0][static_cast<size_t>(p)], p, what + " prompt");
    for (int32_t k = 1; k < n; ++k) expect_row(hs[static_cast<size_t>(k)], P + k - 1, what + " token");
  };
  {
    TestServer plain;
    auto r = plain.post("/generate", R"({"input_ids": [5, 6, 7], "return_hidden_states": true})");
    EXPECT_EQ(r.status, 400);
    EXPECT_NE(r.body.find("--enable-return-hidden-states"), std::string::npos) << r.body;
    r = plain.post("/generate", R"({"input_ids": [5, 6, 7], "return_hidden_states": false,
        "sampling_params": {"max_new_tokens": 2}})");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_FALSE(json::parse(r.body)["meta_info"].contains("hidden_states"));
  }
  {  // A request that could bring back more values than a request may (positions x hidden size x n) is a 400.
    ServerOptions small;
    small.enable_return_hidden_states = true;
    small.max_hidden_state_floats = 40 * test::FakeEngine::kHiddenSize;  // forty positions' rows
    TestServer t(small);
    const std::string gen = R"({"input_ids": [5, 6, 7], "return_hidden_states": true, "sampling_params":
        {"max_new_tokens": )";
    EXPECT_EQ(t.post("/generate", gen + "37}}").status, 200);
    auto big = t.post("/generate", gen + "38}}");
    EXPECT_EQ(big.status, 400);
    EXPECT_EQ(json::parse(big.body)["error"]["param"], "return_hidden_states") << big.body;
    EXPECT_EQ(t.post("/generate", R"({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 38}})").status,
              200);  // (no hidden states: no such bound)
    const std::string cmpl = R"({"prompt": [5, 6, 7], "max_tokens": 17, "return_hidden_states": true, "n": )";
    EXPECT_EQ(t.post("/v1/completions", cmpl + "2}").status, 200);  // twice twenty positions
    EXPECT_EQ(t.post("/v1/completions", cmpl + "3}").status, 400);
    // Chat without max_tokens (the whole context by default): its prompt counts, not the context.
    const std::string chat = R"({"messages": [{"role": "user", "content": "q"}], "return_hidden_states": true)";
    auto r = t.post("/v1/chat/completions", chat + "}");
    ASSERT_EQ(r.status, 200) << r.body;
    const int64_t prompt = json::parse(r.body)["usage"]["prompt_tokens"].get<int64_t>();
    ASSERT_LT(prompt, 40);
    EXPECT_EQ(t.post("/v1/chat/completions", chat + ", \"max_tokens\": " + std::to_string(40 - prompt) + "}").status,
              200);
    EXPECT_EQ(t.post("/v1/chat/completions", chat + ", \"max_tokens\": " + std::to_string(41 - prompt) + "}").status,
              400);
  }
  ServerOptions o;
  o.enable_return_hidden_states = true;
  TestServer s(o);
  auto r = s.post("/generate", R"({"input_ids": [5, 6, 7], "return_hidden_states": true,
      "sampling_params": {"max_new_tokens": 3}})");
  ASSERT_EQ(r.status, 200) << r.body;
  expect_native(json::parse(r.body)["meta_info"]["hidden_states"], 3, 3, "generate");
  r = s.post("/generate", R"({"input_ids": [5, 6, 7], "return_hidden_states": true,
      "sampling_params": {"max_new_tokens": 0}})");  // nothing generated: the prompt's rows (an embedding)
  ASSERT_EQ(r.status, 200) << r.body;
  expect_native(json::parse(r.body)["meta_info"]["hidden_states"], 3, 1, "no new tokens");
  // SGLang's earlier place for it; a batch with one value per prompt.
  r = s.post("/generate", R"({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2,
      "return_hidden_states": true}})");
  expect_native(json::parse(r.body)["meta_info"]["hidden_states"], 2, 2, "sampling_params");
  r = s.post("/generate", R"({"input_ids": [[5, 6], [7, 8, 9]], "return_hidden_states": [false, true],
      "sampling_params": {"max_new_tokens": 4}})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto batch = json::parse(r.body);
  EXPECT_FALSE(batch[0]["meta_info"].contains("hidden_states"));
  expect_native(batch[1]["meta_info"]["hidden_states"], 3, 4, "batch");
  for (const char* bad : {R"({"input_ids": [5], "return_hidden_states": 1})",
                          R"({"input_ids": [5], "return_hidden_states": [true]})",
                          R"({"input_ids": [[5], [6]], "return_hidden_states": [true, 0]})"})
    EXPECT_EQ(s.post("/generate", bad).status, 400) << bad;
  // Streamed: every chunk all rows so far, the last one all of them.
  r = s.post("/generate", R"({"input_ids": [5, 6, 7], "return_hidden_states": true, "stream": true,
      "sampling_params": {"max_new_tokens": 4}})");
  auto events = sse_payloads(r.body);
  ASSERT_GE(events.size(), 2u);
  expect_native(json::parse(events[events.size() - 2])["meta_info"]["hidden_states"], 3, 4, "stream");
  // OpenAI: the last row, [] when only the prompt's rows exist.
  auto j = json::parse(s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "q"}],
      "max_tokens": 3, "return_hidden_states": true})").body);
  const int32_t chat_prompt = j["usage"]["prompt_tokens"].get<int32_t>();
  expect_row(j["choices"][0]["hidden_states"], chat_prompt + 1, "chat");
  j = json::parse(s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 1, "return_hidden_states": true})").body);
  EXPECT_EQ(j["choices"][0]["hidden_states"], json::array());
  j = json::parse(s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 2})").body);
  EXPECT_FALSE(j["choices"][0].contains("hidden_states"));
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    const bool chat = std::string(path) == "/v1/chat/completions";
    r = s.post(path, chat ? R"({"messages": [{"role": "user", "content": "q"}], "max_tokens": 2, "stream": true,
                             "return_hidden_states": true, "stream_options": {"include_usage": true}})"
                          : R"({"prompt": "ab", "max_tokens": 2, "stream": true, "return_hidden_states": true,
                             "stream_options": {"include_usage": true}})");
    events = sse_payloads(r.body);
    ASSERT_GE(events.size(), 4u) << r.body;
    EXPECT_EQ(events.back(), "[DONE]");
    const json usage = json::parse(events[events.size() - 2]);
    const json hidden = json::parse(events[events.size() - 3])["choices"][0];  // after the finish, before the usage
    const int32_t prompt = usage["usage"]["prompt_tokens"].get<int32_t>();
    expect_row(chat ? hidden["delta"]["hidden_states"] : hidden["hidden_states"], prompt, path);
    EXPECT_TRUE(hidden["finish_reason"].is_null()) << path;
    EXPECT_FALSE(json::parse(events[events.size() - 4])["choices"][0]["finish_reason"].is_null()) << path;
  }
  // --stream-output: each chunk the rows new since the previous one.
  o.stream_output = true;
  TestServer inc(o);
  r = inc.post("/generate", R"({"input_ids": [5, 6, 7], "return_hidden_states": true, "stream": true,
      "sampling_params": {"max_new_tokens": 4}})");
  events = sse_payloads(r.body);
  json rows = json::array();
  for (size_t e = 0; e + 1 < events.size(); ++e) {
    const json chunk = json::parse(events[e]);
    for (const json& x : chunk["meta_info"]["hidden_states"]) rows.push_back(x);
  }
  expect_native(rows, 3, 4, "incremental stream");
}

// SGLang's return_routed_experts (with --enable-return-routed-experts, else 400): meta_info.routed_experts is the
// base64 of the little-endian int32 ids of every position's rows (those of return_hidden_states); OpenAI choices
// carry the same string; per prompt of a batch; --stream-output chunks carry the new rows.
TEST(HttpApi, ReturnRoutedExperts) {
  auto decode = [&](const json& v) {
    return test::int32s_of_base64(v.get<std::string>());
  };
  auto want = [](int32_t P, int32_t n) {
    std::vector<int32_t> ids;
    for (int32_t p = 0; p < P + n - 1; ++p)
      for (int32_t v : test::FakeEngine::fake_route_row(p)) ids.push_back(v);
    return ids;
  };
  {
    TestServer plain;
    auto r = plain.post("/generate", R"({"input_ids": [5, 6, 7], "return_routed_experts": true})");
    EXPECT_EQ(r.status, 400);
    EXPECT_NE(r.body.find("--enable-return-routed-experts"), std::string::npos) << r.body;
  }
  ServerOptions o;
  o.enable_return_routed_experts = true;
  TestServer s(o);
  auto r = s.post("/generate", R"({"input_ids": [5, 6, 7], "return_routed_experts": true,
      "sampling_params": {"max_new_tokens": 3}})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(decode(j["meta_info"]["routed_experts"]), want(3, 3));
  EXPECT_FALSE(j["meta_info"].contains("hidden_states"));
  EXPECT_EQ(s.post("/generate", R"({"input_ids": [5], "return_hidden_states": true})").status, 400)
      << "hidden states need their own flag";
  r = s.post("/generate", R"({"input_ids": [[5, 6], [7, 8, 9, 10]], "return_routed_experts": [false, true],
      "sampling_params": {"max_new_tokens": 2}})");
  j = json::parse(r.body);
  EXPECT_FALSE(j[0]["meta_info"].contains("routed_experts"));
  EXPECT_EQ(decode(j[1]["meta_info"]["routed_experts"]), want(4, 2));
  EXPECT_EQ(s.post("/generate", R"({"input_ids": [5], "return_routed_experts": "yes"})").status, 400);
  j = json::parse(
      s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 3, "return_routed_experts": true})").body);
  EXPECT_EQ(decode(j["choices"][0]["routed_experts"]), want(j["usage"]["prompt_tokens"].get<int32_t>(), 3));
  o.stream_output = true;
  TestServer inc(o);
  r = inc.post("/generate", R"({"input_ids": [5, 6, 7], "return_routed_experts": true, "stream": true,
      "sampling_params": {"max_new_tokens": 4}})");
  auto events = sse_payloads(r.body);
  std::vector<int32_t> joined;
  for (size_t e = 0; e + 1 < events.size(); ++e) {
    const json chunk = json::parse(events[e]);
    const std::vector<int32_t> part = decode(chunk["meta_info"]["routed_experts"]);
    joined.insert(joined.end(), part.begin(), part.end());
  }
  EXPECT_EQ(joined, want(3, 4));
}

TEST(HttpApi, CompletionsNonStreamAndStream) {
  TestServer s;
  auto r = s.post("/v1/completions", R"({"model": "fake", "prompt": "hey", "max_tokens": 4, "echo": true})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "fake");
  EXPECT_EQ(j["choices"][0]["text"], "heyheyh");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"], json::parse(R"({"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8})"));

  r = s.post("/v1/completions", R"({"prompt": "hey", "max_tokens": 4, "n": 2, "stream": true, "stop": "y",
                                    "stream_options": {"include_usage": true}})");
  auto events = sse_payloads(r.body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  auto usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(usage["usage"]["completion_tokens"], 6);  // "h", "e", "y" per sample; the stop string is cut
  std::map<int, std::string> text;
  std::map<int, std::string> finish;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    auto e = json::parse(events[i]);
    EXPECT_TRUE(e.contains("usage") && e["usage"].is_null());
    auto ch = e["choices"][0];
    text[ch["index"].get<int>()] += ch["text"].get<std::string>();
    if (!ch["finish_reason"].is_null()) finish[ch["index"].get<int>()] = ch["finish_reason"];
  }
  EXPECT_EQ(text[0], "he");
  EXPECT_EQ(text[1], "he");
  EXPECT_EQ(finish[0], "stop");
  EXPECT_EQ(finish[1], "stop");
}

// Prompt logprobs: completions echo with logprobs lists the prompt's tokens first (the first one's logprob and
// alternatives null, offsets from 0), then the generated ones; streamed, the echoed prompt comes with them; max_tokens
// 0 with echo reads the prompt only. The native API gives input_token_logprobs from logprob_start_len on.
TEST(HttpApi, PromptLogprobs) {
  TestServer s;
  auto r = s.post("/v1/completions", R"({"prompt": "hey", "max_tokens": 2, "echo": true, "logprobs": 1})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto lp = json::parse(r.body)["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json::parse(R"(["<bos>", "h", "e", "y", "h", "e"])"));
  ASSERT_EQ(lp["token_logprobs"].size(), 6u);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_NEAR(lp["token_logprobs"][1].get<double>(), -0.1, 1e-6);
  EXPECT_NEAR(lp["token_logprobs"][3].get<double>(), -0.3, 1e-6);
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["top_logprobs"][2].size(), 1u);
  EXPECT_EQ(lp["text_offset"], json::parse("[0, 5, 6, 7, 8, 9]"));  // over the tokens' text, as vLLM counts
  // Without echo: the generated tokens only.
  lp = json::parse(s.post("/v1/completions", R"({"prompt": "hey", "max_tokens": 2, "logprobs": 0})").body)
           ["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"].size(), 2u);

  r = s.post("/v1/completions", R"({"prompt": "hey", "max_tokens": 0, "echo": true, "logprobs": 0})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto ch = json::parse(r.body)["choices"][0];
  EXPECT_EQ(ch["text"], "hey");
  EXPECT_EQ(ch["finish_reason"], "length");
  EXPECT_EQ(ch["logprobs"]["tokens"].size(), 4u);
  EXPECT_EQ(s.post("/v1/completions", R"({"prompt": "hey", "max_tokens": 0})").status, 400);

  r = s.post("/v1/completions", R"({"prompt": "hey", "max_tokens": 2, "echo": true, "logprobs": 0, "stream": true})");
  auto events = sse_payloads(r.body);
  ASSERT_GE(events.size(), 3u);
  auto first = json::parse(events[0])["choices"][0];
  EXPECT_EQ(first["text"], "hey");
  EXPECT_EQ(first["logprobs"]["tokens"].size(), 4u);
  EXPECT_EQ(first["logprobs"]["text_offset"], json::parse("[0, 5, 6, 7]"));
  std::string text;
  json offsets = json::array();
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    auto c = json::parse(events[i])["choices"][0];
    text += c["text"].get<std::string>();
    if (!c["logprobs"].is_null())
      for (const auto& o : c["logprobs"]["text_offset"]) offsets.push_back(o);
  }
  EXPECT_EQ(text, "heyhe");
  EXPECT_EQ(offsets, json::parse("[0, 5, 6, 7, 8, 9]"));

  auto meta = json::parse(s.post("/generate", R"({"text": "hey", "sampling_params": {"max_new_tokens": 1},
      "return_logprob": true, "logprob_start_len": 2, "top_logprobs_num": 2})").body)["meta_info"];
  ASSERT_EQ(meta["input_token_logprobs"].size(), 2u);  // positions 2, 3 of <bos> h e y
  EXPECT_NEAR(meta["input_token_logprobs"][0][0].get<double>(), -0.2, 1e-6);
  EXPECT_EQ(meta["input_token_logprobs"][0][1], 'e');
  EXPECT_EQ(meta["input_top_logprobs"][1].size(), 2u);
  EXPECT_EQ(meta["output_token_logprobs"].size(), 1u);
  meta = json::parse(s.post("/generate", R"({"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 0},
      "return_logprob": true, "logprob_start_len": 0})").body)["meta_info"];
  ASSERT_EQ(meta["input_token_logprobs"].size(), 2u);
  EXPECT_TRUE(meta["input_token_logprobs"][0][0].is_null());
  EXPECT_TRUE(meta["output_token_logprobs"].empty());
  meta = json::parse(s.post("/generate", R"({"text": "hey", "return_logprob": true})").body)["meta_info"];
  EXPECT_FALSE(meta.contains("input_token_logprobs"));

  // vLLM's prompt_logprobs: per prompt token {"<id>": {logprob, rank, decoded_token}} with the alternatives.
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    const std::string input = std::string(path) == "/v1/completions"
                                  ? R"("prompt": "hey")"
                                  : R"("messages": [{"role": "user", "content": "hey"}])";
    const std::string req = "{" + input + R"(, "max_tokens": 1, "prompt_logprobs": 1)";
    auto pl = json::parse(s.post(path, req + "}").body)["choices"][0]["prompt_logprobs"];
    SCOPED_TRACE(path);
    ASSERT_TRUE(pl.is_array() && pl.size() >= 4u);
    EXPECT_TRUE(pl[0].is_null());
    const auto& e = pl[1];  // the fake: logprob -0.1 p, rank 1 + p % 3, alternatives (token + k) % 256
    ASSERT_TRUE(e.is_object());
    const std::string first_key = e.begin().key();
    EXPECT_NEAR(e[first_key]["logprob"].get<double>(), -0.1, 1e-6);
    EXPECT_EQ(e[first_key]["rank"], 2);
    EXPECT_EQ(e.size(), 1u);  // the only alternative (k = 0) is the token itself
    auto events = sse_payloads(s.post(path, req + R"(, "stream": true})").body);
    int with = 0;
    for (const auto& ev : events)
      if (ev != "[DONE]" && json::parse(ev)["choices"][0].contains("prompt_logprobs")) ++with;
    EXPECT_EQ(with, 1);
  }
  EXPECT_EQ(s.post("/v1/completions", R"({"prompt": "a", "prompt_logprobs": 99})").status, 400);
}

// --reasoning-parser deepseek-r1: chat output before "</think>" is reasoning_content, after it content, whole or
// streamed (the fake engine repeats the prompt: "<bos>[user]why</think>so[assistant]" + the template's prefix);
// separate_reasoning false keeps it in content; chat_template_kwargs reach the template (the fake's "prefix").
TEST(HttpApi, ReasoningContentAndTemplateKwargs) {
  ServerOptions o;
  o.reasoning_parser = "deepseek-r1";
  TestServer s(o);
  const std::string script = "<bos>[user]why</think>so[assistant]P";
  const std::string body = R"({"messages": [{"role": "user", "content": "why</think>so"}], "chat_template_kwargs":
      {"prefix": "P"}, "max_tokens": )" + std::to_string(script.size());
  auto r = s.post("/v1/chat/completions", body + "}");
  ASSERT_EQ(r.status, 200) << r.body;
  auto msg = json::parse(r.body)["choices"][0]["message"];
  EXPECT_EQ(msg["reasoning_content"], "<bos>[user]why");
  EXPECT_EQ(msg["content"], "so[assistant]P");
  msg = json::parse(s.post("/v1/chat/completions", body + R"(, "separate_reasoning": false})").body)["choices"][0]
                                                                                                   ["message"];
  EXPECT_EQ(msg["content"], script);
  EXPECT_FALSE(msg.contains("reasoning_content"));

  auto events = sse_payloads(s.post("/v1/chat/completions", body + R"(, "stream": true})").body);
  std::string reasoning, content;
  bool content_started = false, reasoning_after_content = false;
  for (const auto& e : events) {
    if (e == "[DONE]") continue;
    const auto d = json::parse(e)["choices"][0]["delta"];
    if (d.contains("reasoning_content")) {
      reasoning += d["reasoning_content"].get<std::string>();
      reasoning_after_content |= content_started;
    }
    if (d.contains("content") && d["content"].is_string()) {
      content += d["content"].get<std::string>();
      content_started |= !d["content"].get<std::string>().empty();
    }
  }
  EXPECT_EQ(reasoning, "<bos>[user]why");
  EXPECT_EQ(content, "so[assistant]P");
  EXPECT_FALSE(reasoning_after_content);
  // vLLM's include_reasoning false: the reasoning is split off and dropped, whole or streamed.
  msg = json::parse(s.post("/v1/chat/completions", body + R"(, "include_reasoning": false})").body)["choices"][0]
                                                                                                     ["message"];
  EXPECT_EQ(msg["content"], "so[assistant]P");
  EXPECT_TRUE(msg["reasoning_content"].is_null()) << msg.dump();
  content.clear();
  for (const auto& e : sse_payloads(
           s.post("/v1/chat/completions", body + R"(, "include_reasoning": false, "stream": true})").body)) {
    if (e == "[DONE]") continue;
    const auto d = json::parse(e)["choices"][0]["delta"];
    EXPECT_FALSE(d.contains("reasoning_content")) << e;
    if (d.contains("content") && d["content"].is_string()) content += d["content"].get<std::string>();
  }
  EXPECT_EQ(content, "so[assistant]P");
  // SGLang's stream_reasoning false: the reasoning in one delta once it has ended, then the answer.
  std::vector<std::string> reasoning_deltas;
  content.clear();
  for (const auto& e : sse_payloads(
           s.post("/v1/chat/completions", body + R"(, "stream_reasoning": false, "stream": true})").body)) {
    if (e == "[DONE]") continue;
    const auto d = json::parse(e)["choices"][0]["delta"];
    if (d.contains("reasoning_content")) {
      EXPECT_TRUE(content.empty()) << "the reasoning before the answer";
      reasoning_deltas.push_back(d["reasoning_content"].get<std::string>());
    }
    if (d.contains("content") && d["content"].is_string()) content += d["content"].get<std::string>();
  }
  EXPECT_EQ(reasoning_deltas, (std::vector<std::string>{"<bos>[user]why"}));
  EXPECT_EQ(content, "so[assistant]P");
  auto bad = s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "a"}],
      "chat_template_kwargs": [1]})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("chat_template_kwargs"), std::string::npos);
}

// --reasoning-parser deepseek-v3 (the hybrid DeepSeek-V3.1, SGLang's name; vLLM's deepseek_v3): the output is split
// only when chat_template_kwargs turn thinking on; otherwise all of it is content, "</think>" included.
TEST(HttpApi, ReasoningParserV3FollowsThinking) {
  ServerOptions o;
  o.reasoning_parser = "deepseek-v3";
  TestServer s(o);
  const std::string script = "<bos>[user]why</think>so[assistant]";
  const auto body = [&](const std::string& kwargs, bool stream) {
    return R"({"messages": [{"role": "user", "content": "why</think>so"}], "max_tokens": )" +
           std::to_string(script.size()) + (kwargs.empty() ? "" : R"(, "chat_template_kwargs": )" + kwargs) +
           (stream ? R"(, "stream": true})" : "}");
  };
  for (const std::string kwargs : {"", "{}", R"({"thinking": false})"}) {
    auto r = s.post("/v1/chat/completions", body(kwargs, false));
    ASSERT_EQ(r.status, 200) << r.body;
    const auto msg = json::parse(r.body)["choices"][0]["message"];
    EXPECT_EQ(msg["content"], script) << kwargs;
    EXPECT_TRUE(!msg.contains("reasoning_content") || msg["reasoning_content"].is_null()) << kwargs;
  }
  for (const std::string kwargs : {R"({"thinking": true})", R"({"enable_thinking": true})"}) {
    auto r = s.post("/v1/chat/completions", body(kwargs, false));
    ASSERT_EQ(r.status, 200) << r.body;
    const auto msg = json::parse(r.body)["choices"][0]["message"];
    EXPECT_EQ(msg["reasoning_content"], "<bos>[user]why") << kwargs;
    EXPECT_EQ(msg["content"], "so[assistant]") << kwargs;
    std::string reasoning, content;
    for (const auto& e : sse_payloads(s.post("/v1/chat/completions", body(kwargs, true)).body)) {
      if (e == "[DONE]") continue;
      const auto d = json::parse(e)["choices"][0]["delta"];
      if (d.contains("reasoning_content") && d["reasoning_content"].is_string())
        reasoning += d["reasoning_content"].get<std::string>();
      if (d.contains("content") && d["content"].is_string()) content += d["content"].get<std::string>();
    }
    EXPECT_EQ(reasoning, "<bos>[user]why") << kwargs;
    EXPECT_EQ(content, "so[assistant]") << kwargs;
  }
}

// Two tool calls (f with {"a": 1}, then g with {}) in DeepSeek's markers, as the model writes them.
const std::string kCallsFG =
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜>\n"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

// Tools f (an object's parameters) and g, and an unfinished chat body (no closing brace) asking with them for a reply
// the fake engine makes of "hi", `calls` and an EOS.
const std::string kToolsFG = R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}}])";
std::string tool_chat_body(const std::string& calls) {
  return R"({"messages": [{"role": "user", "content": )" + json("hi" + calls + "#").dump() +
         R"(}], "max_tokens": 500, "tools": )" + kToolsFG;
}

// --tool-call-parser deepseekv3: the tools reach the template, the calls in the output come back as tool_calls (whole
// and streamed, finish_reason "tool_calls" when the model stopped after them). The fake engine repeats the prompt
// "<bos>[tools:f,g,][user]<user content>[assistant]", where the user content holds the calls and a '#' (EOS).
TEST(HttpApi, ToolCalls) {
  ServerOptions o;
  o.tool_call_parser = "deepseekv3";
  TestServer s(o);
  const std::string calls = kCallsFG;
  const std::string tools = kToolsFG, body = tool_chat_body(calls);
  auto r = s.post("/v1/chat/completions", body + "}");
  ASSERT_EQ(r.status, 200) << r.body;
  auto ch = json::parse(r.body)["choices"][0];
  EXPECT_EQ(ch["finish_reason"], "tool_calls");
  EXPECT_EQ(ch["message"]["content"], "<bos>[tools:f,g,][user]hi");
  ASSERT_EQ(ch["message"]["tool_calls"].size(), 2u);
  const auto& c0 = ch["message"]["tool_calls"][0];
  EXPECT_EQ(c0["type"], "function");
  EXPECT_EQ(c0["function"]["name"], "f");
  EXPECT_EQ(c0["function"]["arguments"], "{\"a\": 1}");
  EXPECT_EQ(c0["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_NE(c0["id"], ch["message"]["tool_calls"][1]["id"]);
  EXPECT_EQ(ch["message"]["tool_calls"][1]["function"]["name"], "g");

  ch = json::parse(s.post("/v1/chat/completions", body + R"(, "parallel_tool_calls": false})").body)["choices"][0];
  EXPECT_EQ(ch["message"]["tool_calls"].size(), 1u);
  ch = json::parse(s.post("/v1/chat/completions", body + R"(, "tool_choice": "none"})").body)["choices"][0];
  EXPECT_FALSE(ch["message"].contains("tool_calls"));  // neither shown nor parsed
  EXPECT_EQ(ch["finish_reason"], "stop");
  EXPECT_EQ(ch["message"]["content"].get<std::string>().rfind("<bos>[user]hi<｜tool", 0), 0u);

  auto events = sse_payloads(s.post("/v1/chat/completions", body + R"(, "stream": true})").body);
  std::string content;
  std::vector<json> streamed;
  std::string finish;
  for (const auto& e : events) {
    if (e == "[DONE]") continue;
    const auto c = json::parse(e)["choices"][0];
    if (c["delta"].contains("content") && c["delta"]["content"].is_string()) content += c["delta"]["content"];
    if (c["delta"].contains("tool_calls"))
      for (const auto& t : c["delta"]["tool_calls"]) streamed.push_back(t);
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
  }
  EXPECT_EQ(content, "<bos>[tools:f,g,][user]hi");
  ASSERT_EQ(streamed.size(), 2u);
  EXPECT_EQ(streamed[0]["index"], 0);
  EXPECT_EQ(streamed[1]["index"], 1);
  EXPECT_EQ(streamed[1]["function"]["name"], "g");
  EXPECT_EQ(finish, "tool_calls");

  EXPECT_EQ(s.post("/v1/chat/completions", body + R"(, "tool_choice": "required"})").status, 400);
  EXPECT_EQ(s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "a"}], "tools": [{"type":
      "function", "function": {}}]})").status, 400);
  TestServer plain;
  auto no_parser = plain.post("/v1/chat/completions", body + "}");
  EXPECT_EQ(no_parser.status, 400);
  EXPECT_NE(no_parser.body.find("--tool-call-parser"), std::string::npos);
}

// --tool-call-parser kimi_k2: Kimi-K2's markers; each call keeps the id the model wrote (functions.NAME:IDX), which
// Kimi's template shows back to it; /parse_function_call reads the same form.
TEST(HttpApi, KimiToolCalls) {
  ServerOptions o;
  o.tool_call_parser = "kimi_k2";
  TestServer s(o);
  const std::string calls =
      "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1}"
      "<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
      "<|tool_calls_section_end|>";
  const std::string tools = kToolsFG, body = tool_chat_body(calls);
  auto r = s.post("/v1/chat/completions", body + "}");
  ASSERT_EQ(r.status, 200) << r.body;
  auto ch = json::parse(r.body)["choices"][0];
  EXPECT_EQ(ch["finish_reason"], "tool_calls");
  EXPECT_EQ(ch["message"]["content"], "<bos>[tools:f,g,][user]hi");
  ASSERT_EQ(ch["message"]["tool_calls"].size(), 2u);
  EXPECT_EQ(ch["message"]["tool_calls"][0]["id"], "functions.f:0");
  EXPECT_EQ(ch["message"]["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(ch["message"]["tool_calls"][0]["function"]["arguments"], "{\"a\": 1}");
  EXPECT_EQ(ch["message"]["tool_calls"][1]["id"], "functions.g:1");
  // DeepSeek's markers are plain text to this parser.
  const std::string ds_body = tool_chat_body(kCallsFG) + "}";
  ch = json::parse(s.post("/v1/chat/completions", ds_body).body)["choices"][0];
  EXPECT_FALSE(ch["message"].contains("tool_calls"));
  // tool_choice "required" writes Kimi's special tokens, which the fake tokenizer lacks: a 400 naming them.
  r = s.post("/v1/chat/completions", body + R"(, "tool_choice": "required"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("<|tool_calls_section_begin|>"), std::string::npos) << r.body;
  // SGLang's /parse_function_call with the server's parser, and naming it.
  r = s.post("/parse_function_call", json{{"text", "ok " + calls}, {"tools", json::parse(tools)}}.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  json p = json::parse(r.body);
  EXPECT_EQ(p["normal_text"], "ok");
  ASSERT_EQ(p["calls"].size(), 2u);
  EXPECT_EQ(p["calls"][1]["name"], "g");
  EXPECT_EQ(p["calls"][1]["tool_index"], 1);
  p = json::parse(s.post("/parse_function_call", json{{"text", "ok " + kCallsFG}, {"tool_call_parser", "deepseekv3"}}
                                                      .dump())
                      .body);
  EXPECT_EQ(p["calls"].size(), 2u);
  r = s.post("/parse_function_call", json{{"text", "x"}, {"tool_call_parser", "kimi"}}.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("kimi_k2"), std::string::npos) << r.body;
}

// Generative scoring (SGLang's /v1/score, vLLM's /generative_scoring): each item's prompt generated for one token
// with the labels' logprobs; the fake engine gives label id the logprob -(id % 8) / 8 - P / 16 at a prompt of P
// tokens, so the answers show each prompt's length and each API's normalisation.
TEST(HttpApi, GenerativeScoring) {
  TestServer s;
  auto lp = [](int id, int P) { return -0.125 * (id % 8) - 0.0625 * P; };
  // SGLang, texts: "ab" + "c" and "ab" + "de" with the BOS (4 and 5 tokens); probabilities over the vocabulary.
  auto r = s.post("/v1/score", R"({"query": "ab", "items": ["c", "de"], "label_token_ids": [9, 10]})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_EQ(j["object"], "scoring");
  EXPECT_EQ(j["model"], "fake");
  ASSERT_EQ(j["scores"].size(), 2u);
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 2; ++k) EXPECT_NEAR(j["scores"][i][k].get<double>(), std::exp(lp(9 + k, 4 + i)), 1e-6);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 9);
  EXPECT_EQ(j["usage"]["completion_tokens"], 2);
  // apply_softmax: over the labels alone (the prompt's length cancels); one text item; token ids, item first.
  r = s.post("/v1/score", R"({"query": "ab", "items": "c", "label_token_ids": [9, 10, 17], "apply_softmax": true})");
  j = json::parse(r.body);
  const double z = std::exp(lp(9, 0)) + std::exp(lp(10, 0)) + std::exp(lp(17, 0));
  ASSERT_EQ(j["scores"].size(), 1u);
  for (int k = 0; k < 3; ++k)
    EXPECT_NEAR(j["scores"][0][k].get<double>(), std::exp(lp(k == 2 ? 17 : 9 + k, 0)) / z, 1e-6);
  r = s.post("/v1/score", R"({"query": [1, 2], "items": [[3], [4, 5, 6]], "label_token_ids": [8],
      "item_first": true, "model": "default"})");
  j = json::parse(r.body);
  EXPECT_NEAR(j["scores"][0][0].get<double>(), std::exp(lp(8, 3)), 1e-6);
  EXPECT_NEAR(j["scores"][1][0].get<double>(), std::exp(lp(8, 5)), 1e-6);

  // vLLM: the query tokenized with its BOS, items without; the first label's probability, over the labels by default.
  r = s.post("/generative_scoring", R"({"model": "fake", "query": "ab", "items": ["c", [99, 100]],
      "label_token_ids": [9, 10]})");
  ASSERT_EQ(r.status, 200) << r.body;
  j = json::parse(r.body);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["id"].get<std::string>().rfind("generative-scoring-", 0), 0u);
  ASSERT_EQ(j["data"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(j["data"][i]["index"], i);
    EXPECT_EQ(j["data"][i]["object"], "score");
    EXPECT_NEAR(j["data"][i]["score"].get<double>(), 1.0 / (1.0 + std::exp(lp(10, 0) - lp(9, 0))), 1e-6);
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], 9);  // 3 + 1 and 3 + 2
  r = s.post("/generative_scoring", R"({"query": "ab", "items": ["c"], "label_token_ids": [9, 10],
      "apply_softmax": false, "add_special_tokens": false})");
  EXPECT_NEAR(json::parse(r.body)["data"][0]["score"].get<double>(), std::exp(lp(9, 3)), 1e-6);

  for (const auto& [path, body, param] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"/v1/score", R"({"query": "a", "items": ["b"]})", "label_token_ids"},
           {"/v1/score", R"({"query": "a", "items": ["b"], "label_token_ids": []})", "label_token_ids"},
           {"/v1/score", R"({"query": "a", "items": ["b"], "label_token_ids": [258]})", "label_token_ids"},
           {"/v1/score", R"({"query": "a", "items": [], "label_token_ids": [1]})", "items"},
           {"/v1/score", R"({"query": "a", "items": [[1]], "label_token_ids": [1]})", "items[0]"},
           {"/v1/score", R"({"items": ["b"], "label_token_ids": [1]})", "query"},
           {"/v1/score", R"({"query": [1, "x"], "items": [[1]], "label_token_ids": [1]})", "query"},
           {"/v1/score", R"({"query": "a", "items": ["b"], "label_token_ids": [1], "apply_softmax": 1})",
            "apply_softmax"},
           {"/generative_scoring", R"({"query": "a", "items": "b", "label_token_ids": [1]})", "items"}}) {
    r = s.post(path, body);
    EXPECT_EQ(r.status, 400) << body;
    EXPECT_EQ(json::parse(r.body)["error"]["param"], param) << r.body;
  }
  EXPECT_EQ(s.post("/v1/score", R"({"model": "other", "query": "a", "items": ["b"], "label_token_ids": [1]})").status,
            404);
  EXPECT_EQ(s.get("/v1/score").status, 405);
  EXPECT_TRUE(s.wait_idle());
}

// The prompts each API builds (vLLM's cut to the context less one token).
TEST(Scoring, PromptsAsEachApiMakes) {
  test::ByteCodec codec;
  ScorePlan p = plan_score(json::parse(R"({"query": [1, 2], "items": [[3], [4, 5]], "item_first": true,
      "label_token_ids": [7]})"), ScoreApi::Sglang, &codec, 100, ParseOptions{});
  EXPECT_EQ(p.generate["input_ids"], json::parse("[[3, 1, 2], [4, 5, 1, 2]]"));
  EXPECT_EQ(p.generate["token_ids_logprob"], json::parse("[7]"));
  EXPECT_EQ(p.generate["sampling_params"]["max_new_tokens"], 1);
  EXPECT_FALSE(p.apply_softmax);
  p = plan_score(json::parse(R"({"query": "ab", "items": ["c"], "item_first": true, "label_token_ids": [7]})"),
                 ScoreApi::Sglang, &codec, 100, ParseOptions{});
  EXPECT_EQ(p.generate["text"], json::parse(R"(["cab"])"));
  p = plan_score(json::parse(R"({"query": "ab", "items": ["cdefgh", [9]], "label_token_ids": [7]})"), ScoreApi::Vllm,
                 &codec, 6, ParseOptions{});
  EXPECT_EQ(p.generate["input_ids"], json::parse(R"([[256, 97, 98, 99, 100], [256, 97, 98, 9]])"));
  EXPECT_TRUE(p.apply_softmax);
  p = plan_score(json::parse(R"({"query": "ab", "items": ["c"], "item_first": true, "label_token_ids": [7]})"),
                 ScoreApi::Vllm, &codec, 100, ParseOptions{});
  EXPECT_EQ(p.generate["input_ids"], json::parse(R"([[99, 256, 97, 98]])"));
  ParseOptions small;
  small.max_token_ids_logprob = 2;
  small.max_batch = 2;
  EXPECT_THROW(plan_score(json::parse(R"({"query": "a", "items": ["b"], "label_token_ids": [1, 2, 3]})"),
                          ScoreApi::Sglang, &codec, 100, small),
               ApiError);
  EXPECT_THROW(plan_score(json::parse(R"({"query": "a", "items": ["b", "c", "d"], "label_token_ids": [1]})"),
                          ScoreApi::Sglang, &codec, 100, small),
               ApiError);
  EXPECT_THROW(plan_score(json::parse(R"({"query": "a", "items": ["b"], "label_token_ids": [1]})"), ScoreApi::Vllm,
                          nullptr, 100, small),
               ApiError);  // text without a tokenizer
}

// vLLM's per-request chat_template (or chat_template_kwargs.chat_template): refused (400 naming the flag) unless the
// server trusts request templates, then the request renders with it (the fake engine echoes the prompt); a template
// that fails is a 400 naming chat_template.
TEST(HttpApi, RequestChatTemplate) {
  // (The fake engine echoes the prompt until the '#', its EOS.)
  const std::string hi = R"({"messages": [{"role": "user", "content": "hi#"}], "max_tokens": 100, )";
  TestServer plain;
  auto r = plain.post("/v1/chat/completions", hi + R"("chat_template": "T"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "chat_template");
  EXPECT_NE(r.body.find("--trust-request-chat-template"), std::string::npos) << r.body;
  EXPECT_EQ(plain.post("/v1/chat/completions", hi + R"("chat_template_kwargs": {"chat_template": "T"}})").status, 400);
  ServerOptions o;
  o.trust_request_chat_template = true;
  TestServer s(o);
  auto content = [&](const std::string& body) {
    auto res = s.post("/v1/chat/completions", body);
    EXPECT_EQ(res.status, 200) << res.body;
    return json::parse(res.body)["choices"][0]["message"]["content"].get<std::string>();
  };
  EXPECT_EQ(content(hi + R"("chat_template": "T"})"), "<bos>{T}hi");
  EXPECT_EQ(content(hi + R"("chat_template_kwargs": {"chat_template": "K", "x": 1}})"), "<bos>{K}hi");
  EXPECT_EQ(content(hi + R"("chat_template": null})"), "<bos>[user]hi");  // the model's
  for (const auto& [body, param] : {std::pair{hi + R"("chat_template": 5})", "chat_template"},
                                    std::pair{hi + R"("chat_template": "{% bad"})", "chat_template"},
                                    std::pair{hi + R"("chat_template_kwargs": {"chat_template": []}})",
                                              "chat_template_kwargs.chat_template"}}) {
    r = s.post("/v1/chat/completions", body);
    EXPECT_EQ(r.status, 400) << body;
    EXPECT_EQ(json::parse(r.body)["error"]["param"], param) << r.body;
  }
  // vLLM's /tokenize of messages renders them the same way.
  r = s.post("/tokenize", R"({"messages": [{"role": "user", "content": "hi#"}], "chat_template": "T",
      "return_token_strs": true})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["count"], std::string("<bos>{T}hi#").size());
  EXPECT_EQ(json::parse(r.body)["token_strs"].back(), "#");  // (vLLM's return_token_strs)
  EXPECT_EQ(s.post("/tokenize", R"({"prompt": "a", "return_token_strs": "yes"})").status, 400);
}

// SGLang's /parse_function_call: the calls of a text (the server's parser unless the request names one), calls of
// functions not among `tools` dropped, each with its tool's index; the text before the calls trimmed.
TEST(HttpApi, ParseFunctionCall) {
  TestServer s;  // no --tool-call-parser: deepseekv3 unless the request names one
  const std::string tools = R"([{"type": "function", "function": {"name": "g"}},
      {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])";
  auto r = s.post("/parse_function_call", R"({"text": )" + json("  Let me look.\n" + kCallsFG).dump() +
                                              R"(, "tools": )" + tools + "}");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body), json::parse(R"({"normal_text": "Let me look.", "calls": [
      {"tool_index": 1, "name": "f", "parameters": "{\"a\": 1}"},
      {"tool_index": 0, "name": "g", "parameters": "{}"}]})"));
  // Only f defined: g's call dropped; V3.1's form (NAME<｜tool▁sep｜>ARGS) read too.
  const std::string v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"city\": \"東京\"}<｜tool▁call▁end｜>"
                          "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  r = s.post("/parse_function_call", R"({"tool_call_parser": "deepseekv31", "text": )" + json(v31).dump() +
                                         R"(, "tools": [{"type": "function", "function": {"name": "f"}}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body), json::parse(R"({"normal_text": "", "calls": [
      {"tool_index": 0, "name": "f", "parameters": "{\"city\": \"東京\"}"}]})"));
  // No tools: every call listed, tool_index -1; no calls: the text as it is; a call cut short is none.
  r = s.post("/parse_function_call", R"({"text": )" + json(kCallsFG).dump() + "}");
  ASSERT_EQ(r.status, 200) << r.body;
  const json all = json::parse(r.body);
  ASSERT_EQ(all["calls"].size(), 2u);
  EXPECT_EQ(all["calls"][1], json::parse(R"({"tool_index": -1, "name": "g", "parameters": "{}"})"));
  r = s.post("/parse_function_call", R"({"text": " plain text ", "tools": )" + tools + "}");
  EXPECT_EQ(json::parse(r.body), json::parse(R"({"normal_text": " plain text ", "calls": []})"));
  const std::string cut = kCallsFG.substr(0, kCallsFG.find("<｜tool▁call▁end｜>"));
  r = s.post("/parse_function_call", R"({"text": )" + json("x " + cut).dump() + "}");
  EXPECT_EQ(json::parse(r.body), json::parse(R"({"normal_text": "x", "calls": []})"));

  for (const auto& [body, param] :
       {std::pair{R"({"tools": []})", "text"}, std::pair{R"({"text": 5})", "text"},
        std::pair{R"({"text": "a", "tool_call_parser": "llama3"})", "tool_call_parser"},
        std::pair{R"({"text": "a", "tools": {"name": "f"}})", "tools"},
        std::pair{R"({"text": "a", "tools": [{"type": "function", "function": {}}]})", "tools[0].function.name"}}) {
    r = s.post("/parse_function_call", body);
    EXPECT_EQ(r.status, 400) << body;
    EXPECT_EQ(json::parse(r.body)["error"]["param"], param) << r.body;
  }
  EXPECT_EQ(s.post("/parse_function_call", "[1]").status, 400);
  EXPECT_EQ(s.get("/parse_function_call").status, 405);
}

// SGLang's /separate_reasoning: deepseek-r1 reads a text as reasoning until "</think>" (the opening tag optional),
// deepseek-v3 only a text that opens its thinking; the request's parser or else the server's.
TEST(HttpApi, SeparateReasoning) {
  ServerOptions o;
  o.reasoning_parser = "deepseek-r1";
  TestServer s(o);
  auto split = [&](const std::string& text, const std::string& parser = "") {
    auto r = s.post("/separate_reasoning", R"({"text": )" + json(text).dump() +
                                               (parser.empty() ? "" : R"(, "reasoning_parser": ")" + parser + "\"") +
                                               "}");
    EXPECT_EQ(r.status, 200) << r.body;
    const json j = json::parse(r.body);
    return std::pair{j["reasoning_text"].get<std::string>(), j["text"].get<std::string>()};
  };
  using P = std::pair<std::string, std::string>;
  EXPECT_EQ(split("<think>\nWhy? Because.</think>\n\nThe answer."), (P{"Why? Because.", "The answer."}));
  EXPECT_EQ(split("No opening tag.</think>Answer"), (P{"No opening tag.", "Answer"}));
  EXPECT_EQ(split("Cut short while thinking"), (P{"Cut short while thinking", ""}));
  EXPECT_EQ(split("Plain answer", "deepseek-v3"), (P{"", "Plain answer"}));
  EXPECT_EQ(split("<think>hm</think>yes", "deepseek_v3"), (P{"hm", "yes"}));

  auto bad = s.post("/separate_reasoning", R"({"text": "a", "reasoning_parser": "qwen3"})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("deepseek-r1"), std::string::npos);
  EXPECT_EQ(s.post("/separate_reasoning", R"({"reasoning_parser": "deepseek-r1"})").status, 400);
  EXPECT_EQ(s.get("/separate_reasoning").status, 405);
  TestServer plain;  // no --reasoning-parser: the request must name one
  bad = plain.post("/separate_reasoning", R"({"text": "a"})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(json::parse(bad.body)["error"]["param"], "reasoning_parser");
  EXPECT_EQ(json::parse(plain.post("/separate_reasoning", R"({"text": "x</think>y", "reasoning_parser":
      "deepseek-r1"})").body)["text"], "y");
}

// OpenAI's Responses API over the chat machinery (the fake engine echoes the rendered prompt, so the output shows
// what the input items became): a response object with message and function_call items, the same as typed stream
// events, and 400s naming the field for what it cannot express.
TEST(HttpApi, ResponsesApi) {
  ServerOptions o;
  o.tool_call_parser = "deepseekv3";
  TestServer s(o);
  const std::string calls = kCallsFG;
  json req = {{"model", "fake"},
              {"instructions", "be brief"},
              {"input", json::array({{{"role", "user"}, {"content", json::array({{{"type", "input_text"}, {"text", "q"}}})}},
                                     {{"type", "function_call"}, {"call_id", "c1"}, {"name", "f"}, {"arguments", "{}"}},
                                     {{"type", "function_call"}, {"call_id", "c2"}, {"name", "g"}, {"arguments", "[]"}},
                                     {{"type", "function_call_output"}, {"call_id", "c1"}, {"output", "r1"}},
                                     {{"type", "reasoning"}, {"summary", json::array()}},
                                     {{"role", "user"}, {"content", "hi" + calls + "#"}}})},
              {"max_output_tokens", 500},
              {"tools", json::array({{{"type", "function"}, {"name", "f"}, {"parameters", {{"type", "object"}}}},
                                     {{"type", "function"}, {"name", "g"}}})},
              {"metadata", {{"k", "v"}}}};
  auto r = s.post("/v1/responses", req.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const json resp = json::parse(r.body);
  EXPECT_EQ(resp["object"], "response");
  EXPECT_EQ(resp["id"].get<std::string>().rfind("resp_", 0), 0u);
  EXPECT_EQ(resp["status"], "completed");
  EXPECT_EQ(resp["model"], "fake");
  EXPECT_EQ(resp["instructions"], "be brief");
  EXPECT_EQ(resp["metadata"], json({{"k", "v"}}));
  const json& out = resp["output"];
  ASSERT_EQ(out.size(), 3u) << out.dump();
  EXPECT_EQ(out[0]["type"], "message");
  EXPECT_EQ(out[0]["role"], "assistant");
  EXPECT_EQ(out[0]["content"][0]["type"], "output_text");
  EXPECT_EQ(out[0]["content"][0]["text"],
            "<bos>[tools:f,g,][system]be brief[user]q[assistant][calls:f({})|c1,g([])|c2,][tool]r1(c1)[user]hi");
  EXPECT_EQ(out[1]["type"], "function_call");
  EXPECT_EQ(out[1]["name"], "f");
  EXPECT_EQ(out[1]["arguments"], "{\"a\": 1}");
  EXPECT_EQ(out[1]["call_id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(out[2]["name"], "g");
  const int64_t in_tokens = resp["usage"]["input_tokens"], out_tokens = resp["usage"]["output_tokens"];
  EXPECT_GT(in_tokens, 0);
  EXPECT_GT(out_tokens, 0);
  EXPECT_EQ(resp["usage"]["total_tokens"], in_tokens + out_tokens);

  // Streamed: typed events (an `event:` line naming each), numbered from 0; the same output.
  req["stream"] = true;
  r = s.post("/v1/responses", req.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.body.find("event: response.created\ndata: {\"type\":\"response.created\""), std::string::npos);
  std::vector<std::string> types;
  std::string text;
  json done;
  int64_t seq = 0;
  for (const auto& e : sse_payloads(r.body)) {
    const json ev = json::parse(e);
    EXPECT_EQ(ev["sequence_number"], seq++);
    types.push_back(ev["type"]);
    if (ev["type"] == "response.output_text.delta") text += ev["delta"].get<std::string>();
    if (ev["type"] == "response.completed") done = ev["response"];
  }
  ASSERT_GE(types.size(), 4u);
  EXPECT_EQ(types[0], "response.created");
  EXPECT_EQ(types[1], "response.in_progress");
  EXPECT_EQ(types.back(), "response.completed");
  EXPECT_EQ(text, out[0]["content"][0]["text"]);
  ASSERT_EQ(done["output"].size(), 3u) << done.dump();
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(done["output"][i]["type"], out[i]["type"]);
    if (out[i]["type"] == "function_call") {
      EXPECT_EQ(done["output"][i]["arguments"], out[i]["arguments"]);
    }
  }
  EXPECT_EQ(done["usage"], resp["usage"]);
  EXPECT_EQ(std::count(types.begin(), types.end(), "response.output_item.added"), 3);
  EXPECT_EQ(std::count(types.begin(), types.end(), "response.output_item.done"), 3);

  // Cut short: incomplete, with the reason.
  r = s.post("/v1/responses", R"({"input": "a long prompt here", "max_output_tokens": 3})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["status"], "incomplete");
  EXPECT_EQ(json::parse(r.body)["incomplete_details"]["reason"], "max_output_tokens");
  EXPECT_EQ(json::parse(r.body)["usage"]["output_tokens"], 3);

  // /abort_request takes the response's id: the stream ends with the response cancelled.
  {
    HttpConnection c(s.port());
    c.send_request("POST", "/v1/responses", R"({"input": "abc", "max_output_tokens": 4000, "ignore_eos": true,
        "stream": true})");
    auto head = c.read_events(1);
    const std::string id = json::parse(sse_payloads(head.body).at(0))["response"]["id"];
    for (int i = 0; i < 500 && s.engine.num_live() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_EQ(json::parse(s.post("/abort_request", json({{"rid", id}}).dump()).body)["aborted"], 1);
    const std::string rest = c.read_rest();
    const json last = json::parse(sse_payloads(rest).back());
    EXPECT_EQ(last["type"], "response.incomplete") << rest.substr(rest.size() > 600 ? rest.size() - 600 : 0);
    EXPECT_EQ(last["response"]["status"], "cancelled");
    EXPECT_EQ(last["response"]["id"], id);
  }

  for (const auto& [bad, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"input": 5})", "input"},
           {R"({})", "input"},
           {R"({"input": [{"type": "input_image", "image_url": "x"}]})", "input[0].type"},
           {R"({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})", "input[0].content[0].type"},
           {R"({"input": "x", "conversation": "conv_1"})", "conversation"},
           {R"({"input": "x", "previous_response_id": 7})", "previous_response_id"},
           {R"({"input": "x", "store": "yes"})", "store"},
           {R"({"input": "x", "background": true, "store": false})", "background"},
           {R"({"input": "x", "tools": [{"type": "web_search"}]})", "tools[0].type"},
           {R"({"input": "x", "stream": "yes"})", "stream"},
           {R"({"input": [{"type": "function_call", "name": "f"}]})", "input[0].call_id"},
           {R"({"input": "x", "text": {"format": {"type": "xml"}}})", "text.format.type"}}) {
    r = s.post("/v1/responses", bad);
    EXPECT_EQ(r.status, 400) << bad << " -> " << r.body;
    EXPECT_EQ(json::parse(r.body)["error"]["param"], param) << bad << " -> " << r.body;
  }
}

// Stored responses: GET / DELETE /v1/responses/{id}, input_items, previous_response_id continuing the stored
// conversation (the fake engine echoes the rendered prompt, so the continuation's output shows the conversation it
// was given: equal to chat with the same messages), store false, streamed responses stored whole.
TEST(HttpApi, StoredResponses) {
  TestServer s;
  auto post = [&](const json& body) {
    auto r = s.post("/v1/responses", body.dump());
    EXPECT_EQ(r.status, 200) << body.dump() << " -> " << r.body;
    return json::parse(r.body);
  };
  auto text_of = [](const json& resp) { return resp["output"][0]["content"][0]["text"].get<std::string>(); };
  const json first = post({{"input", "hello"}, {"instructions", "old rules"}, {"max_output_tokens", 200}});
  const std::string id = first["id"];
  EXPECT_EQ(first["store"], true);
  EXPECT_EQ(first["background"], false);
  auto got = s.get("/v1/responses/" + id);
  ASSERT_EQ(got.status, 200) << got.body;
  EXPECT_EQ(json::parse(got.body), first);

  // The continuation: the earlier input and output, then its own input; the earlier instructions are not carried.
  const json second = post({{"input", json::array({{{"role", "user"}, {"content", "next"}},
                                                   {{"type", "message"}, {"role", "user"},
                                                    {"content", json::array({{{"type", "input_text"},
                                                                              {"text", "and more"}}})}}})},
                            {"instructions", "be brief"},
                            {"previous_response_id", id},
                            {"max_output_tokens", 400}});
  EXPECT_EQ(second["previous_response_id"], id);
  const json chat = {{"messages", json::array({{{"role", "system"}, {"content", "be brief"}},
                                               {{"role", "user"}, {"content", "hello"}},
                                               {{"role", "assistant"}, {"content", text_of(first)}},
                                               {{"role", "user"}, {"content", "next"}},
                                               {{"role", "user"}, {"content", "and more"}}})},
                     {"max_tokens", 400}};
  auto c = s.post("/v1/chat/completions", chat.dump());
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(text_of(second), json::parse(c.body)["choices"][0]["message"]["content"]);
  EXPECT_EQ(text_of(second).rfind("<bos>[system]be brief[user]hello[assistant]<bos>[system]old rules", 0), 0u)
      << text_of(second);
  // A third turn continues the whole chain.
  const json third = post({{"input", "last"}, {"previous_response_id", second["id"]}, {"max_output_tokens", 900}});
  EXPECT_NE(text_of(third).find("[user]hello[assistant]"), std::string::npos);
  EXPECT_NE(text_of(third).find("[user]next[user]and more[assistant]"), std::string::npos) << text_of(third);
  EXPECT_NE(text_of(third).find("[user]last"), std::string::npos);

  // input_items: the request's own items (newest first by default), with ids.
  const std::string second_id = second["id"];
  auto items = json::parse(s.get("/v1/responses/" + second_id + "/input_items").body);
  EXPECT_EQ(items["object"], "list");
  ASSERT_EQ(items["data"].size(), 2u) << items.dump();
  EXPECT_EQ(items["data"][0]["content"][0], json({{"type", "input_text"}, {"text", "and more"}}));
  EXPECT_EQ(items["data"][1]["content"][0], json({{"type", "input_text"}, {"text", "next"}}));
  EXPECT_EQ(items["data"][1]["type"], "message");
  EXPECT_EQ(items["has_more"], false);
  EXPECT_EQ(items["first_id"], items["data"][0]["id"]);
  EXPECT_NE(items["data"][0]["id"], items["data"][1]["id"]);
  auto page = json::parse(s.get("/v1/responses/" + second_id + "/input_items?order=asc&limit=1").body);
  ASSERT_EQ(page["data"].size(), 1u);
  EXPECT_EQ(page["data"][0]["content"][0]["text"], "next");
  EXPECT_EQ(page["has_more"], true);
  page = json::parse(s.get("/v1/responses/" + second_id + "/input_items?order=asc&after=" +
                           page["last_id"].get<std::string>()).body);
  ASSERT_EQ(page["data"].size(), 1u);
  EXPECT_EQ(page["data"][0]["content"][0]["text"], "and more");
  EXPECT_EQ(page["has_more"], false);
  EXPECT_EQ(s.get("/v1/responses/" + second_id + "/input_items?limit=0").status, 400);
  EXPECT_EQ(s.get("/v1/responses/" + second_id + "/input_items?order=up").status, 400);
  EXPECT_EQ(s.get("/v1/responses/" + second_id + "/input_items?after=nope").status, 400);
  items = json::parse(s.get("/v1/responses/" + id + "/input_items").body);
  ASSERT_EQ(items["data"].size(), 1u);
  EXPECT_EQ(items["data"][0]["role"], "user");
  EXPECT_EQ(items["data"][0]["content"][0]["text"], "hello");

  // store false: answered, not kept.
  const json unstored = post({{"input", "x"}, {"store", false}, {"max_output_tokens", 2}});
  EXPECT_EQ(unstored["store"], false);
  EXPECT_EQ(s.get("/v1/responses/" + unstored["id"].get<std::string>()).status, 404);
  auto r = s.post("/v1/responses", json({{"input", "y"}, {"previous_response_id", unstored["id"]}}).dump());
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "previous_response_id");

  // Streamed: stored as the last event's response.
  r = s.post("/v1/responses", json({{"input", "streamed"}, {"stream", true}, {"max_output_tokens", 5}}).dump());
  ASSERT_EQ(r.status, 200);
  const json last = json::parse(sse_payloads(r.body).back());
  ASSERT_EQ(last["type"], "response.incomplete") << last.dump();
  got = s.get("/v1/responses/" + last["response"]["id"].get<std::string>());
  ASSERT_EQ(got.status, 200);
  EXPECT_EQ(json::parse(got.body), last["response"]);

  // DELETE: gone, then unknown.
  auto del = http_request(s.port(), "DELETE", "/v1/responses/" + id);
  ASSERT_EQ(del.status, 200) << del.body;
  EXPECT_EQ(json::parse(del.body), json({{"id", id}, {"object", "response"}, {"deleted", true}}));
  EXPECT_EQ(s.get("/v1/responses/" + id).status, 404);
  EXPECT_EQ(http_request(s.port(), "DELETE", "/v1/responses/" + id).status, 404);
  EXPECT_EQ(s.get("/v1/responses/" + id + "/input_items").status, 404);
  // Its continuation keeps what it was given.
  EXPECT_EQ(s.get("/v1/responses/" + second_id).status, 200);
  EXPECT_EQ(post({{"input", "z"}, {"previous_response_id", second_id}, {"max_output_tokens", 1}})["status"],
            "incomplete");
  // OpenAI's input token count: what the request's prompt takes (instructions, the stored conversation, its input).
  auto count = [&](const json& body) {
    auto r = s.post("/v1/responses/input_tokens", body.dump());
    EXPECT_EQ(r.status, 200) << r.body;
    const json j = json::parse(r.body);
    EXPECT_EQ(j["object"], "response.input_tokens");
    return j["input_tokens"].get<int64_t>();
  };
  const json counted = post({{"input", "count me"}, {"instructions", "be brief"}, {"max_output_tokens", 1}});
  EXPECT_EQ(count({{"input", "count me"}, {"instructions", "be brief"}}),
            counted["usage"]["input_tokens"].get<int64_t>());
  const int64_t alone = count({{"input", "more"}});
  const int64_t continued = count({{"input", "more"}, {"previous_response_id", second_id}});
  EXPECT_GT(continued, alone + 20);
  EXPECT_GT(count({{"instructions", "only these"}}), 0);
  EXPECT_EQ(s.get("/v1/responses/input_tokens").status, 405);
  EXPECT_EQ(s.post("/v1/responses/input_tokens", json({{"input", 5}}).dump()).status, 400);
  // Not a background response: no cancel; other methods and routes refused.
  r = s.post("/v1/responses/" + second_id + "/cancel", "");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(s.post("/v1/responses/" + second_id, "{}").status, 405);
  EXPECT_EQ(s.get("/v1/responses/" + second_id + "/other").status, 404);
  EXPECT_EQ(s.get("/v1/responses/" + second_id + "?stream=true").status, 400);
}

// The store keeps the newest responses within its bytes: the oldest finished ones go first, a running background
// response stays until it ends.
TEST(ResponseStoreTest, ForgetsTheOldestPastItsBytes) {
  using ojson = nlohmann::ordered_json;
  auto response = [](const std::string& id, const char* status) {
    return ojson{{"id", id}, {"status", status}, {"output", ojson::array()}, {"pad", std::string(1000, 'x')}};
  };
  auto context = std::make_shared<const ojson>(ojson::array());
  ResponseStore store(3500);  // three responses of ~1,040 bytes
  for (const char* id : {"a", "b", "c"}) store.put(id, response(id, "completed"), ojson::array(), context);
  EXPECT_EQ(store.size(), 3u);
  store.put("d", response("d", "completed"), ojson::array(), context);
  EXPECT_EQ(store.size(), 3u);
  EXPECT_EQ(store.get("a"), nullptr);
  ASSERT_NE(store.get("b"), nullptr);
  EXPECT_EQ(store.get("d")->response["id"], "d");
  // A running background response is not forgotten; once it ends it is the oldest.
  auto ex = store.begin_background("bg", response("bg", "queued"), ojson::array(), context,
                                   [](std::shared_ptr<HttpExchange> inner) { return inner; });
  for (const char* id : {"e", "f", "g"}) store.put(id, response(id, "completed"), ojson::array(), context);
  ASSERT_NE(store.get("bg"), nullptr);
  EXPECT_EQ(store.get("b"), nullptr);
  EXPECT_EQ(store.get("e"), nullptr);
  store.started("bg");
  EXPECT_EQ(store.get("bg")->response["status"], "in_progress");
  store.complete("bg", response("bg", "completed"));
  std::promise<void> answered;
  ex->executor()([&] {
    ex->respond(200, "application/json", "{}");
    answered.set_value();
  });
  answered.get_future().wait();
  EXPECT_EQ(store.get("bg")->response["status"], "completed");
  store.put("h", response("h", "completed"), ojson::array(), context);
  EXPECT_EQ(store.get("bg"), nullptr);
  EXPECT_TRUE(store.erase("h"));
  EXPECT_FALSE(store.erase("h"));
}

// Background responses: created at once (queued or in progress), polled until they end, cancellable; a request
// the server refuses is answered with its error and not kept.
TEST(HttpApi, BackgroundResponses) {
  TestServer s;
  auto poll = [&](const std::string& id) {
    json r;
    for (int i = 0; i < 2000; ++i) {
      r = json::parse(s.get("/v1/responses/" + id).body);
      if (r["status"] != "queued" && r["status"] != "in_progress") break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return r;
  };
  auto r = s.post("/v1/responses", R"({"input": "short", "background": true, "max_output_tokens": 4})");
  ASSERT_EQ(r.status, 200) << r.body;
  json created = json::parse(r.body);
  EXPECT_EQ(created["background"], true);
  EXPECT_TRUE(created["status"] == "queued" || created["status"] == "in_progress" ||
              created["status"] == "incomplete")
      << created.dump();
  json done = poll(created["id"]);
  EXPECT_EQ(done["status"], "incomplete") << done.dump();
  EXPECT_EQ(done["usage"]["output_tokens"], 4);
  EXPECT_EQ(done["output"][0]["content"][0]["text"].get<std::string>().size(), 4u);
  // Cancelling an ended background response answers it as it is.
  r = s.post("/v1/responses/" + created["id"].get<std::string>() + "/cancel", "");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["status"], "incomplete");

  // A long one: in progress until cancelled; a continuation must wait for it.
  r = s.post("/v1/responses", R"({"input": "abc", "background": true, "max_output_tokens": 4000,
      "ignore_eos": true})");
  ASSERT_EQ(r.status, 200) << r.body;
  const std::string id = json::parse(r.body)["id"];
  for (int i = 0; i < 500 && s.engine.num_live() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(json::parse(s.get("/v1/responses/" + id).body)["status"], "in_progress");
  r = s.post("/v1/responses", json({{"input", "then"}, {"previous_response_id", id}}).dump());
  EXPECT_EQ(r.status, 400) << r.body;
  r = s.post("/v1/responses/" + id + "/cancel", "");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["status"], "cancelled");
  EXPECT_TRUE(s.wait_idle());
  EXPECT_EQ(json::parse(s.get("/v1/responses/" + id).body)["status"], "cancelled");
  // /abort_request takes a background response's id too; deleting a running one cancels it.
  for (const bool abort : {true, false}) {
    r = s.post("/v1/responses", R"({"input": "abc", "background": true, "max_output_tokens": 4000,
        "ignore_eos": true})");
    const std::string id2 = json::parse(r.body)["id"];
    for (int i = 0; i < 500 && s.engine.num_live() < 1; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (abort) {
      EXPECT_EQ(json::parse(s.post("/abort_request", json({{"rid", id2}}).dump()).body)["aborted"], 1);
      EXPECT_EQ(poll(id2)["status"], "cancelled");
    } else {
      EXPECT_EQ(http_request(s.port(), "DELETE", "/v1/responses/" + id2).status, 200);
      EXPECT_EQ(s.get("/v1/responses/" + id2).status, 404);
    }
    EXPECT_TRUE(s.wait_idle());
  }

  // Refused requests: the error at once, nothing kept.
  r = s.post("/v1/responses", R"({"input": "x", "background": true, "model": "nope"})");
  EXPECT_EQ(r.status, 404) << r.body;
  r = s.post("/v1/responses", R"({"input": "x", "background": true, "max_output_tokens": 100000})");
  EXPECT_EQ(r.status, 400) << r.body;
}

// Background responses created with `stream`: the creator gets the events as a foreground stream would, going away
// does not stop the generation, GET ?stream=true (after `starting_after`) replays the events so far and follows the
// rest, or replays them all once it ended; cancelling or deleting ends the streams.
TEST(HttpApi, BackgroundStreamedResponses) {
  TestServer s;
  auto seqs = [](const std::vector<std::string>& events) {
    std::vector<int64_t> out;
    for (const auto& e : events) out.push_back(json::parse(e)["sequence_number"].get<int64_t>());
    return out;
  };
  auto range = [](int64_t from, int64_t to) {
    std::vector<int64_t> v;
    for (int64_t i = from; i < to; ++i) v.push_back(i);
    return v;
  };
  // A short one, streamed whole to its creator, then replayed: all of it, and after an event.
  auto r = s.post("/v1/responses", R"({"input": "short", "background": true, "stream": true, "max_output_tokens": 4})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers["content-type"], "text/event-stream");
  const std::vector<std::string> events = sse_payloads(r.body);
  ASSERT_GE(events.size(), 4u) << r.body;
  EXPECT_EQ(seqs(events), range(0, static_cast<int64_t>(events.size())));
  // Created queued (response.created, response.queued), then in progress, as OpenAI's background responses.
  ASSERT_GE(events.size(), 3u);
  for (size_t k = 0; k < 3; ++k) {
    const json e = json::parse(events[k]);
    EXPECT_EQ(e["type"], std::vector<std::string>({"response.created", "response.queued", "response.in_progress"})[k]);
    EXPECT_EQ(e["response"]["status"], k < 2 ? "queued" : "in_progress") << events[k];
  }
  const json last = json::parse(events.back());
  EXPECT_EQ(last["type"], "response.incomplete") << events.back();
  EXPECT_EQ(last["response"]["background"], true);
  const std::string id = last["response"]["id"];
  EXPECT_NE(r.body.find("event: response.created\ndata: "), std::string::npos) << r.body;
  const json stored = json::parse(s.get("/v1/responses/" + id).body);
  EXPECT_EQ(stored["status"], "incomplete");
  EXPECT_EQ(stored["output"], last["response"]["output"]);
  EXPECT_EQ(s.get("/v1/responses/" + id + "?stream=true").body, r.body);
  EXPECT_EQ(sse_payloads(s.get("/v1/responses/" + id + "?stream=true&starting_after=2").body),
            std::vector<std::string>(events.begin() + 3, events.end()));
  EXPECT_TRUE(sse_payloads(s.get("/v1/responses/" + id + "?stream=true&starting_after=999").body).empty());

  // A long one: its creator goes away after 3 events, the generation goes on; a GET follows from event 3 until
  // the response is cancelled, and a GET afterwards replays the whole stream to its end.
  std::string long_id;
  {
    HttpConnection c(s.port());
    c.send_request("POST", "/v1/responses", R"({"input": "abc", "background": true, "stream": true,
        "max_output_tokens": 4000, "ignore_eos": true})");
    auto head = c.read_events(3);
    ASSERT_EQ(head.status, 200) << head.body;
    long_id = json::parse(sse_payloads(head.body).at(0))["response"]["id"];
    c.reset();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(s.engine.num_live(), 1) << "the creator going away stopped the generation";
  EXPECT_EQ(json::parse(s.get("/v1/responses/" + long_id).body)["status"], "in_progress");
  {
    HttpConnection c(s.port());
    c.send_request("GET", "/v1/responses/" + long_id + "?stream=true&starting_after=2");
    auto head = c.read_events(5);
    ASSERT_EQ(head.status, 200) << head.body;
    const std::vector<std::string> got = sse_payloads(head.body);
    ASSERT_FALSE(got.empty());
    EXPECT_EQ(seqs(got).front(), 3);
    r = s.post("/v1/responses/" + long_id + "/cancel", "");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["status"], "cancelled");
    std::vector<std::string> all = got;
    for (const auto& e : sse_payloads(c.read_rest())) all.push_back(e);  // the stream ends
    EXPECT_EQ(seqs(all), range(3, 3 + static_cast<int64_t>(all.size())));
  }
  EXPECT_TRUE(s.wait_idle());
  const std::vector<std::string> replayed = sse_payloads(s.get("/v1/responses/" + long_id + "?stream=true").body);
  ASSERT_GT(replayed.size(), 5u);
  EXPECT_EQ(seqs(replayed), range(0, static_cast<int64_t>(replayed.size())));

  // Deleting a running one ends its stream.
  {
    HttpConnection c(s.port());
    c.send_request("POST", "/v1/responses", R"({"input": "abc", "background": true, "stream": true,
        "max_output_tokens": 4000, "ignore_eos": true})");
    auto head = c.read_events(2);
    const std::string id2 = json::parse(sse_payloads(head.body).at(0))["response"]["id"];
    EXPECT_EQ(http_request(s.port(), "DELETE", "/v1/responses/" + id2).status, 200);
    c.set_deadline(10);
    (void)c.read_rest();
    EXPECT_EQ(s.get("/v1/responses/" + id2).status, 404);
  }
  EXPECT_TRUE(s.wait_idle());

  // Only background responses created with `stream` stream; a bad cursor or id is refused.
  r = s.post("/v1/responses", R"({"input": "x", "background": true, "max_output_tokens": 2})");
  const std::string plain = json::parse(r.body)["id"];
  for (int i = 0; i < 500 && json::parse(s.get("/v1/responses/" + plain).body)["status"] != "incomplete"; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  r = s.get("/v1/responses/" + plain + "?stream=true");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("stream"), std::string::npos) << r.body;
  r = s.post("/v1/responses", R"({"input": "x", "max_output_tokens": 2})");
  EXPECT_EQ(s.get("/v1/responses/" + json::parse(r.body)["id"].get<std::string>() + "?stream=true").status, 400);
  for (const char* q : {"?stream=true&starting_after=x", "?stream=true&starting_after=-2",
                        "?stream=true&starting_after=1.5"}) {
    r = s.get("/v1/responses/" + id + q);
    EXPECT_EQ(r.status, 400) << q;
    EXPECT_NE(r.body.find("starting_after"), std::string::npos) << r.body;
  }
  EXPECT_EQ(s.get("/v1/responses/resp_nope?stream=true").status, 404);
  // A refused request gets its error, nothing kept.
  r = s.post("/v1/responses", R"({"input": "x", "background": true, "stream": true, "max_output_tokens": 100000})");
  EXPECT_EQ(r.status, 400) << r.body;
}

// vLLM's add_special_tokens (the BOS on text prompts: completions by default, chat not, its template writes it) and
// truncate_prompt_tokens (the prompt's last tokens; the fake engine repeats the prompt it was given).
TEST(HttpApi, AddSpecialTokensAndTruncatePromptTokens) {
  TestServer s;
  auto prompt_tokens = [&](const std::string& path, const std::string& body) {
    auto r = s.post(path, body);
    EXPECT_EQ(r.status, 200) << body << " -> " << r.body;
    return json::parse(r.body)["usage"]["prompt_tokens"].get<int>();
  };
  EXPECT_EQ(prompt_tokens("/v1/completions", R"({"prompt": "abcdef", "max_tokens": 1})"), 7);
  EXPECT_EQ(prompt_tokens("/v1/completions", R"({"prompt": "abcdef", "max_tokens": 1, "add_special_tokens": false})"),
            6);
  const std::string chat = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1)";
  const int templated = prompt_tokens("/v1/chat/completions", chat + "}");
  EXPECT_EQ(prompt_tokens("/v1/chat/completions", chat + R"(, "add_special_tokens": true})"), templated + 1);
  auto r = s.post("/v1/completions", R"({"prompt": "abcdef", "max_tokens": 3, "truncate_prompt_tokens": 3,
      "echo": true})");
  ASSERT_EQ(r.status, 200) << r.body;
  const json c = json::parse(r.body);
  EXPECT_EQ(c["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(c["choices"][0]["text"], "defdef");  // the echoed prompt is what the model got
  EXPECT_EQ(prompt_tokens("/v1/completions", R"({"prompt": "abcdef", "max_tokens": 1, "truncate_prompt_tokens": -1})"),
            7);
  EXPECT_EQ(s.post("/v1/completions", R"({"prompt": "a", "truncate_prompt_tokens": -2})").status, 400);
  EXPECT_EQ(s.post("/v1/completions", R"({"prompt": "a", "add_special_tokens": "yes"})").status, 400);
}

// SGLang's /abort_request ends a running request by its rid (its client gets the abort finish), or every request
// with abort_all; /health_generate runs a one-token generation.
TEST(HttpApi, AbortRequestAndHealthGenerate) {
  TestServer s;
  auto health = s.get("/health_generate");
  EXPECT_EQ(health.status, 200) << health.body;
  EXPECT_EQ(s.post("/health_generate", "{}").status, 405);
  test::HttpResponse long_one, other;
  std::thread t1([&] {
    long_one = s.post("/generate", R"({"rid": "long1", "text": "abc", "sampling_params": {"max_new_tokens": 4000,
        "ignore_eos": true}})");
  });
  std::thread t2([&] {
    other = s.post("/v1/completions", R"({"prompt": "abc", "max_tokens": 4000, "ignore_eos": true})");
  });
  for (int i = 0; i < 500 && s.engine.num_live() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(s.engine.num_live(), 2u);  // (4 s of tokens each: the threads end by the aborts below)
  auto a = s.post("/abort_request", R"({"rid": "long1"})");
  EXPECT_EQ(a.status, 200) << a.body;
  EXPECT_EQ(json::parse(a.body)["aborted"], 1);
  t1.join();
  ASSERT_EQ(long_one.status, 200) << long_one.body;
  EXPECT_EQ(json::parse(long_one.body)["meta_info"]["finish_reason"]["type"], "abort");
  EXPECT_EQ(s.engine.num_live(), 1u);  // the other one runs on
  EXPECT_EQ(json::parse(s.post("/abort_request", R"({"rid": "nobody"})").body)["aborted"], 0);
  EXPECT_EQ(json::parse(s.post("/abort_request", R"({"abort_all": true})").body)["aborted"], 1);
  t2.join();
  ASSERT_EQ(other.status, 200) << other.body;
  EXPECT_EQ(json::parse(other.body)["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(s.post("/abort_request", R"({})").status, 400);
  EXPECT_TRUE(s.wait_idle());
}

// continue_final_message (with add_generation_prompt false) leaves the final assistant message open; vLLM's
// stream_options.continuous_usage_stats puts the usage so far in every chunk.
TEST(HttpApi, ContinueFinalMessageAndContinuousUsage) {
  TestServer s;
  const std::string msgs = R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Once"}],
      "max_tokens": 2)";
  auto r = json::parse(s.post("/v1/chat/completions",
                              msgs + R"(, "add_generation_prompt": false, "continue_final_message": true})").body);
  EXPECT_EQ(r["usage"]["prompt_tokens"], std::string("<bos>[user]q[assistant]Once").size());
  r = json::parse(s.post("/v1/chat/completions", msgs + "}").body);
  EXPECT_EQ(r["usage"]["prompt_tokens"], std::string("<bos>[user]q[assistant]Once[assistant]").size());
  EXPECT_EQ(s.post("/v1/chat/completions", msgs + R"(, "continue_final_message": true})").status, 400);
  EXPECT_EQ(s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "q"}],
      "add_generation_prompt": false, "continue_final_message": true})").status, 400);

  auto events = sse_payloads(s.post("/v1/completions", R"({"prompt": "abc", "max_tokens": 3, "stream": true,
      "stream_options": {"include_usage": true, "continuous_usage_stats": true}})").body);
  int64_t last = -1;
  int chunks = 0;
  for (const auto& e : events) {
    if (e == "[DONE]") continue;
    const auto j = json::parse(e);
    ASSERT_TRUE(j["usage"].is_object()) << e;
    EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
    EXPECT_GE(j["usage"]["completion_tokens"].get<int64_t>(), last);
    last = j["usage"]["completion_tokens"];
    ++chunks;
  }
  EXPECT_EQ(last, 3);
  EXPECT_GE(chunks, 4);
}

TEST(HttpApi, ChatNonStreamAndStream) {
  TestServer s;
  auto r = s.post("/v1/chat/completions",
                  R"({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "chat.completion");
  // The fake engine repeats the templated prompt "<bos>[user]hi[assistant]"; <bos> is text there, not a token.
  EXPECT_EQ(j["choices"][0]["message"], json::parse(R"({"role": "assistant", "content": "<bos>"})"));
  EXPECT_EQ(j["usage"]["prompt_tokens"], 24);

  r = s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
      "stream": true, "stream_options": {"include_usage": true}})");
  auto events = sse_payloads(r.body);
  ASSERT_EQ(events.size(), 1 + 3 + 1 + 1 + 1u);  // role, 3 contents, finish, usage, [DONE]
  auto first = json::parse(events[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], json::parse(R"({"role": "assistant", "content": ""})"));
  std::string content;
  for (size_t i = 1; i < 4; ++i) content += json::parse(events[i])["choices"][0]["delta"]["content"].get<std::string>();
  EXPECT_EQ(content, "<bo");
  auto fin = json::parse(events[4]);
  EXPECT_EQ(fin["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(fin["choices"][0]["delta"], json::object());
  EXPECT_EQ(json::parse(events[5])["usage"]["completion_tokens"], 3);
}

// Completions `suffix` with a tokenizer that has no FIM tokens: a 400 naming the parameter.
TEST(HttpApi, SuffixNeedsFimTokens) {
  TestServer s;
  auto r = s.post("/v1/completions", R"({"prompt": "ab", "suffix": "cd", "max_tokens": 2})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "suffix") << r.body;
  EXPECT_NE(r.body.find("FIM tokens"), std::string::npos) << r.body;
  EXPECT_EQ(s.post("/v1/completions", R"({"prompt": "ab", "suffix": "", "max_tokens": 2})").status, 200);
}

TEST(HttpApi, ClientErrors) {
  ServerOptions o;
  o.max_body_bytes = 4096;
  TestServer s(o, /*context_len=*/64);
  struct Case {
    std::string path, body;
    int status;
    std::string code;
  };
  const std::vector<Case> cases = {
      {"/generate", "{not json", 400, "invalid_json"},
      {"/generate", "[]", 400, "invalid_type"},
      {"/generate", R"({"text": 1})", 400, "invalid_type"},
      {"/generate", R"({"text": "a", "sampling_params": {"temperature": -2}})", 400, "invalid_value"},
      {"/generate", R"({"text": "a", "sampling_params": {"max_new_tokens": 1000000000}})", 400,
       "context_length_exceeded"},
      {"/generate", std::string(R"({"text": ")") + std::string(100, 'a') + "\"}", 400, "context_length_exceeded"},
      {"/v1/completions", R"({"model": "gpt-4", "prompt": "a"})", 404, "model_not_found"},
      {"/v1/completions", R"({"prompt": "a", "n": -1})", 400, "invalid_value"},
      {"/v1/completions", R"({"prompt": "a", "top_p": 7})", 400, "invalid_value"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"})", 400,
       "invalid_type"},
      {"/v1/chat/completions", R"({"model": "nope", "messages": [{"role": "user", "content": "x"}]})", 404,
       "model_not_found"},
      {"/generate", std::string(R"({"text": ")") + std::string(5000, 'a') + "\"}", 413, "413"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.body.substr(0, 120));
    auto r = s.post(c.path, c.body);
    EXPECT_EQ(r.status, c.status) << r.body;
    auto j = json::parse(r.body);
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_TRUE(j["error"].contains("type"));
    EXPECT_TRUE(j["error"].contains("param"));
    EXPECT_EQ(j["error"]["code"].is_string() ? j["error"]["code"].get<std::string>() : j["error"]["code"].dump(),
              c.code);
  }
  EXPECT_TRUE(s.wait_idle());
  EXPECT_TRUE(s.engine.submitted().empty());  // nothing reached the engine
}

// Request priorities: a 400 naming the flags when priority scheduling is off (0 and null pass); vLLM's policy hands
// them to the engine as they are (lower first), SGLang's flips their sign (higher first) on every API.
TEST(HttpApi, PriorityNeedsPrioritySchedulingAndKeepsItsMeaning) {
  {
    TestServer off;
    auto r = off.post("/v1/completions", R"({"prompt": "a", "max_tokens": 1, "priority": 3})");
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(json::parse(r.body)["error"]["param"], "priority");
    EXPECT_NE(r.body.find("--enable-priority-scheduling"), std::string::npos);
    EXPECT_EQ(off.post("/generate", R"({"text": "a", "sampling_params": {"max_new_tokens": 1}, "priority": 0})").status,
              200);
    EXPECT_EQ(off.post("/generate", R"({"text": "a", "priority": "high"})").status, 400);
    EXPECT_TRUE(off.wait_idle());
  }
  for (bool higher_first : {false, true}) {
    ServerOptions o;
    o.priority_scheduling = true;
    o.priority_higher_first = higher_first;
    TestServer s(o);
    EXPECT_EQ(s.post("/generate", R"({"text": "a", "sampling_params": {"max_new_tokens": 1}, "priority": 7})").status,
              200);
    EXPECT_EQ(s.post("/v1/completions", R"({"prompt": "a", "max_tokens": 1, "priority": -2})").status, 200);
    EXPECT_EQ(s.post("/v1/chat/completions",
                     R"({"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "priority": 4})")
                  .status,
              200);
    const int32_t sign = higher_first ? -1 : 1;
    EXPECT_EQ(s.engine.priorities(), (std::vector<int32_t>{7 * sign, -2 * sign, 4 * sign}));
    EXPECT_TRUE(s.wait_idle());
  }
}

// A multipart/form-data upload of `data` as `filename` with this purpose (as HTTP clients send files).
test::HttpResponse upload(int port, const std::string& filename, const std::string& purpose, const std::string& data,
                          const std::string& headers = "") {
  const std::string b = "XyZ-boundary";
  const std::string body = "--" + b + "\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n" + purpose +
                           "\r\n--" + b + "\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + filename +
                           "\"\r\nContent-Type: application/jsonl\r\n\r\n" + data + "\r\n--" + b + "--\r\n";
  HttpConnection c(port);
  c.send_raw("POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers +
             "Content-Type: multipart/form-data; boundary=\"" + b + "\"\r\nContent-Length: " +
             std::to_string(body.size()) + "\r\n\r\n" + body);
  return c.read_response();
}

// Polls a batch until it ends.
json wait_batch(TestServer& s, const std::string& id, const std::string& headers = "") {
  json b;
  for (int i = 0; i < 1000; ++i) {
    b = json::parse(http_request(s.port(), "GET", "/v1/batches/" + id, "", headers).body);
    if (b["status"] == "completed" || b["status"] == "failed" || b["status"] == "cancelled") return b;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ADD_FAILURE() << "batch did not end: " << b.dump();
  return b;
}

// OpenAI's Files and Batch APIs over the fake engine: an upload listed and read back; a batch of completions runs
// each line as the same request sent directly (answers in input order, a bad line into the error file with its
// 400); a file that breaks the rules fails the batch with the lines' errors; a cancelled batch aborts its running
// requests; deletion; 404s and 400s; internal requests pass the API key.
// A batch past its 24 h completion window expires (an injected clock): lines not started never start, running ones
// are cancelled, the answers it has go to the output file and each unanswered request gets a batch_expired line in
// the error file.
TEST(BatchServiceTest, ExpiresPastItsWindow) {
  using ojson = nlohmann::ordered_json;
  std::atomic<int64_t> now{1'000'000};
  std::atomic<int> started{0}, cancelled{0};
  std::mutex mu;
  std::vector<std::shared_ptr<HttpExchange>> held;
  BatchService svc(
      [&](const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
        ++started;
        if (req.body.find("first") != std::string::npos) {
          ex->respond(200, "application/json", R"({"id": "chatcmpl-1", "ok": true})");
          return;
        }
        ex->on_cancel([&](const std::string&) { ++cancelled; });  // the others never answer
        std::lock_guard lk(mu);
        held.push_back(ex);
      },
      [&] { return now.load(); });
  std::string lines;
  for (const char* tag : {"first", "second", "third"})
    lines += fmt::format(R"({{"custom_id": "{}", "method": "POST", "url": "/v1/chat/completions", "body": )"
                         R"({{"messages": [{{"role": "user", "content": "{}"}}]}}}})",
                         tag, tag) + "\n";
  const ojson file = svc.store_file("in.jsonl", "batch", lines);
  const ojson created = svc.create_batch(
      {{"input_file_id", file["id"]}, {"endpoint", "/v1/chat/completions"}, {"completion_window", "24h"}});
  const std::string id = created["id"];
  EXPECT_EQ(created["expires_at"], 1'000'000 + BatchService::kWindowSeconds);
  struct Capture : HttpExchange {
    std::string body;
    Executor executor() override {
      return [](std::function<void()> fn) { fn(); };
    }
    void respond(int, const std::string&, std::string b) override { body = std::move(b); }
    void start_stream() override {}
    void send_event(std::string) override {}
    void end_stream() override {}
    void on_cancel(std::function<void(const std::string&)>) override {}
  };
  auto get = [&] {
    auto ex = std::make_shared<Capture>();
    HttpRequest req;
    req.method = "GET";
    svc.batches(req, "/" + id, "", ex);
    return ojson::parse(ex->body);
  };
  for (int i = 0; i < 1000 && (started < 3 || get()["request_counts"]["completed"] != 1); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ojson b = get();
  EXPECT_EQ(b["status"], "in_progress");
  EXPECT_EQ(b["request_counts"]["completed"], 1);
  now += BatchService::kWindowSeconds - 1;
  EXPECT_EQ(get()["status"], "in_progress");  // not yet
  now += 1;
  get();  // looked at past its window
  b = svc.wait(id);
  EXPECT_EQ(b["status"], "expired");
  EXPECT_EQ(b["expired_at"], now.load());
  EXPECT_EQ(cancelled, 2);
  EXPECT_EQ(b["request_counts"], ojson({{"total", 3}, {"completed", 1}, {"failed", 2}}));
  const std::string out = *svc.file_content(b["output_file_id"]);
  EXPECT_NE(out.find("\"custom_id\":\"first\""), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  const std::string err = *svc.file_content(b["error_file_id"]);
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 2);
  EXPECT_NE(err.find("\"custom_id\":\"third\""), std::string::npos) << err;
  EXPECT_NE(err.find("batch_expired"), std::string::npos) << err;
}

TEST(HttpApi, FilesAndBatches) {
  ServerOptions o;
  o.api_key = "k";
  TestServer s(o);
  const std::string auth = "Authorization: Bearer k\r\n";
  auto line = [](const std::string& id, const std::string& body) {
    return R"({"custom_id": ")" + id + R"(", "method": "POST", "url": "/v1/completions", "body": )" + body + "}\n";
  };
  auto create = [&](const json& file) {  // a completions batch of an uploaded file
    return s.post("/v1/batches", R"({"input_file_id": ")" + file["id"].get<std::string>() +
                                     R"(", "endpoint": "/v1/completions", "completion_window": "24h"})",
                  auth);
  };
  const std::string input = line("one", R"({"prompt": "ab", "max_tokens": 3})") + "\n" +
                            line("bad", R"({"prompt": "x", "max_tokens": "many"})") +
                            line("two", R"({"prompt": "cde", "max_tokens": 4, "n": 2})");
  EXPECT_EQ(upload(s.port(), "in.jsonl", "batch", input).status, 401);
  auto up = upload(s.port(), "in.jsonl", "batch", input, auth);
  ASSERT_EQ(up.status, 200) << up.body;
  const json file = json::parse(up.body);
  EXPECT_EQ(file["object"], "file");
  EXPECT_EQ(file["bytes"], input.size());
  EXPECT_EQ(file["filename"], "in.jsonl");
  EXPECT_EQ(http_request(s.port(), "GET", "/v1/files/" + file["id"].get<std::string>() + "/content", "", auth).body,
            input);
  const json files = json::parse(http_request(s.port(), "GET", "/v1/files?purpose=batch", "", auth).body);
  ASSERT_EQ(files["data"].size(), 1u);
  EXPECT_EQ(files["data"][0]["id"], file["id"]);

  auto created = create(file);
  ASSERT_EQ(created.status, 200) << created.body;
  const json b = wait_batch(s, json::parse(created.body)["id"], auth);
  EXPECT_EQ(b["status"], "completed") << b.dump();
  EXPECT_EQ(b["request_counts"], json::parse(R"({"total": 3, "completed": 2, "failed": 1})"));
  const std::string out =
      http_request(s.port(), "GET", "/v1/files/" + b["output_file_id"].get<std::string>() + "/content", "", auth).body;
  std::vector<json> outs;
  for (size_t at = 0, nl; (nl = out.find('\n', at)) != std::string::npos; at = nl + 1)
    outs.push_back(json::parse(out.substr(at, nl - at)));
  ASSERT_EQ(outs.size(), 2u) << out;
  EXPECT_EQ(outs[0]["custom_id"], "one");
  EXPECT_EQ(outs[1]["custom_id"], "two");
  const json direct = json::parse(s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 3})", auth).body);
  EXPECT_EQ(outs[0]["response"]["status_code"], 200);
  EXPECT_EQ(outs[0]["response"]["body"]["choices"], direct["choices"]);
  EXPECT_EQ(outs[0]["response"]["request_id"], outs[0]["response"]["body"]["id"]);
  EXPECT_EQ(outs[1]["response"]["body"]["choices"].size(), 2u);
  const json err = json::parse(
      http_request(s.port(), "GET", "/v1/files/" + b["error_file_id"].get<std::string>() + "/content", "", auth).body);
  EXPECT_EQ(err["custom_id"], "bad");
  EXPECT_EQ(err["response"]["status_code"], 400);
  EXPECT_EQ(err["response"]["body"]["error"]["param"], "max_tokens");

  // Validation: a duplicate custom_id and a wrong url fail the batch before anything runs.
  auto bad_file = json::parse(upload(s.port(), "bad.jsonl", "batch",
                                     line("x", R"({"prompt": "a"})") + line("x", R"({"prompt": "b"})") +
                                         R"({"custom_id": "y", "method": "POST", "url": "/generate", "body": {}})",
                                     auth)
                                  .body);
  const json failed = json::parse(create(bad_file).body);
  EXPECT_EQ(failed["status"], "failed");
  ASSERT_EQ(failed["errors"]["data"].size(), 2u) << failed.dump();
  EXPECT_EQ(failed["errors"]["data"][0]["line"], 2);
  EXPECT_EQ(failed["errors"]["data"][0]["code"], "duplicate_custom_id");
  EXPECT_EQ(failed["errors"]["data"][1]["code"], "mismatched_url");
  // A Responses line asking for a background response (its answer would not be the response).
  auto bg_file = json::parse(upload(s.port(), "bg.jsonl", "batch",
                                    R"({"custom_id": "r", "method": "POST", "url": "/v1/responses", "body":)"
                                    R"( {"input": "a", "background": true}})",
                                    auth)
                                 .body);
  auto bg_create = s.post("/v1/batches",
                          json({{"input_file_id", bg_file["id"]}, {"endpoint", "/v1/responses"},
                                {"completion_window", "24h"}}).dump(),
                          auth);
  ASSERT_EQ(bg_create.status, 200) << bg_create.body;
  const json bg_failed = json::parse(bg_create.body);
  EXPECT_EQ(bg_failed["status"], "failed");
  ASSERT_EQ(bg_failed["errors"]["data"].size(), 1u) << bg_failed.dump();
  EXPECT_NE(bg_failed["errors"]["data"][0]["message"].get<std::string>().find("background"), std::string::npos);

  // Hostile input: a line nested 100,000 levels deep is answered with the endpoint's 400 for a body that deep (no
  // recursion through it), a non-boolean `stream` by the endpoint itself; a create request with deep metadata is a
  // 400.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  auto deep_file = json::parse(upload(s.port(), "deep.jsonl", "batch",
                                      line("d", R"({"prompt": "a", "x": )" + deep + "}") +
                                          line("t", R"({"prompt": "a", "max_tokens": 1, "stream": "yes"})"),
                                      auth)
                                   .body);
  const json deep_batch = json::parse(create(deep_file).body);
  const json deep_done = wait_batch(s, deep_batch["id"], auth);
  EXPECT_EQ(deep_done["status"], "completed") << deep_done.dump();
  EXPECT_EQ(deep_done["request_counts"], json::parse(R"({"total": 2, "completed": 0, "failed": 2})"));
  const std::string deep_errs = http_request(s.port(), "GET", "/v1/files/" +
                                                                  deep_done["error_file_id"].get<std::string>() +
                                                                  "/content", "", auth).body;
  EXPECT_NE(deep_errs.find("nests more than"), std::string::npos) << deep_errs;
  EXPECT_NE(deep_errs.find("'stream' must be a boolean"), std::string::npos) << deep_errs;
  auto only_deep = json::parse(upload(s.port(), "d.jsonl", "batch", line("d", "{\"x\": " + deep + "}"), auth).body);
  const json none_ran = json::parse(create(only_deep).body);
  EXPECT_EQ(wait_batch(s, none_ran["id"], auth)["request_counts"]["failed"], 1);  // ends with nothing run
  EXPECT_EQ(s.post("/v1/batches", R"({"input_file_id": "x", "endpoint": "/v1/completions", "completion_window":
                                      "24h", "metadata": {"k": )" + deep + "}}",
                   auth)
                .status,
            400);

  // Cancel: long requests are aborted, the batch ends cancelled with nothing held.
  s.engine.step_delay_ms = 20;
  auto slow = json::parse(upload(s.port(), "slow.jsonl", "batch",
                                 line("s1", R"({"prompt": "ab", "max_tokens": 1000})") +
                                     line("s2", R"({"prompt": "cd", "max_tokens": 1000})"),
                                 auth)
                              .body);
  const json running = json::parse(create(slow).body);
  for (int i = 0; i < 500 && s.engine.num_live() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const json cancelling =
      json::parse(s.post("/v1/batches/" + running["id"].get<std::string>() + "/cancel", "", auth).body);
  EXPECT_TRUE(cancelling["status"] == "cancelling" || cancelling["status"] == "cancelled") << cancelling.dump();
  EXPECT_EQ(wait_batch(s, running["id"], auth)["status"], "cancelled");
  EXPECT_EQ(s.engine.aborted().size(), 2u);
  EXPECT_EQ(s.post("/v1/batches/" + running["id"].get<std::string>() + "/cancel", "", auth).status, 200);
  s.engine.step_delay_ms = 1;
  EXPECT_TRUE(s.wait_idle());

  const json listed = json::parse(http_request(s.port(), "GET", "/v1/batches?limit=2", "", auth).body);
  ASSERT_EQ(listed["data"].size(), 2u);
  EXPECT_EQ(listed["data"][0]["id"], running["id"]);  // newest first
  EXPECT_TRUE(listed["has_more"].get<bool>());

  // Errors: unknown ids, a body that is no upload, a wrong endpoint or window; deletion.
  EXPECT_EQ(http_request(s.port(), "GET", "/v1/files/file-nope", "", auth).status, 404);
  EXPECT_EQ(http_request(s.port(), "GET", "/v1/batches/batch_nope", "", auth).status, 404);
  EXPECT_EQ(s.post("/v1/files", R"({"file": "x"})", auth).status, 400);
  EXPECT_EQ(s.post("/v1/batches", R"({"input_file_id": "file-nope", "endpoint": "/v1/completions",
                                      "completion_window": "24h"})",
                   auth)
                .status,
            404);
  const std::string fid = file["id"];
  EXPECT_EQ(s.post("/v1/batches", R"({"input_file_id": ")" + fid + R"(", "endpoint": "/generate",
                                      "completion_window": "24h"})",
                   auth)
                .status,
            400);
  EXPECT_EQ(s.post("/v1/batches", R"({"input_file_id": ")" + fid + R"(", "endpoint": "/v1/completions",
                                      "completion_window": "1h"})",
                   auth)
                .status,
            400);
  auto del = http_request(s.port(), "DELETE", "/v1/files/" + fid, "", auth);
  EXPECT_EQ(del.status, 200);
  EXPECT_EQ(json::parse(del.body)["deleted"], true);
  EXPECT_EQ(http_request(s.port(), "GET", "/v1/files/" + fid, "", auth).status, 404);
  EXPECT_EQ(http_request(s.port(), "PUT", "/v1/files/" + fid, "", auth).status, 405);
}

// multipart/form-data bodies as clients write them: a quoted or plain boundary, a preamble, CRLF inside a part's
// bytes, filenames; malformed bodies are 400s.
TEST(Multipart, PartsAndErrors) {
  const std::string body = "preamble\r\n--b1\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                           "--b1\r\ncontent-disposition: form-data; name=file; filename=\"a \\\"q\\\".jsonl\"\r\n"
                           "Content-Type: text/plain\r\n\r\nline 1\r\nline 2\r\n\r\n--b1--\r\nepilogue";
  auto parts = parse_multipart("multipart/form-data; boundary=b1", body);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].name, "purpose");
  EXPECT_EQ(parts[0].data, "batch");
  EXPECT_FALSE(parts[0].filename.has_value());
  EXPECT_EQ(parts[1].name, "file");
  EXPECT_EQ(parts[1].filename, "a \"q\".jsonl");
  EXPECT_EQ(parts[1].content_type, "text/plain");
  EXPECT_EQ(parts[1].data, "line 1\r\nline 2\r\n");
  EXPECT_EQ(parse_multipart("Multipart/Form-Data; charset=utf-8; boundary=\"b1\"", body).size(), 2u);
  for (const auto& [type, b] : std::vector<std::pair<std::string, std::string>>{
           {"application/json", body},
           {"multipart/form-data", body},
           {"multipart/form-data; boundary=zz", body},
           {"multipart/form-data; boundary=b1", "--b1\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nno end"},
           {"multipart/form-data; boundary=b1", "--b1\r\nContent-Type: x\r\n\r\ndata\r\n--b1--"},
       })
    EXPECT_THROW(parse_multipart(type, b), ApiError) << type << " " << b;
}

// n samples of a long prompt: the first sample goes to the engine alone, the others once it answered (its prompt is
// then in the prefix cache); short prompts go all at once. Every sample completes either way.
TEST(HttpApi, SamplesOfALongPromptFollowTheFirst) {
  TestServer s;
  const std::string long_prompt(80, 'q');
  auto r = s.post("/v1/completions", R"({"prompt": [")" + long_prompt + R"(", ")" + long_prompt +
                                         R"(x"], "max_tokens": 3, "n": 2})");
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = json::parse(r.body);
  ASSERT_EQ(j["choices"].size(), 4u);
  for (const auto& c : j["choices"]) EXPECT_EQ(c["text"], "qqq");
  const std::vector<std::string> order = s.engine.submitted();
  ASSERT_EQ(order.size(), 4u);
  const std::string id = j["id"];
  EXPECT_EQ(order[0], id + "-0");  // both prompts' first samples lead
  EXPECT_EQ(order[1], id + "-2");
  EXPECT_TRUE(s.wait_idle());
  auto shorter = s.post("/generate", R"({"text": "abc", "sampling_params": {"max_new_tokens": 2, "n": 3}})");
  ASSERT_EQ(shorter.status, 200);
  const std::vector<std::string> all = s.engine.submitted();
  ASSERT_EQ(all.size(), 7u);
  const std::string sid = json::parse(shorter.body)[0]["meta_info"]["id"];
  EXPECT_EQ(std::vector<std::string>(all.begin() + 4, all.end()),
            (std::vector<std::string>{sid.substr(0, sid.size() - 2) + "-0", sid.substr(0, sid.size() - 2) + "-1",
                                      sid.substr(0, sid.size() - 2) + "-2"}));
  EXPECT_TRUE(s.wait_idle());
}

TEST(HttpApi, ApiKey) {
  ServerOptions o;
  o.api_key = "sekret";
  TestServer s(o);
  EXPECT_EQ(s.post("/generate", R"({"text": "a"})").status, 401);
  EXPECT_EQ(s.post("/generate", R"({"text": "a"})", "Authorization: Bearer wrong\r\n").status, 401);
  EXPECT_EQ(s.post("/generate", R"({"text": "a", "sampling_params": {"max_new_tokens": 1}})",
                   "Authorization: Bearer sekret\r\n")
                .status,
            200);
  EXPECT_EQ(s.get("/health").status, 200);
  EXPECT_EQ(s.get("/ping").status, 200);  // liveness checks need no key
  EXPECT_EQ(s.get("/v1/models").status, 401);
}

TEST(HttpApi, ModelRetrieveHeadAndCors) {
  ServerOptions o;
  o.api_key = "sekret";
  TestServer s(o);
  const std::string auth = "Authorization: Bearer sekret\r\n";
  HttpConnection c(s.port());
  // OpenAI's models.retrieve; ids may hold '/' and %XX escapes.
  c.send_request("GET", "/v1/models/fake", "", auth);
  auto r = c.read_response();
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["id"], "fake");
  EXPECT_EQ(json::parse(r.body)["object"], "model");
  c.send_request("GET", "/v1/models/%66ake", "", auth);
  EXPECT_EQ(c.read_response().status, 200);
  c.send_request("GET", "/v1/models//models/fake", "", auth);  // the model path, as the id
  EXPECT_EQ(c.read_response().status, 200);
  c.send_request("GET", "/v1/models/org/other", "", auth);
  r = c.read_response();
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "model_not_found") << r.body;
  c.send_request("POST", "/v1/models/fake", "{}", auth);
  EXPECT_EQ(c.read_response().status, 405);

  // HEAD: GET's status and headers, no body; the connection stays usable.
  c.send_request("HEAD", "/v1/models", "", auth);
  r = c.read_response(/*head_request=*/true);
  EXPECT_EQ(r.status, 200);
  EXPECT_GT(std::stoul(r.headers["content-length"]), 10u);
  c.send_request("HEAD", "/health");
  EXPECT_EQ(c.read_response(true).status, 200);
  c.send_request("GET", "/health");
  r = c.read_response();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.count("access-control-allow-origin"), 0u);  // no Origin: not a browser's cross-origin call

  // CORS (every origin by default): a preflight needs no key; answers, errors and streams carry the header.
  c.send_raw("OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\n"
             "Access-Control-Request-Method: POST\r\n"
             "Access-Control-Request-Headers: authorization, content-type\r\n\r\n");
  r = c.read_response();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers["access-control-allow-origin"], "*");
  EXPECT_NE(r.headers["access-control-allow-methods"].find("POST"), std::string::npos);
  EXPECT_EQ(r.headers["access-control-allow-headers"], "authorization, content-type");
  const std::string origin = "Origin: https://app.example\r\n";
  c.send_request("GET", "/v1/models", "", origin);
  r = c.read_response();
  EXPECT_EQ(r.status, 401);
  EXPECT_EQ(r.headers["access-control-allow-origin"], "*");
  c.send_request("POST", "/generate", R"({"text": "k", "stream": true, "sampling_params": {"max_new_tokens": 2}})",
                 auth + origin);
  r = c.read_response();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers["access-control-allow-origin"], "*");
  EXPECT_EQ(sse_payloads(r.body).back(), "[DONE]");
  c.send_request("OPTIONS", "/v1/models", "", auth);  // not a preflight: OPTIONS is no method of the API
  EXPECT_EQ(c.read_response().status, 405);
}

TEST(HttpApi, CorsOnlyForTheAllowedOrigins) {
  ServerOptions o;
  o.allowed_origins = {"https://a.example"};
  TestServer s(o);
  HttpConnection c(s.port());
  c.send_request("GET", "/v1/models", "", "Origin: https://a.example\r\n");
  auto r = c.read_response();
  EXPECT_EQ(r.headers["access-control-allow-origin"], "https://a.example");
  EXPECT_EQ(r.headers["vary"], "Origin");
  c.send_request("GET", "/v1/models", "", "Origin: https://b.example\r\n");
  r = c.read_response();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.count("access-control-allow-origin"), 0u);
  c.send_raw("OPTIONS /generate HTTP/1.1\r\nHost: x\r\nOrigin: https://b.example\r\n"
             "Access-Control-Request-Method: POST\r\n\r\n");
  r = c.read_response();
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(json::parse(r.body)["error"]["message"].get<std::string>().find("https://b.example"), std::string::npos);
}

TEST(HttpApi, KeepAliveServesSeveralRequestsOnOneConnection) {
  TestServer s;
  HttpConnection c(s.port());
  for (int i = 0; i < 3; ++i) {
    c.send_request("POST", "/generate", R"({"text": "k", "stream": true, "sampling_params": {"max_new_tokens": 2}})");
    auto r = c.read_response();
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(sse_payloads(r.body).back(), "[DONE]");
    c.send_request("GET", "/health");
    EXPECT_EQ(c.read_response().status, 200);
  }
  // Pipelined: two requests in one write.
  c.send_raw("GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(c.read_response().status, 200);
  EXPECT_EQ(c.read_response().status, 200);
}

TEST(HttpApi, ExpectContinueAndLargeBody) {
  TestServer s;
  HttpConnection c(s.port());
  std::string body = R"({"text": ")" + std::string(3000, 'q') + R"(", "sampling_params": {"max_new_tokens": 1}})";
  c.send_raw("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
             "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n");
  auto cont = c.read_response();
  EXPECT_EQ(cont.status, 100);
  c.send_raw(body);
  auto r = c.read_response();
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["meta_info"]["prompt_tokens"], 3001);
}

TEST(HttpApi, DisconnectsAbortAndFreeEverything) {
  TestServer s;
  s.engine.step_delay_ms = 2;
  constexpr int kStreams = 80;
  std::vector<std::thread> threads;
  std::atomic<int> completed{0}, dropped{0};
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      HttpConnection c(s.port());
      const bool drop = i % 2 == 0;
      const char* api = i % 3 == 0 ? "/v1/chat/completions" : "/generate";
      std::string body = i % 3 == 0
                             ? R"({"messages": [{"role": "user", "content": "m"}], "stream": true, "max_tokens": 200})"
                             : R"({"text": "stream me", "stream": true, "sampling_params": {"max_new_tokens": 200}})";
      if (!drop) body = R"({"text": "x", "stream": true, "sampling_params": {"max_new_tokens": 20}})";
      c.send_request("POST", drop ? api : "/generate", body);
      if (drop) {
        c.read_events(1 + i % 4);
        if (i % 4 == 0) c.reset();
        else c.close();
        ++dropped;
      } else {
        auto r = c.read_response();
        if (sse_payloads(r.body).back() == "[DONE]") ++completed;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(completed.load(), kStreams / 2);
  EXPECT_EQ(dropped.load(), kStreams / 2);
  EXPECT_TRUE(s.wait_idle()) << "engine still holds " << s.engine.num_live() << " requests";
  EXPECT_EQ(s.engine.aborted().size(), static_cast<size_t>(kStreams / 2));
  auto si = json::parse(s.get("/get_server_info").body)["internal_states"][0];
  EXPECT_EQ(si["kv_tokens_free"], si["kv_tokens_total"]);
}

// Many concurrent streams on two server threads: 1500 connections opened at once, each streaming, read by one
// client thread with poll().
TEST(HttpApi, ThousandsOfConcurrentStreams) {
  rlimit rl{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &rl), 0);
  rl.rlim_cur = rl.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &rl);
  ::getrlimit(RLIMIT_NOFILE, &rl);
  const size_t n = std::min<size_t>(1500, (rl.rlim_cur - 64) / 2);  // client + server fds in this process
  TestServer s;
  std::vector<std::unique_ptr<HttpConnection>> conns;
  for (size_t i = 0; i < n; ++i) {
    conns.push_back(std::make_unique<HttpConnection>(s.port()));
    conns.back()->send_request("POST", "/generate",
                               R"({"text": "c)" + std::to_string(i) +
                                   R"(", "stream": true, "sampling_params": {"max_new_tokens": 5}})");
  }
  size_t ok = 0;
  for (size_t i = 0; i < n; ++i) {
    auto r = conns[i]->read_response();
    auto ev = sse_payloads(r.body);
    if (r.status == 200 && ev.size() == 6 && ev.back() == "[DONE]") ++ok;
  }
  EXPECT_EQ(ok, n);
  EXPECT_TRUE(s.wait_idle());
  EXPECT_GE(n, 400u) << "file descriptor limit too low for a meaningful test";
}

TEST(HttpApi, NonStreamDisconnectAborts) {
  TestServer s;
  {
    HttpConnection c(s.port());
    c.send_request("POST", "/generate", R"({"text": "slow", "sampling_params": {"max_new_tokens": 4000}})");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_EQ(s.engine.num_live(), 1u);
  }
  EXPECT_TRUE(s.wait_idle());
}

TEST(HttpApi, RequestTimeoutAborts) {
  ServerOptions o;
  o.request_timeout_s = 0.2;
  TestServer s(o);
  auto r = s.post("/generate", R"({"text": "slow", "sampling_params": {"max_new_tokens": 4000}})");
  EXPECT_EQ(r.status, 408) << r.body;
  EXPECT_TRUE(s.wait_idle());
}

TEST(HttpApi, MultiTokenOutputsAndMetrics) {
  TestServer s(ServerOptions(), 4096, /*tokens_per_output=*/3);
  auto r = s.post("/generate", R"({"text": "abcdefg", "stream": true, "sampling_params": {"max_new_tokens": 7}})");
  auto events = sse_payloads(r.body);
  ASSERT_EQ(events.size(), 4u);  // 3 + 3 + 1 tokens, then [DONE]
  EXPECT_EQ(json::parse(events[0])["meta_info"]["completion_tokens"], 3);
  EXPECT_EQ(json::parse(events[2])["text"], "abcdefg");
  auto m = s.get("/metrics").body;
  EXPECT_NE(m.find("mlaserve:time_to_first_token_seconds_count 1\n"), std::string::npos) << m;
  EXPECT_NE(m.find("mlaserve:inter_token_latency_seconds_count 4\n"), std::string::npos) << m;
  EXPECT_NE(m.find("mlaserve:e2e_request_latency_seconds_count 1\n"), std::string::npos) << m;
  // vLLM's per-request histograms and finished requests by reason (a length finish: 7 tokens of 7).
  EXPECT_NE(m.find("vllm:request_generation_tokens_sum{model_name=\"fake\"} 7\n"), std::string::npos) << m;
  EXPECT_NE(m.find("vllm:request_success_total{model_name=\"fake\",finished_reason=\"length\"} 1\n"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("vllm:request_success_total{model_name=\"fake\",finished_reason=\"stop\"} 0\n"),
            std::string::npos)
      << m;
}

// SGLang's sessions: /open_session, then requests continuing earlier ones of the session (session_params: rid,
// offset, drop_previous_output, replace), /close_session.
TEST(HttpApi, SessionsContinueEarlierRequests) {
  using Ids = std::vector<int32_t>;
  using test::kBos;
  TestServer s;
  auto opened = s.post("/open_session", R"({"capacity_of_str_len": 1000})");
  ASSERT_EQ(opened.status, 200) << opened.body;
  const std::string sid = json::parse(opened.body).get<std::string>();
  EXPECT_EQ(sid.size(), 32u);
  EXPECT_NE(json::parse(s.post("/open_session", R"({"capacity_of_str_len": 1})").body), sid);
  EXPECT_EQ(json::parse(s.post("/open_session", R"({"capacity_of_str_len": 5, "session_id": "mine"})").body), "mine");
  auto again = s.post("/open_session", R"({"capacity_of_str_len": 5, "session_id": "mine"})");
  EXPECT_EQ(again.status, 400);
  EXPECT_NE(again.body.find("already open"), std::string::npos) << again.body;
  EXPECT_EQ(s.post("/open_session", R"({"capacity_of_str_len": "x"})").status, 400);
  // SGLang's newer fields: capacity_of_str_len may be left out; `streaming` a boolean; `timeout` seconds above 0
  EXPECT_EQ(s.post("/open_session", "{}").status, 200);
  EXPECT_EQ(s.post("/open_session", R"({"streaming": true, "timeout": 30.5, "session_id": "t"})").status, 200);
  for (const char* bad : {R"({"timeout": 0})", R"({"timeout": -1})", R"({"timeout": "x"})", R"({"streaming": 1})"}) {
    const auto r = s.post("/open_session", bad);
    EXPECT_EQ(r.status, 400) << bad;
    EXPECT_NE(r.body.find(std::string(bad).find("timeout") != std::string::npos ? "timeout" : "streaming"),
              std::string::npos)
        << r.body;
  }

  // rid "" : none given (the response's meta_info.id names the request).
  auto gen = [&](const std::string& rid, const std::string& input, const std::string& params) {
    return s.post("/generate",
                  fmt::format(R"({{{}{}, "sampling_params": {{"max_new_tokens": 3}}, "session_params": {}}})",
                              rid.empty() ? "" : fmt::format(R"("rid": "{}", )", rid), input, params));
  };
  auto in = [&](const std::string& parent, const std::string& more = "") {
    return fmt::format(R"({{"id": "{}"{}{}}})", sid, parent.empty() ? "" : fmt::format(R"(, "rid": "{}")", parent),
                       more);
  };
  auto root = gen("r1", R"("text": "ab")", in(""));
  ASSERT_EQ(root.status, 200) << root.body;
  EXPECT_EQ(json::parse(root.body)["text"], "aba");  // (the fake engine repeats its prompt)
  EXPECT_EQ(s.engine.input_ids("r1"), (Ids{kBos, 'a', 'b'}));
  // r1's prompt and output, then the new turn (its BOS dropped).
  auto r2 = gen("r2", R"("text": "c")", in("r1"));
  ASSERT_EQ(r2.status, 200) << r2.body;
  EXPECT_EQ(s.engine.input_ids("r2"), (Ids{kBos, 'a', 'b', 'a', 'b', 'a', 'c'}));
  EXPECT_EQ(json::parse(r2.body)["meta_info"]["prompt_tokens"], 7);
  EXPECT_EQ(json::parse(r2.body)["text"], "aba");
  // offset: Python's slice [:offset] of the parent's tokens; drop_previous_output: its prompt alone.
  ASSERT_EQ(gen("r3", R"("text": "c")", in("r1", R"(, "offset": -2)")).status, 200);
  EXPECT_EQ(s.engine.input_ids("r3"), (Ids{kBos, 'a', 'b', 'a', 'c'}));
  ASSERT_EQ(gen("r4", R"("text": "c")", in("r1", R"(, "offset": 2)")).status, 200);
  EXPECT_EQ(s.engine.input_ids("r4"), (Ids{kBos, 'a', 'c'}));
  ASSERT_EQ(gen("r5", R"("text": "c")", in("r1", R"(, "offset": -100)")).status, 200);
  EXPECT_EQ(s.engine.input_ids("r5"), (Ids{'c'}));
  ASSERT_EQ(gen("r6", R"("text": "c")", in("r1", R"(, "drop_previous_output": true)")).status, 200);
  EXPECT_EQ(s.engine.input_ids("r6"), (Ids{kBos, 'a', 'b', 'c'}));
  // Token ids, continuing a continuation; no rid given: the answer's id continues it.
  auto r7 = gen("", R"("input_ids": [256, 100])", in("r2"));
  ASSERT_EQ(r7.status, 200) << r7.body;
  const std::string r7_id = json::parse(r7.body)["meta_info"]["id"].get<std::string>();
  const Ids r7_in{kBos, 'a', 'b', 'a', 'b', 'a', 'c', 'a', 'b', 'a', 100};
  EXPECT_EQ(s.engine.input_ids(r7_id), r7_in);
  ASSERT_EQ(gen("r8", R"("input_ids": [101])", in(r7_id)).status, 200);
  Ids r8_in = r7_in;
  r8_in.insert(r8_in.end(), {'a', 'b', 'a', 101});
  EXPECT_EQ(s.engine.input_ids("r8"), r8_in);

  // Bad session requests: 400s naming the field.
  auto bad = [&](const test::HttpResponse& r, const std::string& param, const std::string& words) {
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_EQ(json::parse(r.body)["error"]["param"], param) << r.body;
    EXPECT_NE(r.body.find(words), std::string::npos) << r.body;
  };
  bad(gen("x1", R"("text": "c")", in("nobody")), "session_params.rid", "has no request 'nobody'");
  bad(gen("x2", R"("text": "c")", R"({"id": "closed?"})"), "session_params.id", "not open");
  bad(gen("r2", R"("text": "c")", in("r1")), "rid", "already has a request 'r2'");
  bad(gen("x3", R"("text": ["a", "b"])", in("r1")), "session_params", "one prompt");
  bad(gen("x4", R"("text": "c")", in("r1", R"(, "extra": 1)")), "session_params.extra", "not a session parameter");
  bad(gen("x5", R"("text": "c")", in("r1", R"(, "offset": "2")")), "session_params.offset", "integer");
  bad(s.post("/generate", fmt::format(R"({{"text": "c", "sampling_params": {{"n": 2}}, "session_params": {}}})",
                                      in("r1"))),
      "session_params", "n 1");
  for (const char* rid : {"x1", "x2", "x3", "x4", "x5"}) EXPECT_TRUE(s.engine.input_ids(rid).empty()) << rid;
  // Without a session id: an ordinary request (SGLang's).
  ASSERT_EQ(gen("plain", R"("text": "ab")", R"({"rid": "r1"})").status, 200);
  EXPECT_EQ(s.engine.input_ids("plain"), (Ids{kBos, 'a', 'b'}));

  // replace with a parent: what continued it before is dropped (r2 and its continuations too).
  ASSERT_EQ(gen("r9", R"("text": "d")", in("r1", R"(, "replace": true)")).status, 200);
  EXPECT_EQ(s.engine.input_ids("r9"), (Ids{kBos, 'a', 'b', 'a', 'b', 'a', 'd'}));
  bad(gen("x6", R"("text": "c")", in("r2")), "session_params.rid", "has no request 'r2'");
  bad(gen("x7", R"("text": "c")", in("r8")), "session_params.rid", "has no request 'r8'");
  ASSERT_EQ(gen("r10", R"("text": "e")", in("r9")).status, 200);

  // A running request cannot be continued; replace without a parent drops (and aborts) every request of the session.
  test::HttpResponse running;
  std::thread t([&] {
    running = s.post("/generate", fmt::format(R"({{"rid": "long", "text": "zz", "sampling_params": {{"max_new_tokens":
        4000}}, "session_params": {}}})", in("r1")));
  });
  for (int i = 0; i < 2000 && s.engine.input_ids("long").empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  bad(gen("x8", R"("text": "c")", in("long")), "session_params.rid", "has not finished");
  ASSERT_EQ(gen("r11", R"("text": "f")", in("", R"(, "replace": true)")).status, 200);
  t.join();
  ASSERT_EQ(running.status, 200) << running.body;
  EXPECT_EQ(json::parse(running.body)["meta_info"]["finish_reason"]["type"], "abort");
  EXPECT_EQ(s.engine.input_ids("r11"), (Ids{kBos, 'f'}));
  bad(gen("x9", R"("text": "c")", in("r9")), "session_params.rid", "has no request 'r9'");
  ASSERT_EQ(gen("r12", R"("text": "g")", in("r11")).status, 200);
  EXPECT_EQ(s.engine.input_ids("r12"), (Ids{kBos, 'f', 'f', 'f', 'f', 'g'}));

  // Closing: 200 with an empty body; the session is gone.
  auto closed = s.post("/close_session", fmt::format(R"({{"session_id": "{}"}})", sid));
  EXPECT_EQ(closed.status, 200) << closed.body;
  EXPECT_TRUE(closed.body.empty());
  bad(gen("x10", R"("text": "c")", in("r11")), "session_params.id", "not open");
  bad(s.post("/close_session", fmt::format(R"({{"session_id": "{}"}})", sid)), "session_id", "not open");
  bad(s.post("/close_session", "{}"), "session_id", "required");
  EXPECT_EQ(s.get("/close_session?x").status, 400);
  EXPECT_EQ(s.post("/close_session", R"({"session_id": "mine"})").status, 200);
  EXPECT_TRUE(s.wait_idle());
}

// A session request that ends early (its client's time ran out) is recorded with the tokens it had: continuing it
// runs them.
TEST(HttpApi, SessionRequestCutShortCanBeContinued) {
  using Ids = std::vector<int32_t>;
  ServerOptions o;
  o.request_timeout_s = 0.2;
  TestServer s(o);
  ASSERT_EQ(s.post("/open_session", R"({"capacity_of_str_len": 0, "session_id": "s"})").status, 200);
  auto slow = s.post("/generate", R"({"rid": "slow", "text": "slow", "sampling_params": {"max_new_tokens": 4000},
      "session_params": {"id": "s"}})");
  EXPECT_EQ(slow.status, 408) << slow.body;
  EXPECT_TRUE(s.wait_idle());
  auto next = s.post("/generate", R"({"rid": "next", "text": "!", "sampling_params": {"max_new_tokens": 1},
      "session_params": {"id": "s", "rid": "slow"}})");
  ASSERT_EQ(next.status, 200) << next.body;
  const Ids in = s.engine.input_ids("next");
  ASSERT_GE(in.size(), 6u);
  EXPECT_EQ(Ids(in.begin(), in.begin() + 5), (Ids{test::kBos, 's', 'l', 'o', 'w'}));
  EXPECT_EQ(in.back(), '!');
  for (size_t i = 5; i + 1 < in.size(); ++i) EXPECT_EQ(in[i], "slow"[(i - 5) % 4]) << i;  // what it had generated
}

// vLLM's --served-model-name with several names: requests may name any (and are answered under it), /v1/models lists
// each, other names stay a 404.
TEST(HttpApi, SeveralServedModelNames) {
  ServerOptions o;
  o.served_model_aliases = {"alias", "org/other-name"};
  TestServer s(o);
  const json models = json::parse(s.get("/v1/models").body);
  ASSERT_EQ(models["data"].size(), 3u) << models.dump();
  EXPECT_EQ(models["data"][0]["id"], "fake");
  EXPECT_EQ(models["data"][1]["id"], "alias");
  EXPECT_EQ(models["data"][2]["id"], "org/other-name");
  EXPECT_EQ(json::parse(s.get("/v1/models/org/other-name").body)["id"], "org/other-name");
  EXPECT_EQ(json::parse(s.get("/v1/models/alias").body)["id"], "alias");
  EXPECT_EQ(s.get("/v1/models/other-name").status, 404);
  for (const std::string name : {"fake", "alias", "org/other-name", "/models/fake", "default"}) {
    SCOPED_TRACE(name);
    const std::string answered = name == "alias" || name == "org/other-name" ? name : "fake";
    auto r = s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 2, "model": ")" + name + "\"}");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["model"], answered);
    r = s.post("/v1/chat/completions",
               R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "model": ")" + name + "\"}");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["model"], answered);
    r = s.post("/v1/responses", R"({"input": "x", "max_output_tokens": 2, "model": ")" + name + "\"}");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["model"], answered);
    r = s.post("/v1/score", R"({"query": "q", "items": ["a"], "label_token_ids": [97], "model": ")" + name + "\"}");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["model"], answered);
  }
  auto r = s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "model": "other-name"})");
  EXPECT_EQ(r.status, 404) << r.body;
}

// vLLM's return_token_ids: completions give each choice's prompt ids and generated ids, chat the prompt's ids at the
// top; streamed, the generated ids come as each chunk's new ones (all of them by the last chunk).
TEST(HttpApi, ReturnTokenIds) {
  using Ids = std::vector<int32_t>;
  TestServer s;
  auto r = json::parse(
      s.post("/v1/completions", R"({"prompt": ["ab", "c"], "max_tokens": 3, "return_token_ids": true})").body);
  ASSERT_EQ(r["choices"].size(), 2u) << r.dump();
  EXPECT_EQ(r["choices"][0]["prompt_token_ids"].get<Ids>(), (Ids{test::kBos, 'a', 'b'}));
  EXPECT_EQ(r["choices"][0]["token_ids"].get<Ids>(), (Ids{'a', 'b', 'a'}));
  EXPECT_EQ(r["choices"][1]["prompt_token_ids"].get<Ids>(), (Ids{test::kBos, 'c'}));
  EXPECT_EQ(r["choices"][1]["token_ids"].get<Ids>(), (Ids{'c', 'c', 'c'}));
  EXPECT_FALSE(json::parse(s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 3})").body)["choices"][0]
                   .contains("token_ids"));
  // A finish on EOS: its id is among the generated ones, not in the text.
  r = json::parse(s.post("/v1/completions", R"({"prompt": "x#", "max_tokens": 5, "return_token_ids": true})").body);
  EXPECT_EQ(r["choices"][0]["token_ids"].get<Ids>(), (Ids{'x', test::kEos}));
  EXPECT_EQ(r["choices"][0]["text"], "x");

  const std::string chat = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
      "return_token_ids": true)";
  r = json::parse(s.post("/v1/chat/completions", chat + "}").body);
  Ids prompt;
  for (unsigned char ch : std::string("<bos>[user]hi[assistant]")) prompt.push_back(ch);
  EXPECT_EQ(r["prompt_token_ids"].get<Ids>(), prompt);
  ASSERT_EQ(r["choices"].size(), 2u);
  const Ids out(prompt.begin(), prompt.begin() + 4);
  for (const auto& c : r["choices"]) EXPECT_EQ(c["token_ids"].get<Ids>(), out);

  std::map<int, Ids> streamed;
  int prompt_ids_seen = 0;
  for (const auto& e : sse_payloads(s.post("/v1/chat/completions", chat + R"(, "stream": true})").body)) {
    if (e == "[DONE]") continue;
    const json j = json::parse(e);
    if (j.contains("prompt_token_ids")) {
      EXPECT_EQ(j["prompt_token_ids"].get<Ids>(), prompt);
      ++prompt_ids_seen;
    }
    for (const auto& c : j["choices"])
      if (c.contains("token_ids"))
        for (int32_t id : c["token_ids"].get<Ids>()) streamed[c["index"].get<int>()].push_back(id);
  }
  EXPECT_EQ(prompt_ids_seen, 2);  // one per choice, with its first chunk
  EXPECT_EQ(streamed[0], out);
  EXPECT_EQ(streamed[1], out);
  int completions_prompts = 0;
  Ids got;
  for (const auto& e : sse_payloads(
           s.post("/v1/completions", R"({"prompt": "ab", "max_tokens": 5, "stream": true, "return_token_ids": true})")
               .body)) {
    if (e == "[DONE]") continue;
    const json c = json::parse(e)["choices"][0];
    if (c.contains("prompt_token_ids")) {
      EXPECT_EQ(c["prompt_token_ids"].get<Ids>(), (Ids{test::kBos, 'a', 'b'}));
      ++completions_prompts;
    }
    for (int32_t id : c["token_ids"].get<Ids>()) got.push_back(id);
  }
  EXPECT_EQ(completions_prompts, 1);
  EXPECT_EQ(got, (Ids{'a', 'b', 'a', 'b', 'a'}));
}

// vLLM's request ids: the X-Request-Id header, else the body's request_id, make the response id; an id of a running
// request is refused. vLLM's documents reach the chat template; its fields for what does not run here are 400s.
TEST(HttpApi, RequestIdsDocumentsAndUnsupportedVllmFields) {
  TestServer s;
  const std::string chat = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2)";
  EXPECT_EQ(json::parse(s.post("/v1/chat/completions", chat + R"(, "request_id": "abc"})").body)["id"],
            "chatcmpl-abc");
  EXPECT_EQ(json::parse(s.post("/v1/completions", R"({"prompt": "a", "max_tokens": 1, "request_id": "abc"})").body)
                ["id"],
            "cmpl-abc");
  EXPECT_EQ(json::parse(s.post("/v1/chat/completions", chat + R"(, "request_id": "abc"})", "X-Request-Id: hdr-1\r\n")
                            .body)["id"],
            "chatcmpl-hdr-1");
  const std::string plain = json::parse(s.post("/v1/chat/completions", chat + "}").body)["id"];
  EXPECT_EQ(plain.rfind("chatcmpl-", 0), 0u);
  EXPECT_NE(plain, "chatcmpl-abc");
  EXPECT_EQ(s.post("/v1/chat/completions", chat + R"(, "request_id": ""})").status, 400);

  // A running request's id is refused; once it ended, it may be used again.
  test::HttpResponse first;
  std::thread t([&] {
    first = s.post("/generate", R"({"rid": "dup", "text": "slow", "sampling_params": {"max_new_tokens": 4000}})");
  });
  for (int i = 0; i < 2000 && s.engine.num_live() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  auto again = s.post("/generate", R"({"rid": "dup", "text": "x", "sampling_params": {"max_new_tokens": 1}})");
  EXPECT_EQ(again.status, 400) << again.body;
  EXPECT_NE(again.body.find("in use by a running request"), std::string::npos) << again.body;
  EXPECT_EQ(json::parse(s.post("/abort_request", R"({"rid": "dup"})").body)["aborted"], 1);
  t.join();
  EXPECT_EQ(json::parse(first.body)["meta_info"]["finish_reason"]["type"], "abort");
  EXPECT_EQ(s.post("/generate", R"({"rid": "dup", "text": "x", "sampling_params": {"max_new_tokens": 1}})").status,
            200);

  // documents: the fake template writes how many.
  auto r = json::parse(s.post("/v1/chat/completions",
                              chat + R"(, "documents": [{"title": "a", "text": "b"}, {"text": "c"}]})")
                           .body);
  EXPECT_EQ(r["usage"]["prompt_tokens"], std::string("<bos>[docs:2][user]hi[assistant]").size()) << r.dump();
  EXPECT_EQ(s.post("/v1/chat/completions", chat + R"(, "documents": "text"})").status, 400);
  EXPECT_EQ(s.post("/v1/chat/completions", chat + R"(, "documents": ["text"]})").status, 400);
  for (const char* field : {"prompt_embeds", "logits_processors", "kv_transfer_params"}) {
    auto bad = s.post("/v1/completions", fmt::format(R"({{"prompt": "a", "{}": ["x"]}})", field));
    EXPECT_EQ(bad.status, 400) << field;
    EXPECT_EQ(json::parse(bad.body)["error"]["param"], field) << bad.body;
  }
  EXPECT_TRUE(s.wait_idle());
}

// Anthropic's Messages API: a message object (text, stop reasons, usage), the conversation's blocks (thinking,
// tool_use, tool_result) rendered as chat renders them, count_tokens, the stream's events, errors in Anthropic's form,
// and the x-api-key header.
TEST(HttpApi, AnthropicMessages) {
  ServerOptions o;
  o.api_key = "k";
  TestServer s(o);
  const std::string key = "x-api-key: k\r\n";
  auto post = [&](const std::string& path, const std::string& body) { return s.post(path, body, key); };
  auto r = post("/v1/messages", R"({"model": "fake", "max_tokens": 5, "system": "S",
      "messages": [{"role": "user", "content": "hi"}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  json m = json::parse(r.body);
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_EQ(m["model"], "fake");
  EXPECT_EQ(m["id"].get<std::string>().rfind("msg_", 0), 0u);
  ASSERT_EQ(m["content"].size(), 1u) << m.dump();
  EXPECT_EQ(m["content"][0]["type"], "text");
  EXPECT_EQ(m["content"][0]["text"], "<bos>");  // (the fake engine repeats the prompt)
  EXPECT_EQ(m["stop_reason"], "max_tokens");
  EXPECT_TRUE(m["stop_sequence"].is_null());
  EXPECT_EQ(m["usage"]["input_tokens"], std::string("<bos>[system]S[user]hi[assistant]").size());
  EXPECT_EQ(m["usage"]["output_tokens"], 5);
  // A stop sequence, and the end of a turn (the fake's '#' is its EOS).
  m = json::parse(post("/v1/messages", R"({"max_tokens": 50, "stop_sequences": ["sys"], "system": "S",
      "messages": [{"role": "user", "content": "hi"}]})").body);
  EXPECT_EQ(m["content"][0]["text"], "<bos>[");
  EXPECT_EQ(m["stop_reason"], "stop_sequence");
  EXPECT_EQ(m["stop_sequence"], "sys");
  m = json::parse(post("/v1/messages", R"({"max_tokens": 50, "messages": [{"role": "user", "content": "#"}]})").body);
  EXPECT_EQ(m["content"][0]["text"], "<bos>[user]");
  EXPECT_EQ(m["stop_reason"], "end_turn");

  // Blocks: the assistant's thinking is not shown again; its tool_use becomes a call, the tool_result a tool message.
  const std::string convo = R"("messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
      {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
        {"type": "text", "text": "a"}, {"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "r"},
        {"type": "text", "text": "more"}]}])";
  const std::string rendered = R"(<bos>[user]q[assistant]a[calls:f({"x":1})|c1,][tool]r(c1)[user]more[assistant])";
  m = json::parse(post("/v1/messages", R"({"max_tokens": 1, )" + convo + "}").body);
  EXPECT_EQ(m["usage"]["input_tokens"], rendered.size()) << m.dump();
  m = json::parse(post("/v1/messages/count_tokens", "{" + convo + "}").body);
  EXPECT_EQ(m["input_tokens"], rendered.size()) << m.dump();

  // Streamed: message_start, a text block with its deltas, message_delta, message_stop; each event named by its type.
  r = post("/v1/messages", R"({"max_tokens": 5, "stream": true, "system": "S",
      "messages": [{"role": "user", "content": "hi"}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  std::vector<std::string> types;
  std::string text;
  for (size_t at = 0; (at = r.body.find("event: ", at)) != std::string::npos;) {
    const size_t nl = r.body.find('\n', at);
    const std::string name = r.body.substr(at + 7, nl - at - 7);
    ASSERT_EQ(r.body.compare(nl + 1, 6, "data: "), 0) << r.body;
    const size_t end = r.body.find("\n\n", nl);
    const json e = json::parse(r.body.substr(nl + 7, end - nl - 7));
    EXPECT_EQ(e["type"], name);
    if (types.empty() || types.back() != name) types.push_back(name);
    if (name == "content_block_delta") text += e["delta"]["text"].get<std::string>();
    if (name == "message_delta") {
      EXPECT_EQ(e["delta"]["stop_reason"], "max_tokens");
      EXPECT_EQ(e["usage"]["output_tokens"], 5);
    }
    at = end;
  }
  EXPECT_EQ(types, (std::vector<std::string>{"message_start", "content_block_start", "content_block_delta",
                                             "content_block_stop", "message_delta", "message_stop"}));
  EXPECT_EQ(text, "<bos>");

  // Errors in Anthropic's form; the key by x-api-key (or Authorization) only.
  auto error_type = [](const test::HttpResponse& e) {
    const json j = json::parse(e.body);
    EXPECT_EQ(j["type"], "error") << e.body;
    EXPECT_TRUE(j["error"]["message"].is_string()) << e.body;
    return j["error"]["type"].get<std::string>();
  };
  r = post("/v1/messages", R"({"messages": [{"role": "user", "content": "hi"}]})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(error_type(r), "invalid_request_error");
  EXPECT_NE(r.body.find("max_tokens"), std::string::npos);
  r = post("/v1/messages", R"({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image",
      "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(error_type(r), "invalid_request_error");
  r = post("/v1/messages", R"({"model": "other", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(error_type(r), "not_found_error");
  r = post("/v1/messages", R"({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "hi"}]})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(s.post("/v1/messages", R"({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})").status,
            401);
  EXPECT_EQ(s.post("/v1/messages", R"({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})",
                   "Authorization: Bearer k\r\n")
                .status,
            200);
}

// vLLM's --default-chat-template-kwargs (under each request's own), --response-role, and GET /load (the generation
// requests being served).
TEST(HttpApi, DefaultTemplateKwargsResponseRoleAndLoad) {
  ServerOptions o;
  o.parse.default_chat_template_kwargs = {{"prefix", "D"}};
  o.response_role = "bot";
  TestServer s(o);
  const std::string chat = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2)";
  auto r = json::parse(s.post("/v1/chat/completions", chat + "}").body);
  EXPECT_EQ(r["usage"]["prompt_tokens"], std::string("<bos>[user]hi[assistant]D").size()) << r.dump();
  EXPECT_EQ(r["choices"][0]["message"]["role"], "bot");
  r = json::parse(s.post("/v1/chat/completions", chat + R"(, "chat_template_kwargs": {"prefix": "RR"}})").body);
  EXPECT_EQ(r["usage"]["prompt_tokens"], std::string("<bos>[user]hi[assistant]RR").size()) << r.dump();
  const auto events = sse_payloads(s.post("/v1/chat/completions", chat + R"(, "stream": true})").body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(json::parse(events[0])["choices"][0]["delta"]["role"], "bot") << events[0];
  EXPECT_EQ(json::parse(s.post("/tokenize", R"({"messages": [{"role": "user", "content": "hi"}]})").body)["count"],
            std::string("<bos>[user]hi[assistant]D").size());

  EXPECT_EQ(json::parse(s.get("/load").body)["server_load"], 0);
  test::HttpResponse slow;
  std::thread t([&] {
    slow = s.post("/generate", R"({"rid": "busy", "text": "slow", "sampling_params": {"max_new_tokens": 4000}})");
  });
  for (int i = 0; i < 2000 && s.engine.num_live() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(json::parse(s.get("/load").body)["server_load"], 1);
  EXPECT_EQ(json::parse(s.post("/abort_request", R"({"rid": "busy"})").body)["aborted"], 1);
  t.join();
  EXPECT_TRUE(s.wait_idle());
  EXPECT_EQ(json::parse(s.get("/load").body)["server_load"], 0);
}

// A job's on_end runs before its last update and its on_done, which answer the client: what on_end records (a
// session's finished request) is there by the time the client can send its next request.
TEST(GenerationJob, EndComesBeforeTheAnswer) {
  test::FakeEngine engine;
  std::mutex mu;
  std::deque<std::function<void()>> queue;
  const Executor post = [&](std::function<void()> f) {
    std::lock_guard lk(mu);
    queue.push_back(std::move(f));
  };
  for (const bool stream : {false, true}) {
    JobSpec spec;
    spec.id = stream ? "streamed" : "whole";
    JobPrompt prompt;
    prompt.input_ids = {'a', 'b'};
    spec.prompts.push_back(prompt);
    spec.sampling.max_new_tokens = 3;
    auto job = std::make_shared<GenerationJob>(engine, nullptr, nullptr, post, spec);
    std::vector<std::string> events;
    job->on_end = [&](const GenerationJob& j) {
      events.push_back("end");
      EXPECT_EQ(j.choices()[0].output_ids.size(), 3u);
    };
    if (stream)
      job->on_update = [&](const ChoiceUpdate& u) {
        if (u.finished) events.push_back("last update");
      };
    job->on_done = [&] { events.push_back("done"); };
    job->start();
    for (int i = 0; i < 5000 && !job->done(); ++i) {
      std::deque<std::function<void()>> ready;
      {
        std::lock_guard lk(mu);
        ready.swap(queue);
      }
      for (auto& f : ready) f();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(job->done());
    EXPECT_EQ(events, stream ? (std::vector<std::string>{"end", "last update", "done"})
                             : (std::vector<std::string>{"end", "done"}));
  }
}

}  // namespace
}  // namespace mlaserve::server
