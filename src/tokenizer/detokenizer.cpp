#include "tokenizer/detokenizer.h"

namespace mlaserve::tok {
namespace {
bool ends_incomplete(const std::string& s) { return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0; }
}  // namespace

std::string IncrementalDetokenizer::decode_range(size_t b, size_t e) const {
  return tok_.decode(std::span<const int32_t>(ids_.data() + b, e - b), skip_special_);
}

std::string IncrementalDetokenizer::push(int32_t id) {
  ids_.push_back(id);
  std::string prefix = decode_range(0, read_);
  std::string full = decode_range(0, ids_.size());
  if (full.size() <= prefix.size() || ends_incomplete(full)) return "";
  std::string out = full.substr(prefix.size());
  // Slide the window: keep the last emitted token as context for the next decode.
  size_t keep_from = read_;
  ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(keep_from));
  read_ = ids_.size();
  return out;
}

std::string IncrementalDetokenizer::finish() {
  std::string out;
  if (read_ < ids_.size()) {
    std::string prefix = decode_range(0, read_);
    std::string full = decode_range(0, ids_.size());
    if (full.size() > prefix.size()) out = full.substr(prefix.size());
  }
  ids_.clear();
  read_ = 0;
  return out;
}

}  // namespace mlaserve::tok
