// mlaserve bench-serving: SGLang bench_serving's flags and report against a running server.
#include "cli/command.h"
#include "core/error.h"
#include "server/bench_serving.h"

namespace mlaserve::cli {
namespace {

const RegisterCommand reg("bench-serving", "benchmark a running server (drop-in for SGLang's bench_serving)",
                          [](CLI::App& app) {
  auto a = std::make_shared<bench::BenchArgs>();
  auto rate = std::make_shared<std::string>("inf");
  app.add_option("--backend", a->backend, "sglang | sglang-native | sglang-oai | sglang-oai-chat")
      ->capture_default_str();
  app.add_option("--host", a->host, "server host")->capture_default_str();
  app.add_option("--port", a->port, "server port")->capture_default_str();
  app.add_option("--base-url", a->base_url, "server URL (overrides --host/--port)");
  app.add_option("--model", a->model, "model name for OpenAI requests (default: the server's)");
  app.add_option("--tokenizer", a->tokenizer, "tokenizer directory (default: the server's tokenizer_path)");
  app.add_option("--dataset-name", a->dataset_name, "random | random-ids | sharegpt | generated-shared-prefix")
      ->capture_default_str();
  app.add_option("--dataset-path", a->dataset_path, "ShareGPT JSON (sharegpt; optional text source for random)");
  app.add_option("--num-prompts", a->num_prompts, "requests to send")->capture_default_str();
  app.add_option("--random-input,--random-input-len", a->random_input, "random: max input tokens")
      ->capture_default_str();
  app.add_option("--random-output,--random-output-len", a->random_output, "random: max output tokens")
      ->capture_default_str();
  app.add_option("--random-range-ratio", a->random_range_ratio, "random: lengths drawn from [len*ratio, len]")
      ->capture_default_str();
  app.add_option("--sharegpt-output-len", a->sharegpt_output_len, "sharegpt: fixed output length");
  app.add_option("--gsp-num-groups", a->gsp_num_groups, "generated-shared-prefix: system prompts")
      ->capture_default_str();
  app.add_option("--gsp-prompts-per-group", a->gsp_prompts_per_group, "generated-shared-prefix: prompts per system "
                 "prompt (--num-prompts is not used)")->capture_default_str();
  app.add_option("--gsp-system-prompt-len", a->gsp_system_prompt_len, "generated-shared-prefix: system prompt tokens")
      ->capture_default_str();
  app.add_option("--gsp-question-len", a->gsp_question_len, "generated-shared-prefix: question tokens")
      ->capture_default_str();
  app.add_option("--gsp-output-len", a->gsp_output_len, "generated-shared-prefix: output tokens")
      ->capture_default_str();
  app.add_option("--request-rate", *rate, "requests per second, Poisson arrivals (inf: all at once)")
      ->capture_default_str();
  app.add_option("--max-concurrency", a->max_concurrency, "cap on requests in flight (0: none)");
  app.add_option("--seed", a->seed, "seed of the dataset and arrivals")->capture_default_str();
  app.add_option("--output-file", a->output_file, "append the results as one JSON line");
  app.add_flag("--output-details", a->output_details, "per-request arrays in the output file");
  app.add_flag("--disable-stream", a->disable_stream, "non-streaming requests");
  app.add_flag("--disable-ignore-eos", a->disable_ignore_eos, "let requests stop at EOS");
  app.add_flag("--disable-tqdm", a->disable_tqdm, "no progress bar");
  app.add_option("--warmup-requests", a->warmup_requests, "warm-up requests before the run")->capture_default_str();
  app.add_option("--extra-request-body", a->extra_request_body, "JSON object merged into every request body");
  app.add_option("--num-client-threads", a->num_threads, "client io threads")->capture_default_str();
  return [a, rate]() -> int {
    if (*rate == "inf" || *rate == "Inf" || *rate == "INF") {
      a->request_rate = std::numeric_limits<double>::infinity();
    } else {
      size_t pos = 0;
      try {
        a->request_rate = std::stod(*rate, &pos);
      } catch (const std::exception&) {
        pos = 0;
      }
      MLA_CHECK(pos == rate->size() && pos > 0, "--request-rate: expected a number or inf, got '{}'", *rate);
    }
    return bench::run_bench_serving(*a);
  };
});

}  // namespace
}  // namespace mlaserve::cli
