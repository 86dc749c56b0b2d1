// The serving engine in parallel layouts on CPU ranks: DP attention with idle groups and a prefill on one group
// meeting decode on another; DP replicas behind the controller; the load balancer. Outputs equal the reference.
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "engine/dp_controller.h"
#include "engine/engine.h"
#include "engine/load_balancer.h"
#include "engine/offline.h"
#include "parallel/inprocess_communicator.h"
#include "io/safetensors.h"
#include "test_util.h"

using namespace mlaserve;

namespace {

struct Golden {
  std::vector<std::vector<int32_t>> prompts, greedy;
};

Golden golden(const std::string& fam) {
  Golden g;
  SafetensorsFile f(test::golden_dir(fam) + "/reference.safetensors");
  for (int j = 0; j < 5; ++j) {
    Tensor p = f.tensor("prompt_" + std::to_string(j)), gr = f.tensor("greedy_" + std::to_string(j)),
           m = f.tensor("margin_" + std::to_string(j));
    g.prompts.emplace_back(p.data_as<int32_t>(), p.data_as<int32_t>() + p.numel());
    std::vector<int32_t> ref;
    for (int64_t i = 0; i < gr.numel() && m.data_as<float>()[i] >= 0.02f; ++i) ref.push_back(gr.data_as<int32_t>()[i]);
    g.greedy.push_back(ref);
  }
  return g;
}

using test::submit_ids;
using test::wait_ids;

void expect_prefix(const std::vector<int32_t>& got, const std::vector<int32_t>& ref) {
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) EXPECT_EQ(got[i], ref[i]) << "step " << i;
}

void expect_idle_and_clean(EngineClient& e) { test::expect_engine_idle_and_clean(e); }

}  // namespace

// graphs: decode steps through recorded graphs (GraphRecorder on the CPU ranks), with overlap scheduling on.
void prefill_meets_decode(bool graphs) {
  Golden g = golden("v3");
  auto ranks = test::cpu_ranks("v3", 4, 4, graphs ? 8 : 0);
  const RankSet* rs = ranks.get();
  EngineOptions o;
  o.page_size = 8;
  o.num_pages = 128;
  o.chunked_prefill_size = 32;
  o.check_integrity = true;
  Engine e(std::move(ranks), o);
  ASSERT_EQ(e.stats().size(), 4u);
  // Group 0 decodes a long continuation; while it runs, group 1 gets a long prefill (in chunks); groups 2 and 3
  // stay idle throughout but must join every step.
  auto a = submit_ids(e, "a", g.prompts[1], 20, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  auto b = submit_ids(e, "b", g.prompts[4], 6, 1);
  expect_prefix(wait_ids(a), g.greedy[1]);
  expect_prefix(wait_ids(b), g.greedy[4]);
  // Then everything at once, balanced by the load balancer.
  std::vector<std::future<std::vector<int32_t>>> fs;
  for (int j = 0; j < 5; ++j) fs.push_back(submit_ids(e, "c" + std::to_string(j), g.prompts[j], 8));
  for (int j = 0; j < 5; ++j) expect_prefix(wait_ids(fs[j]), g.greedy[j]);
  expect_idle_and_clean(e);
  if (graphs) EXPECT_GT(rs->graph_steps(), 10);
  else EXPECT_EQ(rs->graph_steps(), 0);
  // Overlap scheduling launched decode steps whose ids came from the previous step's samples on the ranks.
  EXPECT_GT(e.stats()[0].overlapped_steps, 10);
  EXPECT_GT(rs->prev_id_steps(), 10);
}

TEST(DpAttentionEngine, PrefillMeetsDecodeAndIdleGroups) { prefill_meets_decode(false); }
TEST(DpAttentionEngine, PrefillMeetsDecodeThroughGraphs) { prefill_meets_decode(true); }

// Layouts whose attention groups have several ranks: only a group's leading rank samples, and the ids reach the
// group's other ranks on the device (broadcast) before the next step, which overlap scheduling launches before the
// host has them. Outputs equal the reference; the same with overlap off (nothing taken from the device).
void ids_on_the_ranks(int32_t tp, int32_t dp, bool graphs, bool overlap) {
  Golden g = golden("v2");
  auto ranks = test::cpu_ranks("v2", tp, dp, graphs ? 8 : 0);
  const RankSet* rs = ranks.get();
  Engine e(std::move(ranks), test::small_engine_options(overlap));
  std::vector<std::future<std::vector<int32_t>>> fs;
  for (int j = 0; j < 5; ++j) fs.push_back(submit_ids(e, "r" + std::to_string(j), g.prompts[j], 10 + j));
  for (int j = 0; j < 5; ++j) {
    const std::vector<int32_t> got = wait_ids(fs[static_cast<size_t>(j)]);
    EXPECT_EQ(got.size(), static_cast<size_t>(10 + j));
    expect_prefix(got, g.greedy[static_cast<size_t>(j)]);
  }
  expect_idle_and_clean(e);
  if (overlap) {
    EXPECT_GT(e.stats()[0].overlapped_steps, 5);
    EXPECT_GT(rs->prev_id_steps(), 5);
  } else {
    EXPECT_EQ(e.stats()[0].overlapped_steps, 0);
    EXPECT_EQ(rs->prev_id_steps(), 0);
  }
  if (graphs) {
    EXPECT_GT(rs->graph_steps(), 5);
  }
}

// Penalised requests under overlap scheduling in layouts where another rank than the engine's first samples (a DP
// group's leading rank; a graph's padded batch): the token in flight is counted there, on the device, so the steps are
// launched early and the tokens equal those of overlap off.
void penalised_overlap(int32_t tp, int32_t dp, bool graphs) {
  Golden g = golden("v2");
  auto run = [&](bool overlap) {
    Engine e(test::cpu_ranks("v2", tp, dp, graphs ? 8 : 0), test::small_engine_options(overlap));
    SamplingParams favour;  // negative penalties: the newest token is favoured, so miscounting it shows
    favour.temperature = 0.0f;
    favour.frequency_penalty = -1.0f;
    favour.presence_penalty = -1.0f;
    SamplingParams seeded;
    seeded.temperature = 0.8f;
    seeded.seed = 9;
    seeded.repetition_penalty = 1.4f;
    seeded.frequency_penalty = 0.5f;
    std::vector<std::future<std::vector<int32_t>>> fs;
    for (int j = 0; j < 5; ++j)
      fs.push_back(submit_ids(e, std::string("r").append(std::to_string(j)), g.prompts[j], 10 + j, j % dp,
                              j % 2 ? &favour : &seeded));
    std::vector<std::vector<int32_t>> out;
    for (auto& f : fs) out.push_back(wait_ids(f));
    expect_idle_and_clean(e);
    return std::make_pair(out, e.stats()[0].overlapped_steps);
  };
  const auto [off, off_steps] = run(false);
  const auto [on, on_steps] = run(true);
  EXPECT_EQ(on, off);
  EXPECT_EQ(off_steps, 0);
  EXPECT_GT(on_steps, 5);
}

TEST(PenalisedOverlap, TensorParallel2) { penalised_overlap(2, 1, false); }
TEST(PenalisedOverlap, DpAttention4x2ThroughGraphs) { penalised_overlap(4, 2, true); }

TEST(IdsOnTheDevice, TensorParallel2) { ids_on_the_ranks(2, 1, false, true); }
TEST(IdsOnTheDevice, TensorParallel2NoOverlap) { ids_on_the_ranks(2, 1, false, false); }
TEST(IdsOnTheDevice, DpAttention4x2ThroughGraphs) { ids_on_the_ranks(4, 2, true, true); }

// The golden v2 model on CPU ranks, --tp 2 --dp 2 (replicas, or DP attention), pages of 8.
EngineArgs two_ranks(const std::string& method, bool dp_attention = false) {
  EngineArgs a;
  a.model_path = test::golden_dir("v2");
  a.device = "cpu";
  a.tp_size = 2;
  a.dp_size = 2;
  a.enable_dp_attention = dp_attention;
  a.max_total_tokens = 4096;
  a.page_size = 8;
  a.load_balance_method = method;
  return a;
}

// cache_aware's thresholds out of range: an error naming the flag before anything loads, in both DP layouts.
TEST(DpReplicas, BadBalanceThresholdsNameTheFlag) {
  for (bool dpa : {false, true}) {
    EngineArgs a = two_ranks("cache_aware", dpa);
    a.balance.abs = -3;
    try {
      make_engine(a);
      ADD_FAILURE() << "accepted, dp attention " << dpa;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--balance-abs-threshold must be >= 0, got -3"), std::string::npos)
          << e.what();
    }
  }
}

TEST(DpReplicas, ControllerDispatchesAndRoutesAborts) {
  Golden g = golden("v2");
  auto e = make_engine(two_ranks("shortest_queue"));
  ASSERT_EQ(e->stats().size(), 2u);
  std::vector<std::future<std::vector<int32_t>>> fs;
  for (int j = 0; j < 5; ++j) fs.push_back(submit_ids(*e, "r" + std::to_string(j), g.prompts[j], 8));
  auto victim = submit_ids(*e, "victim", g.prompts[2], 4000);
  FinishReason why;
  why.kind = FinishKind::Abort;
  e->abort("victim", why);
  EXPECT_LT(wait_ids(victim).size(), 4000u);
  for (int j = 0; j < 5; ++j) expect_prefix(wait_ids(fs[j]), g.greedy[j]);
  int64_t prompts = 0;
  for (auto& s : e->stats()) {
    EXPECT_GT(s.prompt_tokens_total, 0) << "both replicas should have served requests";
    prompts += s.prompt_tokens_total;
  }
  EXPECT_GT(prompts, 0);
  expect_idle_and_clean(*e);
}

std::vector<int32_t> first_turn(const Golden& g) {
  std::vector<int32_t> p;
  for (const auto& q : g.prompts) p.insert(p.end(), q.begin(), q.end());
  return p;
}

// A conversation's second turn (the first turn's prompt and output, then more) after the first finished, on two DP
// groups (DP attention) or two replicas: the prompt tokens it found cached.
int64_t second_turn_cached(const std::string& method, bool dp_attention) {
  Golden g = golden("v2");
  auto e = make_engine(two_ranks(method, dp_attention));
  auto first = submit_ids(*e, "first", first_turn(g), 8);
  std::vector<int32_t> turn = first_turn(g);
  for (int32_t t : wait_ids(first)) turn.push_back(t);
  turn.insert(turn.end(), g.prompts[3].begin(), g.prompts[3].end());
  auto second = submit_ids(*e, "second", turn, 4);
  wait_ids(second);
  int64_t cached = 0;
  for (const RankStats& s : e->stats()) cached += s.cached_prompt_tokens_total;
  expect_idle_and_clean(*e);
  return cached;
}

// cache_aware sends the second turn where the first is cached; round_robin to the other group / replica, which
// computes it all again.
TEST(LoadBalancer, CacheAwareFindsTheFirstTurnsCache) {
  const int64_t pages = static_cast<int64_t>(first_turn(golden("v2")).size()) / 8 * 8;
  ASSERT_GE(pages, 16);
  for (bool dp_attention : {true, false}) {
    SCOPED_TRACE(dp_attention ? "DP attention" : "DP replicas");
    EXPECT_EQ(second_turn_cached("round_robin", dp_attention), 0);
    EXPECT_GE(second_turn_cached("cache_aware", dp_attention), pages);
  }
}

TEST(LoadBalancer, ShortestQueueCountsTokensNotRequests) {
  LoadBalancer lb(2, "shortest_queue");
  EXPECT_EQ(lb.assign("big", 1000), 0);
  EXPECT_EQ(lb.assign("s1", 10), 1);
  EXPECT_EQ(lb.assign("s2", 10), 1);  // two requests on rank 1 still weigh less than one big on rank 0
  EXPECT_EQ(lb.assign("s3", 10), 1);
  EXPECT_EQ(lb.release("big"), 0);
  EXPECT_EQ(lb.assign("s4", 10), 0);
  EXPECT_EQ(lb.assign("pinned", 5, 1), 1);
  EXPECT_EQ(lb.rank_of("pinned"), 1);
  LoadBalancer rr(3, "round_robin");
  EXPECT_EQ(rr.assign("a", 1), 0);
  EXPECT_EQ(rr.assign("b", 1), 1);
  EXPECT_EQ(rr.assign("c", 1), 2);
  EXPECT_EQ(rr.assign("d", 1), 0);
  EXPECT_THROW(LoadBalancer(2, "random"), Error);
  // Following a request: its rank, ahead of the policy (live or lately finished: its prefix is cached there); a pin
  // wins; an unknown one is not followed.
  EXPECT_EQ(rr.assign("e", 1, -1, "b"), 1);
  EXPECT_EQ(rr.assign("f", 1, 2, "b"), 2);
  EXPECT_EQ(rr.release("b"), 1);
  EXPECT_EQ(rr.assign("g", 1, -1, "nobody"), 1);  // round robin's turn: rank 1 (a, b, c, d took 0 1 2 0)
  EXPECT_EQ(rr.assign("h", 1, -1, "b"), 1);       // (its turn was 2)
  EXPECT_EQ(rr.assign("i", 1, -1, "c"), 2);
  // Only the last kRecent finished requests are remembered.
  LoadBalancer two(2, "round_robin");
  EXPECT_EQ(two.assign("first", 1), 0);
  EXPECT_EQ(two.release("first"), 0);
  for (size_t k = 0; k < LoadBalancer::kRecent; ++k) {
    two.assign("r" + std::to_string(k), 1);
    two.release("r" + std::to_string(k));
  }
  // "first" (rank 0) is forgotten: round robin's turn, rank 1 (rk took rank (1 + k) % 2); r4094 (rank 1) is not,
  // though round robin's turn is rank 0 now.
  EXPECT_EQ(two.assign("late", 1, -1, "first"), 1);
  EXPECT_EQ(two.assign("late2", 1, -1, "r" + std::to_string(LoadBalancer::kRecent - 2)), 1);
}

TEST(EngineArgsErrors, NegativeCudaGraphMaxBsIsClear) {
  EngineArgs a;
  a.model_path = test::golden_dir("v2");
  a.device = "cpu";
  a.cuda_graph_max_bs = -1;
  try {
    make_engine(a);
    FAIL() << "a negative --cuda-graph-max-bs was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--cuda-graph-max-bs must be >= 0, got -1"), std::string::npos) << e.what();
  }
}

// A communicator that fails asynchronously (NCCL's asynchronous errors: its collectives then stop completing) fails
// the step at once, naming the error, instead of leaving the ranks in collectives until a timeout; later steps are
// refused by the aborted communicators.
TEST(RankSetFailures, AsyncCommunicatorErrorFailsTheStepAtOnce) {
  auto group = std::make_shared<InProcessGroup>(2, std::chrono::seconds(20));
  ParallelConfig pc;
  pc.tp_size = 2;
  pc.device = "cpu";
  pc.comm_factory = [group](int32_t global, int32_t) -> std::unique_ptr<Communicator> {
    return std::make_unique<InProcessCommunicator>(group, global);
  };
  RankSet ranks(ModelConfig::from_file(test::golden_dir("v2")), pc, test::golden_dir("v2"), LoadOptions{});
  const auto prompts = test::golden_prompts("v2");
  OfflineOptions o;
  o.max_new_tokens = 2;
  run_offline(ranks, {prompts[1]}, o);  // healthy: runs
  group->fail_async("simulated NCCL error: remote peer lost");
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    run_offline(ranks, {prompts[1]}, o);
  } catch (const Error& e) {
    what = e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(what.find("simulated NCCL error: remote peer lost"), std::string::npos) << what;
  EXPECT_LT(s, 5.0) << "the step waited for the collectives' timeout: " << what;
}
