// Mutated requests against the real server: valid requests of every endpoint, changed at random (values of other
// types and sizes, members removed or added from the parameter names the APIs know, deep nesting, odd text, broken
// bytes), sent from several connections at once. Whatever arrives, the answer is a 200 (whose body parses) or a 4xx
// with an error object, never a 5xx or a dropped connection; afterwards the server is healthy, holds no pages and
// answers a reference request exactly as before.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "core/thread.h"
#include "e2e/server_process.h"
#include "http_test_client.h"
#include "input_stack.h"

namespace mlaserve::test {
namespace {

using json = nlohmann::json;

struct Seed {
  const char* path;
  const char* body;
};

// Valid requests (each checked to get a 200 first), small generations.
const Seed kSeeds[] = {
    {"/generate", R"({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6,
      "temperature": 0}})"},
    {"/generate", R"({"input_ids": [[100, 200, 300], [400, 500]], "sampling_params": {"max_new_tokens": 4, "n": 2,
      "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "seed": 3, "stop": ["a", "the"],
      "stop_token_ids": [7], "frequency_penalty": 0.5, "repetition_penalty": 1.1, "min_new_tokens": 1},
      "return_logprob": true, "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": true,
      "token_ids_logprob": [[5, 6], [7]], "return_hidden_states": [true, false], "return_routed_experts": true})"},
    {"/generate", R"({"text": ["one", "two"], "stream": true, "rid": ["r1", "r2"], "sampling_params":
      {"max_new_tokens": 5, "regex": "[a-z ]+", "skip_special_tokens": false, "no_stop_trim": true}})"},
    {"/generate", R"({"text": "Answer:", "sampling_params": {"max_new_tokens": 8, "json_schema":
      "{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\", \"minimum\": 0}}, \"required\": [\"a\"]}"}})"},
    {"/generate", R"({"text": "Pick:", "sampling_params": {"max_new_tokens": 4, "ebnf":
      "root ::= \"yes\" | \"no\"", "logit_bias": {"100": -2.5}, "ignore_eos": true}})"},
    {"/generate", R"({"text": "Count: 1 2 3", "sampling_params": {"max_new_tokens": 6, "stop_regex": ["[0-9]{3}",
      "\\s{2}"], "min_new_tokens": 1}})"},
    {"/v1/completions", R"({"model": "tiny-v3", "prompt": ["a b", "c"], "max_tokens": 5, "logprobs": 2,
      "echo": true, "n": 2, "stop": ["\n"], "seed": 1, "logit_bias": {"100": -5}, "presence_penalty": 0.2,
      "user": "fuzz"})"},
    {"/v1/completions", R"({"model": "tiny-v3", "prompt": "def f(x):", "suffix": "return y", "max_tokens": 6,
      "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true},
      "temperature": 0.5, "top_k": 5, "min_tokens": 2})"},
    {"/v1/completions", R"({"model": "tiny-v3", "prompt": "x y", "max_tokens": 4, "allowed_token_ids": [100, 200,
      300], "bad_words": ["a b", "c"], "temperature": 0.7})"},
    {"/v1/completions", R"({"model": "tiny-v3", "prompt": [[100, 101, 102]], "max_tokens": 3,
      "include_stop_str_in_output": true, "stop_token_ids": [5], "response_format": {"type": "json_object"}})"},
    {"/v1/chat/completions", R"({"model": "tiny-v3", "messages": [{"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 6, "logprobs": true,
      "top_logprobs": 2, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true,
      "schema": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]}}}})"},
    {"/v1/chat/completions", R"({"model": "tiny-v3", "messages": [{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [{"id": "c1",
      "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "And Rome?"}],
      "tools": [{"type": "function", "function": {"name": "get_weather", "description": "weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
      "tool_choice": "required", "max_tokens": 24, "stream": true, "stream_options": {"include_usage": true},
      "parallel_tool_calls": false, "chat_template_kwargs": {"thinking": false}})"},
    {"/v1/chat/completions", R"({"model": "tiny-v3", "messages": [{"role": "user", "content": "Go on"},
      {"role": "assistant", "content": "Once upon"}], "add_generation_prompt": false, "continue_final_message": true,
      "max_completion_tokens": 4, "n": 2, "seed": 5, "temperature": 1.0, "separate_reasoning": true,
      "stop": "."})"},
    {"/v1/responses", R"({"model": "tiny-v3", "instructions": "Be brief.", "input": [{"role": "user", "content":
      [{"type": "input_text", "text": "Weather?"}]}, {"type": "function_call", "call_id": "c1", "name": "get_weather",
      "arguments": "{\"city\": \"Paris\"}"}, {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
      "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city":
      {"type": "string"}}}}], "max_output_tokens": 8, "stream": true, "top_logprobs": 2})"},
    {"/v1/responses", R"({"input": "Say it", "max_output_tokens": 6, "text": {"format": {"type": "json_schema",
      "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "boolean"}}}}}, "temperature": 0.5})"},
    {"/v1/responses", R"({"input": [{"role": "user", "content": "Hi"}], "background": true, "store": true,
      "max_output_tokens": 4, "metadata": {"a": "b"}})"},
    {"/v1/responses", R"({"input": "Count", "background": true, "stream": true, "max_output_tokens": 5})"},
    {"/v1/responses/input_tokens", R"({"input": [{"role": "user", "content": "Weather?"}], "instructions": "Be brief.",
      "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]})"},
    {"/tokenize", R"({"prompt": "hello world", "add_special_tokens": false})"},
    {"/tokenize", R"({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true})"},
    {"/detokenize", R"({"tokens": [100, 200, 300]})"},
    {"/abort_request", R"({"rid": "no-such-request"})"},
    {"/v1/chat/completions", R"({"model": "tiny-v3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
      "return_token_ids": true, "cache_salt": "fuzz", "include_reasoning": false, "documents": [{"text": "d"}],
      "request_id": "fuzz-chat", "stream": true})"},
    {"/generate", R"({"text": "Salted", "extra_key": "fuzz", "sampling_params": {"max_new_tokens": 3}})"},
    {"/configure_logging", R"({"log_requests": false, "log_requests_level": 1})"},
    {"/v1/messages", R"({"model": "tiny-v3", "max_tokens": 6, "system": "Be brief.", "stop_sequences": ["."],
      "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, {"role": "assistant", "content":
      [{"type": "thinking", "thinking": "t", "signature": ""}, {"type": "text", "text": "Hello"}]},
      {"role": "user", "content": "Go on"}], "temperature": 0.5, "top_k": 5, "stream": true})"},
    {"/v1/messages/count_tokens", R"({"model": "tiny-v3", "messages": [{"role": "user", "content": "Hi"}]})"},
    {"/open_session", R"({"capacity_of_str_len": 100, "session_id": "fuzz"})"},
    {"/generate", R"({"text": "Hello", "rid": "fuzz-root", "session_params": {"id": "fuzz"},
      "sampling_params": {"max_new_tokens": 4}})"},
    {"/generate", R"({"input_ids": [100, 101], "session_params": {"id": "fuzz", "rid": "fuzz-root", "offset": -1,
      "replace": true, "drop_previous_output": false}, "sampling_params": {"max_new_tokens": 4}})"},
    {"/open_session", R"({"capacity_of_str_len": 0, "session_id": "fuzz2"})"},
    {"/close_session", R"({"session_id": "fuzz2"})"},
    {"/v1/score", R"({"query": "Is it true?", "items": [" yes", " no"], "label_token_ids": [100, 200],
      "apply_softmax": true, "item_first": false, "model": "tiny-v3"})"},
    {"/generative_scoring", R"({"query": [100, 101], "items": ["a", [300, 301]], "label_token_ids": [5, 6, 7],
      "apply_softmax": false, "add_special_tokens": true})"},
    {"/separate_reasoning", R"({"text": "<think>why</think>because", "reasoning_parser": "deepseek-r1"})"},
    {"/parse_function_call", R"({"text": "hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f)"
                             R"(\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "tools": [{"type": )"
                             R"("function", "function": {"name": "f"}}], "tool_call_parser": "deepseekv3"})"},
};

// Every parameter name the APIs read (added at random, with random values).
const char* kKeys[] = {
    "text", "input_ids", "sampling_params", "max_new_tokens", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "no_stop_trim", "n", "seed", "min_new_tokens", "logit_bias", "stream", "rid",
    "return_logprob", "top_logprobs_num", "return_text_in_logprobs", "logprob_start_len", "regex", "json_schema",
    "return_hidden_states", "return_routed_experts",
    "ebnf", "structural_tag", "model", "prompt", "max_tokens", "max_completion_tokens", "min_tokens", "echo",
    "logprobs", "top_logprobs", "suffix", "best_of", "stream_options", "include_usage", "continuous_usage_stats",
    "messages", "role", "content", "tools", "tool_choice", "response_format", "type", "schema", "name", "strict",
    "chat_template_kwargs", "separate_reasoning", "add_generation_prompt", "continue_final_message",
    "include_stop_str_in_output", "tool_calls", "function", "arguments", "parameters", "reasoning_content",
    "add_special_tokens", "tokens", "abort_all", "data_parallel_rank", "lora_path", "image_data", "functions",
    "user", "guided_json", "guided_regex", "structured_outputs", "input", "instructions", "max_output_tokens",
    "text", "format", "call_id", "output", "previous_response_id", "metadata", "store", "reasoning",
    "truncate_prompt_tokens", "prompt_logprobs", "continuous_usage_stats", "allowed_token_ids", "bad_words",
    "token_ids_logprob", "thinking_budget", "thinking_token_budget", "background", "conversation",
    "stop_regex", "chat_template", "session_params", "custom_logit_processor", "query", "items", "label_token_ids",
    "apply_softmax", "item_first", "reasoning_parser", "tool_call_parser", "capacity_of_str_len", "session_id",
    "offset", "replace", "drop_previous_output", "return_token_ids", "cache_salt", "extra_key", "include_reasoning",
    "documents", "request_id", "prompt_embeds", "log_requests", "log_requests_level", "system", "stop_sequences",
    "thinking", "budget_tokens", "tool_use", "tool_result", "tool_use_id", "input_schema", "signature",
};

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  std::string mutate(const char* body) {
    json j = json::parse(body);
    const int n = 1 + pick(3);
    for (int i = 0; i < n; ++i) mutate_once(j);
    std::string deep;  // a member's value nested far deeper than any real request, written as text
    if (j.is_object() && !j.empty() && pick(40) == 0) {
      auto it = j.begin();
      std::advance(it, pick(static_cast<int>(j.size())));
      const size_t levels = 1000 + static_cast<size_t>(pick(200000));
      deep = std::string(levels, '[') + "1" + std::string(levels, ']');
      *it = "@@deep@@";
    }
    std::string out = j.dump(-1, ' ', pick(4) == 0);  // sometimes \u escapes for everything past ASCII
    if (!deep.empty()) out.replace(out.find("\"@@deep@@\""), 10, deep);
    if (pick(12) == 0) out = break_bytes(out);
    return out;
  }

 private:
  int pick(int n) { return static_cast<int>(rng_() % static_cast<uint64_t>(n)); }

  // Every node of j (root first) with a pointer to it.
  void nodes(json& j, std::vector<json*>& out) {
    out.push_back(&j);
    if (j.is_object() || j.is_array())
      for (auto& v : j) nodes(v, out);
  }

  json random_value(int depth = 0) {
    switch (pick(depth > 1 ? 5 : 8)) {
      case 0: return nullptr;
      case 1: return pick(2) == 0;
      case 2: {
        static const int64_t ints[] = {0, 1, -1, 2, 3, 7, 16, 64, 255, 4096, 5119, 5120, 100000, 129279, 129280,
                                       -2147483648LL, 2147483647LL, 2147483648LL, INT64_MAX, INT64_MIN};
        return ints[pick(static_cast<int>(std::size(ints)))];
      }
      case 3: {
        static const double reals[] = {0.0, -0.0, 0.5, 1.5, -1.0, 2.0, 1e-300, 1e300, -1e300, 3.7, 1e9, 0.999};
        if (pick(6) == 0) return static_cast<uint64_t>(UINT64_MAX);
        return reals[pick(static_cast<int>(std::size(reals)))];
      }
      case 4: {
        static const std::vector<std::string> strs = {
            "", "a", "tiny-v3", "default", "function", "text", "json_schema", "user", "assistant", "tool", "system",
            "none", "auto", "required", "[a-z]{2,3}", "(((", "\\", "{\"type\": \"integer\"}", "root ::= \"x\"",
            "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "</think>", "<think>", "日本語のテキスト", "🙂👍🏽", "مرحبا",
            std::string("\0nul", 4), "line\nbreak", "{{ raise_exception('x') }}", "%s%n"};
        if (pick(10) == 0) {
          static const char* units[] = {"x", "é", "中", "🙂"};
          std::string long_text;
          for (int n = 1 + pick(8000); n > 0; --n) long_text += units[pick(4)];
          return long_text;
        }
        return strs[static_cast<size_t>(pick(static_cast<int>(strs.size())))];
      }
      case 5: {
        json a = json::array();
        const int n = pick(4);
        for (int i = 0; i < n; ++i) a.push_back(random_value(depth + 1));
        return a;
      }
      case 6: {
        json o = json::object();
        const int n = pick(3);
        for (int i = 0; i < n; ++i) o[kKeys[pick(static_cast<int>(std::size(kKeys)))]] = random_value(depth + 1);
        return o;
      }
      default: {  // deep nesting
        json v = pick(2) ? json(1) : json::object();
        const int levels = 1 + pick(pick(4) == 0 ? 3000 : 200);
        for (int i = 0; i < levels; ++i) v = pick(2) ? json::array({std::move(v)}) : json{{"a", std::move(v)}};
        return v;
      }
    }
  }

  void mutate_once(json& root) {
    std::vector<json*> all;
    nodes(root, all);
    json& target = *all[static_cast<size_t>(pick(static_cast<int>(all.size())))];
    switch (pick(6)) {
      case 0:
      case 1:
        if (&target != &root || pick(8) == 0) target = random_value();
        break;
      case 2:  // remove a member or an element
        if (target.is_object() && !target.empty()) {
          auto it = target.begin();
          std::advance(it, pick(static_cast<int>(target.size())));
          target.erase(it);
        } else if (target.is_array() && !target.empty()) {
          target.erase(static_cast<size_t>(pick(static_cast<int>(target.size()))));
        }
        break;
      case 3:  // add a member the APIs know
        if (target.is_object()) target[kKeys[pick(static_cast<int>(std::size(kKeys)))]] = random_value();
        break;
      case 4:  // grow an array (copies of its elements, or other values)
        if (target.is_array()) {
          const int n = 1 + pick(pick(5) == 0 ? 300 : 3);
          for (int i = 0; i < n; ++i)
            target.push_back(!target.empty() && pick(2) ? json(target[0]) : random_value(1));
        }
        break;
      default:  // wrap
        target = pick(2) ? json::array({target}) : json{{"value", target}};
        break;
    }
  }

  std::string break_bytes(std::string s) {
    switch (pick(4)) {
      case 0: return s.substr(0, static_cast<size_t>(pick(static_cast<int>(s.size()))));
      case 1:
        s.insert(static_cast<size_t>(pick(static_cast<int>(s.size()) + 1)), 1, static_cast<char>(pick(256)));
        return s;
      case 2:
        if (!s.empty()) s[static_cast<size_t>(pick(static_cast<int>(s.size())))] = static_cast<char>(0x80 + pick(128));
        return s;
      default: return s + s;
    }
  }

  std::mt19937_64 rng_;
};

json server_state(int port) {
  const auto r = http_request(port, "GET", "/get_server_info");
  EXPECT_EQ(r.status, 200) << r.body;
  return json::parse(r.body)["internal_states"][0];
}

const char* kReference = R"({"text": "Reference request:", "sampling_params": {"max_new_tokens": 8,
  "temperature": 0, "ignore_eos": true}})";

TEST(ServerFuzz, MutatedRequestsGetAnAnswerAndLeaveNoTrace) {
  ASSERT_TRUE(have_deepseek_tokenizer())
      << "the DeepSeek-V3 tokenizer is missing at " << deepseek_tokenizer_dir() << ": run scripts/setup.sh";
  ServerProcess server({"--tool-call-parser", "deepseekv3", "--reasoning-parser", "deepseek-r1",
                        "--chunked-prefill-size", "64", "--max-body-bytes", "2000000", "--enable-return-hidden-states",
                        "--enable-return-routed-experts"});
  ASSERT_TRUE(server.running()) << server.log();
  const int port = server.port();

  const auto before = http_request(port, "POST", "/generate", kReference);
  ASSERT_EQ(before.status, 200) << before.body;
  for (const Seed& s : kSeeds) {
    const auto r = http_request(port, "POST", s.path, s.body);
    EXPECT_EQ(r.status, 200) << s.path << " " << s.body << " -> " << r.body;
  }

  // MLASERVE_FUZZ_SEED / MLASERVE_FUZZ_REQUESTS (per connection) explore further than CI's fixed run.
  const char* seed_env = std::getenv("MLASERVE_FUZZ_SEED");
  const char* count_env = std::getenv("MLASERVE_FUZZ_REQUESTS");
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : 1000;
  const int kThreads = 4, kPerThread = count_env ? std::atoi(count_env) : 300;
  std::mutex mu;
  std::map<int, int> statuses;
  std::atomic<int> timeouts{0}, failures{0};
  // The mutator makes and writes values nested 3,000 deep by recursion: its threads get the server handlers' stack
  // (a sanitizer build's frames overflowed the default 8 MiB).
  std::vector<Thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back(kInputStackBytes, [&, t] {
      Mutator m(seed + t);
      std::mt19937 pick(static_cast<uint32_t>(seed + t));
      for (int i = 0; i < kPerThread && failures < 20; ++i) {
        const Seed& s = kSeeds[pick() % std::size(kSeeds)];
        const std::string body = m.mutate(s.body);
        auto fail = [&](const std::string& why) {
          ++failures;
          ADD_FAILURE() << why << "\n  " << s.path << " " << body.substr(0, 4000);
        };
        HttpResponse r;
        try {
          HttpConnection c(port, 30);
          c.set_deadline(6);  // a request mutated into a long generation: leave it (the server aborts it)
          c.send_request("POST", s.path, body);
          r = c.read_response();
        } catch (const std::exception& e) {
          if (std::string(e.what()) == "read timed out") {
            ++timeouts;
            continue;
          }
          fail(std::string("no answer: ") + e.what());
          continue;
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          ++statuses[r.status];
        }
        if (r.status >= 400 && r.status < 500) {
          const json j = json::parse(r.body, nullptr, false);
          if (!j.is_object() || !j.contains("error") || !j["error"].is_object() || !j["error"].contains("message") ||
              !j["error"]["message"].is_string() || j["error"]["message"].get<std::string>().empty())
            fail("HTTP " + std::to_string(r.status) + " without an error object: " + r.body.substr(0, 300));
        } else if (r.status == 200) {
          const auto ct = r.headers.find("content-type");
          if (ct != r.headers.end() && ct->second.find("text/event-stream") != std::string::npos) {
            for (const std::string& ev : sse_payloads(r.body))
              if (ev != "[DONE]" && json::parse(ev, nullptr, false).is_discarded())
                fail("an event that is not JSON: " + ev.substr(0, 300));
          } else if ((ct == r.headers.end() || ct->second.find("application/json") != std::string::npos) &&
                     json::parse(r.body, nullptr, false).is_discarded()) {  // (SGLang's text answers: not JSON)
            fail("a 200 whose body is not JSON: " + r.body.substr(0, 300));
          }
        } else {
          fail("HTTP " + std::to_string(r.status) + ": " + r.body.substr(0, 300));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  std::string summary;
  for (const auto& [status, n] : statuses) summary += fmt::format(" {}: {}", status, n);
  std::printf("statuses:%s, timed out: %d\n", summary.c_str(), timeouts.load());
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(statuses[200], kThreads * kPerThread / 20) << "too few mutated requests were valid to exercise much";
  EXPECT_GT(statuses[400], kThreads * kPerThread / 4);

  // A batch of mutated chat requests (those still JSON objects; not streamed, at most 32 tokens): it completes, and
  // every line is answered once, a 200 into the output file or a 4xx with an error object into the error file.
  {
    Mutator m(seed + 99);
    std::string jsonl;
    int lines = 0;
    on_input_stack([&] {  // the mutator's recursion, as above
      for (int i = 0; lines < 60 && i < 1000; ++i) {
        const Seed& s = kSeeds[static_cast<size_t>(i) % std::size(kSeeds)];
        if (std::string(s.path) != "/v1/chat/completions") continue;
        const std::string text = m.mutate(s.body);
        if (text.size() > 20000) continue;  // the deeply nested ones: this process would recurse through them
        json body = json::parse(text, nullptr, false);
        if (!body.is_object()) continue;
        body.erase("stream");
        for (const char* k : {"max_tokens", "max_completion_tokens"})
          if (body.contains(k) && body[k].is_number_integer() && body[k].get<int64_t>() > 32) body[k] = 32;
        if (!body.contains("max_tokens") && !body.contains("max_completion_tokens")) body["max_tokens"] = 16;
        jsonl += json({{"custom_id", "c" + std::to_string(lines++)}, {"method", "POST"},
                       {"url", "/v1/chat/completions"}, {"body", body}})
                     .dump(-1, ' ', false, json::error_handler_t::replace) +
                 "\n";
      }
    });
    const std::string b = "fuzzboundary";
    const std::string form = "--" + b + "\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--" + b +
                             "\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.jsonl\"\r\n\r\n" + jsonl +
                             "\r\n--" + b + "--\r\n";
    HttpConnection c(port);
    c.send_raw("POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=" + b +
               "\r\nContent-Length: " + std::to_string(form.size()) + "\r\n\r\n" + form);
    const HttpResponse up = c.read_response();
    ASSERT_EQ(up.status, 200) << up.body;
    const auto created = http_request(port, "POST", "/v1/batches", json({{"input_file_id", json::parse(up.body)["id"]},
        {"endpoint", "/v1/chat/completions"}, {"completion_window", "24h"}}).dump());
    ASSERT_EQ(created.status, 200) << created.body;
    json batch = json::parse(created.body);
    for (int k = 0; k < 1200 && batch["status"] == "in_progress"; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      batch = json::parse(http_request(port, "GET", "/v1/batches/" + batch["id"].get<std::string>()).body);
    }
    ASSERT_EQ(batch["status"], "completed") << batch.dump();
    const auto& counts = batch["request_counts"];
    std::printf("batch of mutated requests: %s\n", counts.dump().c_str());
    EXPECT_EQ(counts["total"], lines);
    EXPECT_EQ(counts["completed"].get<int>() + counts["failed"].get<int>(), lines) << batch.dump();
    std::set<std::string> answered;
    for (const char* key : {"output_file_id", "error_file_id"}) {
      if (batch[key].is_null()) continue;
      const std::string text =
          http_request(port, "GET", "/v1/files/" + batch[key].get<std::string>() + "/content").body;
      for (size_t at = 0, nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1) {
        const json line = json::parse(text.substr(at, nl - at));
        EXPECT_TRUE(answered.insert(line["custom_id"].get<std::string>()).second) << line.dump();
        const int status = line["response"]["status_code"];
        if (std::string(key) == "output_file_id") {
          EXPECT_EQ(status, 200);
        } else {
          EXPECT_TRUE(status >= 400 && status < 500) << line.dump();
          EXPECT_TRUE(line["response"]["body"]["error"]["message"].is_string()) << line.dump();
        }
      }
    }
    EXPECT_EQ(answered.size(), static_cast<size_t>(lines));
  }

  // Background responses (no client holds them) may still generate: aborted, as an operator would.
  EXPECT_EQ(http_request(port, "POST", "/abort_request", R"({"abort_all": true})").status, 200);
  // Nothing runs or waits, and only the prefix cache holds pages (the last aborts may land a step later).
  json st;
  for (int k = 0; k < 600; ++k) {
    st = server_state(port);
    if (st["num_running_reqs"] == 0 && st["num_queue_reqs"] == 0 &&
        st["kv_tokens_free"].get<int64_t>() ==
            st["kv_tokens_total"].get<int64_t>() - st["kv_tokens_cached"].get<int64_t>())
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(st["num_running_reqs"], 0) << st.dump();
  EXPECT_EQ(st["num_queue_reqs"], 0) << st.dump();
  EXPECT_EQ(st["kv_tokens_free"].get<int64_t>(),
            st["kv_tokens_total"].get<int64_t>() - st["kv_tokens_cached"].get<int64_t>())
      << st.dump();
  EXPECT_EQ(http_request(port, "POST", "/flush_cache").status, 200);
  st = server_state(port);
  EXPECT_EQ(st["kv_tokens_free"], st["kv_tokens_total"]) << st.dump();
  EXPECT_EQ(http_request(port, "GET", "/health").status, 200);
  EXPECT_EQ(http_request(port, "GET", "/health_generate").status, 200);

  const auto after = http_request(port, "POST", "/generate", kReference);
  ASSERT_EQ(after.status, 200) << after.body;
  EXPECT_EQ(json::parse(after.body)["output_ids"], json::parse(before.body)["output_ids"]);
  EXPECT_EQ(server.stop(), 0) << server.log();
}

}  // namespace
}  // namespace mlaserve::test
