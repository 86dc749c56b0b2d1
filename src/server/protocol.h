// The three generation APIs (native /generate, OpenAI completions, OpenAI chat) parsed into one request shape,
// with every field validated (ApiError with the field's name on a bad value). No engine calls here.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine_api.h"
#include "server/kv_transfer.h"
#include "server/tool_calls.h"
#include "server/sessions.h"

namespace mlaserve::structured {
struct Nfa;
}

namespace mlaserve::server {

enum class ApiKind { Native, Completions, Chat };

// A prompt as given: text (tokenized later) or token ids.
struct PromptInput {
  std::optional<std::string> text;
  std::vector<int32_t> input_ids;
};

// Typed, validated access to the fields of one JSON object: each reader gives nullopt when the field is absent or
// null (JSON null means "default" in these APIs) and an ApiError 400 naming it ("sampling_params.top_p": `prefix`
// and the key) when it has the wrong type or range.
class Fields {
 public:
  Fields(const nlohmann::json& obj, std::string prefix = {}) : obj_(obj), prefix_(std::move(prefix)) {}
  Fields(nlohmann::json&&, std::string = {}) = delete;  // (it keeps a reference)

  std::string param(const std::string& key) const { return prefix_ + key; }
  const nlohmann::json* get(const std::string& key) const;  // nullptr when absent or null
  bool has(const std::string& key) const { return get(key) != nullptr; }
  // The field (400 "'key' (what) is required" when absent or null).
  const nlohmann::json& required(const std::string& key, std::string_view what) const;
  std::string required_string(const std::string& key, std::string_view what) const;  // required and a string
  std::optional<double> number(const std::string& key, double lo, double hi, bool lo_open = false) const;
  std::optional<int64_t> integer(const std::string& key, int64_t lo, int64_t hi) const;
  // An integer value (a float with an integral value too) in [lo, hi]; `p` names it in errors.
  static int64_t as_integer(const nlohmann::json& v, const std::string& p, int64_t lo, int64_t hi);
  std::optional<bool> boolean(const std::string& key) const;
  std::optional<std::string> string(const std::string& key) const;
  // Fields this server does not implement: present and not the neutral value -> 400 saying so.
  void reject_unsupported(const std::string& key, const char* why) const;
  // A 400 naming the first key not among `known` (`what`: what the object is, for the message).
  void allow_only(std::initializer_list<std::string_view> known, std::string_view what) const;

 private:
  const nlohmann::json& obj_;
  std::string prefix_;
};

struct ParsedRequest {
  ApiKind api = ApiKind::Native;
  // Completions `suffix`: fill in the middle (the prompt is the text before the hole, this the text after it).
  std::optional<std::string> suffix;
  std::vector<PromptInput> prompts;  // one entry unless a batch
  bool batch = false;                // the input was a list: the native response is a list too
  SamplingParams sampling;           // engine-level sampling (max_new_tokens may be filled in later)
  bool max_new_tokens_given = false;
  std::vector<std::string> stop;     // stop strings (text level)
  std::vector<std::string> stop_regex;  // SGLang's stop_regex (compiled by the server; stop_regex_param names it)
  std::string stop_regex_param;
  std::vector<std::string> bad_words;  // vLLM's: words never generated (tokenized into sampling.bad_words_ids)
  std::string thinking_budget_param;   // the field sampling.thinking_budget came from (errors name it)
  bool skip_special_tokens = true;
  bool no_stop_trim = false;         // keep the matched stop string in the output (native only)
  int32_t n = 1;
  int32_t priority = 0;              // vLLM's / SGLang's request priority (its meaning per the server's flags)
  bool stream = false;
  std::string rid;                   // client-chosen id (native) or empty
  std::optional<SessionParams> session;  // SGLang's session_params (native; with a session id)
  std::string cache_salt;  // vLLM's cache_salt / SGLang's extra_key, combined (GenerateRequest::cache_salt)
  std::vector<std::string> prompt_salts;  // SGLang's extra_key as a list: each prompt's salt (empty: cache_salt's)
  std::optional<KvTransferParams> kv_transfer;  // vLLM's kv_transfer_params (OpenAI): prefill / decode disaggregation
  // logprobs: native return_logprob/top_logprobs_num; completions `logprobs: k`; chat `logprobs` + `top_logprobs`.
  bool logprobs = false;
  int32_t top_logprobs = 0;
  bool return_text_in_logprobs = false;
  // SGLang's token_ids_logprob (with return_logprob): one list for every prompt, or one per prompt; empty: none.
  std::vector<std::vector<int32_t>> token_ids_logprob;
  // SGLang's return_hidden_states: one value for every prompt, or one per prompt of a batch; empty: none.
  std::vector<bool> return_hidden_states;
  std::vector<bool> return_routed_experts;  // SGLang's return_routed_experts, the same way
  // OpenAI only.
  std::string model;
  bool echo = false;
  std::optional<bool> add_special_tokens;  // vLLM's: the tokenizer's BOS on text prompts (completions: true, chat: false)
  int32_t truncate_prompt_tokens = 0;      // vLLM's: keep the prompt's last that many tokens (-1: the context's; 0: all)
  int32_t prompt_logprobs = -1;      // vLLM's prompt_logprobs (>= 0: the prompt's logprobs with that many alternatives)
  bool tokens_as_ids = false;        // vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:ID"
  bool return_token_ids = false;     // vLLM's: OpenAI answers carry prompt_token_ids and token_ids
  std::string request_id;            // vLLM's request_id (OpenAI): the response id is "chatcmpl-" / "cmpl-" and it
  bool include_reasoning = true;     // vLLM's (chat): false drops the reasoning a reasoning parser split off
  bool stream_reasoning = true;      // SGLang's (chat): false streams the reasoning in one piece as it ends
  bool include_usage = false;
  bool continuous_usage = false;     // stream_options.continuous_usage_stats: usage in every chunk
  nlohmann::json messages;           // chat
  nlohmann::json chat_template_kwargs = nlohmann::json::object();  // chat: more variables for the template
  // chat: vLLM's chat_template (or chat_template_kwargs.chat_template), a Jinja template to render this request with
  // in place of the model's; taken with --trust-request-chat-template only.
  std::optional<std::string> chat_template;
  bool add_generation_prompt = true;    // chat: the template's opening of the assistant's turn
  bool continue_final_message = false;  // chat: the final (assistant) message left open, continued by the model
  bool separate_reasoning = true;    // chat with --reasoning-parser: reasoning_content apart from content
  nlohmann::json tools;              // chat: the function tools (an array, or null when none)
  bool tool_choice_none = false;     // tool_choice "none": the tools are neither shown to the model nor parsed
  bool parallel_tool_calls = true;   // false: only the first call is returned
  // Structured output (regex, json_schema, response_format): the regex the generated text must match, and the
  // field it came from; empty: none.
  std::string constraint_regex;
  std::string constraint_param;
  // A regex the client wrote (or a grammar's), compiled while checking it, so the server's automaton need not compile
  // it again; null for the regexes the server makes (schemas, tool calls), compiled where the automaton is built.
  std::shared_ptr<const structured::Nfa> constraint_nfa;
  bool forced_tool_calls = false;    // tool_choice required or named: the constraint is DeepSeek's tool calls
};

// Sampling defaults of a request that leaves them out (the model's generation_config.json, as vLLM's
// --generation-config auto and SGLang's --sampling-defaults model apply them); unset: the API's own.
struct SamplingDefaults {
  std::optional<float> temperature, top_p, min_p, repetition_penalty;
  std::optional<int32_t> top_k;
  // generation_config.json's max_new_tokens: as vLLM reads it, the most tokens an OpenAI request generates (a
  // request's own max_tokens above it, or none, is lowered to it).
  std::optional<int32_t> max_tokens;
  bool empty() const { return !temperature && !top_p && !min_p && !repetition_penalty && !top_k && !max_tokens; }
};

struct ParseOptions {
  int32_t max_n = 64;
  SamplingDefaults defaults;
  int32_t max_top_logprobs = 20;
  // vLLM's --return-tokens-as-token-ids: OpenAI logprobs name tokens "token_id:ID" unless a request says otherwise.
  bool return_tokens_as_token_ids = false;
  int32_t max_stop_strings = 32;
  int32_t max_bad_words = 256;
  int32_t max_token_ids_logprob = 1024;
  size_t max_batch = 4096;
  // tool_choice's forced calls in this form (--tool-call-parser): V3 / R1's (function<｜tool▁sep｜>NAME and a
  // ```json fence), V3.1's (NAME<｜tool▁sep｜>ARGS) or Kimi-K2's (functions.NAME:IDX<|tool_call_argument_begin|>ARGS).
  ToolFormat tool_format = ToolFormat::DeepseekV3;
  // vLLM's --default-chat-template-kwargs: chat template variables every chat request has unless it sets them itself.
  nlohmann::json default_chat_template_kwargs = nlohmann::json::object();
};

// Throws ApiError (400) naming the offending field.
// raw: the body's text, when there (a JSON schema object's properties then keep the request's order).
ParsedRequest parse_native(const nlohmann::json& body, const ParseOptions& opts, std::string_view raw = {});
ParsedRequest parse_completions(const nlohmann::json& body, const ParseOptions& opts, std::string_view raw = {});
ParsedRequest parse_chat(const nlohmann::json& body, const ParseOptions& opts, std::string_view raw = {});

// A list of token ids in [0, 2^31) (ApiError 400 naming `param`, or `param`[i] for a bad element); empty allowed
// with allow_empty.
std::vector<int32_t> token_id_list(const nlohmann::json& v, const std::string& param, bool allow_empty);

// The body as JSON, or ApiError 400 (invalid_json) / 400 when it is not an object or nests more than kMaxBodyDepth
// levels.
constexpr int kMaxBodyDepth = 64;
nlohmann::json parse_body(const std::string& body);
// The same with the keys in the request's order (what is translated into another request keeps it).
nlohmann::ordered_json parse_body_ordered(const std::string& body);
// "null", "boolean", "string", "array", "object", "number" or "integer", as request errors name JSON types.
const char* json_type_name(nlohmann::json::value_t t);

// Native `finish_reason` ({"type": "length", "length": N} / {"type": "stop", "matched": ...} / abort) and the
// OpenAI string ("length" / "stop" / "abort"); null JSON while not finished.
nlohmann::ordered_json native_finish_reason(const FinishReason& f, int32_t completion_tokens);
nlohmann::ordered_json openai_finish_reason(const FinishReason& f);

}  // namespace mlaserve::server
