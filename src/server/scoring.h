// Generative scoring: the probability a causal LM gives label tokens as the next token after query + item, for each
// item (SGLang's POST /v1/score, vLLM's POST /generative_scoring). Each item's prompt becomes one prompt of a native
// /generate batch of one greedy token with the labels' logprobs (token_ids_logprob: the model's log-softmax), and
// ScoreExchange turns that answer into the API's.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "server/api.h"
#include "server/protocol.h"
#include "server/text_codec.h"

namespace mlaserve::server {

enum class ScoreApi { Sglang, Vllm };

struct ScorePlan {
  ScoreApi api = ScoreApi::Sglang;
  std::vector<int32_t> labels;  // label_token_ids, in the request's order
  bool apply_softmax = false;   // normalise over the labels alone; else each label's probability over the vocabulary
  nlohmann::json generate;      // the native /generate request computing it
};

// Reads a scoring request ({"query", "items", "label_token_ids", "apply_softmax", "item_first"}; vLLM's also
// "add_special_tokens"); ApiError 400 naming the field. The prompts as each API makes them: SGLang joins a text query
// and text items as text (tokenized by /generate, with the BOS) or id lists as ids, items a string or a list;
// vLLM tokenizes the query (its special tokens per add_special_tokens, default true) and each text item (without),
// joins the ids and cuts them to max_context - 1. apply_softmax defaults to false (SGLang) or true (vLLM).
// limits: the most label ids (max_token_ids_logprob) and items (max_batch) a request may name.
ScorePlan plan_score(const nlohmann::json& body, ScoreApi api, const TextCodec* codec, int64_t max_context,
                     const ParseOptions& limits);

// The API's answer from the /generate answer (one native object per item, or one object for a single item):
// SGLang {"scores": [[p per label] per item], "model", "usage", "object": "scoring"}; vLLM {"id", "object": "list",
// "created", "model", "data": [{"index", "object": "score", "score": the first label's p}], "usage"}.
nlohmann::ordered_json score_answer(const ScorePlan& plan, const nlohmann::json& generated, const std::string& id,
                                    int64_t created, const std::string& model);

// In front of the client's exchange: a 200 /generate answer becomes score_answer's; other answers pass unchanged.
class ScoreExchange : public ForwardingExchange {
 public:
  ScoreExchange(std::shared_ptr<HttpExchange> inner, ScorePlan plan, std::string id, int64_t created,
                std::string model);
  void respond(int status, const std::string& content_type, std::string body) override;
  // A scoring request never streams (its /generate request asks for none).
  void start_stream() override;
  void send_event(std::string) override {}
  void end_stream() override {}

 private:
  ScorePlan plan_;
  std::string id_;
  int64_t created_;
  std::string model_;
};

}  // namespace mlaserve::server
