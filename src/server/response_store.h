// The Responses API's stored responses (OpenAI's `store`, on by default): GET / DELETE /v1/responses/{id}, its
// input_items, `previous_response_id` (a new request continues a stored conversation) and `background` responses
// (generated while the client polls; cancellable). In memory, up to kMaxBytes: past that the oldest finished
// responses are forgotten first. A background response's generation answers through an exchange of the store, on
// the store's own worker thread; one created with `stream` keeps its events, which its creator and any later
// GET ?stream=true (from a `starting_after` sequence number) receive as they come, or replayed once it ended.
#pragma once

#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/api.h"
#include "server/serial_worker.h"

namespace mlaserve::server {

class ResponseStore {
 public:
  static constexpr size_t kMaxBytes = size_t{1} << 30;

  // One server-sent event of a streamed background response (its index is its sequence_number).
  struct Event {
    std::string type;  // the SSE `event:` name
    std::string data;
  };

  struct Record {
    nlohmann::ordered_json response;  // as GET returns it
    nlohmann::ordered_json input;     // the request's own input items, each with an id
    // The items the model saw, its own input last (instructions are not carried on): what a request naming this
    // response as previous_response_id continues, followed by this response's output.
    std::shared_ptr<const nlohmann::ordered_json> context;
    // A background response created with `stream`, once it ended: its events (null for other responses).
    std::shared_ptr<const std::vector<Event>> events;
    size_t bytes = 0;
  };

  explicit ResponseStore(size_t max_bytes = kMaxBytes);
  ~ResponseStore();  // background responses still running are dropped (the engine aborts them as it stops)
  ResponseStore(const ResponseStore&) = delete;
  ResponseStore& operator=(const ResponseStore&) = delete;

  // Stores (or replaces) a response; the oldest finished ones go while the store holds more than max_bytes.
  void put(const std::string& id, nlohmann::ordered_json response, nlohmann::ordered_json input,
           std::shared_ptr<const nlohmann::ordered_json> context);
  std::shared_ptr<const Record> get(const std::string& id) const;  // null when unknown
  // Forgets a response (a running background one is cancelled first). False when unknown.
  bool erase(const std::string& id);
  size_t size() const;

  // Background: stores the queued response and returns the exchange its generation answers through: `wrap`'s
  // (the ResponsesExchange) around the store's own, which runs on the store's worker and is held until the
  // generation ends (the job refers to its exchange weakly). stream: the generation streams; its events are kept
  // for subscribe().
  std::shared_ptr<HttpExchange> begin_background(
      const std::string& id, nlohmann::ordered_json response, nlohmann::ordered_json input,
      std::shared_ptr<const nlohmann::ordered_json> context,
      const std::function<std::shared_ptr<HttpExchange>(std::shared_ptr<HttpExchange>)>& wrap, bool stream = false);
  // Streams a background response created with `stream` into `client` (an SSE stream: its events after sequence
  // number `after`, -1 for all, then the ones still to come, then its end), on the store's worker. `done` gets 0
  // when it streams, else the status the caller answers with (nothing sent): 404 for an unknown response (deleted
  // meanwhile), 400 for one without events to stream.
  void subscribe(const std::string& id, int64_t after, std::shared_ptr<HttpExchange> client,
                 std::function<void(int status)> done);
  // On the client's executor, before subscribe: a client that goes away stops receiving (the generation goes on).
  void unsubscribe_on_cancel(const std::string& id, const std::shared_ptr<HttpExchange>& client);
  // The queued response's generation was submitted: in_progress (unless it already ended).
  void started(const std::string& id);
  // Its generation could not start (the request refused): forgotten.
  void abandon(const std::string& id);
  // Its finished response (completed, incomplete or cancelled), from the ResponsesExchange; dropped when the
  // response was deleted meanwhile.
  void complete(const std::string& id, nlohmann::ordered_json response);
  // Cancels a running background response (its generation aborted, status cancelled); `done` gets the record as it
  // then is (null when unknown), on the store's worker.
  void cancel(const std::string& id, std::function<void(std::shared_ptr<const Record>)> done);
  Executor executor() { return worker_->executor(); }

 private:
  class BackgroundExchange;
  struct Slot {
    std::shared_ptr<const Record> record;
    std::list<std::string>::iterator order;
    std::shared_ptr<BackgroundExchange> running;  // a background response being generated
  };
  void put_locked(const std::string& id, Record r);
  void set_locked(Slot& s, Record r);  // replaces a slot's record, keeping its place
  // On the worker, from the background exchange: the generation ended with an error answer (status, JSON body),
  // or answered (the response came through complete()).
  void failed(const std::string& id, int status, const std::string& body, std::vector<Event> events);
  void finished(const std::string& id, std::vector<Event> events);

  size_t max_bytes_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Slot> slots_;
  std::list<std::string> order_;  // oldest first
  size_t bytes_ = 0;
  std::shared_ptr<SerialWorker> worker_;
};

}  // namespace mlaserve::server
