// The HTTP API without the HTTP machinery: routes a request (method, path, body) to its handler, which answers
// through an HttpExchange. The Beast layer (http_server.cpp) implements HttpExchange per connection; tests can
// implement it in memory.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "engine/engine_api.h"
#include "server/generation.h"
#include "server/metrics.h"
#include "server/protocol.h"
#include "server/text_codec.h"
#include "structured/token_constraint.h"

namespace mlaserve::server {

// Seconds since the Unix epoch (OpenAI's `created` fields).
int64_t unix_seconds();
// %XX escapes of a URL path or query value decoded (a malformed escape stays as it is).
std::string percent_decode(std::string_view s);
// `key=value` of a query string (percent escapes and '+' decoded), or nullopt.
std::optional<std::string> query_param(std::string_view query, std::string_view key);
// A list route's `limit` query parameter: default 20; ApiError 400 unless an integer in [1, 100].
int64_t list_limit(std::string_view query);
// After a collection's path ("/v1/files"): "/ID" or "/ID/SUB" -> the id and "/SUB" (empty when none).
std::pair<std::string, std::string_view> id_and_sub(std::string_view rest);
// OpenAI's page of a list: {"object": "list", "first_id", "last_id", "has_more", "data"} (ids of data's items).
nlohmann::ordered_json page_object(nlohmann::ordered_json data, bool has_more);

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path + optional query
  std::string body;
  std::string authorization;  // the Authorization header
  std::string content_type;   // the Content-Type header
  std::string request_id;     // the X-Request-Id header when it is 1-128 visible ASCII characters, else empty
  std::string host;           // the Host header
  int local_port = 0;         // the port the connection came in on (0: unknown, e.g. in-memory exchanges)
};

// Whether `id` may be a request id from a header: 1-128 visible ASCII characters.
bool valid_request_id(std::string_view id);

// ApiError 405 naming the request's method and path.
[[noreturn]] void method_not_allowed(const HttpRequest& req);

// One request's response channel. Every call happens on executor() (the connection's strand).
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual Executor executor() = 0;
  // A complete response; ends the exchange.
  virtual void respond(int status, const std::string& content_type, std::string body) = 0;
  // Server-sent events: start_stream sends the 200 headers, send_event writes `data: <payload>\n\n`,
  // end_stream finishes the response.
  virtual void start_stream() = 0;
  virtual void send_event(std::string payload) = 0;
  // `event: <event>` before the data (the Responses API's typed events); by default the data alone.
  virtual void send_named_event(const std::string& event, std::string payload) {
    (void)event;
    send_event(std::move(payload));
  }
  virtual void end_stream() = 0;
  // `fn` runs (once, on the executor) if the client goes away or the request times out before the response has
  // ended; the response cannot be written after that.
  virtual void on_cancel(std::function<void(const std::string& why)> fn) = 0;
};

// An HttpExchange in front of another (the connection's) that rewrites what is written through it (the Responses,
// Messages and scoring APIs over chat or /generate). The inner exchange keeps it alive until the response ends: no
// one else holds it.
class ForwardingExchange : public HttpExchange, public std::enable_shared_from_this<ForwardingExchange> {
 public:
  explicit ForwardingExchange(std::shared_ptr<HttpExchange> inner) : inner_(std::move(inner)) {}
  Executor executor() override { return inner_->executor(); }
  void on_cancel(std::function<void(const std::string& why)> fn) override;

 protected:
  std::shared_ptr<HttpExchange> inner_;
};

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 30000;
  std::string api_key;                // empty: no auth
  // Browser origins answered with CORS headers (requests carrying an Origin header, and OPTIONS preflights);
  // "*" any origin, empty: none.
  std::vector<std::string> allowed_origins = {"*"};
  std::string served_model_name;      // what /v1/models lists and OpenAI requests name
  // vLLM's --served-model-name with several names: the others, which requests may name too (answered under the name
  // they used) and /v1/models lists after the first.
  std::vector<std::string> served_model_aliases;
  std::string model_path;
  std::string tokenizer_path;
  size_t max_body_bytes = 256u << 20;
  int num_threads = 4;                // io_context threads
  double request_timeout_s = 0.0;     // 0: none; else a generation running longer is aborted
  double idle_timeout_s = 300.0;      // keep-alive connection without a request
  int32_t stream_interval = 1;        // tokens per streamed chunk (the last chunk of a choice may have fewer)
  // SGLang's --stream-output: a streamed /generate chunk carries only what is new since the choice's previous chunk
  // (text, output_ids, output logprobs; the prompt's logprobs in the first), not everything so far.
  bool stream_output = false;
  // SGLang's --enable-return-hidden-states: requests may ask for return_hidden_states (else 400).
  bool enable_return_hidden_states = false;
  // The most hidden-state values one request may ask for (positions x hidden size x n, over its prompts): more is a
  // 400 rather than an answer of gigabytes.
  int64_t max_hidden_state_floats = int64_t{1} << 27;
  // SGLang's --enable-return-routed-experts: requests may ask for return_routed_experts (else 400).
  bool enable_return_routed_experts = false;
  // SGLang's --allow-auto-truncate: a prompt too long for the context keeps its first tokens (room left for the
  // tokens asked for, at least one) instead of a 400.
  bool allow_auto_truncate = false;
  // vLLM's --enable-request-id-headers: every response carries X-Request-Id (the request's own, else a new one).
  bool request_id_headers = false;
  bool log_requests = false;  // --log-requests: a log line per generation request as it arrives and as it finishes
  // SGLang's --log-requests-level: 0 the request's shape and counts, 1 and its sampling parameters, 2 and its prompt
  // and output text (their first 2048 bytes), 3 all of them. vLLM's --max-log-len (>= 0): the most bytes (or ids)
  // shown instead.
  int log_requests_level = 2;
  int64_t max_log_len = -1;
  std::string reasoning_parser;       // --reasoning-parser (known_reasoning_parser): chat gives reasoning_content
  std::string response_role = "assistant";  // vLLM's --response-role: the role chat answers are given
  bool trust_request_chat_template = false;  // vLLM's --trust-request-chat-template: requests' chat_template taken
  std::string tool_call_parser;       // --tool-call-parser (known_tool_call_parser): chat takes tools
  // Requests' `priority` (else a non-zero one is a 400): lower values first (vLLM's --scheduling-policy priority),
  // or higher ones first (SGLang's --enable-priority-scheduling without --schedule-low-priority-values-first).
  bool priority_scheduling = false;
  bool priority_higher_first = false;
  ParseOptions parse;
  nlohmann::json server_args = nlohmann::json::object();  // echoed by /get_server_info
  // SGLang's --weight-version: the weights' version, shown by /get_weight_version and /get_model_info, set by
  // /update_weights_from_disk's weight_version and /update_weight_version.
  std::string weight_version = "default";
  // TLS (vLLM's and SGLang's flags): a PEM certificate (chain) and its private key make every connection HTTPS;
  // ssl_ca_certs and ssl_cert_reqs (Python's ssl.CERT_NONE 0 / OPTIONAL 1 / REQUIRED 2) check client certificates.
  std::string ssl_certfile, ssl_keyfile, ssl_keyfile_password, ssl_ca_certs;
  int ssl_cert_reqs = 0;
  // vLLM's --enable-ssl-refresh: a new connection after the certificate files changed (modification times) gets a
  // context made from them as they are now (the previous one while they do not make a usable one).
  bool ssl_refresh = false;
  // Where /start_profile's traces go unless the request names a folder (SGLang's $SGLANG_TORCH_PROFILER_DIR, vLLM's
  // $VLLM_TORCH_PROFILER_DIR).
  std::string profile_dir = "/tmp";
  // Where /dump_expert_distribution_record writes (SGLang's $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR; made if absent).
  std::string expert_distribution_dir = "/tmp";
  // Prefill / decode disaggregation (server/kv_transfer.h): the address ("host" or "host:port") a prefill answer's
  // kv_transfer_params name for this server (empty: the prefill request's Host header), and how long a decode
  // request's read of a prefill server's rows may take (each of its reads).
  std::string kv_transfer_addr;
  double kv_transfer_timeout_s = 60.0;
  // SGLang's --disaggregation-mode: "null" (bootstrap fields ignored), "prefill" (a request with a bootstrap_room runs
  // one token and ends its room; exports may wait for a room) or "decode" (a request with bootstrap fields reads its
  // prompt's rows from the prefill server's bootstrap port first); the bootstrap port (served by a second listener in
  // prefill mode; a decode request's bootstrap_port default).
  std::string disaggregation_mode = "null";
  int disaggregation_bootstrap_port = 8998;
};

class BatchService;
class ResponseStore;

class Api {
 public:
  Api(EngineClient& engine, const TextCodec* codec, ServerOptions opts);
  ~Api();
  void handle(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  ServerMetrics& metrics() { return metrics_; }
  BatchService& batches() { return *batches_; }
  const ServerOptions& options() const { return opts_; }

 private:
  struct Prepared;
  // id: the request's id when the caller chose it (the Responses API's resp_...), else made here.
  void generate(ApiKind api, const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex,
                const std::string& id = {});
  // generate() once the request is prepared (and its prompts' rows read from a prefill server, when it names one).
  void run_generation(const ParsedRequest& pr, Prepared p, const std::shared_ptr<HttpExchange>& ex);
  // The longest prefix of `tokens` this server's device cache holds under `salt` (blocks for an engine job).
  int32_t local_prefix(const std::vector<int32_t>& tokens, const std::string& salt, int32_t rank);
  // A decode request of prefill / decode disaggregation (kv_transfer_params do_remote_prefill, or SGLang's bootstrap
  // fields in decode mode): each prompt's rows read from its source (one per prompt) on kv_fetch_, then
  // run_generation on the connection's executor.
  void generate_after_transfer(const HttpRequest& req, ParsedRequest pr, Prepared p, std::vector<KvSource> sources,
                               const std::shared_ptr<HttpExchange>& ex);
  // POST /kv_transfer/export ({"token_ids", "cache_salt", "begin", "max_tokens", "bootstrap_room", "wait_ms"}): the
  // cached rows of the tokens' prefix (EngineClient::export_kv) as server/kv_transfer.h encodes them; in prefill mode
  // with a bootstrap_room, once that room's request has ended (or wait_ms / the transfer timeout has passed).
  void kv_export(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  // vLLM's /tokenize ({"prompt"} or chat {"messages"}) and /detokenize ({"tokens"}).
  void tokenize(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  void detokenize(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  // SGLang's POST /v1/score and vLLM's POST /generative_scoring (server/scoring.h): the items' prompts generated as
  // one native /generate batch of one token each, answered through a ScoreExchange.
  void score(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool vllm);
  // SGLang's /abort_request ({"rid"} or {"abort_all": true}): the named running jobs end with an abort finish.
  void abort_request(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  // The running jobs whose id `match` accepts end with an abort finish carrying `message`; returns how many.
  size_t abort_jobs(const std::function<bool(const std::string&)>& match, const std::string& message);
  // SGLang's /open_session ({"capacity_of_str_len", "session_id"}: the id as a JSON string) and /close_session
  // ({"session_id"}: 200, empty): sessions_.
  void open_session(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  void close_session(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  // SGLang's /configure_logging ({"log_requests", "log_requests_level", ...}): request logging changed while running;
  // 200 with an empty body.
  void configure_logging(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  // POST /v1/responses: OpenAI's Responses API, generated as chat (server/responses.h); stored, continued and run
  // in the background through responses_store_.
  void responses(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  // The input items and outputs of the stored responses a Responses request continues (previous_response_id): 404
  // for an unknown id, 400 for one still running.
  nlohmann::ordered_json previous_conversation(const nlohmann::ordered_json& body);
  // A chat request's prompt (messages, tools, chat_template_kwargs, add_generation_prompt) as the template renders
  // and the tokenizer encodes it; ApiError for bad messages or a failing template.
  std::vector<int32_t> chat_prompt_ids(const nlohmann::json& body);
  // Anthropic's POST /v1/messages (server/anthropic.h; generated as chat) and, with `count`, POST
  // /v1/messages/count_tokens ({"input_tokens"}).
  void messages(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool count);
  // POST /v1/responses/input_tokens: OpenAI's count of a Responses request's input tokens.
  void responses_input_tokens(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  // /v1/responses/{id}: GET, DELETE, GET .../input_items, POST .../cancel; `rest` the path after /v1/responses.
  void stored_response(const HttpRequest& req, std::string_view rest, std::string_view query,
                       const std::shared_ptr<HttpExchange>& ex);
  // The answer (status, JSON error body) to a request whose handling threw, from inside a catch block: a 4xx for
  // client errors, else 500 (logged).
  std::pair<int, std::string> error_answer(const HttpRequest& req);
  // /health_generate: one token generated (200), or 503 when the engine fails it.
  void health_generate(const std::shared_ptr<HttpExchange>& ex);
  // SGLang's POST /update_weights_from_disk ({"model_path", "load_format", "abort_all_requests", "flush_cache",
  // "weight_version"}): EngineClient::update_weights; 200 {"success": true, ...} or 400 {"success": false, "message"}.
  void update_weights_from_disk(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  // SGLang's GET / POST /get_weights_by_name ({"name", "truncate_size": 100}): EngineClient::get_weights; 200 with the
  // tensor's first truncate_size rows as nested lists of floats (a vector: its first elements), a list of those per
  // DP rank when there are several (as SGLang's); 400 naming what is wrong (no such tensor, too many values).
  void get_weights_by_name(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  // SGLang's POST /pause_generation ({"mode": "abort" | "retract" | "in_place"}) and vLLM's POST /pause
  // (?wait_for_inflight_requests=&clear_cache=): EngineClient::pause_generation, answered once paused.
  void pause(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool vllm);
  // SGLang's /release_memory_occupation and /resume_memory_occupation ({"tags": [...]} optional): EngineClient's
  // release_memory / resume_memory; 200 {"success": true, "message"}, or 400 with success false.
  void memory_occupation(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool release);
  // vLLM's sleep mode, on the same release / resume: POST /sleep (?level=1 or 2: the weights are loaded again from
  // their checkpoint on waking either way) and POST /wake_up (?tags=weights / kv_cache: any means all); a no-op 200
  // when already asleep / awake; 200 with an empty body, or 400 JSON.
  void sleep_or_wake(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool sleep);
  // SGLang's /start_expert_distribution_record, /stop_... and /dump_... (GET or POST): EngineClient::expert_record;
  // SGLang's text answers (200), a 400 JSON error when recording is off. A dump writes
  // expert_distribution_recorder_<unix time>.json into ServerOptions::expert_distribution_dir: {"rank": 0,
  // "num_layers", "num_experts", "logical_count": [layer][expert]} (routed (token, expert) pairs summed over the
  // recording; SGLang's stat mode keeps one such table per step in a torch file).
  void expert_record(const std::shared_ptr<HttpExchange>& ex, ExpertRecordOp op);
  // SGLang's and vLLM's /start_profile ({"output_dir", "num_steps"} optional; SGLang's other fields accepted) and
  // /stop_profile (GET or POST): EngineClient::profile; SGLang's text answers, a 400 JSON error when refused.
  void profile(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool start);
  // The checkpoint the weights came from and their version (both change with updates).
  std::pair<std::string, std::string> weights_info() const;
  Prepared prepare(ParsedRequest& pr);
  // ApiError 404 unless `model` names the served model (one of its names, its path, or "default").
  void check_model(const std::string& model) const;
  // `model` is one of the served model's names (served_model_name or an alias) or its path.
  bool serves(const std::string& model) const;
  // The name OpenAI responses give: the request's `model` when it is one of the served names, else the first.
  const std::string& answered_name(const std::string& model) const;
  // A chat request's prompt text: the model's chat template, or the request's own (vLLM's chat_template: a 400
  // without --trust-request-chat-template); ApiError 400 when the template fails on the messages.
  std::string render_chat(const ParsedRequest& pr, bool add_generation_prompt, const nlohmann::json& vars) const;
  // Completions `suffix`: the prompts' ids made into DeepSeek's fill-in-the-middle prompt.
  void fill_in_the_middle(ParsedRequest& pr) const;
  // The id of the tokenizer's one token whose text is `text` (a special token such as DeepSeek's FIM and tool-call
  // markers), or nullopt; looked up once per text (the tokenizer never changes).
  std::optional<int32_t> single_token(const std::string& text) const;
  void respond_json(const std::shared_ptr<HttpExchange>& ex, int status, const std::string& body);
  void respond_error(const std::shared_ptr<HttpExchange>& ex, int status, const std::string& body);
  // A 404: the background response `id` was deleted before its client got it (from any thread).
  void respond_deleted(const std::shared_ptr<HttpExchange>& ex, const std::string& id);
  std::string new_id();
  nlohmann::ordered_json model_card(const std::string& name) const;

  EngineClient& engine_;
  const TextCodec* codec_;
  ServerOptions opts_;
  // weights_info(); shared with the callbacks of updates in progress (they may finish after this Api is gone).
  struct WeightsState {
    std::mutex mu;
    std::string path, version;
  };
  std::shared_ptr<WeightsState> weights_ = std::make_shared<WeightsState>();
  ServerMetrics metrics_;
  std::atomic<uint64_t> next_id_{0};
  uint64_t id_salt_;
  // Constrained decoding: the constraint of a regex over the tokenizer's tokens (made by the first request that needs
  // it; the last kConstraintCache regexes are kept, so requests with the same schema share its automaton and masks).
  // nfa: the regex already compiled (ParsedRequest::constraint_nfa), or null.
  std::shared_ptr<TokenConstraint> constraint_for(const std::string& regex,
                                                  const std::shared_ptr<const structured::Nfa>& nfa = nullptr);
  static constexpr size_t kConstraintCache = 32;
  mutable std::mutex special_mu_;
  mutable std::unordered_map<std::string, std::optional<int32_t>> specials_;
  std::mutex vocab_mu_;
  std::shared_ptr<const structured::TokenVocab> vocab_;
  std::vector<std::pair<std::string, std::shared_ptr<TokenConstraint>>> constraints_;  // most recent last
  std::mutex jobs_mu_;
  std::unordered_map<std::string, std::weak_ptr<GenerationJob>> jobs_;  // running jobs by id (rid), for aborts
  // The Responses API's stored and background responses (server/response_store.h): its worker runs generate().
  std::unique_ptr<ResponseStore> responses_store_;
  // SGLang's sessions (server/sessions.h); shared with the jobs that record their outputs there as they end.
  std::shared_ptr<SessionStore> sessions_ = std::make_shared<SessionStore>();
  // Request logging as configured now (ServerOptions' log_requests / log_requests_level, /configure_logging).
  std::atomic<bool> log_requests_{false};
  std::atomic<int> log_level_{2};
  // The decode side's reads of prefill servers' rows (generate_after_transfer).
  std::unique_ptr<KvFetchPool> kv_fetch_ = std::make_unique<KvFetchPool>(4);
  // Prefill mode: the bootstrap rooms whose requests ended (shared with the jobs that end them); else null.
  std::shared_ptr<BootstrapRooms> rooms_;
  // OpenAI's Files and Batch APIs (server/batches.h): its lines run through handle(). Last: destroyed first.
  std::unique_ptr<BatchService> batches_;
};

}  // namespace mlaserve::server
