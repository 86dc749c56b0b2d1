#include "server/protocol.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>

#include "core/error.h"
#include "server/api_error.h"
#include "server/tool_calls.h"
#include "structured/ebnf.h"
#include "structured/json_schema.h"
#include "structured/regex.h"

namespace mlaserve::server {
namespace {

using json = nlohmann::json;

const char* type_name(const json& v) { return json_type_name(v.type()); }

// Whether the object o has the string `want` at `key` (any other type or absence: false, never an exception).
bool member_is(const json& o, const char* key, std::string_view want) {
  const auto it = o.find(key);
  return it != o.end() && it->is_string() && it->get_ref<const std::string&>() == want;
}

}  // namespace

const json* Fields::get(const std::string& key) const {
  auto it = obj_.find(key);
  if (it == obj_.end() || it->is_null()) return nullptr;
  return &*it;
}

const json& Fields::required(const std::string& key, std::string_view what) const {
  const json* v = get(key);
  if (!v) bad_request(param(key), "invalid_value", "'{}' ({}) is required", param(key), what);
  return *v;
}

std::string Fields::required_string(const std::string& key, std::string_view what) const {
  required(key, what);
  return *string(key);
}

std::optional<double> Fields::number(const std::string& key, double lo, double hi, bool lo_open) const {
  const json* v = get(key);
  if (!v) return std::nullopt;
  if (!v->is_number())
    bad_request(param(key), "invalid_type", "'{}' must be a number, got {}", param(key), type_name(*v));
  double d = v->get<double>();
  if (!std::isfinite(d) || d < lo || d > hi || (lo_open && d == lo))
    bad_request(param(key), "invalid_value", "'{}' must be in {}{}, {}], got {}", param(key), lo_open ? "(" : "[", lo,
                hi, v->dump());
  return d;
}

std::optional<int64_t> Fields::integer(const std::string& key, int64_t lo, int64_t hi) const {
  const json* v = get(key);
  if (!v) return std::nullopt;
  return as_integer(*v, param(key), lo, hi);
}

int64_t Fields::as_integer(const json& v, const std::string& p, int64_t lo, int64_t hi) {
  int64_t i = 0;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      bad_request(p, "invalid_value", "'{}' must be in [{}, {}], got {}", p, lo, hi, v.dump());
    i = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    i = v.get<int64_t>();
  } else if (v.is_number_float() && std::isfinite(v.get<double>()) && std::floor(v.get<double>()) == v.get<double>() &&
             std::fabs(v.get<double>()) < 9e15) {
    i = static_cast<int64_t>(v.get<double>());
  } else {
    bad_request(p, "invalid_type", "'{}' must be an integer, got {}", p,
                v.is_number_float() ? "a fractional number" : type_name(v));
  }
  if (i < lo || i > hi) bad_request(p, "invalid_value", "'{}' must be in [{}, {}], got {}", p, lo, hi, i);
  return i;
}

std::optional<bool> Fields::boolean(const std::string& key) const {
  const json* v = get(key);
  if (!v) return std::nullopt;
  if (!v->is_boolean())
    bad_request(param(key), "invalid_type", "'{}' must be a boolean, got {}", param(key), type_name(*v));
  return v->get<bool>();
}

std::optional<std::string> Fields::string(const std::string& key) const {
  const json* v = get(key);
  if (!v) return std::nullopt;
  if (!v->is_string())
    bad_request(param(key), "invalid_type", "'{}' must be a string, got {}", param(key), type_name(*v));
  return v->get<std::string>();
}

void Fields::reject_unsupported(const std::string& key, const char* why) const {
  const json* v = get(key);
  if (!v) return;
  if ((v->is_array() || v->is_object() || v->is_string()) && v->empty()) return;
  if (v->is_boolean() && !v->get<bool>()) return;
  bad_request(param(key), "unsupported_parameter", "'{}' is not supported by this server ({})", param(key), why);
}

void Fields::allow_only(std::initializer_list<std::string_view> known, std::string_view what) const {
  for (const auto& [key, value] : obj_.items())
    if (std::find(known.begin(), known.end(), key) == known.end())
      bad_request(param(key), "invalid_value", "'{}' is not {} ({})", param(key), what, fmt::join(known, ", "));
}

namespace {

std::vector<int32_t> token_ids(const json& v, const std::string& p, bool allow_empty = false) {
  if (!v.is_array()) bad_request(p, "invalid_type", "'{}' must be an array of token ids, got {}", p, type_name(v));
  if (v.empty() && !allow_empty) bad_request(p, "invalid_value", "'{}' must not be empty", p);
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    ids.push_back(static_cast<int32_t>(
        Fields::as_integer(v[i], fmt::format("{}[{}]", p, i), 0, std::numeric_limits<int32_t>::max())));
  return ids;
}

bool is_id_list(const json& v) { return v.is_array() && !v.empty() && v[0].is_number(); }

// Structured output: the regex the generated text must match, from `param` (one such field per request). A regex
// the client wrote is compiled here to reject a bad one with a 400 (the automaton is then built from this compile;
// one compiled lately is not compiled again: compile_regex_shared); one made from a schema is checked where the
// server builds its automaton (once per regex: Api::constraint_for).
void set_constraint(ParsedRequest& r, const std::string& param, const std::string& regex, bool check) {
  if (!r.constraint_param.empty())
    bad_request(param, "invalid_value", "'{}' and '{}' both constrain the output; give one", r.constraint_param, param);
  r.constraint_nfa = nullptr;
  if (check) {
    try {
      r.constraint_nfa = structured::compile_regex_shared(regex);
    } catch (const Error& e) {
      bad_request(param, "invalid_value", "'{}': {}", param, e.what());
    }
  }
  r.constraint_param = param;
  r.constraint_regex = regex;
}

// An EBNF grammar (GBNF / xgrammar notation, structured/ebnf.h) as the constraint; its errors a 400 naming param.
void set_grammar_constraint(ParsedRequest& r, const std::string& param, const std::string& grammar) {
  std::string regex;
  try {
    regex = structured::ebnf_regex(grammar);
  } catch (const Error& e) {
    bad_request(param, "invalid_value", "'{}': {}", param, e.what());
  }
  set_constraint(r, param, regex, /*check=*/true);  // its classes are written as the grammar wrote them
}

// The request body's text read again with its keys in the request's order (parse_body's JSON sorts them); null
// when there is no text.
nlohmann::ordered_json ordered_body(std::string_view raw) {
  return raw.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json::parse(raw, nullptr, false);
}

// The object at `param` (dotted: "response_format.json_schema.schema", "tools.0.function.parameters") of
// ordered_body's JSON; false when there is none.
bool ordered_at(const nlohmann::ordered_json& whole, const std::string& param, nlohmann::ordered_json& out) {
  const nlohmann::ordered_json* at = &whole;
  for (size_t b = 0; b <= param.size();) {
    const size_t e = std::min(param.find('.', b), param.size());
    const std::string key = param.substr(b, e - b);
    if (at->is_array() && !key.empty() && key.find_first_not_of("0123456789") == std::string::npos) {
      const size_t i = std::stoul(key);  // an array index ("tools.0.function.parameters")
      if (i >= at->size()) return false;
      at = &(*at)[i];
    } else {
      if (!at->is_object() || !at->contains(key)) return false;
      at = &(*at)[key];
    }
    b = e + 1;
  }
  if (!at->is_object()) return false;
  out = *at;
  return true;
}

// json_schema_regex of the schema at `param`, or a 400 naming it with what the schema cannot express.
std::string schema_regex(const std::string& param, const nlohmann::ordered_json& schema, bool compact = false) {
  try {
    return structured::json_schema_regex(schema, compact);
  } catch (const Error& e) {
    bad_request(param, "invalid_value", "'{}': {}", param, e.what());
  }
}

// A JSON schema (an object, or SGLang's JSON text of one) at `param` as its regex; raw: the body's text (an object's
// properties keep their order), or empty.
void set_schema_constraint(ParsedRequest& r, const std::string& param, const json& v, std::string_view raw) {
  nlohmann::ordered_json schema;
  if (v.is_object() && ordered_at(ordered_body(raw), param, schema)) {
  } else if (v.is_string()) {
    schema = nlohmann::ordered_json::parse(v.get<std::string>(), nullptr, false);
    if (schema.is_discarded()) bad_request(param, "invalid_value", "'{}' is not valid JSON", param);
  } else if (v.is_object() || v.is_boolean()) {
    schema = nlohmann::ordered_json::parse(v.dump());
  } else {
    bad_request(param, "invalid_type", "'{}' must be a JSON schema (an object or its JSON text), got {}", param,
                type_name(v));
  }
  set_constraint(r, param, schema_regex(param, schema), /*check=*/false);
}

// A structural tag (SGLang's response_format / structural_tag, vLLM's structured_outputs.structural_tag; an object or
// its JSON text): {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]} (a "type" other than
// "structural_tag" is a 400). Free text holding no trigger, then one of the structures whose begin starts with the
// trigger that appeared (the rest of begin, JSON of its schema, end), then free text again, any number of times; the
// text may end only in free text. raw: the body's text (the schemas' property order).
void set_structural_tag_constraint(ParsedRequest& r, const std::string& param, const json& v, std::string_view raw) {
  nlohmann::ordered_json tag;
  if (v.is_string()) {
    tag = nlohmann::ordered_json::parse(v.get<std::string>(), nullptr, false);
    if (tag.is_discarded()) bad_request(param, "invalid_value", "'{}' is not valid JSON", param);
  } else if (v.is_object()) {
    if (!ordered_at(ordered_body(raw), param, tag)) tag = nlohmann::ordered_json::parse(v.dump());
  }
  if (!tag.is_object())
    bad_request(param, "invalid_type", "'{}' must be a structural tag (an object or its JSON text), got {}", param,
                type_name(v));
  if (tag.contains("type") && tag["type"] != "structural_tag")
    bad_request(param, "invalid_value", "'{}.type' must be 'structural_tag' (the structures / triggers form)", param);
  const auto strings = [&](const char* key) {
    std::vector<std::string> out;
    const auto it = tag.find(key);
    if (it == tag.end() || !it->is_array() || it->empty())
      bad_request(param, "invalid_value", "'{}.{}' must be a non-empty array", param, key);
    for (size_t i = 0; i < it->size(); ++i) {
      const auto& s = (*it)[i];
      if (!s.is_string() || s.get<std::string>().empty())
        bad_request(param, "invalid_value", "'{}.{}[{}]' must be a non-empty string", param, key, i);
      out.push_back(s.get<std::string>());
    }
    return out;
  };
  const std::vector<std::string> triggers = strings("triggers");
  const auto st = tag.find("structures");
  if (st == tag.end() || !st->is_array() || st->empty())
    bad_request(param, "invalid_value", "'{}.structures' must be a non-empty array", param);
  std::string text = "(?~", structures;  // text: free text holding no trigger
  for (size_t i = 0; i < triggers.size(); ++i) {
    if (i) text += '|';
    text += structured::regex_escape(triggers[i]);
  }
  text += ")";
  for (size_t i = 0; i < st->size(); ++i) {
    const auto& s = (*st)[i];
    const std::string at = fmt::format("{}.structures[{}]", param, i);
    if (!s.is_object() || !s.contains("begin") || !s["begin"].is_string() || !s.contains("end") ||
        !s["end"].is_string() || !s.contains("schema") || !(s["schema"].is_object() || s["schema"].is_boolean()))
      bad_request(at, "invalid_value", "'{}' must be an object with 'begin', 'schema' and 'end'", at);
    const std::string begin = s["begin"].get<std::string>(), end = s["end"].get<std::string>();
    if (std::none_of(triggers.begin(), triggers.end(), [&](const std::string& t) { return begin.rfind(t, 0) == 0; }))
      bad_request(at, "invalid_value", "'{}.begin' must start with one of the triggers", at);
    const std::string schema = schema_regex(at + ".schema", s["schema"]);
    if (i) structures += '|';  // appended piece by piece: GCC 12 warns falsely on "x" + a temporary
    structures += structured::regex_escape(begin);
    structures += '(';
    structures += schema;
    structures += ')';
    structures += structured::regex_escape(end);
  }
  set_constraint(r, param, "(" + text + "(" + structures + "))*" + text, /*check=*/false);
}

// vLLM's guided_choice: the output is exactly one of the listed strings.
void set_choice_constraint(ParsedRequest& r, const std::string& param, const json& v) {
  if (!v.is_array() || v.empty())
    bad_request(param, "invalid_type", "'{}' must be a non-empty array of strings", param);
  std::string re;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string() || v[i].get<std::string>().empty())
      bad_request(param, "invalid_value", "'{}[{}]' must be a non-empty string", param, i);
    if (i) re += '|';
    re += structured::regex_escape(v[i].get<std::string>());
  }
  set_constraint(r, param, "(" + re + ")", /*check=*/false);
}

// tool_choice required (forced == "") or a named function: the output is tool calls in format `f` (its markers are
// special tokens: `\C` + their text in the constraint's vocabulary) of those tools, the arguments JSON of each
// tool's parameters (at most a space between tokens); one call for a named function or parallel_tool_calls false,
// else one or more. DeepSeek V3 / R1: function<｜tool▁sep｜>NAME and a json fence; V3.1: NAME<｜tool▁sep｜>ARGS;
// Kimi-K2: functions.NAME:IDX<|tool_call_argument_begin|>ARGS.
void set_tool_constraint(ParsedRequest& r, const std::string& forced, std::string_view raw, ToolFormat f) {
  if (r.tools.is_null())
    bad_request("tool_choice", "invalid_value", "'tool_choice' '{}' needs 'tools'",
                forced.empty() ? "required" : forced);
  auto marker = [](std::string_view text) { return "\\C" + structured::regex_escape(text); };
  std::string calls;
  const nlohmann::ordered_json body = ordered_body(raw);  // read once for every tool's parameters
  for (size_t i = 0; i < r.tools.size(); ++i) {
    const json& fn = r.tools[i]["function"];
    const std::string name = fn["name"].get<std::string>();
    if (!forced.empty() && name != forced) continue;
    const std::string path = fmt::format("tools.{}.function.parameters", i);
    nlohmann::ordered_json params = nlohmann::ordered_json::object({{"type", "object"}});
    if (fn.contains("parameters") && fn["parameters"].is_object() && !ordered_at(body, path, params))
      params = nlohmann::ordered_json::parse(fn["parameters"].dump());
    const std::string args = schema_regex(fmt::format("tools[{}].function.parameters", i), params, /*compact=*/true);
    const ToolMarkers& m = tool_markers(f);
    std::string call;
    if (f == ToolFormat::KimiK2)
      call = "functions\\." + structured::regex_escape(name) + ":[0-9]+" + marker(m.sep) + "(" + args + ")";
    else if (f == ToolFormat::DeepseekV31)
      call = structured::regex_escape(name) + marker(m.sep) + "(" + args + ")";
    else
      call = "function" + marker(m.sep) + structured::regex_escape(name) + "\n```json\n(" + args + ")\n```";
    calls += (calls.empty() ? "" : "|") + marker(m.call_begin) + call + marker(m.call_end);
  }
  if (calls.empty())
    bad_request("tool_choice", "invalid_value", "'tool_choice' names '{}', which is not in 'tools'", forced);
  const bool one = !forced.empty() || !r.parallel_tool_calls;
  set_constraint(r, "tool_choice", marker(tool_markers(f).calls_begin) + "(" + calls + ")" + (one ? "" : "+") +
                                       marker(tool_markers(f).calls_end), /*check=*/false);
  r.forced_tool_calls = true;
}

// OpenAI's response_format: text, json_object (any JSON object) or json_schema ({"json_schema": {"name", "schema",
// "strict"}}). raw: the request body's text, read again for the schema's property order (parse_body's JSON sorts
// keys).
void parse_response_format(const Fields& f, ParsedRequest& r, std::string_view raw) {
  const json* rf = f.get("response_format");
  if (!rf) return;
  if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
    bad_request("response_format", "invalid_value", "'response_format' must be an object with a 'type'");
  const std::string type = (*rf)["type"].get<std::string>();
  if (type == "text") return;
  if (type == "json_object") {
    set_constraint(r, "response_format", structured::json_object_regex(), /*check=*/false);
    return;
  }
  if (type == "structural_tag") {  // SGLang's
    set_structural_tag_constraint(r, "response_format", *rf, raw);
    return;
  }
  if (type != "json_schema")
    bad_request("response_format.type", "invalid_value",
                "'response_format.type' must be 'text', 'json_object', 'json_schema' or 'structural_tag', got '{}'",
                type);
  const json* js = rf->contains("json_schema") ? &(*rf)["json_schema"] : nullptr;
  if (!js || !js->is_object() || !js->contains("schema"))
    bad_request("response_format.json_schema", "invalid_value",
                "'response_format.json_schema' must be an object with a 'schema'");
  set_schema_constraint(r, "response_format.json_schema.schema", (*js)["schema"], raw);
}

// A string or an array of at most `max` strings (`what` names them in the error).
std::vector<std::string> string_list(const json& v, const std::string& p, int32_t max, const char* what) {
  if (v.is_string()) return {v.get<std::string>()};
  if (!v.is_array())
    bad_request(p, "invalid_type", "'{}' must be a string or an array of strings, got {}", p, type_name(v));
  if (v.size() > static_cast<size_t>(max))
    bad_request(p, "invalid_value", "'{}' has {} {}; at most {} are allowed", p, v.size(), what, max);
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string())
      bad_request(p, "invalid_type", "'{}[{}]' must be a string, got {}", p, i, type_name(v[i]));
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

// Sampling fields shared by all three APIs. `max_tokens_keys` are the names max_new_tokens goes by; 0 only where
// `zero_ok` (a request that only reads its prompt's logprobs).
// The server's sampling defaults, before a request's own fields (every API, with or without sampling fields).
void apply_defaults(const SamplingDefaults& d, SamplingParams& s) {
  if (d.temperature) s.temperature = *d.temperature;
  if (d.top_p) s.top_p = *d.top_p;
  if (d.top_k) s.top_k = *d.top_k;
  if (d.min_p) s.min_p = *d.min_p;
  if (d.repetition_penalty) s.repetition_penalty = *d.repetition_penalty;
}

void parse_sampling(const Fields& f, const std::vector<std::string>& max_tokens_keys, const ParseOptions& opts,
                    ParsedRequest& r, std::string_view raw, bool zero_ok = false) {
  SamplingParams& s = r.sampling;
  for (const auto& k : max_tokens_keys)
    if (auto v = f.integer(k, zero_ok ? 0 : 1, std::numeric_limits<int32_t>::max())) {
      s.max_new_tokens = static_cast<int32_t>(*v);
      r.max_new_tokens_given = true;
    }
  if (auto v = f.number("temperature", 0.0, 100.0)) s.temperature = static_cast<float>(*v);
  if (auto v = f.number("top_p", 0.0, 1.0, /*lo_open=*/true)) s.top_p = static_cast<float>(*v);
  if (auto v = f.integer("top_k", -1, 1 << 30)) s.top_k = *v <= 0 ? -1 : static_cast<int32_t>(*v);
  if (auto v = f.number("min_p", 0.0, 1.0)) s.min_p = static_cast<float>(*v);
  if (auto v = f.number("frequency_penalty", -2.0, 2.0)) s.frequency_penalty = static_cast<float>(*v);
  if (auto v = f.number("presence_penalty", -2.0, 2.0)) s.presence_penalty = static_cast<float>(*v);
  if (auto v = f.number("repetition_penalty", 0.0, 2.0, /*lo_open=*/true)) s.repetition_penalty = static_cast<float>(*v);
  if (auto v = f.boolean("ignore_eos")) s.ignore_eos = *v;
  if (auto v = f.boolean("skip_special_tokens")) r.skip_special_tokens = *v;
  if (auto v = f.integer("n", 1, opts.max_n)) r.n = static_cast<int32_t>(*v);
  for (const char* key : {"seed", "sampling_seed"})
    if (auto v = f.integer(key, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()))
      s.seed = static_cast<uint64_t>(*v);
  if (const json* v = f.get("stop")) {
    const std::string p = f.param("stop");
    r.stop = string_list(*v, p, opts.max_stop_strings, "stop strings");
    for (const auto& s2 : r.stop)
      if (s2.empty()) bad_request(p, "invalid_value", "'{}' must not contain empty strings", p);
  }
  if (const json* v = f.get("stop_regex")) {  // SGLang's: patterns searched in the output text
    r.stop_regex_param = f.param("stop_regex");
    r.stop_regex = string_list(*v, r.stop_regex_param, opts.max_stop_strings, "stop patterns");
    for (const auto& s2 : r.stop_regex)
      if (s2.empty()) bad_request(r.stop_regex_param, "invalid_value", "'{}' must not contain empty patterns",
                                  r.stop_regex_param);
  }
  if (const json* v = f.get("stop_token_ids")) {
    const std::string p = f.param("stop_token_ids");
    if (!v->is_array())
      bad_request(p, "invalid_type", "'{}' must be an array of token ids, got {}", p, type_name(*v));
    for (size_t i = 0; i < v->size(); ++i)
      s.stop_token_ids.push_back(static_cast<int32_t>(
          Fields::as_integer((*v)[i], fmt::format("{}[{}]", p, i), 0, std::numeric_limits<int32_t>::max())));
  }
  // A reasoning model's thinking budget: SGLang's thinking_budget, vLLM's thinking_token_budget (the markers are the
  // tokenizer's, found by the server: routes.cpp).
  for (const char* key : {"thinking_budget", "thinking_token_budget"})
    if (auto v = f.integer(key, 0, std::numeric_limits<int32_t>::max())) {
      s.thinking_budget = static_cast<int32_t>(*v);
      r.thinking_budget_param = f.param(key);
    }
  // vLLM's allowed_token_ids (only these may be drawn) and bad_words (tokenized by the server: routes.cpp).
  if (const json* v = f.get("allowed_token_ids")) s.allowed_token_ids = token_ids(*v, f.param("allowed_token_ids"));
  if (const json* v = f.get("bad_words")) {
    const std::string p = f.param("bad_words");
    r.bad_words = string_list(*v, p, opts.max_bad_words, "words");
    for (size_t i = 0; i < r.bad_words.size(); ++i)
      if (r.bad_words[i].find_first_not_of(" \t\n\r\f\v") == std::string::npos)
        bad_request(p, "invalid_value", "'{}' must not contain empty or blank words (word {})", p, i);
  }
  if (const json* v = f.get("logit_bias")) {
    // {"<token id>": bias in [-100, 100]} (OpenAI; SGLang's sampling_params take the same object).
    const std::string p = f.param("logit_bias");
    if (!v->is_object())
      bad_request(p, "invalid_type", "'{}' must be an object of token id -> bias, got {}", p, type_name(*v));
    for (const auto& [key, bias] : v->items()) {
      int64_t id = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      if (ec != std::errc() || end != key.data() + key.size() || id < 0 || id > std::numeric_limits<int32_t>::max())
        bad_request(p, "invalid_value", "'{}' keys must be token ids (non-negative integers), got \"{}\"", p, key);
      if (!bias.is_number() || !std::isfinite(bias.get<double>()) || bias.get<double>() < -100.0 ||
          bias.get<double>() > 100.0)
        bad_request(p, "invalid_value", "'{}[\"{}\"]' must be a number in [-100, 100], got {}", p, key, bias.dump());
      s.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(bias.get<double>()));
    }
    std::sort(s.logit_bias.begin(), s.logit_bias.end());
    for (size_t i = 1; i < s.logit_bias.size(); ++i)
      if (s.logit_bias[i].first == s.logit_bias[i - 1].first)
        bad_request(p, "invalid_value", "'{}' names token {} twice", p, s.logit_bias[i].first);
  }
  // SGLang's regex / json_schema; vLLM's guided_regex / guided_json / guided_choice and structured_outputs.
  for (const char* key : {"regex", "guided_regex"})
    if (auto v = f.string(key)) set_constraint(r, f.param(key), *v, /*check=*/true);
  for (const char* key : {"json_schema", "guided_json"})
    if (const json* v = f.get(key); v && !v->is_null()) set_schema_constraint(r, f.param(key), *v, raw);
  if (const json* v = f.get("guided_choice"); v && !v->is_null())
    set_choice_constraint(r, f.param("guided_choice"), *v);
  if (const json* v = f.get("structured_outputs"); v && !v->is_null()) {
    const std::string p = f.param("structured_outputs");
    if (!v->is_object()) bad_request(p, "invalid_type", "'{}' must be an object, got {}", p, type_name(*v));
    for (const auto& [key, val] : v->items()) {
      if (val.is_null()) continue;
      const std::string kp = p + "." + key;
      if (key == "regex" && val.is_string()) set_constraint(r, kp, val.get<std::string>(), /*check=*/true);
      else if (key == "json") set_schema_constraint(r, kp, val, raw);
      else if (key == "choice") set_choice_constraint(r, kp, val);
      else if (key == "json_object" && val.is_boolean()) {
        if (val.get<bool>()) set_constraint(r, kp, structured::json_object_regex(), /*check=*/false);
      } else if (key == "grammar" && val.is_string()) {
        set_grammar_constraint(r, kp, val.get<std::string>());
      } else if (key == "structural_tag") {
        set_structural_tag_constraint(r, kp, val, raw);
      }
      else if (key != "disable_fallback" && key != "disable_any_whitespace" &&
               key != "disable_additional_properties" && key != "whitespace_pattern")
        bad_request(kp, "invalid_value", "'{}' is not a structured output this server knows (or has the wrong type)",
                    kp);
    }
  }
  for (const char* key : {"ebnf", "guided_grammar"})
    if (auto v = f.string(key)) set_grammar_constraint(r, f.param(key), *v);
  if (const json* v = f.get("structural_tag"); v && !v->is_null())
    set_structural_tag_constraint(r, f.param("structural_tag"), *v, raw);
  // SGLang's min_new_tokens; vLLM's and SGLang's OpenAI endpoints call it min_tokens.
  for (const char* key : {"min_new_tokens", "min_tokens"})
    if (auto v = f.integer(key, 0, std::numeric_limits<int32_t>::max())) {
      s.min_new_tokens = static_cast<int32_t>(*v);
      if (r.max_new_tokens_given && s.min_new_tokens > s.max_new_tokens)
        bad_request(f.param(key), "invalid_value", "'{}' ({}) must not exceed the maximum number of new tokens ({})",
                    f.param(key), s.min_new_tokens, s.max_new_tokens);
    }
}

void parse_stream_options(const Fields& f, ParsedRequest& r) {
  if (auto v = f.boolean("stream")) r.stream = *v;
  if (const json* so = f.get("stream_options")) {
    if (!so->is_object())
      bad_request("stream_options", "invalid_type", "'stream_options' must be an object, got {}", type_name(*so));
    Fields sf(*so, "stream_options.");
    if (auto v = sf.boolean("include_usage")) r.include_usage = *v;
    if (auto v = sf.boolean("continuous_usage_stats")) r.continuous_usage = *v;
    if (!r.stream)
      bad_request("stream_options", "invalid_value", "'stream_options' is only allowed when 'stream' is true");
  }
}

// One field's part of a cache salt (unambiguous: lengths given).
std::string salt_part(const char* key, const std::string& v) {
  if (v.empty()) bad_request(key, "invalid_value", "'{}' must be a non-empty string", key);
  return fmt::format("{}:{}:{};", key, v.size(), v);
}

// vLLM's cache_salt and SGLang's extra_key (either API takes both): the request's tree of the prefix cache, "" none.
// lists: SGLang's extra_key may be a list (a native batch's, one per prompt), left to the caller.
std::string cache_salt(const Fields& f, bool lists = false) {
  std::string salt;
  for (const char* key : {"cache_salt", "extra_key"}) {
    if (lists && std::string_view(key) == "extra_key" && f.get(key) && f.get(key)->is_array()) continue;
    if (const std::optional<std::string> v = f.string(key)) salt += salt_part(key, *v);
  }
  return salt;
}

void parse_openai_common(const Fields& f, const ParseOptions& opts, ParsedRequest& r) {
  if (auto v = f.string("model")) r.model = *v;
  r.cache_salt = cache_salt(f);
  if (auto v = f.string("request_id")) {  // vLLM's: the response id's base
    if (v->empty()) bad_request("request_id", "invalid_value", "'request_id' must not be empty");
    r.request_id = *v;
  }
  // vLLM's fields for what this server does not run: embeddings as the prompt, Python logits processors.
  f.reject_unsupported("prompt_embeds", "prompts are text or token ids");
  f.reject_unsupported("logits_processors", "no Python logits processor runs here");
  if (const json* kv = f.get("kv_transfer_params")) r.kv_transfer = parse_kv_transfer_params(*kv);
  if (const json* b = f.get("best_of")) {
    int64_t best_of = Fields::as_integer(*b, "best_of", 1, opts.max_n);
    if (best_of != r.n) bad_request("best_of", "unsupported_parameter", "'best_of' different from 'n' is not supported");
  }
  parse_stream_options(f, r);
  // Keep a matched stop string in the text: SGLang's no_stop_trim, vLLM's include_stop_str_in_output.
  for (const char* key : {"no_stop_trim", "include_stop_str_in_output"})
    if (auto v = f.boolean(key)) r.no_stop_trim = *v;
  if (auto v = f.boolean("add_special_tokens")) r.add_special_tokens = *v;
  if (auto v = f.integer("priority", -std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::max()))
    r.priority = static_cast<int32_t>(*v);
  if (auto v = f.integer("truncate_prompt_tokens", -1, std::numeric_limits<int32_t>::max()))
    r.truncate_prompt_tokens = static_cast<int32_t>(*v);
  r.tokens_as_ids = opts.return_tokens_as_token_ids;
  if (auto v = f.boolean("return_tokens_as_token_ids")) r.tokens_as_ids = *v;
  if (auto v = f.boolean("return_token_ids")) r.return_token_ids = *v;
  if (auto v = f.boolean("return_hidden_states")) r.return_hidden_states = {*v};  // SGLang's
  if (auto v = f.boolean("return_routed_experts")) r.return_routed_experts = {*v};
  // vLLM's prompt_logprobs: each prompt token's logprob and rank, with this many alternatives.
  if (auto v = f.integer("prompt_logprobs", 0, opts.max_top_logprobs)) {
    r.prompt_logprobs = static_cast<int32_t>(*v);
    r.sampling.logprob_start_len = 0;
  }
}

// SGLang's session_params ({"id", "rid", "offset", "replace", "drop_previous_output"}); nullopt without an id (a
// request outside any session, as SGLang runs it).
std::optional<SessionParams> session_params(const json& v) {
  const std::string p = "session_params";
  if (!v.is_object()) bad_request(p, "invalid_type", "'{}' must be an object, got {}", p, type_name(v));
  Fields f(v, p + ".");
  f.allow_only({"id", "rid", "offset", "replace", "drop_previous_output"}, "a session parameter");
  auto id = f.string("id");
  if (!id) return std::nullopt;
  SessionParams s;
  s.id = std::move(*id);
  s.rid = f.string("rid");
  if (auto o = f.integer("offset", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()))
    s.offset = *o;
  if (auto b = f.boolean("replace")) s.replace = *b;
  if (auto b = f.boolean("drop_previous_output")) s.drop_previous_output = *b;
  return s;
}

}  // namespace

std::vector<int32_t> token_id_list(const json& v, const std::string& param, bool allow_empty) {
  return token_ids(v, param, allow_empty);
}

const char* json_type_name(nlohmann::json::value_t t) {
  using json = nlohmann::json;
  switch (t) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean";
    case json::value_t::string: return "string";
    case json::value_t::array: return "array";
    case json::value_t::object: return "object";
    case json::value_t::number_float: return "number";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    default: return "value";
  }
}

namespace {

template <typename J>
J parse_body_as(const std::string& body) {
  J j;
  // Nesting is bounded: what reads the body (JSON schemas, tools into the chat template) recurses once per level.
  bool too_deep = false;
  const typename J::parser_callback_t depth = [&](int d, typename J::parse_event_t, J&) {
    if (d > kMaxBodyDepth) too_deep = true;
    return !too_deep;
  };
  try {
    j = J::parse(body, depth);
  } catch (const nlohmann::json::parse_error& e) {
    throw ApiError(400, fmt::format("the request body is not valid JSON: {}", e.what()), "", "invalid_json");
  }
  if (too_deep)
    throw ApiError(400, fmt::format("the request body nests more than {} levels", kMaxBodyDepth), "",
                   "invalid_value");
  if (!j.is_object())
    throw ApiError(400, fmt::format("the request body must be a JSON object, got {}", json_type_name(j.type())), "",
                   "invalid_type");
  return j;
}

}  // namespace

nlohmann::json parse_body(const std::string& body) { return parse_body_as<nlohmann::json>(body); }
nlohmann::ordered_json parse_body_ordered(const std::string& body) {
  return parse_body_as<nlohmann::ordered_json>(body);
}

ParsedRequest parse_native(const json& body, const ParseOptions& opts, std::string_view raw) {
  ParsedRequest r;
  r.api = ApiKind::Native;
  Fields f(body, "");
  const json* text = f.get("text");
  const json* ids = f.get("input_ids");
  for (const char* unsupported : {"input_embeds", "image_data", "audio_data", "lora_path"})
    f.reject_unsupported(unsupported, "text-only model");
  // SGLang's Python logit processor (pickled; SGLang too refuses it unless started with
  // --enable-custom-logit-processor).
  f.reject_unsupported("custom_logit_processor", "a Python logit processor cannot run here");
  if (const json* sp = f.get("session_params")) r.session = session_params(*sp);
  r.cache_salt = cache_salt(f, /*lists=*/true);
  if (text && ids) bad_request("text", "invalid_value", "give either 'text' or 'input_ids', not both");
  if (!text && !ids) bad_request("text", "invalid_value", "one of 'text' or 'input_ids' is required");
  if (text) {
    if (text->is_string()) {
      r.prompts.push_back({text->get<std::string>(), {}});
    } else if (text->is_array()) {
      if (text->empty()) bad_request("text", "invalid_value", "'text' must not be an empty array");
      if (text->size() > opts.max_batch)
        bad_request("text", "invalid_value", "'text' has {} prompts; at most {} are allowed", text->size(),
                    opts.max_batch);
      r.batch = true;
      for (size_t i = 0; i < text->size(); ++i) {
        if (!(*text)[i].is_string())
          bad_request("text", "invalid_type", "'text[{}]' must be a string, got {}", i, type_name((*text)[i]));
        r.prompts.push_back({(*text)[i].get<std::string>(), {}});
      }
    } else {
      bad_request("text", "invalid_type", "'text' must be a string or an array of strings, got {}", type_name(*text));
    }
  } else {
    if (!ids->is_array() || ids->empty())
      bad_request("input_ids", ids->is_array() ? "invalid_value" : "invalid_type",
                  "'input_ids' must be a non-empty array of token ids or of arrays of token ids");
    if ((*ids)[0].is_array()) {
      if (ids->size() > opts.max_batch)
        bad_request("input_ids", "invalid_value", "'input_ids' has {} prompts; at most {} are allowed", ids->size(),
                    opts.max_batch);
      r.batch = true;
      for (size_t i = 0; i < ids->size(); ++i)
        r.prompts.push_back({std::nullopt, token_ids((*ids)[i], fmt::format("input_ids[{}]", i))});
    } else {
      r.prompts.push_back({std::nullopt, token_ids(*ids, "input_ids")});
    }
  }
  apply_defaults(opts.defaults, r.sampling);
  if (const json* sp = f.get("sampling_params")) {
    if (!sp->is_object())
      bad_request("sampling_params", "invalid_type", "'sampling_params' must be an object, got {}", type_name(*sp));
    Fields sf(*sp, "sampling_params.");
    parse_sampling(sf, {"max_new_tokens"}, opts, r, raw, /*zero_ok=*/true);
    if (auto v = sf.boolean("no_stop_trim")) r.no_stop_trim = *v;
    if (auto v = sf.boolean("return_hidden_states")) r.return_hidden_states = {*v};  // (SGLang's earlier place)
  }
  if (auto v = f.boolean("stream")) r.stream = *v;
  if (const json* rid = f.get("rid")) {
    if (rid->is_string()) r.rid = rid->get<std::string>();
    else if (!rid->is_array()) bad_request("rid", "invalid_type", "'rid' must be a string, got {}", type_name(*rid));
  }
  if (auto v = f.integer("priority", -std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::max()))
    r.priority = static_cast<int32_t>(*v);
  if (auto v = f.boolean("return_logprob")) r.logprobs = *v;
  if (auto v = f.integer("top_logprobs_num", 0, opts.max_top_logprobs)) r.top_logprobs = static_cast<int32_t>(*v);
  if (auto v = f.boolean("return_text_in_logprobs")) r.return_text_in_logprobs = *v;
  // Prompt logprobs from this position on (checked against the prompt's length by the engine).
  if (auto v = f.integer("logprob_start_len", -1, std::numeric_limits<int32_t>::max()); v && r.logprobs)
    r.sampling.logprob_start_len = static_cast<int32_t>(*v);
  // SGLang's token_ids_logprob: one list of ids for every prompt, or (a batch) one list per prompt; read with
  // return_logprob only, as SGLang does.
  if (const json* v = f.get("token_ids_logprob")) {
    const std::string p = "token_ids_logprob";
    if (!v->is_array()) bad_request(p, "invalid_type", "'{}' must be an array of token ids, got {}", p, type_name(*v));
    auto ids = [&](const json& list, const std::string& lp) {
      if (list.is_array() && list.size() > static_cast<size_t>(opts.max_token_ids_logprob))
        bad_request(lp, "invalid_value", "'{}' has {} ids; at most {} are allowed", lp, list.size(),
                    opts.max_token_ids_logprob);
      return token_ids(list, lp, /*allow_empty=*/true);
    };
    if (!v->empty() && (*v)[0].is_array()) {
      if (!r.batch || v->size() != r.prompts.size())
        bad_request(p, "invalid_value",
                    "'{}' as a list of lists needs one list per prompt of a batch ({} prompts, {} lists)", p,
                    r.prompts.size(), v->size());
      for (size_t i = 0; i < v->size(); ++i) r.token_ids_logprob.push_back(ids((*v)[i], fmt::format("{}[{}]", p, i)));
    } else {
      r.token_ids_logprob.push_back(ids(*v, p));
    }
    if (!r.logprobs) r.token_ids_logprob.clear();
  }
  // SGLang's extra_key as a list: one per prompt of a batch (each prompt's cache tree: cache_salt's, then its own).
  if (const json* v = f.get("extra_key"); v && v->is_array()) {
    if (!r.batch || v->size() != r.prompts.size())
      bad_request("extra_key", "invalid_value", "'extra_key' as a list needs one string per prompt of a batch ({} "
                  "prompts, {} strings)", r.prompts.size(), v->size());
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_string())
        bad_request("extra_key", "invalid_type", "'extra_key[{}]' must be a string, got {}", i, type_name((*v)[i]));
      r.prompt_salts.push_back(r.cache_salt + salt_part("extra_key", (*v)[i].get<std::string>()));
    }
  }
  // SGLang's return_hidden_states and return_routed_experts: a boolean, or (a batch) one per prompt.
  for (const char* key : {"return_hidden_states", "return_routed_experts"}) {
    const json* v = f.get(key);
    if (!v) continue;
    const std::string p = key;
    std::vector<bool>& out = p == "return_hidden_states" ? r.return_hidden_states : r.return_routed_experts;
    if (v->is_boolean()) {
      out = {v->get<bool>()};
    } else if (v->is_array() && r.batch && v->size() == r.prompts.size()) {
      out.clear();
      for (size_t i = 0; i < v->size(); ++i) {
        if (!(*v)[i].is_boolean())
          bad_request(p, "invalid_type", "'{}[{}]' must be a boolean, got {}", p, i, type_name((*v)[i]));
        out.push_back((*v)[i].get<bool>());
      }
    } else {
      bad_request(p, v->is_array() ? "invalid_value" : "invalid_type",
                  "'{}' must be a boolean, or one boolean per prompt of a batch ({} prompts)", p, r.prompts.size());
    }
  }
  return r;
}

ParsedRequest parse_completions(const json& body, const ParseOptions& opts, std::string_view raw) {
  ParsedRequest r;
  r.api = ApiKind::Completions;
  Fields f(body, "");
  const json* prompt = f.get("prompt");
  if (!prompt) bad_request("prompt", "invalid_value", "'prompt' is required");
  if (prompt->is_string()) {
    r.prompts.push_back({prompt->get<std::string>(), {}});
  } else if (prompt->is_array() && !prompt->empty()) {
    if (prompt->size() > opts.max_batch)
      bad_request("prompt", "invalid_value", "'prompt' has {} prompts; at most {} are allowed", prompt->size(),
                  opts.max_batch);
    if (is_id_list(*prompt)) {
      r.prompts.push_back({std::nullopt, token_ids(*prompt, "prompt")});
    } else {
      r.batch = true;
      for (size_t i = 0; i < prompt->size(); ++i) {
        const json& p = (*prompt)[i];
        if (p.is_string()) r.prompts.push_back({p.get<std::string>(), {}});
        else if (p.is_array()) r.prompts.push_back({std::nullopt, token_ids(p, fmt::format("prompt[{}]", i))});
        else bad_request("prompt", "invalid_type", "'prompt[{}]' must be a string or an array of token ids, got {}", i,
                         type_name(p));
      }
    }
  } else {
    bad_request("prompt", prompt->is_array() ? "invalid_value" : "invalid_type",
                "'prompt' must be a string, an array of strings, or (arrays of) token ids");
  }
  if (auto v = f.boolean("echo")) r.echo = *v;
  if (const json* sfx = f.get("suffix")) {  // fill in the middle (null: none)
    if (!sfx->is_string()) bad_request("suffix", "invalid_type", "'suffix' must be a string, got {}", type_name(*sfx));
    if (r.echo) bad_request("suffix", "invalid_value", "'suffix' cannot be combined with 'echo'");
    if (!sfx->get<std::string>().empty()) r.suffix = sfx->get<std::string>();  // "": no hole, a plain completion
  }
  // max_tokens 0 with echo: the prompt alone (and its logprobs), as vLLM allows.
  apply_defaults(opts.defaults, r.sampling);
  parse_sampling(f, {"max_tokens"}, opts, r, raw, /*zero_ok=*/r.echo);
  if (!r.max_new_tokens_given) r.sampling.max_new_tokens = 16;  // OpenAI's default for completions
  if (const json* lp = f.get("logprobs")) {
    r.logprobs = true;
    r.top_logprobs = static_cast<int32_t>(Fields::as_integer(*lp, "logprobs", 0, opts.max_top_logprobs));
  }
  // Echo with logprobs: the prompt's tokens come with their logprobs too (the first one's null).
  if (r.echo && r.logprobs) r.sampling.logprob_start_len = 0;
  parse_response_format(f, r, raw);
  parse_openai_common(f, opts, r);
  return r;
}

ParsedRequest parse_chat(const json& body, const ParseOptions& opts, std::string_view raw) {
  ParsedRequest r;
  r.api = ApiKind::Chat;
  Fields f(body, "");
  f.reject_unsupported("suffix", "fill in the middle is a completions feature");
  const json* msgs = f.get("messages");
  if (!msgs) bad_request("messages", "invalid_value", "'messages' is required");
  if (!msgs->is_array() || msgs->empty())
    bad_request("messages", msgs->is_array() ? "invalid_value" : "invalid_type",
                "'messages' must be a non-empty array of messages");
  r.messages = json::array();
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string p = fmt::format("messages[{}]", i);
    if (!m.is_object()) bad_request(p, "invalid_type", "'{}' must be an object, got {}", p, type_name(m));
    Fields mf(m, p + ".");
    auto role = mf.string("role");
    if (!role) bad_request(p + ".role", "invalid_value", "'{}.role' is required", p);
    if (*role != "system" && *role != "user" && *role != "assistant" && *role != "tool" && *role != "developer")
      bad_request(p + ".role", "invalid_value",
                  "'{}.role' must be one of system, developer, user, assistant, tool; got '{}'", p, *role);
    json out = json::object();
    out["role"] = *role == "developer" ? "system" : *role;
    const json* content = mf.get("content");
    if (!content) {
      if (*role != "assistant") bad_request(p + ".content", "invalid_value", "'{}.content' is required", p);
      out["content"] = nullptr;
    } else if (content->is_string()) {
      out["content"] = *content;
    } else if (content->is_array()) {
      std::string text;
      for (size_t k = 0; k < content->size(); ++k) {
        const json& part = (*content)[k];
        const std::string pp = fmt::format("{}.content[{}]", p, k);
        if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
            !part["text"].is_string())
          bad_request(pp, "invalid_value", "'{}' must be a text part {{\"type\": \"text\", \"text\": ...}}", pp);
        text += part["text"].get<std::string>();
      }
      out["content"] = text;
    } else {
      bad_request(p + ".content", "invalid_type", "'{}.content' must be a string or an array of text parts, got {}", p,
                  type_name(*content));
    }
    if (const json* tc = mf.get("tool_calls")) out["tool_calls"] = *tc;
    if (auto rc = mf.string("reasoning_content")) out["reasoning_content"] = *rc;
    // What chat templates read besides (transformers hands them the whole message).
    if (auto id = mf.string("tool_call_id")) out["tool_call_id"] = *id;
    if (auto name = mf.string("name")) out["name"] = *name;
    r.messages.push_back(std::move(out));
  }
  if (const json* kw = f.get("chat_template_kwargs")) {
    if (!kw->is_object())
      bad_request("chat_template_kwargs", "invalid_type", "'chat_template_kwargs' must be an object, got {}",
                  type_name(*kw));
    r.chat_template_kwargs = *kw;
    if (const auto t = r.chat_template_kwargs.find("chat_template"); t != r.chat_template_kwargs.end()) {
      if (!t->is_string() && !t->is_null())
        bad_request("chat_template_kwargs.chat_template", "invalid_type", "'chat_template' must be a string");
      if (t->is_string()) r.chat_template = t->get<std::string>();
      r.chat_template_kwargs.erase(t);
    }
  }
  if (auto t = f.string("chat_template")) r.chat_template = *t;
  for (const auto& [key, value] : opts.default_chat_template_kwargs.items())  // the server's, under the request's
    if (!r.chat_template_kwargs.is_object() || !r.chat_template_kwargs.contains(key))
      r.chat_template_kwargs[key] = value;
  if (const json* docs = f.get("documents")) {  // vLLM's: documents the chat template may show (RAG templates)
    if (!docs->is_array())
      bad_request("documents", "invalid_type", "'documents' must be a list of objects, got {}", type_name(*docs));
    for (size_t i = 0; i < docs->size(); ++i)
      if (!(*docs)[i].is_object())
        bad_request(fmt::format("documents[{}]", i), "invalid_type", "'documents[{}]' must be an object", i);
    if (!r.chat_template_kwargs.is_object()) r.chat_template_kwargs = json::object();
    r.chat_template_kwargs["documents"] = *docs;
  }
  if (auto v = f.boolean("separate_reasoning")) r.separate_reasoning = *v;
  if (auto v = f.boolean("include_reasoning")) r.include_reasoning = *v;
  if (auto v = f.boolean("stream_reasoning")) r.stream_reasoning = *v;
  if (auto v = f.boolean("add_generation_prompt")) r.add_generation_prompt = *v;
  if (auto v = f.boolean("continue_final_message")) r.continue_final_message = *v;
  if (r.continue_final_message && r.add_generation_prompt)
    bad_request("continue_final_message", "invalid_value",
                "'continue_final_message' needs 'add_generation_prompt': false (the final message is continued, no "
                "new turn is opened)");
  if (r.continue_final_message && r.messages.back()["role"] != "assistant")
    bad_request("continue_final_message", "invalid_value", "'continue_final_message' needs a final assistant message");
  apply_defaults(opts.defaults, r.sampling);
  parse_sampling(f, {"max_tokens", "max_completion_tokens"}, opts, r, raw);
  if (auto v = f.boolean("logprobs")) r.logprobs = *v;
  if (auto v = f.integer("top_logprobs", 0, opts.max_top_logprobs)) {
    if (!r.logprobs && *v > 0)
      bad_request("top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs' to be true");
    r.top_logprobs = static_cast<int32_t>(*v);
  }
  if (const json* tools = f.get("tools")) {
    if (!tools->is_array())
      bad_request("tools", "invalid_type", "'tools' must be an array of tools, got {}", type_name(*tools));
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string p = fmt::format("tools[{}]", i);
      if (!t.is_object() || !member_is(t, "type", "function") || !t.contains("function") || !t["function"].is_object())
        bad_request(p, "invalid_value", "'{}' must be {{\"type\": \"function\", \"function\": {{...}}}}", p);
      const json& fn = t["function"];
      if (!fn.contains("name") || !fn["name"].is_string() || fn["name"].get<std::string>().empty())
        bad_request(p + ".function.name", "invalid_value", "'{}.function.name' must be a non-empty string", p);
      if (fn.contains("parameters") && !fn["parameters"].is_null() && !fn["parameters"].is_object())
        bad_request(p + ".function.parameters", "invalid_type", "'{}.function.parameters' must be an object", p);
    }
    if (!tools->empty()) r.tools = *tools;
  }
  std::optional<std::string> forced;  // tool_choice required (""), or the named function
  if (const json* tc = f.get("tool_choice")) {
    if (tc->is_string() && (*tc == "none" || *tc == "auto")) {
      r.tool_choice_none = *tc == "none";
    } else if (tc->is_string() && *tc == "required") {
      forced = "";
    } else if (tc->is_object()) {
      if (!member_is(*tc, "type", "function") || !tc->contains("function") || !(*tc)["function"].is_object() ||
          !(*tc)["function"].contains("name") || !(*tc)["function"]["name"].is_string())
        bad_request("tool_choice", "invalid_value",
                    "'tool_choice' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}");
      forced = (*tc)["function"]["name"].get<std::string>();
    } else {
      bad_request("tool_choice", "invalid_value", "'tool_choice' must be 'none', 'auto', 'required' or a function");
    }
  }
  if (auto v = f.boolean("parallel_tool_calls")) r.parallel_tool_calls = *v;
  if (forced) set_tool_constraint(r, *forced, raw, opts.tool_format);
  f.reject_unsupported("functions", "the legacy 'functions' field is not supported; use 'tools'");
  parse_response_format(f, r, raw);
  parse_openai_common(f, opts, r);
  return r;
}

nlohmann::ordered_json native_finish_reason(const FinishReason& f, int32_t completion_tokens) {
  nlohmann::ordered_json j;
  switch (f.kind) {
    case FinishKind::None: return nullptr;
    case FinishKind::Length:
      j["type"] = "length";
      j["length"] = completion_tokens;
      break;
    case FinishKind::Stop:
      j["type"] = "stop";
      if (f.matched_token >= 0) j["matched"] = f.matched_token;
      else if (!f.matched_text.empty()) j["matched"] = f.matched_text;
      else j["matched"] = nullptr;  // a constrained text completed (nothing more allowed)
      break;
    case FinishKind::Abort:
      j["type"] = "abort";
      j["message"] = f.message;
      break;
  }
  return j;
}

nlohmann::ordered_json openai_finish_reason(const FinishReason& f) {
  switch (f.kind) {
    case FinishKind::None: return nullptr;
    case FinishKind::Length: return "length";
    case FinishKind::Stop: return "stop";
    case FinishKind::Abort: return "abort";
  }
  return nullptr;
}

std::string error_body(const ApiError& e) { return error_body(e.status, e.what(), e.type, e.code, e.param); }

std::string error_body(int status, const std::string& message, const std::string& type, const std::string& code,
                       const std::string& param) {
  nlohmann::ordered_json err;
  err["message"] = message;
  err["type"] = type;
  err["param"] = param.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(param);
  err["code"] = code.empty() ? nlohmann::ordered_json(status) : nlohmann::ordered_json(code);
  nlohmann::ordered_json body;
  body["error"] = std::move(err);
  return body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace mlaserve::server
