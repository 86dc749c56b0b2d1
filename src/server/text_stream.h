// Text-level streaming on top of a TextCodec: turning generated ids into text a piece at a time, and cutting
// the text at stop strings.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "server/text_codec.h"

namespace mlaserve::server {

// Incremental detokenizer: push() returns only text that later tokens cannot change. Decoding a window that
// starts a few tokens back (prefix) and subtracting the window's earlier text makes word-boundary effects
// (leading spaces, merged bytes) come out as a full decode would; a window whose text ends in U+FFFD (an
// incomplete UTF-8 character split across tokens) is held back until the next token completes it.
class IncrementalDetokenizer : public StreamDecoder {
 public:
  IncrementalDetokenizer(const TextCodec* codec, bool skip_special_tokens)
      : codec_(codec), skip_special_(skip_special_tokens) {}
  std::string push(const std::vector<int32_t>& tokens) override;
  // Text still held back at the end of generation (an incomplete character decodes to U+FFFD).
  std::string flush() override;

 private:
  const TextCodec* codec_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;  // window start
  size_t read_offset_ = 0;    // text of ids_[prefix_offset_, read_offset_) was already returned
};

// Stop strings on the detokenized text. push() returns the text that is safe to show: anything that could be
// the beginning of a stop string is held back until the next text decides it. On a match, the text before the
// stop string is returned, `matched()` is set and the stop string (and anything after it) is never returned.
class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops);
  std::string push(std::string_view text);
  // Text not to be searched (before the request's min_new_tokens): returned with what was held back.
  std::string pass(std::string_view text);
  std::string flush();  // generation ended without a match: the held-back text is real output
  const std::optional<std::string>& matched() const { return matched_; }
  bool empty() const { return stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  std::optional<std::string> matched_;
};

// SGLang's stop_regex: patterns searched in the output text's tail (its last kWindow bytes) as the text grows; the
// first pattern that matches ends the request, its text kept as SGLang keeps it (finish reason matched: the pattern).
// PCRE2 (UTF, Unicode classes), compiled once per request.
class StopRegexes {
 public:
  static constexpr size_t kWindow = 4096;
  // Throws std::exception naming the pattern when one does not compile (or the build has no regex library).
  explicit StopRegexes(const std::vector<std::string>& patterns);
  ~StopRegexes();
  // The first pattern found in `text` (valid UTF-8), if any; a pattern whose search fails (a backtracking limit)
  // counts as not found.
  std::optional<std::string> search(std::string_view text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Reasoning models' output (DeepSeek-R1: "<think>" optional at the start, the reasoning, "</think>", the answer) split
// into reasoning_content and content, a piece at a time: push() returns the new text of each part; a suffix that may
// begin "</think>" is held back until the next text decides it (flush() at the end: reasoning). Before "</think>"
// everything is reasoning (an output cut short by its length is all reasoning); whitespace right after "<think>" and
// at the start of the content is dropped (so the streamed parts equal the whole text's).
class ReasoningSplitter {
 public:
  // opened_only: an output that does not open with "<think>" (after whitespace) is all content (Kimi-K2-Thinking's
  // parser) rather than reasoning up to "</think>" (R1's).
  explicit ReasoningSplitter(bool opened_only = false) : opened_only_(opened_only) {}
  struct Parts {
    std::string reasoning, content;
  };
  Parts push(std::string_view text);
  Parts flush();
  bool in_reasoning() const { return state_ != State::Content; }

 private:
  enum class State { Start, Reasoning, Content };
  State state_ = State::Start;
  std::string held_;
  bool opened_only_;
  bool reasoning_started_ = true;  // false right after "<think>": whitespace is dropped until the reasoning starts
  bool content_started_ = false;
};

// Length of the longest suffix of `s` that is a proper prefix of `tag` (text to hold back while a marker may start).
size_t partial_tag_suffix(std::string_view s, std::string_view tag);
// Moves the text of `held` before `tag` to `out` and drops the tag (true); without the tag, moves all but a suffix that
// may begin it (false).
bool take_until_tag(std::string& held, std::string_view tag, std::string& out);
// Number of leading spaces, tabs and newlines of `s`.
size_t leading_space(std::string_view s);

// The reasoning parsers `--reasoning-parser` takes (the model families whose output ReasoningSplitter splits).
bool known_reasoning_parser(const std::string& name);
// Whether the reasoning parser `parser` splits a chat request's output, given its chat_template_kwargs (an object or
// null): deepseek-r1 and kimi_k2 always; deepseek-v3 (SGLang's; vLLM's deepseek_v3), for the hybrid DeepSeek-V3.1
// whose template opens the thinking only when asked, when the kwargs turn "thinking" (or "enable_thinking") on.
bool reasoning_split(const std::string& parser, const nlohmann::json& chat_template_kwargs);
// Whether the parser takes only an output that opens "<think>" as reasoning (kimi_k2: SGLang's and vLLM's parser for
// Kimi-K2-Thinking; ReasoningSplitter's opened_only).
bool reasoning_needs_open_think(const std::string& parser);

}  // namespace mlaserve::server
