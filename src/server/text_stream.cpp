#include "server/text_stream.h"

#include <algorithm>

namespace mlaserve::server {
namespace {

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

bool ends_with_replacement(const std::string& s) {
  return s.size() >= kReplacementChar.size() &&
         std::string_view(s).substr(s.size() - kReplacementChar.size()) == kReplacementChar;
}

}  // namespace

std::string IncrementalDetokenizer::push(const std::vector<int32_t>& tokens) {
  if (!codec_ || tokens.empty()) return {};
  ids_.insert(ids_.end(), tokens.begin(), tokens.end());
  const std::vector<int32_t> prefix(ids_.begin() + prefix_offset_, ids_.begin() + read_offset_);
  const std::vector<int32_t> window(ids_.begin() + prefix_offset_, ids_.end());
  const std::string prefix_text = codec_->decode(prefix, skip_special_);
  const std::string window_text = codec_->decode(window, skip_special_);
  if (window_text.size() <= prefix_text.size() || ends_with_replacement(window_text)) return {};
  // A byte-level decode of a longer window extends the shorter one; guard anyway (normalizers could differ).
  if (window_text.compare(0, prefix_text.size(), prefix_text) != 0) return {};
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  return window_text.substr(prefix_text.size());
}

std::string IncrementalDetokenizer::flush() {
  if (!codec_ || read_offset_ == ids_.size()) return {};
  const std::vector<int32_t> prefix(ids_.begin() + prefix_offset_, ids_.begin() + read_offset_);
  const std::vector<int32_t> window(ids_.begin() + prefix_offset_, ids_.end());
  const std::string prefix_text = codec_->decode(prefix, skip_special_);
  const std::string window_text = codec_->decode(window, skip_special_);
  prefix_offset_ = read_offset_ = ids_.size();
  if (window_text.size() <= prefix_text.size()) return {};
  return window_text.substr(prefix_text.size());
}

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
}

std::string StopStringMatcher::pass(std::string_view text) {
  if (matched_) return {};
  std::string out = std::move(held_);
  held_.clear();
  out.append(text);
  return out;
}

std::string StopStringMatcher::push(std::string_view text) {
  if (matched_) return {};
  if (stops_.empty()) return std::string(text);
  held_.append(text);
  // Earliest match wins; among matches at the same position the longest stop string.
  size_t best = std::string::npos;
  const std::string* best_stop = nullptr;
  for (const auto& s : stops_) {
    size_t p = held_.find(s);
    if (p != std::string::npos && (p < best || (p == best && s.size() > best_stop->size()))) {
      best = p;
      best_stop = &s;
    }
  }
  if (best_stop) {
    matched_ = *best_stop;
    std::string out = held_.substr(0, best);
    held_.clear();
    return out;
  }
  // Hold back the longest suffix of held_ that is a proper prefix of a stop string.
  size_t keep = 0;
  for (const auto& s : stops_) {
    const size_t max_len = std::min(s.size() - 1, held_.size());
    for (size_t len = max_len; len > keep; --len)
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopStringMatcher::flush() {
  if (matched_) return {};
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace mlaserve::server
