#include "tokenizer/unicode.h"

#include <unicode/normalizer2.h>
#include <unicode/uniset.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "core/error.h"

namespace mlaserve::tok {

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

namespace {

const icu::UnicodeSet& unicode_up_to(const char* pattern);

// Length of the well-formed sequence at s[i], or -k where k >= 1 is the length of the maximal ill-formed subpart
// (the bytes to replace by one U+FFFD). Table 3-7 of the Unicode standard.
int scan_sequence(std::string_view s, size_t i) {
  auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char c = b(i);
  if (c < 0x80) return 1;
  int n;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  for (int k = 1; k < n; ++k) {
    if (i + k >= s.size()) return -k;
    unsigned char x = b(i + k);
    if (x < lo || x > hi) return -k;
    lo = 0x80;
    hi = 0xBF;
  }
  return n;
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= s.size()) break;
    int n = scan_sequence(s, i);
    if (n < 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

void check_utf8(std::string_view s, std::string_view what) {
  size_t bad = find_invalid_utf8(s);
  MLA_CHECK(bad == std::string_view::npos, "invalid UTF-8 in {} at byte {} (0x{:02X})", what, bad,
            static_cast<unsigned char>(s[bad]));
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    int n = scan_sequence(s, i);
    if (n > 0) {
      out.append(s.data() + i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += -n;
    }
  }
  return out;
}

size_t complete_utf8_prefix(std::string_view s) {
  // Walk back over at most 3 continuation bytes to the last lead byte; keep it only if its sequence is complete.
  size_t n = s.size();
  size_t i = n;
  int back = 0;
  while (i > 0 && back < 4) {
    unsigned char c = static_cast<unsigned char>(s[i - 1]);
    --i;
    ++back;
    if ((c & 0xC0) != 0x80) {
      int need = utf8_seq_len(c);
      return (c >= 0x80 && need > back) ? i : n;
    }
  }
  return n;
}

size_t count_code_points(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool is_whitespace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE);
}

bool is_numeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  int8_t t = u_charType(static_cast<UChar32>(c));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

bool is_alphanumeric(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z');
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_ALPHABETIC) || is_numeric(c);
}

bool is_combining_mark(char32_t c) {
  if (c < 0x80) return false;
  int8_t t = u_charType(static_cast<UChar32>(c));
  if (t != U_NON_SPACING_MARK && t != U_COMBINING_SPACING_MARK && t != U_ENCLOSING_MARK) return false;
  return unicode_up_to("[:age=9.0:]").contains(static_cast<UChar32>(c));  // HF's tables are Unicode 9
}

bool is_word_char(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') || c == '_';
  UChar32 u = static_cast<UChar32>(c);
  int8_t t = u_charType(u);
  return u_hasBinaryProperty(u, UCHAR_ALPHABETIC) || t == U_NON_SPACING_MARK || t == U_ENCLOSING_MARK ||
         t == U_COMBINING_SPACING_MARK || t == U_DECIMAL_DIGIT_NUMBER || t == U_CONNECTOR_PUNCTUATION ||
         u_hasBinaryProperty(u, UCHAR_JOIN_CONTROL);
}

namespace {

// Hugging Face normalizes (and finds combining marks) with the crate unicode-normalization-alignments 0.1.12,
// whose tables are Unicode 9.0. ICU is newer; characters assigned later are
// left untouched (they act as boundaries, as characters unknown to the old tables do), which reproduces HF.
const icu::UnicodeSet& unicode_up_to(const char* pattern) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<icu::UnicodeSet>> sets;
  std::lock_guard<std::mutex> lock(mu);
  auto& s = sets[pattern];
  if (!s) {
    UErrorCode err = U_ZERO_ERROR;
    s = std::make_unique<icu::UnicodeSet>(icu::UnicodeString(pattern, -1, US_INV), err);
    MLA_CHECK(U_SUCCESS(err), "ICU: bad set {} ({})", pattern, u_errorName(err));
    s->freeze();
  }
  return *s;
}

const icu::Normalizer2& normalizer_for(NormForm form) {
  struct Forms {
    std::unique_ptr<icu::FilteredNormalizer2> f[4];
    Forms() {
      const icu::UnicodeSet& v9 = unicode_up_to("[:age=9.0:]");
      UErrorCode err = U_ZERO_ERROR;
      const icu::Normalizer2* base[4] = {
          icu::Normalizer2::getNFCInstance(err), icu::Normalizer2::getNFDInstance(err),
          icu::Normalizer2::getNFKCInstance(err), icu::Normalizer2::getNFKDInstance(err)};
      MLA_CHECK(U_SUCCESS(err), "ICU: cannot load the normalizers ({})", u_errorName(err));
      for (int i = 0; i < 4; ++i) f[i] = std::make_unique<icu::FilteredNormalizer2>(*base[i], v9);
    }
  };
  static const Forms forms;
  return *forms.f[static_cast<int>(form)];
}

}  // namespace

std::string normalize(std::string_view s, NormForm form) {
  bool ascii = true;
  for (unsigned char c : s)
    if (c >= 0x80) {
      ascii = false;
      break;
    }
  if (ascii) return std::string(s);  // ASCII is invariant under every normalization form
  const icu::Normalizer2& n = normalizer_for(form);
  UErrorCode err = U_ZERO_ERROR;
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  icu::UnicodeString r = n.normalize(u, err);
  MLA_CHECK(U_SUCCESS(err), "ICU: normalization failed ({})", u_errorName(err));
  std::string out;
  r.toUTF8String(out);
  return out;
}

std::string lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      out += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
      ++i;
      continue;
    }
    char32_t cp = next_code_point(s, i);
    // Full mapping of one character alone (no context), e.g. U+0130 -> "i\u0307", U+03A3 -> U+03C3.
    UChar src[2];
    int32_t len = 0;
    U16_APPEND_UNSAFE(src, len, static_cast<UChar32>(cp));
    UChar dst[8];
    UErrorCode err = U_ZERO_ERROR;
    int32_t n = u_strToLower(dst, 8, src, len, "", &err);
    MLA_CHECK(U_SUCCESS(err), "ICU: lowercase failed ({})", u_errorName(err));
    for (int32_t k = 0; k < n;) {
      UChar32 o;
      U16_NEXT(dst, k, n, o);
      append_utf8(out, static_cast<char32_t>(o));
    }
  }
  return out;
}

}  // namespace mlaserve::tok
