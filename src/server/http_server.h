// HttpServer: the Boost.Beast front door. A few io_context threads serve every connection (thousands of
// concurrent streams are fine: nothing blocks). HTTP/1.1 keep-alive, a configurable body limit, SSE streaming
// (chunked), and disconnect detection while a request is being served (the request is then aborted in the
// engine at once). Routing and responses live in Api; this layer only moves bytes.
#pragma once

#include <memory>

#include "server/api.h"

namespace mlaserve::server {

class HttpServer {
 public:
  HttpServer(Api& api, const ServerOptions& opts);
  ~HttpServer();
  // Whether ServerOptions' TLS files make a TLS context (throws naming the flag and file otherwise): a check before
  // the model loads.
  static void check_tls(const ServerOptions& opts);
  // Binds and starts the io threads (HTTPS with ServerOptions::ssl_certfile); throws mlaserve::Error if the address
  // cannot be bound or the TLS files cannot be used.
  void start();
  int port() const;  // the bound port (useful with port 0)
  // Stops accepting and stops the io threads (open connections are dropped). Idempotent.
  void stop();
  // Blocks until stop() or SIGINT / SIGTERM.
  void wait_for_signal();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mlaserve::server
