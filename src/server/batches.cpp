#include "server/batches.h"

#include <algorithm>
#include <cctype>
#include <random>
#include <set>

#include <fmt/format.h>

#include "core/log.h"
#include "server/api_error.h"

namespace mlaserve::server {
namespace {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

std::string dump(const ojson& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

[[noreturn]] void not_found(const std::string& what, const std::string& id) {
  throw ApiError(404, fmt::format("no {} with id '{}'", what, id), "", "not_found");
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// The value of parameter `key` in a header value such as `form-data; name="file"; filename="a.jsonl"` (quoted or
// token form; a quoted value's backslash escapes undone).
std::optional<std::string> header_param(std::string_view value, std::string_view key) {
  size_t i = value.find(';');
  while (i != std::string_view::npos) {
    std::string_view rest = trim(value.substr(i + 1));
    const size_t eq = rest.find('=');
    if (eq == std::string_view::npos) return std::nullopt;
    const std::string name = lower(trim(rest.substr(0, eq)));
    rest = trim(rest.substr(eq + 1));
    std::string v;
    size_t end = 0;
    if (!rest.empty() && rest.front() == '"') {
      for (end = 1; end < rest.size() && rest[end] != '"'; ++end) {
        if (rest[end] == '\\' && end + 1 < rest.size()) ++end;
        v += rest[end];
      }
      ++end;
    } else {
      end = std::min(rest.find(';'), rest.size());
      v = std::string(trim(rest.substr(0, end)));
    }
    if (name == key) return v;
    const size_t next = rest.find(';', std::min(end, rest.size()));
    if (next == std::string_view::npos) return std::nullopt;
    i = static_cast<size_t>(rest.data() + next - value.data());
  }
  return std::nullopt;
}



}  // namespace

std::vector<FormPart> parse_multipart(std::string_view content_type, std::string_view body) {
  const std::string type = lower(trim(content_type.substr(0, content_type.find(';'))));
  if (type != "multipart/form-data")
    throw ApiError(400, fmt::format("expected a multipart/form-data body (a file upload), got content type '{}'",
                                    std::string(content_type.substr(0, 100))),
                   "", "invalid_value");
  const std::optional<std::string> boundary = header_param(content_type, "boundary");
  if (!boundary || boundary->empty() || boundary->size() > 200)
    throw ApiError(400, "the multipart/form-data content type has no boundary", "", "invalid_value");
  auto malformed = [](const char* why) {
    throw ApiError(400, fmt::format("malformed multipart/form-data body: {}", why), "", "invalid_value");
  };
  const std::string delim = "--" + *boundary;
  // The first delimiter may follow a preamble; every later one follows a CRLF.
  size_t at = body.substr(0, delim.size()) == delim ? 0 : body.find("\r\n" + delim);
  if (at == std::string_view::npos) malformed("no boundary line");
  if (at != 0) at += 2;
  std::vector<FormPart> parts;
  for (;;) {
    at += delim.size();
    if (body.substr(at, 2) == "--") return parts;  // the closing delimiter
    while (at < body.size() && (body[at] == ' ' || body[at] == '\t')) ++at;
    if (body.substr(at, 2) != "\r\n") malformed("a boundary line does not end with CRLF");
    at += 2;
    FormPart part;
    bool named = false;
    for (;;) {  // headers up to an empty line
      const size_t eol = body.find("\r\n", at);
      if (eol == std::string_view::npos) malformed("a part's headers do not end");
      const std::string_view line = body.substr(at, eol - at);
      at = eol + 2;
      if (line.empty()) break;
      const size_t colon = line.find(':');
      if (colon == std::string_view::npos) malformed("a part header has no ':'");
      const std::string name = lower(trim(line.substr(0, colon)));
      const std::string_view value = trim(line.substr(colon + 1));
      if (name == "content-disposition") {
        if (auto n = header_param(value, "name")) {
          part.name = *n;
          named = true;
        }
        part.filename = header_param(value, "filename");
      } else if (name == "content-type") {
        part.content_type = std::string(value);
      }
    }
    const size_t end = body.find("\r\n" + delim, at);
    if (end == std::string_view::npos) malformed("a part is not closed by the boundary");
    if (!named) malformed("a part has no Content-Disposition name");
    part.data = std::string(body.substr(at, end - at));
    parts.push_back(std::move(part));
    at = end + 2;
  }
}

struct BatchService::File {
  std::string id, filename, purpose;
  int64_t created_at = 0;
  std::shared_ptr<const std::string> data;
};

struct BatchService::Batch {
  std::string id, endpoint, input_file_id, completion_window, status;
  ojson metadata;  // null or the client's object
  ojson errors;    // null, or {"object": "list", "data": [...]}: why validation failed
  int64_t created_at = 0, in_progress_at = 0, finalizing_at = 0, completed_at = 0, failed_at = 0, cancelling_at = 0,
          cancelled_at = 0, expired_at = 0;
  bool expiring = false;  // past its window: no more lines start; it ends expired
  struct Line {
    std::string custom_id;
    std::string body;  // the request's JSON
    int status = -1;   // -1: not answered; 0: cancelled before an answer
    std::string answer;
    // Held while the line runs: the request's job refers to its exchange weakly (as to a connection's).
    std::shared_ptr<LineExchange> exchange;
  };
  std::vector<Line> lines;
  size_t next = 0;  // lines started
  size_t completed = 0, failed = 0;
  size_t running = 0;  // lines started and not answered yet
  std::string output_file_id, error_file_id;
  bool ended() const {
    return status == "completed" || status == "failed" || status == "cancelled" || status == "expired";
  }
};

// The channel a batch line answers through: the answer (or a cancellation) reaches the service once, on the worker.
class BatchService::LineExchange : public HttpExchange, public std::enable_shared_from_this<LineExchange> {
 public:
  LineExchange(BatchService* svc, std::shared_ptr<SerialWorker> worker, std::string batch, size_t line)
      : svc_(svc), worker_(std::move(worker)), batch_(std::move(batch)), line_(line) {}
  Executor executor() override { return worker_->executor(); }
  void respond(int status, const std::string&, std::string body) override { finish(status, std::move(body)); }
  // Batch lines are refused when they ask to stream (create_batch), so no stream starts; answered as an error.
  void start_stream() override { finish(500, R"({"error": {"message": "a batch request streamed"}})"); }
  void send_event(std::string) override {}
  void end_stream() override {}
  void on_cancel(std::function<void(const std::string&)> fn) override { cancel_ = std::move(fn); }
  // On the worker: the batch was cancelled; a request still running is aborted.
  void cancel() {
    if (done_) return;
    if (cancel_) cancel_("the batch was cancelled");
    finish(0, "");
  }

 private:
  void finish(int status, std::string body) {
    if (done_) return;
    done_ = true;
    cancel_ = nullptr;  // it holds the job
    const auto self = shared_from_this();  // line_done lets the batch's reference go
    svc_->line_done(batch_, line_, status, std::move(body));
  }
  BatchService* svc_;
  std::shared_ptr<SerialWorker> worker_;
  std::string batch_;
  size_t line_;
  bool done_ = false;
  std::function<void(const std::string&)> cancel_;
};

BatchService::BatchService(Runner run, Clock clock)
    : run_(std::move(run)), clock_(std::move(clock)), worker_(SerialWorker::start("batch worker")),
      salt_(std::random_device{}()) {}

BatchService::~BatchService() {
  worker_->stop();
  // Lines still running answer into the stopped worker: dropped (the engine aborts them as it shuts down).
}

std::string BatchService::new_id(const char* prefix) {
  return fmt::format("{}{:08x}{:08x}", prefix, static_cast<uint32_t>(salt_), static_cast<uint32_t>(++counter_));
}

ojson BatchService::file_object(const File& f) const {
  ojson o;
  o["id"] = f.id;
  o["object"] = "file";
  o["bytes"] = f.data->size();
  o["created_at"] = f.created_at;
  o["filename"] = f.filename;
  o["purpose"] = f.purpose;
  return o;
}

ojson BatchService::batch_object(const Batch& b) const {
  auto at = [](int64_t t) { return t > 0 ? ojson(t) : ojson(nullptr); };
  ojson o;
  o["id"] = b.id;
  o["object"] = "batch";
  o["endpoint"] = b.endpoint;
  o["errors"] = b.errors;
  o["input_file_id"] = b.input_file_id;
  o["completion_window"] = b.completion_window;
  o["status"] = b.status;
  o["output_file_id"] = b.output_file_id.empty() ? ojson(nullptr) : ojson(b.output_file_id);
  o["error_file_id"] = b.error_file_id.empty() ? ojson(nullptr) : ojson(b.error_file_id);
  o["created_at"] = b.created_at;
  o["in_progress_at"] = at(b.in_progress_at);
  o["expires_at"] = b.created_at + kWindowSeconds;
  o["finalizing_at"] = at(b.finalizing_at);
  o["completed_at"] = at(b.completed_at);
  o["failed_at"] = at(b.failed_at);
  o["expired_at"] = at(b.expired_at);
  o["cancelling_at"] = at(b.cancelling_at);
  o["cancelled_at"] = at(b.cancelled_at);
  o["request_counts"] = {{"total", b.lines.size()}, {"completed", b.completed}, {"failed", b.failed}};
  o["metadata"] = b.metadata;
  return o;
}

const BatchService::File& BatchService::file_locked(const std::string& id) const {
  const auto it = files_.find(id);
  if (it == files_.end()) not_found("file", id);
  return *it->second;
}

BatchService::Batch& BatchService::batch_locked(const std::string& id) {
  const auto it = batches_.find(id);
  if (it == batches_.end()) not_found("batch", id);
  return *it->second;
}

ojson BatchService::store_file(std::string filename, std::string purpose, std::string data) {
  auto f = std::make_unique<File>();
  f->filename = std::move(filename);
  f->purpose = std::move(purpose);
  f->created_at = clock_();
  f->data = std::make_shared<const std::string>(std::move(data));
  std::lock_guard lk(mu_);
  if (stored_bytes_ + f->data->size() > kMaxStoredBytes)
    throw ApiError(400,
                   fmt::format("the server's file storage is full ({} of {} bytes held); delete files first",
                               stored_bytes_, kMaxStoredBytes),
                   "file", "storage_full");
  f->id = new_id("file-");
  stored_bytes_ += f->data->size();
  ojson o = file_object(*f);
  files_.emplace(f->id, std::move(f));
  return o;
}

std::shared_ptr<const std::string> BatchService::file_content(const std::string& file_id) const {
  std::lock_guard lk(mu_);
  return file_locked(file_id).data;
}

void BatchService::files(const HttpRequest& req, std::string_view rest, std::string_view query,
                         const std::shared_ptr<HttpExchange>& ex) {
  if (rest.empty()) {
    if (req.method == "POST") {  // upload: multipart/form-data with `purpose` and `file`
      std::optional<std::string> purpose;
      std::optional<FormPart> file;
      for (FormPart& p : parse_multipart(req.content_type, req.body)) {
        if (p.name == "purpose") purpose = std::move(p.data);
        else if (p.name == "file") file = std::move(p);
      }
      if (!file) throw ApiError(400, "the upload has no 'file' part", "file", "invalid_value");
      if (!purpose || purpose->empty()) throw ApiError(400, "the upload has no 'purpose'", "purpose", "invalid_value");
      ex->respond(200, "application/json",
                  dump(store_file(file->filename.value_or("upload"), std::move(*purpose), std::move(file->data))));
      return;
    }
    if (req.method != "GET") method_not_allowed(req);
    const std::optional<std::string> purpose = query_param(query, "purpose");
    ojson data = ojson::array();
    {
      std::lock_guard lk(mu_);
      std::vector<const File*> all;
      for (const auto& [id, f] : files_)
        if (!purpose || f->purpose == *purpose) all.push_back(f.get());
      std::sort(all.begin(), all.end(), [](const File* a, const File* b) { return a->id > b->id; });  // newest first
      for (const File* f : all) data.push_back(file_object(*f));
    }
    ojson o;
    o["object"] = "list";
    o["data"] = std::move(data);
    o["has_more"] = false;
    ex->respond(200, "application/json", dump(o));
    return;
  }
  const auto [id, sub] = id_and_sub(rest);
  if (sub == "/content") {
    if (req.method != "GET") method_not_allowed(req);
    std::shared_ptr<const std::string> data = file_content(id);
    ex->respond(200, "application/octet-stream", *data);
    return;
  }
  if (!sub.empty()) throw ApiError(404, fmt::format("no route for {} {}", req.method, rest), "", "not_found");
  if (req.method == "GET") {
    std::lock_guard lk(mu_);
    ex->respond(200, "application/json", dump(file_object(file_locked(id))));
  } else if (req.method == "DELETE") {
    {
      std::lock_guard lk(mu_);
      const File& f = file_locked(id);
      stored_bytes_ -= f.data->size();  // a running batch keeps its own reference to the bytes
      files_.erase(id);
    }
    ojson o;
    o["id"] = id;
    o["object"] = "file";
    o["deleted"] = true;
    ex->respond(200, "application/json", dump(o));
  } else {
    method_not_allowed(req);
  }
}

ojson BatchService::create_batch(const json& body) {
  if (!body.is_object()) throw ApiError(400, "the request body must be an object", "", "invalid_type");
  auto str = [&](const char* key) {
    const auto it = body.find(key);
    if (it == body.end() || !it->is_string() || it->get<std::string>().empty())
      throw ApiError(400, fmt::format("'{}' is required (a string)", key), key, "invalid_value");
    return it->get<std::string>();
  };
  auto b = std::make_unique<Batch>();
  b->input_file_id = str("input_file_id");
  b->endpoint = str("endpoint");
  b->completion_window = str("completion_window");
  if (b->endpoint != "/v1/chat/completions" && b->endpoint != "/v1/completions" && b->endpoint != "/v1/responses")
    throw ApiError(400,
                   fmt::format("'endpoint' must be /v1/chat/completions, /v1/completions or /v1/responses, got '{}'",
                               b->endpoint.substr(0, 100)),
                   "endpoint", "invalid_value");
  if (b->completion_window != "24h")
    throw ApiError(400, "'completion_window' must be \"24h\"", "completion_window", "invalid_value");
  b->metadata = nullptr;
  if (const auto it = body.find("metadata"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) throw ApiError(400, "'metadata' must be an object", "metadata", "invalid_type");
    b->metadata = ojson::parse(it->dump());
  }
  b->created_at = clock_();
  b->errors = nullptr;
  std::shared_ptr<const std::string> input = file_content(b->input_file_id);

  // Validation (as OpenAI does it before running anything): every line a request for the endpoint with a unique
  // custom_id; otherwise the batch fails with the lines' errors.
  ojson errors = ojson::array();
  auto error = [&](size_t line, const std::string& code, const std::string& message) {
    if (errors.size() < 100)
      errors.push_back({{"code", code}, {"message", message}, {"param", nullptr}, {"line", line}});
  };
  std::set<std::string> ids;
  size_t pos = 0, line_no = 0;
  while (pos < input->size()) {
    size_t eol = input->find('\n', pos);
    if (eol == std::string::npos) eol = input->size();
    std::string_view text(input->data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (trim(text).empty()) continue;
    // Ordered (the body keeps the client's key order: a JSON schema's properties follow it). What nests deeper than a
    // request body may (one level more: the line wraps the body) is dropped while parsing, never recursed through;
    // such a line is answered as its endpoint answers a body that deep.
    bool too_deep = false;
    const ojson::parser_callback_t depth = [&](int d, ojson::parse_event_t, ojson&) {
      if (d > kMaxBodyDepth + 1) too_deep = true;
      return d <= kMaxBodyDepth + 1;
    };
    ojson line;
    try {
      line = ojson::parse(text, depth);
    } catch (const json::exception&) {
      error(line_no, "invalid_json_line", "the line is not valid JSON");
      continue;
    }
    if (!line.is_object()) {
      error(line_no, "invalid_request", "the line is not a JSON object");
      continue;
    }
    const auto cid = line.find("custom_id");
    if (cid == line.end() || !cid->is_string()) {
      error(line_no, "missing_custom_id", "the line has no string 'custom_id'");
      continue;
    }
    if (!ids.insert(cid->get<std::string>()).second) {
      error(line_no, "duplicate_custom_id", fmt::format("custom_id '{}' appears twice", cid->get<std::string>()));
      continue;
    }
    const auto method = line.find("method");
    if (method == line.end() || *method != "POST") {
      error(line_no, "invalid_method", "'method' must be \"POST\"");
      continue;
    }
    const auto url = line.find("url");
    if (url == line.end() || *url != b->endpoint) {
      error(line_no, "mismatched_url", fmt::format("'url' must be the batch's endpoint {}", b->endpoint));
      continue;
    }
    const auto rbody = line.find("body");
    if (rbody == line.end() || !rbody->is_object()) {
      error(line_no, "invalid_request", "'body' must be an object");
      continue;
    }
    if (const auto st = rbody->find("stream"); st != rbody->end() && st->is_boolean() && st->get<bool>()) {
      error(line_no, "invalid_request", "requests of a batch cannot stream ('stream': true)");
      continue;
    }
    if (const auto bg = rbody->find("background"); bg != rbody->end() && bg->is_boolean() && bg->get<bool>()) {
      error(line_no, "invalid_request", "requests of a batch cannot run in the background ('background': true)");
      continue;
    }
    if (too_deep) {  // answered now: its endpoint's 400
      b->lines.push_back({cid->get<std::string>(), {}, 400,
                          error_body(400, fmt::format("the request body nests more than {} levels", kMaxBodyDepth)),
                          {}});
      ++b->failed;
      continue;
    }
    b->lines.push_back({cid->get<std::string>(), rbody->dump(), -1, {}, {}});
  }
  if (b->lines.size() > kMaxLines) error(line_no, "too_many_requests", fmt::format("at most {} requests", kMaxLines));
  if (b->lines.empty() && errors.empty()) error(0, "empty_file", "the input file holds no request");

  std::lock_guard lk(mu_);
  b->id = new_id("batch_");
  if (!errors.empty()) {
    b->status = "failed";
    b->failed_at = b->created_at;
    b->errors = {{"object", "list"}, {"data", std::move(errors)}};
    b->lines.clear();
  } else {
    b->status = "in_progress";
    b->in_progress_at = b->created_at;
    queue_.push_back(b->id);
  }
  ojson o = batch_object(*b);
  const bool run = b->status == "in_progress";
  batches_.emplace(b->id, std::move(b));
  if (run) worker_->post([this] { pump(); });
  return o;
}

void BatchService::pump() {
  std::vector<std::pair<HttpRequest, std::shared_ptr<LineExchange>>> start;
  {
    std::lock_guard lk(mu_);
    while (in_flight_ < kMaxInFlight && !queue_.empty()) {
      Batch& b = *batches_.at(queue_.front());
      expire_if_due_locked(b);
      while (b.status == "in_progress" && b.next < b.lines.size() && b.lines[b.next].status >= 0)
        ++b.next;  // answered when the batch was created
      if (b.status != "in_progress" || b.expiring || b.next == b.lines.size()) {
        queue_.pop_front();
        if (b.status == "in_progress" && !b.expiring && b.running == 0) finalize_locked(b);  // all answered at creation
        continue;
      }
      const size_t i = b.next++;
      auto ex = std::make_shared<LineExchange>(this, worker_, b.id, i);
      b.lines[i].exchange = ex;
      ++b.running;
      HttpRequest req;
      req.method = "POST";
      req.target = b.endpoint;
      req.body = std::move(b.lines[i].body);
      req.content_type = "application/json";
      start.emplace_back(std::move(req), std::move(ex));
      ++in_flight_;
    }
  }
  for (auto& [req, ex] : start) run_(req, ex);  // may answer at once (a 400): line_done takes the lock itself
}

void BatchService::line_done(const std::string& id, size_t i, int status, std::string body) {
  {
    std::lock_guard lk(mu_);
    --in_flight_;
    const auto it = batches_.find(id);
    if (it == batches_.end()) return;
    Batch& b = *it->second;
    Batch::Line& line = b.lines[i];
    line.exchange.reset();
    line.status = status;
    line.answer = std::move(body);
    --b.running;
    if (status >= 200 && status < 300) ++b.completed;
    else if (status != 0) ++b.failed;
    expire_if_due_locked(b);
    const bool started_all = b.next == b.lines.size() || b.status == "cancelling" || b.expiring;
    if (started_all && b.running == 0 && !b.ended()) finalize_locked(b);
  }
  pump();
}

void BatchService::finalize_locked(Batch& b) {
  b.finalizing_at = clock_();
  std::string out, err;
  for (size_t i = 0; i < b.lines.size(); ++i) {
    const Batch::Line& line = b.lines[i];
    if (line.status <= 0 && b.expiring) {  // OpenAI's error line for a request the window left unanswered
      ojson o;
      o["id"] = fmt::format("batch_req_{}_{}", b.id.substr(6), i);
      o["custom_id"] = line.custom_id;
      o["response"] = nullptr;
      o["error"] = {{"code", "batch_expired"},
                    {"message", "This request could not be executed before the completion window expired."}};
      err += dump(o) + "\n";
      ++b.failed;
      continue;
    }
    if (line.status <= 0) continue;  // cancelled or never started
    ojson answer;
    try {
      answer = ojson::parse(line.answer);
    } catch (const json::exception&) {
      answer = line.answer;
    }
    ojson o;
    o["id"] = fmt::format("batch_req_{}_{}", b.id.substr(6), i);
    o["custom_id"] = line.custom_id;
    ojson response;
    response["status_code"] = line.status;
    response["request_id"] =
        answer.is_object() && answer.contains("id") && answer["id"].is_string() ? answer["id"] : ojson(o["id"]);
    response["body"] = std::move(answer);
    o["response"] = std::move(response);
    o["error"] = nullptr;
    (line.status >= 200 && line.status < 300 ? out : err) += dump(o) + "\n";
  }
  // The result files (stored whatever the storage cap: the work is done).
  auto store = [&](std::string data, const char* suffix) {
    auto f = std::make_unique<File>();
    f->id = new_id("file-");
    f->filename = b.id + suffix;
    f->purpose = "batch_output";
    f->created_at = clock_();
    f->data = std::make_shared<const std::string>(std::move(data));
    stored_bytes_ += f->data->size();
    const std::string fid = f->id;
    files_.emplace(fid, std::move(f));
    return fid;
  };
  if (!out.empty() || err.empty()) b.output_file_id = store(std::move(out), "_output.jsonl");
  if (!err.empty()) b.error_file_id = store(std::move(err), "_error.jsonl");
  if (b.status == "cancelling") {
    b.status = "cancelled";
    b.cancelled_at = clock_();
  } else if (b.expiring) {
    b.status = "expired";
    b.expired_at = clock_();
  } else {
    b.status = "completed";
    b.completed_at = clock_();
  }
  for (auto& line : b.lines) line.body.clear();
  ended_.notify_all();
}

void BatchService::expire_if_due_locked(Batch& b) {
  if (b.status != "in_progress" || b.expiring || clock_() < b.created_at + kWindowSeconds) return;
  b.expiring = true;
  if (b.running == 0) {
    finalize_locked(b);
    return;
  }
  for (size_t i = 0; i < b.next; ++i)
    if (b.lines[i].status < 0 && b.lines[i].exchange) worker_->post([ex = b.lines[i].exchange] { ex->cancel(); });
}

void BatchService::cancel_locked(Batch& b) {
  b.status = "cancelling";
  b.cancelling_at = clock_();
  std::vector<std::shared_ptr<LineExchange>> running;
  for (size_t i = 0; i < b.next; ++i)
    if (b.lines[i].status < 0 && b.lines[i].exchange) running.push_back(b.lines[i].exchange);
  if (b.running == 0) {
    finalize_locked(b);
    return;
  }
  for (auto& ex : running) worker_->post([ex] { ex->cancel(); });
}

void BatchService::batches(const HttpRequest& req, std::string_view rest, std::string_view query,
                           const std::shared_ptr<HttpExchange>& ex) {
  if (rest.empty()) {
    if (req.method == "POST") {
      ex->respond(200, "application/json", dump(create_batch(parse_body(req.body))));
      return;
    }
    if (req.method != "GET") method_not_allowed(req);
    const int64_t limit = list_limit(query);
    const std::optional<std::string> after = query_param(query, "after");
    ojson data = ojson::array();
    bool more = false;
    {
      std::lock_guard lk(mu_);
      std::vector<const Batch*> all;
      for (const auto& [id, b] : batches_) {
        expire_if_due_locked(*b);
        all.push_back(b.get());
      }
      std::sort(all.begin(), all.end(), [](const Batch* a, const Batch* b) { return a->id > b->id; });  // newest first
      size_t i = 0;
      if (after)
        while (i < all.size() && all[i]->id >= *after) ++i;
      for (; i < all.size(); ++i) {
        if (static_cast<int64_t>(data.size()) == limit) {
          more = true;
          break;
        }
        data.push_back(batch_object(*all[i]));
      }
    }
    ex->respond(200, "application/json", dump(page_object(std::move(data), more)));
    return;
  }
  const auto [id, sub] = id_and_sub(rest);
  std::lock_guard lk(mu_);
  Batch& b = batch_locked(id);
  expire_if_due_locked(b);
  if (sub == "/cancel") {
    if (req.method != "POST") method_not_allowed(req);
    if (b.status == "in_progress" || b.status == "validating") cancel_locked(b);
    else if (b.status != "cancelling" && b.status != "cancelled")
      throw ApiError(409, fmt::format("batch {} is {}; only a running batch can be cancelled", id, b.status), "",
                     "invalid_state");
  } else if (!sub.empty()) {
    throw ApiError(404, fmt::format("no route for {} {}", req.method, rest), "", "not_found");
  } else if (req.method != "GET") {
    method_not_allowed(req);
  }
  ex->respond(200, "application/json", dump(batch_object(b)));
}

ojson BatchService::wait(const std::string& batch_id) {
  std::unique_lock lk(mu_);
  Batch& b = batch_locked(batch_id);
  ended_.wait(lk, [&] { return b.ended(); });
  return batch_object(b);
}

}  // namespace mlaserve::server
