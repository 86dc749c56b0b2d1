#include "server/metrics.h"

#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <sstream>

namespace mlaserve::server {
namespace {

TEST(Metrics, HistogramIsCumulative) {
  Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.5);
  h.observe(0.5);
  h.observe(7.0);
  std::string out;
  h.render(out, "x", "help");
  EXPECT_NE(out.find("# TYPE x histogram"), std::string::npos);
  EXPECT_NE(out.find("x_bucket{le=\"0.1\"} 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"1\"} 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"+Inf\"} 4\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_count 4\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_sum 8.05\n"), std::string::npos) << out;
}

TEST(Metrics, RenderSumsRanks) {
  ServerMetrics m;
  RankStats a, b;
  a.kv_tokens_total = b.kv_tokens_total = 100;
  a.kv_tokens_free = 50;
  b.kv_tokens_free = 100;
  a.num_running_reqs = 2;
  b.num_queue_reqs = 3;
  a.prompt_tokens_total = 10;
  a.cached_prompt_tokens_total = 5;
  a.generation_tokens_total = 7;
  std::string out = m.render({a, b});
  for (const char* line : {"mlaserve:num_running_reqs 2\n", "mlaserve:num_queue_reqs 3\n",
                           "mlaserve:token_usage 0.25\n", "mlaserve:cache_hit_rate 0.5\n",
                           "mlaserve:prompt_tokens_total 10\n", "mlaserve:generation_tokens_total 7\n",
                           "mlaserve:time_to_first_token_seconds_count 0\n",
                           "mlaserve:inter_token_latency_seconds_count 0\n",
                           "mlaserve:e2e_request_latency_seconds_count 0\n"})
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
}

// SGLang's and vLLM's names for the same quantities, labelled with the model's name (escaped): every sample line is
// well formed and every metric has one TYPE line.
TEST(Metrics, SglangAndVllmNames) {
  ServerMetrics m;
  m.ttft_seconds.observe(0.02);
  m.inter_token_latency_seconds.observe(0.01);
  m.request_finished(FinishKind::Stop, 7, 3);
  m.request_finished(FinishKind::Length, 30, 16);
  m.request_finished(FinishKind::Stop, 5, 1);
  RankStats a;
  a.kv_tokens_total = 200;
  a.kv_tokens_free = 100;
  a.kv_tokens_cached = 50;
  a.num_running_reqs = 3;
  a.num_queue_reqs = 4;
  a.prompt_tokens_total = 40;
  a.cached_prompt_tokens_total = 10;
  a.num_retractions = 2;
  a.spec_accepted_tokens = 6;
  const std::string out = m.render({a}, "org/model \"x\"");
  const std::string l = "{model_name=\"org/model \\\"x\\\"\"}";
  for (const std::string& line : std::vector<std::string>{"sglang:num_running_reqs" + l + " 3\n", "sglang:num_queue_reqs" + l + " 4\n",
        "sglang:token_usage" + l + " 0.25\n", "sglang:cache_hit_rate" + l + " 0.25\n",
        "sglang:cached_tokens_total" + l + " 10\n", "vllm:num_requests_running" + l + " 3\n",
        "vllm:num_requests_waiting" + l + " 4\n", "vllm:kv_cache_usage_perc" + l + " 0.25\n",
        "vllm:num_preemptions_total" + l + " 2\n", "vllm:prefix_cache_hits_total" + l + " 10\n",
        "vllm:spec_decode_num_accepted_tokens_total" + l + " 6\n",
        "vllm:time_to_first_token_seconds_count" + l + " 1\n",
        "vllm:time_per_output_token_seconds_count" + l + " 1\n", "vllm:request_prompt_tokens_sum" + l + " 42\n",
        "vllm:request_generation_tokens_count" + l + " 3\n",
        "vllm:request_success_total{model_name=\"org/model \\\"x\\\"\",finished_reason=\"stop\"} 2\n",
        "vllm:request_success_total{model_name=\"org/model \\\"x\\\"\",finished_reason=\"length\"} 1\n",
        std::string("sglang:time_to_first_token_seconds_bucket{model_name=\"org/model \\\"x\\\"\",le=\"0.02\"} 1\n")})
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
  const std::regex sample(R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]+="([^"\\]|\\.)*",?)*\})? [-+0-9.eE]+$)");
  std::set<std::string> typed;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# TYPE ", 0) == 0) {
      const std::string name = line.substr(7, line.find(' ', 7) - 7);
      EXPECT_TRUE(typed.insert(name).second) << "two TYPE lines for " << name;
    } else if (line.rfind("# HELP ", 0) != 0) {
      EXPECT_TRUE(std::regex_match(line, sample)) << line;
    }
  }
  EXPECT_GT(typed.size(), 40u);
}

}  // namespace
}  // namespace mlaserve::server
