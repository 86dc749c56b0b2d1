// Server-side metrics in Prometheus text format: latency histograms measured at the front end (TTFT, inter-token
// latency, end-to-end latency) plus the engine's counters and gauges (RankStats). Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine_api.h"

namespace mlaserve::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double v);
  // `name`_bucket{le=...}, `name`_sum, `name`_count lines (cumulative buckets, +Inf last). labels: more label pairs
  // before `le` (`model_name="x"`), or empty.
  void render(std::string& out, const std::string& name, const std::string& help,
              const std::string& labels = "") const;
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); last = +Inf
  double sum_ = 0.0;
  uint64_t total_ = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();
  Histogram ttft_seconds;
  Histogram inter_token_latency_seconds;
  Histogram e2e_latency_seconds;
  // Per finished request (each of n samples): its prompt and generated tokens, and how it finished.
  Histogram request_prompt_tokens;
  Histogram request_generation_tokens;
  std::atomic<int64_t> finished_stop_total{0}, finished_length_total{0}, finished_abort_total{0};
  void request_finished(FinishKind kind, int64_t prompt_tokens, int64_t generation_tokens);
  std::atomic<int64_t> http_requests_total{0};
  std::atomic<int64_t> generate_requests_total{0};  // engine requests submitted (n > 1 counts n)
  std::atomic<int64_t> aborted_requests_total{0};   // client gone, timeout, server-side abort
  std::atomic<int64_t> client_errors_total{0};      // 4xx answers
  std::atomic<int64_t> open_connections{0};
  // Prefill / decode disaggregation: a decode server's reads of its prompts' KV (each prompt's reads together, the
  // ones that brought rows), the rows received, the reads that brought none (the prompt computed); a prefill
  // server's exported rows.
  Histogram kv_transfer_seconds;
  std::atomic<int64_t> kv_transfer_received_tokens_total{0}, kv_transfer_received_bytes_total{0};
  std::atomic<int64_t> kv_transfer_failed_total{0}, kv_transfer_sent_bytes_total{0};

  // mlaserve's names, then SGLang's (`sglang:`) and vLLM's (`vllm:`) for what they also report, labelled with the
  // served model's name as theirs are, so their dashboards, autoscalers and routers read the server unchanged.
  std::string render(const std::vector<RankStats>& ranks, const std::string& model_name = "") const;
};

}  // namespace mlaserve::server
