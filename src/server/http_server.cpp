#include "server/http_server.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <optional>
#include <random>
#include <type_traits>
#include <vector>

#include "core/buffer_pool.h"
#include "core/error.h"
#include "core/log.h"
#include "core/thread.h"
#include "server/api_error.h"

namespace mlaserve::server {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

constexpr size_t kMaxPendingWriteBytes = 256u << 20;  // a client that stops reading is dropped past this
constexpr size_t kMaxPipelinedBytes = 1u << 20;

std::string status_line(int status) {
  return fmt::format("HTTP/1.1 {} {}\r\n", status,
                     std::string(http::obsolete_reason(static_cast<http::status>(status))));
}

using TlsStream = beast::ssl_stream<beast::tcp_stream>;

// One connection, over plain TCP (Stream = beast::tcp_stream) or TLS (TlsStream: --ssl-certfile). It is its own
// HttpExchange: HTTP/1.1 serves one request at a time per connection.
template <class Stream>
class Session : public HttpExchange, public std::enable_shared_from_this<Session<Stream>> {
  static constexpr bool kTls = std::is_same_v<Stream, TlsStream>;

 public:
  // stream_args: after the socket, what the stream takes (TLS: the server's ssl::context, which `keep` holds for as
  // long as the connection lives: --enable-ssl-refresh may replace the server's).
  template <class... StreamArgs>
  Session(tcp::socket&& socket, Api& api, const ServerOptions& opts, std::shared_ptr<void> keep,
          StreamArgs&... stream_args)
      : keep_(std::move(keep)), stream_(std::move(socket), stream_args...), timer_(stream_.get_executor()), api_(api),
        opts_(opts) {
    ++api_.metrics().open_connections;
  }
  ~Session() override { --api_.metrics().open_connections; }

  void run() {
    net::dispatch(stream_.get_executor(), [self = this->shared_from_this()] { self->start(); });
  }

  // ---- HttpExchange ----
  Executor executor() override {
    return [ex = stream_.get_executor()](std::function<void()> fn) { net::post(ex, std::move(fn)); };
  }

  void respond(int status, const std::string& content_type, std::string body) override {
    if (closed_ || response_started_) return;
    response_started_ = true;
    std::string out = status_line(status);
    out += fmt::format("Content-Type: {}\r\nContent-Length: {}\r\n", content_type, body.size());
    out += cors_headers_;
    out += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    if (head_) body.clear();  // HEAD: the headers GET would send, no body
    enqueue(std::move(out), /*last=*/true, std::move(body));
  }

  void start_stream() override {
    if (closed_ || response_started_) return;
    response_started_ = true;
    std::string out = status_line(200);
    out += "Content-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n";
    out += cors_headers_;
    out += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    enqueue(std::move(out), false);
  }

  void send_event(std::string payload) override { send_named_event({}, std::move(payload)); }

  // One server-sent event as one chunk: `event: <event>` (when named), then `data: <payload>`.
  void send_named_event(const std::string& event, std::string payload) override {
    if (closed_ || !response_started_ || response_ended_) return;
    const std::string head = event.empty() ? "data: " : fmt::format("event: {}\ndata: ", event);
    std::string out = fmt::format("{:x}\r\n", head.size() + payload.size() + 2);
    out += head;
    out += payload;
    out += "\n\n\r\n";
    enqueue(std::move(out), false);
  }

  void end_stream() override {
    if (closed_ || !response_started_ || response_ended_) return;
    enqueue("0\r\n\r\n", true);
  }

  void on_cancel(std::function<void(const std::string&)> fn) override { cancel_fn_ = std::move(fn); }

 private:
  beast::tcp_stream& transport() { return beast::get_lowest_layer(stream_); }

  // TLS: the handshake first (a client that does not complete it within the idle timeout is dropped).
  void start() {
    if constexpr (kTls) {
      transport().expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(opts_.idle_timeout_s)));
      stream_.async_handshake(net::ssl::stream_base::server, [self = this->shared_from_this()](beast::error_code ec) {
        if (ec) {
          MLA_LOG_DEBUG("TLS handshake failed: {}", ec.message());
          return self->close();
        }
        self->do_read();
      });
    } else {
      do_read();
    }
  }

  void do_read() {
    if (closed_) return;
    parser_.emplace();
    parser_->body_limit(opts_.max_body_bytes);
    parser_->header_limit(64 * 1024);
    response_started_ = response_ended_ = head_ = false;
    cors_headers_.clear();
    transport().expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(opts_.idle_timeout_s)));
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = this->shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
  }

  // Errors while reading a request: answer what can be answered (size limits), close on the rest.
  bool read_failed(beast::error_code ec) {
    if (!ec) return false;
    keep_alive_ = false;
    if (ec == http::error::body_limit) {
      reject(413, fmt::format("the request body exceeds the server's limit of {} bytes (see --max-body-bytes)",
                              opts_.max_body_bytes));
    } else if (ec == http::error::header_limit) {
      reject(431, "the request headers are too large");
    } else if (ec == http::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
               ec == net::error::operation_aborted || ec == net::error::connection_reset) {
      close();
    } else {
      reject(400, fmt::format("malformed HTTP request: {}", ec.message()));
    }
    return true;
  }

  void reject(int status, const std::string& message) {
    ++api_.metrics().client_errors_total;
    transport().expires_after(std::chrono::seconds(30));
    respond(status, "application/json", error_body(status, message));
  }

  void on_header(beast::error_code ec) {
    if (read_failed(ec)) return;
    keep_alive_ = parser_->get().keep_alive();
    auto expect = parser_->get().find(http::field::expect);
    if (expect != parser_->get().end() && beast::iequals(expect->value(), "100-continue")) {
      auto msg = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
      net::async_write(stream_, net::buffer(*msg),
                       [self = this->shared_from_this(), msg](beast::error_code ec2, size_t) {
                         if (ec2) return self->close();
                         self->read_body();
                       });
      return;
    }
    read_body();
  }

  void read_body() {
    http::async_read(stream_, buffer_, *parser_,
                     [self = this->shared_from_this()](beast::error_code ec, size_t) { self->on_request(ec); });
  }

  void on_request(beast::error_code ec) {
    if (read_failed(ec)) return;
    transport().expires_never();
    auto& msg = parser_->get();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    req.body = std::move(msg.body());
    if (auto it = msg.find(http::field::authorization); it != msg.end()) req.authorization = std::string(it->value());
    else if (auto key = msg.find("x-api-key"); key != msg.end())  // Anthropic's clients' header for the key
      req.authorization = "Bearer " + std::string(key->value());
    if (auto it = msg.find(http::field::content_type); it != msg.end()) req.content_type = std::string(it->value());
    if (auto it = msg.find(http::field::host); it != msg.end()) req.host = std::string(it->value());
    beast::error_code local_ec;
    const auto local = transport().socket().local_endpoint(local_ec);
    if (!local_ec) req.local_port = local.port();
    if (std::string id = header(msg, "X-Request-Id"); valid_request_id(id)) req.request_id = std::move(id);
    MLA_LOG_DEBUG("{} {} ({} bytes)", req.method, req.target, req.body.size());
    const std::string origin = header(msg, http::field::origin);
    const char* allow = allowed_origin(origin);
    if (allow) cors_headers_ = cors_allow(allow);
    if (opts_.request_id_headers) cors_headers_ += "X-Request-Id: " + request_id(req.request_id) + "\r\n";
    if (msg.method() == http::verb::options && msg.find(http::field::access_control_request_method) != msg.end())
      return preflight(origin, allow, header(msg, http::field::access_control_request_headers));
    if (msg.method() == http::verb::head) {  // answered as GET without the body
      head_ = true;
      req.method = "GET";
    }
    handling_ = true;
    start_monitor();
    if (opts_.request_timeout_s > 0) {
      timer_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(opts_.request_timeout_s)));
      timer_.async_wait([self = this->shared_from_this(), serial = serial_](beast::error_code tec) {
        if (tec || self->serial_ != serial || !self->handling_) return;
        self->timed_out();
      });
    }
    api_.handle(req, this->shared_from_this());
  }

  static std::string header(const http::request<http::string_body>& msg, http::field f) {
    auto it = msg.find(f);
    return it == msg.end() ? std::string() : std::string(it->value());
  }
  static std::string header(const http::request<http::string_body>& msg, std::string_view name) {
    auto it = msg.find(name);
    return it == msg.end() ? std::string() : std::string(it->value());
  }
  // The X-Request-Id a response carries: the request's own when it is 1-128 visible ASCII characters, else 32 new
  // hex digits.
  static std::string request_id(const std::string& given) {
    if (valid_request_id(given)) return given;
    thread_local std::mt19937_64 rng(std::random_device{}());
    return fmt::format("{:016x}{:016x}", rng(), rng());
  }

  // What Access-Control-Allow-Origin answers `origin` with ("*" or the origin itself), null when it is not allowed
  // or the request names none (not a cross-origin browser request: no CORS headers).
  const char* allowed_origin(const std::string& origin) const {
    if (origin.empty()) return nullptr;
    for (const std::string& o : opts_.allowed_origins) {
      if (o == "*") return "*";
      if (o == origin) return origin.c_str();
    }
    return nullptr;
  }
  static std::string cors_allow(const std::string& allow) {
    std::string h = "Access-Control-Allow-Origin: " + allow + "\r\n";
    if (allow != "*") h += "Vary: Origin\r\n";
    return h;
  }

  // A browser's CORS preflight (OPTIONS with Access-Control-Request-Method): answered here, before the API key is
  // checked, since browsers send it without credentials.
  void preflight(const std::string& origin, const char* allow, const std::string& request_headers) {
    handling_ = true;
    if (!allow) {
      ++api_.metrics().client_errors_total;
      respond(400, "application/json",
              error_body(400, fmt::format("CORS origin '{}' is not allowed (see --allowed-origins)", origin)));
      return;
    }
    response_started_ = true;
    std::string out = status_line(200);
    out += cors_headers_;
    out += "Access-Control-Allow-Methods: GET, POST, DELETE, HEAD, OPTIONS\r\n";
    out += fmt::format("Access-Control-Allow-Headers: {}\r\n", request_headers.empty() ? "*" : request_headers);
    out += "Access-Control-Max-Age: 600\r\nContent-Length: 0\r\n";
    out += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    enqueue(std::move(out), /*last=*/true);
  }

  // While a request is served, keep one read pending: it completes with an error when the client goes away,
  // which aborts the request in the engine. Bytes of a pipelined next request stay in buffer_.
  void start_monitor() {
    if (monitoring_ || closed_ || buffer_.size() > kMaxPipelinedBytes) return;
    monitoring_ = true;
    stream_.async_read_some(buffer_.prepare(4096), [self = this->shared_from_this()](beast::error_code ec, size_t n) {
      self->monitoring_ = false;
      if (!ec) {
        self->buffer_.commit(n);
        if (self->handling_) self->start_monitor();
        else self->do_read();
        return;
      }
      if (ec == net::error::operation_aborted && !self->handling_ && !self->closed_) {
        self->do_read();  // cancelled on purpose: the response is complete, read the next request
        return;
      }
      if (self->handling_) self->client_gone("client disconnected");
      else self->close();
    });
  }

  void client_gone(const std::string& why) {
    closed_ = true;
    fire_cancel(why);
    close();
  }

  void timed_out() {
    const std::string why = fmt::format("request timed out after {} s", opts_.request_timeout_s);
    fire_cancel(why);
    if (!response_started_) {
      keep_alive_ = false;
      respond(408, "application/json", error_body(408, why, "timeout_error", "request_timeout"));
    } else {
      close();
    }
  }

  void fire_cancel(const std::string& why) {
    if (auto fn = std::move(cancel_fn_)) {
      cancel_fn_ = nullptr;
      fn(why);
    }
  }

  // Queues `bytes`, then `more` (a response's body, not copied onto its head), and writes unless a write is running.
  void enqueue(std::string bytes, bool last, std::string more = {}) {
    pending_bytes_ += bytes.size() + more.size();
    queue_.push_back(std::move(bytes));
    if (!more.empty()) queue_.push_back(std::move(more));
    if (last) response_ended_ = true;
    if (pending_bytes_ > kMaxPendingWriteBytes) return client_gone("client not reading its response");
    if (!writing_) do_write();
  }

  void do_write() {
    in_flight_.clear();  // one write for everything queued (a gathering write: the strings are not copied)
    while (!queue_.empty()) {
      in_flight_.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    std::vector<net::const_buffer> buffers;
    buffers.reserve(in_flight_.size());
    for (const std::string& b : in_flight_) buffers.push_back(net::buffer(b));
    pending_bytes_ = 0;
    writing_ = true;
    const bool ends_response = response_ended_;
    net::async_write(stream_, buffers,
                     [self = this->shared_from_this(), ends_response](beast::error_code ec, size_t) {
                       self->writing_ = false;
                       for (std::string& b : self->in_flight_)  // (large bodies' memory, e.g. KV exports', reused)
                         BufferPool::global().give(std::move(b));
                       self->in_flight_.clear();
                       if (ec) {
                         if (self->handling_) self->client_gone("client disconnected");
                         else self->close();
                         return;
                       }
                       if (!self->queue_.empty()) return self->do_write();
                       if (ends_response && self->response_ended_) self->finish_response();
                     });
  }

  void finish_response() {
    handling_ = false;
    cancel_fn_ = nullptr;
    ++serial_;
    timer_.cancel();
    if (closed_) return;
    if (!keep_alive_) {
      beast::error_code ec;
      transport().socket().shutdown(tcp::socket::shutdown_send, ec);
      return close();
    }
    if (monitoring_) {
      beast::error_code ec;
      transport().socket().cancel(ec);  // its handler starts the next read
    } else {
      do_read();
    }
  }

  void close() {
    closed_ = true;
    handling_ = false;
    cancel_fn_ = nullptr;
    timer_.cancel();
    beast::error_code ec;
    transport().socket().close(ec);
  }

  std::shared_ptr<void> keep_;  // (destroyed after the stream)
  Stream stream_;
  net::steady_timer timer_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  Api& api_;
  const ServerOptions& opts_;
  std::function<void(const std::string&)> cancel_fn_;
  std::deque<std::string> queue_;
  std::vector<std::string> in_flight_;  // what the running write sends
  size_t pending_bytes_ = 0;
  uint64_t serial_ = 0;
  bool keep_alive_ = true;
  bool handling_ = false;
  bool monitoring_ = false;
  bool writing_ = false;
  bool response_started_ = false;
  bool response_ended_ = false;
  bool closed_ = false;
  bool head_ = false;         // the request is a HEAD: responses carry no body
  std::string cors_headers_;  // the request's CORS response headers (empty: none)
};

}  // namespace

struct HttpServer::Impl {
  Impl(Api& api, const ServerOptions& opts) : api(api), opts(opts), acceptor(ioc) {}

  void do_accept() {
    acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
      if (ec) {
        if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
        MLA_LOG_WARN("accept: {}", ec.message());
      } else {
        beast::error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);
        if (tls && opts.ssl_refresh) refresh_tls();
        if (tls) std::make_shared<Session<TlsStream>>(std::move(socket), api, opts, tls, *tls)->run();
        else std::make_shared<Session<beast::tcp_stream>>(std::move(socket), api, opts, nullptr)->run();
      }
      do_accept();
    });
  }

  // --enable-ssl-refresh: when a certificate file's modification time changed, new connections get a context made
  // from the files as they are now (kept as they were while the files do not make a usable one, e.g. mid-rotation).
  void refresh_tls();

  Api& api;
  ServerOptions opts;
  std::shared_ptr<net::ssl::context> tls;  // --ssl-certfile: every connection speaks TLS
  std::vector<std::filesystem::file_time_type> tls_times;  // of the files `tls` was made from
  net::io_context ioc;
  tcp::acceptor acceptor;
  std::vector<Thread> threads;  // kInputStackBytes each: the handlers parse clients' nested input
  int bound_port = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool stopped = false;
  bool signalled = false;
};

namespace {

// The modification times of the TLS files (the minimum for one that cannot be read).
std::vector<std::filesystem::file_time_type> tls_file_times(const ServerOptions& opts) {
  std::vector<std::filesystem::file_time_type> times;
  for (const std::string* f : {&opts.ssl_certfile, &opts.ssl_keyfile, &opts.ssl_ca_certs}) {
    std::error_code ec;
    const auto t = f->empty() ? std::filesystem::file_time_type::min() : std::filesystem::last_write_time(*f, ec);
    times.push_back(ec ? std::filesystem::file_time_type::min() : t);
  }
  return times;
}

// The TLS context of ServerOptions' ssl_* (none without a certificate); throws naming the flag and file that cannot
// be used.
std::shared_ptr<net::ssl::context> tls_context(const ServerOptions& opts) {
  const bool cert = !opts.ssl_certfile.empty(), key = !opts.ssl_keyfile.empty();
  MLA_CHECK(cert == key, "--ssl-certfile and --ssl-keyfile come together (a certificate and its private key)");
  MLA_CHECK(cert || opts.ssl_ca_certs.empty(), "--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile");
  MLA_CHECK(opts.ssl_cert_reqs >= 0 && opts.ssl_cert_reqs <= 2,
            "--ssl-cert-reqs: {} (0: no client certificate, 1: optional, 2: required)", opts.ssl_cert_reqs);
  MLA_CHECK(opts.ssl_cert_reqs == 0 || !opts.ssl_ca_certs.empty(),
            "--ssl-cert-reqs {} checks client certificates against --ssl-ca-certs, which is not given",
            opts.ssl_cert_reqs);
  if (!cert) return nullptr;
  auto tls = std::make_shared<net::ssl::context>(net::ssl::context::tls_server);
  net::ssl::context& c = *tls;
  c.set_options(net::ssl::context::default_workarounds | net::ssl::context::no_sslv2 |
                net::ssl::context::no_sslv3 | net::ssl::context::no_tlsv1 | net::ssl::context::no_tlsv1_1 |
                net::ssl::context::single_dh_use);
  // Always a callback: without one OpenSSL asks for an encrypted key's password on the terminal (and waits).
  c.set_password_callback([pw = opts.ssl_keyfile_password](size_t, net::ssl::context::password_purpose) {
    return pw;
  });
  beast::error_code ec;
  c.use_certificate_chain_file(opts.ssl_certfile, ec);
  MLA_CHECK(!ec, "--ssl-certfile '{}': {}", opts.ssl_certfile, ec.message());
  c.use_private_key_file(opts.ssl_keyfile, net::ssl::context::pem, ec);
  MLA_CHECK(!ec, "--ssl-keyfile '{}': {}{}", opts.ssl_keyfile, ec.message(),
            opts.ssl_keyfile_password.empty() && ec.message().find("mismatch") == std::string::npos
                ? " (an encrypted key needs --ssl-keyfile-password)"
                : "");
  if (!opts.ssl_ca_certs.empty()) {
    c.load_verify_file(opts.ssl_ca_certs, ec);
    MLA_CHECK(!ec, "--ssl-ca-certs '{}': {}", opts.ssl_ca_certs, ec.message());
  }
  c.set_verify_mode(opts.ssl_cert_reqs == 2   ? net::ssl::verify_peer | net::ssl::verify_fail_if_no_peer_cert
                    : opts.ssl_cert_reqs == 1 ? net::ssl::verify_peer
                                              : net::ssl::verify_none);
  return tls;
}

}  // namespace

void HttpServer::check_tls(const ServerOptions& opts) { (void)tls_context(opts); }

void HttpServer::Impl::refresh_tls() {
  std::vector<std::filesystem::file_time_type> now = tls_file_times(opts);
  if (now == tls_times) return;
  tls_times = std::move(now);  // (files that do not make a context are tried again when they change again)
  try {
    tls = tls_context(opts);
    MLA_LOG_INFO("TLS: the certificate files changed; new connections use them (--enable-ssl-refresh)");
  } catch (const Error& e) {
    MLA_LOG_WARN("TLS: the certificate files changed but cannot be used yet ({}); keeping the previous ones", e.what());
  }
}

HttpServer::HttpServer(Api& api, const ServerOptions& opts) : impl_(std::make_unique<Impl>(api, opts)) {}

HttpServer::~HttpServer() { stop(); }

void HttpServer::start() {
  Impl& s = *impl_;
  s.tls_times = tls_file_times(s.opts);
  s.tls = tls_context(s.opts);
  beast::error_code ec;
  const auto addr = net::ip::make_address(s.opts.host, ec);
  MLA_CHECK(!ec, "--host: '{}' is not an IP address ({})", s.opts.host, ec.message());
  tcp::endpoint ep(addr, static_cast<unsigned short>(s.opts.port));
  s.acceptor.open(ep.protocol(), ec);
  MLA_CHECK(!ec, "cannot open a socket: {}", ec.message());
  s.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  s.acceptor.bind(ep, ec);
  MLA_CHECK(!ec, "cannot listen on {}:{}: {}", s.opts.host, s.opts.port, ec.message());
  s.acceptor.listen(net::socket_base::max_listen_connections, ec);
  MLA_CHECK(!ec, "cannot listen on {}:{}: {}", s.opts.host, s.opts.port, ec.message());
  s.bound_port = s.acceptor.local_endpoint().port();
  s.do_accept();
  const int n = std::max(1, s.opts.num_threads);
  for (int i = 0; i < n; ++i) s.threads.emplace_back(kInputStackBytes, [&s] { s.ioc.run(); });
}

int HttpServer::port() const { return impl_->bound_port; }

void HttpServer::stop() {
  Impl& s = *impl_;
  {
    std::lock_guard lk(s.mu);
    if (s.stopped) return;
    s.stopped = true;
  }
  s.cv.notify_all();
  net::post(s.ioc, [&s] {
    beast::error_code ec;
    s.acceptor.close(ec);
  });
  s.ioc.stop();
  for (auto& t : s.threads)
    if (t.joinable()) t.join();
}

void HttpServer::wait_for_signal() {
  Impl& s = *impl_;
  net::signal_set signals(s.ioc, SIGINT, SIGTERM);
  signals.async_wait([&s](beast::error_code ec, int sig) {
    if (ec) return;
    MLA_LOG_INFO("signal {}: shutting down", sig);
    std::lock_guard lk(s.mu);
    s.signalled = true;
    s.cv.notify_all();
  });
  std::unique_lock lk(s.mu);
  s.cv.wait(lk, [&s] { return s.stopped || s.signalled; });
  lk.unlock();
  beast::error_code ec;
  signals.cancel(ec);
}

}  // namespace mlaserve::server
