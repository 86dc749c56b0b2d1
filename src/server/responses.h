// OpenAI's Responses API (POST /v1/responses) over the chat machinery: the request is translated into a chat
// request (responses_to_chat), generated as chat is, and the chat answer translated back: a response object, or
// the Responses stream's typed events (ResponsesExchange, an HttpExchange in front of the connection's).
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>

#include "server/api.h"

namespace mlaserve::server {

// The chat request a Responses request asks for: instructions, the conversation so far (`prior`: the input items
// and outputs of the stored responses it continues, see ResponseStore) and its input items as messages (text,
// function calls and their outputs), max_output_tokens, tools (function tools), tool_choice, text.format as
// response_format, logprobs, streaming with usage, and the sampling fields chat takes. Throws ApiError (400 naming
// the field) for what it cannot express (other input or tool types, a conversation object).
// allow_empty: no message at all is not an error (counting input tokens of instructions alone).
nlohmann::ordered_json responses_to_chat(const nlohmann::ordered_json& body,
                                         const nlohmann::ordered_json& prior = nlohmann::ordered_json::array(),
                                         bool allow_empty = false);

// o[key] when it is a string, else a 400 naming `param`.key (the request objects' required string members).
std::string string_member(const nlohmann::ordered_json& o, const char* key, const std::string& param);

// The text of `content`: a string, or a list of text parts ({"type", "text"}) whose type is one of `types` (else a
// 400 naming `param`: other parts are not for this text-only model).
std::string text_content(const nlohmann::ordered_json& content, const std::string& param,
                         std::initializer_list<std::string_view> types);

// The request's input as the items GET /v1/responses/{id}/input_items lists: a string input as a user message, text
// content as parts, each item with an id (`<kind>_<rid>_in<k>` when it has none). Call after responses_to_chat
// accepted the body.
nlohmann::ordered_json responses_input_items(const nlohmann::ordered_json& body, const std::string& id);

// The response object of a request, without output or usage: its id, status and settings echoed.
nlohmann::ordered_json response_object(const nlohmann::ordered_json& request, const std::string& id,
                                       int64_t created, const std::string& model, const char* status);

// Writes the Responses form of the chat answer generated behind it: respond() turns a chat.completion into a
// response object (errors pass unchanged); a stream's chat chunks become response.created, output items with
// their deltas (reasoning, message text, function calls) and response.completed / response.incomplete.
class ResponsesExchange : public ForwardingExchange {
 public:
  // request: the Responses request (echoed in the response); model: the served model's name; finished: given the
  // finished response object (answered or streamed whole; not for errors), e.g. to store it.
  ResponsesExchange(std::shared_ptr<HttpExchange> inner, nlohmann::ordered_json request, std::string id,
                    int64_t created, std::string model,
                    std::function<void(const nlohmann::ordered_json&)> finished = nullptr);

  void respond(int status, const std::string& content_type, std::string body) override;
  void start_stream() override;
  void send_event(std::string payload) override;
  void end_stream() override;
  ~ResponsesExchange() override;

 private:
  struct Item;
  nlohmann::ordered_json base(const char* status) const;  // the response object without output and usage
  void emit(const char* type, nlohmann::ordered_json event);
  void open(const std::string& kind);  // closes the open item if it is of another kind, opens one of `kind`
  void close();                        // the open item's done events
  nlohmann::ordered_json finished_response();

  nlohmann::ordered_json request_;
  std::string id_;
  int64_t created_;
  std::string model_;
  std::function<void(const nlohmann::ordered_json&)> finished_;
  int64_t sequence_ = 0;
  nlohmann::ordered_json output_ = nlohmann::ordered_json::array();  // finished items
  std::unique_ptr<Item> open_;                                        // the item being streamed
  int items_ = 0;                                                     // output indices given out
  std::string finish_reason_;
  nlohmann::ordered_json usage_;
};

}  // namespace mlaserve::server
