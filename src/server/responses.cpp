#include "server/responses.h"

#include <algorithm>

#include <fmt/format.h>

#include "server/api_error.h"
#include "server/protocol.h"

namespace mlaserve::server {

// Ordered throughout: a request's keys keep their order into the chat request (a JSON schema's properties, the
// order constrained output writes them in) and back into the response.
using json = nlohmann::ordered_json;
using ojson = nlohmann::ordered_json;

std::string string_member(const json& o, const char* key, const std::string& param) {
  const auto it = o.find(key);
  if (it == o.end() || !it->is_string())
    bad_request(param + "." + key, "invalid_value", "'{}.{}' must be a string", param, key);
  return it->get<std::string>();
}

std::string text_content(const json& content, const std::string& param,
                         std::initializer_list<std::string_view> types) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    bad_request(param, "invalid_type", "'{}' must be a string or an array of text parts, got {}", param,
                json_type_name(content.type()));
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string p = fmt::format("{}[{}]", param, i);
    const auto type = part.is_object() ? part.find("type") : part.end();
    if (!part.is_object() || type == part.end() || !type->is_string())
      bad_request(p, "invalid_value", "'{}' must be a part {{\"type\": \"{}\", \"text\": ...}}", p, *types.begin());
    const std::string& t = type->get_ref<const std::string&>();
    if (std::find(types.begin(), types.end(), t) == types.end())
      bad_request(p + ".type", "unsupported_parameter", "'{}.type' {} is not supported (text-only model)", p, t);
    const auto txt = part.find("text");
    if (txt == part.end() || !txt->is_string())
      bad_request(p + ".text", "invalid_value", "'{}.text' must be a string", p);
    text += txt->get<std::string>();
  }
  return text;
}

json responses_to_chat(const json& body, const json& prior, bool allow_empty) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object", "", "invalid_value");
  if (body.contains("conversation") && !body["conversation"].is_null())
    bad_request("conversation", "unsupported_parameter",
                "'conversation' is not supported (no Conversations API): continue a stored response with "
                "'previous_response_id', or send the whole conversation as 'input'");
  json chat = json::object();
  json messages = json::array();
  if (const auto it = body.find("instructions"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) bad_request("instructions", "invalid_type", "'instructions' must be a string");
    messages.push_back({{"role", "system"}, {"content", *it}});
  }
  // One input item as messages; p names it in errors.
  auto add_item = [&](const json& item, const std::string& p) {
    if (!item.is_object())
      bad_request(p, "invalid_type", "'{}' must be an object, got {}", p, json_type_name(item.type()));
    const auto type_it = item.find("type");
    if (type_it != item.end() && !type_it->is_string())
      bad_request(p + ".type", "invalid_type", "'{}.type' must be a string", p);
    const std::string type = type_it == item.end() ? "message" : type_it->get<std::string>();
    if (type == "message") {
      const std::string role = string_member(item, "role", p);
      if (role != "user" && role != "system" && role != "developer" && role != "assistant")
        bad_request(p + ".role", "invalid_value", "'{}.role' must be user, system, developer or assistant", p);
      const auto content = item.find("content");
      if (content == item.end()) bad_request(p + ".content", "invalid_value", "'{}.content' is required", p);
      messages.push_back(
          {{"role", role}, {"content", text_content(*content, p + ".content", {"input_text", "output_text", "text"})}});
    } else if (type == "function_call") {
      json call = {{"id", string_member(item, "call_id", p)},
                   {"type", "function"},
                   {"function", {{"name", string_member(item, "name", p)},
                                 {"arguments", string_member(item, "arguments", p)}}}};
      // Calls in a row are one assistant turn.
      if (!messages.empty() && messages.back()["role"] == "assistant" && messages.back().contains("tool_calls")) {
        messages.back()["tool_calls"].push_back(std::move(call));
      } else {
        messages.push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array({call})}});
      }
    } else if (type == "function_call_output") {
      const auto out = item.find("output");
      if (out == item.end()) bad_request(p + ".output", "invalid_value", "'{}.output' is required", p);
      messages.push_back({{"role", "tool"},
                          {"tool_call_id", string_member(item, "call_id", p)},
                          {"content", text_content(*out, p + ".output", {"input_text", "output_text", "text"})}});
    } else if (type == "reasoning") {
      // earlier reasoning is not shown to the model again (as chat templates drop it)
    } else {
      bad_request(p + ".type", "unsupported_parameter", "input items of type '{}' are not supported", type);
    }
  };
  for (size_t i = 0; i < prior.size(); ++i) add_item(prior[i], fmt::format("previous_response_id item {}", i));
  const auto input = body.find("input");
  if (input == body.end() || input->is_null()) bad_request("input", "invalid_value", "'input' is required");
  if (input->is_string()) {
    messages.push_back({{"role", "user"}, {"content", *input}});
  } else if (input->is_array()) {
    for (size_t i = 0; i < input->size(); ++i) add_item((*input)[i], fmt::format("input[{}]", i));
  } else {
    bad_request("input", "invalid_type", "'input' must be a string or an array of items, got {}",
                json_type_name(input->type()));
  }
  if (messages.empty() && !allow_empty) bad_request("input", "invalid_value", "'input' holds no message");
  chat["messages"] = std::move(messages);
  if (const auto it = body.find("model"); it != body.end()) chat["model"] = *it;
  if (const auto it = body.find("max_output_tokens"); it != body.end() && !it->is_null()) chat["max_tokens"] = *it;
  // Sampling fields chat takes under the same names (vLLM's extensions among them).
  for (const char* key : {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                          "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "min_tokens",
                          "allowed_token_ids", "bad_words", "priority", "parallel_tool_calls",
                          "chat_template_kwargs", "cache_salt"})
    if (const auto it = body.find(key); it != body.end() && !it->is_null()) chat[key] = *it;
  if (const auto it = body.find("top_logprobs"); it != body.end() && !it->is_null()) {
    chat["logprobs"] = true;
    chat["top_logprobs"] = *it;
  }
  if (const auto it = body.find("tools"); it != body.end() && !it->is_null()) {
    if (!it->is_array()) bad_request("tools", "invalid_type", "'tools' must be an array of tools");
    json tools = json::array();
    for (size_t i = 0; i < it->size(); ++i) {
      const json& t = (*it)[i];
      const std::string p = fmt::format("tools[{}]", i);
      if (!t.is_object() || !t.contains("type") || t["type"] != "function")
        bad_request(p + ".type", "unsupported_parameter", "'{}': only function tools are supported", p);
      json fn = {{"name", string_member(t, "name", p)}};
      for (const char* key : {"description", "parameters", "strict"})
        if (const auto f = t.find(key); f != t.end() && !f->is_null()) fn[key] = *f;
      tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    if (!tools.empty()) chat["tools"] = std::move(tools);
  }
  if (const auto it = body.find("tool_choice"); it != body.end() && !it->is_null()) {
    if (it->is_object() && it->contains("type") && (*it)["type"] == "function" && it->contains("name")) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", (*it)["name"]}}}};
    } else {
      chat["tool_choice"] = *it;  // "none" / "auto" / "required", checked as chat checks them
    }
  }
  if (const auto text = body.find("text"); text != body.end() && text->is_object()) {
    if (const auto f = text->find("format"); f != text->end() && f->is_object()) {
      const std::string type = string_member(*f, "type", "text.format");
      if (type == "json_object") {
        chat["response_format"] = {{"type", "json_object"}};
      } else if (type == "json_schema") {
        const auto name = f->find("name");
        json js = {{"name", name != f->end() && name->is_string() ? *name : json("response")}};
        if (!f->contains("schema"))
          bad_request("text.format.schema", "invalid_value", "'text.format.schema' is required");
        js["schema"] = (*f)["schema"];
        if (f->contains("strict")) js["strict"] = (*f)["strict"];
        chat["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(js)}};
      } else if (type != "text") {
        bad_request("text.format.type", "invalid_value", "'text.format.type' must be text, json_object or json_schema");
      }
    }
  }
  const auto stream = body.find("stream");
  if (stream != body.end() && !stream->is_null() && !stream->is_boolean())
    bad_request("stream", "invalid_type", "'stream' must be true or false");
  if (stream != body.end() && *stream == true) {
    chat["stream"] = true;
    chat["stream_options"] = {{"include_usage", true}};
  }
  return chat;
}

struct ResponsesExchange::Item {
  std::string kind;  // "reasoning", "message", "function_call"
  std::string id;
  int index = 0;
  std::string text;  // reasoning or message text, or the call's arguments
  std::string call_id, name;
  ojson logprobs = ojson::array();
};

ResponsesExchange::ResponsesExchange(std::shared_ptr<HttpExchange> inner, json request, std::string id,
                                     int64_t created, std::string model,
                                     std::function<void(const ojson&)> finished)
    : ForwardingExchange(std::move(inner)), request_(std::move(request)), id_(std::move(id)), created_(created),
      model_(std::move(model)), finished_(std::move(finished)) {}

ResponsesExchange::~ResponsesExchange() = default;

ojson response_object(const json& request, const std::string& id, int64_t created, const std::string& model,
                      const char* status) {
  ojson r;
  r["id"] = id;
  r["object"] = "response";
  r["created_at"] = created;
  r["status"] = status;
  r["error"] = nullptr;
  r["incomplete_details"] = nullptr;
  auto echo = [&](const char* key, ojson dflt) {
    const auto it = request.find(key);
    r[key] = it == request.end() || it->is_null() ? std::move(dflt) : *it;
  };
  echo("background", false);
  echo("instructions", nullptr);
  echo("max_output_tokens", nullptr);
  r["model"] = model;
  r["output"] = ojson::array();
  echo("parallel_tool_calls", true);
  echo("previous_response_id", nullptr);
  echo("reasoning", ojson{{"effort", nullptr}, {"summary", nullptr}});
  echo("store", true);
  echo("temperature", 1.0);
  echo("text", ojson{{"format", {{"type", "text"}}}});
  echo("tool_choice", "auto");
  echo("tools", ojson::array());
  echo("top_p", 1.0);
  r["truncation"] = "disabled";
  r["usage"] = nullptr;
  echo("user", nullptr);
  echo("metadata", ojson::object());
  return r;
}

ojson responses_input_items(const json& body, const std::string& id) {
  const std::string rid = id.substr(id.find('_') + 1);
  ojson items = ojson::array();
  const json& input = body.at("input");
  auto text_parts = [](const std::string& role, const json& text) {
    return ojson::array({ojson{{"type", role == "assistant" ? "output_text" : "input_text"}, {"text", text}}});
  };
  if (input.is_string()) {
    items.push_back(ojson{{"id", fmt::format("msg_{}_in0", rid)},
                          {"type", "message"},
                          {"role", "user"},
                          {"content", text_parts("user", input)}});
    return items;
  }
  for (size_t k = 0; k < input.size(); ++k) {
    ojson item = input[k];
    if (!item.contains("type")) item["type"] = "message";
    const std::string type = item["type"].get<std::string>();
    if (type == "message" && item["content"].is_string())
      item["content"] = text_parts(item["role"].get<std::string>(), item["content"]);
    if (!item.contains("id") || !item["id"].is_string()) {
      const char* prefix = type == "message"         ? "msg"
                           : type == "function_call" ? "fc"
                           : type == "reasoning"     ? "rs"
                                                     : "fco";
      ojson with_id = {{"id", fmt::format("{}_{}_in{}", prefix, rid, k)}};
      for (auto it = item.begin(); it != item.end(); ++it)
        if (it.key() != "id") with_id[it.key()] = it.value();
      item = std::move(with_id);
    }
    items.push_back(std::move(item));
  }
  return items;
}

ojson ResponsesExchange::base(const char* status) const {
  return response_object(request_, id_, created_, model_, status);
}

namespace {

// Responses' usage from chat's.
ojson responses_usage(const json& u) {
  ojson r;
  const int64_t in = u.value("prompt_tokens", int64_t{0}), out = u.value("completion_tokens", int64_t{0});
  r["input_tokens"] = in;
  int64_t cached = 0;
  if (const auto d = u.find("prompt_tokens_details"); d != u.end() && d->is_object())
    cached = d->value("cached_tokens", int64_t{0});
  r["input_tokens_details"] = {{"cached_tokens", cached}};
  r["output_tokens"] = out;
  r["output_tokens_details"] = {{"reasoning_tokens", 0}};
  r["total_tokens"] = in + out;
  return r;
}

ojson reasoning_item(const std::string& id, const std::string& text, const char* status) {
  return ojson{{"id", id},
               {"type", "reasoning"},
               {"summary", ojson::array()},
               {"content", ojson::array({ojson{{"type", "reasoning_text"}, {"text", text}}})},
               {"status", status}};
}

ojson text_part(const std::string& text, const ojson& logprobs) {
  return ojson{{"type", "output_text"}, {"text", text}, {"annotations", ojson::array()}, {"logprobs", logprobs}};
}

ojson message_item(const std::string& id, const ojson& content, const char* status) {
  return ojson{{"id", id}, {"type", "message"}, {"status", status}, {"role", "assistant"}, {"content", content}};
}

ojson call_item(const std::string& id, const std::string& call_id, const std::string& name, const std::string& args,
                const char* status) {
  return ojson{{"id", id},           {"type", "function_call"}, {"status", status},
               {"call_id", call_id}, {"name", name},            {"arguments", args}};
}

bool nonempty_string(const json& v) { return v.is_string() && !v.get_ref<const std::string&>().empty(); }

// A response's status and incomplete_details from chat's finish reason.
void set_status(ojson& r, const std::string& finish_reason) {
  if (finish_reason == "length") {
    r["status"] = "incomplete";
    r["incomplete_details"] = {{"reason", "max_output_tokens"}};
  } else if (finish_reason == "abort") {  // /abort_request, a timeout or the server stopping
    r["status"] = "cancelled";
  } else {
    r["status"] = "completed";
  }
}

}  // namespace

void ResponsesExchange::respond(int status, const std::string& content_type, std::string body) {
  if (status != 200) return inner_->respond(status, content_type, std::move(body));
  const json chat = json::parse(body);
  const json& choice = chat["choices"][0];
  const json& msg = choice["message"];
  ojson r = base("completed");
  const std::string rid = id_.substr(id_.find('_') + 1);
  auto next_id = [&](const char* prefix) { return fmt::format("{}_{}_{}", prefix, rid, r["output"].size()); };
  if (const auto rc = msg.find("reasoning_content"); rc != msg.end() && nonempty_string(*rc))
    r["output"].push_back(reasoning_item(next_id("rs"), rc->get<std::string>(), "completed"));
  const auto calls = msg.find("tool_calls");
  const bool has_calls = calls != msg.end() && calls->is_array() && !calls->empty();
  const auto content = msg.find("content");
  if (content != msg.end() && content->is_string() && (nonempty_string(*content) || !has_calls)) {
    ojson lps = ojson::array();
    if (const auto lp = choice.find("logprobs"); lp != choice.end() && lp->is_object() && lp->contains("content"))
      lps = (*lp)["content"];
    r["output"].push_back(
        message_item(next_id("msg"), ojson::array({text_part(content->get<std::string>(), lps)}), "completed"));
  }
  if (has_calls)
    for (size_t k = 0; k < calls->size(); ++k) {
      const json& c = (*calls)[k];
      r["output"].push_back(call_item(next_id("fc"), c["id"].get<std::string>(),
                                      c["function"]["name"].get<std::string>(),
                                      c["function"]["arguments"].get<std::string>(), "completed"));
    }
  const auto finish = choice.find("finish_reason");
  set_status(r, finish != choice.end() && finish->is_string() ? finish->get<std::string>() : std::string());
  r["usage"] = responses_usage(chat["usage"]);
  if (finished_) finished_(r);
  inner_->respond(200, content_type, r.dump());
}

void ResponsesExchange::emit(const char* type, ojson event) {
  ojson e;
  e["type"] = type;
  e["sequence_number"] = sequence_++;
  for (auto it = event.begin(); it != event.end(); ++it) e[it.key()] = std::move(it.value());
  inner_->send_named_event(type, e.dump());
}

void ResponsesExchange::start_stream() {
  inner_->start_stream();
  // A background response is created queued (as OpenAI's: response.created and response.queued with status "queued"),
  // then in progress.
  const auto bg = request_.find("background");
  if (bg != request_.end() && bg->is_boolean() && bg->get<bool>()) {
    emit("response.created", ojson{{"response", base("queued")}});
    emit("response.queued", ojson{{"response", base("queued")}});
  } else {
    emit("response.created", ojson{{"response", base("in_progress")}});
  }
  emit("response.in_progress", ojson{{"response", base("in_progress")}});
}

void ResponsesExchange::open(const std::string& kind) {
  if (open_ && open_->kind == kind && kind != "function_call") return;
  close();
  open_ = std::make_unique<Item>();
  open_->kind = kind;
  open_->index = items_++;
  const std::string rid = id_.substr(id_.find('_') + 1);
  const char* prefix = kind == "reasoning" ? "rs" : kind == "message" ? "msg" : "fc";
  open_->id = fmt::format("{}_{}_{}", prefix, rid, open_->index);
  if (kind == "reasoning") {
    ojson item = reasoning_item(open_->id, "", "in_progress");
    item["content"] = ojson::array();
    emit("response.output_item.added", ojson{{"output_index", open_->index}, {"item", item}});
  } else if (kind == "message") {
    emit("response.output_item.added",
         ojson{{"output_index", open_->index}, {"item", message_item(open_->id, ojson::array(), "in_progress")}});
    emit("response.content_part.added", ojson{{"item_id", open_->id},
                                              {"output_index", open_->index},
                                              {"content_index", 0},
                                              {"part", text_part("", ojson::array())}});
  }
}

void ResponsesExchange::close() {
  if (!open_) return;
  const Item& it = *open_;
  ojson item;
  if (it.kind == "reasoning") {
    emit("response.reasoning_text.done",
         ojson{{"item_id", it.id}, {"output_index", it.index}, {"content_index", 0}, {"text", it.text}});
    item = reasoning_item(it.id, it.text, "completed");
  } else if (it.kind == "message") {
    emit("response.output_text.done", ojson{{"item_id", it.id},
                                            {"output_index", it.index},
                                            {"content_index", 0},
                                            {"text", it.text},
                                            {"logprobs", it.logprobs}});
    const ojson part = text_part(it.text, it.logprobs);
    emit("response.content_part.done",
         ojson{{"item_id", it.id}, {"output_index", it.index}, {"content_index", 0}, {"part", part}});
    item = message_item(it.id, ojson::array({part}), "completed");
  } else {
    emit("response.function_call_arguments.done",
         ojson{{"item_id", it.id}, {"output_index", it.index}, {"name", it.name}, {"arguments", it.text}});
    item = call_item(it.id, it.call_id, it.name, it.text, "completed");
  }
  emit("response.output_item.done", ojson{{"output_index", it.index}, {"item", item}});
  output_.push_back(std::move(item));
  open_.reset();
}

void ResponsesExchange::send_event(std::string payload) {
  if (payload == "[DONE]") return;
  const json chunk = json::parse(payload);
  if (const auto u = chunk.find("usage"); u != chunk.end() && u->is_object()) usage_ = responses_usage(*u);
  const auto choices = chunk.find("choices");
  if (choices == chunk.end() || !choices->is_array() || choices->empty()) return;
  const json& choice = (*choices)[0];
  const json delta = choice.value("delta", json::object());
  if (const auto r = delta.find("reasoning_content"); r != delta.end() && nonempty_string(*r)) {
    open("reasoning");
    open_->text += r->get<std::string>();
    emit("response.reasoning_text.delta",
         ojson{{"item_id", open_->id}, {"output_index", open_->index}, {"content_index", 0}, {"delta", *r}});
  }
  if (const auto c = delta.find("content"); c != delta.end() && nonempty_string(*c)) {
    open("message");
    open_->text += c->get<std::string>();
    ojson lps = ojson::array();
    if (const auto lp = choice.find("logprobs"); lp != choice.end() && lp->is_object() && lp->contains("content"))
      lps = (*lp)["content"];
    for (const auto& e : lps) open_->logprobs.push_back(e);
    emit("response.output_text.delta", ojson{{"item_id", open_->id},
                                             {"output_index", open_->index},
                                             {"content_index", 0},
                                             {"delta", *c},
                                             {"logprobs", lps}});
  }
  if (const auto calls = delta.find("tool_calls"); calls != delta.end() && calls->is_array()) {
    for (const json& call : *calls) {  // each call arrives whole (chat streams it at its end marker)
      open("function_call");
      open_->call_id = call.value("id", std::string());
      open_->name = call["function"].value("name", std::string());
      open_->text = call["function"].value("arguments", std::string());
      emit("response.output_item.added",
           ojson{{"output_index", open_->index},
                 {"item", call_item(open_->id, open_->call_id, open_->name, "", "in_progress")}});
      emit("response.function_call_arguments.delta",
           ojson{{"item_id", open_->id}, {"output_index", open_->index}, {"delta", open_->text}});
      close();
    }
  }
  if (const auto f = choice.find("finish_reason"); f != choice.end() && f->is_string())
    finish_reason_ = f->get<std::string>();
}

ojson ResponsesExchange::finished_response() {
  close();
  if (output_.empty()) {  // nothing generated: an empty message, as the non-streamed response has
    open("message");
    close();
  }
  ojson r = base("completed");
  r["output"] = output_;
  set_status(r, finish_reason_);
  r["usage"] = usage_.is_null() ? ojson(nullptr) : usage_;
  return r;
}

void ResponsesExchange::end_stream() {
  ojson r = finished_response();
  if (finished_) finished_(r);
  const bool incomplete = r["status"] != "completed";  // the stream's last event for incomplete or cancelled
  emit(incomplete ? "response.incomplete" : "response.completed", ojson{{"response", std::move(r)}});
  inner_->end_stream();
}

}  // namespace mlaserve::server
