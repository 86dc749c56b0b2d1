// Multi-node rendezvous over loopback: nodes agree, payload reaches every node, messages flow both ways;
// a node that never arrives and nodes that disagree on sizes give clear errors.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "core/error.h"
#include "parallel/rendezvous.h"

using namespace mlaserve;

namespace {
// A port nobody listens on right now (the kernel picks it), so parallel test processes never collide.
std::string addr(int) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
}
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
  const std::string a = addr(1);
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
    NodeLink::connect(cfg(3, 0, addr(2), 300), "id");
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("never arrived"), std::string::npos) << m;
    EXPECT_NE(m.find("1, 2"), std::string::npos) << m;
  }
  try {
    NodeLink::connect(cfg(2, 1, addr(3), 300), "");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("could not reach node 0"), std::string::npos) << e.what();
  }
}

TEST(Rendezvous, DisagreeingSizesAreRefused) {
  const std::string a = addr(4);
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
