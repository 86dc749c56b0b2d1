// bench-serving's metric arithmetic and report (no networking here).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "server/bench_serving.h"

namespace mlaserve::bench {
namespace {

double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

double stddev(const std::vector<double>& v) {  // numpy.std: population
  if (v.empty()) return 0.0;
  const double m = mean(v);
  double s = 0.0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

// Python's str() of a float for the "Traffic request rate" line: inf, 16.0, 0.5.
std::string py_float(double x) {
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (std::floor(x) == x && std::fabs(x) < 1e16) return fmt::format("{:.1f}", x);
  return fmt::format("{}", x);
}

}  // namespace

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

BenchMetrics compute_bench_metrics(const std::vector<RequestResult>& results, double duration,
                                   const std::vector<int64_t>& retokenized) {
  BenchMetrics m;
  m.duration = duration;
  std::vector<double> e2e, ttft, tpot, itl;
  for (size_t i = 0; i < results.size(); ++i) {
    const RequestResult& r = results[i];
    if (!r.success) continue;
    ++m.completed;
    m.total_input += r.prompt_len;
    m.total_output += r.output_len;
    m.total_output_retokenized += i < retokenized.size() && retokenized[i] >= 0 ? retokenized[i] : r.output_len;
    e2e.push_back(r.latency * 1000.0);
    ttft.push_back(r.ttft * 1000.0);
    if (r.output_len > 1) tpot.push_back((r.latency - r.ttft) / static_cast<double>(r.output_len - 1) * 1000.0);
    for (double x : r.itl) itl.push_back(x * 1000.0);
  }
  if (duration > 0) {
    m.request_throughput = static_cast<double>(m.completed) / duration;
    m.input_throughput = static_cast<double>(m.total_input) / duration;
    m.output_throughput = static_cast<double>(m.total_output) / duration;
    m.total_throughput = static_cast<double>(m.total_input + m.total_output) / duration;
    m.concurrency = std::accumulate(e2e.begin(), e2e.end(), 0.0) / 1000.0 / duration;
  }
  // mean, median, standard deviation and 99th percentile of one series
  auto summarize = [](const std::vector<double>& v, double& mean_ms, double& median_ms, double& std_ms, double& p99_ms) {
    mean_ms = mean(v);
    median_ms = percentile(v, 50);
    std_ms = stddev(v);
    p99_ms = percentile(v, 99);
  };
  summarize(e2e, m.mean_e2e_ms, m.median_e2e_ms, m.std_e2e_ms, m.p99_e2e_ms);
  summarize(ttft, m.mean_ttft_ms, m.median_ttft_ms, m.std_ttft_ms, m.p99_ttft_ms);
  summarize(tpot, m.mean_tpot_ms, m.median_tpot_ms, m.std_tpot_ms, m.p99_tpot_ms);
  summarize(itl, m.mean_itl_ms, m.median_itl_ms, m.std_itl_ms, m.p99_itl_ms);
  m.p95_itl_ms = percentile(itl, 95);
  m.max_itl_ms = itl.empty() ? 0.0 : *std::max_element(itl.begin(), itl.end());
  return m;
}

std::string format_bench_metrics(const BenchArgs& a, const BenchMetrics& m) {
  std::string o;
  auto title = [&](const std::string& s, char fill) {
    const size_t n = 50, pad = n > s.size() ? n - s.size() : 0;
    o += std::string(pad / 2, fill) + s + std::string(pad - pad / 2, fill) + "\n";
  };
  auto line = [&](const std::string& k, const std::string& v) { o += fmt::format("{:<40} {:<10}\n", k, v); };
  auto num = [&](const std::string& k, double v) { o += fmt::format("{:<40} {:<10.2f}\n", k, v); };
  o += "\n";
  title(" Serving Benchmark Result ", '=');
  line("Backend:", a.backend);
  line("Traffic request rate:", py_float(a.request_rate));
  line("Max request concurrency:", a.max_concurrency > 0 ? std::to_string(a.max_concurrency) : "not set");
  line("Successful requests:", std::to_string(m.completed));
  num("Benchmark duration (s):", m.duration);
  line("Total input tokens:", std::to_string(m.total_input));
  line("Total generated tokens:", std::to_string(m.total_output));
  line("Total generated tokens (retokenized):", std::to_string(m.total_output_retokenized));
  num("Request throughput (req/s):", m.request_throughput);
  num("Input token throughput (tok/s):", m.input_throughput);
  num("Output token throughput (tok/s):", m.output_throughput);
  num("Total token throughput (tok/s):", m.total_throughput);
  num("Concurrency:", m.concurrency);
  title("End-to-End Latency", '-');
  num("Mean E2E Latency (ms):", m.mean_e2e_ms);
  num("Median E2E Latency (ms):", m.median_e2e_ms);
  title("Time to First Token", '-');
  num("Mean TTFT (ms):", m.mean_ttft_ms);
  num("Median TTFT (ms):", m.median_ttft_ms);
  num("P99 TTFT (ms):", m.p99_ttft_ms);
  title("Time per Output Token (excl. 1st token)", '-');
  num("Mean TPOT (ms):", m.mean_tpot_ms);
  num("Median TPOT (ms):", m.median_tpot_ms);
  num("P99 TPOT (ms):", m.p99_tpot_ms);
  title("Inter-Token Latency", '-');
  num("Mean ITL (ms):", m.mean_itl_ms);
  num("Median ITL (ms):", m.median_itl_ms);
  num("P95 ITL (ms):", m.p95_itl_ms);
  num("P99 ITL (ms):", m.p99_itl_ms);
  num("Max ITL (ms):", m.max_itl_ms);
  o += std::string(50, '=') + "\n";
  return o;
}

}  // namespace mlaserve::bench
