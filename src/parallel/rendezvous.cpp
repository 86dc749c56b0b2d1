#include "parallel/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace mlaserve {

namespace {

constexpr uint32_t kMagic = 0x4d4c4153;  // "MLAS"

void write_all(int fd, const void* p, size_t n, const char* what) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    MLA_CHECK(w > 0, "multi-node link: sending {} failed: {}", what, std::strerror(errno));
    c += w;
    n -= static_cast<size_t>(w);
  }
}

void read_all(int fd, void* p, size_t n, const char* what) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    MLA_CHECK(r > 0, "multi-node link: receiving {} failed: {}", what,
              r == 0 ? "the other node closed the connection" : std::strerror(errno));
    c += r;
    n -= static_cast<size_t>(r);
  }
}

void send_msg(int fd, const std::string& m) {
  uint64_t n = m.size();
  write_all(fd, &n, 8, "a message length");
  write_all(fd, m.data(), m.size(), "a message");
}

std::string recv_msg(int fd) {
  uint64_t n = 0;
  read_all(fd, &n, 8, "a message length");
  MLA_CHECK(n < (uint64_t{1} << 36), "multi-node link: implausible message of {} bytes", n);
  std::string m(n, '\0');
  read_all(fd, m.data(), n, "a message");
  return m;
}

sockaddr_in resolve(const std::string& host, uint16_t port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  MLA_CHECK(rc == 0 && res, "--dist-init-addr: cannot resolve host '{}': {}", host, gai_strerror(rc));
  sockaddr_in a = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  a.sin_port = htons(port);
  ::freeaddrinfo(res);
  return a;
}

}  // namespace

std::pair<std::string, uint16_t> parse_host_port(const std::string& addr) {
  const auto colon = addr.rfind(':');
  MLA_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < addr.size(),
            "--dist-init-addr '{}': expected host:port", addr);
  int port = 0;
  try {
    size_t pos = 0;
    port = std::stoi(addr.substr(colon + 1), &pos);
    MLA_CHECK(pos == addr.size() - colon - 1, "bad port");
  } catch (const std::exception&) {
    fail("--dist-init-addr '{}': the port is not a number", addr);
  }
  MLA_CHECK(port > 0 && port < 65536, "--dist-init-addr '{}': port out of range", addr);
  return {addr.substr(0, colon), static_cast<uint16_t>(port)};
}

std::unique_ptr<NodeLink> NodeLink::connect(const RendezvousConfig& cfg, const std::string& payload) {
  MLA_CHECK(cfg.nnodes >= 1, "--nnodes must be >= 1, got {}", cfg.nnodes);
  MLA_CHECK(cfg.node_rank >= 0 && cfg.node_rank < cfg.nnodes, "--node-rank {} must be in [0, --nnodes {})",
            cfg.node_rank, cfg.nnodes);
  std::unique_ptr<NodeLink> link(new NodeLink());
  link->cfg_ = cfg;
  if (cfg.nnodes == 1) {
    link->payload_ = payload;
    return link;
  }
  MLA_CHECK(!cfg.addr.empty(), "--nnodes {} needs --dist-init-addr host:port", cfg.nnodes);
  auto [host, port] = parse_host_port(cfg.addr);
  const sockaddr_in sa = resolve(host, port);
  const auto deadline = std::chrono::steady_clock::now() + cfg.timeout;
  auto ms_left = [&] {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count()));
  };
  link->fds_.assign(static_cast<size_t>(cfg.nnodes), -1);

  if (cfg.node_rank == 0) {
    link->payload_ = payload;
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    MLA_CHECK(fd >= 0, "multi-node link: socket(): {}", std::strerror(errno));
    link->listen_fd_ = fd;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    MLA_CHECK(::bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0,
              "--dist-init-addr {}: node 0 cannot listen there: {}", cfg.addr, std::strerror(errno));
    MLA_CHECK(::listen(fd, cfg.nnodes) == 0, "multi-node link: listen(): {}", std::strerror(errno));
    int arrived = 1;
    while (arrived < cfg.nnodes) {
      pollfd pfd{fd, POLLIN, 0};
      const int pr = ::poll(&pfd, 1, ms_left());
      if (pr == 0) {
        std::string missing;
        for (int32_t n = 1; n < cfg.nnodes; ++n)
          if (link->fds_[static_cast<size_t>(n)] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(n);
        fail("node 0 waited {} s at {} for node(s) {} that never arrived (check --nnodes, --node-rank and "
             "--dist-init-addr on every node)",
             cfg.timeout.count() / 1000.0, cfg.addr, missing);
      }
      if (pr < 0 && errno == EINTR) continue;
      int c = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      uint32_t hdr[4];
      try {
        read_all(c, hdr, sizeof hdr, "the node header");
      } catch (const Error&) {
        ::close(c);
        continue;
      }
      std::string err;
      const int32_t nr = static_cast<int32_t>(hdr[2]);
      if (hdr[0] != kMagic) err = "not an mlaserve node";
      else if (static_cast<int32_t>(hdr[1]) != cfg.nnodes)
        err = fmt::format("node {} gave --nnodes {} but node 0 has --nnodes {}", nr, hdr[1], cfg.nnodes);
      else if (nr <= 0 || nr >= cfg.nnodes) err = fmt::format("--node-rank {} is out of range for --nnodes {}", nr, cfg.nnodes);
      else if (link->fds_[static_cast<size_t>(nr)] >= 0) err = fmt::format("two nodes claim --node-rank {}", nr);
      else if (static_cast<int32_t>(hdr[3]) != cfg.ranks_per_node)
        err = fmt::format("node {} has {} ranks but node 0 has {}: every node must run the same number of GPUs", nr,
                          hdr[3], cfg.ranks_per_node);
      uint32_t status = err.empty() ? 0 : 1;
      write_all(c, &status, 4, "the rendezvous status");
      send_msg(c, err.empty() ? payload : err);
      if (!err.empty()) {
        ::close(c);
        fail("multi-node rendezvous: {}", err);
      }
      link->fds_[static_cast<size_t>(nr)] = c;
      ++arrived;
      MLA_LOG_INFO("node {} joined ({}/{})", nr, arrived, cfg.nnodes);
    }
    return link;
  }

  // Other nodes: connect, retrying until node 0 listens.
  int fd = -1;
  for (;;) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    MLA_CHECK(fd >= 0, "multi-node link: socket(): {}", std::strerror(errno));
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0) break;
    ::close(fd);
    if (ms_left() == 0)
      fail("node {} could not reach node 0 at {} within {} s (is node 0 started with the same --dist-init-addr?)",
           cfg.node_rank, cfg.addr, cfg.timeout.count() / 1000.0);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  link->fds_[0] = fd;
  uint32_t hdr[4] = {kMagic, static_cast<uint32_t>(cfg.nnodes), static_cast<uint32_t>(cfg.node_rank),
                     static_cast<uint32_t>(cfg.ranks_per_node)};
  write_all(fd, hdr, sizeof hdr, "the node header");
  uint32_t status = 1;
  read_all(fd, &status, 4, "the rendezvous status");
  std::string reply = recv_msg(fd);
  MLA_CHECK(status == 0, "multi-node rendezvous refused by node 0: {}", reply);
  link->payload_ = reply;
  return link;
}

NodeLink::~NodeLink() {
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void NodeLink::send_to(int32_t node, const std::string& msg) {
  MLA_CHECK(cfg_.node_rank == 0 && node > 0 && node < cfg_.nnodes, "NodeLink::send_to({}) from node {}", node, cfg_.node_rank);
  send_msg(fds_[static_cast<size_t>(node)], msg);
}

std::string NodeLink::recv_from(int32_t node) {
  MLA_CHECK(cfg_.node_rank == 0 && node > 0 && node < cfg_.nnodes, "NodeLink::recv_from({}) on node {}", node, cfg_.node_rank);
  return recv_msg(fds_[static_cast<size_t>(node)]);
}

std::optional<NodeLink::NodeFailure> NodeLink::poll_failure(char fail_op) {
  MLA_CHECK(cfg_.node_rank == 0, "NodeLink::poll_failure on node {}", cfg_.node_rank);
  for (int32_t node = 1; node < cfg_.nnodes; ++node) {
    const int fd = fds_[static_cast<size_t>(node)];
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) continue;
    char head[9];  // the length, then the message's first byte
    const ssize_t r = ::recv(fd, head, sizeof head, MSG_PEEK | MSG_DONTWAIT);
    if (r == 0) return NodeFailure{node, "it closed the connection"};
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return NodeFailure{node, fmt::format("its connection failed: {}", std::strerror(errno))};
    }
    if (r < static_cast<ssize_t>(sizeof head) || head[8] != fail_op) continue;  // a reply, or not all here yet
    const std::string m = recv_msg(fd);
    return NodeFailure{node, m.substr(1)};
  }
  return std::nullopt;
}

void NodeLink::send(const std::string& msg) {
  MLA_CHECK(cfg_.node_rank > 0, "NodeLink::send on node 0");
  send_msg(fds_[0], msg);
}

std::string NodeLink::recv() {
  MLA_CHECK(cfg_.node_rank > 0, "NodeLink::recv on node 0");
  return recv_msg(fds_[0]);
}

}  // namespace mlaserve
