// A small blocking HTTP/1.1 client for tests (POSIX sockets, no Beast): raw requests, Content-Length and
// chunked responses, server-sent events, and abrupt disconnects.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "sanitizer_build.h"

namespace mlaserve::test {

struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;                            // de-chunked
};

class HttpConnection {
 public:
  explicit HttpConnection(int port, double timeout_s = 60.0) : timeout_s_(timeout_s * time_scale()) {
    deadline_ = std::chrono::steady_clock::time_point::max();
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd_ < 0) throw std::runtime_error("socket");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd_);
      fd_ = -1;
      throw std::runtime_error("connect to 127.0.0.1:" + std::to_string(port) + " failed");
    }
    int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  ~HttpConnection() { close(); }
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  // Abrupt close: RST instead of FIN, like a client that crashed.
  void reset() {
    if (fd_ < 0) return;
    linger l{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close();
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  void send_raw(const std::string& data) {
    size_t off = 0;
    while (off < data.size()) {
      ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("send failed");
      off += static_cast<size_t>(n);
    }
  }

  void send_request(const std::string& method, const std::string& path, const std::string& body = "",
                    const std::string& extra_headers = "") {
    std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra_headers;
    if (!body.empty() || method == "POST")
      req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
    req += "\r\n" + body;
    send_raw(req);
  }

  // After read_events: the rest of a chunked body, to its last chunk.
  std::string read_rest() {
    std::string body;
    while (true) {
      const size_t n = std::stoul(read_line(), nullptr, 16);
      if (n == 0) {
        read_line();
        return body;
      }
      body += read_exact(n);
      read_line();
    }
  }

  // Reads one whole response (of a HEAD request: the head alone, whatever Content-Length says).
  HttpResponse read_response(bool head_request = false) {
    HttpResponse r = read_head();
    if (head_request) return r;
    auto te = r.headers.find("transfer-encoding");
    if (te != r.headers.end() && te->second.find("chunked") != std::string::npos) {
      while (true) {
        std::string line = read_line();
        size_t n = std::stoul(line, nullptr, 16);
        if (n == 0) {
          read_line();
          break;
        }
        r.body += read_exact(n);
        read_line();
      }
    } else if (auto cl = r.headers.find("content-length"); cl != r.headers.end()) {
      r.body = read_exact(std::stoul(cl->second));
    }
    return r;
  }

  // Reads the response head, then de-chunked body bytes until `n_events` SSE events ("\n\n") arrived.
  HttpResponse read_events(size_t n_events) {
    HttpResponse r = read_head();
    if (auto cl = r.headers.find("content-length"); cl != r.headers.end()) {  // not a stream (an error)
      r.body = read_exact(std::stoul(cl->second));
      return r;
    }
    size_t seen = 0;
    while (seen < n_events) {
      std::string line = read_line();
      size_t n = std::stoul(line, nullptr, 16);
      if (n == 0) break;
      std::string chunk = read_exact(n);
      read_line();
      r.body += chunk;
      seen = 0;
      for (size_t p = r.body.find("\n\n"); p != std::string::npos; p = r.body.find("\n\n", p + 2)) ++seen;
    }
    return r;
  }

  // Reads fail ("read timed out") once `seconds` from now have passed, however steadily data arrives.
  void set_deadline(double seconds) {
    deadline_ = std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
  }

  bool peer_closed(double wait_s) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(wait_s * 1000)) <= 0) return false;
    char c;
    return ::recv(fd_, &c, 1, MSG_PEEK) == 0;
  }

 private:
  HttpResponse read_head() {
    HttpResponse r;
    std::string status = read_line();
    if (status.size() < 12) throw std::runtime_error("bad status line: " + status);
    r.status = std::stoi(status.substr(9, 3));
    while (true) {
      std::string line = read_line();
      if (line.empty()) break;
      size_t c = line.find(':');
      std::string name = line.substr(0, c);
      for (auto& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      size_t v = line.find_first_not_of(' ', c + 1);
      r.headers[name] = v == std::string::npos ? "" : line.substr(v);
    }
    return r;
  }

  void fill() {
    pollfd p{fd_, POLLIN, 0};
    auto wait_ms = static_cast<int64_t>(timeout_s_ * 1000);
    if (deadline_ != std::chrono::steady_clock::time_point::max()) {
      using std::chrono::milliseconds;
      const auto left = std::chrono::duration_cast<milliseconds>(deadline_ - std::chrono::steady_clock::now()).count();
      wait_ms = std::min<int64_t>(wait_ms, std::max<int64_t>(0, left));
    }
    if (wait_ms <= 0 || ::poll(&p, 1, static_cast<int>(wait_ms)) <= 0) throw std::runtime_error("read timed out");
    char buf[65536];
    ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) throw std::runtime_error("connection closed by the server");
    in_.append(buf, static_cast<size_t>(n));
  }
  std::string read_line() {
    size_t p;
    while ((p = in_.find("\r\n")) == std::string::npos) fill();
    std::string line = in_.substr(0, p);
    in_.erase(0, p + 2);
    return line;
  }
  std::string read_exact(size_t n) {
    while (in_.size() < n) fill();
    std::string out = in_.substr(0, n);
    in_.erase(0, n);
    return out;
  }

  int fd_ = -1;
  double timeout_s_;
  std::chrono::steady_clock::time_point deadline_;
  std::string in_;
};

inline HttpResponse http_request(int port, const std::string& method, const std::string& path,
                                 const std::string& body = "", const std::string& extra_headers = "") {
  HttpConnection c(port);
  c.send_request(method, path, body, extra_headers);
  return c.read_response();
}

// The payloads of `data: ...\n\n` events.
inline std::vector<std::string> sse_payloads(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    size_t s = body.find("data: ", pos);
    if (s == std::string::npos) break;
    size_t e = body.find("\n\n", s);
    if (e == std::string::npos) break;
    out.push_back(body.substr(s + 6, e - s - 6));
    pos = e + 2;
  }
  return out;
}

// Little-endian int32s from base64 (standard alphabet, padded), as a client decodes SGLang's routed_experts.
inline std::vector<int32_t> int32s_of_base64(const std::string& s) {
  const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string bytes;
  EXPECT_EQ(s.size() % 4, 0u) << s.substr(0, 80);
  for (size_t i = 0; i + 3 < s.size(); i += 4) {
    uint32_t n = 0;
    int pad = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = s[i + k];
      pad += c == '=' ? 1 : 0;
      const size_t d = c == '=' ? 0 : alphabet.find(c);
      EXPECT_NE(d, std::string::npos) << "not base64: " << c;
      n = (n << 6) | static_cast<uint32_t>(d == std::string::npos ? 0 : d);
    }
    bytes.push_back(static_cast<char>(n >> 16));
    if (pad < 2) bytes.push_back(static_cast<char>((n >> 8) & 0xff));
    if (pad < 1) bytes.push_back(static_cast<char>(n & 0xff));
  }
  EXPECT_EQ(bytes.size() % 4, 0u);
  std::vector<int32_t> ids(bytes.size() / 4);
  for (size_t i = 0; i < ids.size(); ++i) {
    uint32_t v = 0;
    for (int b = 3; b >= 0; --b) v = (v << 8) | static_cast<unsigned char>(bytes[i * 4 + static_cast<size_t>(b)]);
    ids[i] = static_cast<int32_t>(v);
  }
  return ids;
}

}  // namespace mlaserve::test
