// Route handlers: /generate, /v1/completions, /v1/chat/completions and the informational endpoints.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <future>
#include <random>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "server/api.h"
#include "server/anthropic.h"
#include "server/api_error.h"
#include "server/batches.h"
#include "server/response_store.h"
#include "server/responses.h"
#include "server/scoring.h"
#include "server/text_stream.h"
#include "server/tool_calls.h"

namespace mlaserve::server {
namespace {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

std::string dump(const ojson& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Appends "[v0,v1,...]": the numbers as the JSON library writes them (non-finite ones as null), a few thousand at a
// time.
void append_numbers(std::string& out, const float* v, int64_t n) {
  out += '[';
  constexpr int64_t kChunk = 4096;
  for (int64_t i = 0; i < n; i += kChunk) {
    ojson a = ojson::array();
    for (int64_t j = i; j < std::min(n, i + kChunk); ++j) a.push_back(v[j]);
    const std::string part = dump(a);
    if (i) out += ',';
    out.append(part, 1, part.size() - 2);
  }
  out += ']';
}

std::string_view path_of(std::string_view target) {
  const size_t q = target.find('?');
  return q == std::string_view::npos ? target : target.substr(0, q);
}

std::string_view query_of(std::string_view target) {
  const size_t q = target.find('?');
  return q == std::string_view::npos ? std::string_view() : target.substr(q + 1);
}

}  // namespace

void ForwardingExchange::on_cancel(std::function<void(const std::string&)> fn) {
  inner_->on_cancel([self = shared_from_this(), fn = std::move(fn)](const std::string& why) {
    if (fn) fn(why);
  });
}

bool valid_request_id(std::string_view id) {
  return !id.empty() && id.size() <= 128 &&
         std::all_of(id.begin(), id.end(), [](char c) { return c > ' ' && c < 127; });
}

namespace {

// A small route's body: parse_body's object, or {} when the body is empty (SGLang's routes take either).
json body_or_empty(const HttpRequest& req) { return req.body.empty() ? json::object() : parse_body(req.body); }

// SGLang's /separate_reasoning: {"text", "reasoning_parser"} (default: the server's --reasoning-parser) ->
// {"reasoning_text", "text"}, split as chat splits a reply: deepseek-r1 reads everything before "</think>" as
// reasoning (R1 may leave out the opening "<think>"), deepseek-v3 (the hybrid V3.1) only a text that opens one.
ojson separate_reasoning(const json& body, const std::string& server_parser) {
  const Fields f(body);
  const std::string text = f.required_string("text", "the text to split");
  const std::string parser = f.string("reasoning_parser").value_or(server_parser);
  if (parser.empty())
    bad_request("reasoning_parser", "invalid_value",
                "'reasoning_parser' is required: this server runs without --reasoning-parser");
  if (!known_reasoning_parser(parser))
    bad_request("reasoning_parser", "invalid_value",
                "'reasoning_parser' '{}' is not known (known: deepseek-r1, deepseek-v3, kimi_k2, deepseek_r1, "
                "deepseek_v3)",
                parser);
  ojson out;
  if (reasoning_split(parser, nullptr) || text.find("<think>") != std::string::npos) {
    ReasoningSplitter split(reasoning_needs_open_think(parser));
    ReasoningSplitter::Parts a = split.push(text), b = split.flush();
    out["reasoning_text"] = a.reasoning + b.reasoning;
    out["text"] = a.content + b.content;
  } else {
    out["reasoning_text"] = "";
    out["text"] = text;
  }
  return out;
}

// SGLang's /parse_function_call: {"text", "tools", "tool_call_parser"} (default: the server's --tool-call-parser,
// else deepseekv3) -> {"normal_text", "calls": [{"tool_index", "name", "parameters"}]}. As in SGLang, a call naming
// no tool of `tools` is dropped and the normal text is the text before the calls, trimmed; with no tools at all
// every call is listed (tool_index -1). "parameters" is the arguments' text as generated (chat's "arguments").
ojson parse_function_call(const json& body, const std::string& server_parser) {
  const Fields f(body);
  const std::string text = f.required_string("text", "the text to parse");
  const std::string parser =
      f.string("tool_call_parser").value_or(server_parser.empty() ? std::string("deepseekv3") : server_parser);
  const std::optional<ToolFormat> format = tool_call_format(parser);
  if (!format)
    bad_request("tool_call_parser", "invalid_value", "'tool_call_parser' '{}' is not known (known: {})", parser,
                kToolCallParsers);
  std::vector<std::string> names;
  if (const auto tools = body.find("tools"); tools != body.end() && !tools->is_null()) {
    if (!tools->is_array()) bad_request("tools", "invalid_type", "'tools' must be an array of tools");
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const json* fn = t.is_object() && t.contains("function") ? &t["function"] : nullptr;
      if (!fn || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string())
        bad_request(fmt::format("tools[{}].function.name", i), "invalid_value",
                    "tools[{}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", i);
      names.push_back((*fn)["name"].get<std::string>());
    }
  }
  ToolCallParser tool_calls(*format);
  const ToolCallParser::Out parsed = tool_calls.push(text);  // (whole calls only: one without its end is none)
  ojson out;
  const size_t begin = text.find(tool_markers(*format).calls_begin);
  if (begin == std::string::npos) {
    out["normal_text"] = text;
  } else {
    const std::string_view before = std::string_view(text).substr(0, begin);
    const size_t lead = leading_space(before);
    size_t end = before.size();
    while (end > lead && leading_space(before.substr(end - 1, 1)) == 1) --end;
    out["normal_text"] = std::string(before.substr(lead, end - lead));
  }
  ojson calls = ojson::array();
  for (const ToolCall& call : parsed.calls) {
    const auto at = std::find(names.begin(), names.end(), call.name);
    if (!names.empty() && at == names.end()) continue;  // SGLang drops calls of undefined functions
    calls.push_back(ojson{{"tool_index", names.empty() ? -1 : at - names.begin()},
                          {"name", call.name},
                          {"parameters", call.arguments}});
  }
  out["calls"] = std::move(calls);
  return out;
}

}  // namespace

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string percent_decode(std::string_view s) {
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
  };
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
      out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// For an engine thread's callback: runs fn later on the connection's executor, with the exchange, or null when the
// client has gone.
using Later = std::function<void(std::function<void(HttpExchange*)>)>;
Later on_connection(const std::shared_ptr<HttpExchange>& ex) {
  return [wex = std::weak_ptr<HttpExchange>(ex), post = ex->executor()](std::function<void(HttpExchange*)> fn) {
    post([wex, fn = std::move(fn)] { fn(wex.lock().get()); });
  };
}

std::optional<std::string> query_param(std::string_view query, std::string_view key) {
  while (!query.empty()) {
    const size_t amp = query.find('&');
    std::string_view kv = query.substr(0, amp);
    const size_t eq = kv.find('=');
    if (kv.substr(0, eq) == key) {
      std::string v(eq == std::string_view::npos ? std::string_view() : kv.substr(eq + 1));
      std::replace(v.begin(), v.end(), '+', ' ');  // a form-encoded space
      return percent_decode(v);
    }
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return std::nullopt;
}

int64_t list_limit(std::string_view query) {
  const auto l = query_param(query, "limit");
  if (!l) return 20;
  int64_t limit = -1;
  try {
    size_t used = 0;
    limit = std::stoll(*l, &used);
    if (used != l->size()) limit = -1;
  } catch (const std::exception&) {
  }
  if (limit < 1 || limit > 100) throw ApiError(400, "'limit' must be an integer in [1, 100]", "limit", "invalid_value");
  return limit;
}

void method_not_allowed(const HttpRequest& req) {
  throw ApiError(405, fmt::format("method {} is not allowed on {}", req.method, path_of(req.target)), "",
                 "method_not_allowed");
}

ojson page_object(ojson data, bool has_more) {
  ojson o;
  o["object"] = "list";
  o["first_id"] = data.empty() ? ojson(nullptr) : data.front()["id"];
  o["last_id"] = data.empty() ? ojson(nullptr) : data.back()["id"];
  o["has_more"] = has_more;
  o["data"] = std::move(data);
  return o;
}

std::pair<std::string, std::string_view> id_and_sub(std::string_view rest) {
  const std::string_view tail = rest.substr(1);
  const size_t slash = tail.find('/');
  return {std::string(tail.substr(0, slash)),
          slash == std::string_view::npos ? std::string_view() : tail.substr(slash)};
}

namespace {

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

// Everything a response builder needs besides the job.
struct ResponseContext {
  ApiKind api;
  std::string id;
  std::string model;
  int64_t created;
  bool logprobs;
  int32_t top_logprobs;
  bool return_text_in_logprobs;
  bool prompt_logprobs;  // logprob_start_len >= 0 (completions: echo with logprobs)
  int32_t vllm_prompt_logprobs;  // vLLM's prompt_logprobs: -1 none, else the alternatives per prompt token
  bool split_reasoning;  // chat with a reasoning parser: reasoning_content apart from content
  bool parse_tools;      // chat with tools and a tool-call parser: tool_calls apart from content
  ToolFormat tool_format;  // the parser's call form
  bool think_opened;       // the reasoning parser splits only an output that opens "<think>" (kimi_k2)
  bool parallel_tool_calls;
  bool echo;
  bool include_usage;
  bool continuous_usage;
  bool list_response;  // native: answer with a list (batch input or n > 1)
  const TextCodec* codec;
  bool token_ids_logprob = false;  // native: SGLang's token_ids_logprob lists
  bool incremental = false;        // native, streamed under ServerOptions::stream_output: chunks carry what is new
  bool tokens_as_ids = false;      // OpenAI: logprobs' tokens as "token_id:ID" (vLLM's return_tokens_as_token_ids)
  // OpenAI: vLLM's return_token_ids (the prompt's ids: chat's at the top level, completions' per choice; each
  // choice's generated ids, streamed as each chunk's new ones)
  bool return_token_ids = false;
  bool include_reasoning = true;  // chat: vLLM's include_reasoning (false: split_reasoning's reasoning dropped)
  std::string role = "assistant";  // chat: the answers' role (vLLM's --response-role)
  bool stream_reasoning = true;    // chat, streamed: SGLang's stream_reasoning (false: the reasoning in one delta)
  // OpenAI, not streamed: a prefill answer's kv_transfer_params (prefill / decode disaggregation); null: none.
  nlohmann::json kv_transfer_params = nullptr;
};

std::string token_text(const ResponseContext& rc, int32_t id) { return rc.codec ? rc.codec->token_text(id) : ""; }
// A token as logprobs name it: its text, or "token_id:ID" (whose text offsets count that string, as vLLM's do).
std::string token_str(const ResponseContext& rc, int32_t id) {
  return rc.tokens_as_ids ? fmt::format("token_id:{}", id) : token_text(rc, id);
}

// ---- native /generate ----

// A logprob, or null where there is none (a prompt's first token).
ojson logprob_value(float lp) { return std::isnan(lp) ? ojson(nullptr) : ojson(lp); }

ojson native_logprob_entry(const ResponseContext& rc, float lp, int32_t id) {
  ojson e = ojson::array();
  e.push_back(logprob_value(lp));
  e.push_back(id);
  if (rc.return_text_in_logprobs) e.push_back(token_text(rc, id));
  else e.push_back(nullptr);
  return e;
}

// ---- return_hidden_states (SGLang's) ----

bool returns_hidden(const GenerationJob& job, const Choice& c) {
  return job.spec().prompts[c.prompt_index].return_hidden_states;
}

size_t hidden_rows(const Choice& c) {
  return c.hidden_size > 0 ? c.hidden_states.size() / static_cast<size_t>(c.hidden_size) : 0;
}

// Row r of the choice's hidden states; each value as the shortest decimal that reads back as the same float.
ojson hidden_row(const Choice& c, size_t r) {
  const size_t h = static_cast<size_t>(c.hidden_size);
  ojson row = ojson::array();
  row.get_ref<ojson::array_t&>().reserve(h);
  for (size_t k = r * h; k < (r + 1) * h; ++k)
    row.push_back(std::strtod(fmt::format("{}", c.hidden_states[k]).c_str(), nullptr));
  return row;
}

// meta_info.hidden_states from row `from` on, as SGLang lays them out: the prompt's rows as one list of rows (its
// first element), then one row per generated token but the last.
ojson native_hidden_states(const Choice& c, size_t from) {
  const size_t n = hidden_rows(c), prompt = static_cast<size_t>(c.prompt_tokens);
  ojson out = ojson::array();
  if (from < std::min(n, prompt)) {
    ojson block = ojson::array();
    for (size_t r = from; r < std::min(n, prompt); ++r) block.push_back(hidden_row(c, r));
    out.push_back(std::move(block));
  }
  for (size_t r = std::max(from, prompt); r < n; ++r) out.push_back(hidden_row(c, r));
  return out;
}

bool returns_routes(const GenerationJob& job, const Choice& c) {
  return job.spec().prompts[c.prompt_index].return_routed_experts;
}

// SGLang's routed_experts: the int32 ids from entry `from` on, their little-endian bytes in base64.
std::string routed_experts_base64(const Choice& c, size_t from) {
  static constexpr char kDigits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string bytes;
  for (size_t i = std::min(from, c.routed_experts.size()); i < c.routed_experts.size(); ++i) {
    const auto v = static_cast<uint32_t>(c.routed_experts[i]);
    for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<char>((v >> (8 * b)) & 0xff));
  }
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t n = static_cast<uint32_t>(static_cast<unsigned char>(bytes[i])) << 16;
    if (i + 1 < bytes.size()) n |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[i + 1])) << 8;
    if (i + 2 < bytes.size()) n |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[i + 2]));
    out.push_back(kDigits[(n >> 18) & 63]);
    out.push_back(kDigits[(n >> 12) & 63]);
    out.push_back(i + 1 < bytes.size() ? kDigits[(n >> 6) & 63] : '=');
    out.push_back(i + 2 < bytes.size() ? kDigits[n & 63] : '=');
  }
  return out;
}

// The OpenAI choices' hidden_states (SGLang's): the row of the last generated token that has one, [] when none does.
ojson last_hidden_state(const Choice& c) {
  const size_t n = hidden_rows(c);
  return n > static_cast<size_t>(c.prompt_tokens) ? hidden_row(c, n - 1) : ojson::array();
}

// The choice so far, or with rc.incremental and a streamed update `u` what `u` brought.
ojson native_object(const ResponseContext& rc, const GenerationJob& job, const Choice& c,
                    const ChoiceUpdate* u = nullptr) {
  const bool part = rc.incremental && u;
  ojson o;
  const size_t text_from = part ? std::min(u->text_begin, c.text.size()) : 0;
  const size_t ids_from = part ? std::min(u->ids_begin, c.output_ids.size()) : 0;
  o["text"] = c.text.substr(text_from);
  o["output_ids"] = std::vector<int32_t>(c.output_ids.begin() + static_cast<int64_t>(ids_from), c.output_ids.end());
  ojson meta;
  meta["id"] = c.rid;
  meta["finish_reason"] = native_finish_reason(c.finish, c.completion_tokens);
  meta["prompt_tokens"] = c.prompt_tokens;
  meta["completion_tokens"] = c.completion_tokens;
  meta["cached_tokens"] = c.cached_tokens;
  if (rc.logprobs) {
    // [logprob, id, text] per token; the top-N alternatives of each position and the logprobs of the ids asked for
    // (null where the logprob is).
    auto lists = [&](const std::vector<TokenLogprob>& lps, size_t begin, const char* tokens_key, const char* top_key,
                     const char* ids_key) {
      ojson out = ojson::array();
      ojson top = ojson::array();
      ojson ids = ojson::array();
      for (size_t i = std::min(begin, lps.size()); i < lps.size(); ++i) {
        const TokenLogprob& lp = lps[i];
        out.push_back(native_logprob_entry(rc, lp.logprob, lp.token));
        ojson alts = std::isnan(lp.logprob) ? ojson(nullptr) : ojson::array();
        for (const auto& [tok, l] : lp.top) alts.push_back(native_logprob_entry(rc, l, tok));
        top.push_back(std::move(alts));
        ojson asked = std::isnan(lp.logprob) ? ojson(nullptr) : ojson::array();
        for (const auto& [tok, l] : lp.ids) asked.push_back(native_logprob_entry(rc, l, tok));
        ids.push_back(std::move(asked));
      }
      meta[tokens_key] = std::move(out);
      if (rc.top_logprobs > 0) meta[top_key] = std::move(top);
      if (rc.token_ids_logprob) meta[ids_key] = std::move(ids);
    };
    // Incremental chunks: the prompt's logprobs go with the first (they come with the first token).
    if (rc.prompt_logprobs && (!part || u->ids_begin == 0))
      lists(c.prompt_logprobs, 0, "input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs");
    lists(c.logprobs, part ? u->logprobs_begin : 0, "output_token_logprobs", "output_top_logprobs",
          "output_token_ids_logprobs");
  }
  // Streamed chunks carry them all so far (as the text), or with rc.incremental the rows new since the last chunk.
  if (returns_hidden(job, c)) meta["hidden_states"] = native_hidden_states(c, part ? u->hidden_begin : 0);
  if (returns_routes(job, c)) meta["routed_experts"] = routed_experts_base64(c, part ? u->routes_begin : 0);
  if (c.finished) {
    meta["e2e_latency"] = std::chrono::duration<double>(c.finish_time - job.start_time()).count();
  }
  o["meta_info"] = std::move(meta);
  if (rc.list_response) o["index"] = c.index;
  return o;
}

// ---- OpenAI ----

struct CompletionLogprobs {
  ojson tokens = ojson::array(), token_logprobs = ojson::array(), top_logprobs = ojson::array(),
        text_offset = ojson::array();
};

// Appends lps[begin:], their text offsets counted from text_offset over their tokens' text; returns the offset after.
size_t add_completion_logprobs(const ResponseContext& rc, const std::vector<TokenLogprob>& lps, size_t begin,
                               size_t text_offset, CompletionLogprobs& l) {
  for (size_t i = begin; i < lps.size(); ++i) {
    const auto& lp = lps[i];
    std::string t = token_str(rc, lp.token);
    l.tokens.push_back(t);
    l.token_logprobs.push_back(logprob_value(lp.logprob));
    l.text_offset.push_back(text_offset);
    text_offset += t.size();
    if (rc.top_logprobs > 0 && !std::isnan(lp.logprob)) {
      ojson alts = ojson::object();
      for (size_t k = 0; k < lp.top.size() && static_cast<int32_t>(k) < rc.top_logprobs; ++k)
        alts[token_str(rc, lp.top[k].first)] = lp.top[k].second;
      l.top_logprobs.push_back(std::move(alts));
    } else {
      l.top_logprobs.push_back(nullptr);
    }
  }
  return text_offset;
}

// The choice's generated tokens from `begin` on, their text offsets from `text_offset`; with `prompt`, its prompt's
// tokens first (echo), offsets from 0 on over all the tokens' text (as vLLM counts them) whatever text_offset says.
ojson completion_logprobs(const ResponseContext& rc, const Choice& c, size_t begin, size_t text_offset,
                          bool prompt = false) {
  CompletionLogprobs l;
  if (prompt) text_offset = add_completion_logprobs(rc, c.prompt_logprobs, 0, 0, l);
  add_completion_logprobs(rc, c.logprobs, begin, text_offset, l);
  ojson o;
  o["tokens"] = std::move(l.tokens);
  o["token_logprobs"] = std::move(l.token_logprobs);
  o["top_logprobs"] = std::move(l.top_logprobs);
  o["text_offset"] = std::move(l.text_offset);
  return o;
}

// vLLM's prompt_logprobs: null for the first token, then per token {"<id>": {logprob, rank, decoded_token}} of the
// prompt's token and its rc.vllm_prompt_logprobs best alternatives (ranks 1, 2, ...).
ojson vllm_prompt_logprobs(const ResponseContext& rc, const Choice& c) {
  ojson out = ojson::array();
  for (const auto& lp : c.prompt_logprobs) {
    if (std::isnan(lp.logprob)) {
      out.push_back(nullptr);
      continue;
    }
    ojson d = ojson::object();
    d[std::to_string(lp.token)] =
        ojson{{"logprob", lp.logprob}, {"rank", lp.rank}, {"decoded_token", token_text(rc, lp.token)}};
    for (size_t k = 0; k < lp.top.size() && static_cast<int32_t>(k) < rc.vllm_prompt_logprobs; ++k) {
      const auto& [id, v] = lp.top[k];
      const std::string key = std::to_string(id);
      if (!d.contains(key))
        d[key] = ojson{{"logprob", v}, {"rank", static_cast<int64_t>(k) + 1}, {"decoded_token", token_text(rc, id)}};
    }
    out.push_back(std::move(d));
  }
  return out;
}

ojson bytes_of(const std::string& s) {
  ojson b = ojson::array();
  for (unsigned char ch : s) b.push_back(static_cast<int>(ch));
  return b;
}

ojson chat_logprobs(const ResponseContext& rc, const Choice& c, size_t begin) {
  ojson content = ojson::array();
  for (size_t i = begin; i < c.logprobs.size(); ++i) {
    const auto& lp = c.logprobs[i];
    std::string t = token_str(rc, lp.token);
    ojson e;
    e["token"] = t;
    e["logprob"] = lp.logprob;
    e["bytes"] = bytes_of(t);
    ojson alts = ojson::array();
    for (size_t k = 0; k < lp.top.size() && static_cast<int32_t>(k) < rc.top_logprobs; ++k) {
      std::string at = token_str(rc, lp.top[k].first);
      ojson a;
      a["token"] = at;
      a["logprob"] = lp.top[k].second;
      a["bytes"] = bytes_of(at);
      alts.push_back(std::move(a));
    }
    e["top_logprobs"] = std::move(alts);
    content.push_back(std::move(e));
  }
  ojson o;
  o["content"] = std::move(content);
  return o;
}

// A chat choice's text as the client sees it: reasoning (with a reasoning parser), content, and tool calls (with
// tools), a piece at a time.
struct ChatSplitter {
  explicit ChatSplitter(const ResponseContext& rc) : reasoning(rc.think_opened), tools(rc.tool_format) {}
  struct Parts {
    std::string reasoning, content;
    std::vector<ToolCall> calls;
  };
  Parts push(const ResponseContext& rc, std::string_view text, bool last) {
    Parts out;
    std::string content;
    if (rc.split_reasoning) {
      ReasoningSplitter::Parts p = reasoning.push(text);
      if (last) {
        ReasoningSplitter::Parts rest = reasoning.flush();
        p.reasoning += rest.reasoning;
        p.content += rest.content;
      }
      out.reasoning = std::move(p.reasoning);
      content = std::move(p.content);
    } else {
      content = std::string(text);
    }
    if (!rc.parse_tools) {
      out.content = std::move(content);
      return out;
    }
    ToolCallParser::Out t = tools.push(content);
    if (last) {
      ToolCallParser::Out rest = tools.flush();
      t.content += rest.content;
    }
    out.content = std::move(t.content);
    for (auto& call : t.calls)  // parallel_tool_calls false: the first call only
      if (rc.parallel_tool_calls || calls_made++ == 0) out.calls.push_back(std::move(call));
    return out;
  }
  ReasoningSplitter reasoning;
  ToolCallParser tools;
  size_t calls_made = 0;
};

// A tool call as OpenAI lists it; ids are unique per response, choice and call.
ojson tool_call_json(const ResponseContext& rc, const Choice& c, const ToolCall& call, size_t k, bool stream) {
  ojson t;
  if (stream) t["index"] = k;
  // The format's own id where it writes one (Kimi-K2's functions.NAME:IDX, which its template shows back to it).
  t["id"] = !call.id.empty() ? call.id : fmt::format("call_{}_{}_{}", rc.id.substr(rc.id.find('-') + 1), c.index, k);
  t["type"] = "function";
  t["function"] = ojson{{"name", call.name}, {"arguments", call.arguments}};
  return t;
}

// finish_reason "tool_calls" when the choice called tools and stopped on its own.
ojson chat_finish_reason(const Choice& c, bool called_tools) {
  if (called_tools && c.finish.kind == FinishKind::Stop) return "tool_calls";
  return openai_finish_reason(c.finish);
}

ojson matched_stop(const FinishReason& f) {
  if (f.kind != FinishKind::Stop) return nullptr;
  if (f.matched_token >= 0) return f.matched_token;
  return f.matched_text;
}

ojson usage(const GenerationJob& job) {
  int64_t prompt = 0, completion = 0, cached = 0;
  const int32_t n = job.spec().n;
  for (const auto& c : job.choices()) {
    if (c.index % static_cast<size_t>(n) == 0) {  // each prompt counted once, however many samples
      prompt += c.prompt_tokens;
      cached += c.cached_tokens;
    }
    completion += c.completion_tokens;
  }
  ojson u;
  u["prompt_tokens"] = prompt;
  u["completion_tokens"] = completion;
  u["total_tokens"] = prompt + completion;
  if (cached > 0) u["prompt_tokens_details"] = ojson{{"cached_tokens", cached}};
  return u;
}

ojson openai_envelope(const ResponseContext& rc, const char* object) {
  ojson o;
  o["id"] = rc.id;
  o["object"] = object;
  o["created"] = rc.created;
  o["model"] = rc.model;
  return o;
}

ojson openai_response(const ResponseContext& rc, const GenerationJob& job) {
  const bool chat = rc.api == ApiKind::Chat;
  ojson o = openai_envelope(rc, chat ? "chat.completion" : "text_completion");
  ojson choices = ojson::array();
  for (const auto& c : job.choices()) {
    ojson ch;
    ch["index"] = c.index;
    bool called_tools = false;
    if (chat) {
      ChatSplitter split(rc);
      ChatSplitter::Parts parts = split.push(rc, c.text, /*last=*/true);
      called_tools = !parts.calls.empty();
      ojson msg{{"role", rc.role},
                {"content", called_tools && parts.content.empty() ? ojson(nullptr) : ojson(parts.content)}};
      if (rc.split_reasoning)
        msg["reasoning_content"] =
            parts.reasoning.empty() || !rc.include_reasoning ? ojson(nullptr) : ojson(parts.reasoning);
      if (called_tools) {
        ojson calls = ojson::array();
        for (size_t k = 0; k < parts.calls.size(); ++k)
          calls.push_back(tool_call_json(rc, c, parts.calls[k], k, /*stream=*/false));
        msg["tool_calls"] = std::move(calls);
      }
      ch["message"] = std::move(msg);
      ch["logprobs"] = rc.logprobs ? chat_logprobs(rc, c, 0) : ojson(nullptr);
    } else {
      const std::string& prompt_text = job.spec().prompts[c.prompt_index].text;
      ch["text"] = rc.echo ? prompt_text + c.text : c.text;
      ch["logprobs"] = rc.logprobs ? completion_logprobs(rc, c, 0, 0, rc.echo) : ojson(nullptr);
    }
    ch["finish_reason"] = chat ? chat_finish_reason(c, called_tools) : openai_finish_reason(c.finish);
    ch["matched_stop"] = matched_stop(c.finish);
    if (rc.vllm_prompt_logprobs >= 0) ch["prompt_logprobs"] = vllm_prompt_logprobs(rc, c);
    if (returns_hidden(job, c)) ch["hidden_states"] = last_hidden_state(c);
    if (returns_routes(job, c)) ch["routed_experts"] = routed_experts_base64(c, 0);
    if (rc.return_token_ids) {
      if (!chat) ch["prompt_token_ids"] = job.spec().prompts[c.prompt_index].input_ids;
      ch["token_ids"] = c.output_ids;
    }
    choices.push_back(std::move(ch));
  }
  o["choices"] = std::move(choices);
  o["usage"] = usage(job);
  if (chat && rc.return_token_ids) o["prompt_token_ids"] = job.spec().prompts[0].input_ids;
  if (!rc.kv_transfer_params.is_null()) o["kv_transfer_params"] = rc.kv_transfer_params;
  return o;
}

// Streaming state of an OpenAI response: what each choice has been sent so far.
struct OpenAIStream {
  std::vector<size_t> text_offsets;  // completions text_offset bookkeeping (echo: the prompt's tokens counted)
  // Completions echo with logprobs: the echoed prompt waits for its logprobs (the choice's first update).
  std::vector<bool> echo_pending;
  std::vector<ChatSplitter> chat;  // per chat choice: reasoning / content / tool calls
  std::vector<size_t> calls_sent;  // per chat choice: tool calls streamed (their indices)
  std::vector<bool> prompt_lps_sent;  // per choice: vLLM's prompt_logprobs went out (with the first chunk after them)
  std::vector<size_t> ids_sent;       // per choice, return_token_ids: output ids sent in token_ids
  std::vector<std::string> held_reasoning;  // per chat choice, stream_reasoning false: the reasoning not sent yet
};

// With include_usage every chunk has "usage": null, or (continuous_usage_stats) the job's usage so far.
ojson openai_chunk(const ResponseContext& rc, ojson choice, const GenerationJob& job) {
  ojson o = openai_envelope(rc, rc.api == ApiKind::Chat ? "chat.completion.chunk" : "text_completion");
  ojson choices = ojson::array();
  choices.push_back(std::move(choice));
  o["choices"] = std::move(choices);
  if (rc.include_usage) o["usage"] = rc.continuous_usage ? usage(job) : ojson(nullptr);
  return o;
}

// A generation request's log line as it arrives (--log-requests): its shape and counts, with spec.log_level 1 its
// sampling parameters, with 2 its prompts (log_excerpt: their text, else their ids).
std::string received_log_line(const HttpRequest& req, const JobSpec& spec, bool stream) {
  size_t tokens = 0;
  for (const JobPrompt& jp : spec.prompts) tokens += jp.input_ids.size();
  std::string line = fmt::format("request {} received: {} {}, {} prompt(s) x n {}, {} prompt tokens{}", spec.id,
                                 req.method, path_of(req.target), spec.prompts.size(), spec.n, tokens,
                                 stream ? ", streamed" : "");
  if (spec.log_level >= 1) {
    const SamplingParams& s = spec.sampling;
    line += fmt::format(", sampling: max_new_tokens {}, temperature {}, top_p {}, top_k {}, min_p {}, "
                        "frequency_penalty {}, presence_penalty {}, repetition_penalty {}, min_new_tokens {}, "
                        "ignore_eos {}",
                        s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.frequency_penalty,
                        s.presence_penalty, s.repetition_penalty, s.min_new_tokens, s.ignore_eos);
    if (s.seed) line += fmt::format(", seed {}", *s.seed);
    for (const std::string& stop : spec.stop) line += ", stop " + log_excerpt(stop, spec.log_max_len);
    if (!s.stop_token_ids.empty()) line += ", stop_token_ids " + log_excerpt(s.stop_token_ids, spec.log_max_len);
    if (s.constraint) line += ", constrained";
  }
  if (spec.log_level >= 2)
    for (size_t i = 0; i < spec.prompts.size(); ++i) {
      const JobPrompt& jp = spec.prompts[i];
      line += fmt::format(", prompt{} {}", spec.prompts.size() > 1 ? fmt::format("[{}]", i) : std::string(),
                          jp.text.empty() ? log_excerpt(jp.input_ids, spec.log_max_len)
                                          : log_excerpt(jp.text, spec.log_max_len));
    }
  return line;
}

}  // namespace

struct Api::Prepared {
  JobSpec spec;
  ResponseContext rc;
  std::vector<uint64_t> rooms;  // prefill mode: the bootstrap rooms the job ends
};

Api::Api(EngineClient& engine, const TextCodec* codec, ServerOptions opts)
    : engine_(engine), codec_(codec), opts_(std::move(opts)), id_salt_(std::random_device{}()) {
  if (opts_.served_model_name.empty()) opts_.served_model_name = opts_.model_path;
  if (auto f = tool_call_format(opts_.tool_call_parser)) opts_.parse.tool_format = *f;  // tool_choice's form
  if (opts_.disaggregation_mode == "prefill") rooms_ = std::make_shared<BootstrapRooms>();
  weights_->path = opts_.model_path;
  weights_->version = opts_.weight_version;
  log_requests_ = opts_.log_requests;
  log_level_ = opts_.log_requests_level;
  responses_store_ = std::make_unique<ResponseStore>();
  batches_ = std::make_unique<BatchService>([this](const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
    HttpRequest r = req;
    if (!opts_.api_key.empty()) r.authorization = "Bearer " + opts_.api_key;  // the batch's creator was let in
    handle(r, ex);
  });
}

Api::~Api() = default;

// What /v1/models lists and /v1/models/{id} returns.
ojson Api::model_card(const std::string& name) const {
  ojson m;
  m["id"] = name;
  m["object"] = "model";
  m["created"] = unix_seconds();
  m["owned_by"] = "mlaserve";
  m["root"] = opts_.served_model_name;
  m["max_model_len"] = engine_.max_context_len();
  return m;
}

std::string Api::new_id() {
  return fmt::format("{:08x}{:08x}", static_cast<uint32_t>(id_salt_), static_cast<uint32_t>(next_id_.fetch_add(1)));
}

void Api::respond_json(const std::shared_ptr<HttpExchange>& ex, int status, const std::string& body) {
  ex->respond(status, "application/json", body);
}

void Api::respond_error(const std::shared_ptr<HttpExchange>& ex, int status, const std::string& body) {
  if (status >= 400 && status < 500) ++metrics_.client_errors_total;
  ex->respond(status, "application/json", body);
}

namespace {

// /invocations: a chat request when the body has 'messages', a completions request when it has 'prompt' (as vLLM
// tries its request types in that order); a body that is not JSON gets the chat API's parse error.
ApiKind invocation_kind(const std::string& body) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || j.contains("messages")) return ApiKind::Chat;
  if (j.contains("prompt")) return ApiKind::Completions;
  throw ApiError(400, "'/invocations' takes a chat request ('messages') or a completions request ('prompt')",
                 "messages");
}

}  // namespace

void Api::handle(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  ++metrics_.http_requests_total;
  const std::string path(path_of(req.target));
  const bool get = req.method == "GET";
  const bool post = req.method == "POST";
  try {
    if (!opts_.api_key.empty() && path != "/health" && path != "/health_generate" && path != "/ping" &&
        path != "/metrics") {
      const std::string expected = "Bearer " + opts_.api_key;
      if (!constant_time_equal(req.authorization, expected))
        throw ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "", "invalid_api_key",
                       "authentication_error");
    }
    if (path == "/generate") {
      if (!post) method_not_allowed(req);
      generate(ApiKind::Native, req, ex);
    } else if (path == "/v1/completions") {
      if (!post) method_not_allowed(req);
      generate(ApiKind::Completions, req, ex);
    } else if (path == "/v1/chat/completions") {
      if (!post) method_not_allowed(req);
      generate(ApiKind::Chat, req, ex);
    } else if (path == "/invocations") {  // vLLM's (SageMaker's inference route): the request's kind picks the API
      if (!post) method_not_allowed(req);
      generate(invocation_kind(req.body), req, ex);
    } else if (path == "/v1/responses") {
      if (!post) method_not_allowed(req);
      responses(req, ex);
    } else if (path == "/v1/responses/input_tokens") {
      if (!post) method_not_allowed(req);
      responses_input_tokens(req, ex);
    } else if (path == "/v1/messages" || path == "/v1/messages/count_tokens") {  // Anthropic's, as vLLM serves it
      if (!post) method_not_allowed(req);
      try {
        messages(req, ex, path == "/v1/messages/count_tokens");
      } catch (...) {  // in Anthropic's error form
        const auto [status, body] = error_answer(req);
        respond_error(ex, status, anthropic_error_body(status, body));
      }
    } else if (path.rfind("/v1/responses/", 0) == 0) {
      stored_response(req, std::string_view(path).substr(13), query_of(req.target), ex);
    } else if (path == "/v1/files" || path.rfind("/v1/files/", 0) == 0) {
      batches_->files(req, std::string_view(path).substr(9), query_of(req.target), ex);
    } else if (path == "/v1/batches" || path.rfind("/v1/batches/", 0) == 0) {
      batches_->batches(req, std::string_view(path).substr(11), query_of(req.target), ex);
    } else if (path == "/health") {
      if (!get) method_not_allowed(req);
      ex->respond(200, "text/plain", "");
    } else if (path == "/ping") {  // vLLM's (SageMaker's liveness check): GET or POST
      if (!get && !post) method_not_allowed(req);
      ex->respond(200, "text/plain", "");
    } else if (path == "/version") {  // vLLM's
      if (!get) method_not_allowed(req);
      respond_json(ex, 200, R"({"version":"mlaserve"})");
    } else if (path == "/health_generate") {
      if (!get) method_not_allowed(req);
      health_generate(ex);
    } else if (path == "/abort_request") {
      if (!post) method_not_allowed(req);
      abort_request(req, ex);
    } else if (path == "/configure_logging") {
      if (!get && !post) method_not_allowed(req);
      configure_logging(req, ex);
    } else if (path == "/open_session" || path == "/close_session") {
      if (!get && !post) method_not_allowed(req);
      if (path == "/open_session") open_session(req, ex);
      else close_session(req, ex);
    } else if (path == "/v1/models") {
      if (!get) method_not_allowed(req);
      ojson body;
      body["object"] = "list";
      body["data"] = ojson::array({model_card(opts_.served_model_name)});
      for (const std::string& alias : opts_.served_model_aliases) body["data"].push_back(model_card(alias));
      respond_json(ex, 200, dump(body));
    } else if (path.rfind("/v1/models/", 0) == 0) {  // OpenAI's retrieve: the id may hold '/' (org/name)
      if (!get) method_not_allowed(req);
      const std::string id = percent_decode(path.substr(std::string_view("/v1/models/").size()));
      if (!serves(id))
        throw ApiError(404, fmt::format("the model '{}' does not exist; this server serves '{}'", id,
                                        opts_.served_model_name),
                       "model", "model_not_found");
      respond_json(ex, 200, dump(model_card(answered_name(id))));
    } else if (path == "/get_load") {  // SGLang's, read by its router: one object per DP rank
      if (!get) method_not_allowed(req);
      ojson loads = ojson::array();
      int rank = 0;
      for (const RankStats& st : engine_.stats()) {
        ojson l;
        l["dp_rank"] = rank++;
        l["num_reqs"] = st.num_running_reqs;
        l["num_waiting_reqs"] = st.num_queue_reqs;
        l["num_tokens"] = st.kv_tokens_total - st.kv_tokens_free - st.kv_tokens_cached;  // held by requests
        loads.push_back(std::move(l));
      }
      respond_json(ex, 200, dump(loads));
    } else if (path == "/get_model_info" || path == "/model_info") {
      if (!get) method_not_allowed(req);
      ojson body;
      const auto [weights_path, weight_version] = weights_info();
      body["model_path"] = weights_path;
      body["weight_version"] = weight_version;
      body["tokenizer_path"] = opts_.tokenizer_path.empty() ? ojson(nullptr) : ojson(opts_.tokenizer_path);
      body["served_model_name"] = opts_.served_model_name;
      body["is_generation"] = true;
      body["max_context_length"] = engine_.max_context_len();
      body["eos_token_ids"] = engine_.eos_token_ids();
      body["preferred_sampling_params"] = nullptr;
      respond_json(ex, 200, dump(body));
    } else if (path == "/get_server_info" || path == "/server_info") {
      if (!get) method_not_allowed(req);
      ojson body = ojson::parse(opts_.server_args.dump());
      const auto [weights_path, weight_version] = weights_info();
      body["model_path"] = weights_path;
      body["weight_version"] = weight_version;
      ojson states = ojson::array();
      int rank = 0;
      for (const RankStats& s : engine_.stats()) {
        ojson st;
        st["dp_rank"] = rank++;
        st["kv_tokens_total"] = s.kv_tokens_total;
        st["kv_tokens_free"] = s.kv_tokens_free;
        st["kv_tokens_cached"] = s.kv_tokens_cached;
        st["num_running_reqs"] = s.num_running_reqs;
        st["num_queue_reqs"] = s.num_queue_reqs;
        st["prompt_tokens_total"] = s.prompt_tokens_total;
        st["generation_tokens_total"] = s.generation_tokens_total;
        st["cached_prompt_tokens_total"] = s.cached_prompt_tokens_total;
        if (s.kv_host_tokens_total > 0) {  // the hierarchical cache's host tier
          st["kv_host_tokens_total"] = s.kv_host_tokens_total;
          st["kv_host_tokens_cached"] = s.kv_host_tokens_cached;
          st["host_loaded_tokens_total"] = s.host_loaded_tokens_total;
        }
        st["num_requests_finished"] = s.num_requests_finished;
        st["num_retractions"] = s.num_retractions;
        st["forward_steps"] = s.forward_steps;
        st["overlapped_steps"] = s.overlapped_steps;
        st["spec_draft_tokens"] = s.spec_draft_tokens;
        st["spec_accepted_tokens"] = s.spec_accepted_tokens;
        st["spec_checks"] = s.spec_checks;
        // SGLang's: tokens a request gets per step that checks drafts (the drafts kept and the draw after them)
        if (s.spec_checks > 0)
          st["avg_spec_accept_length"] =
              1.0 + static_cast<double>(s.spec_accepted_tokens) / static_cast<double>(s.spec_checks);
        states.push_back(std::move(st));
      }
      body["internal_states"] = std::move(states);
      body["version"] = "mlaserve";
      respond_json(ex, 200, dump(body));
    } else if (path == "/v1/score" || path == "/generative_scoring") {  // SGLang's, vLLM's generative scoring
      if (!post) method_not_allowed(req);
      score(req, ex, path == "/generative_scoring");
    } else if (path == "/separate_reasoning") {  // SGLang's
      if (!post) method_not_allowed(req);
      respond_json(ex, 200, dump(separate_reasoning(parse_body(req.body), opts_.reasoning_parser)));
    } else if (path == "/parse_function_call") {  // SGLang's
      if (!post) method_not_allowed(req);
      respond_json(ex, 200, dump(parse_function_call(parse_body(req.body), opts_.tool_call_parser)));
    } else if (path == "/tokenize" || path == "/v1/tokenize") {
      if (!post) method_not_allowed(req);
      tokenize(req, ex);
    } else if (path == "/detokenize" || path == "/v1/detokenize") {
      if (!post) method_not_allowed(req);
      detokenize(req, ex);
    } else if (path == "/flush_cache") {
      if (!get && !post) method_not_allowed(req);
      if (engine_.flush_cache())
        ex->respond(200, "text/plain", "Cache flushed.\n");
      else
        throw ApiError(400, "cache not flushed: requests are running or waiting; retry when the server is idle", "",
                       "server_busy");
    } else if (path == "/kv_transfer/export") {  // prefill / decode disaggregation: read by decode servers
      if (!post) method_not_allowed(req);
      kv_export(req, ex);
    } else if (path == "/update_weights_from_disk") {
      if (!post) method_not_allowed(req);
      update_weights_from_disk(req, ex);
    } else if (path == "/get_weights_by_name") {  // SGLang's
      if (!get && !post) method_not_allowed(req);
      get_weights_by_name(req, ex);
    } else if (path == "/pause_generation" || path == "/pause") {  // SGLang's, vLLM's
      if (!post) method_not_allowed(req);
      pause(req, ex, path == "/pause");
    } else if (path == "/continue_generation" || path == "/resume") {  // SGLang's, vLLM's
      if (!post) method_not_allowed(req);
      if (!engine_.continue_generation())
        throw ApiError(503, "this engine cannot pause or continue", "", "service_unavailable");
      respond_json(ex, 200, path == "/resume" ? R"({"status":"resumed"})"
                                              : R"({"message":"Generation continued successfully.","status":"ok"})");
    } else if (path == "/release_memory_occupation" || path == "/resume_memory_occupation") {  // SGLang's
      if (!get && !post) method_not_allowed(req);
      memory_occupation(req, ex, path == "/release_memory_occupation");
    } else if (path == "/start_expert_distribution_record" || path == "/stop_expert_distribution_record" ||
               path == "/dump_expert_distribution_record") {  // SGLang's
      if (!get && !post) method_not_allowed(req);
      expert_record(ex, path.starts_with("/start_")  ? ExpertRecordOp::Start
                        : path.starts_with("/stop_") ? ExpertRecordOp::Stop
                                                     : ExpertRecordOp::Dump);
    } else if (path == "/start_profile" || path == "/stop_profile") {  // SGLang's, vLLM's
      if (!get && !post) method_not_allowed(req);
      profile(req, ex, path == "/start_profile");
    } else if (path == "/sleep" || path == "/wake_up") {  // vLLM's
      if (!post) method_not_allowed(req);
      sleep_or_wake(req, ex, path == "/sleep");
    } else if (path == "/is_sleeping") {  // vLLM's
      if (!get) method_not_allowed(req);
      respond_json(ex, 200, dump(ojson{{"is_sleeping", engine_.memory_released()}}));
    } else if (path == "/reset_prefix_cache") {  // vLLM's /flush_cache
      if (!post) method_not_allowed(req);
      if (!engine_.flush_cache())
        throw ApiError(400, "prefix cache not reset: requests are running or waiting; retry when the server is idle",
                       "", "server_busy");
      ex->respond(200, "text/plain", "");
    } else if (path == "/is_paused") {  // vLLM's
      if (!get) method_not_allowed(req);
      respond_json(ex, 200, dump(ojson{{"is_paused", engine_.is_paused()}}));
    } else if (path == "/get_weight_version") {  // SGLang's
      if (!get) method_not_allowed(req);
      respond_json(ex, 200, dump(ojson{{"weight_version", weights_info().second}}));
    } else if (path == "/update_weight_version") {  // SGLang's: {"new_version"} (its abort_all_requests not taken)
      if (!post) method_not_allowed(req);
      const json body = parse_body(req.body);
      const std::string v = Fields(body).required_string("new_version", "the weights' version");
      {
        std::lock_guard lk(weights_->mu);
        weights_->version = v;
      }
      respond_json(ex, 200, dump(ojson{{"success", true}, {"message", "weight version updated to " + v}}));
    } else if (path == "/load") {  // vLLM's: the generation requests being served now
      if (!get) method_not_allowed(req);
      size_t running = 0;
      {
        std::lock_guard lk(jobs_mu_);
        for (const auto& [id, w] : jobs_)
          if (const auto j = w.lock(); j && !j->done()) ++running;
      }
      respond_json(ex, 200, dump(ojson{{"server_load", running}}));
    } else if (path == "/metrics") {
      if (!get) method_not_allowed(req);
      ex->respond(200, "text/plain; version=0.0.4", metrics_.render(engine_.stats(), opts_.served_model_name));
    } else {
      throw ApiError(404, fmt::format("no route for {} {}", req.method, path), "", "not_found");
    }
  } catch (...) {
    const auto [status, body] = error_answer(req);
    respond_error(ex, status, body);
  }
}

std::pair<int, std::string> Api::error_answer(const HttpRequest& req) {
  try {
    throw;
  } catch (const ApiError& e) {
    return {e.status, error_body(e)};
  } catch (const Error& e) {  // the engine refusing a request (client error by the interface's contract)
    return {400, error_body(400, e.what())};
  } catch (const std::exception& e) {
    MLA_LOG_ERROR("{} {}: {}", req.method, path_of(req.target), e.what());
    return {500, error_body(500, e.what(), "internal_error", "internal_error")};
  } catch (...) {
    MLA_LOG_ERROR("{} {}: an unknown exception", req.method, path_of(req.target));
    return {500, error_body(500, "an unknown exception", "internal_error", "internal_error")};
  }
}

Api::Prepared Api::prepare(ParsedRequest& pr) {
  Prepared p;
  const bool openai = pr.api != ApiKind::Native;
  if (openai && !pr.model.empty()) check_model(pr.model);
  const int64_t ctx = engine_.max_context_len();
  // Tools: shown to the model through the chat template's `tools` variable and parsed out of its output; their
  // markers are special tokens, so the text keeps special tokens.
  bool parse_tools = false;
  json template_vars = pr.chat_template_kwargs;
  if (!pr.tools.is_null()) {
    if (opts_.tool_call_parser.empty())
      throw ApiError(400, "'tools' needs a server started with --tool-call-parser (deepseekv3, kimi_k2, ...)", "tools",
                     "unsupported_parameter");
    if (!pr.tool_choice_none) {
      template_vars["tools"] = pr.tools;
      parse_tools = true;
      pr.skip_special_tokens = false;
    }
  }
  if (pr.api == ApiKind::Chat) {
    if (!codec_) throw ApiError(400, "chat needs a tokenizer; this server runs without one", "messages", "no_tokenizer");
    std::string prompt = render_chat(pr, pr.add_generation_prompt, template_vars);
    if (pr.continue_final_message) {  // cut after the final message's content (its end-of-turn tokens go)
      const json& last = pr.messages.back()["content"];
      const std::string content = last.is_string() ? last.get<std::string>() : std::string();
      const size_t at = content.empty() ? std::string::npos : prompt.rfind(content);
      if (at == std::string::npos)
        throw ApiError(400, "the chat template does not write the final message's content as given, so it cannot "
                            "be continued", "continue_final_message", "invalid_value");
      prompt.resize(at + content.size());
    }
    pr.prompts = {{prompt, {}}};
    pr.prompts[0].input_ids = codec_->encode(prompt, pr.add_special_tokens.value_or(false));  // the template's BOS
  }
  if (pr.suffix) fill_in_the_middle(pr);
  int64_t hidden_positions = 0;  // rows of hidden states the request may bring back
  for (size_t i = 0; i < pr.prompts.size(); ++i) {
    PromptInput& in = pr.prompts[i];
    JobPrompt jp;
    if (in.text) {
      if (in.input_ids.empty()) {
        if (!codec_)
          throw ApiError(400, "text prompts need a tokenizer; this server runs without one: send token ids", "text",
                         "no_tokenizer");
        in.input_ids = codec_->encode(*in.text, pr.add_special_tokens.value_or(true));
      }
      jp.text = *in.text;
    } else if (codec_ && pr.echo) {
      jp.text = codec_->decode(in.input_ids, false);
    }
    jp.input_ids = std::move(in.input_ids);
    if (pr.session) {  // SGLang's session: the request continues an earlier one of the session
      if (pr.prompts.size() != 1 || pr.n != 1)
        throw ApiError(400, "a session request ('session_params') takes one prompt and n 1", "session_params",
                       "invalid_value");
      std::optional<int32_t> bos;
      if (codec_)
        if (const auto with = codec_->encode("", true); !with.empty()) bos = with.front();
      jp.input_ids = sessions_->prompt(*pr.session, jp.input_ids, bos);
    }
    if (!pr.token_ids_logprob.empty())
      jp.token_ids_logprob = pr.token_ids_logprob[pr.token_ids_logprob.size() == 1 ? 0 : i];
    jp.cache_salt = pr.prompt_salts.empty() ? pr.cache_salt : pr.prompt_salts[i];
    // SGLang's per-prompt flags (one for every prompt, or one per prompt), each allowed by its server flag.
    auto per_prompt = [&](const std::vector<bool>& asked, bool allowed, const char* field, const char* flag) {
      const bool on = !asked.empty() && asked[asked.size() == 1 ? 0 : i];
      if (on && !allowed)
        throw ApiError(400, fmt::format("'{}' needs the server started with {}", field, flag), field, "invalid_value");
      return on;
    };
    jp.return_hidden_states = per_prompt(pr.return_hidden_states, opts_.enable_return_hidden_states,
                                         "return_hidden_states", "--enable-return-hidden-states");
    jp.return_routed_experts = per_prompt(pr.return_routed_experts, opts_.enable_return_routed_experts,
                                          "return_routed_experts", "--enable-return-routed-experts");
    if (pr.truncate_prompt_tokens != 0) {  // vLLM's: the prompt's last tokens (-1: as many as the context holds)
      const int64_t keep = pr.truncate_prompt_tokens > 0 ? pr.truncate_prompt_tokens : ctx - 1;
      if (static_cast<int64_t>(jp.input_ids.size()) > keep) {
        jp.input_ids.erase(jp.input_ids.begin(), jp.input_ids.end() - keep);
        if (codec_ && !jp.text.empty()) jp.text = codec_->decode(jp.input_ids, false);  // what echo shows
      }
    }
    int64_t len = static_cast<int64_t>(jp.input_ids.size());
    const std::string param = pr.api == ApiKind::Chat ? "messages" : pr.api == ApiKind::Native ? "text" : "prompt";
    if (len == 0) throw ApiError(400, "the prompt is empty (no tokens)", param, "invalid_value");
    // --allow-auto-truncate: the prompt's first tokens, room left for those asked for (at least one).
    const int64_t wanted = pr.max_new_tokens_given ? std::max<int64_t>(pr.sampling.max_new_tokens, 1) : 1;
    if (const int64_t keep = std::max<int64_t>(ctx - wanted, 1); opts_.allow_auto_truncate && keep < len) {
      MLA_LOG_WARN("request {}: a prompt of {} tokens cut to its first {} (--allow-auto-truncate)", p.spec.id, len,
                   keep);
      jp.input_ids.resize(static_cast<size_t>(keep));
      if (codec_ && !jp.text.empty()) jp.text = codec_->decode(jp.input_ids, false);
      len = keep;
    }
    if (len >= ctx)
      throw ApiError(400,
                     fmt::format("the prompt has {} tokens; this model's context length is {} tokens (room is needed "
                                 "for at least one new token)",
                                 len, ctx),
                     param, "context_length_exceeded");
    if (!pr.max_new_tokens_given && pr.api == ApiKind::Chat) {
      pr.sampling.max_new_tokens = static_cast<int32_t>(ctx - len);
    } else if (len + pr.sampling.max_new_tokens > ctx) {
      if (pr.max_new_tokens_given && !opts_.allow_auto_truncate)
        throw ApiError(400,
                       fmt::format("this model's context length is {} tokens, but {} were requested ({} in the "
                                   "prompt, {} to generate); reduce the prompt or the number of new tokens",
                                   ctx, len + pr.sampling.max_new_tokens, len, pr.sampling.max_new_tokens),
                       pr.api == ApiKind::Native ? "sampling_params.max_new_tokens" : "max_tokens",
                       "context_length_exceeded");
      pr.sampling.max_new_tokens = static_cast<int32_t>(ctx - len);  // a default that does not fit: shortened
    }
    if (const auto& cap = opts_.parse.defaults.max_tokens; cap && pr.api != ApiKind::Native)
      pr.sampling.max_new_tokens = std::min(pr.sampling.max_new_tokens, *cap);  // (vLLM's generation-config limit)
    // (a chat request's default of the whole context counts none: most stop far before it)
    const bool counted = pr.max_new_tokens_given || pr.api != ApiKind::Chat;
    if (jp.return_hidden_states)
      hidden_positions += (len + (counted ? pr.sampling.max_new_tokens : 0)) * std::max(pr.n, 1);
    p.spec.prompts.push_back(std::move(jp));
  }
  if (const int64_t floats = hidden_positions * engine_.hidden_size(); floats > opts_.max_hidden_state_floats)
    throw ApiError(400,
                   fmt::format("return_hidden_states for up to {} positions of {} values ({} in all) is more than one "
                               "request may ask for ({}); ask for fewer tokens or prompts",
                               hidden_positions, engine_.hidden_size(), floats, opts_.max_hidden_state_floats),
                   "return_hidden_states", "invalid_value");
  if (pr.sampling.thinking_budget >= 0) {  // DeepSeek-R1's markers, as the tokenizer spells them
    const std::string& param = pr.thinking_budget_param;
    if (!codec_)
      throw ApiError(400, fmt::format("'{}' needs the tokenizer; this server runs without one", param), param,
                     "no_tokenizer");
    if (!pr.constraint_regex.empty())
      throw ApiError(400, fmt::format("'{}' cannot be combined with structured output ('{}')", param,
                                      pr.constraint_param),
                     param, "invalid_value");
    pr.sampling.think_start_ids = codec_->encode("<think>", /*add_special_tokens=*/false);
    pr.sampling.think_end_ids = codec_->encode("</think>", /*add_special_tokens=*/false);
  }
  if (!pr.bad_words.empty()) {
    const std::string param = pr.api == ApiKind::Native ? "sampling_params.bad_words" : "bad_words";
    if (!codec_)
      throw ApiError(400, "'bad_words' needs the tokenizer; this server runs without one", param, "no_tokenizer");
    pr.sampling.bad_words_ids = bad_words_token_ids(*codec_, pr.bad_words);
  }
  pr.sampling.return_logprob = pr.logprobs;
  pr.sampling.top_logprobs_num = std::max(pr.logprobs ? pr.top_logprobs : 0, pr.prompt_logprobs);
  const std::string id = new_id();
  p.spec.id = !pr.rid.empty()                ? pr.rid
              : pr.api == ApiKind::Native      ? id
                                               : (pr.api == ApiKind::Chat ? "chatcmpl-" : "cmpl-") + id;
  p.spec.n = pr.n;
  p.spec.sampling = pr.sampling;
  p.spec.stop = pr.stop;
  if (!pr.stop_regex.empty()) {
    try {
      p.spec.stop_regex = std::make_shared<const StopRegexes>(pr.stop_regex);
    } catch (const std::exception& e) {
      throw ApiError(400, e.what(), pr.stop_regex_param);
    }
  }
  p.spec.skip_special_tokens = pr.skip_special_tokens;
  p.spec.no_stop_trim = pr.no_stop_trim;
  p.spec.stream_interval = opts_.stream_interval;
  if (pr.priority != 0 && !opts_.priority_scheduling)
    throw ApiError(400,
                   "'priority' needs priority scheduling; start the server with --enable-priority-scheduling "
                   "(SGLang's: higher values first) or --scheduling-policy priority (vLLM's: lower values first)",
                   "priority", "invalid_value");
  p.spec.priority = opts_.priority_higher_first ? -pr.priority : pr.priority;
  if (pr.session && pr.session->rid) p.spec.follow_rid = *pr.session->rid;  // to the DP rank caching its parent
  if (!pr.constraint_regex.empty()) {
    if (!codec_)
      throw ApiError(400, "constrained decoding needs the tokenizer; this server runs without one",
                     pr.constraint_param, "no_tokenizer");
    if (pr.forced_tool_calls) {  // the calls are written in the format's special tokens: the tokenizer needs them
      const ToolMarkers& tm = tool_markers(opts_.parse.tool_format);
      for (std::string_view m : {tm.calls_begin, tm.calls_end, tm.call_begin, tm.call_end, tm.sep})
        if (!single_token(std::string(m)))
          throw ApiError(400, fmt::format("'tool_choice' needs the tool-call tokens of --tool-call-parser {}; this "
                                          "tokenizer has no {}",
                                          opts_.tool_call_parser, m),
                         "tool_choice", "invalid_value");
    }
    try {
      p.spec.sampling.constraint = constraint_for(pr.constraint_regex, pr.constraint_nfa);  // shared by the choices
    } catch (const Error& e) {  // a schema's pattern the regex compiler rejects
      throw ApiError(400, fmt::format("'{}': {}", pr.constraint_param, e.what()), pr.constraint_param,
                     "invalid_value");
    }
  }
  p.rc = ResponseContext{pr.api,
                         p.spec.id,
                         answered_name(pr.model),
                         unix_seconds(),
                         pr.logprobs,
                         pr.top_logprobs,
                         pr.return_text_in_logprobs,
                         pr.sampling.logprob_start_len >= 0,
                         pr.prompt_logprobs,
                         pr.api == ApiKind::Chat && pr.separate_reasoning &&
                             reasoning_split(opts_.reasoning_parser, pr.chat_template_kwargs),
                         parse_tools,
                         opts_.parse.tool_format,
                         reasoning_needs_open_think(opts_.reasoning_parser),
                         pr.parallel_tool_calls,
                         pr.echo,
                         pr.include_usage,
                         pr.continuous_usage,
                         pr.batch || pr.n > 1,
                         codec_};
  p.rc.token_ids_logprob = !pr.token_ids_logprob.empty();
  p.rc.tokens_as_ids = pr.tokens_as_ids && pr.api != ApiKind::Native;
  p.rc.return_token_ids = pr.return_token_ids && pr.api != ApiKind::Native;
  p.rc.include_reasoning = pr.include_reasoning;
  p.rc.role = opts_.response_role;
  p.rc.stream_reasoning = pr.stream_reasoning;
  p.rc.incremental = pr.api == ApiKind::Native && pr.stream && opts_.stream_output;
  return p;
}

// Completions `suffix` (DeepSeek's fill in the middle, as DeepSeek-Coder is prompted and SGLang's deepseek_coder
// completion template writes it): each prompt becomes <｜fim▁begin｜> prompt <｜fim▁hole｜> suffix <｜fim▁end｜> (after
// the BOS a text prompt gets; a token-id prompt's leading BOS stays first), and the model writes the hole.
std::optional<int32_t> Api::single_token(const std::string& text) const {
  std::lock_guard<std::mutex> lk(special_mu_);
  auto it = specials_.find(text);
  if (it == specials_.end()) {
    const std::vector<int32_t> ids = codec_->encode(text, /*add_special_tokens=*/false);
    std::optional<int32_t> id;
    if (ids.size() == 1 && codec_->token_text(ids[0]) == text) id = ids[0];
    it = specials_.emplace(text, id).first;
  }
  return it->second;
}

void Api::fill_in_the_middle(ParsedRequest& pr) const {
  if (!codec_)
    throw ApiError(400, "'suffix' needs a tokenizer; this server runs without one", "suffix", "no_tokenizer");
  auto special = [&](const char* text) {
    const std::optional<int32_t> id = single_token(text);
    if (!id)
      throw ApiError(400,
                     fmt::format("'suffix' (fill in the middle) needs a tokenizer with DeepSeek's FIM tokens; this one "
                                 "has no {} token",
                                 text),
                     "suffix", "unsupported_parameter");
    return *id;
  };
  const int32_t begin = special("<｜fim▁begin｜>"), hole = special("<｜fim▁hole｜>"), end = special("<｜fim▁end｜>");
  const std::vector<int32_t> bos = codec_->encode("", /*add_special_tokens=*/true);  // [BOS] or nothing
  const std::vector<int32_t> after = codec_->encode(*pr.suffix, /*add_special_tokens=*/false);
  for (PromptInput& in : pr.prompts) {
    std::vector<int32_t> ids = in.text ? codec_->encode(*in.text, /*add_special_tokens=*/true) : in.input_ids;
    const auto at = ids.begin() + (bos.size() == 1 && !ids.empty() && ids[0] == bos[0] ? 1 : 0);
    ids.insert(at, begin);
    ids.push_back(hole);
    ids.insert(ids.end(), after.begin(), after.end());
    ids.push_back(end);
    in.input_ids = std::move(ids);
  }
}

void Api::tokenize(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  if (!codec_) throw ApiError(400, "tokenizing needs a tokenizer; this server runs without one", "", "no_tokenizer");
  const json body = parse_body(req.body);
  std::vector<int32_t> ids;
  if (body.contains("messages")) {
    ids = chat_prompt_ids(body);
  } else {
    const Fields f(body);
    const std::string prompt = f.required_string("prompt", "a string; or 'messages'");
    ids = codec_->encode(prompt, f.boolean("add_special_tokens").value_or(true));
  }
  // vLLM's return_token_strs: the vocabulary's strings of the ids too
  const bool strs = Fields(body).boolean("return_token_strs").value_or(false);
  ojson out;
  out["count"] = ids.size();
  out["max_model_len"] = engine_.max_context_len();
  out["tokens"] = ids;
  if (strs) {
    ojson pieces = ojson::array();
    for (int32_t id : ids) {
      const std::optional<std::string> p = codec_->token_piece(id);
      pieces.push_back(p ? ojson(*p) : ojson(nullptr));
    }
    out["token_strs"] = std::move(pieces);
  }
  respond_json(ex, 200, dump(out));
}

std::vector<int32_t> Api::chat_prompt_ids(const json& body) {
  ParsedRequest pr = parse_chat(body, opts_.parse);  // validates the messages
  const bool gen = Fields(body).boolean("add_generation_prompt").value_or(true);
  json vars = pr.chat_template_kwargs;
  if (!pr.tools.is_null() && !pr.tool_choice_none) vars["tools"] = pr.tools;
  return codec_->encode(render_chat(pr, gen, vars), /*add_special_tokens=*/false);
}

std::string Api::render_chat(const ParsedRequest& pr, bool add_generation_prompt, const json& vars) const {
  if (pr.chat_template && !opts_.trust_request_chat_template)
    throw ApiError(400, "a chat_template was passed with the request, but the server was not started with "
                        "--trust-request-chat-template: the request's template was refused",
                   "chat_template");
  try {
    return pr.chat_template ? codec_->apply_chat_template_source(*pr.chat_template, pr.messages,
                                                                 add_generation_prompt, vars)
                            : codec_->apply_chat_template(pr.messages, add_generation_prompt, vars);
  } catch (const std::exception& e) {
    throw ApiError(400, fmt::format("the chat template failed on these messages: {}", e.what()),
                   pr.chat_template ? "chat_template" : "messages", "invalid_value");
  }
}

void Api::detokenize(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  if (!codec_) throw ApiError(400, "detokenizing needs a tokenizer; this server runs without one", "", "no_tokenizer");
  const json body = parse_body(req.body);
  const auto it = body.find("tokens");
  if (it == body.end() || !it->is_array())
    throw ApiError(400, "'tokens' (an array of token ids) is required", "tokens", "invalid_value");
  std::vector<int32_t> ids;
  const int64_t vocab = static_cast<int64_t>(codec_->vocab_size());
  for (size_t i = 0; i < it->size(); ++i)
    ids.push_back(static_cast<int32_t>(Fields::as_integer((*it)[i], fmt::format("tokens[{}]", i), 0, vocab - 1)));
  ojson out;
  out["prompt"] = codec_->decode(ids, /*skip_special_tokens=*/false);
  respond_json(ex, 200, dump(out));
}

void Api::abort_request(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  const json body = parse_body(req.body);
  const Fields f(body);
  const bool abort_all = f.boolean("abort_all").value_or(false);
  const std::optional<std::string> rid = f.string("rid");
  if (!abort_all && !rid) bad_request("rid", "invalid_value", "'rid' (a string) or 'abort_all': true is required");
  const size_t n =
      abort_jobs([&](const std::string& id) { return abort_all || id == *rid; }, "aborted by /abort_request");
  respond_json(ex, 200, dump(ojson{{"aborted", n}}));
}

size_t Api::abort_jobs(const std::function<bool(const std::string&)>& match, const std::string& message) {
  std::vector<std::shared_ptr<GenerationJob>> hit;
  {
    std::lock_guard lk(jobs_mu_);
    for (const auto& [id, w] : jobs_)
      if (match(id))
        if (auto j = w.lock(); j && !j->done()) hit.push_back(std::move(j));
  }
  FinishReason f;
  f.kind = FinishKind::Abort;
  f.message = message;
  for (const auto& j : hit)
    for (const auto& c : j->choices()) engine_.abort(c.rid, f);  // each choice ends as aborted, its client answered
  return hit.size();
}

void Api::open_session(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  const json body = body_or_empty(req);
  const Fields f(body);
  // (SGLang's fields; capacity_of_str_len 0 when absent, as its newer servers take it; `streaming` sessions keep
  // their turns in the prefix cache as every session here does)
  const int64_t capacity = f.integer("capacity_of_str_len", 0, std::numeric_limits<int64_t>::max()).value_or(0);
  const std::optional<std::string> id = f.string("session_id");
  if (id && id->empty()) bad_request("session_id", "invalid_value", "'session_id' must not be empty");
  f.boolean("streaming");
  const std::optional<double> timeout = f.number("timeout", 0.0, 1e9, /*lo_open=*/true);  // seconds idle
  respond_json(ex, 200, json(sessions_->open(id.value_or(""), capacity, timeout)).dump());
}

void Api::configure_logging(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  const json body = body_or_empty(req);
  const Fields f(body);
  f.allow_only({"log_requests", "log_requests_level", "dump_requests_folder", "dump_requests_threshold",
                "crash_dump_folder"},
               "a logging setting");
  const std::optional<bool> on = f.boolean("log_requests");  // (absent or null: unchanged, as SGLang's)
  const std::optional<int64_t> level = f.integer("log_requests_level", 0, 3);
  for (const char* key : {"dump_requests_folder", "crash_dump_folder"})
    if (!f.string(key).value_or("").empty())
      bad_request(key, "unsupported_parameter", "'{}': this server writes no request dumps (SGLang's pickle files)",
                  key);
  f.integer("dump_requests_threshold", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
  if (on) log_requests_ = *on;
  if (level) log_level_ = static_cast<int>(*level);
  MLA_LOG_INFO("request logging {} (level {}), by /configure_logging", log_requests_ ? "on" : "off", log_level_.load());
  ex->respond(200, "text/plain", "");  // SGLang's empty answer
}

void Api::kv_export(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  const json body = parse_body(req.body);
  const Fields f(body);
  f.allow_only({"token_ids", "cache_salt", "begin", "max_tokens", "bootstrap_room", "wait_ms"}, "a KV export field");
  const json& ids = f.required("token_ids", "the tokens whose cached prefix is read");
  if (!ids.is_array()) bad_request("token_ids", "invalid_type", "'token_ids' must be an array of token ids");
  std::vector<int32_t> tokens;
  tokens.reserve(ids.size());
  for (const json& t : ids) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
      bad_request("token_ids", "invalid_value", "'token_ids' must hold token ids (non-negative integers)");
    tokens.push_back(t.get<int32_t>());
  }
  std::string salt = f.string("cache_salt").value_or("");
  const auto begin = static_cast<int32_t>(f.integer("begin", 0, std::numeric_limits<int32_t>::max()).value_or(0));
  const auto max_tokens = static_cast<int32_t>(
      f.integer("max_tokens", 0, std::numeric_limits<int32_t>::max()).value_or(std::numeric_limits<int32_t>::max()));
  std::optional<uint64_t> room;
  if (const json* r = f.get("bootstrap_room"); r && !r->is_null()) {
    if (!r->is_number_integer() || (!r->is_number_unsigned() && r->get<int64_t>() < 0))
      bad_request("bootstrap_room", "invalid_value", "'bootstrap_room' must be a non-negative integer");
    room = r->get<uint64_t>();
  }
  const int64_t own_ms = static_cast<int64_t>(opts_.kv_transfer_timeout_s * 1000.0);
  const auto wait = std::chrono::milliseconds(f.integer("wait_ms", 0, own_ms).value_or(own_ms));
  auto read = [this, ex, tokens = std::move(tokens), salt = std::move(salt), begin, max_tokens](bool) mutable {
    engine_.export_kv(std::move(tokens), std::move(salt), begin, max_tokens, [this, ex](KvRows rows) {
      auto shared = std::make_shared<KvRows>(std::move(rows));
      ex->executor()([this, ex, shared] {
        if (!shared->error.empty()) {
          respond_error(ex, 400, error_body(400, "KV export: " + shared->error, "invalid_request_error", "kv_export"));
          return;
        }
        metrics_.kv_transfer_sent_bytes_total += static_cast<int64_t>(shared->rows_size());
        ex->respond(200, "application/octet-stream", encode_kv_rows(std::move(*shared)));
      });
    });
  };
  // Prefill mode: the room's request may not have ended (or arrived) yet; what is cached then is read either way.
  if (room && rooms_) rooms_->when_ended(*room, wait, std::move(read));
  else read(true);
}

void Api::close_session(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  const json body = body_or_empty(req);
  const std::string id = Fields(body).required_string("session_id", "the session to close");
  if (!sessions_->close(id)) bad_request("session_id", "invalid_value", "session '{}' is not open", id);
  ex->respond(200, "text/plain", "");  // SGLang's empty answer
}

std::pair<std::string, std::string> Api::weights_info() const {
  std::lock_guard lk(weights_->mu);
  return {weights_->path, weights_->version};
}

void Api::update_weights_from_disk(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  const json body = parse_body(req.body);
  const Fields f(body);
  WeightUpdate u;
  u.model_path = f.required_string("model_path", "the folder of the checkpoint to load");
  if (u.model_path.empty()) bad_request("model_path", "invalid_value", "'model_path' must be a checkpoint's folder");
  if (const std::optional<std::string> lf = f.string("load_format"); lf && *lf != "auto" && *lf != "safetensors")
    bad_request("load_format", "invalid_value",
                "'load_format' '{}': weights load from safetensors (auto or safetensors)", *lf);
  u.abort_all_requests = f.boolean("abort_all_requests").value_or(u.abort_all_requests);
  u.flush_cache = f.boolean("flush_cache").value_or(u.flush_cache);
  const std::optional<std::string> version = f.string("weight_version");
  std::weak_ptr<HttpExchange> wex = ex;
  Executor post = ex->executor();
  MLA_LOG_INFO("updating the weights from {}", u.model_path);
  engine_.update_weights(u, [state = weights_, wex, post, version, path = u.model_path](const WeightUpdateResult& r) {
    if (r.ok) {
      std::lock_guard lk(state->mu);
      state->path = path;
      if (version) state->version = *version;
    } else {
      MLA_LOG_WARN("weight update from {} failed: {}", path, r.message);
    }
    ojson out;
    out["success"] = r.ok;
    out["message"] = r.ok ? "Succeeded to update model weights." : r.message;
    out["num_paused_requests"] = 0;
    post([wex, ok = r.ok, text = dump(out)] {
      if (auto ex2 = wex.lock()) ex2->respond(ok ? 200 : 400, "application/json", text);
    });
  });
}

void Api::get_weights_by_name(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  const json body = parse_body(req.body);
  const Fields f(body);
  std::string name = f.required_string("name", "the checkpoint tensor's name");
  const int64_t rows = f.integer("truncate_size", 0, std::numeric_limits<int32_t>::max()).value_or(100);
  std::weak_ptr<HttpExchange> wex = ex;
  Executor post = ex->executor();
  engine_.get_weights(std::move(name), rows, [wex, post](const std::vector<WeightValues>& all) {
    int status = 200;
    std::string text;
    try {
      // Written as text (up to kMaxReadValues numbers: no JSON tree of them all): one list per DP rank (one rank: its
      // list alone), a list per row, a vector's elements as one list.
      for (const WeightValues& v : all)
        if (!v.ok) throw ApiError(400, v.message, "name", "invalid_value");
      if (all.size() != 1) text += '[';
      for (size_t i = 0; i < all.size(); ++i) {
        const WeightValues& v = all[i];
        if (i) text += ',';
        if (v.shape.size() == 1) {
          append_numbers(text, v.values.data(), v.cols);
          continue;
        }
        text += '[';
        for (int64_t r = 0; r < v.rows; ++r) {
          if (r) text += ',';
          append_numbers(text, v.values.data() + r * v.cols, v.cols);
        }
        text += ']';
      }
      if (all.size() != 1) text += ']';
    } catch (const ApiError& e) {
      status = e.status;
      text = error_body(e);
    }
    post([wex, status, text = std::move(text)] {
      if (auto ex2 = wex.lock()) ex2->respond(status, "application/json", text);
    });
  });
}

void Api::pause(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool vllm) {
  PauseMode mode = PauseMode::Abort;
  bool clear_cache = false;
  if (vllm) {  // query flags: wait_for_inflight_requests (false: abort them), clear_cache (true)
    const std::string_view q = query_of(req.target);
    auto flag = [&](const char* name, bool dflt) {
      const auto v = query_param(q, name);
      if (!v) return dflt;
      if (*v == "true" || *v == "True" || *v == "1") return true;
      if (*v == "false" || *v == "False" || *v == "0") return false;
      throw ApiError(400, fmt::format("'{}' must be true or false, got '{}'", name, *v), name, "invalid_value");
    };
    if (flag("wait_for_inflight_requests", false)) mode = PauseMode::Drain;
    clear_cache = flag("clear_cache", true);
  } else {
    const json body = body_or_empty(req);
    if (const std::optional<std::string> m = Fields(body).string("mode")) {
      if (*m == "retract") mode = PauseMode::Retract;
      else if (*m == "in_place") mode = PauseMode::InPlace;
      else if (*m != "abort")
        bad_request("mode", "invalid_value", "'mode' must be abort, retract or in_place, got '{}'", *m);
    }
  }
  std::weak_ptr<HttpExchange> wex = ex;
  Executor post = ex->executor();
  EngineClient* engine = &engine_;
  engine_.pause_generation(mode, [wex, post, engine, vllm, clear_cache](bool ok) {
    post([wex, engine, ok, vllm, clear_cache] {
      auto ex2 = wex.lock();
      if (!ok) {
        if (ex2)
          ex2->respond(503, "application/json",
                       error_body(503, "the engine did not pause", "engine_error", "service_unavailable"));
        return;
      }
      if (clear_cache) engine->flush_cache();  // (nothing runs: a drain or abort left no request)
      if (ex2)
        ex2->respond(200, "application/json",
                     vllm ? R"({"status":"paused"})"
                          : R"({"message":"Generation paused successfully.","status":"ok"})");
    });
  });
}

void Api::memory_occupation(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool release) {
  const json body = body_or_empty(req);
  // SGLang's tags name parts of the memory; here the weights and the KV cache share one allocation, released and
  // taken again together (the CUDA graphs' memory stays): any of them means all.
  if (const auto t = body.find("tags"); t != body.end() && !t->is_null()) {
    if (!t->is_array()) throw ApiError(400, "'tags' must be a list", "tags", "invalid_value");
    for (const json& tag : *t)
      if (!tag.is_string() || (tag != "weights" && tag != "kv_cache" && tag != "cuda_graph"))
        throw ApiError(400, fmt::format("'tags' holds {}: expected weights, kv_cache or cuda_graph", tag.dump()),
                       "tags", "invalid_value");
  }
  auto answer = [later = on_connection(ex)](const WeightUpdateResult& r) {
    if (!r.ok) MLA_LOG_WARN("{}", r.message);
    const std::string text = dump(ojson{{"success", r.ok}, {"message", r.message}});
    later([ok = r.ok, text](HttpExchange* e) {
      if (e) e->respond(ok ? 200 : 400, "application/json", text);
    });
  };
  if (release) engine_.release_memory(answer);
  else engine_.resume_memory(answer);
}

namespace {

// /dump_expert_distribution_record's file (Api::expert_record); its path, or throws naming what failed.
std::string write_expert_record(const std::string& dir, const ExpertRecord& r) {
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::filesystem::path path =
      std::filesystem::path(dir) / fmt::format("expert_distribution_recorder_{:.6f}.json", now);
  json table = json::array();
  for (int64_t l = 0; l < r.num_layers; ++l) {
    const auto first = r.counts.begin() + l * r.num_experts;
    table.push_back(std::vector<int64_t>(first, first + r.num_experts));
  }
  write_file(path, dump(ojson{{"rank", 0},
                              {"num_layers", r.num_layers},
                              {"num_experts", r.num_experts},
                              {"logical_count", std::move(table)}}) +
                       "\n");
  return path.string();
}

}  // namespace

void Api::expert_record(const std::shared_ptr<HttpExchange>& ex, ExpertRecordOp op) {
  // The answer (and a dump's file) is made on the connection's executor, not on the engine thread that calls back.
  const std::string dir = opts_.expert_distribution_dir;
  engine_.expert_record(op, [later = on_connection(ex), op, dir](const ExpertRecord& r) {
    later([op, dir, r](HttpExchange* e) {
      int status = 200;
      std::string type = "text/plain", text;
      try {
        if (!r.ok) throw ApiError(400, r.message);
        switch (op) {
          case ExpertRecordOp::Start:
            text = "Start recording the expert distribution.\n";
            break;
          case ExpertRecordOp::Stop:
            text = "Stop recording the expert distribution.\n";
            break;
          case ExpertRecordOp::Dump:
            MLA_LOG_INFO("expert distribution written to {}", write_expert_record(dir, r));
            text = "Dump expert distribution record.\n";
            break;
        }
      } catch (const ApiError& e) {
        status = e.status;
        type = "application/json";
        text = error_body(e);
      } catch (const std::exception& e) {
        status = 500;
        type = "application/json";
        text = error_body(500, e.what(), "internal_error");
      }
      if (e) e->respond(status, type, text);
    });
  });
}

void Api::profile(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool start) {
  ProfileRequest p;
  p.start = start;
  p.output_dir = opts_.profile_dir;
  if (start && !req.body.empty()) {
    const json body = parse_body(req.body);
    const Fields f(body);
    if (const std::optional<std::string> d = f.string("output_dir")) {
      if (d->empty()) bad_request("output_dir", "invalid_value", "'output_dir' must be a folder's path");
      p.output_dir = *d;
    }
    if (auto n = f.integer("num_steps", 1, std::numeric_limits<int64_t>::max())) p.num_steps = *n;
  }
  engine_.profile(p, [later = on_connection(ex), start](const ProfileResult& r) {
    for (const std::string& path : r.paths) MLA_LOG_INFO("profile written to {}", path);
    later([start, r](HttpExchange* e) {
      if (!e) return;
      if (!r.ok) return e->respond(400, "application/json", error_body(400, r.message));
      e->respond(200, "text/plain", start ? "Start profiling.\n" : "Stop profiling. This will take some time.\n");
    });
  });
}

void Api::sleep_or_wake(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool sleep) {
  const std::string_view q = query_of(req.target);
  if (sleep) {
    const std::string level = query_param(q, "level").value_or("1");
    if (level != "1" && level != "2")
      throw ApiError(400, fmt::format("'level' must be 1 or 2, got '{}'", level), "level", "invalid_value");
  } else {
    for (std::string_view rest = q; !rest.empty();) {  // every tags=... (repeated)
      const size_t amp = rest.find('&');
      const std::string_view kv = rest.substr(0, amp);
      if (kv.substr(0, kv.find('=')) == "tags") {
        const auto t = query_param(kv, "tags");
        if (*t != "weights" && *t != "kv_cache")
          throw ApiError(400, fmt::format("'tags' must be weights or kv_cache, got '{}'", *t), "tags", "invalid_value");
      }
      rest = amp == std::string_view::npos ? std::string_view() : rest.substr(amp + 1);
    }
  }
  if (engine_.memory_released() == sleep) return ex->respond(200, "text/plain", "");  // asleep / awake already
  auto answer = [later = on_connection(ex)](const WeightUpdateResult& r) {
    if (!r.ok) MLA_LOG_WARN("{}", r.message);
    later([r](HttpExchange* e) {
      if (!e) return;
      if (r.ok) e->respond(200, "text/plain", "");
      else e->respond(400, "application/json", error_body(400, r.message));
    });
  };
  if (sleep) engine_.release_memory(answer);
  else engine_.resume_memory(answer);
}

void Api::health_generate(const std::shared_ptr<HttpExchange>& ex) {
  GenerateRequest g;
  g.rid = "health-" + new_id();
  g.input_ids = {0};
  g.sampling.max_new_tokens = 1;
  g.sampling.temperature = 0.0f;
  std::weak_ptr<HttpExchange> wex = ex;
  Executor post = ex->executor();
  g.on_output = [wex, post](const GenerateOutput& o) {
    if (!o.finished) return;
    const bool ok = o.finish.kind != FinishKind::Abort && o.completion_tokens == 1;
    post([wex, ok, why = o.finish.message] {
      if (auto ex2 = wex.lock())
        ex2->respond(ok ? 200 : 503, "application/json",
                     ok ? "{}" : error_body(503, "the engine failed a one-token generation: " + why, "engine_error",
                                            "service_unavailable"));
    });
  };
  ex->on_cancel([this, rid = g.rid](const std::string& why) {
    FinishReason f;
    f.kind = FinishKind::Abort;
    f.message = why;
    engine_.abort(rid, f);
  });
  try {
    engine_.submit(std::move(g));
  } catch (const std::exception& e) {
    respond_error(ex, 503, error_body(503, std::string("the engine refused a one-token generation: ") + e.what(),
                                      "engine_error", "service_unavailable"));
  }
}

std::shared_ptr<TokenConstraint> Api::constraint_for(const std::string& regex,
                                                     const std::shared_ptr<const structured::Nfa>& nfa) {
  std::lock_guard<std::mutex> lk(vocab_mu_);
  for (size_t i = 0; i < constraints_.size(); ++i)
    if (constraints_[i].first == regex) {
      std::rotate(constraints_.begin() + static_cast<int64_t>(i), constraints_.begin() + static_cast<int64_t>(i) + 1,
                  constraints_.end());
      return constraints_.back().second;
    }
  if (!vocab_) vocab_ = std::make_shared<const structured::TokenVocab>(codec_->token_bytes());
  auto c = nfa ? std::make_shared<structured::RegexConstraint>(vocab_, *nfa)
               : std::make_shared<structured::RegexConstraint>(vocab_, regex);
  if (constraints_.size() >= kConstraintCache) constraints_.erase(constraints_.begin());
  constraints_.emplace_back(regex, c);
  return c;
}

ojson Api::previous_conversation(const ojson& body) {
  // The conversation a request continues: the stored response's context and output.
  ojson prior = ojson::array();
  if (const auto prev = body.find("previous_response_id"); prev != body.end() && !prev->is_null()) {
    if (!prev->is_string())
      bad_request("previous_response_id", "invalid_type", "'previous_response_id' must be a string");
    const auto rec = responses_store_->get(prev->get<std::string>());
    if (!rec)
      throw ApiError(404, fmt::format("no stored response with id '{}' (deleted, created with store false, or "
                                      "forgotten: this server keeps the last {} GiB of responses in memory)",
                                      prev->get<std::string>(), ResponseStore::kMaxBytes >> 30),
                     "previous_response_id", "not_found");
    const std::string status = rec->response.value("status", "");
    if (status == "queued" || status == "in_progress")
      bad_request("previous_response_id", "invalid_value", "the response '{}' is still {}: wait until it ends",
                  prev->get<std::string>(), status);
    if (rec->context) prior = *rec->context;
    for (const auto& item : rec->response.at("output")) prior.push_back(item);
  }
  return prior;
}

void Api::responses(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  const ojson body = parse_body_ordered(req.body);
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object", "", "invalid_value");
  auto flag = [&](const char* key, bool dflt) {
    const auto it = body.find(key);
    if (it == body.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) bad_request(key, "invalid_type", "'{}' must be true or false", key);
    return it->get<bool>();
  };
  const bool store = flag("store", true), background = flag("background", false), stream = flag("stream", false);
  if (background && !store)
    bad_request("background", "invalid_value", "'background' responses need 'store' (true by default)");
  ojson prior = previous_conversation(body);
  HttpRequest chat = req;
  chat.body = responses_to_chat(body, prior).dump();  // in the request's key order (a schema's properties' order)
  const std::string id = "resp_" + new_id();  // also the job's: /abort_request takes it
  const int64_t created = unix_seconds();
  const auto model = body.find("model");  // (checked as the chat request's)
  const std::string name = answered_name(model != body.end() && model->is_string() ? model->get<std::string>() : "");
  std::shared_ptr<const ojson> context;
  ojson input;
  if (store) {
    input = responses_input_items(body, id);
    for (const auto& item : input) prior.push_back(item);
    context = std::make_shared<const ojson>(std::move(prior));
  }
  if (!background) {
    std::function<void(const ojson&)> finished;
    if (store)
      finished = [st = responses_store_.get(), id, input = std::move(input), context](const ojson& r) mutable {
        st->put(id, r, std::move(input), context);  // once: the answer or the stream's end
      };
    generate(ApiKind::Chat, chat,
             std::make_shared<ResponsesExchange>(ex, body, id, created, name, std::move(finished)),
             id);
    return;
  }
  // Background: stored as queued, generated on the store's worker; the client gets the response as it is once the
  // generation was submitted (or the error refusing it). With `stream` the client gets its events instead, as
  // GET ?stream=true does; going away does not stop the generation.
  ResponseStore* st = responses_store_.get();
  auto outer = st->begin_background(
      id, response_object(body, id, created, name, "queued"), std::move(input), std::move(context),
      [&](std::shared_ptr<HttpExchange> inner) {
        return std::make_shared<ResponsesExchange>(std::move(inner), body, id, created, name,
                                                   [st, id](const ojson& r) { st->complete(id, r); });
      },
      stream);
  if (stream) st->unsubscribe_on_cancel(id, ex);
  st->executor()([this, st, chat, outer, id, ex, stream] {
    std::string answer;
    int status = 200;
    try {
      generate(ApiKind::Chat, chat, outer, id);
      st->started(id);
      if (stream) {
        st->subscribe(id, -1, ex, [this, ex, id](int status) {
          if (status != 0) respond_deleted(ex, id);
        });
        return;
      }
      const auto rec = st->get(id);
      answer = rec ? dump(rec->response) : std::string();
    } catch (...) {
      st->abandon(id);
      std::tie(status, answer) = error_answer(chat);
    }
    if (answer.empty()) return respond_deleted(ex, id);
    ex->executor()([this, ex, status, answer = std::move(answer)]() mutable {
      respond_error(ex, status, std::move(answer));
    });
  });
}

void Api::respond_deleted(const std::shared_ptr<HttpExchange>& ex, const std::string& id) {
  ex->executor()([this, ex, id] {
    respond_error(ex, 404,
                  error_body(404, fmt::format("the response '{}' was deleted", id), "invalid_request_error",
                             "not_found"));
  });
}

void Api::responses_input_tokens(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  if (!codec_)
    throw ApiError(400, "counting tokens needs a tokenizer; this server runs without one", "", "no_tokenizer");
  ojson body = parse_body_ordered(req.body);
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object", "", "invalid_value");
  if (!body.contains("input")) body["input"] = ojson::array();  // instructions alone (or the previous response's)
  json chat = json::parse(responses_to_chat(body, previous_conversation(body), /*allow_empty=*/true).dump());
  chat["add_generation_prompt"] = true;
  ojson out;
  out["object"] = "response.input_tokens";
  out["input_tokens"] = chat_prompt_ids(chat).size();
  respond_json(ex, 200, dump(out));
}

void Api::messages(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool count) {
  const ojson body = parse_body_ordered(req.body);
  const ojson chat = anthropic_to_chat(body, count);
  if (count) {  // count_tokens: {"input_tokens"}, the prompt as the chat template renders it
    if (!codec_)
      throw ApiError(400, "counting tokens needs a tokenizer; this server runs without one", "", "no_tokenizer");
    json parsed = json::parse(chat.dump());
    parsed["add_generation_prompt"] = true;
    respond_json(ex, 200, dump(ojson{{"input_tokens", chat_prompt_ids(parsed).size()}}));
    return;
  }
  HttpRequest inner = req;
  inner.body = chat.dump();  // in the request's key order (a tool schema's properties' order)
  const auto model = body.find("model");
  const std::string name = answered_name(model != body.end() && model->is_string() ? model->get<std::string>() : "");
  const std::string id = "msg_" + new_id();  // also the job's: /abort_request takes it
  generate(ApiKind::Chat, inner, std::make_shared<AnthropicExchange>(ex, id, name), id);
}

void Api::stored_response(const HttpRequest& req, std::string_view rest, std::string_view query,
                          const std::shared_ptr<HttpExchange>& ex) {
  const auto [id, sub] = id_and_sub(rest);
  const auto rec = responses_store_->get(id);
  auto not_found = [&] {
    throw ApiError(404, fmt::format("no stored response with id '{}'", id), "response_id", "not_found");
  };
  if (sub.empty()) {
    if (req.method == "DELETE") {
      if (!responses_store_->erase(id)) not_found();
      respond_json(ex, 200, dump(ojson{{"id", id}, {"object", "response"}, {"deleted", true}}));
      return;
    }
    if (req.method != "GET") method_not_allowed(req);
    if (!rec) not_found();
    if (const auto s = query_param(query, "stream"); s && *s == "true") {
      // A background response created with `stream`: its events after starting_after, then the rest as they come.
      int64_t after = -1;
      if (const auto a = query_param(query, "starting_after")) {
        const auto [end, ec] = std::from_chars(a->data(), a->data() + a->size(), after);
        if (ec != std::errc() || end != a->data() + a->size() || after < -1)
          throw ApiError(400, fmt::format("'starting_after' must be an event's sequence number, got '{}'", *a),
                         "starting_after", "invalid_value");
      }
      responses_store_->unsubscribe_on_cancel(id, ex);
      responses_store_->subscribe(id, after, ex, [this, ex, id](int status) {
        if (status == 404) return respond_deleted(ex, id);
        if (status == 0) return;
        ex->executor()([this, ex] {
          respond_error(ex, 400,
                        error_body(400,
                                   "only background responses created with 'stream': true can be streamed: GET it "
                                   "without 'stream'",
                                   "invalid_request_error", "unsupported_parameter"));
        });
      });
      return;
    }
    respond_json(ex, 200, dump(rec->response));
  } else if (sub == "/input_items") {
    if (req.method != "GET") method_not_allowed(req);
    if (!rec) not_found();
    const int64_t limit = list_limit(query);
    const std::string order = query_param(query, "order").value_or("desc");
    if (order != "asc" && order != "desc")
      throw ApiError(400, "'order' must be asc or desc", "order", "invalid_value");
    std::vector<const ojson*> items;
    for (const auto& item : rec->input) items.push_back(&item);
    if (order == "desc") std::reverse(items.begin(), items.end());
    size_t i = 0;
    if (const auto after = query_param(query, "after")) {
      while (i < items.size() && (*items[i])["id"] != *after) ++i;
      if (i == items.size())
        throw ApiError(400, fmt::format("'after': no input item '{}' in this response", *after), "after",
                       "invalid_value");
      ++i;
    }
    ojson data = ojson::array();
    for (; i < items.size() && static_cast<int64_t>(data.size()) < limit; ++i) data.push_back(*items[i]);
    respond_json(ex, 200, dump(page_object(std::move(data), i < items.size())));
  } else if (sub == "/cancel") {
    if (req.method != "POST") method_not_allowed(req);
    if (!rec) not_found();
    if (rec->response.value("background", false) != true)
      throw ApiError(400, "only responses created with 'background': true can be cancelled", "response_id",
                     "invalid_value");
    responses_store_->cancel(id, [this, ex, id](std::shared_ptr<const ResponseStore::Record> r) {
      std::string body = r ? dump(r->response) : std::string();
      ex->executor()([this, ex, id, body = std::move(body)]() mutable {
        if (body.empty()) {
          respond_error(ex, 404, error_body(404, fmt::format("no stored response with id '{}'", id),
                                            "invalid_request_error", "not_found"));
        } else {
          respond_json(ex, 200, body);
        }
      });
    });
  } else {
    throw ApiError(404, fmt::format("no route for {} {}", req.method, path_of(req.target)), "", "not_found");
  }
}

bool Api::serves(const std::string& model) const {
  return model == opts_.served_model_name || model == opts_.model_path ||
         std::find(opts_.served_model_aliases.begin(), opts_.served_model_aliases.end(), model) !=
             opts_.served_model_aliases.end();
}

const std::string& Api::answered_name(const std::string& model) const {
  const auto& aliases = opts_.served_model_aliases;
  const auto it = std::find(aliases.begin(), aliases.end(), model);
  return it != aliases.end() ? *it : opts_.served_model_name;
}

void Api::check_model(const std::string& model) const {
  if (!serves(model) && model != "default")
    throw ApiError(404, fmt::format("the model '{}' does not exist; this server serves '{}'", model,
                                    opts_.served_model_name),
                   "model", "model_not_found");
}

void Api::score(const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex, bool vllm) {
  const json body = parse_body(req.body);
  std::string model;
  if (const auto m = body.find("model"); m != body.end() && !m->is_null()) {
    if (!m->is_string()) bad_request("model", "invalid_type", "'model' must be a string");
    model = m->get<std::string>();
    check_model(model);
  }
  ScorePlan plan =
      plan_score(body, vllm ? ScoreApi::Vllm : ScoreApi::Sglang, codec_, engine_.max_context_len(), opts_.parse);
  HttpRequest inner = req;
  inner.target = "/generate";
  inner.body = plan.generate.dump();
  const std::string id = (vllm ? "generative-scoring-" : "score-") + new_id();
  generate(ApiKind::Native, inner,
           std::make_shared<ScoreExchange>(ex, std::move(plan), id, unix_seconds(), answered_name(model)));
}

void Api::generate(ApiKind api, const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex,
                   const std::string& id) {
  json body = parse_body(req.body);
  // Prefill mode: a request refused before its job owns its rooms (a bad field, a prompt too long) ends the rooms
  // it names, so that a decode server waiting on one reads nothing at once instead of waiting out its timeout.
  struct EndNamedRoomsIfRefused {
    BootstrapRooms* rooms;
    const json& body;
    const int uncaught = std::uncaught_exceptions();
    ~EndNamedRoomsIfRefused() {
      if (!rooms || std::uncaught_exceptions() <= uncaught) return;
      try {
        for (uint64_t r : bootstrap_rooms_named(body)) rooms->end(r);
      } catch (...) {  // (unwinding already: the refusal's own error is the one answered)
      }
    }
  } refused{rooms_.get(), body};
  ParsedRequest pr = api == ApiKind::Native      ? parse_native(body, opts_.parse, req.body)
                     : api == ApiKind::Completions ? parse_completions(body, opts_.parse, req.body)
                                                   : parse_chat(body, opts_.parse, req.body);
  if (!id.empty()) pr.rid = id;
  // vLLM's response ids: "chatcmpl-" / "cmpl-" and the X-Request-Id header, else the body's request_id, else new.
  if (const std::string& base = !req.request_id.empty() ? req.request_id : pr.request_id;
      api != ApiKind::Native && pr.rid.empty() && !base.empty())
    pr.rid = (api == ApiKind::Chat ? "chatcmpl-" : "cmpl-") + base;
  Prepared p = prepare(pr);
  const int level = log_requests_.load() ? log_level_.load() : -1;
  p.spec.log_level = level;
  p.spec.log_max_len = opts_.max_log_len >= 0 ? static_cast<size_t>(opts_.max_log_len)
                       : level >= 3            ? std::numeric_limits<size_t>::max()
                                               : size_t{2048};
  if (level >= 0) MLA_LOG_INFO("{}", received_log_line(req, p.spec, pr.stream));
  if (pr.kv_transfer && pr.kv_transfer->remote_decode) {  // this server prefills: its answer names it
    auto [host, port] = split_host_port(opts_.kv_transfer_addr.empty() ? req.host : opts_.kv_transfer_addr);
    if (host.empty()) host = opts_.host;
    if (port == 0) port = req.local_port > 0 ? req.local_port : opts_.port;
    p.rc.kv_transfer_params = kv_transfer_answer(host, port, p.spec.id);
  }
  std::vector<KvSource> sources;  // per prompt: where its rows are read first (empty: nowhere)
  if (opts_.disaggregation_mode != "null") {  // SGLang's router's bootstrap fields
    const std::vector<Bootstrap> bs =
        parse_bootstrap(body, p.spec.prompts.size(), opts_.disaggregation_bootstrap_port);
    if (!bs.empty() && rooms_) {  // prefill: the first token only; its rooms end with the job
      p.spec.sampling.max_new_tokens = 1;
      p.spec.sampling.min_new_tokens = std::min(p.spec.sampling.min_new_tokens, 1);
      for (const Bootstrap& b : bs) p.rooms.push_back(b.room);
    } else {
      for (const Bootstrap& b : bs) sources.push_back(KvSource{b.host, b.port, b.room});
    }
  }
  if (pr.kv_transfer && pr.kv_transfer->remote_prefill)
    sources.assign(p.spec.prompts.size(), KvSource{pr.kv_transfer->remote_host, pr.kv_transfer->remote_port, {}});
  if (!sources.empty()) {
    generate_after_transfer(req, std::move(pr), std::move(p), std::move(sources), ex);
    return;
  }
  run_generation(pr, std::move(p), ex);
}

int32_t Api::local_prefix(const std::vector<int32_t>& tokens, const std::string& salt, int32_t rank) {
  auto got = std::make_shared<std::promise<int32_t>>();
  std::future<int32_t> f = got->get_future();
  engine_.export_kv(
      tokens, salt, 0, 0, [got](KvRows r) { got->set_value(r.error.empty() ? r.cached : 0); }, rank);
  return f.get();
}

void Api::generate_after_transfer(const HttpRequest& req, ParsedRequest pr, Prepared p, std::vector<KvSource> sources,
                                  const std::shared_ptr<HttpExchange>& ex) {
  struct Pending {
    HttpRequest head;  // (for error_answer's log line)
    ParsedRequest pr;
    Prepared p;
  };
  auto pending = std::make_shared<Pending>(Pending{HttpRequest{req.method, req.target, {}, {}, {}, {}, {}, 0},
                                                   std::move(pr), std::move(p)});
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(opts_.kv_transfer_timeout_s * 1000.0));
  kv_fetch_->post([this, pending, ex, timeout, auth = req.authorization, sources = std::move(sources)] {
    JobSpec& spec = pending->p.spec;
    for (size_t i = 0; i < spec.prompts.size(); ++i) {
      JobPrompt& prompt = spec.prompts[i];
      const KvSource& src = sources[i];
      // Only what the cache of the request's DP rank lacks is read: a later turn of a conversation finds its earlier
      // turns there (this server generated them). With several ranks the load balancer picks it now (cache_aware:
      // where the conversation is, while the ranks are balanced) and the request is sent there.
      int32_t have = 0;
      if (spec.follow_rid.empty() || engine_.stats().size() == 1) {
        prompt.dp_rank = engine_.choose_rank(prompt.input_ids, prompt.cache_salt);
        have = local_prefix(prompt.input_ids, prompt.cache_salt, prompt.dp_rank);
      }
      if (have > 0 && static_cast<size_t>(have) + 1 >= prompt.input_ids.size()) continue;  // (nothing to read)
      std::string why;
      const auto t0 = std::chrono::steady_clock::now();
      prompt.kv_prefix = fetch_kv_rows(src.host, src.port, auth, prompt.input_ids, prompt.cache_salt, timeout, why,
                                       src.room, std::numeric_limits<int32_t>::max(), have);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!prompt.kv_prefix) {
        ++metrics_.kv_transfer_failed_total;
        MLA_LOG_WARN("request {}: no KV read from the prefill server ({}): the prompt is computed here", spec.id, why);
        continue;
      }
      size_t bytes = 0;
      for (const KvRows& r : *prompt.kv_prefix) bytes += r.rows_size();
      const int32_t tokens = prompt.kv_prefix->back().end - prompt.kv_prefix->front().begin;
      metrics_.kv_transfer_seconds.observe(s);
      metrics_.kv_transfer_received_tokens_total += tokens;
      metrics_.kv_transfer_received_bytes_total += static_cast<int64_t>(bytes);
      MLA_LOG_INFO("request {}: KV of {} prompt tokens ({:.1f} MB; {} cached here) read from {}:{} in {:.1f} ms ({} "
                   "reads, {:.0f} MB/s)",
                   spec.id, tokens, static_cast<double>(bytes) / 1e6, have, src.host, src.port, s * 1e3,
                   prompt.kv_prefix->size(), s > 0 ? static_cast<double>(bytes) / 1e6 / s : 0.0);
    }
    ex->executor()([this, pending, ex] {
      try {
        run_generation(pending->pr, std::move(pending->p), ex);
      } catch (...) {
        const auto [status, body] = error_answer(pending->head);
        respond_error(ex, status, body);
      }
    });
  });
}

void Api::run_generation(const ParsedRequest& pr, Prepared p, const std::shared_ptr<HttpExchange>& ex) {
  const ApiKind api = pr.api;
  const bool stream = pr.stream;
  // Prefill mode: the job's bootstrap rooms end with it (whichever way), or now if it never starts.
  struct EndRooms {
    std::weak_ptr<BootstrapRooms> rooms;
    std::vector<uint64_t> ids;
    void operator()() const {
      if (auto r = rooms.lock())
        for (uint64_t id : ids) r->end(id);
    }
  };
  const EndRooms end_rooms{rooms_, std::move(p.rooms)};
  struct EndRoomsUnlessStarted {  // (a refusal before the job starts, e.g. its id in use, ends them too)
    const EndRooms& end;
    bool started = false;
    ~EndRoomsUnlessStarted() {
      if (!started) end();
    }
  } rooms_guard{end_rooms};
  auto job = std::make_shared<GenerationJob>(engine_, codec_, &metrics_, ex->executor(), std::move(p.spec));
  const ResponseContext rc = p.rc;
  std::weak_ptr<HttpExchange> wex = ex;
  std::weak_ptr<GenerationJob> wjob = job;

  if (!stream) {
    job->on_done = [this, wex, wjob, rc] {
      auto ex2 = wex.lock();
      auto job2 = wjob.lock();
      if (!ex2 || !job2) return;
      if (rc.api == ApiKind::Native) {
        if (!rc.list_response) {
          respond_json(ex2, 200, dump(native_object(rc, *job2, job2->choices()[0])));
        } else {
          ojson arr = ojson::array();
          for (const auto& c : job2->choices()) arr.push_back(native_object(rc, *job2, c));
          respond_json(ex2, 200, dump(arr));
        }
      } else {
        respond_json(ex2, 200, dump(openai_response(rc, *job2)));
      }
    };
  } else {
    auto state = std::make_shared<OpenAIStream>();
    for (size_t i = 0; i < job->choices().size(); ++i) {
      state->text_offsets.push_back(0);
      state->echo_pending.push_back(rc.api == ApiKind::Completions && rc.echo && rc.logprobs);
      state->chat.emplace_back(rc);
      state->calls_sent.push_back(0);
      state->prompt_lps_sent.push_back(false);
      state->ids_sent.push_back(0);
      state->held_reasoning.emplace_back();
    }
    job->on_update = [wex, wjob, rc, state](const ChoiceUpdate& u) {
      auto ex2 = wex.lock();
      auto job2 = wjob.lock();
      if (!ex2 || !job2) return;
      const Choice& c = job2->choices()[u.choice];
      if (rc.api == ApiKind::Native) {
        ex2->send_event(dump(native_object(rc, *job2, c, &u)));
        return;
      }
      if (state->echo_pending[u.choice]) {  // the prompt and its logprobs, before the first tokens
        state->echo_pending[u.choice] = false;
        ojson ch;
        ch["index"] = c.index;
        ch["text"] = job2->spec().prompts[c.prompt_index].text;
        ch["logprobs"] = completion_logprobs(rc, c, c.logprobs.size(), 0, /*prompt=*/true);
        for (const auto& lp : c.prompt_logprobs) state->text_offsets[u.choice] += token_str(rc, lp.token).size();
        ch["finish_reason"] = nullptr;
        ex2->send_event(dump(openai_chunk(rc, std::move(ch), *job2)));
      }
      const std::string delta = c.text.substr(u.text_begin);
      const bool new_logprobs = rc.logprobs && c.logprobs.size() > u.logprobs_begin;
      // vLLM's prompt_logprobs: with the first chunk once they are known.
      auto attach_prompt_logprobs = [&](ojson& ch) {
        if (rc.vllm_prompt_logprobs < 0 || state->prompt_lps_sent[u.choice] || c.prompt_logprobs.empty()) return;
        ch["prompt_logprobs"] = vllm_prompt_logprobs(rc, c);
        state->prompt_lps_sent[u.choice] = true;
      };
      // vLLM's return_token_ids: the ids not sent yet (completions: the prompt's with the choice's first chunk).
      auto attach_token_ids = [&](ojson& ch) {
        if (!rc.return_token_ids) return;
        size_t& sent = state->ids_sent[u.choice];
        if (rc.api == ApiKind::Completions && sent == 0 && !ch.contains("prompt_token_ids"))
          ch["prompt_token_ids"] = job2->spec().prompts[c.prompt_index].input_ids;
        ch["token_ids"] = std::vector<int32_t>(c.output_ids.begin() + static_cast<ptrdiff_t>(sent), c.output_ids.end());
        sent = c.output_ids.size();
      };
      // Chat with a reasoning or tool-call parser: the new text split (held back while a marker is undecided).
      const bool split = rc.api == ApiKind::Chat && (rc.split_reasoning || rc.parse_tools);
      ChatSplitter::Parts parts;
      if (split) parts = state->chat[u.choice].push(rc, delta, u.finished);
      if (!rc.include_reasoning) parts.reasoning.clear();
      if (!rc.stream_reasoning) {  // held until the reasoning has ended (the answer starts, or the choice ends)
        std::string& held = state->held_reasoning[u.choice];
        held += parts.reasoning;
        parts.reasoning.clear();
        if (!held.empty() && (!parts.content.empty() || !parts.calls.empty() || u.finished)) parts.reasoning.swap(held);
      }
      const bool new_text =
          split ? !parts.reasoning.empty() || !parts.content.empty() || !parts.calls.empty() : !delta.empty();
      if (new_text || new_logprobs) {
        ojson ch;
        ch["index"] = c.index;
        if (split) {
          ojson d = ojson::object();
          if (!parts.reasoning.empty()) d["reasoning_content"] = parts.reasoning;
          if (!parts.content.empty() || (parts.reasoning.empty() && parts.calls.empty())) d["content"] = parts.content;
          if (!parts.calls.empty()) {
            ojson calls = ojson::array();
            for (const auto& call : parts.calls)
              calls.push_back(tool_call_json(rc, c, call, state->calls_sent[u.choice]++, true));
            d["tool_calls"] = std::move(calls);
          }
          ch["delta"] = std::move(d);
          ch["logprobs"] = rc.logprobs ? chat_logprobs(rc, c, u.logprobs_begin) : ojson(nullptr);
        } else if (rc.api == ApiKind::Chat) {
          ch["delta"] = ojson{{"content", delta}};
          ch["logprobs"] = rc.logprobs ? chat_logprobs(rc, c, u.logprobs_begin) : ojson(nullptr);
        } else {
          ch["text"] = delta;
          if (rc.logprobs) {
            ch["logprobs"] = completion_logprobs(rc, c, u.logprobs_begin, state->text_offsets[u.choice]);
            for (size_t i = u.logprobs_begin; i < c.logprobs.size(); ++i)
              state->text_offsets[u.choice] += token_str(rc, c.logprobs[i].token).size();
          } else {
            ch["logprobs"] = nullptr;
          }
        }
        ch["finish_reason"] = nullptr;
        attach_prompt_logprobs(ch);
        attach_token_ids(ch);
        ex2->send_event(dump(openai_chunk(rc, std::move(ch), *job2)));
      }
      if (u.finished) {
        ojson ch;
        ch["index"] = c.index;
        if (rc.api == ApiKind::Chat) ch["delta"] = ojson::object();
        else ch["text"] = "";
        ch["logprobs"] = nullptr;
        ch["finish_reason"] = rc.api == ApiKind::Chat ? chat_finish_reason(c, state->calls_sent[u.choice] > 0)
                                                      : openai_finish_reason(c.finish);
        ch["matched_stop"] = matched_stop(c.finish);
        attach_prompt_logprobs(ch);
        attach_token_ids(ch);
        ex2->send_event(dump(openai_chunk(rc, std::move(ch), *job2)));
      }
    };
    job->on_done = [wex, wjob, rc] {
      auto ex2 = wex.lock();
      auto job2 = wjob.lock();
      if (!ex2 || !job2) return;
      // SGLang's return_hidden_states: each choice's last row in a chunk of its own after the text.
      for (const Choice& c : job2->choices()) {
        if (rc.api == ApiKind::Native || !returns_hidden(*job2, c)) continue;
        ojson ch;
        ch["index"] = c.index;
        if (rc.api == ApiKind::Chat) {
          ch["delta"] = ojson{{"hidden_states", last_hidden_state(c)}};
        } else {
          ch["text"] = "";
          ch["hidden_states"] = last_hidden_state(c);
        }
        ch["logprobs"] = nullptr;
        ch["finish_reason"] = nullptr;
        ex2->send_event(dump(openai_chunk(rc, std::move(ch), *job2)));
      }
      if (rc.api != ApiKind::Native && rc.include_usage) {
        ojson o = openai_envelope(rc, rc.api == ApiKind::Chat ? "chat.completion.chunk" : "text_completion");
        o["choices"] = ojson::array();
        o["usage"] = usage(*job2);
        ex2->send_event(dump(o));
      }
      ex2->send_event("[DONE]");
      ex2->end_stream();
    };
  }
  ex->on_cancel([wjob, this](const std::string& why) {
    if (auto j = wjob.lock()) j->cancel(why);
  });
  {  // known to /abort_request before its first choice reaches the engine; the id of a running request is refused
    std::lock_guard lk(jobs_mu_);
    std::erase_if(jobs_, [](const auto& kv) { return kv.second.expired(); });  // jobs that ended
    if (const auto it = jobs_.find(job->spec().id); it != jobs_.end())
      if (const auto other = it->second.lock(); other && !other->done())
        throw ApiError(400, fmt::format("the request id '{}' is in use by a running request", job->spec().id),
                       api == ApiKind::Native ? "rid" : "request_id", "invalid_value");
    jobs_[job->spec().id] = job;
  }
  if (pr.session) {  // recorded in the session as it runs (replace: the requests it drops abort)
    const std::vector<std::string> dropped = sessions_->add(*pr.session, job->spec().id,
                                                            job->spec().prompts[0].input_ids);
    if (!dropped.empty())
      abort_jobs([&](const std::string& id) { return std::find(dropped.begin(), dropped.end(), id) != dropped.end(); },
                 fmt::format("replaced in session '{}'", pr.session->id));
    job->on_end = [store = std::weak_ptr<SessionStore>(sessions_), sid = pr.session->id](const GenerationJob& j) {
      if (auto s = store.lock()) s->finish(sid, j.spec().id, j.choices()[0].output_ids);
    };
  }
  if (!end_rooms.ids.empty())
    job->on_end = [prev = std::move(job->on_end), end_rooms](const GenerationJob& j) {
      if (prev) prev(j);
      end_rooms();
    };
  try {
    job->start();  // throws (400) before anything was sent if the engine refuses the request
  } catch (...) {
    if (pr.session) sessions_->forget(pr.session->id, job->spec().id);  // it never ran
    throw;
  }
  rooms_guard.started = true;
  if (stream) {
    ex->start_stream();
    // The first chunks: chat opens every choice with the assistant role; completions echo the prompt.
    for (const auto& c : job->choices()) {
      ojson ch;
      ch["index"] = c.index;
      if (rc.api == ApiKind::Chat) {
        ch["delta"] = ojson{{"role", rc.role}, {"content", ""}};
        ch["logprobs"] = nullptr;
        if (rc.return_token_ids) {  // (vLLM's: the prompt's ids at the top of the choice's first chunk)
          ch["finish_reason"] = nullptr;
          ojson chunk = openai_chunk(rc, std::move(ch), *job);
          chunk["prompt_token_ids"] = job->spec().prompts[0].input_ids;
          ex->send_event(dump(chunk));
          continue;
        }
      } else if (rc.api == ApiKind::Completions && rc.echo && !rc.logprobs) {  // else with its logprobs, later
        ch["text"] = job->spec().prompts[c.prompt_index].text;
        ch["logprobs"] = nullptr;
      } else {
        continue;
      }
      ch["finish_reason"] = nullptr;
      ex->send_event(dump(openai_chunk(rc, std::move(ch), *job)));
    }
  }
}

}  // namespace mlaserve::server
