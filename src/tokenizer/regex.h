// PCRE2 regexes for tokenizer patterns (compiled UTF + UCP + JIT; text is validated once by the caller and matched
// with PCRE2_NO_UTF_CHECK). Hugging Face runs these patterns with Oniguruma, so patterns are first rewritten where
// the two engines differ (\s, \w), and matches are iterated with Oniguruma's rule for empty matches.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace mlaserve::tok {

class Regex {
 public:
  // `where` names the pattern's origin for error messages (e.g. "tokenizer.json pre_tokenizer[2].pattern").
  Regex(std::string_view pattern, std::string_view where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Leftmost match starting at or after byte `from`; false when none.
  bool find(std::string_view text, size_t from, size_t& start, size_t& end) const;

  // Every match in order, as Oniguruma's find_iter yields them (an empty match right where the previous match
  // ended is skipped). fn(start, end) in bytes.
  void for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& fn) const;

  // Quote a literal string so it matches itself.
  static std::string escape(std::string_view literal);

  const std::string& pattern() const { return source_; }

 private:
  std::string source_;
  std::string where_;
  void* code_ = nullptr;  // pcre2_code_8*
};

// Onig-compatible rewrite of a pattern for PCRE2 (exposed for tests).
std::string onig_to_pcre2(std::string_view pattern);

// tiktoken's patterns are Rust `regex` / fancy-regex syntax, whose classes may nest and intersect
// (`[\p{L}&&[^\p{Han}]]`). This rewrites such classes into lookaheads over plain classes (`(?:(?=[^\p{Han}])[\p{L}])`);
// everything else (\s, \w, \p{..}, (?i:..), lookahead) already means the same as in Oniguruma. Throws for a class
// it cannot rewrite (naming `where`).
std::string rust_classes_to_onig(std::string_view pattern, std::string_view where);

}  // namespace mlaserve::tok
