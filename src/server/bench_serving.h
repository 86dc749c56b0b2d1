// bench-serving: a load generator for an SGLang-compatible server, a drop-in for SGLang's bench_serving.
// Requests go out on a few io threads over many connections (Beast), streamed responses are timed per chunk,
// and the metrics are computed as SGLang computes them (see compute_bench_metrics).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace mlaserve::bench {

struct BenchArgs {
  std::string backend = "sglang";  // sglang | sglang-native | sglang-oai | sglang-oai-chat
  std::string host = "127.0.0.1";
  int port = 30000;
  std::string base_url;            // overrides host/port (http://host:port[/prefix])
  std::string model;               // OpenAI "model"; default: the server's /v1/models
  std::string tokenizer;           // default: the server's /get_model_info tokenizer_path
  std::string dataset_name = "sharegpt";  // random | random-ids | sharegpt | generated-shared-prefix
  std::string dataset_path;
  int32_t num_prompts = 1000;
  int32_t random_input = 1024;
  int32_t random_output = 1024;
  double random_range_ratio = 0.0;
  int32_t sharegpt_output_len = 0;  // > 0: fixed output length for sharegpt
  // generated-shared-prefix: gsp_num_groups system prompts, each starting gsp_prompts_per_group prompts (its
  // system prompt, a blank line, a question of its own), shuffled; every request gsp_output_len new tokens.
  int32_t gsp_num_groups = 64;
  int32_t gsp_prompts_per_group = 16;
  int32_t gsp_system_prompt_len = 2048;
  int32_t gsp_question_len = 128;
  int32_t gsp_output_len = 256;
  double request_rate = std::numeric_limits<double>::infinity();
  int32_t max_concurrency = 0;      // 0: unlimited
  uint64_t seed = 1;
  std::string output_file;          // appends one JSON line per run
  bool output_details = false;      // per-request arrays in the output file
  bool disable_stream = false;
  bool disable_ignore_eos = false;
  bool disable_tqdm = false;
  int32_t warmup_requests = 1;
  std::string extra_request_body;   // JSON object merged into every request
  int num_threads = 0;  // 0: half the cores, 2 to 8 (a thousand streams of cumulative payloads need several)
};

// One request as measured by the client.
struct RequestResult {
  bool success = false;
  std::string error;
  double latency = 0.0;       // s, send to last byte
  double ttft = 0.0;          // s, send to first token
  std::vector<double> itl;    // s, per token after the first (a k-token chunk contributes k equal entries)
  int64_t prompt_len = 0;
  int64_t output_len = 0;
  std::string generated_text;
};

struct BenchMetrics {
  int64_t completed = 0;
  int64_t total_input = 0;
  int64_t total_output = 0;
  int64_t total_output_retokenized = 0;
  double duration = 0.0;
  double request_throughput = 0.0, input_throughput = 0.0, output_throughput = 0.0, total_throughput = 0.0;
  double concurrency = 0.0;  // sum of request latencies / duration
  double mean_e2e_ms = 0, median_e2e_ms = 0, std_e2e_ms = 0, p99_e2e_ms = 0;
  double mean_ttft_ms = 0, median_ttft_ms = 0, std_ttft_ms = 0, p99_ttft_ms = 0;
  double mean_tpot_ms = 0, median_tpot_ms = 0, std_tpot_ms = 0, p99_tpot_ms = 0;
  double mean_itl_ms = 0, median_itl_ms = 0, std_itl_ms = 0, p95_itl_ms = 0, p99_itl_ms = 0, max_itl_ms = 0;
};

// numpy.percentile (linear interpolation) of unsorted values; 0 for none.
double percentile(std::vector<double> v, double p);

// SGLang's definitions: successful requests only; TPOT = (latency - ttft) / (output_len - 1) for output_len > 1;
// ITL over all per-token gaps. `retokenized` gives the retokenized output length of each result (or -1).
BenchMetrics compute_bench_metrics(const std::vector<RequestResult>& results, double duration,
                                   const std::vector<int64_t>& retokenized);

// The result block, as SGLang prints it.
std::string format_bench_metrics(const BenchArgs& args, const BenchMetrics& m);

// Runs the benchmark; prints progress and the result block; returns a process exit code.
int run_bench_serving(const BenchArgs& args);

}  // namespace mlaserve::bench
