#include "server/http_client.h"

#include <openssl/ssl.h>

#include <type_traits>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/host_name_verification.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include "core/error.h"

namespace mlaserve::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

void tls_client_setup(TlsStream& stream, const std::string& host) {
  MLA_CHECK(SSL_set_tlsext_host_name(stream.native_handle(), host.c_str()) == 1, "TLS: bad server name '{}'", host);
  stream.set_verify_callback(net::ssl::host_name_verification(host));
}

namespace {

// The exchange on `stream` (asynchronous, so the timeout holds for every step), run to its end on `ioc`.
template <class Stream>
HttpAnswer exchange(net::io_context& ioc, Stream& stream, const HttpCall& c, std::string storage) {
  beast::tcp_stream& lowest = beast::get_lowest_layer(stream);
  http::request<http::string_body> req{http::string_to_verb(c.method), c.target, 11};
  MLA_CHECK(req.method() != http::verb::unknown, "HTTP client: unknown method '{}'", c.method);
  req.set(http::field::host, c.host.find(':') != std::string::npos ? "[" + c.host + "]:" + c.port
                                                                    : c.host + ":" + c.port);
  if (!c.authorization.empty()) req.set(http::field::authorization, c.authorization);
  if (!c.body.empty()) {
    req.set(http::field::content_type, "application/json");
    req.body() = c.body;
  }
  req.prepare_payload();
  beast::flat_buffer buf;
  buf.reserve(1 << 20);  // (reads as large as the room here: an empty buffer reads a body 512 bytes at a time)
  http::response_parser<http::string_body> parser;
  parser.body_limit(c.body_limit);
  storage.clear();
  parser.get().body() = std::move(storage);  // (the body is appended to it: its capacity is used first)
  beast::error_code failed;
  std::string step = "resolving";
  auto ok = [&](beast::error_code ec, const char* next) {  // (step: the one that failed, or "done")
    if (ec) failed = ec;
    else step = next;
    return !ec;
  };
  auto send = [&] {
    http::async_write(stream, req, [&](beast::error_code ec, size_t) {
      if (!ok(ec, "reading the answer")) return;
      http::async_read(stream, buf, parser, [&](beast::error_code ec2, size_t) { ok(ec2, "done"); });
    });
  };
  tcp::resolver resolver(ioc);
  lowest.expires_after(c.timeout);
  resolver.async_resolve(c.host, c.port, [&](beast::error_code ec, tcp::resolver::results_type eps) {
    if (!ok(ec, "connecting")) return;
    lowest.async_connect(eps, [&](beast::error_code ec2, const tcp::endpoint&) {
      if (!ok(ec2, std::is_same_v<Stream, TlsStream> ? "the TLS handshake" : "sending")) return;
      beast::error_code ignored;  // (header and body go out as they are written: no Nagle wait for the server's ACK)
      lowest.socket().set_option(tcp::no_delay(true), ignored);
      if constexpr (std::is_same_v<Stream, TlsStream>) {
        tls_client_setup(stream, c.host);
        stream.async_handshake(net::ssl::stream_base::client, [&](beast::error_code ec3) {
          if (ok(ec3, "sending")) send();
        });
      } else {
        send();
      }
    });
  });
  ioc.run();
  if (failed) fail("{} {}:{}: {}", step, c.host, c.port, failed.message());
  beast::error_code ignored;
  lowest.socket().shutdown(tcp::socket::shutdown_both, ignored);
  return {static_cast<int>(parser.get().result_int()), std::move(parser.get().body())};
}

}  // namespace

HttpAnswer http_call(const HttpCall& call, std::string answer_storage) {
  net::io_context ioc;
  if (call.tls) {
    TlsStream stream(ioc, *call.tls);
    return exchange(ioc, stream, call, std::move(answer_storage));
  }
  beast::tcp_stream stream(ioc);
  return exchange(ioc, stream, call, std::move(answer_storage));
}

}  // namespace mlaserve::server
