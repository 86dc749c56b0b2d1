// SGLang's return_routed_experts: each position's routed expert ids of every layer (dense layers 0), the rows
// return_hidden_states gives (the prompt's, then each generated token's but the last's). They are the model's own
// routing: a forward over the same tokens with its routing recorded chooses the same experts, with overlap on and off,
// in prefill chunks, with graphs, at tp 2 and with DP attention (each group's rows among the MoE's gathered rows), and
// with the shared experts fused into the routed ones (only the picks reported).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <future>

#include "engine/engine.h"
#include "engine/offline.h"
#include "gpu/forwarding_backend.h"
#include "test_util.h"

using namespace mlaserve;

namespace {

struct Out {
  std::vector<int32_t> tokens, routes;
  std::vector<float> hidden;
};

// fused: the shared experts fused into the routed ones (their fixed ids are not reported).
std::unique_ptr<RankSet> route_ranks(int32_t tp, int32_t dp, int32_t graph_max_bs, bool capture = true,
                                     bool fused = false) {
  LoadOptions lo;
  lo.shared_experts_fusion = fused ? LoadOptions::KeepQuantized::On : LoadOptions::KeepQuantized::Off;
  return test::cpu_ranks_at(test::golden_dir("v2"), tp, dp, graph_max_bs, false, false,
                            [capture](ParallelConfig& pc) { pc.capture_routes = capture; }, lo);
}

std::future<Out> submit(Engine& e, const std::string& rid, const std::vector<int32_t>& ids, int32_t n,
                        bool hidden = false) {
  SamplingParams sp;
  sp.temperature = 0.0f;
  sp.return_routed_experts = true;
  sp.return_hidden_states = hidden;
  GenerateRequest g = test::ids_request(rid, ids, n, -1, &sp);
  auto prom = std::make_shared<std::promise<Out>>();
  auto acc = std::make_shared<Out>();
  g.on_output = [prom, acc](const GenerateOutput& o) {
    acc->tokens.insert(acc->tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
    acc->routes.insert(acc->routes.end(), o.routed_experts.begin(), o.routed_experts.end());
    acc->hidden.insert(acc->hidden.end(), o.hidden_states.begin(), o.hidden_states.end());
    if (o.finished) prom->set_value(*acc);
  };
  e.submit(std::move(g));
  return prom->get_future();
}

// The routing a recorded forward over each of `seqs` chooses, as return_routed_experts lays it out per sequence.
std::vector<std::vector<int32_t>> reference_routes(const std::vector<std::vector<int32_t>>& seqs) {
  const std::string dir = test::golden_dir("v2");
  const ModelConfig cfg = ModelConfig::from_file(dir);
  test::RouteLog log;
  auto cpu = make_cpu_backend();
  test::RouteRecorder rec(*cpu, log);
  DeepseekModel m(cfg, rec);
  m.load(dir, LoadOptions{});
  OfflineOptions one_step;  // every sequence in one prefill step: one logged routing per MoE layer
  one_step.prompt_logits = false;
  run_offline(m, seqs, one_step);
  const int64_t L = cfg.num_hidden_layers, k = cfg.num_experts_per_tok;
  std::vector<std::vector<int32_t>> out;
  size_t row = 0;
  for (const auto& s : seqs) {
    std::vector<int32_t> r(s.size() * static_cast<size_t>(L * k), 0);
    for (size_t p = 0; p < s.size(); ++p)
      for (int64_t l = 0, mo = 0; l < L; ++l) {  // (the log's entries: the MoE layers in order)
        if (!cfg.is_moe_layer(l)) continue;
        for (int64_t j = 0; j < k; ++j)
          r[(p * static_cast<size_t>(L) + static_cast<size_t>(l)) * static_cast<size_t>(k) + static_cast<size_t>(j)] =
              log.ids[static_cast<size_t>(mo)][(row + p) * static_cast<size_t>(k) + static_cast<size_t>(j)];
        ++mo;
      }
    row += s.size();
    out.push_back(std::move(r));
  }
  EXPECT_EQ(log.ids.size(), static_cast<size_t>(L - cfg.first_k_dense_replace));
  return out;
}

TEST(RoutedExperts, AreTheModelsRoutingInEveryLayout) {
  const auto prompts = test::golden_prompts("v2");
  const ModelConfig cfg = ModelConfig::from_file(test::golden_dir("v2"));
  const size_t width = static_cast<size_t>(cfg.num_hidden_layers * cfg.num_experts_per_tok);
  struct Layout {
    int32_t tp, dp, graphs;
    bool overlap;
    int32_t chunk;
    bool fused = false;
  };
  for (const Layout& lay : {Layout{1, 1, 0, false, 8192}, Layout{1, 1, 0, true, 48}, Layout{1, 1, 8, true, 8192},
                            Layout{2, 1, 8, true, 8192}, Layout{2, 2, 8, true, 48}, Layout{1, 1, 8, true, 8192, true},
                            Layout{2, 2, 8, true, 48, true}}) {
    const std::string what = fmt::format("tp {} dp {} graphs {} overlap {} chunk {} fused {}", lay.tp, lay.dp,
                                         lay.graphs, lay.overlap, lay.chunk, lay.fused);
    EngineOptions o = test::small_engine_options(lay.overlap, 512);
    o.chunked_prefill_size = lay.chunk;
    Engine e(route_ranks(lay.tp, lay.dp, lay.graphs, true, lay.fused), o);
    std::vector<std::future<Out>> fs;
    // (three requests: decode batches of 3, or 2 and 1 over two groups, replay graphs padded to 4 or 2 rows)
    for (size_t j : {1, 2, 3}) fs.push_back(submit(e, fmt::format("r{}", j), prompts[j], 9, j == 2));
    std::vector<Out> outs;
    for (auto& f : fs) {
      ASSERT_EQ(f.wait_for(std::chrono::seconds(120)), std::future_status::ready) << what;
      outs.push_back(f.get());
    }
    test::expect_engine_idle_and_clean(e);
    std::vector<std::vector<int32_t>> seqs;
    for (size_t i = 0; i < outs.size(); ++i) {
      seqs.push_back(prompts[i + 1]);
      seqs.back().insert(seqs.back().end(), outs[i].tokens.begin(), outs[i].tokens.end() - 1);
    }
    const auto want = reference_routes(seqs);
    for (size_t i = 0; i < outs.size(); ++i) {
      ASSERT_EQ(outs[i].tokens.size(), 9u) << what;
      ASSERT_EQ(outs[i].routes.size(), seqs[i].size() * width) << what << " request " << i;
      EXPECT_EQ(outs[i].routes, want[i]) << what << " request " << i;
      EXPECT_EQ(outs[i].hidden.size(), i == 1 ? seqs[i].size() * static_cast<size_t>(cfg.hidden_size) : 0u) << what;
    }
  }
}

// A step none of whose requests returns hidden states (ForwardBatch::hidden_states false) brings back only its rows'
// routed experts: the same as with the hidden states, which stay on the device.
TEST(RoutedExperts, RoutesOnlyStepsLeaveTheHiddenStates) {
  const ModelConfig cfg = ModelConfig::from_file(test::golden_dir("v2"));
  auto ranks = route_ranks(1, 1, 0);
  ranks->allocate_kv(16, 8);
  const auto prompt = test::golden_prompts("v2")[1];
  const size_t n = prompt.size();
  std::vector<int32_t> pages;
  for (int32_t p = 0; p * 8 < static_cast<int32_t>(n); ++p) pages.push_back(p);
  std::vector<int32_t> routes_with;
  for (const bool hidden : {true, false}) {
    ForwardBatchBuilder bb(8);
    bb.add(prompt, 0, pages, false);
    bb.hidden_of_last();
    ForwardBatch b = bb.finish();
    b.hidden_states = hidden;
    const std::vector<GroupOutput> out = ranks->step({&b}, {std::vector<RowSampling>(1)}, LogitRows{});
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].hidden.size(), hidden ? n * static_cast<size_t>(cfg.hidden_size) : 0u);
    ASSERT_EQ(out[0].routes.size(), n * static_cast<size_t>(cfg.num_hidden_layers * cfg.num_experts_per_tok));
    if (hidden) routes_with = out[0].routes;
    else EXPECT_EQ(out[0].routes, routes_with);
  }
}

// Without --enable-return-routed-experts the engine refuses such a request (the server answers 400 before it).
TEST(RoutedExperts, RefusedWhenNotCaptured) {
  Engine e(route_ranks(1, 1, 0, /*capture=*/false), test::small_engine_options(false));
  EXPECT_THROW(submit(e, "r", test::golden_prompts("v2")[1], 2), Error);
}

}  // namespace
