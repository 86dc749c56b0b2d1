// TextCodec over the tokenizer library (src/tokenizer): PretrainedTokenizer gives ids <-> text with the
// checkpoint's BOS rule, the chat template (Jinja), and the incremental detokenizer used for streaming.
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "server/text_codec.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/jinja.h"
#include "tokenizer/tokenizer_config.h"

namespace mlaserve::server {
namespace {

class LibraryStreamDecoder : public StreamDecoder {
 public:
  LibraryStreamDecoder(const tok::Tokenizer& t, bool skip_special) : detok_(t, skip_special) {}
  std::string push(const std::vector<int32_t>& ids) override {
    std::string out;
    for (int32_t id : ids) out += detok_.push(id);
    return out;
  }
  std::string flush() override { return detok_.finish(); }

 private:
  tok::IncrementalDetokenizer detok_;
};

class TokenizerCodec : public TextCodec {
 public:
  TokenizerCodec(const std::string& path, const std::string& chat_template) : path_(path) {
    namespace fs = std::filesystem;
    const std::string dir = fs::is_directory(path) ? path : fs::path(path).parent_path().string();
    MLA_CHECK(fs::exists(fs::path(dir) / "tokenizer.json") || fs::exists(fs::path(dir) / "tiktoken.model"),
              "--tokenizer-path: no tokenizer.json (or tiktoken.model) in '{}'", dir);
    tok_ = tok::PretrainedTokenizer::load(dir);
    if (!chat_template.empty()) {
      std::ifstream f(chat_template, std::ios::binary);
      MLA_CHECK(f.good(), "--chat-template: cannot read '{}'", chat_template);
      std::stringstream ss;
      ss << f.rdbuf();
      tok_->set_chat_template(ss.str(), chat_template);
    }
  }
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const override {
    return tok_->encode(text, add_special_tokens);
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const override {
    return tok_->decode(ids, skip_special_tokens);
  }
  std::string apply_chat_template(const nlohmann::json& messages, bool add_generation_prompt,
                                  const nlohmann::json& extra) const override {
    return tok_->apply_chat_template(nlohmann::ordered_json::parse(messages.dump()), add_generation_prompt,
                                     nlohmann::ordered_json::parse(extra.dump()));
  }
  std::string apply_chat_template_source(const std::string& source, const nlohmann::json& messages,
                                         bool add_generation_prompt, const nlohmann::json& extra) const override {
    const jinja::Template t(source, "the request's chat_template");
    return tok_->render_chat_template(t, nlohmann::ordered_json::parse(messages.dump()), add_generation_prompt,
                                      nlohmann::ordered_json::parse(extra.dump()));
  }
  std::optional<std::string> token_piece(int32_t id) const override { return tok_->tokenizer().id_to_token(id); }
  std::string name_or_path() const override { return path_; }
  size_t vocab_size() const override { return tok_->tokenizer().vocab_size(); }
  std::vector<std::string> token_bytes() const override {
    const tok::Tokenizer& t = tok_->tokenizer();
    std::vector<std::string> out(t.vocab_size());
    for (size_t id = 0; id < out.size(); ++id) {
      if (auto b = t.token_bytes(static_cast<int32_t>(id))) {
        if (b->find('\xFF') == std::string::npos) out[id] = std::move(*b);
      } else if (auto added = t.id_to_token(static_cast<int32_t>(id))) {  // an added token: 0xFF + its text
        out[id] = "\xFF" + *added;
      }
    }
    return out;
  }
  std::unique_ptr<StreamDecoder> stream_decoder(bool skip_special_tokens) const override {
    return std::make_unique<LibraryStreamDecoder>(tok_->tokenizer(), skip_special_tokens);
  }

 private:
  std::string path_;
  std::unique_ptr<tok::PretrainedTokenizer> tok_;
};

}  // namespace

std::unique_ptr<TextCodec> load_text_codec(const std::string& path, const std::string& chat_template) {
  return std::make_unique<TokenizerCodec>(path, chat_template);
}

}  // namespace mlaserve::server
