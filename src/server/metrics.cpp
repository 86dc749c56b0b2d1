#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace mlaserve::server {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  std::lock_guard lk(mu_);
  ++counts_[i];
  sum_ += v;
  ++total_;
}

uint64_t Histogram::count() const {
  std::lock_guard lk(mu_);
  return total_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help,
                       const std::string& labels) const {
  std::lock_guard lk(mu_);
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  const std::string pre = labels.empty() ? "" : labels + ",";
  const std::string own = labels.empty() ? "" : "{" + labels + "}";
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += fmt::format("{}_bucket{{{}le=\"{}\"}} {}\n", name, pre, bounds_[i], cum);
  }
  cum += counts_.back();
  out += fmt::format("{}_bucket{{{}le=\"+Inf\"}} {}\n{}_sum{} {}\n{}_count{} {}\n", name, pre, cum, name, own, sum_,
                     name, own, total_);
}

namespace {
// A Prometheus label value: backslash, double quote and newline escaped.
std::string label_value(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}
}  // namespace

ServerMetrics::ServerMetrics()
    : ttft_seconds({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0,
                    20.0, 30.0, 60.0}),
      inter_token_latency_seconds({0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
                                   0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0}),
      e2e_latency_seconds({0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0}),
      request_prompt_tokens({1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000}),
      request_generation_tokens({1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000}),
      kv_transfer_seconds({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0}) {}

void ServerMetrics::request_finished(FinishKind kind, int64_t prompt_tokens, int64_t generation_tokens) {
  request_prompt_tokens.observe(static_cast<double>(prompt_tokens));
  request_generation_tokens.observe(static_cast<double>(generation_tokens));
  (kind == FinishKind::Stop ? finished_stop_total : kind == FinishKind::Length ? finished_length_total
                                                                               : finished_abort_total)++;
}

std::string ServerMetrics::render(const std::vector<RankStats>& ranks, const std::string& model_name) const {
  RankStats sum;
  for (const auto& r : ranks) {
    sum.kv_tokens_total += r.kv_tokens_total;
    sum.kv_tokens_free += r.kv_tokens_free;
    sum.kv_tokens_cached += r.kv_tokens_cached;
    sum.kv_host_tokens_total += r.kv_host_tokens_total;
    sum.kv_host_tokens_cached += r.kv_host_tokens_cached;
    sum.host_loaded_tokens_total += r.host_loaded_tokens_total;
    sum.num_running_reqs += r.num_running_reqs;
    sum.num_queue_reqs += r.num_queue_reqs;
    sum.prompt_tokens_total += r.prompt_tokens_total;
    sum.generation_tokens_total += r.generation_tokens_total;
    sum.cached_prompt_tokens_total += r.cached_prompt_tokens_total;
    sum.num_requests_finished += r.num_requests_finished;
    sum.num_retractions += r.num_retractions;
    sum.forward_steps += r.forward_steps;
    sum.overlapped_steps += r.overlapped_steps;
    sum.spec_draft_tokens += r.spec_draft_tokens;
    sum.spec_accepted_tokens += r.spec_accepted_tokens;
  }
  std::string out;
  auto gauge = [&](const char* name, const char* help, auto value) {
    out += fmt::format("# HELP mlaserve:{} {}\n# TYPE mlaserve:{} gauge\nmlaserve:{} {}\n", name, help, name, name,
                       value);
  };
  auto counter = [&](const char* name, const char* help, auto value) {
    out += fmt::format("# HELP mlaserve:{} {}\n# TYPE mlaserve:{} counter\nmlaserve:{} {}\n", name, help, name, name,
                       value);
  };
  const int64_t used = sum.kv_tokens_total - sum.kv_tokens_free - sum.kv_tokens_cached;
  gauge("num_running_reqs", "Requests in the running batch.", sum.num_running_reqs);
  gauge("num_queue_reqs", "Requests waiting to be scheduled.", sum.num_queue_reqs);
  gauge("num_used_tokens", "KV-cache token slots held by requests.", used);
  gauge("num_cached_tokens", "KV-cache token slots held only by the prefix cache.", sum.kv_tokens_cached);
  gauge("max_total_num_tokens", "KV-cache token slots in all.", sum.kv_tokens_total);
  gauge("token_usage", "Fraction of KV-cache slots held by requests.",
        sum.kv_tokens_total > 0 ? static_cast<double>(used) / static_cast<double>(sum.kv_tokens_total) : 0.0);
  gauge("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens, since start.",
        sum.prompt_tokens_total > 0
            ? static_cast<double>(sum.cached_prompt_tokens_total) / static_cast<double>(sum.prompt_tokens_total)
            : 0.0);
  if (sum.kv_host_tokens_total > 0) {  // --enable-hierarchical-cache
    gauge("host_max_total_num_tokens", "Token slots of the hierarchical cache's host tier.", sum.kv_host_tokens_total);
    gauge("host_cached_tokens", "Host-tier token slots holding pages the prefix cache evicted from the device.",
          sum.kv_host_tokens_cached);
    counter("host_loaded_prompt_tokens_total", "Prompt tokens copied back from the host tier instead of computed.",
            sum.host_loaded_tokens_total);
  }
  gauge("open_connections", "Open HTTP connections.", open_connections.load());
  counter("prompt_tokens_total", "Prompt tokens processed.", sum.prompt_tokens_total);
  counter("generation_tokens_total", "Tokens generated.", sum.generation_tokens_total);
  counter("cached_prompt_tokens_total", "Prompt tokens served from the prefix cache.", sum.cached_prompt_tokens_total);
  counter("num_requests_total", "Engine requests finished.", sum.num_requests_finished);
  counter("num_retractions_total", "Requests retracted (preempted) for lack of KV-cache memory.", sum.num_retractions);
  counter("forward_steps_total", "Model forward steps.", sum.forward_steps);
  counter("overlapped_steps_total", "Forward steps launched before the previous one finished.", sum.overlapped_steps);
  counter("spec_decode_num_draft_tokens_total", "Speculative decoding: draft tokens checked.", sum.spec_draft_tokens);
  counter("spec_decode_num_accepted_tokens_total", "Speculative decoding: draft tokens kept.",
          sum.spec_accepted_tokens);
  counter("http_requests_total", "HTTP requests received.", http_requests_total.load());
  counter("generate_requests_total", "Generation requests submitted to the engine (n > 1 counts n).",
          generate_requests_total.load());
  counter("aborted_requests_total", "Generation requests aborted (client gone, timeout).", aborted_requests_total.load());
  counter("client_errors_total", "Requests answered with a 4xx status.", client_errors_total.load());
  if (kv_transfer_seconds.count() > 0 || kv_transfer_failed_total.load() > 0 ||
      kv_transfer_sent_bytes_total.load() > 0) {  // (a server of the disaggregation only)
    counter("kv_transfer_received_tokens_total", "Prompt tokens whose KV was read from a prefill server.",
            kv_transfer_received_tokens_total.load());
    counter("kv_transfer_received_bytes_total", "Bytes of KV read from prefill servers.",
            kv_transfer_received_bytes_total.load());
    counter("kv_transfer_failed_total", "Prompts whose KV read brought nothing (computed here instead).",
            kv_transfer_failed_total.load());
    counter("kv_transfer_sent_bytes_total", "Bytes of KV exported to decode servers.",
            kv_transfer_sent_bytes_total.load());
    kv_transfer_seconds.render(out, "mlaserve:kv_transfer_seconds",
                               "A prompt's KV read from a prefill server, seconds.");
  }
  // The three latency histograms under a family's prefix.
  auto histograms = [&](const std::string& prefix, const std::string& lab) {
    ttft_seconds.render(out, prefix + "time_to_first_token_seconds", "Time to first token, seconds.", lab);
    inter_token_latency_seconds.render(out, prefix + "inter_token_latency_seconds",
                                       "Time between consecutive output tokens, seconds.", lab);
    e2e_latency_seconds.render(out, prefix + "e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                               lab);
  };
  histograms("mlaserve:", "");

  // The same quantities under SGLang's and vLLM's names.
  const std::string labels = fmt::format("model_name=\"{}\"", label_value(model_name));
  auto named = [&](const char* type, const std::string& name, const char* help, auto value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{}{{{}}} {}\n", name, help, name, type, name, labels, value);
  };
  const double usage =
      sum.kv_tokens_total > 0 ? static_cast<double>(used) / static_cast<double>(sum.kv_tokens_total) : 0.0;
  named("gauge", "sglang:num_running_reqs", "The number of running requests.", sum.num_running_reqs);
  named("gauge", "sglang:num_queue_reqs", "The number of requests in the waiting queue.", sum.num_queue_reqs);
  named("gauge", "sglang:num_used_tokens", "The number of used tokens.", used);
  named("gauge", "sglang:token_usage", "The token usage.", usage);
  named("gauge", "sglang:cache_hit_rate", "The prefix cache hit rate.",
        sum.prompt_tokens_total > 0
            ? static_cast<double>(sum.cached_prompt_tokens_total) / static_cast<double>(sum.prompt_tokens_total)
            : 0.0);
  named("counter", "sglang:prompt_tokens_total", "Number of prefill tokens processed.", sum.prompt_tokens_total);
  named("counter", "sglang:generation_tokens_total", "Number of generation tokens processed.",
        sum.generation_tokens_total);
  named("counter", "sglang:cached_tokens_total", "Number of cached prompt tokens.", sum.cached_prompt_tokens_total);
  named("counter", "sglang:num_requests_total", "Number of requests processed.", sum.num_requests_finished);
  histograms("sglang:", labels);
  named("gauge", "vllm:num_requests_running", "Number of requests in model execution batches.",
        sum.num_running_reqs);
  named("gauge", "vllm:num_requests_waiting", "Number of requests waiting to be processed.", sum.num_queue_reqs);
  named("gauge", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage);
  named("gauge", "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage);
  named("counter", "vllm:prompt_tokens_total", "Number of prefill tokens processed.", sum.prompt_tokens_total);
  named("counter", "vllm:generation_tokens_total", "Number of generation tokens processed.",
        sum.generation_tokens_total);
  named("counter", "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
        sum.num_retractions);
  named("counter", "vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
        sum.prompt_tokens_total);
  named("counter", "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
        sum.cached_prompt_tokens_total);
  named("counter", "vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", sum.spec_draft_tokens);
  named("counter", "vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
        sum.spec_accepted_tokens);
  histograms("vllm:", labels);
  // vLLM's older name for the inter-token histogram (its dashboards still read it), its per-request token histograms
  // and finished requests by reason.
  inter_token_latency_seconds.render(out, "vllm:time_per_output_token_seconds", "Time per output token, seconds.",
                                     labels);
  request_prompt_tokens.render(out, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels);
  request_generation_tokens.render(out, "vllm:request_generation_tokens", "Number of generation tokens processed.",
                                   labels);
  out += "# HELP vllm:request_success_total Count of successfully processed requests.\n"
         "# TYPE vllm:request_success_total counter\n";
  for (const auto& [reason, n] : {std::pair{"stop", finished_stop_total.load()},
                                  std::pair{"length", finished_length_total.load()},
                                  std::pair{"abort", finished_abort_total.load()}})
    out += fmt::format("vllm:request_success_total{{{},finished_reason=\"{}\"}} {}\n", labels, reason, n);
  return out;
}

}  // namespace mlaserve::server
