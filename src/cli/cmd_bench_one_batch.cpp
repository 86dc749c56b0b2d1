// mlaserve bench-one-batch: latency and throughput of one static batch, offline (no scheduler, no HTTP).
// B sequences of I random prompt tokens are prefilled (in steps of at most --max-prefill-tokens tokens, whole
// sequences per step), then decoded greedily for O - 1 more steps (the prefill yields the first output token), with
// sampling on the backend and only the sampled ids copied back. A warm-up pass (prefill + 2 decode steps) runs
// first so one-time costs (GEMM heuristics, first launches) stay out of the numbers.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <numeric>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/command.h"
#include "cli/model_args.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/page_pool.h"
#include "engine/rank_set.h"
#include "model/kv_cache.h"

namespace mlaserve::cli {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct RunResult {
  double prefill_s = 0.0;
  std::vector<double> decode_s;  // per decode step
  std::vector<int32_t> last_ids;
};

// Runs the static batch on every rank of the layout: sequence j lives in DP group j % groups with pages from that
// group's pool; prefill steps take whole sequences up to the token budget per group; decode steps one token each.
class BatchRunner {
 public:
  BatchRunner(RankSet& ranks, int32_t page_size, std::vector<std::vector<int32_t>> prompts,
              std::vector<std::vector<int32_t>> pages, int32_t max_prefill_tokens)
      : ranks_(ranks), ps_(page_size), prompts_(std::move(prompts)), pages_(std::move(pages)),
        max_prefill_(max_prefill_tokens) {}

  RunResult run(int32_t output_len, MlaForm form) {
    const size_t B = prompts_.size();
    const size_t G = static_cast<size_t>(ranks_.dp_groups());
    RunResult r;
    std::vector<int32_t> next(B, 0);
    const auto t0 = Clock::now();
    std::vector<size_t> cursor(G);
    for (size_t g = 0; g < G; ++g) cursor[g] = g;
    for (;;) {
      std::vector<std::vector<size_t>> members(G);
      std::vector<ForwardBatch> batches(G);
      bool any = false;
      for (size_t g = 0; g < G; ++g) {
        ForwardBatchBuilder bb(ps_);
        size_t tokens = 0;
        while (cursor[g] < B && (members[g].empty() || tokens + prompts_[cursor[g]].size() <= static_cast<size_t>(max_prefill_))) {
          bb.add(prompts_[cursor[g]], 0, pages_[cursor[g]], false);
          tokens += prompts_[cursor[g]].size();
          members[g].push_back(cursor[g]);
          cursor[g] += G;
        }
        batches[g] = bb.finish();
        any |= !members[g].empty();
      }
      if (!any) break;
      step(batches, members, next, form);
    }
    r.prefill_s = seconds_since(t0);
    std::vector<int32_t> len(B);
    for (size_t j = 0; j < B; ++j) len[j] = static_cast<int32_t>(prompts_[j].size());
    for (int32_t s = 0; s + 1 < output_len; ++s) {
      const auto ts = Clock::now();
      std::vector<std::vector<size_t>> members(G);
      std::vector<ForwardBatch> batches(G);
      for (size_t g = 0; g < G; ++g) {
        ForwardBatchBuilder bb(ps_);
        for (size_t j = g; j < B; j += G) {
          bb.add(std::span<const int32_t>(&next[j], 1), len[j]++, pages_[j], false);
          members[g].push_back(j);
        }
        batches[g] = bb.finish();
      }
      step(batches, members, next, form);
      r.decode_s.push_back(seconds_since(ts));
    }
    r.last_ids = next;
    return r;
  }

 private:
  // One step; greedy ids sampled on the devices (only the ids come back) into next[].
  void step(const std::vector<ForwardBatch>& batches, const std::vector<std::vector<size_t>>& members,
            std::vector<int32_t>& next, MlaForm form) {
    std::vector<const ForwardBatch*> ptrs;
    std::vector<std::vector<RowSampling>> greedy;
    for (size_t g = 0; g < batches.size(); ++g) {
      ptrs.push_back(members[g].empty() ? nullptr : &batches[g]);
      greedy.emplace_back(members[g].size());
    }
    std::vector<GroupOutput> outs = ranks_.step(ptrs, greedy, LogitRows{}, form);
    for (size_t g = 0; g < batches.size(); ++g)
      for (size_t i = 0; i < members[g].size(); ++i) next[members[g][i]] = outs[g].ids[i];
  }

  RankSet& ranks_;
  int32_t ps_;
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<std::vector<int32_t>> pages_;
  int32_t max_prefill_;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

const RegisterCommand reg("bench-one-batch", "prefill and decode latency / throughput of one static batch",
                          [](CLI::App& app) {
  auto args = std::make_shared<ModelArgs>();
  auto batch = std::make_shared<int32_t>(1);
  auto in_len = std::make_shared<int32_t>(128);
  auto out_len = std::make_shared<int32_t>(16);
  auto max_prefill = std::make_shared<int32_t>(16384);
  auto warmup = std::make_shared<bool>(true);
  auto input_seed = std::make_shared<uint64_t>(1);
  auto recorder = std::make_shared<std::string>();
  auto routes = std::make_shared<bool>(false);
  args->add_to(app);
  app.add_flag("--enable-return-routed-experts", *routes,
               "every step keeps its routed experts, as serve does for return_routed_experts (their cost)");
  app.add_option("--expert-distribution-recorder-mode", *recorder,
                 "stat: count the routed experts during the run (as serve records them), and print their sums");
  app.add_option("--batch-size", *batch, "sequences in the batch")->capture_default_str();
  app.add_option("--input-len", *in_len, "prompt tokens per sequence")->capture_default_str();
  app.add_option("--output-len", *out_len, "generated tokens per sequence (the first comes from the prefill)")
      ->capture_default_str();
  app.add_option("--max-prefill-tokens", *max_prefill, "most prompt tokens in one prefill step (whole sequences)")
      ->capture_default_str();
  app.add_option("--warmup", *warmup, "run a warm-up pass first")->capture_default_str();
  app.add_option("--input-seed", *input_seed, "seed of the random prompt ids")->capture_default_str();
  return [=]() -> int {
    MLA_CHECK(*batch > 0 && *in_len > 0 && *out_len > 0, "--batch-size, --input-len and --output-len must be positive");
    MLA_CHECK(*max_prefill > 0, "--max-prefill-tokens must be positive");
    args->validate();
    const ModelConfig cfg = ModelConfig::from_file(args->model_path);
    MLA_CHECK(args->enable_dp_attention || args->dp == 1, "bench-one-batch runs one replica: --dp needs --enable-dp-attention");
    MLA_CHECK(args->nnodes == 1, "bench-one-batch runs on one node");
    MLA_CHECK(recorder->empty() || *recorder == "stat" || *recorder == "stat_approx",
              "--expert-distribution-recorder-mode: '{}' (stat or stat_approx)", *recorder);
    ParallelConfig pc = args->parallel_config();
    pc.count_experts = !recorder->empty();
    pc.capture_routes = *routes;
    RankSet ranks(cfg, pc, args->model_path, args->load_options());
    const int32_t ps = args->page_size;
    const int32_t pages_per_seq = (*in_len + *out_len + ps - 1) / ps;
    const int32_t groups = ranks.dp_groups();
    const int32_t total_pages = (*batch + groups - 1) / groups * pages_per_seq;  // per group
    ranks.allocate_kv(total_pages, ps);
    std::vector<std::unique_ptr<PagePool>> pools;
    for (int32_t g = 0; g < groups; ++g) pools.push_back(std::make_unique<PagePool>(total_pages));
    std::vector<std::vector<int32_t>> pages, prompts;
    std::mt19937_64 rng(*input_seed);
    std::uniform_int_distribution<int32_t> tok(2, static_cast<int32_t>(cfg.vocab_size - 1));
    for (int32_t j = 0; j < *batch; ++j) {
      pages.push_back(*pools[static_cast<size_t>(j % groups)]->alloc(pages_per_seq));
      std::vector<int32_t> p(static_cast<size_t>(*in_len));
      for (auto& t : p) t = tok(rng);
      prompts.push_back(std::move(p));
    }
    BatchRunner runner(ranks, ps, prompts, pages, *max_prefill);
    if (*warmup) runner.run(std::min(*out_len, 3), args->form());
    if (pc.count_experts) ranks.reset_expert_counts();
    const RunResult r = runner.run(*out_len, args->form());
    if (pc.count_experts) {
      // Every MoE layer routed each forwarded token (the prompts and every new token but the last) to k experts.
      const std::vector<int64_t> counts = ranks.expert_counts();
      const int64_t E = cfg.n_routed_experts;
      std::vector<int64_t> sums;
      for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
        if (cfg.is_moe_layer(l))
          sums.push_back(std::accumulate(counts.begin() + l * E, counts.begin() + (l + 1) * E, int64_t{0}));
      fmt::print("  experts: routed pairs per MoE layer {} (expected {} each)\n", fmt::join(sums, " "),
                 static_cast<int64_t>(*batch) * (*in_len + *out_len - 1) * cfg.num_experts_per_tok);
    }

    const double prefill_tokens = static_cast<double>(*batch) * *in_len;
    const double dec_med = median(r.decode_s);
    double dec_sum = 0.0;
    for (double d : r.decode_s) dec_sum += d;
    const double dec_tokens = static_cast<double>(*batch) * r.decode_s.size();
    const std::string layout = fmt::format("{} x{}{}", ranks.backend(0).name(), args->tp,
                                           groups > 1 ? fmt::format(" (DP attention, {} groups)", groups) : "");
    fmt::print("bench-one-batch: {} on {}, batch {}, input {}, output {}, page size {}\n", cfg.arch_name, layout,
               *batch, *in_len, *out_len, ps);
    fmt::print("  prefill: {:>10.2f} ms   {:>10.0f} tok/s   ({} tokens)\n", r.prefill_s * 1e3,
               prefill_tokens / r.prefill_s, static_cast<int64_t>(prefill_tokens));
    if (!r.decode_s.empty()) {
      fmt::print("  decode:  {:>10.3f} ms/step (median of {}, mean {:.3f})   {:>10.0f} tok/s (median)   {:.0f} tok/s (mean)\n",
                 dec_med * 1e3, r.decode_s.size(), dec_sum / r.decode_s.size() * 1e3, *batch / dec_med,
                 dec_tokens / dec_sum);
    }
    const double total_s = r.prefill_s + dec_sum;
    fmt::print("  total:   {:>10.2f} ms   {:>10.0f} tok/s (prompt + generated)\n", total_s * 1e3,
               (prefill_tokens + dec_tokens + *batch) / total_s);
    fmt::print("{{\"arch\": \"{}\", \"device\": \"{}\", \"batch_size\": {}, \"input_len\": {}, \"output_len\": {}, "
               "\"prefill_ms\": {:.3f}, \"prefill_tok_s\": {:.1f}, \"decode_median_ms\": {:.4f}, "
               "\"decode_tok_s\": {:.1f}, \"first_ids\": [{}]}}\n",
               cfg.arch_name, layout, *batch, *in_len, *out_len, r.prefill_s * 1e3,
               prefill_tokens / r.prefill_s, dec_med * 1e3, dec_med > 0 ? *batch / dec_med : 0.0,
               fmt::join(r.last_ids.begin(), r.last_ids.begin() + std::min<size_t>(4, r.last_ids.size()), ", "));
    return 0;
  };
});

}  // namespace
}  // namespace mlaserve::cli
