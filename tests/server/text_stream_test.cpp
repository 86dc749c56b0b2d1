#include "server/text_stream.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "fakes.h"

namespace mlaserve::server {
namespace {

std::vector<int32_t> bytes(const std::string& s) { return test::ByteCodec().encode(s, false); }

TEST(IncrementalDetokenizer, HoldsBackSplitUtf8) {
  test::ByteCodec codec;
  IncrementalDetokenizer d(&codec, true);
  const std::string e_acute = "\xC3\xA9";  // é: two tokens in the byte codec
  EXPECT_EQ(d.push(bytes("a")), "a");
  EXPECT_EQ(d.push({0xC3}), "");
  EXPECT_EQ(d.push({0xA9}), e_acute);
  EXPECT_EQ(d.push(bytes("bc")), "bc");
  const std::string euro = "\xE2\x82\xAC";
  EXPECT_EQ(d.push({0xE2, 0x82}), "");
  EXPECT_EQ(d.push({0xAC, 'x'}), euro + "x");
  EXPECT_EQ(d.flush(), "");
}

TEST(IncrementalDetokenizer, FlushEmitsIncompleteAsReplacement) {
  test::ByteCodec codec;
  IncrementalDetokenizer d(&codec, true);
  EXPECT_EQ(d.push({'o', 'k', 0xE2}), "");  // held: the last character is incomplete
  EXPECT_EQ(d.flush(), "ok\xEF\xBF\xBD");
}

TEST(IncrementalDetokenizer, SkipsSpecialTokens) {
  test::ByteCodec codec;
  IncrementalDetokenizer d(&codec, true);
  EXPECT_EQ(d.push({'h', test::kEos}), "h");
  EXPECT_EQ(d.push({'i'}), "i");
  IncrementalDetokenizer keep(&codec, false);
  EXPECT_EQ(keep.push({'h', test::kEos}), "h<eos>");
}

TEST(IncrementalDetokenizer, MatchesFullDecodeOverManyPieces) {
  test::ByteCodec codec;
  const std::string text = "héllo wörld \xE2\x82\xAC \xF0\x9F\x98\x80 end";
  for (size_t step = 1; step <= 5; ++step) {
    IncrementalDetokenizer d(&codec, true);
    auto ids = bytes(text);
    std::string out;
    for (size_t i = 0; i < ids.size(); i += step)
      out += d.push(std::vector<int32_t>(ids.begin() + i, ids.begin() + std::min(ids.size(), i + step)));
    out += d.flush();
    EXPECT_EQ(out, text) << "step " << step;
  }
}

TEST(StopStringMatcher, NoStopsPassesThrough) {
  StopStringMatcher m({});
  EXPECT_EQ(m.push("abc"), "abc");
  EXPECT_EQ(m.flush(), "");
  EXPECT_FALSE(m.matched());
}

// Text before a request's min_new_tokens is passed through unsearched, with what was held back before it.
TEST(StopStringMatcher, PassedTextIsNotSearched) {
  StopStringMatcher m({"STOP"});
  EXPECT_EQ(m.pass("aSTOPb"), "aSTOPb");
  EXPECT_FALSE(m.matched());
  EXPECT_EQ(m.push("xST"), "x");
  EXPECT_EQ(m.pass("O"), "STO");  // the held prefix goes out with the passed text
  EXPECT_EQ(m.push("cSTOPd"), "c");
  ASSERT_TRUE(m.matched());
  EXPECT_EQ(m.pass("more"), "");
}

TEST(StopStringMatcher, MatchAcrossPiecesIsNeverEmitted) {
  StopStringMatcher m({"STOP"});
  std::string out;
  for (std::string piece : {"ab", "cS", "T", "O", "Pxyz"}) out += m.push(piece);
  EXPECT_EQ(out, "abc");
  ASSERT_TRUE(m.matched());
  EXPECT_EQ(*m.matched(), "STOP");
  EXPECT_EQ(m.push("more"), "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopStringMatcher, HeldPrefixReleasedWhenItDiverges) {
  StopStringMatcher m({"STOP"});
  EXPECT_EQ(m.push("aS"), "a");
  EXPECT_EQ(m.push("T"), "");
  EXPECT_EQ(m.push("x"), "STx");
  EXPECT_EQ(m.push("ST"), "");
  EXPECT_EQ(m.flush(), "ST");
  EXPECT_FALSE(m.matched());
}

TEST(StopStringMatcher, EarliestMatchWinsAmongSeveral) {
  StopStringMatcher m({"world", "lo w", "\n\n"});
  EXPECT_EQ(m.push("hello world"), "hel");
  EXPECT_EQ(*m.matched(), "lo w");
}

TEST(StopStringMatcher, OverlappingPrefixes) {
  StopStringMatcher m({"aab"});
  std::string out;
  for (char c : std::string("xaaaab")) out += m.push(std::string(1, c));
  EXPECT_EQ(out, "xaa");
  EXPECT_TRUE(m.matched());
}

TEST(StopStringMatcher, EmptyStopStringsIgnored) {
  StopStringMatcher m({""});
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(m.push("abc"), "abc");
}

// `text` pushed through a ReasoningSplitter in pieces of `piece` bytes, then flushed: (reasoning, content).
std::pair<std::string, std::string> split_in_pieces(const std::string& text, size_t piece, bool opened_only) {
  ReasoningSplitter sp(opened_only);
  std::string reasoning, content;
  for (size_t i = 0; i < text.size(); i += piece) {
    auto p = sp.push(std::string_view(text).substr(i, piece));
    reasoning += p.reasoning;
    content += p.content;
  }
  auto p = sp.flush();
  return {reasoning + p.reasoning, content + p.content};
}

// DeepSeek-R1 output split at "</think>": the whole text, and the same text pushed in every split into pieces of
// 1, 2, 3 and 5 bytes, give the same two parts.
TEST(ReasoningSplitter, SplitsAtTheEndTagWhateverThePieces) {
  struct Case {
    std::string text, reasoning, content;
  };
  const std::vector<Case> cases = {
      {"<think>\nLet me see.\n</think>\n\nThe answer is 4.", "Let me see.\n", "The answer is 4."},
      {"Let me see.</think>Four.", "Let me see.", "Four."},  // the template opened the think block
      {"  <think>a</think>b", "a", "b"},
      {"still thinking when the length ran out", "still thinking when the length ran out", ""},
      {"<think>cut at </thi", "cut at </thi", ""},
      {"<thinking is not the tag</think>x", "<thinking is not the tag", "x"},
      {"<thi", "", ""},
      {"a</think></think>b", "a", "</think>b"},
      {"</think>", "", ""},
  };
  for (const auto& c : cases) {
    for (size_t piece : {size_t{1000}, size_t{1}, size_t{2}, size_t{3}, size_t{5}}) {
      const auto [reasoning, content] = split_in_pieces(c.text, piece, /*opened_only=*/false);
      EXPECT_EQ(reasoning, c.reasoning) << c.text << " in pieces of " << piece;
      EXPECT_EQ(content, c.content) << c.text << " in pieces of " << piece;
    }
  }
  ReasoningSplitter sp;
  EXPECT_TRUE(sp.in_reasoning());
  EXPECT_EQ(sp.push("x</th").reasoning, "x");  // the partial tag waits
  auto p = sp.push("ink>y");
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, "y");
  EXPECT_FALSE(sp.in_reasoning());
  EXPECT_TRUE(known_reasoning_parser("deepseek-r1"));
  EXPECT_TRUE(known_reasoning_parser("deepseek_r1"));  // vLLM's name
  EXPECT_FALSE(known_reasoning_parser("r2"));
  EXPECT_TRUE(known_reasoning_parser("deepseek-v3"));
  EXPECT_TRUE(known_reasoning_parser("deepseek_v3"));
  // deepseek-r1 splits every request; deepseek-v3 (the hybrid V3.1) only those that turn thinking on
  const auto kw = [](const char* s) { return nlohmann::json::parse(s); };
  EXPECT_TRUE(reasoning_split("deepseek-r1", kw("{}")));
  EXPECT_TRUE(reasoning_split("deepseek_r1", kw("null")));
  EXPECT_FALSE(reasoning_split("deepseek-v3", kw("{}")));
  EXPECT_FALSE(reasoning_split("deepseek-v3", kw("null")));
  EXPECT_FALSE(reasoning_split("deepseek-v3", kw(R"({"thinking": false})")));
  EXPECT_FALSE(reasoning_split("deepseek-v3", kw(R"({"thinking": "yes"})")));
  EXPECT_TRUE(reasoning_split("deepseek-v3", kw(R"({"thinking": true})")));
  EXPECT_TRUE(reasoning_split("deepseek_v3", kw(R"({"enable_thinking": true})")));
  EXPECT_TRUE(reasoning_split("deepseek-v3", kw(R"({"thinking": 1})")));
  EXPECT_FALSE(reasoning_split("", kw(R"({"thinking": true})")));
}

// kimi_k2 (Kimi-K2-Thinking): only an output that opens "<think>" has reasoning; any other output is content as
// generated, whatever the pieces.
TEST(ReasoningSplitter, OpenedOnlySplitsAnOutputThatOpensThink) {
  struct Case {
    std::string text, reasoning, content;
  };
  const std::vector<Case> cases = {
      {"<think>\nWhy.\n</think>\n\nBecause.", "Why.\n", "Because."},
      {"  <think>a</think>b", "a", "b"},
      {"Let me see.</think>Four.", "", "Let me see.</think>Four."},
      {"  plain answer", "", "  plain answer"},
      {"<thinking>x", "", "<thinking>x"},
      {"<think>cut short", "cut short", ""},
      {"<thi", "", "<thi"},
      {"", "", ""},
  };
  for (const auto& c : cases) {
    for (size_t piece : {size_t{1000}, size_t{1}, size_t{2}, size_t{3}}) {
      const auto [reasoning, content] = split_in_pieces(c.text, piece, /*opened_only=*/true);
      EXPECT_EQ(reasoning, c.reasoning) << c.text << " in pieces of " << piece;
      EXPECT_EQ(content, c.content) << c.text << " in pieces of " << piece;
    }
  }
  EXPECT_TRUE(known_reasoning_parser("kimi_k2"));
  EXPECT_TRUE(reasoning_needs_open_think("kimi_k2"));
  EXPECT_FALSE(reasoning_needs_open_think("deepseek-r1"));
  EXPECT_TRUE(reasoning_split("kimi_k2", nlohmann::json::object()));
}

}  // namespace
}  // namespace mlaserve::server
