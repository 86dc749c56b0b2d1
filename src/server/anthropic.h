// Anthropic's Messages API (POST /v1/messages, as vLLM serves it) over the chat machinery: the request is translated
// into a chat request (anthropic_to_chat), generated as chat is, and the chat answer translated back: a message
// object, or the Messages stream's events (AnthropicExchange, an HttpExchange in front of the connection's).
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "server/api.h"

namespace mlaserve::server {

// The chat request a Messages request asks for: system, messages (text, thinking, tool_use and tool_result blocks),
// max_tokens (required unless counting), stop_sequences, temperature / top_p / top_k, tools (custom tools'
// input_schema as function parameters), tool_choice, thinking (the chat template's `thinking` and a thinking budget),
// stream (with usage). Throws ApiError (400 naming the field) for what it cannot express (images, server tools).
nlohmann::ordered_json anthropic_to_chat(const nlohmann::ordered_json& body, bool counting = false);

// Anthropic's error body ({"type": "error", "error": {"type", "message"}}) for an error answer of this server's
// OpenAI form (`body`) with HTTP status `status`.
std::string anthropic_error_body(int status, const std::string& body);

// Writes the Messages form of the chat answer generated behind it: respond() turns a chat.completion into a message
// object (errors into Anthropic's error body); a stream's chat chunks become message_start, content blocks (thinking,
// text, tool_use) with their deltas, message_delta (stop reason, usage) and message_stop.
class AnthropicExchange : public ForwardingExchange {
 public:
  AnthropicExchange(std::shared_ptr<HttpExchange> inner, std::string id, std::string model);

  void respond(int status, const std::string& content_type, std::string body) override;
  void start_stream() override;
  void send_event(std::string payload) override;
  void end_stream() override;

 private:
  void emit(const char* type, nlohmann::ordered_json event);
  void open(const char* kind, nlohmann::ordered_json block);  // a new content block (closing the open one)
  void close();                                                 // the open block's content_block_stop

  std::string id_, model_;
  int blocks_ = 0;            // content blocks started
  std::string open_kind_;     // the open block's type ("" none)
  std::string finish_reason_;
  nlohmann::ordered_json matched_stop_;  // chat's matched_stop of the finish
  nlohmann::ordered_json usage_;         // chat's usage (the stream's last chunk)
};

}  // namespace mlaserve::server
