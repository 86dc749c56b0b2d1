#include "server/response_store.h"

#include <vector>

#include "core/log.h"

namespace mlaserve::server {

using ojson = nlohmann::ordered_json;

// The channel a background response's generation answers through, on the store's worker. A 200 answer has
// already reached the store through the ResponsesExchange in front (complete()); an error answer fails the response.
class ResponseStore::BackgroundExchange : public HttpExchange,
                                          public std::enable_shared_from_this<BackgroundExchange> {
 public:
  BackgroundExchange(ResponseStore* store, std::string id) : store_(store), id_(std::move(id)) {}
  Executor executor() override { return store_->executor(); }
  void respond(int status, const std::string&, std::string body) override {
    if (done_) return;
    end();
    if (status == 200) {
      store_->finished(id_);
    } else {
      store_->failed(id_, status, body);
    }
  }
  // Background responses are refused when they ask to stream: a stream here is an internal error.
  void start_stream() override {
    respond(500, "", R"({"error": {"message": "a background response streamed", "code": "server_error"}})");
  }
  void send_event(std::string) override {}
  void end_stream() override {}
  void on_cancel(std::function<void(const std::string&)> fn) override { cancel_ = std::move(fn); }
  void keep(std::shared_ptr<HttpExchange> outer) { outer_ = std::move(outer); }
  void drop() { end(); }  // the store is going: no answer is awaited
  // On the worker: aborts the generation (no answer follows). False when it had already answered.
  bool cancel() {
    if (done_) return false;
    auto fn = std::move(cancel_);
    end();
    if (fn) fn("the response was cancelled");
    return true;
  }

 private:
  void end() {
    done_ = true;
    cancel_ = nullptr;
    outer_.reset();  // the ResponsesExchange in front, which holds this one: kept alive by the caller's frame
  }
  ResponseStore* store_;
  std::string id_;
  bool done_ = false;
  std::function<void(const std::string&)> cancel_;
  std::shared_ptr<HttpExchange> outer_;
};

namespace {

size_t json_bytes(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace).size(); }

size_t record_bytes(const ResponseStore::Record& r) {
  return json_bytes(r.response) + json_bytes(r.input) + (r.context ? json_bytes(*r.context) : 0);
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
  Record r{std::move(response), std::move(input), std::move(context), 0};
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
  if (running) worker_->post([running] { running->cancel(); });
  return true;
}

std::shared_ptr<HttpExchange> ResponseStore::begin_background(
    const std::string& id, ojson response, ojson input, std::shared_ptr<const ojson> context,
    const std::function<std::shared_ptr<HttpExchange>(std::shared_ptr<HttpExchange>)>& wrap) {
  auto inner = std::make_shared<BackgroundExchange>(this, id);
  auto outer = wrap(inner);
  inner->keep(outer);
  std::lock_guard lk(mu_);
  put_locked(id, Record{std::move(response), std::move(input), std::move(context), 0});
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
  if (running) worker_->post([running] { running->cancel(); });
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

void ResponseStore::failed(const std::string& id, int status, const std::string& body) {
  std::shared_ptr<BackgroundExchange> running;
  std::lock_guard lk(mu_);
  const auto it = slots_.find(id);
  if (it == slots_.end()) return;
  running = std::move(it->second.running);
  Record r = *it->second.record;
  ojson error = {{"code", status >= 500 ? "server_error" : "invalid_request"}, {"message", body}};
  try {  // the server's error shape: {"error": {"message", "type", "param", "code"}}
    const ojson e = ojson::parse(body).at("error");
    error["message"] = e.at("message");
    if (e.contains("code") && e["code"].is_string()) error["code"] = e["code"];
  } catch (const std::exception&) {
  }
  r.response["status"] = "failed";
  r.response["error"] = std::move(error);
  r.bytes = 0;
  set_locked(it->second, std::move(r));
  MLA_LOG_WARN("background response {} failed ({}): {}", id, status, body);
}

void ResponseStore::finished(const std::string& id) {
  std::shared_ptr<BackgroundExchange> running;
  std::lock_guard lk(mu_);
  if (const auto it = slots_.find(id); it != slots_.end()) running = std::move(it->second.running);
}

void ResponseStore::cancel(const std::string& id, std::function<void(std::shared_ptr<const Record>)> done) {
  worker_->post([this, id, done = std::move(done)] {
    std::shared_ptr<BackgroundExchange> running;
    {
      std::lock_guard lk(mu_);
      if (const auto it = slots_.find(id); it != slots_.end()) running = it->second.running;
    }
    if (running && running->cancel()) {
      std::lock_guard lk(mu_);
      if (const auto it = slots_.find(id); it != slots_.end() && it->second.running == running) {
        it->second.running.reset();
        Record r = *it->second.record;
        r.response["status"] = "cancelled";
        r.bytes = 0;
        set_locked(it->second, std::move(r));
      }
    }
    done(get(id));
  });
}

}  // namespace mlaserve::server
