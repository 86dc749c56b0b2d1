// The tool-call parsers: content before the calls, each call's name and arguments (DeepSeek V3's fenced form and
// V3.1's plain one; Kimi-K2's with its call ids), whatever pieces the text comes in; an unfinished call is dropped.
#include <gtest/gtest.h>

#include "server/tool_calls.h"

namespace mlaserve::server {
namespace {

struct Parsed {
  std::string content;
  std::vector<ToolCall> calls;
};

Parsed parse(const std::string& text, size_t piece, ToolFormat f = ToolFormat::DeepseekV3) {
  ToolCallParser p(f);
  Parsed r;
  for (size_t i = 0; i < text.size(); i += piece) {
    auto o = p.push(std::string_view(text).substr(i, piece));
    r.content += o.content;
    for (auto& c : o.calls) r.calls.push_back(c);
  }
  auto o = p.flush();
  r.content += o.content;
  for (auto& c : o.calls) r.calls.push_back(c);
  return r;
}

TEST(ToolCallParser, CallsAndContentWhateverThePieces) {
  const std::string v3 =
      "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n"
      "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  const std::string v31 =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"x\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  const std::string cut = "a<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"x\"";
  const std::string none = "no calls here, just <｜tool";
  for (size_t piece : {size_t{10000}, size_t{1}, size_t{2}, size_t{3}, size_t{7}}) {
    SCOPED_TRACE("pieces of " + std::to_string(piece));
    Parsed a = parse(v3, piece);
    EXPECT_EQ(a.content, "Let me check.");
    ASSERT_EQ(a.calls.size(), 2u);
    EXPECT_EQ(a.calls[0].name, "get_weather");
    EXPECT_EQ(a.calls[0].arguments, "{\"city\": \"Paris\"}");
    EXPECT_EQ(a.calls[1].name, "get_time");
    EXPECT_EQ(a.calls[1].arguments, "{}");
    Parsed b = parse(v31, piece);
    EXPECT_EQ(b.content, "");
    ASSERT_EQ(b.calls.size(), 1u);
    EXPECT_EQ(b.calls[0].name, "search");
    EXPECT_EQ(b.calls[0].arguments, "{\"q\": \"x\"}");
    Parsed c = parse(cut, piece);
    EXPECT_EQ(c.content, "a");
    EXPECT_TRUE(c.calls.empty());
    Parsed d = parse(none, piece);
    EXPECT_EQ(d.content, none);
    EXPECT_TRUE(d.calls.empty());
  }
  // A call comes out as soon as its end marker arrives.
  ToolCallParser p;
  EXPECT_TRUE(p.push(v3.substr(0, v3.find("<｜tool▁call▁end｜>"))).calls.empty());
  EXPECT_EQ(p.push("<｜tool▁call▁end｜>").calls.size(), 1u);
  EXPECT_TRUE(known_tool_call_parser("deepseekv3"));
  EXPECT_TRUE(known_tool_call_parser("deepseek_v3"));
  EXPECT_FALSE(known_tool_call_parser("llama3"));
}

TEST(ToolCallParser, KimiK2CallsKeepTheirIds) {
  const std::string text =
      "I'll look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
      "{\"city\": \"Beijing\"}<|tool_call_end|> <|tool_call_begin|> functions.ns.search:1 "
      "<|tool_call_argument_begin|> {} <|tool_call_end|><|tool_calls_section_end|>";
  const std::string cut = "x<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{";
  for (size_t piece : {size_t{10000}, size_t{1}, size_t{5}}) {
    SCOPED_TRACE("pieces of " + std::to_string(piece));
    Parsed a = parse(text, piece, ToolFormat::KimiK2);
    EXPECT_EQ(a.content, "I'll look.");
    ASSERT_EQ(a.calls.size(), 2u);
    EXPECT_EQ(a.calls[0].name, "get_weather");
    EXPECT_EQ(a.calls[0].id, "functions.get_weather:0");
    EXPECT_EQ(a.calls[0].arguments, "{\"city\": \"Beijing\"}");
    EXPECT_EQ(a.calls[1].name, "ns.search");  // everything between the first '.' and the index
    EXPECT_EQ(a.calls[1].id, "functions.ns.search:1");
    EXPECT_EQ(a.calls[1].arguments, "{}");
    Parsed c = parse(cut, piece, ToolFormat::KimiK2);
    EXPECT_EQ(c.content, "x");
    EXPECT_TRUE(c.calls.empty());
  }
  // DeepSeek's markers are text to the Kimi parser, and Kimi's to DeepSeek's.
  EXPECT_EQ(parse(text, 7).content, text);
  const std::string ds = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  EXPECT_EQ(parse(ds, 3, ToolFormat::KimiK2).content, ds);
  EXPECT_TRUE(parse(ds, 3, ToolFormat::DeepseekV31).calls.size() == 1 &&
              parse(ds, 3, ToolFormat::DeepseekV31).calls[0].id.empty());
  EXPECT_TRUE(known_tool_call_parser("kimi_k2"));
}

}  // namespace
}  // namespace mlaserve::server
