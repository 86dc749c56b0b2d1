#include "server/text_codec.h"

#include "server/text_stream.h"

namespace mlaserve::server {

std::unique_ptr<StreamDecoder> TextCodec::stream_decoder(bool skip_special_tokens) const {
  return std::make_unique<IncrementalDetokenizer>(this, skip_special_tokens);
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

// The tokenizer library (src/tokenizer) is adapted in tokenizer_codec.cpp when it is part of the build.
#ifndef MLASERVE_HAS_TOKENIZER
std::unique_ptr<TextCodec> load_text_codec(const std::string&, const std::string&) { return nullptr; }
#endif

}  // namespace mlaserve::server
