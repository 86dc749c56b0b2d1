// The HTTP client side, for requests of one answer each on a connection of their own: bench-serving's control calls
// (model info, flush) and a decode server's reads of a prefill server's KV (server/kv_transfer.h). The streamed
// generation requests of bench-serving keep their own asynchronous client; they share tls_client_setup.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include <boost/asio/ssl/context.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>

namespace mlaserve::server {

using TlsStream = boost::beast::ssl_stream<boost::beast::tcp_stream>;

// TLS: the server's name for SNI and for checking its certificate (an IP address checks the certificate's IP
// entries).
void tls_client_setup(TlsStream& stream, const std::string& host);

struct HttpCall {
  std::string host, port;
  std::string method = "GET";
  std::string target;
  std::string body;           // sent as application/json when not empty
  std::string authorization;  // the Authorization header (empty: none)
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};  // the whole exchange, connection included
  size_t body_limit = size_t{1} << 30;                          // the answer's
  boost::asio::ssl::context* tls = nullptr;                     // https (null: plain HTTP)
};
struct HttpAnswer {
  int status = 0;
  std::string body;
};
// The request and its answer; throws mlaserve::Error naming the step that failed ("connecting host:port: ...").
// The answer's body is read into `answer_storage`'s memory (an empty string whose capacity is reused: no fresh pages
// for a large answer) while it fits.
HttpAnswer http_call(const HttpCall& call, std::string answer_storage = {});

}  // namespace mlaserve::server
