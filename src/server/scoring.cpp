#include "server/scoring.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "server/api_error.h"

namespace mlaserve::server {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

bool is_id_list(const json& v) {
  return v.is_array() && std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_number_integer(); });
}

std::vector<int32_t> ids_of(const json& v, const std::string& field) {
  if (!is_id_list(v)) bad_request(field, "invalid_type", "'{}' must be a list of token ids", field);
  return token_id_list(v, field, /*allow_empty=*/true);
}

}  // namespace

ScorePlan plan_score(const json& body, ScoreApi api, const TextCodec* codec, int64_t max_context,
                     const ParseOptions& limits) {
  const size_t max_labels = static_cast<size_t>(limits.max_token_ids_logprob);
  if (!body.is_object()) bad_request("", "invalid_type", "the body must be a JSON object");
  const Fields f(body);
  ScorePlan p;
  p.api = api;
  p.labels = ids_of(f.required("label_token_ids", "the token ids to score"), "label_token_ids");
  if (p.labels.empty()) bad_request("label_token_ids", "invalid_value", "'label_token_ids' must hold a token id");
  if (p.labels.size() > max_labels)
    bad_request("label_token_ids", "invalid_value", "'label_token_ids' has {} ids; at most {} are allowed",
                p.labels.size(), max_labels);
  if (codec)
    for (int32_t id : p.labels)
      if (static_cast<size_t>(id) >= codec->vocab_size())
        bad_request("label_token_ids", "invalid_value", "label token id {} is outside the vocabulary [0, {})", id,
                    codec->vocab_size());
  p.apply_softmax = f.boolean("apply_softmax").value_or(api == ScoreApi::Vllm);
  const bool item_first = f.boolean("item_first").value_or(false);
  const json& query = f.required("query", "a text or a list of token ids");
  json items = f.required("items", "a list of texts or of token id lists");
  if (api == ScoreApi::Sglang && items.is_string()) items = json::array({items});  // SGLang takes one text
  if (!items.is_array() || items.empty())
    bad_request("items", items.is_array() ? "invalid_value" : "invalid_type",
                "'items' must be a non-empty list of texts or of token id lists");
  if (items.size() > limits.max_batch)
    bad_request("items", "invalid_value", "'items' has {} items; at most {} are allowed", items.size(),
                limits.max_batch);
  if (!query.is_string()) ids_of(query, "query");
  for (size_t i = 0; i < items.size(); ++i)
    if (!items[i].is_string()) ids_of(items[i], fmt::format("items[{}]", i));

  p.generate = json::object();
  if (api == ScoreApi::Sglang) {  // both texts (joined as text) or both token ids
    const bool text = query.is_string();
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].is_string() != text)
        bad_request(fmt::format("items[{}]", i), "invalid_type",
                    "'query' and 'items' must both be text or both token ids (query: {}, items[{}]: {})",
                    text ? "text" : "ids", i, items[i].is_string() ? "text" : "ids");
    json prompts = json::array();
    for (const json& item : items) {
      if (text) {
        const std::string q = query.get<std::string>(), it = item.get<std::string>();
        prompts.push_back(item_first ? it + q : q + it);
      } else {
        json ids = item_first ? item : query;
        for (const json& x : item_first ? query : item) ids.push_back(x);
        prompts.push_back(std::move(ids));
      }
    }
    p.generate[text ? "text" : "input_ids"] = std::move(prompts);
  } else {  // vLLM: ids joined after tokenizing each part
    const bool add_special = f.boolean("add_special_tokens").value_or(true);
    auto encode = [&](const json& v, bool special, const std::string& field) {
      if (!v.is_string()) return ids_of(v, field);
      if (!codec) bad_request(field, "no_tokenizer", "text needs a tokenizer; this server runs without one: send ids");
      return codec->encode(v.get<std::string>(), special);
    };
    const std::vector<int32_t> q = encode(query, add_special, "query");
    json prompts = json::array();
    for (size_t i = 0; i < items.size(); ++i) {
      const std::vector<int32_t> it = encode(items[i], false, fmt::format("items[{}]", i));
      std::vector<int32_t> ids = item_first ? it : q;
      ids.insert(ids.end(), (item_first ? q : it).begin(), (item_first ? q : it).end());
      if (max_context > 1 && static_cast<int64_t>(ids.size()) > max_context - 1)
        ids.resize(static_cast<size_t>(max_context - 1));  // room for the one token
      prompts.push_back(ids);
    }
    p.generate["input_ids"] = std::move(prompts);
  }
  p.generate["sampling_params"] = {{"max_new_tokens", 1}, {"temperature", 0.0}};
  p.generate["return_logprob"] = true;
  p.generate["token_ids_logprob"] = p.labels;
  return p;
}

ojson score_answer(const ScorePlan& plan, const json& generated, const std::string& id, int64_t created,
                   const std::string& model) {
  std::vector<const json*> results;
  if (generated.is_array())
    for (const json& r : generated) results.push_back(&r);
  else
    results.push_back(&generated);
  const double inf = std::numeric_limits<double>::infinity();
  ojson scores = ojson::array(), data = ojson::array();
  int64_t prompt_tokens = 0, completion_tokens = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const json& meta = results[i]->at("meta_info");
    prompt_tokens += meta.value("prompt_tokens", int64_t{0});
    completion_tokens += meta.value("completion_tokens", int64_t{0});
    const auto lists = meta.find("output_token_ids_logprobs");
    if (lists == meta.end() || !lists->is_array() || lists->empty() || !(*lists)[0].is_array()) {
      const auto fin = meta.find("finish_reason");
      throw ApiError(503, fmt::format("item {} ended before its next token was scored ({})", i,
                                      fin == meta.end() ? std::string("no finish reason") : fin->dump()),
                     "", "service_unavailable");
    }
    std::vector<double> lp(plan.labels.size(), -inf);
    for (const json& e : (*lists)[0]) {  // [logprob (null: -inf), id, text]
      if (!e.is_array() || e.size() < 2 || !e[1].is_number_integer()) continue;
      const int32_t tok = e[1].get<int32_t>();
      for (size_t k = 0; k < plan.labels.size(); ++k)
        if (plan.labels[k] == tok && e[0].is_number()) lp[k] = e[0].get<double>();
    }
    std::vector<double> p(lp.size(), 0.0);
    const double top = *std::max_element(lp.begin(), lp.end());
    if (plan.apply_softmax && top > -inf) {  // over the labels alone
      double sum = 0.0;
      for (size_t k = 0; k < lp.size(); ++k) sum += p[k] = std::exp(lp[k] - top);
      for (double& x : p) x /= sum;
    } else if (!plan.apply_softmax) {
      for (size_t k = 0; k < lp.size(); ++k) p[k] = std::exp(lp[k]);
    }
    if (plan.api == ScoreApi::Sglang)
      scores.push_back(p);
    else
      data.push_back(ojson{{"index", i}, {"object", "score"}, {"score", p[0]}});
  }
  const ojson usage{{"prompt_tokens", prompt_tokens},
                    {"total_tokens", prompt_tokens + completion_tokens},
                    {"completion_tokens", completion_tokens}};
  ojson out;
  if (plan.api == ScoreApi::Sglang) {
    out["scores"] = std::move(scores);
    out["model"] = model;
    out["usage"] = usage;
    out["object"] = "scoring";
  } else {
    out["id"] = id;
    out["object"] = "list";
    out["created"] = created;
    out["model"] = model;
    out["data"] = std::move(data);
    out["usage"] = usage;
  }
  return out;
}

ScoreExchange::ScoreExchange(std::shared_ptr<HttpExchange> inner, ScorePlan plan, std::string id, int64_t created,
                             std::string model)
    : ForwardingExchange(std::move(inner)), plan_(std::move(plan)), id_(std::move(id)), created_(created),
      model_(std::move(model)) {}

void ScoreExchange::respond(int status, const std::string& content_type, std::string body) {
  if (status != 200) {
    inner_->respond(status, content_type, std::move(body));
    return;
  }
  try {
    const ojson a = score_answer(plan_, json::parse(body), id_, created_, model_);
    inner_->respond(200, "application/json", a.dump(-1, ' ', false, json::error_handler_t::replace));
  } catch (const ApiError& e) {
    inner_->respond(e.status, "application/json", error_body(e));
  } catch (const std::exception& e) {  // (an answer /generate does not give)
    inner_->respond(500, "application/json",
                    error_body(500, fmt::format("the scores could not be read: {}", e.what()), "internal_error"));
  }
}

void ScoreExchange::start_stream() {
  inner_->respond(500, "application/json", error_body(500, "a scoring request streamed", "internal_error"));
}

}  // namespace mlaserve::server
