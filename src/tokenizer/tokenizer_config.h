// A checkpoint's tokenizer as a server sees it: tokenizer.json plus tokenizer_config.json (special tokens given
// as strings or AddedToken objects, add_bos_token / add_eos_token, chat_template as a string or a list of named
// templates; chat_template.jinja overrides it) and generation_config.json (eos_token_id, int or list).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/jinja.h"
#include "tokenizer/tokenizer.h"

namespace mlaserve::tok {

class PretrainedTokenizer {
 public:
  // `dir` holds tokenizer.json (or tiktoken.model with its tokenization_*.py: tokenizer/tiktoken.h) and
  // optionally tokenizer_config.json, generation_config.json, chat_template.jinja.
  static std::unique_ptr<PretrainedTokenizer> load(const std::string& dir);

  const Tokenizer& tokenizer() const { return *tok_; }

  // add_special_tokens: bos/eos per add_bos_token / add_eos_token when tokenizer_config.json sets them (what
  // transformers' LlamaTokenizerFast does, e.g. for DeepSeek), else tokenizer.json's post-processor.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const {
    return tok_->encode(text, add_special_tokens);
  }
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const {
    return tok_->decode(ids, skip_special_tokens);
  }

  // Renders the chat template as transformers' apply_chat_template(tokenize=False) does: messages,
  // add_generation_prompt, tools and documents (None unless given), the special tokens (bos_token, eos_token,
  // ...) and every key of `extra` (an object) as variables. `template_name` picks a named template; by default
  // "tool_use" when tools are given and it exists, else "default".
  std::string apply_chat_template(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                  const nlohmann::ordered_json& extra = nlohmann::ordered_json::object(),
                                  const std::string& template_name = "") const;

  // The same with a given template (transformers' chat_template= argument).
  std::string render_chat_template(const jinja::Template& tmpl, const nlohmann::ordered_json& messages,
                                   bool add_generation_prompt,
                                   const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  const std::optional<std::string>& bos_token() const { return bos_token_; }
  const std::optional<std::string>& eos_token() const { return eos_token_; }
  const std::optional<std::string>& pad_token() const { return pad_token_; }
  std::optional<int32_t> bos_token_id() const { return id_of(bos_token_); }
  std::optional<int32_t> eos_token_id() const { return id_of(eos_token_); }
  std::optional<int32_t> pad_token_id() const { return id_of(pad_token_); }
  // Ids that end generation: generation_config.json's eos_token_id when present, else eos_token's id.
  const std::vector<int32_t>& eos_token_ids() const { return eos_ids_; }
  bool add_bos_token() const { return add_bos_; }
  bool add_eos_token() const { return add_eos_; }
  std::vector<std::string> chat_template_names() const;
  // Replaces every chat template with this one (`where` names it in errors); a template that does not parse throws.
  void set_chat_template(const std::string& source, const std::string& where);

 private:
  std::optional<int32_t> id_of(const std::optional<std::string>& t) const {
    return t ? tok_->token_to_id(*t) : std::nullopt;
  }
  std::unique_ptr<Tokenizer> tok_;
  std::optional<std::string> bos_token_, eos_token_, pad_token_;
  std::map<std::string, std::string> special_map_;  // name -> content (bos_token, eos_token, unk_token, ...)
  std::optional<nlohmann::ordered_json> additional_special_tokens_;
  std::vector<int32_t> eos_ids_;
  bool add_bos_ = false, add_eos_ = false;
  bool sort_tool_keys_ = false;  // a tiktoken class whose apply_chat_template sorts the tools' keys (Kimi's)
  std::map<std::string, std::unique_ptr<jinja::Template>> templates_;
};

}  // namespace mlaserve::tok
