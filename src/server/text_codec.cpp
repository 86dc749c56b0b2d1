#include "server/text_codec.h"

namespace mlaserve::server {

// The tokenizer library (src/tokenizer) is adapted in tokenizer_codec.cpp when it is part of the build.
#ifndef MLASERVE_HAS_TOKENIZER
std::unique_ptr<TextCodec> load_text_codec(const std::string&) { return nullptr; }
#endif

}  // namespace mlaserve::server
