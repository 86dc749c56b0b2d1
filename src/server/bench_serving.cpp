// bench-serving: datasets, request shaping (rate, concurrency), the async HTTP client and the report.
#include "server/bench_serving.h"

#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/host_name_verification.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>

#include "core/error.h"
#include "core/log.h"
#include "server/http_client.h"
#include "server/text_codec.h"

namespace mlaserve::bench {
namespace {

using server::TlsStream;
using server::tls_client_setup;

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Endpoint {
  std::string host;
  std::string port;
  std::string prefix;  // path prefix from --base-url
  // https:// (TLS: the server's certificate checked against the system's CAs, or $SSL_CERT_FILE / $SSL_CERT_DIR)
  std::shared_ptr<net::ssl::context> tls;
};

Endpoint endpoint_of(const BenchArgs& a) {
  Endpoint e{a.host, std::to_string(a.port), "", nullptr};
  if (a.base_url.empty()) return e;
  std::string u = a.base_url;
  const bool https = u.rfind("https://", 0) == 0;
  MLA_CHECK(https || u.rfind("http://", 0) == 0, "--base-url: expected an http:// or https:// URL, got '{}'", u);
  u = u.substr(https ? 8 : 7);
  if (https) {
    e.tls = std::make_shared<net::ssl::context>(net::ssl::context::tls_client);
    e.tls->set_default_verify_paths();  // (OpenSSL reads $SSL_CERT_FILE and $SSL_CERT_DIR here)
    e.tls->set_verify_mode(net::ssl::verify_peer);
  }
  const size_t slash = u.find('/');
  std::string hostport = u.substr(0, slash);
  e.prefix = slash == std::string::npos ? "" : u.substr(slash);
  while (!e.prefix.empty() && e.prefix.back() == '/') e.prefix.pop_back();
  const size_t colon = hostport.rfind(':');
  if (colon == std::string::npos) {
    e.host = hostport;
    e.port = https ? "443" : "80";
  } else {
    e.host = hostport.substr(0, colon);
    e.port = hostport.substr(colon + 1);
  }
  return e;
}

std::string auth_header() {
  const char* key = std::getenv("OPENAI_API_KEY");
  return key && *key ? std::string("Bearer ") + key : "";
}

// A request of one answer for the few control calls (model info, flush; warm-up is asynchronous like the rest).
std::pair<int, std::string> simple_request(const Endpoint& ep, const char* method, const std::string& path) {
  server::HttpCall call;
  call.host = ep.host;
  call.port = ep.port;
  call.method = method;
  call.target = ep.prefix + path;
  call.authorization = auth_header();
  call.tls = ep.tls.get();
  server::HttpAnswer a = server::http_call(call);
  return {a.status, std::move(a.body)};
}

// ---- datasets ----

struct Prompt {
  std::string text;
  std::vector<int32_t> ids;  // set: send token ids (random-ids to the native backend)
  int64_t prompt_len = 0;
  int64_t output_len = 0;
};

// Generic English text to cut random prompts from (a real-text stand-in when no ShareGPT file is given).
std::string builtin_corpus() {
  static const char* sentences[] = {
      "The history of computing is a story of people who wanted machines to do arithmetic faster than clerks.",
      "Early mechanical calculators used gears and levers, and later designs replaced them with relays and tubes.",
      "A modern processor executes billions of instructions every second while drawing only a few watts of power.",
      "Language models predict the next token of a text from the tokens that came before it.",
      "Serving such a model to many users at once means batching their requests and sharing the accelerator.",
      "Rivers carve valleys over millions of years, carrying sand and stones from the mountains to the sea.",
      "In the market square, traders sold apples, bread, cheese, and woollen cloth from the nearby villages.",
      "The committee met on Tuesday to discuss the budget, the new library, and the repairs to the old bridge.",
      "She opened the window, listened to the rain, and wrote three letters before the candle burned out.",
      "Mathematicians proved that there are infinitely many prime numbers more than two thousand years ago.",
      "A good recipe lists its ingredients in the order they are used and gives the oven temperature first.",
      "The train left the station at dawn and crossed the plains, the forests, and finally the snowy pass.",
      "Engineers measure latency in milliseconds and throughput in tokens per second when they tune a server.",
      "Children learned to read from simple stories about animals, seasons, and the work of farmers.",
      "When the orchestra began to play, the audience fell silent and the hall filled with music.",
      "Good documentation explains why a design was chosen, not only what the code does line by line.",
  };
  std::mt19937_64 rng(12345);
  std::string out;
  for (int i = 0; i < 400; ++i) {
    out += sentences[rng() % std::size(sentences)];
    out += (i % 7 == 6) ? "\n\n" : " ";
  }
  return out;
}

int32_t uniform_int(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // inclusive
  if (hi <= lo) return static_cast<int32_t>(lo);
  return static_cast<int32_t>(std::uniform_int_distribution<int64_t>(lo, hi)(rng));
}

// The tokens of the text prompts are cut from: the --dataset-path ShareGPT file's text, else builtin_corpus().
std::vector<int32_t> text_corpus(const BenchArgs& a, const server::TextCodec& codec) {
  std::vector<int32_t> corpus;
  if (!a.dataset_path.empty()) {
    std::ifstream in(a.dataset_path);
    MLA_CHECK(in.good(), "--dataset-path: cannot read '{}'", a.dataset_path);
    json d = json::parse(in);
    std::string text;
    for (const auto& conv : d)
      if (conv.contains("conversations"))
        for (const auto& turn : conv["conversations"])
          if (turn.contains("value") && turn["value"].is_string()) text += turn["value"].get<std::string>() + "\n";
    corpus = codec.encode(text, false);
  } else {
    corpus = codec.encode(builtin_corpus(), false);
  }
  MLA_CHECK(corpus.size() > 16, "the text corpus for the {} dataset is too short", a.dataset_name);
  return corpus;
}

// `n` tokens of the corpus from a random start (wrapping around).
std::vector<int32_t> corpus_cut(std::mt19937_64& rng, const std::vector<int32_t>& corpus, int64_t n) {
  const auto start = static_cast<size_t>(uniform_int(rng, 0, static_cast<int64_t>(corpus.size()) - 1));
  std::vector<int32_t> ids;
  for (int64_t j = 0; j < n; ++j) ids.push_back(corpus[(start + static_cast<size_t>(j)) % corpus.size()]);
  return ids;
}

std::vector<Prompt> random_prompts(const BenchArgs& a, const server::TextCodec& codec, bool ids_dataset,
                                   bool send_ids) {
  std::mt19937_64 rng(a.seed);
  const int64_t in_lo = std::max<int64_t>(static_cast<int64_t>(a.random_input * a.random_range_ratio), 1);
  const int64_t out_lo = std::max<int64_t>(static_cast<int64_t>(a.random_output * a.random_range_ratio), 1);
  std::vector<int32_t> corpus;
  if (!ids_dataset) corpus = text_corpus(a, codec);
  const int64_t vocab = static_cast<int64_t>(codec.vocab_size());
  std::vector<Prompt> out;
  for (int32_t i = 0; i < a.num_prompts; ++i) {
    Prompt p;
    p.prompt_len = uniform_int(rng, in_lo, a.random_input);
    p.output_len = uniform_int(rng, out_lo, a.random_output);
    std::vector<int32_t> ids;
    if (ids_dataset) {
      const int64_t offset = uniform_int(rng, 0, vocab - 1);
      for (int64_t j = 0; j < p.prompt_len; ++j) ids.push_back(static_cast<int32_t>((offset + i + j) % vocab));
    } else {
      ids = corpus_cut(rng, corpus, p.prompt_len);  // real text cut (or repeated) to the target token count
    }
    if (send_ids) p.ids = ids;
    else p.text = codec.decode(ids, false);
    out.push_back(std::move(p));
  }
  return out;
}

// SGLang's generated-shared-prefix: groups of prompts sharing a long system prompt (text cut from the corpus), each
// with a question of its own, in a shuffled order (a group's prompts interleave with the others').
std::vector<Prompt> shared_prefix_prompts(const BenchArgs& a, const server::TextCodec& codec) {
  std::mt19937_64 rng(a.seed);
  const std::vector<int32_t> corpus = text_corpus(a, codec);
  std::vector<Prompt> out;
  for (int32_t g = 0; g < a.gsp_num_groups; ++g) {
    const std::string system = codec.decode(corpus_cut(rng, corpus, a.gsp_system_prompt_len), false);
    for (int32_t q = 0; q < a.gsp_prompts_per_group; ++q) {
      Prompt p;
      p.text = system + "\n\n" + codec.decode(corpus_cut(rng, corpus, a.gsp_question_len), false);
      p.prompt_len = static_cast<int64_t>(codec.encode(p.text, false).size());
      p.output_len = a.gsp_output_len;
      out.push_back(std::move(p));
    }
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

std::vector<Prompt> sharegpt_prompts(const BenchArgs& a, const server::TextCodec& codec) {
  MLA_CHECK(!a.dataset_path.empty(),
            "--dataset-name sharegpt needs --dataset-path (ShareGPT_V3_unfiltered_cleaned_split.json); this tool "
            "does not download");
  std::ifstream in(a.dataset_path);
  MLA_CHECK(in.good(), "--dataset-path: cannot read '{}'", a.dataset_path);
  json d = json::parse(in);
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const auto& conv : d) {
    if (!conv.contains("conversations") || conv["conversations"].size() < 2) continue;
    const auto& c = conv["conversations"];
    if (!c[0].contains("value") || !c[1].contains("value")) continue;
    pairs.emplace_back(c[0]["value"].get<std::string>(), c[1]["value"].get<std::string>());
  }
  std::mt19937_64 rng(a.seed);
  std::shuffle(pairs.begin(), pairs.end(), rng);
  std::vector<Prompt> out;
  for (const auto& [prompt, completion] : pairs) {
    if (static_cast<int32_t>(out.size()) >= a.num_prompts) break;
    Prompt p;
    p.text = prompt;
    p.prompt_len = static_cast<int64_t>(codec.encode(prompt, false).size());
    p.output_len = a.sharegpt_output_len > 0 ? a.sharegpt_output_len
                                             : static_cast<int64_t>(codec.encode(completion, false).size());
    if (p.prompt_len < 2 || p.output_len < 2) continue;
    if (a.sharegpt_output_len <= 0 && (p.prompt_len > 1024 || p.prompt_len + p.output_len > 2048)) continue;
    out.push_back(std::move(p));
  }
  MLA_CHECK(!out.empty(), "--dataset-path '{}': no usable conversations", a.dataset_path);
  return out;
}

// ---- one streamed request ----

struct Shared {
  BenchArgs args;
  Endpoint ep;
  std::string model;
  tcp::resolver::results_type endpoints;
  json extra = json::object();
  std::string auth;
};

std::string request_body(const Shared& s, const Prompt& p) {
  json b;
  const bool stream = !s.args.disable_stream;
  const bool ignore_eos = !s.args.disable_ignore_eos;
  if (s.args.backend == "sglang" || s.args.backend == "sglang-native") {
    if (!p.ids.empty()) b["input_ids"] = p.ids;
    else b["text"] = p.text;
    b["sampling_params"] = {{"temperature", 0.0}, {"max_new_tokens", p.output_len}, {"ignore_eos", ignore_eos}};
    b["stream"] = stream;
  } else {
    b["model"] = s.model;
    if (s.args.backend == "sglang-oai-chat") b["messages"] = json::array({{{"role", "user"}, {"content", p.text}}});
    else b["prompt"] = p.text;
    b["temperature"] = 0.0;
    b["max_tokens"] = p.output_len;
    b["ignore_eos"] = ignore_eos;
    b["stream"] = stream;
    if (stream) b["stream_options"] = {{"include_usage", true}};
  }
  for (auto& [k, v] : s.extra.items()) {
    if (k == "sampling_params" && b.contains("sampling_params")) b["sampling_params"].update(v);
    else b[k] = v;
  }
  return b.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string request_path(const BenchArgs& a) {
  if (a.backend == "sglang" || a.backend == "sglang-native") return "/generate";
  if (a.backend == "sglang-oai") return "/v1/completions";
  return "/v1/chat/completions";
}

// One request on a connection of its own, over plain TCP (Stream = beast::tcp_stream) or TLS (TlsStream).
template <class Stream>
class StreamedRequest : public std::enable_shared_from_this<StreamedRequest<Stream>> {
 public:
  // stream_args: after the executor, what the stream takes (TLS: the client's ssl::context).
  template <class... StreamArgs>
  StreamedRequest(net::any_io_executor ex, const Shared& s, const Prompt& p, std::function<void(RequestResult)> done,
                  StreamArgs&... stream_args)
      : stream_(ex, stream_args...), shared_(s), prompt_(p), done_(std::move(done)) {
    result_.prompt_len = p.prompt_len;
  }

  void start() {
    req_ = {http::verb::post, shared_.ep.prefix + request_path(shared_.args), 11};
    req_.set(http::field::host, shared_.ep.host);
    req_.set(http::field::content_type, "application/json");
    if (!shared_.auth.empty()) req_.set(http::field::authorization, shared_.auth);
    req_.body() = request_body(shared_, prompt_);
    req_.prepare_payload();
    parser_.body_limit(std::numeric_limits<uint64_t>::max());
    start_ = Clock::now();
    transport().expires_after(std::chrono::hours(6));
    transport().async_connect(shared_.endpoints, [self = this->shared_from_this()](beast::error_code ec, auto) {
      if (ec) return self->fail("connect: " + ec.message());
      beast::error_code ignored;
      self->transport().socket().set_option(tcp::no_delay(true), ignored);
      if constexpr (std::is_same_v<Stream, TlsStream>) {
        try {
          tls_client_setup(self->stream_, self->shared_.ep.host);
        } catch (const std::exception& e) {
          return self->fail(e.what());
        }
        self->stream_.async_handshake(net::ssl::stream_base::client, [self](beast::error_code ec2) {
          if (ec2) return self->fail("TLS handshake: " + ec2.message());
          self->write();
        });
      } else {
        self->write();
      }
    });
  }

 private:
  beast::tcp_stream& transport() { return beast::get_lowest_layer(stream_); }

  void write() {
    http::async_write(stream_, req_, [self = this->shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->fail("write: " + ec.message());
      self->read_some();
    });
  }

  void read_some() {
    http::async_read_some(stream_, buffer_, parser_, [self = this->shared_from_this()](beast::error_code ec, size_t) {
      const Clock::time_point now = Clock::now();
      if (ec && ec != http::error::end_of_stream) return self->fail("read: " + ec.message());
      if (self->parser_.is_header_done() && self->parser_.get().result_int() != 200) {
        if (!self->parser_.is_done() && !ec) return self->read_some();
        return self->fail(fmt::format("HTTP {}: {}", self->parser_.get().result_int(), self->parser_.get().body()));
      }
      self->consume(now, self->parser_.is_done() || ec);
      if (self->finished_) return;
      if (self->parser_.is_done() || ec) return self->finish();
      self->read_some();
    });
  }

  // Parse complete SSE events (or the whole body when not streaming) out of the body received so far.
  void consume(Clock::time_point now, bool at_end) {
    std::string& body = parser_.get().body();
    if (shared_.args.disable_stream) {
      if (at_end) handle_payload(body, now, /*whole=*/true);
      return;
    }
    size_t pos;
    while ((pos = body.find("\n\n")) != std::string::npos) {
      std::string event = body.substr(0, pos);
      body.erase(0, pos + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      std::string payload = event.substr(6);
      if (payload == "[DONE]") continue;
      handle_payload(payload, now, false);
    }
  }

  // The native stream's payloads are cumulative (text and output ids so far), so parsing each one in full costs
  // O(length^2) per request; a streamed native payload is only scanned for its completion_tokens (meta_info comes
  // last, so from the end; an error payload has none and is parsed in full), and the last one is parsed (for the
  // text) when the request ends. Quotes inside JSON strings are escaped, so the key cannot match inside the text.
  static bool scan_completion_tokens(const std::string& payload, int64_t& ct) {
    static const std::string key = "\"completion_tokens\":";
    const size_t k = payload.rfind(key);
    if (k == std::string::npos) return false;
    size_t i = k + key.size();
    while (i < payload.size() && payload[i] == ' ') ++i;
    int64_t v = 0;
    const size_t start = i;
    while (i < payload.size() && payload[i] >= '0' && payload[i] <= '9') v = v * 10 + (payload[i++] - '0');
    if (i == start) return false;
    ct = v;
    return true;
  }

  void handle_payload(const std::string& payload, Clock::time_point now, bool whole) {
    const bool native_stream = !whole && (shared_.args.backend == "sglang" || shared_.args.backend == "sglang-native");
    int64_t ct = 0;
    if (native_stream && scan_completion_tokens(payload, ct)) {
      last_native_ = payload;
      count_tokens(ct - result_.output_len, now, whole);
      result_.output_len = ct;
      return;
    }
    json j = json::parse(payload, nullptr, false);
    if (j.is_discarded()) return;
    if (j.contains("error")) {
      error_ = j["error"].dump();
      return;
    }
    const bool native = shared_.args.backend == "sglang" || shared_.args.backend == "sglang-native";
    int64_t tokens_now = 0;   // tokens this payload brings
    if (native) {
      const int64_t ct = j["meta_info"].value("completion_tokens", int64_t{0});
      tokens_now = ct - result_.output_len;
      result_.output_len = ct;
      result_.generated_text = j.value("text", std::string());
    } else {
      if (j.contains("usage") && j["usage"].is_object()) usage_tokens_ = j["usage"].value("completion_tokens", int64_t{-1});
      if (!j.contains("choices") || j["choices"].empty()) return;
      const auto& ch = j["choices"][0];
      std::string text;
      if (ch.contains("text") && ch["text"].is_string()) text = ch["text"];
      else if (ch.contains("delta") && ch["delta"].contains("content") && ch["delta"]["content"].is_string())
        text = ch["delta"]["content"];
      else if (ch.contains("message") && ch["message"].contains("content") && ch["message"]["content"].is_string())
        text = ch["message"]["content"];
      if (text.empty()) return;
      result_.generated_text += text;
      tokens_now = 1;  // an OpenAI chunk carries one token's text (the usage chunk corrects the total)
      ++chunk_tokens_;
    }
    count_tokens(tokens_now, now, whole);
  }

  void count_tokens(int64_t tokens_now, Clock::time_point now, bool whole) {
    if (tokens_now <= 0) return;
    if (!got_first_) {
      got_first_ = true;
      result_.ttft = seconds(now - start_);
    } else if (!whole) {
      const double per_token = seconds(now - last_) / static_cast<double>(tokens_now);
      for (int64_t k = 0; k < tokens_now; ++k) result_.itl.push_back(per_token);
    }
    last_ = now;
  }

  void finish() {
    finished_ = true;
    result_.latency = seconds(Clock::now() - start_);
    const bool native = shared_.args.backend == "sglang" || shared_.args.backend == "sglang-native";
    if (native && !last_native_.empty()) {
      json j = json::parse(last_native_, nullptr, false);
      if (!j.is_discarded() && j.contains("text") && j["text"].is_string()) result_.generated_text = j["text"];
    }
    if (!native) result_.output_len = usage_tokens_ >= 0 ? usage_tokens_ : chunk_tokens_;
    if (!error_.empty()) {
      result_.error = error_;
    } else if (!got_first_ && result_.output_len == 0) {
      result_.error = "no tokens received";
    } else {
      result_.success = true;
      if (!got_first_) result_.ttft = result_.latency;
    }
    close();
    done_(std::move(result_));
  }

  void fail(const std::string& why) {
    if (finished_) return;
    finished_ = true;
    result_.success = false;
    result_.error = why;
    result_.latency = seconds(Clock::now() - start_);
    close();
    done_(std::move(result_));
  }

  void close() {
    beast::error_code ec;
    transport().socket().shutdown(tcp::socket::shutdown_both, ec);
    transport().socket().close(ec);
  }

  Stream stream_;
  const Shared& shared_;
  const Prompt& prompt_;
  std::function<void(RequestResult)> done_;
  http::request<http::string_body> req_;
  http::response_parser<http::string_body> parser_;
  beast::flat_buffer buffer_;
  RequestResult result_;
  std::string last_native_;  // the latest cumulative native payload (parsed at the end)
  Clock::time_point start_, last_;
  bool got_first_ = false, finished_ = false;
  int64_t usage_tokens_ = -1, chunk_tokens_ = 0;
  std::string error_;
};

// ---- progress bar (tqdm-like, on stderr) ----

class Progress {
 public:
  Progress(size_t total, bool enabled) : total_(total), enabled_(enabled), start_(Clock::now()) { draw(true); }
  void tick() {
    ++done_;
    draw(done_ == total_);
  }
  void end() {
    if (enabled_) std::cerr << "\n";
  }

 private:
  void draw(bool force) {
    if (!enabled_) return;
    const Clock::time_point now = Clock::now();
    if (!force && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    const double el = seconds(now - start_);
    const double rate = el > 0 ? static_cast<double>(done_) / el : 0.0;
    const double remaining = rate > 0 ? static_cast<double>(total_ - done_) / rate : 0.0;
    const int width = 30;
    const int filled = total_ ? static_cast<int>(width * done_ / total_) : width;
    auto mmss = [](double s) {
      const int t = static_cast<int>(s);
      return fmt::format("{:02d}:{:02d}", t / 60, t % 60);
    };
    std::string bar;
    for (int i = 0; i < width; ++i) bar += i < filled ? "\u2588" : " ";
    std::cerr << fmt::format("\r{:3d}%|{}| {}/{} [{}<{}, {:.2f}it/s]", total_ ? 100 * done_ / total_ : 100, bar,
                             done_, total_, mmss(el), mmss(remaining), rate)
              << std::flush;
  }
  size_t total_, done_ = 0;
  bool enabled_;
  Clock::time_point start_, last_draw_{};
};

// Runs `prompts` against the server with the arrival process and concurrency cap of `args`; results in order.
std::vector<RequestResult> run_requests(const Shared& s, const std::vector<Prompt>& prompts, bool arrival_process,
                                        bool show_progress, double& duration) {
  net::io_context ioc;
  auto work = net::make_work_guard(ioc);
  std::vector<RequestResult> results(prompts.size());
  std::mutex mu;
  size_t completed = 0, next = 0, in_flight = 0;
  Progress progress(prompts.size(), show_progress && !s.args.disable_tqdm);
  const size_t cap = s.args.max_concurrency > 0 ? static_cast<size_t>(s.args.max_concurrency) : SIZE_MAX;
  std::deque<size_t> ready;  // arrived, waiting for a concurrency slot
  std::mt19937_64 rng(s.args.seed);
  const bool poisson = arrival_process && std::isfinite(s.args.request_rate) && s.args.request_rate > 0;
  std::exponential_distribution<double> gap(poisson ? s.args.request_rate : 1.0);
  net::steady_timer timer(ioc);
  std::function<void()> launch_ready;
  std::function<void()> schedule_next;

  auto on_done = [&](size_t i, RequestResult r) {
    std::lock_guard lk(mu);
    results[i] = std::move(r);
    ++completed;
    --in_flight;
    progress.tick();
    if (completed == prompts.size()) work.reset();
    else net::post(ioc, [&] { launch_ready(); });
  };
  launch_ready = [&] {
    std::vector<size_t> to_start;
    {
      std::lock_guard lk(mu);
      while (!ready.empty() && in_flight < cap) {
        to_start.push_back(ready.front());
        ready.pop_front();
        ++in_flight;
      }
    }
    for (size_t i : to_start) {
      auto done = [&, i](RequestResult r) { on_done(i, std::move(r)); };
      if (s.ep.tls)
        std::make_shared<StreamedRequest<TlsStream>>(net::make_strand(ioc), s, prompts[i], done, *s.ep.tls)->start();
      else
        std::make_shared<StreamedRequest<beast::tcp_stream>>(net::make_strand(ioc), s, prompts[i], done)->start();
    }
  };
  schedule_next = [&] {
    {
      std::lock_guard lk(mu);
      if (next >= prompts.size()) return;
      ready.push_back(next++);
    }
    launch_ready();
    if (!poisson) {
      net::post(ioc, [&] { schedule_next(); });
      return;
    }
    timer.expires_after(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng))));
    timer.async_wait([&](beast::error_code ec) {
      if (!ec) schedule_next();
    });
  };
  const Clock::time_point t0 = Clock::now();
  if (prompts.empty()) work.reset();
  else net::post(ioc, [&] { schedule_next(); });
  std::vector<std::thread> threads;
  const int nthreads = s.args.num_threads > 0
                           ? s.args.num_threads
                           : static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency() / 2, 2, 8));
  for (int t = 1; t < nthreads; ++t) threads.emplace_back([&] { ioc.run(); });
  ioc.run();
  for (auto& t : threads) t.join();
  duration = seconds(Clock::now() - t0);
  progress.end();
  return results;
}

void check_args(const BenchArgs& a) {
  MLA_CHECK(a.backend == "sglang" || a.backend == "sglang-native" || a.backend == "sglang-oai" ||
                a.backend == "sglang-oai-chat",
            "--backend: expected sglang, sglang-native, sglang-oai or sglang-oai-chat, got '{}'", a.backend);
  MLA_CHECK(a.dataset_name == "random" || a.dataset_name == "random-ids" || a.dataset_name == "sharegpt" ||
                a.dataset_name == "generated-shared-prefix",
            "--dataset-name: expected random, random-ids, sharegpt or generated-shared-prefix, got '{}'",
            a.dataset_name);
  MLA_CHECK(a.gsp_num_groups >= 1 && a.gsp_prompts_per_group >= 1 && a.gsp_system_prompt_len >= 1 &&
                a.gsp_question_len >= 1 && a.gsp_output_len >= 1,
            "--gsp-num-groups, --gsp-prompts-per-group, --gsp-system-prompt-len, --gsp-question-len and "
            "--gsp-output-len must be >= 1");
  MLA_CHECK(a.num_prompts >= 1, "--num-prompts must be >= 1");
  MLA_CHECK(a.random_input >= 1 && a.random_output >= 1, "--random-input and --random-output must be >= 1");
  MLA_CHECK(a.random_range_ratio >= 0.0 && a.random_range_ratio <= 1.0, "--random-range-ratio must be in [0, 1]");
  MLA_CHECK(a.request_rate > 0, "--request-rate must be positive (inf: all at once)");
  MLA_CHECK(a.max_concurrency >= 0, "--max-concurrency must be >= 0");
}

}  // namespace

int run_bench_serving(const BenchArgs& args) {
  check_args(args);
  Shared s;
  s.args = args;
  s.ep = endpoint_of(args);
  s.auth = auth_header();
  if (!args.extra_request_body.empty()) {
    s.extra = json::parse(args.extra_request_body, nullptr, false);
    MLA_CHECK(s.extra.is_object(), "--extra-request-body must be a JSON object");
  }
  {
    net::io_context ioc;
    tcp::resolver resolver(ioc);
    beast::error_code ec;
    s.endpoints = resolver.resolve(s.ep.host, s.ep.port, ec);
    MLA_CHECK(!ec, "cannot resolve {}:{}: {}", s.ep.host, s.ep.port, ec.message());
  }
  // Model name and tokenizer: flags, else what the server says.
  json model_info;
  try {
    auto [status, body] = simple_request(s.ep, "GET", "/get_model_info");
    if (status == 200) model_info = json::parse(body, nullptr, false);
  } catch (const std::exception& e) {
    fail("cannot reach the server at {}:{}{}: {}", s.ep.host, s.ep.port, s.ep.prefix, e.what());
  }
  s.model = args.model;
  if (s.model.empty()) {
    auto [status, body] = simple_request(s.ep, "GET", "/v1/models");
    json m = json::parse(body, nullptr, false);
    if (status == 200 && m.contains("data") && !m["data"].empty()) s.model = m["data"][0].value("id", "");
  }
  std::string tokenizer = args.tokenizer;
  if (tokenizer.empty() && model_info.is_object() && model_info.contains("tokenizer_path") &&
      model_info["tokenizer_path"].is_string())
    tokenizer = model_info["tokenizer_path"];
  MLA_CHECK(!tokenizer.empty(), "no tokenizer: pass --tokenizer (the server did not name one)");
  auto codec = server::load_text_codec(tokenizer);
  MLA_CHECK(codec != nullptr, "this build has no tokenizer library");

  const bool native = args.backend == "sglang" || args.backend == "sglang-native";
  std::vector<Prompt> prompts =
      args.dataset_name == "sharegpt"                  ? sharegpt_prompts(args, *codec)
      : args.dataset_name == "generated-shared-prefix" ? shared_prefix_prompts(args, *codec)
                                                       : random_prompts(args, *codec, args.dataset_name == "random-ids",
                                                                        native && args.dataset_name == "random-ids");
  int64_t total_in = 0, total_out = 0;
  for (const auto& p : prompts) {
    total_in += p.prompt_len;
    total_out += p.output_len;
  }
  std::cout << fmt::format("#Input tokens: {}\n#Output tokens: {}", total_in, total_out) << std::endl;

  // Warm-up: the first prompt, short, must succeed.
  if (args.warmup_requests > 0) {
    std::vector<Prompt> warm(static_cast<size_t>(args.warmup_requests), prompts[0]);
    for (auto& w : warm) w.output_len = std::min<int64_t>(w.output_len, 16);
    double d = 0;
    Shared ws = s;
    ws.args.max_concurrency = 0;
    auto r = run_requests(ws, warm, false, false, d);
    for (const auto& x : r)
      if (!x.success) {
        std::cerr << "Initial test run failed - Please make sure benchmark arguments are correctly specified. Error: "
                  << x.error << std::endl;
        return 1;
      }
    std::cout << "Initial test run completed. Starting main benchmark run..." << std::endl;
  }
  if (native) {
    try {
      simple_request(s.ep, "POST", "/flush_cache");
    } catch (const std::exception&) {
    }
  }

  double duration = 0.0;
  std::vector<RequestResult> results = run_requests(s, prompts, true, true, duration);
  std::vector<int64_t> retok;
  for (const auto& r : results)
    retok.push_back(r.success ? static_cast<int64_t>(codec->encode(r.generated_text, false).size()) : -1);
  BenchMetrics m = compute_bench_metrics(results, duration, retok);
  std::cout << format_bench_metrics(args, m) << std::flush;

  size_t failed = 0;
  for (const auto& r : results)
    if (!r.success) {
      if (failed < 5) std::cerr << "request failed: " << r.error << "\n";
      ++failed;
    }
  if (failed) std::cerr << fmt::format("{} of {} requests failed", failed, results.size()) << std::endl;

  if (!args.output_file.empty()) {
    json o;
    o["backend"] = args.backend;
    o["dataset_name"] = args.dataset_name;
    o["request_rate"] = std::isfinite(args.request_rate) ? json(args.request_rate) : json("inf");
    o["max_concurrency"] = args.max_concurrency > 0 ? json(args.max_concurrency) : json(nullptr);
    o["random_input_len"] = args.random_input;
    o["random_output_len"] = args.random_output;
    o["random_range_ratio"] = args.random_range_ratio;
    o["num_prompts"] = args.num_prompts;
    o["duration"] = m.duration;
    o["completed"] = m.completed;
    o["total_input_tokens"] = m.total_input;
    o["total_output_tokens"] = m.total_output;
    o["total_output_tokens_retokenized"] = m.total_output_retokenized;
    o["request_throughput"] = m.request_throughput;
    o["input_throughput"] = m.input_throughput;
    o["output_throughput"] = m.output_throughput;
    o["total_throughput"] = m.total_throughput;
    o["concurrency"] = m.concurrency;
    o["mean_e2e_latency_ms"] = m.mean_e2e_ms;
    o["median_e2e_latency_ms"] = m.median_e2e_ms;
    o["std_e2e_latency_ms"] = m.std_e2e_ms;
    o["p99_e2e_latency_ms"] = m.p99_e2e_ms;
    o["mean_ttft_ms"] = m.mean_ttft_ms;
    o["median_ttft_ms"] = m.median_ttft_ms;
    o["std_ttft_ms"] = m.std_ttft_ms;
    o["p99_ttft_ms"] = m.p99_ttft_ms;
    o["mean_tpot_ms"] = m.mean_tpot_ms;
    o["median_tpot_ms"] = m.median_tpot_ms;
    o["std_tpot_ms"] = m.std_tpot_ms;
    o["p99_tpot_ms"] = m.p99_tpot_ms;
    o["mean_itl_ms"] = m.mean_itl_ms;
    o["median_itl_ms"] = m.median_itl_ms;
    o["std_itl_ms"] = m.std_itl_ms;
    o["p95_itl_ms"] = m.p95_itl_ms;
    o["p99_itl_ms"] = m.p99_itl_ms;
    o["max_itl_ms"] = m.max_itl_ms;
    if (args.output_details) {
      json in = json::array(), out = json::array(), ttfts = json::array(), itls = json::array(),
           texts = json::array(), errors = json::array();
      for (const auto& r : results) {
        in.push_back(r.prompt_len);
        out.push_back(r.output_len);
        ttfts.push_back(r.ttft);
        itls.push_back(r.itl);
        texts.push_back(r.generated_text);
        errors.push_back(r.error);
      }
      o["input_lens"] = in;
      o["output_lens"] = out;
      o["ttfts"] = ttfts;
      o["itls"] = itls;
      o["generated_texts"] = texts;
      o["errors"] = errors;
    }
    std::ofstream f(args.output_file, std::ios::app);
    MLA_CHECK(f.good(), "--output-file: cannot write '{}'", args.output_file);
    f << o.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  }
  return failed == results.size() ? 1 : 0;
}

}  // namespace mlaserve::bench
