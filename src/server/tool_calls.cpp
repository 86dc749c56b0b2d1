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
bool parse_call(std::string_view body, ToolCall& out) {
  const size_t sep = body.find(kToolSep);
  if (sep == std::string_view::npos) return false;
  const std::string_view left = trim(body.substr(0, sep));
  std::string_view right = body.substr(sep + kToolSep.size());
  if (left == "function") {  // V3 / R1: the name on the first line, the arguments in a ```json fence
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

bool tool_calls_v31(const std::string& name) { return name == "deepseekv31" || name == "deepseek_v31"; }
bool known_tool_call_parser(const std::string& name) {
  return name == "deepseekv3" || name == "deepseek_v3" || tool_calls_v31(name);
}

ToolCallParser::Out ToolCallParser::push(std::string_view text) {
  Out out;
  held_.append(text);
  if (state_ == State::Content) {
    if (!take_until_tag(held_, kToolCallsBegin, out.content)) return out;
    state_ = State::Calls;
  }
  while (state_ == State::Calls) {
    const size_t begin = held_.find(kToolCallBegin), calls_end = held_.find(kToolCallsEnd);
    if (calls_end != std::string::npos && (begin == std::string::npos || calls_end < begin)) {
      held_.erase(0, calls_end + kToolCallsEnd.size());
      state_ = State::After;
      break;
    }
    if (begin == std::string::npos) break;
    const size_t end = held_.find(kToolCallEnd, begin);
    if (end == std::string::npos) break;
    ToolCall call;
    const size_t body = begin + kToolCallBegin.size();
    if (parse_call(std::string_view(held_).substr(body, end - body), call)) out.calls.push_back(std::move(call));
    held_.erase(0, end + kToolCallEnd.size());
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
