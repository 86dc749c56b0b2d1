// The multi-node path without GPUs: two simulated nodes in one process (two RankSets joined by a real TCP
// NodeLink on loopback, their CPU ranks sharing in-process communicators). Node 0 drives; node 1 follows, and
// returns the outputs of the DP groups it leads. Results must equal one node running every rank.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <mutex>
#include <thread>

#include "engine/offline.h"
#include "io/safetensors.h"
#include "parallel/inprocess_communicator.h"
#include "test_util.h"

using namespace mlaserve;

namespace {



// Runs `tp` ranks (`dp` attention-DP groups) as two nodes; returns node 0's offline result.
OfflineResult two_nodes(const std::string& fam, int tp, int dp, const std::vector<std::vector<int32_t>>& ps,
                        const OfflineOptions& o) {
  const ModelConfig cfg = ModelConfig::from_file(test::golden_dir(fam));
  // Communicators shared by the simulated nodes: the world, and one group per DP group.
  auto world = make_inprocess_communicators(tp);
  const int at = tp / dp;
  std::vector<std::vector<std::unique_ptr<InProcessCommunicator>>> attn(static_cast<size_t>(dp));
  if (at > 1 && dp > 1)
    for (int g = 0; g < dp; ++g) attn[static_cast<size_t>(g)] = make_inprocess_communicators(at);
  std::mutex mu;
  auto factory = [&](int32_t rank, int32_t group) -> std::unique_ptr<Communicator> {
    std::lock_guard<std::mutex> lk(mu);
    if (group < 0) return std::move(world[static_cast<size_t>(rank)]);
    return std::move(attn[static_cast<size_t>(group)][static_cast<size_t>(rank % at)]);
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
  std::thread follower([&] {
    try {
      RankSet r1(cfg, pc(1), test::golden_dir(fam), {});
      r1.follow();
    } catch (const std::exception& e) {
      follower_error = e.what();
    }
  });
  OfflineResult res;
  {
    RankSet r0(cfg, pc(0), test::golden_dir(fam), {});
    res = run_offline(r0, ps, o);
  }  // r0 tells node 1 to stop
  follower.join();
  EXPECT_EQ(follower_error, "");
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
    OfflineResult r = two_nodes("v2", l.tp, l.dp, ps, o);
    ASSERT_EQ(r.greedy.size(), ref.greedy.size());
    for (size_t j = 0; j < ps.size(); ++j) {
      EXPECT_LT(test::rel_err(r.prompt_logits[j], ref.prompt_logits[j]), 1e-4) << "prompt " << j;
      EXPECT_EQ(r.greedy[j], ref.greedy[j]) << "prompt " << j;
    }
  }
}
