#include "server/tool_calls.h"

#include <algorithm>

#include "server/text_stream.h"

namespace mlaserve::server {
namespace {

std::string_view trim(std::string_view s) {
  s.remove_prefix(leading_space(s));
  while (!s.empty() && leading_space(s.substr(s.size() - 1)) == 1) s.remove_suffix(1);
  return s;
}

// One call's text between its markers; false when it has no name.
bool parse_call(ToolFormat f, std::string_view body, ToolCall& out) {
  const std::string_view sep_marker = tool_markers(f).sep;
  const size_t sep = body.find(sep_marker);
  if (sep == std::string_view::npos) return false;
  const std::string_view left = trim(body.substr(0, sep));
  std::string_view right = body.substr(sep + sep_marker.size());
  if (f == ToolFormat::KimiK2) {  // functions.NAME:IDX<|tool_call_argument_begin|>ARGS
    out.id = std::string(left);
    std::string_view name = left;
    if (const size_t colon = name.rfind(':'); colon != std::string_view::npos) name = name.substr(0, colon);
    if (const size_t dot = name.find('.'); dot != std::string_view::npos) name = name.substr(dot + 1);
    out.name = std::string(name);
    out.arguments = std::string(trim(right));
  } else if (left == "function") {  // V3 / R1: the name on the first line, the arguments in a ```json fence
    const size_t nl = right.find('\n');
    out.name = std::string(trim(right.substr(0, nl)));
    std::string_view args = nl == std::string_view::npos ? std::string_view() : trim(right.substr(nl + 1));
    if (args.substr(0, 3) == "```") {
      const size_t line = args.find('\n');
      args = line == std::string_view::npos ? std::string_view() : args.substr(line + 1);
      if (const size_t fence = args.rfind("```"); fence != std::string_view::npos) args = args.substr(0, fence);
    }
    out.arguments = std::string(trim(args));
  } else {  // V3.1: NAME<｜tool▁sep｜>ARGS
    out.name = std::string(left);
    out.arguments = std::string(trim(right));
  }
  return !out.name.empty();
}

}  // namespace

const ToolMarkers& tool_markers(ToolFormat f) {
  static const ToolMarkers deepseek{kToolCallsBegin, kToolCallsEnd, kToolCallBegin, kToolCallEnd, kToolSep};
  static const ToolMarkers kimi{"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                "<|tool_call_end|>", "<|tool_call_argument_begin|>"};
  return f == ToolFormat::KimiK2 ? kimi : deepseek;
}

std::optional<ToolFormat> tool_call_format(const std::string& name) {
  if (name == "deepseekv3" || name == "deepseek_v3") return ToolFormat::DeepseekV3;
  if (name == "deepseekv31" || name == "deepseek_v31") return ToolFormat::DeepseekV31;
  if (name == "kimi_k2") return ToolFormat::KimiK2;
  return std::nullopt;
}

ToolCallParser::Out ToolCallParser::push(std::string_view text) {
  Out out;
  held_.append(text);
  const ToolMarkers& m = tool_markers(format_);
  if (state_ == State::Content) {
    if (!take_until_tag(held_, m.calls_begin, out.content)) return out;
    state_ = State::Calls;
  }
  while (state_ == State::Calls) {
    const size_t begin = held_.find(m.call_begin), calls_end = held_.find(m.calls_end);
    if (calls_end != std::string::npos && (begin == std::string::npos || calls_end < begin)) {
      held_.erase(0, calls_end + m.calls_end.size());
      state_ = State::After;
      break;
    }
    if (begin == std::string::npos) break;
    const size_t end = held_.find(m.call_end, begin);
    if (end == std::string::npos) break;
    ToolCall call;
    const size_t body = begin + m.call_begin.size();
    if (parse_call(format_, std::string_view(held_).substr(body, end - body), call))
      out.calls.push_back(std::move(call));
    held_.erase(0, end + m.call_end.size());
  }
  if (state_ == State::After) {  // text after the calls (rare): content
    out.content += held_;
    held_.clear();
  }
  return out;
}

ToolCallParser::Out ToolCallParser::flush() {
  Out out;
  if (state_ == State::Content) out.content = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace mlaserve::server
