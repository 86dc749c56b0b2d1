// Tool calls in generated text (`--tool-call-parser deepseekv3`): DeepSeek's chat format writes them after the
// answer's text as
//   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>...
//   <｜tool▁calls▁end｜>
// (V3 / R1; V3.1 writes NAME<｜tool▁sep｜>ARGS inside a call, also taken). The parser works a piece of text at a
// time: text before the calls is content (a suffix that may begin the calls' marker is held back until the next
// text decides it), each call comes out once its end marker arrives.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mlaserve::server {

// DeepSeek's tool-call markers (each a special token).
constexpr std::string_view kToolCallsBegin = "<｜tool▁calls▁begin｜>", kToolCallsEnd = "<｜tool▁calls▁end｜>",
                           kToolCallBegin = "<｜tool▁call▁begin｜>", kToolCallEnd = "<｜tool▁call▁end｜>",
                           kToolSep = "<｜tool▁sep｜>";

struct ToolCall {
  std::string name;
  std::string arguments;  // as generated (a JSON object's text when the model follows its format)
};

// The names `--tool-call-parser` takes (deepseekv3, deepseekv31 and their deepseek_v3* spellings; the parser reads
// both call forms), and whether the name is V3.1's (tool_choice's forced calls are then written in its form).
bool known_tool_call_parser(const std::string& name);
bool tool_calls_v31(const std::string& name);

class ToolCallParser {
 public:
  struct Out {
    std::string content;
    std::vector<ToolCall> calls;
  };
  Out push(std::string_view text);
  // The end of the output: held text that never became the calls' marker is content; a call without its end marker
  // (the output was cut short) is dropped.
  Out flush();

 private:
  enum class State { Content, Calls, After };
  State state_ = State::Content;
  std::string held_;
};

}  // namespace mlaserve::server
