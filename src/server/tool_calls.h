// Tool calls in generated text (`--tool-call-parser`). DeepSeek's chat format (deepseekv3) writes them after the
// answer's text as
//   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>...
//   <｜tool▁calls▁end｜>
// (V3 / R1; V3.1 writes NAME<｜tool▁sep｜>ARGS inside a call, also taken). Kimi-K2's (kimi_k2) writes
//   <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>
//   ...<|tool_calls_section_end|>
// and its call ids (functions.NAME:IDX) are the ids the calls get. The parser works a piece of text at a time: text
// before the calls is content (a suffix that may begin the calls' marker is held back until the next text decides
// it), each call comes out once its end marker arrives.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mlaserve::server {

// DeepSeek's tool-call markers (each a special token).
constexpr std::string_view kToolCallsBegin = "<｜tool▁calls▁begin｜>", kToolCallsEnd = "<｜tool▁calls▁end｜>",
                           kToolCallBegin = "<｜tool▁call▁begin｜>", kToolCallEnd = "<｜tool▁call▁end｜>",
                           kToolSep = "<｜tool▁sep｜>";

// The call forms: DeepSeek V3 / R1's, V3.1's (both read by either; the form matters when tool_choice forces calls),
// Kimi-K2's.
enum class ToolFormat { DeepseekV3, DeepseekV31, KimiK2 };

// A format's markers: around all calls, around one call, and between a call's name (or id) and its arguments.
struct ToolMarkers {
  std::string_view calls_begin, calls_end, call_begin, call_end, sep;
};
const ToolMarkers& tool_markers(ToolFormat f);

struct ToolCall {
  std::string name;
  std::string arguments;  // as generated (a JSON object's text when the model follows its format)
  std::string id;         // the call's id where the format writes one (Kimi-K2's functions.NAME:IDX), else ""
};

// The names `--tool-call-parser` takes: deepseekv3 / deepseek_v3, deepseekv31 / deepseek_v31, kimi_k2.
std::optional<ToolFormat> tool_call_format(const std::string& name);
inline bool known_tool_call_parser(const std::string& name) { return tool_call_format(name).has_value(); }
// For error messages.
constexpr const char* kToolCallParsers = "deepseekv3, deepseek_v3, deepseekv31, deepseek_v31, kimi_k2";

class ToolCallParser {
 public:
  explicit ToolCallParser(ToolFormat f = ToolFormat::DeepseekV3) : format_(f) {}
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
  ToolFormat format_;
  State state_ = State::Content;
  std::string held_;
};

}  // namespace mlaserve::server
