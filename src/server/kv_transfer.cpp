#include "server/kv_transfer.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/buffer_pool.h"
#include "core/error.h"
#include "core/json_int.h"
#include "core/log.h"
#include "server/api_error.h"
#include "server/http_client.h"

namespace mlaserve::server {

using json = nlohmann::json;

std::optional<KvTransferParams> parse_kv_transfer_params(const json& v) {
  if (v.is_null()) return std::nullopt;
  if (!v.is_object()) bad_request("kv_transfer_params", "invalid_type", "'kv_transfer_params' must be an object");
  KvTransferParams p;
  auto flag = [&](const char* key) {
    const auto it = v.find(key);
    if (it == v.end() || it->is_null()) return false;
    if (!it->is_boolean())
      bad_request("kv_transfer_params", "invalid_type", "'kv_transfer_params.{}' must be a boolean", key);
    return it->get<bool>();
  };
  p.remote_decode = flag("do_remote_decode");
  p.remote_prefill = flag("do_remote_prefill");
  if (p.remote_decode && p.remote_prefill)
    bad_request("kv_transfer_params", "invalid_value",
                "'kv_transfer_params' cannot ask for both do_remote_decode and do_remote_prefill");
  if (p.remote_prefill) {
    const auto host = v.find("remote_host"), port = v.find("remote_port");
    if (host == v.end() || !host->is_string() || host->get<std::string>().empty())
      bad_request("kv_transfer_params", "invalid_value",
                  "'kv_transfer_params.remote_host' must name the prefill server (do_remote_prefill)");
    if (port == v.end() || !port->is_number_integer() || port->get<int64_t>() < 1 || port->get<int64_t>() > 65535)
      bad_request("kv_transfer_params", "invalid_value",
                  "'kv_transfer_params.remote_port' must be the prefill server's port, 1-65535 (do_remote_prefill)");
    p.remote_host = host->get<std::string>();
    p.remote_port = static_cast<int32_t>(port->get<int64_t>());
  }
  return p;
}

std::vector<Bootstrap> parse_bootstrap(const json& body, size_t prompts, int32_t default_port) {
  const auto room = body.find("bootstrap_room");
  if (room == body.end() || room->is_null()) return {};
  // One value for every prompt, or a list of one per prompt.
  auto values = [&](const char* key) -> std::vector<const json*> {
    const auto it = body.find(key);
    std::vector<const json*> out(prompts, nullptr);
    if (it == body.end() || it->is_null()) return out;
    if (!it->is_array()) {
      std::fill(out.begin(), out.end(), &*it);
      return out;
    }
    if (it->size() != prompts)
      bad_request(key, "invalid_value", "'{}' lists {} values for {} prompts", key, it->size(), prompts);
    for (size_t i = 0; i < prompts; ++i) out[i] = &(*it)[i];
    return out;
  };
  const std::vector<const json*> hosts = values("bootstrap_host"), ports = values("bootstrap_port"),
                                 rooms = values("bootstrap_room");
  std::vector<Bootstrap> out(prompts);
  for (size_t i = 0; i < prompts; ++i) {
    if (!rooms[i] || !rooms[i]->is_number_integer() ||
        (!rooms[i]->is_number_unsigned() && rooms[i]->get<int64_t>() < 0))
      bad_request("bootstrap_room", "invalid_value", "'bootstrap_room' must be a non-negative integer");
    out[i].room = rooms[i]->get<uint64_t>();
    if (!hosts[i] || !hosts[i]->is_string() || hosts[i]->get<std::string>().empty())
      bad_request("bootstrap_host", "invalid_value", "'bootstrap_host' must name the prefill server");
    out[i].host = hosts[i]->get<std::string>();
    out[i].port = default_port;
    if (ports[i] && !ports[i]->is_null()) {
      if (!ports[i]->is_number_integer() || ports[i]->get<int64_t>() < 1 || ports[i]->get<int64_t>() > 65535)
        bad_request("bootstrap_port", "invalid_value", "'bootstrap_port' must be a port, 1-65535");
      out[i].port = static_cast<int32_t>(ports[i]->get<int64_t>());
    }
  }
  return out;
}

BootstrapRooms::BootstrapRooms() : timer_([this] { sweep(); }) {}

BootstrapRooms::~BootstrapRooms() {
  std::vector<Waiter> left;
  {
    std::lock_guard lk(mu_);
    stop_ = true;
    left.swap(waiters_);
  }
  cv_.notify_all();
  timer_.join();
  for (Waiter& w : left) w.fn(false);
}

void BootstrapRooms::end(uint64_t room) {
  std::vector<Waiter> ready;
  {
    std::lock_guard lk(mu_);
    if (ended_.insert(room).second) {
      order_.push_back(room);
      if (order_.size() > kKept) {
        ended_.erase(order_.front());
        order_.pop_front();
      }
    }
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->room == room) {
        ready.push_back(std::move(*it));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Waiter& w : ready) w.fn(true);
}

void BootstrapRooms::when_ended(uint64_t room, std::chrono::milliseconds timeout, std::function<void(bool)> fn) {
  bool ended = false;
  {
    std::lock_guard lk(mu_);
    ended = ended_.contains(room);
    if (!ended && !stop_) {
      waiters_.push_back(Waiter{room, std::chrono::steady_clock::now() + timeout, std::move(fn)});
      cv_.notify_all();
      return;
    }
  }
  fn(ended);
}

void BootstrapRooms::sweep() {
  std::unique_lock lk(mu_);
  while (!stop_) {
    auto next = std::chrono::steady_clock::time_point::max();
    for (const Waiter& w : waiters_) next = std::min(next, w.deadline);
    if (next == std::chrono::steady_clock::time_point::max()) cv_.wait(lk);
    else cv_.wait_until(lk, next);
    const auto now = std::chrono::steady_clock::now();
    std::vector<Waiter> late;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->deadline <= now) {
        late.push_back(std::move(*it));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
    if (late.empty()) continue;
    lk.unlock();
    for (Waiter& w : late) w.fn(false);
    lk.lock();
  }
}

std::vector<uint64_t> bootstrap_rooms_named(const json& body) {
  std::vector<uint64_t> out;
  if (!body.is_object() || !body.contains("bootstrap_room")) return out;
  const json& v = body["bootstrap_room"];
  auto add = [&](const json& r) {
    if (r.is_number_unsigned() || (r.is_number_integer() && r.get<int64_t>() >= 0)) out.push_back(r.get<uint64_t>());
  };
  if (v.is_array())
    for (const json& r : v) add(r);
  else
    add(v);
  return out;
}

json kv_transfer_answer(const std::string& host, int32_t port, const std::string& request_id) {
  return json{{"do_remote_prefill", true},      {"do_remote_decode", false}, {"remote_host", host},
              {"remote_port", port},            {"remote_engine_id", "mlaserve"},
              {"remote_block_ids", json::array()}, {"remote_request_id", request_id}};
}

std::pair<std::string, int32_t> split_host_port(std::string_view s) {
  auto port_of = [](std::string_view p) -> int32_t {
    if (p.empty() || p.size() > 5 || !std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return 0;
    const int v = std::stoi(std::string(p));
    return v <= 65535 ? v : 0;
  };
  if (s.starts_with('[')) {  // [v6] or [v6]:port
    const size_t close = s.find(']');
    if (close == std::string_view::npos) return {std::string(s), 0};
    const std::string_view rest = s.substr(close + 1);
    return {std::string(s.substr(1, close - 1)), rest.starts_with(':') ? port_of(rest.substr(1)) : 0};
  }
  const size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || s.find(':') != colon) return {std::string(s), 0};  // (a bare v6 address)
  return {std::string(s.substr(0, colon)), port_of(s.substr(colon + 1))};
}

namespace {
constexpr const char* kRowsLayout = "token,layer,row";  // KvRows::bytes' order
}  // namespace

std::string encode_kv_rows(KvRows r) {
  const std::string head = json{{"begin", r.begin},         {"end", r.end},   {"cached", r.cached},
                                {"layers", r.layers},       {"row_bytes", r.row_bytes},
                                {"dtype", r.dtype},         {"layout", kRowsLayout}}
                               .dump();
  if (head.size() < r.offset) {  // the line (padded with spaces, JSON's whitespace) in the room before the rows
    std::memcpy(r.bytes.data(), head.data(), head.size());
    std::memset(r.bytes.data() + head.size(), ' ', r.offset - head.size() - 1);
    r.bytes[r.offset - 1] = '\n';
    return std::move(r.bytes);
  }
  std::string out = head;
  out += '\n';
  out.append(r.rows(), r.rows_size());
  return out;
}

KvRows decode_kv_rows(std::string body) {
  const size_t nl = body.find('\n');
  MLA_CHECK(nl != std::string::npos, "KV rows: no header line in an answer of {} bytes", body.size());
  const json h = json::parse(std::string_view(body).substr(0, nl), nullptr, /*allow_exceptions=*/false);
  MLA_CHECK(h.is_object(), "KV rows: the header line is not a JSON object");
  KvRows r;
  // Integers, in range: a float (or a number past int32) is refused, not converted.
  auto count = [&](const char* k, int64_t most) -> int64_t {
    const auto it = h.find(k);
    const auto v = it == h.end() ? std::nullopt : json_integer(*it, 0, most);
    MLA_CHECK(v, "KV rows: bad header: '{}' must be an integer in [0, {}], got {}", k, most,
              it == h.end() ? std::string("nothing") : it->dump());
    return *v;
  };
  auto text = [&](const char* k) -> std::string {
    const auto it = h.find(k);
    MLA_CHECK(it != h.end() && it->is_string(), "KV rows: bad header: '{}' must be a string", k);
    return it->get<std::string>();
  };
  constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
  r.begin = static_cast<int32_t>(count("begin", kMaxTokens));
  r.end = static_cast<int32_t>(count("end", kMaxTokens));
  r.cached = static_cast<int32_t>(count("cached", kMaxTokens));
  r.layers = count("layers", int64_t{1} << 20);
  r.row_bytes = count("row_bytes", int64_t{1} << 30);
  r.dtype = text("dtype");
  const std::string layout = text("layout");
  MLA_CHECK(layout == kRowsLayout, "KV rows: the rows come in order '{}', this server reads '{}'", layout,
            kRowsLayout);
  MLA_CHECK(r.end >= r.begin && r.cached >= r.end, "KV rows: bad header (tokens [{}, {}) of {} cached)", r.begin, r.end,
            r.cached);
  // The rows' size by division (layers * row_bytes < 2^50; times the tokens it could pass 64 bits).
  const auto per_token = static_cast<uint64_t>(r.layers) * static_cast<uint64_t>(r.row_bytes);
  const uint64_t have = body.size() - nl - 1, tokens = static_cast<uint64_t>(r.end - r.begin);
  MLA_CHECK(per_token == 0 ? have == 0 : have % per_token == 0 && have / per_token == tokens,
            "KV rows: {} bytes of rows where the header says {} tokens x {} layers x {} bytes", have, tokens, r.layers,
            r.row_bytes);
  r.bytes = std::move(body);
  r.offset = nl + 1;
  return r;
}

std::shared_ptr<const KvPrefix> fetch_kv_rows(const std::string& host, int32_t port,
                                              const std::string& authorization, const std::vector<int32_t>& tokens,
                                              const std::string& salt, std::chrono::milliseconds timeout,
                                              std::string& why, std::optional<uint64_t> room,
                                              int32_t tokens_per_read, int32_t from) {
  // The parts' buffers go back to the pool when the prefix is dropped (after its import).
  std::shared_ptr<KvPrefix> parts(new KvPrefix, [](KvPrefix* p) {
    for (KvRows& r : *p) BufferPool::global().give(std::move(r.bytes));
    delete p;
  });
  int32_t begin = std::max(0, from);
  try {
    for (;;) {
      json q{{"token_ids", tokens}, {"cache_salt", salt}, {"begin", begin}, {"max_tokens", tokens_per_read}};
      if (room && parts->empty()) {  // (the prefill server waits for the room within 3/4 of this read's time)
        q["bootstrap_room"] = *room;
        q["wait_ms"] = timeout.count() * 3 / 4;
      }
      HttpCall call{host, std::to_string(port), "POST", "/kv_transfer/export", q.dump(), authorization, timeout,
                    kMaxKvExportBytes + (1 << 20), nullptr};
      auto [status, body] = http_call(call, BufferPool::global().take(kMaxKvExportBytes + kKvExportHeaderRoom));
      if (status != 200) {
        why = fmt::format("{}:{} answered {}: {}", host, port, status, body.substr(0, 300));
        break;
      }
      KvRows r = decode_kv_rows(std::move(body));
      if (!parts->empty() && !r.same_layout(parts->front())) {
        why = fmt::format("{}:{} changed its rows' layout between reads", host, port);
        break;
      }
      if (r.begin != begin || r.end == r.begin) {  // (read out, or evicted there meanwhile)
        if (parts->empty()) why = fmt::format("{}:{} holds none of the prompt's KV", host, port);
        break;
      }
      begin = r.end;
      const bool last = r.end >= r.cached;
      parts->push_back(std::move(r));
      if (last) break;
    }
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (parts->empty()) return nullptr;
  return parts;
}

KvFetchPool::KvFetchPool(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) workers_.push_back(SerialWorker::start("KV transfer"));
}

KvFetchPool::~KvFetchPool() {
  for (auto& w : workers_) w->stop();
}

void KvFetchPool::post(std::function<void()> task) { workers_[next_++ % workers_.size()]->post(std::move(task)); }

}  // namespace mlaserve::server
