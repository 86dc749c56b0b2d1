// StopRegexes (text_stream.h) over the tokenizer library's PCRE2 regexes.
#include <stdexcept>

#include "server/text_stream.h"
#ifdef MLASERVE_HAS_TOKENIZER
#include "tokenizer/regex.h"
#endif

namespace mlaserve::server {

#ifdef MLASERVE_HAS_TOKENIZER
struct StopRegexes::Impl {
  std::vector<std::unique_ptr<tok::Regex>> patterns;
};

StopRegexes::StopRegexes(const std::vector<std::string>& patterns) : impl_(std::make_unique<Impl>()) {
  for (const std::string& p : patterns) impl_->patterns.push_back(std::make_unique<tok::Regex>(p, "stop_regex"));
}

std::optional<std::string> StopRegexes::search(std::string_view text) const {
  for (const auto& re : impl_->patterns) {
    size_t start = 0, end = 0;
    try {
      if (re->find(text, 0, start, end)) return re->pattern();
    } catch (const std::exception&) {  // (a match limit: not found)
    }
  }
  return std::nullopt;
}
#else
struct StopRegexes::Impl {};

StopRegexes::StopRegexes(const std::vector<std::string>&) {
  throw std::runtime_error("stop_regex needs a build with the tokenizer library (PCRE2)");
}

std::optional<std::string> StopRegexes::search(std::string_view) const { return std::nullopt; }
#endif

StopRegexes::~StopRegexes() = default;

}  // namespace mlaserve::server
