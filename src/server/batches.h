// OpenAI's Files and Batch APIs (SGLang serves them too): uploaded JSONL files of requests, each line run through
// the server's own endpoint as if a client had sent it, the answers collected into an output file (2xx) and an error
// file (the rest), in the input's order. Files live in memory. One worker thread starts a batch's lines (at most
// kMaxInFlight of them at a time) and receives their answers; the HTTP threads only read and change the state under
// the service's lock.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/api.h"
#include "server/serial_worker.h"

namespace mlaserve::server {

// One part of a multipart/form-data body (RFC 7578), as HTTP clients upload files.
struct FormPart {
  std::string name;
  std::optional<std::string> filename;
  std::string content_type;
  std::string data;
};
// The parts of `body`; ApiError 400 when the content type is not multipart/form-data with a boundary or the body
// is not made of its parts.
std::vector<FormPart> parse_multipart(std::string_view content_type, std::string_view body);

class BatchService {
 public:
  // Runs one request of a batch through the server (Api::handle); its answer comes back through the exchange.
  using Runner = std::function<void(const HttpRequest&, const std::shared_ptr<HttpExchange>&)>;
  static constexpr size_t kMaxInFlight = 512;        // lines of all batches submitted at once
  static constexpr size_t kMaxLines = 50000;         // per batch (OpenAI's limit)
  static constexpr size_t kMaxStoredBytes = size_t{4} << 30;  // all files together

  // The clock of the batches' and files' timestamps and of their completion window (seconds since the epoch).
  using Clock = std::function<int64_t()>;
  static constexpr int64_t kWindowSeconds = 24 * 3600;  // completion_window "24h": then the batch expires

  explicit BatchService(Runner run, Clock clock = unix_seconds);
  ~BatchService();  // batches still running are cancelled; their answers are dropped
  BatchService(const BatchService&) = delete;
  BatchService& operator=(const BatchService&) = delete;

  // The routes under /v1/files and /v1/batches: `rest` is the path after the prefix ("", "/ID", "/ID/content",
  // "/ID/cancel"), `query` the target's query string. Answers through `ex`; ApiError for client errors.
  void files(const HttpRequest& req, std::string_view rest, std::string_view query,
             const std::shared_ptr<HttpExchange>& ex);
  void batches(const HttpRequest& req, std::string_view rest, std::string_view query,
               const std::shared_ptr<HttpExchange>& ex);

  // For in-process callers (run-batch, tests): stores a file / creates a batch (the create body's JSON) and waits
  // for a batch to end, returning its object.
  nlohmann::ordered_json store_file(std::string filename, std::string purpose, std::string data);
  nlohmann::ordered_json create_batch(const nlohmann::json& body);
  nlohmann::ordered_json wait(const std::string& batch_id);
  std::shared_ptr<const std::string> file_content(const std::string& file_id) const;

 private:
  struct File;
  struct Batch;
  class LineExchange;

  nlohmann::ordered_json file_object(const File& f) const;
  nlohmann::ordered_json batch_object(const Batch& b) const;
  const File& file_locked(const std::string& id) const;
  Batch& batch_locked(const std::string& id);
  // On the worker: starts the batch's next lines while fewer than kMaxInFlight run.
  void pump();
  // On the worker: line `i` of batch `id` answered (status 0: cancelled, no answer).
  void line_done(const std::string& id, size_t i, int status, std::string body);
  void finalize_locked(Batch& b);
  void cancel_locked(Batch& b);
  // A running batch past its completion window expires: no more lines start, running ones are cancelled, and it
  // ends `expired` with the answers it has (checked whenever the batch is looked at or a line answers).
  void expire_if_due_locked(Batch& b);
  std::string new_id(const char* prefix);

  Runner run_;
  Clock clock_;
  std::shared_ptr<SerialWorker> worker_;
  mutable std::mutex mu_;
  std::condition_variable ended_;
  std::map<std::string, std::unique_ptr<File>> files_;
  std::map<std::string, std::unique_ptr<Batch>> batches_;
  std::deque<std::string> queue_;  // batches with lines not yet started, oldest first
  size_t in_flight_ = 0;
  size_t stored_bytes_ = 0;
  uint64_t counter_ = 0;
  uint64_t salt_;
};

}  // namespace mlaserve::server
