#include "server/response_store.h"

#include <vector>

#include "core/log.h"

namespace mlaserve::server {

using ojson = nlohmann::ordered_json;

namespace {

// A failed generation's error as a response's `error` (and a stream's `error` event) gives it: {"code", "message"},
// from the server's error shape {"error": {"message", "type", "param", "code"}} when the body has it.
ojson response_error(int status, const std::string& body) {
  ojson error = {{"code", status >= 500 ? "server_error" : "invalid_request"}, {"message", body}};
  try {
    const ojson e = ojson::parse(body).at("error");
    error["message"] = e.at("message");
    if (e.contains("code") && e["code"].is_string()) error["code"] = e["code"];
  } catch (const std::exception&) {
  }
  return error;
}

}  // namespace

// The channel a background response's generation answers through, on the store's worker. A 200 answer has
// already reached the store through the ResponsesExchange in front (complete()); an error answer fails the response.
// Created with `stream`, it keeps the stream's events and forwards each to its subscribers (SSE clients, each on its
// own executor), who also get the stream's end (or an `error` event when the generation fails).
class ResponseStore::BackgroundExchange : public HttpExchange,
                                          public std::enable_shared_from_this<BackgroundExchange> {
 public:
  BackgroundExchange(ResponseStore* store, std::string id, bool stream)
      : store_(store), id_(std::move(id)), stream_(stream) {}
  Executor executor() override { return store_->executor(); }
  void respond(int status, const std::string&, std::string body) override {
    if (done_) return;
    if (status == 200) {
      end();
      store_->finished(id_, {});
      return;
    }
    if (stream_) {  // as OpenAI's streams report a failure: an `error` event, then the end
      const ojson error = response_error(status, body);
      const ojson e = {{"type", "error"}, {"code", error["code"]}, {"message", error["message"]}, {"param", nullptr},
                       {"sequence_number", log_.size()}};
      send_named_event("error", e.dump(-1, ' ', false, ojson::error_handler_t::replace));
      close_subscribers();
    }
    std::vector<Event> log = std::move(log_);
    end();
    store_->failed(id_, status, body, std::move(log));
  }
  // Without `stream` background responses are refused when they ask to stream: a stream here is an internal error.
  void start_stream() override {
    if (stream_) return;
    respond(500, "", R"({"error": {"message": "a background response streamed", "code": "server_error"}})");
  }
  void send_event(std::string payload) override { send_named_event({}, std::move(payload)); }
  void send_named_event(const std::string& event, std::string payload) override {
    if (done_ || !stream_) return;
    log_.push_back(Event{event, std::move(payload)});
    for (const auto& c : subscribers_) forward(c, log_.size() - 1);
  }
  void end_stream() override {
    if (done_ || !stream_) return;
    close_subscribers();
    std::vector<Event> log = std::move(log_);
    end();
    store_->finished(id_, std::move(log));
  }
  void on_cancel(std::function<void(const std::string&)> fn) override { cancel_ = std::move(fn); }
  void keep(std::shared_ptr<HttpExchange> outer) { outer_ = std::move(outer); }
  void drop() { end(); }  // the store is going: no answer is awaited
  bool streams() const { return stream_; }
  // On the worker: aborts the generation (no answer follows; subscribers see their streams end). False when it had
  // already answered. The events so far go to `log`.
  bool cancel(std::vector<Event>& log) {
    if (done_) return false;
    auto fn = std::move(cancel_);
    close_subscribers();
    log = std::move(log_);
    end();
    if (fn) fn("the response was cancelled");
    return true;
  }
  // On the worker: `client` gets the events after `after`, then the rest as they come.
  void subscribe(int64_t after, std::shared_ptr<HttpExchange> client) {
    replay(client, log_, after, /*last=*/false);
    subscribers_.push_back(std::move(client));
  }
  void unsubscribe(const HttpExchange* client) {
    std::erase_if(subscribers_, [client](const auto& c) { return c.get() == client; });
  }

  // An SSE stream of `events` after `after` (-1: all) into `client`, on its executor; last: then its end.
  static void replay(const std::shared_ptr<HttpExchange>& client, const std::vector<Event>& events, int64_t after,
                     bool last) {
    std::vector<Event> tail;
    for (size_t i = static_cast<size_t>(std::max<int64_t>(after + 1, 0)); i < events.size(); ++i)
      tail.push_back(events[i]);
    client->executor()([client, tail = std::move(tail), last] {
      client->start_stream();
      for (const Event& e : tail) client->send_named_event(e.type, e.data);
      if (last) client->end_stream();
    });
  }

 private:
  void forward(const std::shared_ptr<HttpExchange>& client, size_t i) {
    client->executor()([client, e = log_[i]] { client->send_named_event(e.type, e.data); });
  }
  void close_subscribers() {
    for (const auto& c : subscribers_) c->executor()([c] { c->end_stream(); });
    subscribers_.clear();
  }
  void end() {
    done_ = true;
    cancel_ = nullptr;
    subscribers_.clear();
    outer_.reset();  // the ResponsesExchange in front, which holds this one: kept alive by the caller's frame
  }
  ResponseStore* store_;
  std::string id_;
  bool stream_;
  bool done_ = false;
  std::function<void(const std::string&)> cancel_;
  std::shared_ptr<HttpExchange> outer_;
  std::vector<Event> log_;                                  // the events so far (`stream`)
  std::vector<std::shared_ptr<HttpExchange>> subscribers_;  // SSE clients receiving them
};

namespace {

size_t json_bytes(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace).size(); }

size_t record_bytes(const ResponseStore::Record& r) {
  size_t events = 0;
  if (r.events)
    for (const auto& e : *r.events) events += e.type.size() + e.data.size();
  return json_bytes(r.response) + json_bytes(r.input) + (r.context ? json_bytes(*r.context) : 0) + events;
}

}  // namespace

ResponseStore::ResponseStore(size_t max_bytes)
    : max_bytes_(max_bytes), worker_(SerialWorker::start("background responses")) {}

ResponseStore::~ResponseStore() {
  worker_->stop();
  for (auto& [id, s] : slots_)
    if (s.running) s.running->drop();  // each holds the exchange in front, which holds it
}

void ResponseStore::set_locked(Slot& s, Record r) {
  if (r.bytes == 0) r.bytes = record_bytes(r);
  if (s.record) bytes_ -= s.record->bytes;
  bytes_ += r.bytes;
  s.record = std::make_shared<const Record>(std::move(r));
}

void ResponseStore::put_locked(const std::string& id, Record r) {
  auto it = slots_.find(id);
  if (it == slots_.end()) {
    order_.push_back(id);
    it = slots_.emplace(id, Slot{nullptr, std::prev(order_.end()), nullptr}).first;
  }
  set_locked(it->second, std::move(r));
  // The oldest go first; a running background response and the newest one stay.
  for (auto o = order_.begin(); bytes_ > max_bytes_ && o != order_.end();) {
    if (*o == id) break;
    Slot& s = slots_.at(*o);
    if (s.running) {
      ++o;
      continue;
    }
    bytes_ -= s.record->bytes;
    slots_.erase(*o);
    o = order_.erase(o);
  }
}

void ResponseStore::put(const std::string& id, ojson response, ojson input, std::shared_ptr<const ojson> context) {
  Record r{std::move(response), std::move(input), std::move(context), nullptr, 0};
  r.bytes = record_bytes(r);  // measured before the lock: a long conversation takes a while
  std::lock_guard lk(mu_);
  put_locked(id, std::move(r));
}

std::shared_ptr<const ResponseStore::Record> ResponseStore::get(const std::string& id) const {
  std::lock_guard lk(mu_);
  const auto it = slots_.find(id);
  return it == slots_.end() ? nullptr : it->second.record;
}

size_t ResponseStore::size() const {
  std::lock_guard lk(mu_);
  return slots_.size();
}

bool ResponseStore::erase(const std::string& id) {
  std::shared_ptr<BackgroundExchange> running;
  {
    std::lock_guard lk(mu_);
    const auto it = slots_.find(id);
    if (it == slots_.end()) return false;
    running = std::move(it->second.running);
    bytes_ -= it->second.record->bytes;
    order_.erase(it->second.order);
    slots_.erase(it);
  }
  if (running) worker_->post([running] {
      std::vector<Event> log;
      running->cancel(log);
    });
  return true;
}

std::shared_ptr<HttpExchange> ResponseStore::begin_background(
    const std::string& id, ojson response, ojson input, std::shared_ptr<const ojson> context,
    const std::function<std::shared_ptr<HttpExchange>(std::shared_ptr<HttpExchange>)>& wrap, bool stream) {
  auto inner = std::make_shared<BackgroundExchange>(this, id, stream);
  auto outer = wrap(inner);
  inner->keep(outer);
  std::lock_guard lk(mu_);
  put_locked(id, Record{std::move(response), std::move(input), std::move(context), nullptr, 0});
  slots_.at(id).running = std::move(inner);
  return outer;
}

void ResponseStore::started(const std::string& id) {
  std::lock_guard lk(mu_);
  const auto it = slots_.find(id);
  if (it == slots_.end() || it->second.record->response.value("status", "") != "queued") return;
  Record r = *it->second.record;
  r.response["status"] = "in_progress";
  r.bytes = 0;
  set_locked(it->second, std::move(r));
}

void ResponseStore::abandon(const std::string& id) {
  std::shared_ptr<BackgroundExchange> running;
  {
    std::lock_guard lk(mu_);
    const auto it = slots_.find(id);
    if (it == slots_.end()) return;
    running = std::move(it->second.running);  // released outside the lock
    bytes_ -= it->second.record->bytes;
    order_.erase(it->second.order);
    slots_.erase(it);
  }
  if (running) worker_->post([running] {
      std::vector<Event> log;
      running->cancel(log);
    });
}

void ResponseStore::complete(const std::string& id, ojson response) {
  std::lock_guard lk(mu_);
  const auto it = slots_.find(id);
  if (it == slots_.end() || !it->second.running) return;  // deleted or cancelled meanwhile
  Record r = *it->second.record;
  r.response = std::move(response);
  r.bytes = 0;
  set_locked(it->second, std::move(r));
}

void ResponseStore::failed(const std::string& id, int status, const std::string& body, std::vector<Event> events) {
  std::shared_ptr<BackgroundExchange> running;
  std::lock_guard lk(mu_);
  const auto it = slots_.find(id);
  if (it == slots_.end()) return;
  running = std::move(it->second.running);
  Record r = *it->second.record;
  r.response["status"] = "failed";
  r.response["error"] = response_error(status, body);
  if (running && running->streams()) r.events = std::make_shared<const std::vector<Event>>(std::move(events));
  r.bytes = 0;
  set_locked(it->second, std::move(r));
  MLA_LOG_WARN("background response {} failed ({}): {}", id, status, body);
}

void ResponseStore::finished(const std::string& id, std::vector<Event> events) {
  std::shared_ptr<BackgroundExchange> running;
  std::lock_guard lk(mu_);
  const auto it = slots_.find(id);
  if (it == slots_.end()) return;
  running = std::move(it->second.running);
  if (!running || !running->streams()) return;
  Record r = *it->second.record;
  r.events = std::make_shared<const std::vector<Event>>(std::move(events));
  r.bytes = 0;
  set_locked(it->second, std::move(r));
}

void ResponseStore::cancel(const std::string& id, std::function<void(std::shared_ptr<const Record>)> done) {
  worker_->post([this, id, done = std::move(done)] {
    std::shared_ptr<BackgroundExchange> running;
    {
      std::lock_guard lk(mu_);
      if (const auto it = slots_.find(id); it != slots_.end()) running = it->second.running;
    }
    std::vector<Event> log;
    if (running && running->cancel(log)) {
      std::lock_guard lk(mu_);
      if (const auto it = slots_.find(id); it != slots_.end() && it->second.running == running) {
        it->second.running.reset();
        Record r = *it->second.record;
        r.response["status"] = "cancelled";
        if (running->streams()) r.events = std::make_shared<const std::vector<Event>>(std::move(log));
        r.bytes = 0;
        set_locked(it->second, std::move(r));
      }
    }
    done(get(id));
  });
}

void ResponseStore::unsubscribe_on_cancel(const std::string& id, const std::shared_ptr<HttpExchange>& client) {
  client->on_cancel([this, id, c = client.get()](const std::string&) {
    worker_->post([this, id, c] {
      std::shared_ptr<BackgroundExchange> running;
      {
        std::lock_guard lk(mu_);
        if (const auto it = slots_.find(id); it != slots_.end()) running = it->second.running;
      }
      if (running) running->unsubscribe(c);
    });
  });
}

void ResponseStore::subscribe(const std::string& id, int64_t after, std::shared_ptr<HttpExchange> client,
                              std::function<void(int)> done) {
  worker_->post([this, id, after, client = std::move(client), done = std::move(done)] {
    std::shared_ptr<BackgroundExchange> running;
    std::shared_ptr<const std::vector<Event>> events;
    {
      std::lock_guard lk(mu_);
      const auto it = slots_.find(id);
      if (it == slots_.end()) return done(404);
      running = it->second.running;
      events = it->second.record->events;
    }
    if (running && running->streams()) {  // events come until its end (the worker runs the generation's answers)
      running->subscribe(after, client);
    } else if (!running && events) {
      BackgroundExchange::replay(client, *events, after, /*last=*/true);
    } else {
      return done(400);
    }
    done(0);
  });
}

}  // namespace mlaserve::server
