// Multi-node rendezvous over loopback: nodes agree, payload reaches every node, messages flow both ways;
// a node that never arrives and nodes that disagree on sizes give clear errors.
#include <gtest/gtest.h>

#include <thread>

#include "core/error.h"
#include "parallel/rendezvous.h"
#include "test_util.h"

using namespace mlaserve;

namespace {
RendezvousConfig cfg(int nnodes, int rank, const std::string& a, int ms = 5000, int rpn = 2) {
  RendezvousConfig c;
  c.nnodes = nnodes;
  c.node_rank = rank;
  c.ranks_per_node = rpn;
  c.addr = a;
  c.timeout = std::chrono::milliseconds(ms);
  return c;
}
}  // namespace

TEST(Rendezvous, ThreeNodesExchangePayloadAndMessages) {
  const std::string a = test::free_loopback_addr();
  std::vector<std::unique_ptr<NodeLink>> links(3);
  std::vector<std::thread> ts;
  for (int r = 2; r >= 1; --r)  // followers first: they retry until node 0 listens
    ts.emplace_back([&, r] { links[r] = NodeLink::connect(cfg(3, r, a), ""); });
  links[0] = NodeLink::connect(cfg(3, 0, a), "the-unique-id");
  for (auto& t : ts) t.join();
  EXPECT_EQ(links[1]->payload(), "the-unique-id");
  EXPECT_EQ(links[2]->payload(), "the-unique-id");
  links[0]->broadcast("step 1");
  EXPECT_EQ(links[1]->recv(), "step 1");
  EXPECT_EQ(links[2]->recv(), "step 1");
  links[2]->send(std::string(100000, 'x'));
  EXPECT_EQ(links[0]->recv_from(2).size(), 100000u);
}

TEST(Rendezvous, MissingNodeTimesOutNamingIt) {
  try {
    NodeLink::connect(cfg(3, 0, test::free_loopback_addr(), 300), "id");
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("never arrived"), std::string::npos) << m;
    EXPECT_NE(m.find("1, 2"), std::string::npos) << m;
  }
  try {
    NodeLink::connect(cfg(2, 1, test::free_loopback_addr(), 300), "");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("could not reach node 0"), std::string::npos) << e.what();
  }
}

TEST(Rendezvous, DisagreeingSizesAreRefused) {
  const std::string a = test::free_loopback_addr();
  std::string follower_err;
  std::thread t([&] {
    try {
      NodeLink::connect(cfg(3, 1, a, 3000), "");  // says 3 nodes; node 0 says 2
    } catch (const Error& e) {
      follower_err = e.what();
    }
  });
  try {
    NodeLink::connect(cfg(2, 0, a, 3000), "id");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gave --nnodes 3 but node 0 has --nnodes 2"), std::string::npos) << e.what();
  }
  t.join();
  EXPECT_NE(follower_err.find("refused"), std::string::npos) << follower_err;
  EXPECT_THROW(parse_host_port("nohost"), Error);
  EXPECT_THROW(parse_host_port("h:99999"), Error);
}
