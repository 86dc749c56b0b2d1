#include "tokenizer/tokenizer_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/json_int.h"
#include "tokenizer/tiktoken.h"
#include "tokenizer/unicode.h"

namespace mlaserve::tok {
namespace {

std::optional<nlohmann::ordered_json> read_json_if_exists(const std::string& path) {
  if (!std::filesystem::exists(path)) return std::nullopt;
  std::ifstream f(path, std::ios::binary);
  MLA_CHECK(f.good(), "cannot open '{}'", path);
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return nlohmann::ordered_json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
}

// A special token given as "text", {"content": "text", ...} (AddedToken, with or without "__type") or null.
std::optional<std::string> token_text(const nlohmann::ordered_json& cfg, const char* key, const std::string& where) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  fail("{}: '{}' must be a string or an AddedToken object with 'content', got {}", where, key, it->dump());
}

}  // namespace

std::unique_ptr<PretrainedTokenizer> PretrainedTokenizer::load(const std::string& dir) {
  auto p = std::unique_ptr<PretrainedTokenizer>(new PretrainedTokenizer());
  std::string cfg_path = dir + "/tokenizer_config.json";
  auto cfg = read_json_if_exists(cfg_path).value_or(nlohmann::ordered_json::object());
  MLA_CHECK(cfg.is_object(), "{}: expected a JSON object", cfg_path);

  std::string tj = dir + "/tokenizer.json";
  if (std::filesystem::exists(tj)) {
    p->tok_ = Tokenizer::from_file(tj);
  } else {
    MLA_CHECK(std::filesystem::exists(dir + "/tiktoken.model"),
              "--tokenizer-path '{}': no tokenizer.json (or tiktoken.model) there", dir);
    TiktokenTokenizer t = load_tiktoken_dir(dir, cfg, cfg_path);
    p->tok_ = std::move(t.tokenizer);
    p->sort_tool_keys_ = t.sort_tool_keys;
  }
  p->bos_token_ = token_text(cfg, "bos_token", cfg_path);
  p->eos_token_ = token_text(cfg, "eos_token", cfg_path);
  p->pad_token_ = token_text(cfg, "pad_token", cfg_path);
  for (const char* k : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})
    if (auto t = token_text(cfg, k, cfg_path)) p->special_map_[k] = *t;
  if (cfg.contains("additional_special_tokens") && cfg["additional_special_tokens"].is_array()) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& t : cfg["additional_special_tokens"])
      list.push_back(t.is_object() && t.contains("content") ? t["content"] : t);
    p->additional_special_tokens_ = list;
  }
  auto flag = [&](const char* k, bool& out) {
    auto it = cfg.find(k);
    if (it == cfg.end() || it->is_null()) return false;
    MLA_CHECK(it->is_boolean(), "{}: '{}' must be a boolean", cfg_path, k);
    out = it->get<bool>();
    return true;
  };
  bool has_bos = flag("add_bos_token", p->add_bos_), has_eos = flag("add_eos_token", p->add_eos_);
  if (has_bos || has_eos) {
    // transformers' LlamaTokenizerFast.update_post_processor: "<bos> $A <eos>" with each part optional.
    std::vector<int32_t> prefix, suffix;
    if (p->add_bos_) {
      auto id = p->bos_token_id();
      MLA_CHECK(id.has_value(), "{}: add_bos_token is true but bos_token {} is not in the vocab", cfg_path,
                p->bos_token_.value_or("(unset)"));
      prefix.push_back(*id);
    }
    if (p->add_eos_) {
      auto id = p->eos_token_id();
      MLA_CHECK(id.has_value(), "{}: add_eos_token is true but eos_token {} is not in the vocab", cfg_path,
                p->eos_token_.value_or("(unset)"));
      suffix.push_back(*id);
    }
    p->tok_->set_post_processor(make_template_processor(std::move(prefix), std::move(suffix)));
  }

  // Chat templates: a string, or [{"name": ..., "template": ...}, ...]; chat_template.jinja overrides "default".
  auto add_template = [&](const std::string& name, const std::string& src, const std::string& where) {
    p->templates_[name] = std::make_unique<jinja::Template>(src, where);
  };
  if (auto it = cfg.find("chat_template"); it != cfg.end() && !it->is_null()) {
    if (it->is_string()) {
      add_template("default", it->get<std::string>(), cfg_path + " chat_template");
    } else {
      MLA_CHECK(it->is_array(), "{}: chat_template must be a string or a list of {{name, template}}", cfg_path);
      for (size_t i = 0; i < it->size(); ++i) {
        const auto& t = (*it)[i];
        MLA_CHECK(t.is_object() && t.contains("name") && t["name"].is_string() && t.contains("template") &&
                      t["template"].is_string(),
                  "{}: chat_template[{}] must be {{\"name\": ..., \"template\": ...}}", cfg_path, i);
        std::string name = t["name"].get<std::string>();
        add_template(name, t["template"].get<std::string>(), fmt::format("{} chat_template '{}'", cfg_path, name));
      }
    }
  }
  std::string jinja_path = dir + "/chat_template.jinja";
  if (std::filesystem::exists(jinja_path)) {
    std::ifstream f(jinja_path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    add_template("default", ss.str(), jinja_path);
  }

  // Stop ids: generation_config.json's eos_token_id (int or list), else eos_token.
  std::string gen_path = dir + "/generation_config.json";
  if (auto gen = read_json_if_exists(gen_path); gen && gen->contains("eos_token_id")) {
    const auto& e = (*gen)["eos_token_id"];
    auto id_of = [&](const nlohmann::json& x) {  // (a value past 32 bits is refused, not truncated into a token)
      const auto id = json_integer(x, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
      MLA_CHECK(id, "{}: eos_token_id entries must be token ids (32-bit integers), got {}", gen_path, x.dump());
      return static_cast<int32_t>(*id);
    };
    if (e.is_number_integer()) {
      p->eos_ids_.push_back(id_of(e));
    } else if (e.is_array()) {
      for (const auto& x : e) p->eos_ids_.push_back(id_of(x));
    } else {
      MLA_CHECK(e.is_null(), "{}: eos_token_id must be an integer or a list of integers", gen_path);
    }
  }
  if (p->eos_ids_.empty())
    if (auto id = p->eos_token_id()) p->eos_ids_.push_back(*id);
  return p;
}

std::vector<std::string> PretrainedTokenizer::chat_template_names() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : templates_) out.push_back(k);
  return out;
}

namespace {
void check_json_utf8(const nlohmann::ordered_json& j, const std::string& where) {
  if (j.is_string()) {
    check_utf8(j.get_ref<const std::string&>(), where);
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) check_json_utf8(j[i], fmt::format("{}[{}]", where, i));
  } else if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      check_utf8(it.key(), where + " key");
      check_json_utf8(it.value(), where + "." + it.key());
    }
  }
}
// Every object's keys in sorted order, at every depth (Kimi's deep_sort_dict).
nlohmann::ordered_json sorted_keys(const nlohmann::ordered_json& j) {
  if (j.is_array()) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (const auto& v : j) out.push_back(sorted_keys(v));
    return out;
  }
  if (!j.is_object()) return j;
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  std::sort(keys.begin(), keys.end());
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& k : keys) out[k] = sorted_keys(j[k]);
  return out;
}
}  // namespace

void PretrainedTokenizer::set_chat_template(const std::string& source, const std::string& where) {
  auto t = std::make_unique<jinja::Template>(source, where);
  templates_.clear();
  templates_["default"] = std::move(t);
}

std::string PretrainedTokenizer::apply_chat_template(const nlohmann::ordered_json& messages,
                                                     bool add_generation_prompt,
                                                     const nlohmann::ordered_json& extra,
                                                     const std::string& template_name) const {
  MLA_CHECK(!templates_.empty(), "this tokenizer has no chat template (tokenizer_config.json chat_template)");
  bool has_tools = extra.is_object() && extra.contains("tools") && !extra["tools"].is_null();
  std::string name = template_name;
  if (name.empty()) name = has_tools && templates_.count("tool_use") ? "tool_use" : "default";
  auto it = templates_.find(name);
  if (it == templates_.end() && template_name.empty() && templates_.size() == 1) it = templates_.begin();
  MLA_CHECK(it != templates_.end(), "no chat template named '{}' (have: {})", name,
            fmt::join(chat_template_names(), ", "));
  return render_chat_template(*it->second, messages, add_generation_prompt, extra);
}

std::string PretrainedTokenizer::render_chat_template(const jinja::Template& tmpl, const nlohmann::ordered_json& messages,
                                                      bool add_generation_prompt,
                                                      const nlohmann::ordered_json& extra) const {
  MLA_CHECK(messages.is_array(), "messages must be a list, got {}", messages.type_name());
  MLA_CHECK(!messages.empty(), "Cannot apply chat template to an empty conversation. Provide at least one message.");
  MLA_CHECK(extra.is_object(), "chat template variables must be an object");
  check_json_utf8(messages, "messages");
  check_json_utf8(extra, "chat template variables");
  jinja::Value ctx = jinja::Value::make_dict();
  jinja::Dict& d = ctx.dict();
  for (const auto& [k, v] : special_map_) d.set(k, jinja::Value(v));
  if (additional_special_tokens_) d.set("additional_special_tokens", jinja::Value::from_json(*additional_special_tokens_));
  d.set("messages", jinja::Value::from_json(messages));
  d.set("tools", jinja::Value::none());
  d.set("documents", jinja::Value::none());
  d.set("add_generation_prompt", jinja::Value(add_generation_prompt));
  for (auto e = extra.begin(); e != extra.end(); ++e) {
    if (sort_tool_keys_ && e.key() == "tools") {
      d.set(e.key(), jinja::Value::from_json(sorted_keys(e.value())));
    } else {
      d.set(e.key(), jinja::Value::from_json(e.value()));
    }
  }
  return tmpl.render(ctx);
}

}  // namespace mlaserve::tok
