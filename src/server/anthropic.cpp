#include "server/anthropic.h"

#include <fmt/format.h>

#include "server/api_error.h"
#include "server/protocol.h"
#include "server/responses.h"

namespace mlaserve::server {

// Ordered throughout: a tool's input_schema keeps its key order into the chat request (the order constrained output
// writes properties in).
using json = nlohmann::ordered_json;

namespace {

const json* member(const json& o, const char* key) {
  const auto it = o.find(key);
  return it == o.end() || it->is_null() ? nullptr : &*it;
}

// One message's content blocks appended to chat messages.
void add_message(const json& m, const std::string& p, json& messages) {
  if (!m.is_object()) bad_request(p, "invalid_type", "'{}' must be an object", p);
  const std::string role = string_member(m, "role", p);
  if (role != "user" && role != "assistant")
    bad_request(p + ".role", "invalid_value", "'{}.role' must be user or assistant, got '{}'", p, role);
  const json* content = member(m, "content");
  if (!content) bad_request(p + ".content", "invalid_value", "'{}.content' is required", p);
  if (content->is_string()) {
    messages.push_back({{"role", role}, {"content", *content}});
    return;
  }
  if (!content->is_array())
    bad_request(p + ".content", "invalid_type", "'{}.content' must be a string or a list of blocks", p);
  std::string text, thinking;
  json calls = json::array();
  for (size_t i = 0; i < content->size(); ++i) {
    const json& b = (*content)[i];
    const std::string bp = fmt::format("{}.content[{}]", p, i);
    if (!b.is_object()) bad_request(bp, "invalid_type", "'{}' must be a content block", bp);
    const std::string type = string_member(b, "type", bp);
    if (type == "text") {
      text += string_member(b, "text", bp);
    } else if (role == "user" && type == "tool_result") {  // a tool message each, in order, before the user's text
      const json* c = member(b, "content");
      messages.push_back({{"role", "tool"},
                          {"tool_call_id", string_member(b, "tool_use_id", bp)},
                          {"content", c ? text_content(*c, bp + ".content", {"text"}) : std::string()}});
    } else if (role == "assistant" && type == "thinking") {
      thinking += string_member(b, "thinking", bp);
    } else if (role == "assistant" && type == "redacted_thinking") {
      // (encrypted elsewhere: nothing to show the model)
    } else if (role == "assistant" && type == "tool_use") {
      const json* input = member(b, "input");
      if (input && !input->is_object()) bad_request(bp + ".input", "invalid_type", "'{}.input' must be an object", bp);
      calls.push_back({{"id", string_member(b, "id", bp)},
                       {"type", "function"},
                       {"function", {{"name", string_member(b, "name", bp)},
                                     {"arguments", input ? input->dump() : std::string("{}")}}}});
    } else {
      bad_request(bp + ".type", "unsupported_parameter", "'{}' blocks are not supported in {} messages here", type,
                  role);
    }
  }
  if (role == "user") {
    if (!text.empty() || content->empty() || messages.empty() || messages.back()["role"] != "tool")
      messages.push_back({{"role", "user"}, {"content", text}});
    return;
  }
  json msg = {{"role", "assistant"}, {"content", text.empty() && !calls.empty() ? json(nullptr) : json(text)}};
  if (!thinking.empty()) msg["reasoning_content"] = thinking;
  if (!calls.empty()) msg["tool_calls"] = std::move(calls);
  messages.push_back(std::move(msg));
}

// Anthropic's stop_reason and stop_sequence from chat's finish_reason and matched_stop.
std::pair<std::string, json> stop_reason(const std::string& finish, const json& matched) {
  if (finish == "length") return {"max_tokens", nullptr};
  if (finish == "tool_calls") return {"tool_use", nullptr};
  if (finish == "stop" && matched.is_string()) return {"stop_sequence", matched};
  return {"end_turn", nullptr};
}

json anthropic_usage(const json& u) {
  const int64_t prompt = u.is_object() ? u.value("prompt_tokens", int64_t{0}) : 0;
  int64_t cached = 0;
  if (const json* d = u.is_object() ? member(u, "prompt_tokens_details") : nullptr; d && d->is_object())
    cached = d->value("cached_tokens", int64_t{0});
  return json{{"input_tokens", prompt - cached},
              {"cache_creation_input_tokens", 0},
              {"cache_read_input_tokens", cached},
              {"output_tokens", u.is_object() ? u.value("completion_tokens", int64_t{0}) : 0}};
}

// A tool call's arguments as tool_use input: the JSON object they are (constrained output writes one), else {}.
json tool_input(const std::string& arguments) {
  json v = json::parse(arguments, nullptr, false);
  return v.is_object() ? v : json::object();
}

}  // namespace

json anthropic_to_chat(const json& body, bool counting) {
  if (!body.is_object()) bad_request("", "invalid_type", "the request body must be a JSON object");
  json chat = json::object();
  if (const json* m = member(body, "model")) chat["model"] = *m;
  json messages = json::array();
  if (const json* s = member(body, "system"))
    messages.push_back({{"role", "system"}, {"content", text_content(*s, "system", {"text"})}});
  const json* msgs = member(body, "messages");
  if (!msgs || !msgs->is_array() || msgs->empty())
    bad_request("messages", "invalid_value", "'messages' must be a non-empty list of messages");
  for (size_t i = 0; i < msgs->size(); ++i) add_message((*msgs)[i], fmt::format("messages[{}]", i), messages);
  chat["messages"] = std::move(messages);
  if (!counting) {
    const json* max = member(body, "max_tokens");
    if (!max) bad_request("max_tokens", "invalid_value", "'max_tokens' is required");
    chat["max_tokens"] = *max;
  }
  if (const json* stops = member(body, "stop_sequences")) chat["stop"] = *stops;
  for (const char* key : {"temperature", "top_p", "top_k"})
    if (const json* v = member(body, key)) chat[key] = *v;
  if (const json* tools = member(body, "tools")) {
    if (!tools->is_array()) bad_request("tools", "invalid_type", "'tools' must be a list of tools");
    json out = json::array();
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string tp = fmt::format("tools[{}]", i);
      if (!t.is_object()) bad_request(tp, "invalid_type", "'{}' must be a tool", tp);
      if (const json* type = member(t, "type"); type && *type != "custom")
        bad_request(tp + ".type", "unsupported_parameter", "'{}.type' {}: only custom tools (input_schema) run here",
                    tp, type->dump());
      json fn = {{"name", string_member(t, "name", tp)}};
      if (const json* d = member(t, "description")) fn["description"] = *d;
      const json* schema = member(t, "input_schema");
      if (!schema || !schema->is_object())
        bad_request(tp + ".input_schema", "invalid_value", "'{}.input_schema' (a JSON schema object) is required", tp);
      fn["parameters"] = *schema;
      out.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    chat["tools"] = std::move(out);
  }
  if (const json* tc = member(body, "tool_choice")) {
    if (!tc->is_object()) bad_request("tool_choice", "invalid_type", "'tool_choice' must be an object");
    const std::string type = string_member(*tc, "type", "tool_choice");
    if (type == "auto") chat["tool_choice"] = "auto";
    else if (type == "any") chat["tool_choice"] = "required";
    else if (type == "none") chat["tool_choice"] = "none";
    else if (type == "tool")
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", string_member(*tc, "name", "tool_choice")}}}};
    else bad_request("tool_choice.type", "invalid_value", "'tool_choice.type' must be auto, any, tool or none");
    if (const json* d = member(*tc, "disable_parallel_tool_use")) {
      if (!d->is_boolean()) bad_request("tool_choice.disable_parallel_tool_use", "invalid_type", "must be a boolean");
      chat["parallel_tool_calls"] = !d->get<bool>();
    }
  }
  if (const json* th = member(body, "thinking")) {
    if (!th->is_object()) bad_request("thinking", "invalid_type", "'thinking' must be an object");
    const std::string type = string_member(*th, "type", "thinking");
    if (type != "enabled" && type != "disabled")
      bad_request("thinking.type", "invalid_value", "'thinking.type' must be enabled or disabled");
    chat["chat_template_kwargs"] = {{"thinking", type == "enabled"}};  // (the hybrid DeepSeek-V3.1's switch)
    if (const json* budget = member(*th, "budget_tokens"); budget && type == "enabled")
      chat["thinking_budget"] = *budget;
  }
  if (const json* st = member(body, "stream")) {
    chat["stream"] = *st;
    if (st->is_boolean() && st->get<bool>()) chat["stream_options"] = {{"include_usage", true}};
  }
  return chat;
}

std::string anthropic_error_body(int status, const std::string& body) {
  const json e = json::parse(body, nullptr, false);
  std::string message = body;
  if (e.is_object())
    if (const json* err = member(e, "error"); err && err->is_object())
      if (const json* m = member(*err, "message"); m && m->is_string()) message = m->get<std::string>();
  const char* type = status == 401   ? "authentication_error"
                     : status == 403 ? "permission_error"
                     : status == 404 ? "not_found_error"
                     : status == 413 ? "request_too_large"
                     : status == 429 ? "rate_limit_error"
                     : status == 503 ? "overloaded_error"
                     : status >= 500 ? "api_error"
                                     : "invalid_request_error";
  return json{{"type", "error"}, {"error", {{"type", type}, {"message", message}}}}.dump();
}

AnthropicExchange::AnthropicExchange(std::shared_ptr<HttpExchange> inner, std::string id, std::string model)
    : ForwardingExchange(std::move(inner)), id_(std::move(id)), model_(std::move(model)) {}

void AnthropicExchange::respond(int status, const std::string& content_type, std::string body) {
  if (status != 200) return inner_->respond(status, "application/json", anthropic_error_body(status, body));
  const json chat = json::parse(body);
  const json& choice = chat["choices"][0];
  const json& msg = choice["message"];
  json content = json::array();
  if (const json* r = member(msg, "reasoning_content"); r && r->is_string() && !r->get<std::string>().empty())
    content.push_back({{"type", "thinking"}, {"thinking", *r}, {"signature", ""}});
  const json* calls = member(msg, "tool_calls");
  if (const json* c = member(msg, "content"); c && c->is_string() && (!c->get<std::string>().empty() || !calls))
    content.push_back({{"type", "text"}, {"text", *c}});
  if (calls)
    for (const json& call : *calls)
      content.push_back({{"type", "tool_use"},
                         {"id", call["id"]},
                         {"name", call["function"]["name"]},
                         {"input", tool_input(call["function"]["arguments"].get<std::string>())}});
  const json* finish = member(choice, "finish_reason");
  const json* matched = member(choice, "matched_stop");
  const auto [reason, sequence] = stop_reason(finish && finish->is_string() ? finish->get<std::string>() : "",
                                              matched ? *matched : json(nullptr));
  json m = {{"id", id_},           {"type", "message"},           {"role", "assistant"},
            {"model", model_},     {"content", std::move(content)}, {"stop_reason", reason},
            {"stop_sequence", sequence}, {"usage", anthropic_usage(chat["usage"])}};
  inner_->respond(200, content_type, m.dump());
}

void AnthropicExchange::emit(const char* type, json event) {
  json e = {{"type", type}};
  for (auto it = event.begin(); it != event.end(); ++it) e[it.key()] = std::move(it.value());
  inner_->send_named_event(type, e.dump());
}

void AnthropicExchange::start_stream() {
  inner_->start_stream();
  emit("message_start", {{"message",
                          {{"id", id_},
                           {"type", "message"},
                           {"role", "assistant"},
                           {"model", model_},
                           {"content", json::array()},
                           {"stop_reason", nullptr},
                           {"stop_sequence", nullptr},
                           {"usage", anthropic_usage(json::object())}}}});
}

void AnthropicExchange::open(const char* kind, json block) {
  close();
  open_kind_ = kind;
  emit("content_block_start", {{"index", blocks_}, {"content_block", std::move(block)}});
}

void AnthropicExchange::close() {
  if (open_kind_.empty()) return;
  if (open_kind_ == "thinking")  // (no signature: the thinking is not encrypted here)
    emit("content_block_delta", {{"index", blocks_}, {"delta", {{"type", "signature_delta"}, {"signature", ""}}}});
  emit("content_block_stop", {{"index", blocks_}});
  ++blocks_;
  open_kind_.clear();
}

void AnthropicExchange::send_event(std::string payload) {
  if (payload == "[DONE]") return;
  const json chunk = json::parse(payload);
  if (const json* u = member(chunk, "usage"); u && u->is_object()) usage_ = *u;
  const json* choices = member(chunk, "choices");
  if (!choices || !choices->is_array() || choices->empty()) return;
  const json& choice = (*choices)[0];
  const json delta = choice.value("delta", json::object());
  if (const json* r = member(delta, "reasoning_content"); r && r->is_string() && !r->get<std::string>().empty()) {
    if (open_kind_ != "thinking") open("thinking", {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}});
    emit("content_block_delta", {{"index", blocks_}, {"delta", {{"type", "thinking_delta"}, {"thinking", *r}}}});
  }
  if (const json* c = member(delta, "content"); c && c->is_string() && !c->get<std::string>().empty()) {
    if (open_kind_ != "text") open("text", {{"type", "text"}, {"text", ""}});
    emit("content_block_delta", {{"index", blocks_}, {"delta", {{"type", "text_delta"}, {"text", *c}}}});
  }
  if (const json* calls = member(delta, "tool_calls"); calls && calls->is_array())
    for (const json& call : *calls) {  // each arrives whole (chat streams a call at its end marker)
      open("tool_use", {{"type", "tool_use"}, {"id", call["id"]}, {"name", call["function"]["name"]},
                        {"input", json::object()}});
      emit("content_block_delta",
           {{"index", blocks_},
            {"delta", {{"type", "input_json_delta"}, {"partial_json", call["function"]["arguments"]}}}});
      close();
    }
  if (const json* f = member(choice, "finish_reason"); f && f->is_string()) {
    finish_reason_ = f->get<std::string>();
    if (const json* m = member(choice, "matched_stop")) matched_stop_ = *m;
  }
}

void AnthropicExchange::end_stream() {
  close();
  const auto [reason, sequence] = stop_reason(finish_reason_, matched_stop_);
  const json usage = anthropic_usage(usage_);
  emit("message_delta", {{"delta", {{"stop_reason", reason}, {"stop_sequence", sequence}}},
                         {"usage", {{"input_tokens", usage["input_tokens"]},
                                    {"cache_read_input_tokens", usage["cache_read_input_tokens"]},
                                    {"output_tokens", usage["output_tokens"]}}}});
  emit("message_stop", json::object());
  inner_->end_stream();
}

}  // namespace mlaserve::server
