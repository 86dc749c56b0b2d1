// The CUDA-graph path on CPU ranks: the backend records each decode size's forward as op closures once
// (GraphRecorder) and replays them on later steps, so the rank set's padding to recorded sizes, the dummy KV page,
// the DP-attention rule (every group pads to the largest group; idle groups replay padding only) and the model's
// recording run in CI. Greedy tokens and prompt logits must equal the eager run's exactly, in every layout.
#include <gtest/gtest.h>

#include <algorithm>

#include "backend/forwarding_backend.h"
#include "engine/offline.h"
#include "test_util.h"

using namespace mlaserve;

namespace {

struct Outcome {
  OfflineResult out;
  int64_t graph_steps = 0;
  std::vector<int32_t> sizes;
};

Outcome run(const std::string& fam, int tp, int dp, bool graphs, const std::vector<std::vector<int32_t>>& prompts) {
  auto rs = test::cpu_ranks(fam, tp, dp, graphs ? 4 : 0);
  RankSet& ranks = *rs;
  OfflineOptions o;
  o.max_new_tokens = 6;
  o.page_size = 8;
  Outcome r;
  r.out = run_offline(ranks, prompts, o);
  r.graph_steps = ranks.graph_steps();
  r.sizes = ranks.graph_batch_sizes();
  return r;
}

TEST(CpuGraphs, ReplayEqualsEagerInEveryLayout) {
  const auto prompts = test::golden_prompts("v2");
  struct Layout {
    int tp, dp;
  };
  for (Layout l : {Layout{1, 1}, Layout{2, 1}, Layout{2, 2}, Layout{4, 2}, Layout{4, 4}}) {
    SCOPED_TRACE("tp " + std::to_string(l.tp) + " dp-attention " + std::to_string(l.dp));
    const Outcome eager = run("v2", l.tp, l.dp, false, prompts), graph = run("v2", l.tp, l.dp, true, prompts);
    EXPECT_EQ(eager.graph_steps, 0);
    EXPECT_EQ(graph.sizes, (std::vector<int32_t>{1, 2, 4}));
    // 5 prompts: in one group the 5-token decode steps exceed the largest size (eager); spread over groups they fit.
    if (l.dp > 1) EXPECT_GT(graph.graph_steps, 0);
    else EXPECT_EQ(graph.graph_steps, 0);
    ASSERT_EQ(graph.out.greedy.size(), prompts.size());
    for (size_t j = 0; j < prompts.size(); ++j) {
      EXPECT_EQ(graph.out.greedy[j], eager.out.greedy[j]) << "prompt " << j;
      EXPECT_EQ(test::rel_err(graph.out.prompt_logits[j], eager.out.prompt_logits[j]), 0.0) << "prompt " << j;
    }
  }
}

// The random configs (one to sixteen heads, dense layers or not, every routing kind): their three prompts decode
// through the graphs of 4 tokens on one rank and of 2 under DP attention 2/2, as the eager steps do.
TEST(CpuGraphs, RandomConfigsReplayAsTheEagerSteps) {
  for (const std::string& fam : test::kRandomFamilies) {
    const auto prompts = test::golden_prompts(fam);
    ASSERT_EQ(prompts.size(), 3u) << fam;
    for (int d : {1, 2}) {
      SCOPED_TRACE(fam + (d > 1 ? " dp-attention 2/2" : " one rank"));
      const Outcome eager = run(fam, d, d, false, prompts), graph = run(fam, d, d, true, prompts);
      EXPECT_GT(graph.graph_steps, 0);
      ASSERT_EQ(graph.out.greedy.size(), prompts.size());
      for (size_t j = 0; j < prompts.size(); ++j) {
        EXPECT_EQ(graph.out.greedy[j], eager.out.greedy[j]) << "prompt " << j;
        EXPECT_EQ(test::rel_err(graph.out.prompt_logits[j], eager.out.prompt_logits[j]), 0.0) << "prompt " << j;
      }
    }
  }
}

TEST(CpuGraphs, SmallBatchesReplayInTensorParallel) {
  // Three prompts decode three at a time (padded to 4), then fewer as they finish... all through the graphs.
  auto prompts = test::golden_prompts("v3");
  prompts.resize(3);
  for (int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const Outcome eager = run("v3", tp, 1, false, prompts), graph = run("v3", tp, 1, true, prompts);
    EXPECT_EQ(graph.graph_steps, 5);  // 6 new tokens: the first comes from the prefill, 5 decode steps
    for (size_t j = 0; j < prompts.size(); ++j) EXPECT_EQ(graph.out.greedy[j], eager.out.greedy[j]) << "prompt " << j;
  }
}

TEST(CpuGraphs, OneBusyGroupThreeIdle) {
  auto prompts = test::golden_prompts("v3");
  std::vector<std::vector<int32_t>> one{prompts[2]};
  const Outcome eager = run("v3", 4, 4, false, one), graph = run("v3", 4, 4, true, one);
  EXPECT_EQ(graph.graph_steps, 5);
  EXPECT_EQ(graph.out.greedy[0], eager.out.greedy[0]);
}

}  // namespace

namespace {

TEST(CpuGraphs, NewKvCacheRecordsAgain) {
  // Two offline runs on one rank set: each allocates a new KV cache, so the graphs of the first (recorded over the
  // old cache) must not replay in the second.
  auto prompts = test::golden_prompts("v2");
  prompts.resize(2);
  auto rs = test::cpu_ranks("v2", 2, 1, 4);
  RankSet& ranks = *rs;
  OfflineOptions o;
  o.max_new_tokens = 5;
  o.page_size = 8;
  const OfflineResult a = run_offline(ranks, prompts, o);
  std::reverse(prompts.begin(), prompts.end());
  const OfflineResult b = run_offline(ranks, prompts, o);
  EXPECT_EQ(ranks.graph_steps(), 8);
  EXPECT_EQ(a.greedy[0], b.greedy[1]);
  EXPECT_EQ(a.greedy[1], b.greedy[0]);
}

// Reports graph variant 1 for steps past a context length (as the CUDA backend does past kOneTokenMaxCtx keys, where
// one token's attention takes other kernels), that context as its graph_variant_contexts, and counts the graph
// recordings.
class VariantPast final : public ForwardingBackend {
 public:
  VariantPast(std::unique_ptr<Backend> inner, int32_t bound, int* recordings)
      : ForwardingBackend(*inner), owned_(std::move(inner)), bound_(bound), recordings_(recordings) {}
  int32_t graph_variant(const ForwardBatch& b) const override {
    for (int32_t p : b.positions)
      if (p + 1 > bound_) return 1;
    return 0;
  }
  std::vector<int32_t> graph_variant_contexts() const override { return {bound_ + 1}; }
  void graph_capture_begin() override {
    ++*recordings_;
    ForwardingBackend::graph_capture_begin();
  }

 private:
  std::unique_ptr<Backend> owned_;
  int32_t bound_;
  int* recordings_;
};

TEST(CpuGraphs, VariantsRecordApart) {
  // One sequence decoding across the bound: one graph of size 1 on each side (the model keys graphs by token count
  // and Backend::graph_variant), both recorded with the KV cache, the tokens those of the eager run.
  auto prompts = test::golden_prompts("v2");
  prompts.resize(1);
  const int32_t len = static_cast<int32_t>(prompts[0].size());
  const Outcome eager = run("v2", 1, 1, false, prompts);
  ParallelConfig pc;
  pc.device = "cpu";
  pc.backend.cpu_graphs = true;
  pc.cuda_graph_max_bs = 4;
  int recordings = 0;
  pc.wrap_backend = [&](std::unique_ptr<Backend> made, int32_t) -> std::unique_ptr<Backend> {
    return std::make_unique<VariantPast>(std::move(made), len + 3, &recordings);
  };
  RankSet ranks(ModelConfig::from_file(test::golden_dir("v2")), pc, test::golden_dir("v2"), LoadOptions{});
  OfflineOptions o;
  o.max_new_tokens = 6;
  o.page_size = 8;
  ranks.allocate_kv(16, 8);
  EXPECT_EQ(recordings, 4);  // sizes 1, 2, 4 (contexts of one token) and size 1 past the bound
  const OfflineResult r = run_offline(ranks, prompts, o);
  EXPECT_EQ(ranks.graph_steps(), 6);  // every decode step
  EXPECT_EQ(recordings, 8);          // run_offline's own KV cache: the four again, none while decoding
  EXPECT_EQ(r.greedy[0], eager.out.greedy[0]);
}

}  // namespace
