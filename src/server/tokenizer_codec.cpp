// TextCodec over the tokenizer library (src/tokenizer): tokenizer.json for ids <-> text, tokenizer_config.json
// for the BOS rule (add_bos_token, as transformers' LlamaTokenizerFast applies it) and the chat template.
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "server/text_codec.h"
#include "tokenizer/tokenizer.h"

namespace mlaserve::server {
namespace {

namespace fs = std::filesystem;

std::string token_content(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}

class TokenizerCodec : public TextCodec {
 public:
  explicit TokenizerCodec(const std::string& path) : path_(path) {
    const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
    const fs::path tj = fs::is_directory(path) ? dir / "tokenizer.json" : fs::path(path);
    MLA_CHECK(fs::exists(tj), "--tokenizer-path: no tokenizer.json in '{}'", path);
    tok_ = tok::Tokenizer::from_file(tj.string());
    const fs::path cfg_path = dir / "tokenizer_config.json";
    if (fs::exists(cfg_path)) {
      std::ifstream in(cfg_path);
      nlohmann::json cfg;
      try {
        cfg = nlohmann::json::parse(in);
      } catch (const std::exception& e) {
        fail("{}: {}", cfg_path.string(), e.what());
      }
      std::vector<int32_t> prefix, suffix;
      const bool add_bos = cfg.value("add_bos_token", false), add_eos = cfg.value("add_eos_token", false);
      if (cfg.contains("bos_token")) bos_ = token_content(cfg["bos_token"]);
      if (cfg.contains("eos_token")) eos_ = token_content(cfg["eos_token"]);
      if (add_bos && !bos_.empty()) {
        auto id = tok_->token_to_id(bos_);
        MLA_CHECK(id.has_value(), "{}: bos_token '{}' is not in the vocabulary", cfg_path.string(), bos_);
        prefix.push_back(*id);
      }
      if (add_eos && !eos_.empty()) {
        auto id = tok_->token_to_id(eos_);
        MLA_CHECK(id.has_value(), "{}: eos_token '{}' is not in the vocabulary", cfg_path.string(), eos_);
        suffix.push_back(*id);
      }
      if (add_bos || add_eos) tok_->set_post_processor(tok::make_template_processor(prefix, suffix));
      if (cfg.contains("chat_template") && cfg["chat_template"].is_string())
        chat_template_ = cfg["chat_template"].get<std::string>();
    }
  }

  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const override {
    return tok_->encode(text, add_special_tokens);
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const override {
    return tok_->decode(ids, skip_special_tokens);
  }
  std::string apply_chat_template(const nlohmann::json& messages, bool add_generation_prompt) const override {
    fail("chat templates are not available in this build yet (the tokenizer library has no template renderer)");
  }
  std::string name_or_path() const override { return path_; }
  size_t vocab_size() const override { return tok_->vocab_size(); }

 private:
  std::string path_;
  std::unique_ptr<tok::Tokenizer> tok_;
  std::string bos_, eos_, chat_template_;
};

}  // namespace

std::unique_ptr<TextCodec> load_text_codec(const std::string& path) { return std::make_unique<TokenizerCodec>(path); }

}  // namespace mlaserve::server
