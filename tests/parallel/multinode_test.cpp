// The multi-node path without GPUs: two simulated nodes in one process (two RankSets joined by a real TCP
// NodeLink on loopback, their CPU ranks sharing in-process communicators). Node 0 drives; node 1 follows, and
// returns the outputs of the DP groups it leads. Results must equal one node running every rank.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "backend/forwarding_backend.h"
#include "engine/offline.h"
#include "io/safetensors.h"
#include "parallel/inprocess_communicator.h"
#include "test_util.h"

using namespace mlaserve;

namespace {

// A rank's in-process communicator whose abort wakes only this rank, as NCCL's abort on one node leaves the ranks of
// the others waiting in their collectives.
class NodeLocalAbort final : public Communicator {
 public:
  explicit NodeLocalAbort(std::unique_ptr<InProcessCommunicator> c) : c_(std::move(c)) {}
  int rank() const override { return c_->rank(); }
  int size() const override { return c_->size(); }
  void all_reduce_sum(Tensor& t) override { c_->all_reduce_sum(t); }
  void all_gather(const Tensor& in, Tensor& out) override { c_->all_gather(in, out); }
  void all_gather_v(const Tensor& in, Tensor& out, const std::vector<int64_t>& counts) override {
    c_->all_gather_v(in, out, counts);
  }
  void reduce_scatter_sum(const Tensor& in, Tensor& out) override { c_->reduce_scatter_sum(in, out); }
  void broadcast(Tensor& t, int root) override { c_->broadcast(t, root); }
  void barrier() override { c_->barrier(); }
  void abort() override { c_->group().abort_rank(c_->rank()); }

 private:
  std::unique_ptr<InProcessCommunicator> c_;
};

// Runs `tp` ranks (`dp` attention-DP groups) as two nodes: node 1 follows in a thread while `drive` uses node 0's
// RankSet (and destroys it, which tells node 1 to stop). Returns node 1's counts of steps served and of steps it
// launched while an earlier one still ran.
// follower_error: where node 1's error goes (null: there must be none); node0 / node1: changes to that node's
// configuration; node_local_aborts: a rank's abort wakes that rank only (NodeLocalAbort), else its whole group;
// mtp: the ranks load the checkpoint's MTP layer.
std::pair<int64_t, int64_t> two_nodes(const std::string& fam, int tp, int dp,
                                      const std::function<void(std::unique_ptr<RankSet>)>& drive,
                                      std::string* follower_error_out = nullptr,
                                      const std::function<void(ParallelConfig&)>& node0 = {},
                                      const std::function<void(ParallelConfig&)>& node1 = {},
                                      bool node_local_aborts = false, bool mtp = false) {
  ModelConfig cfg = ModelConfig::from_file(test::golden_dir(fam));
  if (mtp) cfg.mtp_layers = 1;  // (the checkpoint's MTP layer loaded: speculative decoding with it)
  // Communicators shared by the simulated nodes: the world, and one group per DP group.
  auto world = make_inprocess_communicators(tp);
  const int at = tp / dp;
  std::vector<std::vector<std::unique_ptr<InProcessCommunicator>>> attn(static_cast<size_t>(dp));
  if (at > 1 && dp > 1)
    for (int g = 0; g < dp; ++g) attn[static_cast<size_t>(g)] = make_inprocess_communicators(at);
  std::mutex mu;
  auto factory = [&](int32_t rank, int32_t group) -> std::unique_ptr<Communicator> {
    std::lock_guard<std::mutex> lk(mu);
    std::unique_ptr<InProcessCommunicator> c =
        group < 0 ? std::move(world[static_cast<size_t>(rank)])
                  : std::move(attn[static_cast<size_t>(group)][static_cast<size_t>(rank % at)]);
    if (node_local_aborts) return std::make_unique<NodeLocalAbort>(std::move(c));
    return c;
  };
  const std::string addr = test::free_loopback_addr();
  auto pc = [&](int node) {
    ParallelConfig p;
    p.tp_size = tp;
    p.dp_size = dp;
    p.device = "cpu";
    p.nnodes = 2;
    p.node_rank = node;
    p.dist_init_addr = addr;
    p.dist_timeout = std::chrono::seconds(60);
    p.comm_factory = factory;
    return p;
  };
  std::string follower_error;
  std::pair<int64_t, int64_t> followed{0, 0};
  std::thread follower([&] {
    try {
      ParallelConfig pc1 = pc(1);
      if (node1) node1(pc1);
      RankSet r1(cfg, pc1, test::golden_dir(fam), {});
      r1.follow();
      followed = {r1.followed_steps(), r1.followed_overlapped_steps()};
    } catch (const std::exception& e) {
      follower_error = e.what();
    }
  });
  ParallelConfig pc0 = pc(0);
  if (node0) node0(pc0);
  drive(std::make_unique<RankSet>(cfg, pc0, test::golden_dir(fam), LoadOptions{}));
  follower.join();
  if (follower_error_out)
    *follower_error_out = follower_error;
  else
    EXPECT_EQ(follower_error, "");
  return followed;
}

OfflineResult two_nodes_offline(const std::string& fam, int tp, int dp, const std::vector<std::vector<int32_t>>& ps,
                                const OfflineOptions& o) {
  OfflineResult res;
  two_nodes(fam, tp, dp, [&](std::unique_ptr<RankSet> r0) { res = run_offline(*r0, ps, o); });
  return res;
}

}  // namespace

TEST(MultiNode, TwoSimulatedNodesEqualOneNode) {
  auto ps = test::golden_prompts("v2");
  OfflineOptions o;
  o.max_new_tokens = 6;
  o.page_size = 8;
  ParallelConfig single;
  single.device = "cpu";
  RankSet one(ModelConfig::from_file(test::golden_dir("v2")), single, test::golden_dir("v2"), {});
  OfflineResult ref = run_offline(one, ps, o);
  struct Layout {
    int tp, dp;
  };
  for (Layout l : {Layout{2, 1}, Layout{2, 2}, Layout{4, 2}}) {
    SCOPED_TRACE("tp " + std::to_string(l.tp) + " dp " + std::to_string(l.dp));
    OfflineResult r = two_nodes_offline("v2", l.tp, l.dp, ps, o);
    ASSERT_EQ(r.greedy.size(), ref.greedy.size());
    for (size_t j = 0; j < ps.size(); ++j) {
      EXPECT_LT(test::rel_err(r.prompt_logits[j], ref.prompt_logits[j]), 1e-4) << "prompt " << j;
      EXPECT_EQ(r.greedy[j], ref.greedy[j]) << "prompt " << j;
    }
  }
}

// The serving engine on two nodes with overlap scheduling: node 1 launches each step as it arrives and finishes it
// when node 0 does, so it too runs step N + 1 behind step N. Greedy and penalised requests (the token in flight is
// counted on the sampling rank's device) give the same tokens as one node with overlap off.
TEST(MultiNode, EngineOverlapsOnEveryNode) {
  auto ps = test::golden_prompts("v2");
  auto run = [&](std::unique_ptr<RankSet> ranks, bool overlap) {
    Engine e(std::move(ranks), test::small_engine_options(overlap));
    SamplingParams favour;  // negative penalties: the newest token is favoured, so miscounting it changes the output
    favour.temperature = 0.0f;
    favour.frequency_penalty = -1.0f;
    favour.presence_penalty = -1.0f;
    std::vector<std::future<std::vector<int32_t>>> fs;
    for (size_t j = 0; j < ps.size(); ++j)
      fs.push_back(test::submit_ids(e, "r" + std::to_string(j), ps[j], 12, -1, j % 2 ? &favour : nullptr));
    SamplingParams forced;  // a logit bias travels with the row to the sampling rank: every token is 5
    forced.temperature = 0.0f;
    forced.logit_bias = {{5, 100.0f}};
    const int32_t last_group = static_cast<int32_t>(e.stats().size()) - 1;  // on node 1 with DP attention 2/2
    fs.push_back(test::submit_ids(e, "forced", ps[0], 6, last_group > 0 ? last_group : -1, &forced));
    std::vector<std::vector<int32_t>> out;
    for (auto& f : fs) out.push_back(test::wait_ids(f));
    test::expect_engine_idle_and_clean(e);
    return std::make_pair(out, e.stats()[0].overlapped_steps);
  };
  const auto [ref, ref_steps] = run(test::cpu_ranks("v2"), false);
  EXPECT_EQ(ref_steps, 0);
  EXPECT_EQ(ref.back(), std::vector<int32_t>(6, 5));
  for (auto [tp, dp] : {std::pair{2, 1}, std::pair{2, 2}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " dp " + std::to_string(dp));
    std::vector<std::vector<int32_t>> got;
    int64_t overlapped = 0;
    const auto [served, served_overlapped] = two_nodes("v2", tp, dp, [&](std::unique_ptr<RankSet> r0) {
      std::tie(got, overlapped) = run(std::move(r0), true);
    });
    EXPECT_EQ(got, ref);
    EXPECT_GT(overlapped, 5);
    EXPECT_GT(served, 10);
    EXPECT_GT(served_overlapped, 5) << "node 1 launched each step only after finishing the one before";
  }
}

// return_hidden_states and return_routed_experts on two nodes: the rows of a DP group led by node 1 come back with
// its outputs (and those of node 0's group), equal to one node's.
TEST(MultiNode, HiddenStatesAndRoutedExpertsFromEveryNode) {
  auto ps = test::golden_prompts("v2");
  struct Rows {
    std::vector<float> hidden;
    std::vector<int32_t> routes;
  };
  auto run = [&](std::unique_ptr<RankSet> ranks) {
    Engine e(std::move(ranks), test::small_engine_options(true));
    SamplingParams hs;
    hs.temperature = 0.0f;
    hs.return_hidden_states = true;
    hs.return_routed_experts = true;
    const int32_t groups = static_cast<int32_t>(e.stats().size());
    std::vector<std::future<Rows>> fs;
    for (size_t j = 1; j < 4; ++j) {
      auto prom = std::make_shared<std::promise<Rows>>();
      auto acc = std::make_shared<Rows>();
      GenerateRequest g = test::ids_request("h" + std::to_string(j), ps[j], 5,
                                            groups > 1 ? static_cast<int32_t>(j) % groups : -1, &hs);
      g.on_output = [prom, acc](const GenerateOutput& o) {
        acc->hidden.insert(acc->hidden.end(), o.hidden_states.begin(), o.hidden_states.end());
        acc->routes.insert(acc->routes.end(), o.routed_experts.begin(), o.routed_experts.end());
        if (o.finished) prom->set_value(*acc);
      };
      fs.push_back(prom->get_future());
      e.submit(std::move(g));
    }
    std::vector<Rows> out;
    for (auto& f : fs) {
      EXPECT_EQ(f.wait_for(std::chrono::seconds(120)), std::future_status::ready);
      out.push_back(f.get());
    }
    test::expect_engine_idle_and_clean(e);
    return out;
  };
  ParallelConfig single;
  single.device = "cpu";
  single.capture_routes = true;
  const ModelConfig cfg = ModelConfig::from_file(test::golden_dir("v2"));
  const std::vector<Rows> ref = run(std::make_unique<RankSet>(cfg, single, test::golden_dir("v2"), LoadOptions{}));
  for (size_t j = 1; j < 4; ++j) {
    ASSERT_EQ(std::ssize(ref[j - 1].hidden), (std::ssize(ps[j]) + 4) * cfg.hidden_size);
    ASSERT_EQ(std::ssize(ref[j - 1].routes), (std::ssize(ps[j]) + 4) * cfg.num_hidden_layers * cfg.num_experts_per_tok);
  }
  std::vector<Rows> got;
  auto capture = [](ParallelConfig& pc) { pc.capture_routes = true; };
  two_nodes("v2", 2, 2, [&](std::unique_ptr<RankSet> r0) { got = run(std::move(r0)); }, nullptr, capture, capture);
  ASSERT_EQ(got.size(), ref.size());
  for (size_t k = 0; k < ref.size(); ++k) {
    EXPECT_EQ(got[k].routes, ref[k].routes) << "request " << k;
    ASSERT_EQ(got[k].hidden.size(), ref[k].hidden.size()) << "request " << k;
    for (size_t i = 0; i < ref[k].hidden.size(); ++i)
      ASSERT_NEAR(got[k].hidden[i], ref[k].hidden[i], 1e-4f) << "request " << k << " at " << i;
  }
}

// The hierarchical cache on two nodes: the copies travel with the steps, so the ranks of node 1 (the second DP group,
// or the second half of tp 2) save and load their own pages; a prompt evicted to the host by three others and run
// again comes back from the host with one node's greedy tokens.
TEST(MultiNode, HierarchicalCacheOnEveryNode) {
  auto ps = test::golden_prompts("v2");
  const std::vector<int32_t> a = ps.back();
  auto run = [&](std::unique_ptr<RankSet> ranks, int32_t host_pages) {
    EngineOptions o = test::small_engine_options(true, /*num_pages=*/40);
    o.host_pages = host_pages;
    Engine e(std::move(ranks), o);
    const int32_t group = static_cast<int32_t>(e.stats().size()) - 1;  // on node 1 with DP attention 2/2
    auto f = test::submit_ids(e, "a", a, 6, group);
    std::vector<std::vector<int32_t>> out{test::wait_ids(f)};
    for (int32_t k = 1; k <= 3; ++k) {
      std::vector<int32_t> other = a;
      other[0] = (a[0] + 7 * k) % 700;
      auto g = test::submit_ids(e, "o" + std::to_string(k), other, 2, group);
      test::wait_ids(g);
    }
    auto f2 = test::submit_ids(e, "a2", a, 6, group);
    out.push_back(test::wait_ids(f2));
    const int64_t loaded = e.stats()[static_cast<size_t>(group)].host_loaded_tokens_total;
    test::expect_engine_idle_and_clean(e);
    return std::make_pair(out, loaded);
  };
  const auto [ref, ref_loaded] = run(test::cpu_ranks("v2"), 0);
  EXPECT_EQ(ref_loaded, 0);
  EXPECT_EQ(ref[1], ref[0]);
  for (auto [tp, dp] : {std::pair{2, 1}, std::pair{2, 2}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " dp " + std::to_string(dp));
    std::pair<std::vector<std::vector<int32_t>>, int64_t> got;
    two_nodes("v2", tp, dp, [&](std::unique_ptr<RankSet> r0) { got = run(std::move(r0), 128); });
    EXPECT_EQ(got.first, ref);
    EXPECT_EQ(got.second, static_cast<int64_t>(a.size() - 1) / 8 * 8);
  }
}

// Chained MTP drafts on two nodes with DP attention (a group of one rank on each): node 1 runs each step's chained
// MTP passes as node 0 does (the chain and the draft counts travel with the step's batches, each group's chained
// token counts come from them), and the greedy tokens are those of one node without drafts.
TEST(MultiNode, ChainedMtpDraftsOnTwoNodes) {
  auto ps = test::golden_prompts("v3mtp");
  auto run = [&](std::unique_ptr<RankSet> ranks, int32_t drafts) {
    EngineOptions o = test::small_engine_options(true);
    o.spec_draft_tokens = drafts;
    Engine e(std::move(ranks), o);
    std::vector<std::future<std::vector<int32_t>>> fs;
    for (size_t j = 0; j < ps.size(); ++j) fs.push_back(test::submit_ids(e, "r" + std::to_string(j), ps[j], 16));
    std::vector<std::vector<int32_t>> out;
    for (auto& f : fs) out.push_back(test::wait_ids(f));
    int64_t checks = 0, checked = 0;
    for (const RankStats& st : e.stats()) {
      checks += st.spec_checks;
      checked += st.spec_draft_tokens;
    }
    if (drafts > 0) {
      EXPECT_GT(checks, 10);
      EXPECT_GT(checked, checks * 2) << "chains of up to three drafts";
    }
    test::expect_engine_idle_and_clean(e);
    return out;
  };
  const auto ref = run(test::cpu_ranks("v3mtp"), 0);
  std::vector<std::vector<int32_t>> got;
  const auto [served, served_overlapped] = two_nodes(
      "v3mtp", 2, 2, [&](std::unique_ptr<RankSet> r0) { got = run(std::move(r0), 3); }, nullptr, {}, {}, false,
      /*mtp=*/true);
  EXPECT_EQ(got, ref);
  EXPECT_GT(served, 10);
}

// Throws `what` from the embedding while `armed` (once): a failure inside a step every node runs.
class FailOnce final : public ForwardingBackend {
 public:
  FailOnce(std::unique_ptr<Backend> inner, std::atomic<bool>& armed, std::string what = "injected failure on node 0")
      : ForwardingBackend(*inner), owned_(std::move(inner)), armed_(armed), what_(std::move(what)) {}
  void embedding(const Tensor& t, int64_t vb, Tensor& o) override {
    if (armed_.exchange(false)) fail("{}", what_);
    ForwardingBackend::embedding(t, vb, o);
  }

 private:
  std::unique_ptr<Backend> owned_;
  std::atomic<bool>& armed_;
  std::string what_;
};

// Two prompts run once on node 0 (the layout works); then `armed` is set and the next run must fail naming `failure`,
// within `fast` (no node waited for a timeout), and `refused` runs after it must be refused as a stopped layout
// naming `stopped_names`.
static void works_then_fails(RankSet& r0, std::atomic<bool>& armed, const std::string& failure,
                             std::chrono::seconds fast, int refused, const std::string& stopped_names) {
  auto ps = test::golden_prompts("v2");
  ps.resize(2);
  OfflineOptions o;
  o.max_new_tokens = 3;
  o.page_size = 8;
  const OfflineResult ok = run_offline(r0, ps, o);
  ASSERT_EQ(ok.greedy.size(), ps.size());
  armed = true;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string err = test::error_text([&] { run_offline(r0, ps, o); });
  EXPECT_NE(err.find(failure), std::string::npos) << "the failed step: " << err;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, fast) << "a node waited for a timeout";
  for (int i = 0; i < refused; ++i) {
    const std::string again = test::error_text([&] { run_offline(r0, ps, o); });
    EXPECT_NE(again.find("stopped after a failed step"), std::string::npos) << "a step after the stop: " << again;
    EXPECT_NE(again.find(stopped_names), std::string::npos) << again;
  }
}

// A step node 0 sent to node 1 fails on node 0: node 1's ranks ran (or wait in) collectives node 0 never joins.
// Node 0 reports the failure, node 1 stops with an error instead of waiting forever, and node 0 refuses every later
// step and cache change at once, naming the failure.
// A weight update on two nodes (RankSet::reload_weights sends it to node 1): the logits are the new checkpoint's on one
// node; an update that fails on the nodes' ranks loads the previous weights again everywhere; the memory released and
// resumed on both nodes comes back with the weights.
TEST(MultiNode, WeightUpdateReachesEveryNode) {
  const auto b = test::temp_dir("mn-wu"), bad = test::temp_dir("mn-wu-bad");
  test::write_scaled_checkpoint("v2lite", b, 1.25f);
  test::rewrite_checkpoint("v2lite", bad, [](std::map<std::string, Tensor>& ts) {
    test::scale_projections(ts, 0.5f);
    ts.erase("model.layers.1.self_attn.o_proj.weight");
  });
  const std::vector<std::vector<int32_t>> ps{{5, 17, 300, 2, 99, 41, 7}};
  OfflineOptions o;
  o.max_new_tokens = 4;
  o.page_size = 8;
  for (const auto& [tp, dp] : {std::pair{2, 1}, std::pair{4, 2}}) {
    SCOPED_TRACE(fmt::format("tp {} dp {}", tp, dp));
    const OfflineResult want_old = run_offline(*test::cpu_ranks("v2lite", tp, dp), ps, o);
    const OfflineResult want_new = run_offline(*test::cpu_ranks_at(b.string(), tp, dp), ps, o);
    two_nodes("v2lite", tp, dp, [&](std::unique_ptr<RankSet> r0) {
      r0->reload_weights(b.string());
      const OfflineResult got = run_offline(*r0, ps, o);
      EXPECT_EQ(got.greedy, want_new.greedy);
      EXPECT_EQ(test::rel_err(got.prompt_logits[0], want_new.prompt_logits[0]), 0.0);
      const std::string err = test::error_text([&] { r0->reload_weights(bad.string()); });
      EXPECT_NE(err.find("missing tensor 'model.layers.1.self_attn.o_proj.weight'"), std::string::npos) << err;
      EXPECT_NE(err.find("loaded again"), std::string::npos) << err;
      const OfflineResult kept = run_offline(*r0, ps, o);
      EXPECT_EQ(test::rel_err(kept.prompt_logits[0], want_new.prompt_logits[0]), 0.0);
      r0->reload_weights(test::golden_dir("v2lite"));
      const OfflineResult back = run_offline(*r0, ps, o);
      EXPECT_EQ(back.greedy, want_old.greedy);
      EXPECT_EQ(test::rel_err(back.prompt_logits[0], want_old.prompt_logits[0]), 0.0);
      // The memory released and taken again on both nodes: the weights are loaded again everywhere.
      r0->release_memory();
      r0->resume_memory();
      const OfflineResult resumed = run_offline(*r0, ps, o);
      EXPECT_EQ(resumed.greedy, want_old.greedy);
      EXPECT_EQ(test::rel_err(resumed.prompt_logits[0], want_old.prompt_logits[0]), 0.0);
    });
  }
}

TEST(MultiNode, FailedStepStopsEveryNode) {
  for (auto [tp, dp] : {std::pair{2, 1}, std::pair{2, 2}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " dp " + std::to_string(dp));
    std::atomic<bool> armed{false};
    std::string follower_error;
    const auto t0 = std::chrono::steady_clock::now();
    two_nodes(
        "v2", tp, dp,
        [&](std::unique_ptr<RankSet> r0) {
          works_then_fails(*r0, armed, "injected failure on node 0", std::chrono::seconds(30), 2,
                           "injected failure on node 0");
        },
        &follower_error,
        [&](ParallelConfig& pc) {
          pc.wrap_backend = [&](std::unique_ptr<Backend> made, int32_t global) -> std::unique_ptr<Backend> {
            if (global != 0) return made;
            return std::make_unique<FailOnce>(std::move(made), armed);
          };
        });
    // Node 1 stopped with an error: woken in its collectives (another rank failed) or told by node 0.
    EXPECT_FALSE(follower_error.empty());
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30)) << "a node waited for a timeout";
    std::printf("  node 1 stopped with: %s\n", follower_error.c_str());
  }
}

// A step fails on node 1. Its abort wakes only node 1's ranks (NodeLocalAbort, as with NCCL across nodes), so node 0's
// ranks would wait in their collectives until the step timeout; node 1 tells node 0 instead, which aborts its own
// communicators, fails the step at once naming node 1's error, and refuses later steps.
TEST(MultiNode, FollowerFailureStopsNodeZeroAtOnce) {
  for (auto [tp, dp] : {std::pair{2, 1}, std::pair{2, 2}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " dp " + std::to_string(dp));
    std::atomic<bool> armed{false};
    std::string follower_error;
    two_nodes(
        "v2", tp, dp,
        [&](std::unique_ptr<RankSet> r0) {
          works_then_fails(*r0, armed, "node 1 failed: injected failure on node 1", std::chrono::seconds(10), 1,
                           "node 1 failed");
        },
        &follower_error, [](ParallelConfig& pc) { pc.step_timeout = std::chrono::seconds(40); },
        [&](ParallelConfig& pc) {
          pc.wrap_backend = [&](std::unique_ptr<Backend> made, int32_t) -> std::unique_ptr<Backend> {
            return std::make_unique<FailOnce>(std::move(made), armed, "injected failure on node 1");
          };
        },
        /*node_local_aborts=*/true);
    EXPECT_NE(follower_error.find("injected failure on node 1"), std::string::npos) << follower_error;
  }
}
