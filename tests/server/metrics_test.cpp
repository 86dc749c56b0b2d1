#include "server/metrics.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace mlaserve::server
