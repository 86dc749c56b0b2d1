// Multi-node rendezvous and control channel over TCP (one process per node).
// Node 0 listens on --dist-init-addr host:port; every other node connects (retrying until the timeout), sends
// (nnodes, node_rank, ranks_per_node) and receives node 0's payload (e.g. the NCCL unique id). Node 0 checks
// that all nodes agree on the sizes and that each node rank arrives once; errors name the node and the flag.
// The connections stay open as the control channel: node 0 sends each step to the others and receives what
// they send back (framed messages: u64 length + bytes).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mlaserve {

struct RendezvousConfig {
  int32_t nnodes = 1;
  int32_t node_rank = 0;
  int32_t ranks_per_node = 1;
  std::string addr;  // host:port
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
};

class NodeLink {
 public:
  // Node 0: payload is handed to every node. Other nodes: payload is ignored; payload() returns node 0's.
  static std::unique_ptr<NodeLink> connect(const RendezvousConfig& cfg, const std::string& payload);
  ~NodeLink();

  int32_t nnodes() const { return cfg_.nnodes; }
  int32_t node_rank() const { return cfg_.node_rank; }
  const std::string& payload() const { return payload_; }

  // Node 0 only.
  void send_to(int32_t node, const std::string& msg);
  std::string recv_from(int32_t node);
  void broadcast(const std::string& msg) {
    for (int32_t n = 1; n < cfg_.nnodes; ++n) send_to(n, msg);
  }
  // Without blocking or taking any other message: the first node whose next message starts with byte `fail_op`
  // (that message is taken and returned, less the byte) or whose connection is closed or broken (a description).
  struct NodeFailure {
    int32_t node = 0;
    std::string what;
  };
  std::optional<NodeFailure> poll_failure(char fail_op);
  // Other nodes: talk to node 0.
  void send(const std::string& msg);
  std::string recv();

 private:
  NodeLink() = default;
  RendezvousConfig cfg_;
  std::string payload_;
  int listen_fd_ = -1;
  std::vector<int> fds_;  // node 0: one per node (index = node rank, [0] unused); others: [0] = node 0
};

// "host:port" -> (host, port); throws naming --dist-init-addr.
std::pair<std::string, uint16_t> parse_host_port(const std::string& addr);

}  // namespace mlaserve
