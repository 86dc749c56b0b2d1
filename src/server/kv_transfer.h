// Prefill / decode disaggregation between mlaserve servers, driven by vLLM's kv_transfer_params (what vLLM's
// disaggregated-serving proxies send): the proxy sends a request to a prefill server with
// {"do_remote_decode": true} (and max_tokens 1); that server runs it and answers with kv_transfer_params naming
// itself ({"do_remote_prefill": true, "remote_host", "remote_port", ...}); the proxy sends the request to a decode
// server with those params, which reads the prompt's cached latent rows from the prefill server
// (POST /kv_transfer/export, in chunks), caches them (GenerateRequest::kv_prefix) and computes only the rest.
// The rows travel over HTTP (no RDMA); a prefill server that no longer holds them, cannot be reached or has another
// cache layout costs the decode server the prompt's computation, never a wrong or failed answer.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine_api.h"
#include "server/serial_worker.h"

namespace mlaserve::server {

// What a request's kv_transfer_params asks (vLLM's fields; the others, e.g. remote_engine_id or remote_block_ids,
// are not needed here and ignored).
struct KvTransferParams {
  bool remote_decode = false;   // do_remote_decode: this server prefills; its answer says where the KV is
  bool remote_prefill = false;  // do_remote_prefill: the prompt's KV is read from remote_host:remote_port first
  std::string remote_host;
  int32_t remote_port = 0;
};
// The field's value: an object, or null for none (nullopt). Bad values are 400s naming the field.
std::optional<KvTransferParams> parse_kv_transfer_params(const nlohmann::json& v);

// SGLang's prefill / decode disaggregation fields, as its router adds them to a request it sends to both servers:
// bootstrap_host, bootstrap_port and bootstrap_room (one value each, or lists with one per prompt). Per prompt; empty
// when the request has none. Bad values are 400s naming the field; a missing or null port is `default_port`.
struct Bootstrap {
  std::string host;
  int32_t port = 0;
  uint64_t room = 0;
};
std::vector<Bootstrap> parse_bootstrap(const nlohmann::json& body, size_t prompts, int32_t default_port);

// Where a decode request reads a prompt's rows: a server's host and port (vLLM's remote_host / remote_port, SGLang's
// bootstrap server) and, for SGLang's protocol, the bootstrap room to wait for there.
struct KvSource {
  std::string host;
  int32_t port = 0;
  std::optional<uint64_t> room;
};

// The prefill side's bootstrap rooms: which rooms' prefill requests have ended (the last kKept of them), and the
// export reads waiting for one (a decode server may ask before the prefill server has the request).
class BootstrapRooms {
 public:
  static constexpr size_t kKept = 1 << 16;
  BootstrapRooms();
  ~BootstrapRooms();
  void end(uint64_t room);
  // fn(true) once `room` has ended (at once when it has), else fn(false) after `timeout`; called on the thread that
  // ends the room or on the rooms' own timer thread (never under its lock); fn(false) for waits left at destruction.
  void when_ended(uint64_t room, std::chrono::milliseconds timeout, std::function<void(bool)> fn);

 private:
  struct Waiter {
    uint64_t room;
    std::chrono::steady_clock::time_point deadline;
    std::function<void(bool)> fn;
  };
  void sweep();
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_set<uint64_t> ended_;
  std::deque<uint64_t> order_;  // ended_, oldest first
  std::vector<Waiter> waiters_;
  bool stop_ = false;
  std::thread timer_;
};

// The rooms a request body names in "bootstrap_room" (a non-negative integer or a list of them; anything else:
// none), for ending them when the request is refused before it is checked.
std::vector<uint64_t> bootstrap_rooms_named(const nlohmann::json& body);

// The kv_transfer_params of a prefill (do_remote_decode) answer from the server at host:port.
nlohmann::json kv_transfer_answer(const std::string& host, int32_t port, const std::string& request_id);

// An HTTP Host header ("host", "host:port", "[v6]", "[v6]:port") as host and port (0 when none).
std::pair<std::string, int32_t> split_host_port(std::string_view s);

// POST /kv_transfer/export's answer: one JSON line ({"begin", "end", "cached", "layers", "row_bytes", "dtype",
// "layout": "token,layer,row"}), then the rows' bytes (KvRows::bytes' order). encode_kv_rows writes the line into
// the rows' header room when it fits (an export's: no copy of the rows); decode_kv_rows keeps the body, the rows at
// its offset, and throws mlaserve::Error naming what is wrong with a body.
std::string encode_kv_rows(KvRows r);
KvRows decode_kv_rows(std::string body);

// The rows of the longest prefix of `tokens` that the server at host:port caches under `salt`, read in as many
// export answers as it takes (each at most kMaxKvExportBytes). Null when there are none, or when the server cannot be
// reached or answers with an error; `why` then says what happened. A read that fails after others keeps what they
// brought (a prefix); the answers are kept as they came (one part each). room: SGLang's bootstrap room (the first
// read waits there for that room's prefill request to end). tokens_per_read: the most tokens each read asks for.
// from: the first token read (those before it are cached by the reader).
std::shared_ptr<const KvPrefix> fetch_kv_rows(const std::string& host, int32_t port,
                                              const std::string& authorization, const std::vector<int32_t>& tokens,
                                              const std::string& salt,
                                              std::chrono::milliseconds timeout, std::string& why,
                                              std::optional<uint64_t> room = std::nullopt,
                                              int32_t tokens_per_read = std::numeric_limits<int32_t>::max(),
                                              int32_t from = 0);

// A few threads (SerialWorkers, taken in turn) that run the decode side's reads (blocking network I/O) off the
// connections' executors. Tasks still queued when it is destroyed are dropped; running ones finish first.
class KvFetchPool {
 public:
  explicit KvFetchPool(int threads);
  ~KvFetchPool();
  void post(std::function<void()> task);

 private:
  std::vector<std::shared_ptr<SerialWorker>> workers_;
  std::atomic<size_t> next_{0};
};

}  // namespace mlaserve::server
