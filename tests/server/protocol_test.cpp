#include "server/protocol.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <map>

#include "server/api_error.h"
#include "server/responses.h"
#include "server/text_codec.h"
#include "server/tool_calls.h"
#include "structured/regex.h"

namespace mlaserve::server {
namespace {

using json = nlohmann::json;

TEST(Protocol, NativeDefaultsAndFields) {
  ParsedRequest r = parse_native(json::parse(R"({"text": "hi", "sampling_params": {"max_new_tokens": 5,
      "temperature": 0, "top_k": 3, "top_p": 0.5, "min_p": 0.1, "stop": "x", "stop_token_ids": [7],
      "ignore_eos": true, "n": 2, "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1},
      "stream": true, "return_logprob": true, "top_logprobs_num": 3})"),
                                 {});
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(*r.prompts[0].text, "hi");
  EXPECT_FALSE(r.batch);
  EXPECT_EQ(r.sampling.max_new_tokens, 5);
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.sampling.top_k, 3);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
  EXPECT_EQ(r.stop, std::vector<std::string>{"x"});
  EXPECT_EQ(r.sampling.stop_token_ids, std::vector<int32_t>{7});
  EXPECT_TRUE(r.sampling.ignore_eos);
  EXPECT_EQ(r.n, 2);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 3);

  r = parse_native(json::parse(R"({"input_ids": [[1, 2], [3]]})"), {});
  EXPECT_TRUE(r.batch);
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[1].input_ids, std::vector<int32_t>{3});
  EXPECT_EQ(r.sampling.max_new_tokens, 128);
}

// The server's sampling defaults (a model's generation_config.json) fill what a request leaves out, in every API; the
// request's own values win.
TEST(Protocol, SamplingDefaultsFillWhatTheRequestLeavesOut) {
  ParseOptions o;
  o.defaults.temperature = 0.6f;
  o.defaults.top_p = 0.95f;
  o.defaults.top_k = 20;
  o.defaults.min_p = 0.05f;
  o.defaults.repetition_penalty = 1.05f;
  for (const ParsedRequest& r : {parse_native(json::parse(R"({"text": "hi"})"), o),
                                 parse_completions(json::parse(R"({"prompt": "hi"})"), o),
                                 parse_chat(json::parse(R"({"messages": [{"role": "user", "content": "hi"}]})"), o)}) {
    EXPECT_FLOAT_EQ(r.sampling.temperature, 0.6f);
    EXPECT_FLOAT_EQ(r.sampling.top_p, 0.95f);
    EXPECT_EQ(r.sampling.top_k, 20);
    EXPECT_FLOAT_EQ(r.sampling.min_p, 0.05f);
    EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.05f);
  }
  const ParsedRequest own = parse_completions(
      json::parse(R"({"prompt": "hi", "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1})"),
      o);
  EXPECT_EQ(own.sampling.temperature, 0.0f);
  EXPECT_EQ(own.sampling.top_p, 1.0f);
  EXPECT_EQ(own.sampling.top_k, -1);
  EXPECT_EQ(own.sampling.min_p, 0.0f);
  EXPECT_EQ(own.sampling.repetition_penalty, 1.0f);
  const ParsedRequest plain = parse_completions(json::parse(R"({"prompt": "hi"})"), {});
  EXPECT_EQ(plain.sampling.temperature, SamplingParams{}.temperature) << "no defaults: the API's own";
}

TEST(Protocol, CompletionsPromptShapes) {
  EXPECT_EQ(parse_completions(json::parse(R"({"prompt": [1, 2, 3]})"), {}).prompts.size(), 1u);
  EXPECT_FALSE(parse_completions(json::parse(R"({"prompt": [1, 2, 3]})"), {}).batch);
  auto r = parse_completions(json::parse(R"({"prompt": ["a", "b"], "max_tokens": 3, "logprobs": 2, "echo": true,
                                              "stream": true, "stream_options": {"include_usage": true}})"),
                             {});
  EXPECT_TRUE(r.batch);
  EXPECT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.sampling.max_new_tokens, 3);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 2);
  EXPECT_TRUE(r.echo);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.sampling.logprob_start_len, 0);  // echo with logprobs: the prompt's logprobs too
  EXPECT_EQ(parse_completions(json::parse(R"({"prompt": "a"})"), {}).sampling.max_new_tokens, 16);
  EXPECT_EQ(parse_completions(json::parse(R"({"prompt": "a", "logprobs": 1})"), {}).sampling.logprob_start_len, -1);
  EXPECT_EQ(parse_completions(json::parse(R"({"prompt": "a", "echo": true})"), {}).sampling.logprob_start_len, -1);
  EXPECT_EQ(parse_completions(json::parse(R"({"prompt": "a", "echo": true, "max_tokens": 0})"), {})
                .sampling.max_new_tokens,
            0);
  auto n = parse_native(json::parse(R"({"text": "a", "return_logprob": true, "logprob_start_len": 3,
                                        "sampling_params": {"max_new_tokens": 0}})"),
                        {});
  EXPECT_EQ(n.sampling.logprob_start_len, 3);
  EXPECT_EQ(n.sampling.max_new_tokens, 0);
  EXPECT_EQ(parse_native(json::parse(R"({"text": "a", "logprob_start_len": 3})"), {}).sampling.logprob_start_len, -1);
  // suffix: fill in the middle; "" and null are no suffix
  EXPECT_EQ(parse_completions(json::parse(R"({"prompt": "a", "suffix": "b"})"), {}).suffix, "b");
  EXPECT_FALSE(parse_completions(json::parse(R"({"prompt": "a", "suffix": ""})"), {}).suffix);
  EXPECT_FALSE(parse_completions(json::parse(R"({"prompt": "a", "suffix": null})"), {}).suffix);
}

TEST(Protocol, ChatMessagesFlattened) {
  auto r = parse_chat(json::parse(R"({"model": "m", "messages": [{"role": "developer", "content": "sys"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "logprobs": true, "top_logprobs": 2, "max_completion_tokens": 9})"),
                      {});
  EXPECT_EQ(r.messages[0]["role"], "system");
  EXPECT_EQ(r.messages[1]["content"], "ab");
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.top_logprobs, 2);
  EXPECT_EQ(r.sampling.max_new_tokens, 9);
}

struct BadCase {
  const char* api;  // n: native, c: completions, h: chat
  const char* body;
  const char* param;
  const char* code;
};

TEST(Protocol, BadRequestsNameTheField) {
  const BadCase cases[] = {
      {"n", R"({})", "text", "invalid_value"},
      {"n", R"({"text": "a", "input_ids": [1]})", "text", "invalid_value"},
      {"n", R"({"text": 5})", "text", "invalid_type"},
      {"n", R"({"text": []})", "text", "invalid_value"},
      {"n", R"({"input_ids": [1, -2]})", "input_ids[1]", "invalid_value"},
      {"n", R"({"input_ids": [1, "x"]})", "input_ids[1]", "invalid_type"},
      {"n", R"({"input_ids": []})", "input_ids", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": []})", "sampling_params", "invalid_type"},
      {"n", R"({"text": "a", "sampling_params": {"temperature": -1}})", "sampling_params.temperature", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"temperature": "hot"}})", "sampling_params.temperature",
       "invalid_type"},
      {"n", R"({"text": "a", "sampling_params": {"top_p": 0}})", "sampling_params.top_p", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"top_p": 1.5}})", "sampling_params.top_p", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"top_k": -5}})", "sampling_params.top_k", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"min_p": 2}})", "sampling_params.min_p", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"max_new_tokens": -1}})", "sampling_params.max_new_tokens",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"max_new_tokens": 1.5}})", "sampling_params.max_new_tokens",
       "invalid_type"},
      {"n", R"({"text": "a", "sampling_params": {"max_new_tokens": 1e30}})", "sampling_params.max_new_tokens",
       "invalid_type"},
      {"n", R"({"text": "a", "sampling_params": {"n": 0}})", "sampling_params.n", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"n": 100000}})", "sampling_params.n", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"frequency_penalty": 3}})", "sampling_params.frequency_penalty",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"repetition_penalty": 0}})", "sampling_params.repetition_penalty",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"stop": 3}})", "sampling_params.stop", "invalid_type"},
      {"n", R"({"text": "a", "sampling_params": {"stop": [""]}})", "sampling_params.stop", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"stop_token_ids": [-1]}})", "sampling_params.stop_token_ids[0]",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"ignore_eos": "yes"}})", "sampling_params.ignore_eos",
       "invalid_type"},
      {"n", R"({"text": "a", "stream": 1})", "stream", "invalid_type"},
      {"n", R"({"text": "a", "top_logprobs_num": 1000})", "top_logprobs_num", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"regex": "(a+"}})", "sampling_params.regex", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"regex": 3}})", "sampling_params.regex", "invalid_type"},
      {"n", R"({"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}})", "sampling_params.json_schema",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"json_schema": "{not json"}})", "sampling_params.json_schema",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"json_schema": "{\"$ref\": \"#\"}"}})",
       "sampling_params.json_schema", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"ebnf": "root ::= x"}})", "sampling_params.ebnf",
       "invalid_value"},  // the rule x is not defined
      {"n", R"({"text": "a", "sampling_params": {"ebnf": "root ::= [a-"}})", "sampling_params.ebnf",
       "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}})",
       "response_format.type", "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}})",
       "response_format.json_schema", "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
       "json_schema": {"name": "x", "schema": {"type": "tuple"}}}})", "response_format.json_schema.schema",
       "invalid_value"},
      {"c", R"({"prompt": "a", "response_format": {"type": "json_object"}, "regex": "a"})", "response_format",
       "invalid_value"},
      {"c", R"({"prompt": "a", "guided_choice": []})", "guided_choice", "invalid_type"},
      {"c", R"({"prompt": "a", "guided_choice": ["a", 3]})", "guided_choice", "invalid_value"},
      {"c", R"({"prompt": "a", "guided_grammar": "root ::= x"})", "guided_grammar", "invalid_value"},
      {"c", R"({"prompt": "a", "structured_outputs": {"grammar": "root ::= x"}})", "structured_outputs.grammar",
       "invalid_value"},
      {"c", R"({"prompt": "a", "structured_outputs": {"structural_tag": "x"}})", "structured_outputs.structural_tag",
       "invalid_value"},
      {"c", R"({"prompt": "a", "structured_outputs": {"structural_tag": 3}})", "structured_outputs.structural_tag",
       "invalid_type"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "structural_tag",
       "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]}})",
       "response_format.structures[0]", "invalid_value"},  // begin does not start with a trigger
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "structural_tag",
       "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}})", "response_format", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"structural_tag": {"type": "triggered_tags", "triggers": ["<"]}}})",
       "sampling_params.structural_tag", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"structural_tag": {"structures": [{"begin": "<f>", "schema":
       {"type": "tuple"}, "end": ""}], "triggers": ["<f"]}}})", "sampling_params.structural_tag.structures[0].schema",
       "invalid_value"},
      {"c", R"({"prompt": "a", "guided_grammar": "root ::= \"a\"", "regex": "a"})", "guided_grammar",
       "invalid_value"},
      {"c", R"({"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}})", "structured_outputs.regex",
       "invalid_value"},
      {"c", R"({"prompt": "a", "structured_outputs": {"yaml": "x"}})", "structured_outputs.yaml", "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"logit_bias": [1]}})", "sampling_params.logit_bias", "invalid_type"},
      {"n", R"({"text": "a", "sampling_params": {"logit_bias": {"x": 1}}})", "sampling_params.logit_bias",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"logit_bias": {"-3": 1}}})", "sampling_params.logit_bias",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"logit_bias": {"3": 101}}})", "sampling_params.logit_bias",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"logit_bias": {"3": "up"}}})", "sampling_params.logit_bias",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"logit_bias": {"3": 1, "03": 2}}})", "sampling_params.logit_bias",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"min_new_tokens": -1}})", "sampling_params.min_new_tokens",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}})",
       "sampling_params.min_new_tokens", "invalid_value"},
      {"c", R"({})", "prompt", "invalid_value"},
      {"c", R"({"prompt": {}})", "prompt", "invalid_type"},
      {"c", R"({"prompt": "a", "max_tokens": 0})", "max_tokens", "invalid_value"},
      {"n", R"({"text": "a", "return_logprob": true, "logprob_start_len": -2})", "logprob_start_len",
       "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", "max_tokens", "invalid_value"},
      {"c", R"({"prompt": "a", "logprobs": 99})", "logprobs", "invalid_value"},
      {"c", R"({"prompt": "a", "stream_options": {"include_usage": true}})", "stream_options", "invalid_value"},
      {"c", R"({"prompt": "a", "best_of": 3})", "best_of", "unsupported_parameter"},
      {"c", R"({"prompt": "a", "suffix": 3})", "suffix", "invalid_type"},
      {"c", R"({"prompt": "a", "suffix": "b", "echo": true})", "suffix", "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "suffix": "b"})", "suffix", "unsupported_parameter"},
      {"c", R"({"prompt": "a", "model": 7})", "model", "invalid_type"},
      {"n", R"({"text": "a", "session_params": ["s1"]})", "session_params", "invalid_type"},
      {"n", R"({"text": "a", "session_params": {"id": 1}})", "session_params.id", "invalid_type"},
      {"n", R"({"text": "a", "session_params": {"id": "s", "offset": 0.5}})", "session_params.offset", "invalid_type"},
      {"n", R"({"text": "a", "session_params": {"id": "s", "replace": 1}})", "session_params.replace", "invalid_type"},
      {"n", R"({"text": "a", "session_params": {"id": "s", "parent": "r"}})", "session_params.parent", "invalid_value"},
      {"n", R"({"text": "a", "custom_logit_processor": "gASV..."})", "custom_logit_processor", "unsupported_parameter"},
      {"c", R"({"prompt": "a", "max_tokens": 2, "min_tokens": 3})", "min_tokens", "invalid_value"},
      {"c", R"({"prompt": "a", "logit_bias": {"5": -100.5}})", "logit_bias", "invalid_value"},
      {"c", R"({"prompt": "a", "allowed_token_ids": []})", "allowed_token_ids", "invalid_value"},
      {"n", R"({"text": "a", "return_logprob": true, "token_ids_logprob": 3})", "token_ids_logprob", "invalid_type"},
      {"n", R"({"text": "a", "return_logprob": true, "token_ids_logprob": [[1], [2]]})", "token_ids_logprob",
       "invalid_value"},
      {"n", R"({"text": ["a", "b"], "return_logprob": true, "token_ids_logprob": [[1], [2], [3]]})",
       "token_ids_logprob", "invalid_value"},
      {"n", R"({"text": "a", "return_logprob": true, "token_ids_logprob": [1, -1]})", "token_ids_logprob[1]",
       "invalid_value"},
      {"c", R"({"prompt": "a", "allowed_token_ids": [1, -2]})", "allowed_token_ids[1]", "invalid_value"},
      {"c", R"({"prompt": "a", "allowed_token_ids": 5})", "allowed_token_ids", "invalid_type"},
      {"n", R"({"text": "a", "sampling_params": {"allowed_token_ids": ["x"]}})", "sampling_params.allowed_token_ids[0]",
       "invalid_type"},
      {"c", R"({"prompt": "a", "bad_words": 5})", "bad_words", "invalid_type"},
      {"c", R"({"prompt": "a", "bad_words": ["ok", 5]})", "bad_words", "invalid_type"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "bad_words": ["ok", " \n"]})", "bad_words",
       "invalid_value"},
      {"n", R"({"text": "a", "sampling_params": {"bad_words": [""]}})", "sampling_params.bad_words", "invalid_value"},
      {"h", R"({})", "messages", "invalid_value"},
      {"h", R"({"messages": []})", "messages", "invalid_value"},
      {"h", R"({"messages": "hi"})", "messages", "invalid_type"},
      {"h", R"({"messages": [{"role": "wizard", "content": "x"}]})", "messages[0].role", "invalid_value"},
      {"h", R"({"messages": [{"role": "user"}]})", "messages[0].content", "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content", "invalid_type"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs",
       "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "temperature": -0.1})", "temperature",
       "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", "tools[0]",
       "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "tools": {}})", "tools", "invalid_type"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": 5, "function": {"name": "f"}}]})",
       "tools[0]", "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name":
       "f"}}], "tool_choice": {"type": ["function"], "function": {"name": "f"}}})", "tool_choice", "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})", "tool_choice",
       "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name":
       "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}})", "tool_choice", "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name":
       "f"}}], "tool_choice": {"type": "function"}})", "tool_choice", "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name":
       "f"}}], "tool_choice": "required", "response_format": {"type": "json_object"}})", "response_format",
       "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"})", "tool_choice",
       "invalid_value"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]})", "functions",
       "unsupported_parameter"},
      {"h", R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "x"})", "chat_template_kwargs",
       "invalid_type"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.body);
    json body = json::parse(c.body);
    try {
      if (c.api[0] == 'n') parse_native(body, {});
      else if (c.api[0] == 'c') parse_completions(body, {});
      else parse_chat(body, {});
      ADD_FAILURE() << "accepted";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, c.param) << e.what();
      EXPECT_EQ(e.code, c.code) << e.what();
    }
  }
}

// vLLM's allowed_token_ids and bad_words on every API (the words are tokenized by the server, later).
TEST(Protocol, AllowedTokenIdsAndBadWords) {
  ParsedRequest r = parse_completions(json::parse(R"({"prompt": "a", "allowed_token_ids": [5, 3, 5],
      "bad_words": ["foo", " bar baz"]})"), {});
  EXPECT_EQ(r.sampling.allowed_token_ids, (std::vector<int32_t>{5, 3, 5}));
  EXPECT_EQ(r.bad_words, (std::vector<std::string>{"foo", " bar baz"}));
  r = parse_native(json::parse(R"({"text": "a", "sampling_params": {"bad_words": "x", "allowed_token_ids": [0]}})"),
                   {});
  EXPECT_EQ(r.bad_words, std::vector<std::string>{"x"});
  EXPECT_EQ(r.sampling.allowed_token_ids, std::vector<int32_t>{0});
  r = parse_chat(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "bad_words": [],
      "allowed_token_ids": null})"), {});
  EXPECT_TRUE(r.bad_words.empty());
  EXPECT_TRUE(r.sampling.allowed_token_ids.empty());
  ParseOptions few;
  few.max_bad_words = 2;
  EXPECT_THROW(parse_completions(json::parse(R"({"prompt": "a", "bad_words": ["a", "b", "c"]})"), few), ApiError);
}

// A thinking budget under SGLang's name (native sampling_params, OpenAI) and vLLM's; a negative one is a 400.
TEST(Protocol, ThinkingBudget) {
  ParsedRequest r = parse_native(json::parse(R"({"text": "a", "sampling_params": {"thinking_budget": 64}})"), {});
  EXPECT_EQ(r.sampling.thinking_budget, 64);
  EXPECT_EQ(r.thinking_budget_param, "sampling_params.thinking_budget");
  r = parse_chat(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "thinking_token_budget": 0})"), {});
  EXPECT_EQ(r.sampling.thinking_budget, 0);
  r = parse_completions(json::parse(R"({"prompt": "a"})"), {});
  EXPECT_EQ(r.sampling.thinking_budget, -1);
  EXPECT_THROW(parse_completions(json::parse(R"({"prompt": "a", "thinking_budget": -1})"), {}), ApiError);
}

// SGLang's token_ids_logprob: one list for every prompt or one per prompt of a batch, read with return_logprob only.
TEST(Protocol, TokenIdsLogprob) {
  ParsedRequest r = parse_native(json::parse(R"({"text": "a", "return_logprob": true, "token_ids_logprob": [4, 2]})"),
                                 {});
  EXPECT_EQ(r.token_ids_logprob, (std::vector<std::vector<int32_t>>{{4, 2}}));
  r = parse_native(json::parse(R"({"text": ["a", "b"], "return_logprob": true, "token_ids_logprob": [[1], []]})"), {});
  EXPECT_EQ(r.token_ids_logprob, (std::vector<std::vector<int32_t>>{{1}, {}}));
  r = parse_native(json::parse(R"({"text": "a", "token_ids_logprob": [4, 2]})"), {});
  EXPECT_TRUE(r.token_ids_logprob.empty());
  ParseOptions few;
  few.max_token_ids_logprob = 2;
  EXPECT_THROW(parse_native(json::parse(R"({"text": "a", "return_logprob": true, "token_ids_logprob": [1, 2, 3]})"),
                            few),
               ApiError);
}

// vLLM's cache_salt and SGLang's extra_key: one salt for the request, or (SGLang's extra_key as a list, a native
// batch) one per prompt after cache_salt's part; a list elsewhere, of another length or with a non-string is a 400.
TEST(Protocol, CacheSaltsAndPerPromptExtraKeys) {
  ParsedRequest r = parse_native(json::parse(R"({"text": "a", "extra_key": "k"})"), {});
  const std::string k = r.cache_salt;
  EXPECT_FALSE(k.empty());
  EXPECT_TRUE(r.prompt_salts.empty());
  EXPECT_NE(parse_native(json::parse(R"({"text": "a", "cache_salt": "k"})"), {}).cache_salt, k);
  r = parse_native(json::parse(R"({"text": ["a", "b"], "extra_key": ["k", "j"]})"), {});
  EXPECT_TRUE(r.cache_salt.empty());
  ASSERT_EQ(r.prompt_salts.size(), 2u);
  EXPECT_EQ(r.prompt_salts[0], k);  // the same tree as the string form's
  EXPECT_NE(r.prompt_salts[1], k);
  EXPECT_FALSE(r.prompt_salts[1].empty());
  r = parse_native(json::parse(R"({"input_ids": [[1], [2]], "cache_salt": "c", "extra_key": ["k", "k"]})"), {});
  ASSERT_EQ(r.prompt_salts.size(), 2u);
  EXPECT_EQ(r.prompt_salts[0], r.prompt_salts[1]);
  EXPECT_NE(r.prompt_salts[0], k);  // cache_salt's part first
  for (const char* bad :
       {R"({"text": "a", "extra_key": ["k"]})", R"({"text": ["a", "b"], "extra_key": ["k"]})",
        R"({"text": ["a", "b"], "extra_key": ["k", 3]})", R"({"text": ["a", "b"], "extra_key": ["k", ""]})",
        R"({"text": "a", "extra_key": ""})"}) {
    try {
      parse_native(json::parse(bad), {});
      ADD_FAILURE() << bad;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.param, "extra_key") << bad;
    }
  }
  EXPECT_THROW(parse_completions(json::parse(R"({"prompt": ["a", "b"], "extra_key": ["k", "j"]})"), {}), ApiError);
}

TEST(Protocol, LogitBiasAndMinTokens) {
  ParsedRequest r = parse_completions(
      json::parse(R"({"prompt": "a", "logit_bias": {"50256": -100, "7": 2.5, "0": 100}, "min_tokens": 3})"), {});
  using Bias = std::vector<std::pair<int32_t, float>>;
  EXPECT_EQ(r.sampling.logit_bias, (Bias{{0, 100.0f}, {7, 2.5f}, {50256, -100.0f}}));  // sorted by id
  EXPECT_EQ(r.sampling.min_new_tokens, 3);
  r = parse_native(json::parse(R"({"text": "a", "sampling_params": {"logit_bias": {"9": 1}, "min_new_tokens": 2}})"),
                   {});
  EXPECT_EQ(r.sampling.logit_bias, (Bias{{9, 1.0f}}));
  EXPECT_EQ(r.sampling.min_new_tokens, 2);
  r = parse_chat(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "min_tokens": 4, "logit_bias": {}})"),
                 {});
  EXPECT_TRUE(r.sampling.logit_bias.empty());
  EXPECT_EQ(r.sampling.min_new_tokens, 4);
  r = parse_completions(json::parse(R"({"prompt": "a"})"), {});
  EXPECT_TRUE(r.sampling.logit_bias.empty());
  EXPECT_EQ(r.sampling.min_new_tokens, 0);
  EXPECT_FALSE(r.no_stop_trim);
  r = parse_completions(json::parse(R"({"prompt": "a", "include_stop_str_in_output": true})"), {});
  EXPECT_TRUE(r.no_stop_trim);
  EXPECT_TRUE(parse_chat(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "no_stop_trim": true})"), {})
                  .no_stop_trim);
}

// Structured output: SGLang's regex / json_schema (and vLLM's guided_* names), OpenAI's response_format, each made
// into the regex the engine's constraint runs; a json_schema's properties keep the request's order where the body's
// text is given (parse_body's JSON sorts keys).
TEST(Protocol, StructuredOutputFields) {
  auto matches = [](const ParsedRequest& r, const std::string& text) {
    return structured::Dfa(structured::compile_regex(r.constraint_regex)).matches(text);
  };
  ParsedRequest n = parse_native(json::parse(R"({"text": "a", "sampling_params": {"regex": "(yes|no)!"}})"), {});
  EXPECT_EQ(n.constraint_regex, "(yes|no)!");
  EXPECT_EQ(n.constraint_param, "sampling_params.regex");
  n = parse_native(json::parse(R"({"text": "a", "sampling_params": {"json_schema":
      "{\"type\": \"object\", \"properties\": {\"b\": {\"type\": \"integer\"}, \"a\": {\"type\": \"boolean\"}}}"}})"),
                   {});
  EXPECT_TRUE(matches(n, R"({"b": 1, "a": true})"));
  EXPECT_FALSE(matches(n, R"({"a": true, "b": 1})"));
  EXPECT_TRUE(parse_native(json::parse(R"({"text": "a"})"), {}).constraint_regex.empty());

  const std::string chat = R"({"messages": [{"role": "user", "content": "x"}], "response_format": {
      "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object", "properties": {
      "z": {"type": "null"}, "y": {"enum": [1, 2]}}}}}})";
  ParsedRequest h = parse_chat(json::parse(chat), {}, chat);
  EXPECT_EQ(h.constraint_param, "response_format.json_schema.schema");
  EXPECT_TRUE(matches(h, R"({"z": null, "y": 2})"));
  EXPECT_FALSE(matches(h, R"({"y": 2, "z": null})"));
  EXPECT_TRUE(matches(parse_chat(json::parse(chat), {}), R"({"y": 2, "z": null})"));  // no text: sorted keys
  ParsedRequest o = parse_completions(
      json::parse(R"({"prompt": "a", "response_format": {"type": "json_object"}})"), {});
  EXPECT_TRUE(matches(o, R"({"k": [1, {"j": "v"}]})"));
  EXPECT_FALSE(matches(o, "[1]"));
  EXPECT_TRUE(parse_completions(json::parse(R"({"prompt": "a", "response_format": {"type": "text"}})"), {})
                  .constraint_regex.empty());
  ParsedRequest g = parse_completions(json::parse(R"({"prompt": "a", "guided_json": {"type": "integer"}})"), {});
  EXPECT_TRUE(matches(g, "-12"));
  EXPECT_FALSE(matches(g, "1.5"));
  // EBNF grammars: SGLang's ebnf, vLLM's guided_grammar and structured_outputs.grammar.
  const char* grammar = R"x("root ::= (\"yes\" | \"no\") [!?]")x";
  for (const std::string& body :
       {std::string(R"({"text": "a", "sampling_params": {"ebnf": )") + grammar + "}}",
        std::string(R"({"prompt": "a", "guided_grammar": )") + grammar + "}",
        std::string(R"({"prompt": "a", "structured_outputs": {"grammar": )") + grammar + "}}"}) {
    const json b = json::parse(body);
    ParsedRequest e = b.contains("text") ? parse_native(b, {}) : parse_completions(b, {});
    EXPECT_TRUE(matches(e, "yes!")) << body;
    EXPECT_TRUE(matches(e, "no?")) << body;
    EXPECT_FALSE(matches(e, "maybe!")) << body;
  }
  // vLLM's guided_grammar in Lark's notation (its documentation's example).
  const json lark = {{"prompt", "a"},
                     {"guided_grammar", "?start: \"SELECT \" cols \" FROM \" name\n?cols: name (\",\" name)*\n"
                                        "?name: /[a-zA-Z_][a-zA-Z0-9_]*/\n"}};
  EXPECT_TRUE(matches(parse_completions(lark, {}), "SELECT a,b FROM t"));
  EXPECT_FALSE(matches(parse_completions(lark, {}), "SELECT a, b FROM t"));
  // The same with Lark's usual blanks: %import common.WS, %ignore WS.
  json lark_ws = lark;
  lark_ws["guided_grammar"] = lark["guided_grammar"].get<std::string>() + "%import common.WS\n%ignore WS\n";
  EXPECT_TRUE(matches(parse_completions(lark_ws, {}), "SELECT  a ,\nb  FROM t\n"));
  EXPECT_FALSE(matches(parse_completions(lark_ws, {}), "SELECT a, b FROM t u"));
  EXPECT_EQ(parse_completions(json::parse(R"({"prompt": "a", "guided_regex": "[0-9]"})"), {}).constraint_regex,
            "[0-9]");
  // A client's regex or grammar arrives compiled (checked once, its automaton built from that compile); a regex the
  // server made from a schema is compiled where the automaton is built.
  EXPECT_NE(parse_completions(json::parse(R"({"prompt": "a", "guided_regex": "[0-9]"})"), {}).constraint_nfa, nullptr);
  EXPECT_NE(parse_completions(lark_ws, {}).constraint_nfa, nullptr);
  EXPECT_EQ(g.constraint_nfa, nullptr);
  // vLLM's guided_choice and structured_outputs; an object schema keeps its order where the text is given.
  ParsedRequest ch = parse_completions(json::parse(R"J({"prompt": "a", "guided_choice": ["yes", "no (maybe)"]})J"), {});
  EXPECT_TRUE(matches(ch, "no (maybe)"));
  EXPECT_FALSE(matches(ch, "no"));
  const std::string so = R"({"prompt": "a", "structured_outputs": {"json": {"type": "object",
      "properties": {"q": {"type": "integer"}, "p": {"type": "integer"}}}}})";
  ParsedRequest sj = parse_completions(json::parse(so), {}, so);
  EXPECT_EQ(sj.constraint_param, "structured_outputs.json");
  EXPECT_TRUE(matches(sj, R"({"q": 1, "p": 2})"));
  EXPECT_FALSE(matches(sj, R"({"p": 2, "q": 1})"));
  const std::string nat = R"({"text": "a", "sampling_params": {"json_schema": {"type": "object",
      "properties": {"q": {"type": "integer"}, "p": {"type": "integer"}}}}})";
  EXPECT_TRUE(matches(parse_native(json::parse(nat), {}, nat), R"({"q": 1, "p": 2})"));
  EXPECT_TRUE(matches(parse_completions(json::parse(R"({"prompt": "a", "structured_outputs": {"choice": ["x"]}})"), {}),
                      "x"));

  // Structural tags (SGLang's response_format and sampling_params.structural_tag, vLLM's structured_outputs one as
  // JSON text): free text until a trigger, then a structure that begins with it, its JSON, its end; again and again.
  const std::string tag = R"({"type": "structural_tag", "structures": [{"begin": "<function=get_weather>",
      "schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
      "required": ["city"]}, "end": "</function>"}, {"begin": "<function=noop>", "schema": {"type": "null"},
      "end": "</function>"}], "triggers": ["<function="]})";
  const std::string tc = R"({"messages": [{"role": "user", "content": "x"}], "response_format": )" + tag + "}";
  const std::string tn = R"({"text": "a", "sampling_params": {"structural_tag": )" + tag + "}}";
  const json tv = {{"prompt", "a"}, {"structured_outputs", {{"structural_tag", tag}}}};
  const std::vector<ParsedRequest> tagged = {parse_chat(json::parse(tc), {}, tc), parse_native(json::parse(tn), {}, tn),
                                             parse_completions(tv, {})};
  EXPECT_EQ(tagged[0].constraint_param, "response_format");
  EXPECT_EQ(tagged[1].constraint_param, "sampling_params.structural_tag");
  EXPECT_EQ(tagged[2].constraint_param, "structured_outputs.structural_tag");
  for (const ParsedRequest& t : tagged) {
    for (const char* ok : {"", "Sure, one moment.\n", "a <functio", "<function=noop>null</function>",
                           "Checking. <function=get_weather>{\"city\": \"Paris\", \"days\": 3}</function> Done.",
                           "<function=noop>null</function>x<function=get_weather>{\"city\": \"\"}</function>"})
      EXPECT_TRUE(matches(t, ok)) << t.constraint_param << ": " << ok;
    for (const char* bad : {"<function=get_weather>{}</function>", "<function=other>{}</function>",
                            "<function=noop>null", "x <function=get_weather>{\"city\": 1}</function>",
                            "<function=get_weather>{\"days\": 3, \"city\": \"P\"}</function>"})
      EXPECT_FALSE(matches(t, bad)) << t.constraint_param << ": " << bad;
  }
}

// tool_choice required / a named function: the output is constrained to DeepSeek's tool calls (special tokens as the
// byte 0xFF + their text, as the constraint's vocabulary spells them) of those tools, arguments per the parameters.
TEST(Protocol, ForcedToolCallsAreAConstraint) {
  auto matches = [](const ParsedRequest& r, const std::string& text) {
    return structured::Dfa(structured::compile_regex(r.constraint_regex)).matches(text);
  };
  auto sp = [](std::string_view m) { return fmt::format("\xFF{}", m); };
  auto call = [&](const std::string& name, const std::string& args) {
    return sp(kToolCallBegin) + "function" + sp(kToolSep) + name + "\n```json\n" + args + "\n```" + sp(kToolCallEnd);
  };
  auto calls = [&](const std::string& inner) { return sp(kToolCallsBegin) + inner + sp(kToolCallsEnd); };
  const std::string body = R"({"messages": [{"role": "user", "content": "x"}], "tools": [
      {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties":
        {"unit": {"enum": ["C", "F"]}, "city": {"type": "string"}}}}},
      {"type": "function", "function": {"name": "now"}}])";
  ParsedRequest named = parse_chat(
      json::parse(body + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})"), {},
      body + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})");
  EXPECT_TRUE(named.forced_tool_calls);
  EXPECT_EQ(named.constraint_param, "tool_choice");
  EXPECT_TRUE(matches(named, calls(call("get_weather", R"({"unit": "C", "city": "Paris"})"))));
  EXPECT_TRUE(matches(named, calls(call("get_weather", R"({"unit":"F","city":"Rome"})"))));
  EXPECT_FALSE(matches(named, calls(call("get_weather", R"({"city": "Paris", "unit": "C"})"))));  // the order
  EXPECT_FALSE(matches(named, calls(call("get_weather", "{\n  \"unit\": \"C\", \"city\": \"P\"}"))));  // compact
  EXPECT_FALSE(matches(named, calls(call("now", "{}"))));
  EXPECT_FALSE(matches(named, "<｜tool▁calls▁begin｜>"));  // the markers' text is not the special token
  const std::string required = body + R"(, "tool_choice": "required"})";
  ParsedRequest req = parse_chat(json::parse(required), {}, required);
  EXPECT_TRUE(
      matches(req, calls(call("now", R"({"any": [1]})") + call("get_weather", R"({"unit": "C", "city": ""})"))));
  EXPECT_FALSE(matches(req, calls("")));
  ParsedRequest one =
      parse_chat(json::parse(body + R"(, "tool_choice": "required", "parallel_tool_calls": false})"), {});
  EXPECT_TRUE(matches(one, calls(call("now", "{}"))));
  EXPECT_FALSE(matches(one, calls(call("now", "{}") + call("now", "{}"))));
  // --tool-call-parser deepseekv31: V3.1's form, NAME<｜tool▁sep｜>ARGS (optional properties may be left out).
  auto call31 = [&](const std::string& name, const std::string& args) {
    return sp(kToolCallBegin) + name + sp(kToolSep) + args + sp(kToolCallEnd);
  };
  ParseOptions v31;
  v31.tool_format = ToolFormat::DeepseekV31;
  ParsedRequest named31 = parse_chat(
      json::parse(body + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})"), v31,
      body + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})");
  EXPECT_TRUE(matches(named31, calls(call31("get_weather", R"({"unit": "C", "city": "Paris"})"))));
  EXPECT_TRUE(matches(named31, calls(call31("get_weather", R"({"city": "Paris"})"))));
  EXPECT_FALSE(matches(named31, calls(call("get_weather", R"({"unit": "C", "city": "Paris"})"))));  // V3's form
  EXPECT_FALSE(matches(named31, calls(call31("now", "{}"))));
  EXPECT_EQ(tool_call_format("deepseekv31"), ToolFormat::DeepseekV31);
  EXPECT_EQ(tool_call_format("deepseek_v31"), ToolFormat::DeepseekV31);
  EXPECT_EQ(tool_call_format("deepseekv3"), ToolFormat::DeepseekV3);
  // --tool-call-parser kimi_k2: functions.NAME:IDX<|tool_call_argument_begin|>ARGS between Kimi's markers.
  const ToolMarkers& km = tool_markers(ToolFormat::KimiK2);
  auto kcall = [&](const std::string& id, const std::string& args) {
    return sp(km.call_begin) + id + sp(km.sep) + args + sp(km.call_end);
  };
  auto kcalls = [&](const std::string& inner) { return sp(km.calls_begin) + inner + sp(km.calls_end); };
  ParseOptions kimi;
  kimi.tool_format = ToolFormat::KimiK2;
  ParsedRequest kreq = parse_chat(json::parse(required), kimi, required);
  EXPECT_TRUE(matches(kreq, kcalls(kcall("functions.get_weather:0", R"({"unit": "C", "city": "Paris"})") +
                                   kcall("functions.now:1", "{}"))));
  EXPECT_FALSE(matches(kreq, kcalls(kcall("get_weather:0", R"({"city": "Paris"})"))));  // no functions. prefix
  EXPECT_FALSE(matches(kreq, kcalls(kcall("functions.get_weather", R"({"city": "Paris"})"))));  // no index
  EXPECT_FALSE(matches(kreq, kcalls(kcall("functions.later:0", "{}"))));  // not a tool
  EXPECT_FALSE(matches(kreq, calls(call("now", "{}"))));                  // DeepSeek's form
  EXPECT_EQ(tool_call_format("kimi_k2"), ToolFormat::KimiK2);
  EXPECT_FALSE(tool_call_format("kimi-k2").has_value());
}

TEST(Protocol, BodyMustBeJsonObject) {
  // Nesting past kMaxBodyDepth is a 400 (what reads the body recurses per level), even 100,000 levels deep.
  for (int levels : {kMaxBodyDepth + 1, 100000}) {
    const std::string deep = "{\"a\": " + std::string(levels, '[') + std::string(levels, ']') + "}";
    try {
      parse_body(deep);
      ADD_FAILURE() << levels;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_NE(std::string(e.what()).find("nests more than"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(parse_body("{\"a\": " + std::string(kMaxBodyDepth - 1, '[') + std::string(kMaxBodyDepth - 1, ']') +
                             "}"));
  for (const char* body : {"", "{", "[1]", "\"x\"", "{\"a\": }"}) {
    try {
      parse_body(body);
      ADD_FAILURE() << body;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
    }
  }
}

TEST(Protocol, ErrorBodyShape) {
  json j = json::parse(error_body(ApiError(400, "bad", "temperature", "invalid_value")));
  EXPECT_EQ(j["error"]["message"], "bad");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "temperature");
  EXPECT_EQ(j["error"]["code"], "invalid_value");
}

TEST(Protocol, FinishReasons) {
  FinishReason f;
  f.kind = FinishKind::Length;
  EXPECT_EQ(native_finish_reason(f, 7).dump(), R"({"type":"length","length":7})");
  f.kind = FinishKind::Stop;
  f.matched_token = 2;
  EXPECT_EQ(native_finish_reason(f, 7).dump(), R"({"type":"stop","matched":2})");
  f.matched_token = -1;
  f.matched_text = "\n";
  EXPECT_EQ(native_finish_reason(f, 7).dump(), R"({"type":"stop","matched":"\n"})");
  EXPECT_EQ(openai_finish_reason(f).dump(), R"("stop")");
}

// A Responses request becomes a chat request with its keys in the request's order, so a JSON schema's properties
// keep the order the constrained output writes them in.
TEST(Responses, TranslationKeepsTheRequestsKeyOrder) {
  const auto body = nlohmann::ordered_json::parse(R"({"input": "x", "text": {"format": {"type": "json_schema",
      "name": "n", "schema": {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type":
      "integer"}}, "required": ["zeta", "alpha"]}}}})");
  const std::string chat = responses_to_chat(body).dump();
  EXPECT_LT(chat.find("\"zeta\""), chat.find("\"alpha\"")) << chat;
  const ParsedRequest r = parse_chat(json::parse(chat), {}, chat);
  structured::Dfa dfa(structured::compile_regex(r.constraint_regex));
  EXPECT_TRUE(dfa.matches(R"({"zeta": 1, "alpha": 2})"));
  EXPECT_FALSE(dfa.matches(R"({"alpha": 2, "zeta": 1})"));
}

// bad_words as vLLM tokenizes them: the word without its leading blanks, and after a space when that spelling has as
// many tokens and a different first one.
TEST(Protocol, BadWordsTokenizeAloneAndAfterASpace) {
  // Words with an optional leading space are tokens when listed; anything else is one token per byte (100 + byte).
  struct WordCodec : TextCodec {
    std::map<std::string, int32_t> words{{"foo", 1}, {" foo", 2}, {" bar", 4}, {"x", 6}};
    std::vector<int32_t> encode(const std::string& text, bool) const override {
      std::vector<int32_t> ids;
      for (size_t i = 0; i < text.size();) {
        size_t end = text.find(' ', i + 1);
        if (end == std::string::npos) end = text.size();
        const std::string piece = text.substr(i, end - i);
        if (auto it = words.find(piece); it != words.end()) ids.push_back(it->second);
        else for (unsigned char c : piece) ids.push_back(100 + c);
        i = end;
      }
      return ids;
    }
    std::string decode(const std::vector<int32_t>&, bool) const override { return {}; }
    std::string apply_chat_template(const json&, bool, const json&) const override { return {}; }
    std::string name_or_path() const override { return "words"; }
    size_t vocab_size() const override { return 400; }
  } codec;
  using Ids = std::vector<std::vector<int32_t>>;
  EXPECT_EQ(bad_words_token_ids(codec, {"foo"}), (Ids{{1}, {2}}));
  EXPECT_EQ(bad_words_token_ids(codec, {"  foo bar"}), (Ids{{1, 4}, {2, 4}}));
  EXPECT_EQ(bad_words_token_ids(codec, {"x"}), (Ids{{6}}));  // " x" is two tokens: only the word alone
  EXPECT_EQ(bad_words_token_ids(codec, {"x", " foo"}), (Ids{{6}, {1}, {2}}));
}

}  // namespace
}  // namespace mlaserve::server
