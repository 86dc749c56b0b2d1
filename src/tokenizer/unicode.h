// Unicode helpers for the tokenizer: UTF-8 coding (validation, lossy decoding as Rust's from_utf8_lossy does),
// the character properties Hugging Face's Rust code asks for (char::is_whitespace, is_alphanumeric, ...), and
// normalization / lowercasing through ICU (Debian's libicu: complete, maintained Unicode data, nothing vendored).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace mlaserve::tok {

// Byte length of the UTF-8 sequence starting with `lead` (1 for invalid lead bytes, so loops always progress).
inline int utf8_seq_len(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;
}

// Decodes the code point at s[i] (s must be valid UTF-8) and advances i past it.
inline char32_t next_code_point(std::string_view s, size_t& i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    ++i;
    return c;
  }
  int n = utf8_seq_len(c);
  char32_t cp = c & (0x7F >> n);
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

// Decodes the code point ending just before s[i] and moves i back to its start.
inline char32_t prev_code_point(std::string_view s, size_t& i) {
  size_t j = i - 1;
  while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
  size_t k = j;
  char32_t cp = next_code_point(s, k);
  i = j;
  return cp;
}

void append_utf8(std::string& out, char32_t cp);

// Offset of the first byte that is not part of well-formed UTF-8, or npos when all of `s` is valid.
size_t find_invalid_utf8(std::string_view s);

// Throws mlaserve::Error "invalid UTF-8 in <what> at byte N" unless `s` is valid UTF-8.
void check_utf8(std::string_view s, std::string_view what);

// Bytes to text, each maximal ill-formed subsequence replaced by one U+FFFD (Unicode's "maximal subpart" rule,
// which is what Rust's String::from_utf8_lossy and so HF's decoders do).
std::string utf8_lossy(std::string_view bytes);

// Length in bytes of the longest prefix of `s` that ends on a complete UTF-8 character (s may end mid-character).
size_t complete_utf8_prefix(std::string_view s);

size_t count_code_points(std::string_view s);

// Character properties, with the definitions Rust's std uses.
bool is_whitespace(char32_t c);    // White_Space
bool is_numeric(char32_t c);       // gc in {Nd, Nl, No}
bool is_alphanumeric(char32_t c);  // Alphabetic || numeric
bool is_combining_mark(char32_t c);  // gc in {Mn, Mc, Me}, Unicode 9 (as HF's StripAccents)
// Regex-crate \w (Unicode word): Alphabetic, M, Nd, Pc, Join_Control.
bool is_word_char(char32_t c);

enum class NormForm { NFC, NFD, NFKC, NFKD };
std::string normalize(std::string_view s, NormForm form);
// Per-character full lowercase mapping (as Rust's char::to_lowercase applied to each character).
std::string lowercase(std::string_view s);

}  // namespace mlaserve::tok
