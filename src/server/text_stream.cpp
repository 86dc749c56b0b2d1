#include "server/text_stream.h"

#include <algorithm>
#include <nlohmann/json.hpp>

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
  for (const auto& s : stops_) keep = std::max(keep, partial_tag_suffix(held_, s));
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

size_t partial_tag_suffix(std::string_view s, std::string_view tag) {
  if (tag.empty()) return 0;
  for (size_t len = std::min(tag.size() - 1, s.size()); len > 0; --len)
    if (s.substr(s.size() - len) == tag.substr(0, len)) return len;
  return 0;
}

bool take_until_tag(std::string& held, std::string_view tag, std::string& out) {
  const size_t at = held.find(tag);
  const size_t n = at == std::string::npos ? held.size() - partial_tag_suffix(held, tag) : at;
  out.append(held, 0, n);
  held.erase(0, at == std::string::npos ? n : at + tag.size());
  return at != std::string::npos;
}

size_t leading_space(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) ++i;
  return i;
}

namespace {
constexpr std::string_view kThinkStart = "<think>", kThinkEnd = "</think>";
}  // namespace

namespace {
bool r1_parser(const std::string& name) { return name == "deepseek-r1" || name == "deepseek_r1"; }
bool v3_parser(const std::string& name) { return name == "deepseek-v3" || name == "deepseek_v3"; }
bool truthy(const nlohmann::json& kwargs, const char* key) {
  const auto it = kwargs.find(key);
  return it != kwargs.end() && (it->is_boolean() ? it->get<bool>() : it->is_number() ? *it != 0 : false);
}
}  // namespace

bool known_reasoning_parser(const std::string& name) {
  return r1_parser(name) || v3_parser(name) || reasoning_needs_open_think(name);
}

bool reasoning_needs_open_think(const std::string& parser) { return parser == "kimi_k2"; }

bool reasoning_split(const std::string& parser, const nlohmann::json& chat_template_kwargs) {
  if (r1_parser(parser) || reasoning_needs_open_think(parser)) return true;
  return v3_parser(parser) && chat_template_kwargs.is_object() &&
         (truthy(chat_template_kwargs, "thinking") || truthy(chat_template_kwargs, "enable_thinking"));
}

ReasoningSplitter::Parts ReasoningSplitter::push(std::string_view text) {
  Parts out;
  held_.append(text);
  if (state_ == State::Start) {  // an opening "<think>" (after whitespace) is not part of the reasoning
    const size_t i = leading_space(held_);
    const std::string_view rest = std::string_view(held_).substr(i);
    if (rest.size() < kThinkStart.size() && kThinkStart.substr(0, rest.size()) == rest) return out;  // undecided
    if (rest.substr(0, kThinkStart.size()) == kThinkStart) {
      held_.erase(0, i + kThinkStart.size());
      reasoning_started_ = false;  // the whitespace after it goes too
      state_ = State::Reasoning;
    } else if (opened_only_) {
      state_ = State::Content;
      content_started_ = true;  // the text as generated
    } else {
      state_ = State::Reasoning;
    }
  }
  if (state_ == State::Reasoning && !reasoning_started_) {
    held_.erase(0, leading_space(held_));
    if (held_.empty()) return out;
    reasoning_started_ = true;
  }
  if (state_ == State::Reasoning) {
    if (!take_until_tag(held_, kThinkEnd, out.reasoning)) return out;
    state_ = State::Content;
  }
  if (!content_started_) {
    held_.erase(0, leading_space(held_));
    if (held_.empty()) return out;
    content_started_ = true;
  }
  out.content = std::move(held_);
  held_.clear();
  return out;
}

ReasoningSplitter::Parts ReasoningSplitter::flush() {
  Parts out;
  if (state_ == State::Start && opened_only_) {
    out.content = std::move(held_);  // never opened "<think>": content
  } else if (state_ != State::Content) {
    // Undecided text at the start that turned out not to be "<think>", or a partial "</think>": reasoning.
    out.reasoning = std::move(held_);
    if (state_ == State::Start) {
      const size_t i = leading_space(out.reasoning);
      if (std::string_view(out.reasoning).substr(i) == kThinkStart.substr(0, out.reasoning.size() - i))
        out.reasoning.clear();  // only a prefix of "<think>" was ever generated
    }
  }
  held_.clear();
  return out;
}

}  // namespace mlaserve::server
