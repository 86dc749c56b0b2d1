#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include <vector>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace mlaserve::tok {
namespace {

// Oniguruma's \s with a Unicode encoding: \t \n \v \f \r, U+0085 and the Z categories; PCRE2 10.42 (UCP) leaves
// out U+0085. Its \w is Unicode "word" (Alphabetic, marks, Nd, Pc, Join_Control); PCRE2 10.42's is L, N and '_'.
constexpr std::string_view kSpaceSet = "\\t\\n\\x{0B}\\f\\r\\x{85}\\p{Z}";
constexpr std::string_view kWordSet = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}";

std::string pcre2_error(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

// Per-thread match state: one match data block (enough pairs for any tokenizer pattern) and a JIT stack larger
// than the 32 KiB default, as patterns like `\s+(?!\S)` recurse per character on long whitespace runs.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* ctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    data = pcre2_match_data_create(64, nullptr);
    ctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(ctx, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(ctx);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& match_state() {
  thread_local ThreadMatchState s;
  return s;
}

}  // namespace

std::string onig_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[i + 1];
      if (e == 's' || e == 'w') {
        std::string_view set = e == 's' ? kSpaceSet : kWordSet;
        if (in_class) {
          out += set;
        } else {
          out += '[';
          out += set;
          out += ']';
        }
        ++i;
        continue;
      }
      if ((e == 'S' || e == 'W') && !in_class) {
        out += "[^";
        out += e == 'S' ? kSpaceSet : kWordSet;
        out += ']';
        ++i;
        continue;
      }
      out += c;
      out += e;
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // POSIX class [:alpha:]
      size_t e = p.find(":]", i + 2);
      if (e != std::string_view::npos) {
        out.append(p.substr(i, e + 2 - i));
        i = e + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(std::string_view pattern, std::string_view where) : source_(pattern), where_(where) {
  check_utf8(pattern, where);
  std::string translated = onig_to_pcre2(pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &off, nullptr);
  MLA_CHECK(code != nullptr, "{}: bad regex '{}' at offset {}: {}", where, pattern, off, pcre2_error(err));
  int jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  (void)jit;  // without JIT (unsupported CPU) pcre2_match interprets: slower, same results
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::find(std::string_view text, size_t from, size_t& start, size_t& end) const {
  ThreadMatchState& st = match_state();
  int rc = pcre2_match(static_cast<pcre2_code*>(code_), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), from,
                       PCRE2_NO_UTF_CHECK, st.data, st.ctx);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  MLA_CHECK(rc >= 0, "{}: regex '{}' failed on a text of {} bytes: {}", where_, source_, text.size(), pcre2_error(rc));
  PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
  start = ov[0];
  end = ov[1];
  return true;
}

void Regex::for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& fn) const {
  size_t pos = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (pos <= text.size()) {
    size_t s, e;
    if (!find(text, pos, s, e)) break;
    if (s == e && have_last && last_end == e) {
      // Oniguruma's iterator: no empty match right after the previous match; step one character on.
      pos = e < text.size() ? e + utf8_seq_len(static_cast<unsigned char>(text[e])) : text.size() + 1;
      continue;
    }
    pos = e;
    have_last = true;
    last_end = e;
    fn(s, e);
  }
}

std::string Regex::escape(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}-#&~ \t\n").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace mlaserve::tok

namespace mlaserve::tok {
namespace {

// One bracketed class of a Rust pattern, parsed: `[^? operand (&& operand)* ]`, each operand a union of plain items
// (kept as source text, valid inside a PCRE2 class) and nested classes.
struct RustClass {
  bool negated = false;
  struct Operand {
    std::string items;
    std::vector<RustClass> nested;
  };
  std::vector<Operand> operands;
};

class RustClassParser {
 public:
  RustClassParser(std::string_view p, std::string_view where) : p_(p), where_(where) {}

  // Parses the class opening at p_[i] ('['); i ends after its ']'.
  RustClass parse(size_t& i) {
    RustClass c;
    ++i;
    if (i < p_.size() && p_[i] == '^') {
      c.negated = true;
      ++i;
    }
    c.operands.emplace_back();
    bool first = true;
    while (true) {
      MLA_CHECK(i < p_.size(), "{}: unterminated character class in '{}'", where_, p_);
      char ch = p_[i];
      if (ch == ']' && !first) {
        ++i;
        break;
      }
      first = false;
      if (ch == '&' && i + 1 < p_.size() && p_[i + 1] == '&') {
        c.operands.emplace_back();
        i += 2;
        continue;
      }
      if (ch == '[' && i + 1 < p_.size() && p_[i + 1] == ':') {  // POSIX [:alpha:]
        size_t e = p_.find(":]", i + 2);
        MLA_CHECK(e != std::string_view::npos, "{}: unterminated [: in '{}'", where_, p_);
        c.operands.back().items.append(p_.substr(i, e + 2 - i));
        i = e + 2;
        continue;
      }
      if (ch == '[') {
        c.operands.back().nested.push_back(parse(i));
        continue;
      }
      if (ch == '\\') {
        MLA_CHECK(i + 1 < p_.size(), "{}: pattern '{}' ends with a backslash", where_, p_);
        size_t b = i;
        i += 2;
        char e = p_[b + 1];
        // \p{..} / \P{..} / \x{..} / \u{..} keep their braces.
        if ((e == 'p' || e == 'P' || e == 'x' || e == 'u') && i < p_.size() && p_[i] == '{') {
          size_t close = p_.find('}', i);
          MLA_CHECK(close != std::string_view::npos, "{}: unterminated \\{}{{ in '{}'", where_, e, p_);
          i = close + 1;
        }
        c.operands.back().items.append(p_.substr(b, i - b));
        continue;
      }
      size_t b = i;
      i += utf8_seq_len(static_cast<unsigned char>(ch));
      c.operands.back().items.append(p_.substr(b, i - b));
    }
    return c;
  }

 private:
  std::string_view p_, where_;
};

bool plain(const RustClass& c) { return c.operands.size() == 1 && c.operands[0].nested.empty(); }

// A regex atom matching one character of the class.
std::string class_atom(const RustClass& c, std::string_view where);

std::string operand_atom(const RustClass::Operand& o, std::string_view where) {
  std::string items = o.items;
  std::vector<std::string> alts;
  for (const RustClass& n : o.nested) {
    if (plain(n) && !n.negated) {
      items += n.operands[0].items;  // a union of plain members: flatten
    } else {
      alts.push_back(class_atom(n, where));
    }
  }
  if (!items.empty()) alts.insert(alts.begin(), "[" + items + "]");
  MLA_CHECK(!alts.empty(), "{}: an empty operand in a character class", where);
  if (alts.size() == 1) return alts[0];
  std::string out = "(?:";
  for (size_t k = 0; k < alts.size(); ++k) out += (k ? "|" : "") + alts[k];
  return out + ")";
}

std::string class_atom(const RustClass& c, std::string_view where) {
  if (plain(c)) return std::string(c.negated ? "[^" : "[") + c.operands[0].items + "]";
  std::string inner;
  if (c.operands.size() == 1) {
    inner = operand_atom(c.operands[0], where);
  } else {
    // A && B && C: C's atom consumes the character after lookaheads for the others.
    inner = "(?:";
    for (size_t k = 0; k + 1 < c.operands.size(); ++k) inner += "(?=" + operand_atom(c.operands[k], where) + ")";
    inner += operand_atom(c.operands.back(), where) + ")";
  }
  if (!c.negated) return inner;
  return "(?:(?!" + inner + ")[\\x{0}-\\x{10FFFF}])";
}

}  // namespace

std::string rust_classes_to_onig(std::string_view p, std::string_view where) {
  std::string out;
  out.reserve(p.size() + 32);
  RustClassParser parser(p, where);
  for (size_t i = 0; i < p.size();) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      out.append(p.substr(i, 2));
      i += 2;
      continue;
    }
    if (c == '[') {
      size_t b = i;
      RustClass cls = parser.parse(i);
      if (plain(cls)) {
        out.append(p.substr(b, i - b));  // nothing to rewrite: keep the source
      } else {
        out += class_atom(cls, where);
      }
      continue;
    }
    out += c;
    ++i;
  }
  return out;
}

}  // namespace mlaserve::tok
