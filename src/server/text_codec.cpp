#include "server/text_codec.h"

#include "server/text_stream.h"

namespace mlaserve::server {

std::unique_ptr<StreamDecoder> TextCodec::stream_decoder(bool skip_special_tokens) const {
  return std::make_unique<IncrementalDetokenizer>(this, skip_special_tokens);
}

std::string TextCodec::apply_chat_template_source(const std::string&, const nlohmann::json&, bool,
                                                  const nlohmann::json&) const {
  throw std::runtime_error("this tokenizer renders its own chat template only");
}

std::vector<std::string> TextCodec::token_bytes() const {
  std::vector<std::string> out(vocab_size());
  for (size_t id = 0; id < out.size(); ++id) {
    const std::vector<int32_t> one{static_cast<int32_t>(id)};
    std::string b = decode(one, true);
    if (b.empty()) {  // special
      if (const std::string s = decode(one, false); !s.empty()) b = "\xFF" + s;
    } else if (b.find('\xFF') != std::string::npos) {
      b.clear();
    }
    out[id] = std::move(b);
  }
  return out;
}

std::vector<std::vector<int32_t>> bad_words_token_ids(const TextCodec& codec, const std::vector<std::string>& words) {
  std::vector<std::vector<int32_t>> out;
  for (const std::string& word : words) {
    const size_t start = word.find_first_not_of(" \t\n\r\f\v");
    if (start == std::string::npos) continue;
    const std::string w = word.substr(start);
    std::vector<int32_t> alone = codec.encode(w, /*add_special_tokens=*/false);
    if (alone.empty()) continue;
    std::vector<int32_t> spaced = codec.encode(" " + w, /*add_special_tokens=*/false);
    const bool differs = !spaced.empty() && spaced.size() == alone.size() && spaced[0] != alone[0];
    out.push_back(std::move(alone));
    if (differs) out.push_back(std::move(spaced));
  }
  return out;
}

// The tokenizer library (src/tokenizer) is adapted in tokenizer_codec.cpp when it is part of the build.
#ifndef MLASERVE_HAS_TOKENIZER
std::unique_ptr<TextCodec> load_text_codec(const std::string&, const std::string&) { return nullptr; }
#endif

}  // namespace mlaserve::server
