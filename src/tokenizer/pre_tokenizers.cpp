#include "tokenizer/pre_tokenizers.h"

#include <array>

#include "core/error.h"
#include "tokenizer/json_util.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace mlaserve::tok {
namespace {

// GPT-2's pre-tokenization regex, used by ByteLevel when use_regex is true.
constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

struct ByteTables {
  std::array<char32_t, 256> to_char{};
  std::array<std::string, 256> to_utf8;
  std::array<int, 512> to_byte{};  // every mapped code point is < 512
  ByteTables() {
    to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      to_char[b] = c;
      append_utf8(to_utf8[b], c);
      to_byte[c] = b;
    }
  }
};

const ByteTables& byte_tables() {
  static const ByteTables t;
  return t;
}

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const std::string& s, const std::string& where) {
  if (s == "Removed") return Behavior::Removed;
  if (s == "Isolated") return Behavior::Isolated;
  if (s == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (s == "MergedWithNext") return Behavior::MergedWithNext;
  if (s == "Contiguous") return Behavior::Contiguous;
  fail("{}.behavior: unknown split behavior '{}' (Removed, Isolated, MergedWithPrevious, MergedWithNext, "
       "Contiguous)",
       where, s);
}

// A span of a piece and whether it is a match of the split pattern.
struct Span {
  size_t b, e;
  bool match;
};

// Walks the spans in order, extending the last merged span by the current one when joins(previous span matched,
// this span matches) says so (never into nothing).
template <typename Joins>
std::vector<Span> merge_forward(const std::vector<Span>& spans, Joins joins) {
  std::vector<Span> merged;
  bool prev_match = false;
  for (const auto& s : spans) {
    if (joins(prev_match, s.match) && !merged.empty())
      merged.back().e = s.e;
    else
      merged.push_back(s);
    prev_match = s.match;
  }
  return merged;
}

// Applies a SplitDelimiterBehavior to the spans (which cover the whole piece, in order) and appends the resulting
// non-empty sub-pieces of `p` to `out`. Mirrors NormalizedString::split.
void split_by_spans(const Piece& p, std::vector<Span>& spans, Behavior behavior, Pieces& out) {
  auto emit = [&](size_t b, size_t e) {
    if (e > b) out.push_back(Piece{p.text.substr(b, e - b), p.at_origin && b == 0});
  };
  switch (behavior) {
    case Behavior::Isolated:
      for (const auto& s : spans) emit(s.b, s.e);
      return;
    case Behavior::Removed:
      for (const auto& s : spans)
        if (!s.match) emit(s.b, s.e);
      return;
    case Behavior::Contiguous:  // runs of matches (and of non-matches) become one piece
      for (const auto& s : merge_forward(spans, [](bool prev, bool cur) { return cur == prev; })) emit(s.b, s.e);
      return;
    case Behavior::MergedWithPrevious:  // a match joins the piece before it
      for (const auto& s : merge_forward(spans, [](bool prev, bool cur) { return cur && !prev; })) emit(s.b, s.e);
      return;
    case Behavior::MergedWithNext: {
      std::vector<Span> merged;  // built back to front
      bool prev_match = false;
      for (size_t k = spans.size(); k-- > 0;) {
        const Span& s = spans[k];
        if (s.match && !prev_match && !merged.empty())
          merged.back().b = s.b;
        else
          merged.push_back(s);
        prev_match = s.match;
      }
      for (size_t k = merged.size(); k-- > 0;) emit(merged[k].b, merged[k].e);
      return;
    }
  }
}

// Spans of the matches of a per-character predicate: each matching character is its own match.
template <typename Pred>
void char_spans(const std::string& t, Pred pred, std::vector<Span>& spans) {
  spans.clear();
  size_t last = 0, i = 0;
  while (i < t.size()) {
    size_t b = i;
    char32_t c = next_code_point(t, i);
    if (pred(c)) {
      if (last < b) spans.push_back({last, b, false});
      spans.push_back({b, i, true});
      last = i;
    }
  }
  if (last < t.size()) spans.push_back({last, t.size(), false});
}

void regex_spans(const Regex& re, const std::string& t, bool invert, std::vector<Span>& spans) {
  spans.clear();
  size_t prev = 0;
  re.for_each_match(t, [&](size_t s, size_t e) {
    if (prev != s) spans.push_back({prev, s, invert});
    spans.push_back({s, e, !invert});
    prev = e;
  });
  if (prev != t.size()) spans.push_back({prev, t.size(), invert});
}

class SequencePre : public PreTokenizer {
 public:
  std::vector<std::unique_ptr<PreTokenizer>> parts;
  void apply(Pieces& pieces, Pieces& scratch) const override {
    for (const auto& p : parts) p->apply(pieces, scratch);
  }
};

class SplitPre : public PreTokenizer {
 public:
  SplitPre(std::unique_ptr<Regex> re, Behavior b, bool invert) : re_(std::move(re)), behavior_(b), invert_(invert) {}
  void apply(Pieces& pieces, Pieces& scratch) const override {
    scratch.clear();
    thread_local std::vector<Span> spans;
    for (const auto& p : pieces) {
      regex_spans(*re_, p.text, invert_, spans);
      split_by_spans(p, spans, behavior_, scratch);
    }
    pieces.swap(scratch);
  }

 private:
  std::unique_ptr<Regex> re_;
  Behavior behavior_;
  bool invert_;
};

// Python's str.isspace: bidirectional class WS, B or S, or category Zs.
bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

class LongRunSplitPre : public PreTokenizer {
 public:
  LongRunSplitPre(size_t max_chars, size_t max_run) : max_chars_(max_chars), max_run_(max_run) {}
  void apply(Pieces& pieces, Pieces& scratch) const override {
    scratch.clear();
    for (const auto& p : pieces) {
      const std::string& t = p.text;
      size_t start = 0;  // of the current output piece, in bytes
      auto emit = [&](size_t end) {
        if (end > start) scratch.push_back(Piece{t.substr(start, end - start), p.at_origin && start == 0});
        start = end;
      };
      size_t chars = 0, run = 0;
      bool run_space = false;
      for (size_t i = 0; i < t.size();) {
        size_t at = i;
        bool space = py_isspace(next_code_point(t, i));
        if (chars % max_chars_ == 0) {  // a new chunk: its first character starts a run
          emit(at);
          run = 1;
          run_space = space;
        } else if (space != run_space) {
          run = 1;
          run_space = space;
        } else if (++run > max_run_) {
          emit(at);
          run = 1;
        }
        ++chars;
      }
      emit(t.size());
    }
    pieces.swap(scratch);
  }

 private:
  size_t max_chars_, max_run_;
};

class ByteLevelPre : public PreTokenizer {
 public:
  ByteLevelPre(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space),
        re_(use_regex ? std::make_unique<Regex>(kGpt2Pattern, "ByteLevel regex") : nullptr) {}
  void apply(Pieces& pieces, Pieces& scratch) const override {
    const ByteTables& tb = byte_tables();
    scratch.clear();
    thread_local std::vector<Span> spans;
    thread_local Piece prefixed;
    for (auto& p0 : pieces) {
      const Piece* p = &p0;
      if (add_prefix_space_ && (p->text.empty() || p->text[0] != ' ')) {
        prefixed.text.assign(1, ' ');
        prefixed.text += p0.text;
        prefixed.at_origin = p0.at_origin;
        p = &prefixed;
      }
      size_t first = scratch.size();
      if (re_) {
        regex_spans(*re_, p->text, false, spans);
        split_by_spans(*p, spans, Behavior::Isolated, scratch);
      } else if (!p->text.empty()) {
        scratch.push_back(*p);
      }
      // Map every byte to its printable stand-in.
      for (size_t k = first; k < scratch.size(); ++k) {
        std::string& t = scratch[k].text;
        std::string mapped;
        mapped.reserve(t.size() * 2);
        for (unsigned char c : t) mapped += tb.to_utf8[c];
        t.swap(mapped);
      }
    }
    pieces.swap(scratch);
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> re_;
};

class DigitsPre : public PreTokenizer {
 public:
  explicit DigitsPre(bool individual) : individual_(individual) {}
  void apply(Pieces& pieces, Pieces& scratch) const override {
    scratch.clear();
    thread_local std::vector<Span> spans;
    for (const auto& p : pieces) {
      char_spans(p.text, is_numeric, spans);
      split_by_spans(p, spans, individual_ ? Behavior::Isolated : Behavior::Contiguous, scratch);
    }
    pieces.swap(scratch);
  }

 private:
  bool individual_;
};

class WhitespaceSplitPre : public PreTokenizer {
 public:
  void apply(Pieces& pieces, Pieces& scratch) const override {
    scratch.clear();
    thread_local std::vector<Span> spans;
    for (const auto& p : pieces) {
      char_spans(p.text, is_whitespace, spans);
      split_by_spans(p, spans, Behavior::Removed, scratch);
    }
    pieces.swap(scratch);
  }
};

// Whitespace: keeps the matches of \w+|[^\w\s]+ (with Oniguruma's Unicode \w and \s), drops the rest.
class WhitespacePre : public PreTokenizer {
 public:
  WhitespacePre() : re_("\\w+|[^\\w\\s]+", "Whitespace regex") {}
  void apply(Pieces& pieces, Pieces& scratch) const override {
    scratch.clear();
    thread_local std::vector<Span> spans;
    for (const auto& p : pieces) {
      regex_spans(re_, p.text, true, spans);
      split_by_spans(p, spans, Behavior::Removed, scratch);
    }
    pieces.swap(scratch);
  }

 private:
  Regex re_;
};

class MetaspacePre : public PreTokenizer {
 public:
  enum class Prepend { Always, First, Never };
  MetaspacePre(std::string replacement, Prepend scheme, bool split)
      : rep_(std::move(replacement)), scheme_(scheme), split_(split) {
    size_t i = 0;
    rep_cp_ = next_code_point(rep_, i);
  }
  void apply(Pieces& pieces, Pieces& scratch) const override {
    scratch.clear();
    thread_local std::vector<Span> spans;
    for (auto& p : pieces) {
      std::string t;
      t.reserve(p.text.size() + rep_.size());
      for (char c : p.text) {
        if (c == ' ')
          t += rep_;
        else
          t += c;
      }
      bool starts = t.compare(0, rep_.size(), rep_) == 0;
      if (!starts && (scheme_ == Prepend::Always || (scheme_ == Prepend::First && p.at_origin))) t.insert(0, rep_);
      Piece q{std::move(t), p.at_origin};
      if (split_) {
        char32_t r = rep_cp_;
        char_spans(q.text, [r](char32_t c) { return c == r; }, spans);
        split_by_spans(q, spans, Behavior::MergedWithNext, scratch);
      } else if (!q.text.empty()) {
        scratch.push_back(std::move(q));
      }
    }
    pieces.swap(scratch);
  }

 private:
  std::string rep_;
  char32_t rep_cp_;
  Prepend scheme_;
  bool split_;
};

}  // namespace

char32_t byte_char(unsigned char b) { return byte_tables().to_char[b]; }
const std::string& byte_char_utf8(unsigned char b) { return byte_tables().to_utf8[b]; }
int char_byte(char32_t c) { return c < 512 ? byte_tables().to_byte[c] : -1; }

std::unique_ptr<PreTokenizer> make_long_run_split(size_t max_chars, size_t max_run) {
  MLA_CHECK(max_chars > 0 && max_run > 0, "make_long_run_split: limits must be positive");
  return std::make_unique<LongRunSplitPre>(max_chars, max_run);
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer_sequence(std::vector<std::unique_ptr<PreTokenizer>> parts) {
  auto seq = std::make_unique<SequencePre>();
  for (auto& p : parts)
    if (p) seq->parts.push_back(std::move(p));
  return seq;
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& spec, const std::string& where) {
  if (spec.is_null()) return nullptr;
  std::string type = get_string(spec, "type", where);
  if (type == "Sequence") {
    auto seq = std::make_unique<SequencePre>();
    const auto& list = get_field(spec, "pretokenizers", where);
    MLA_CHECK(list.is_array(), "{}.pretokenizers: expected an array", where);
    for (size_t i = 0; i < list.size(); ++i) {
      auto p = make_pre_tokenizer(list[i], fmt::format("{}.pretokenizers[{}]", where, i));
      if (p) seq->parts.push_back(std::move(p));
    }
    return seq;
  }
  if (type == "Split") {
    return std::make_unique<SplitPre>(make_pattern(get_field(spec, "pattern", where), where + ".pattern"),
                                      parse_behavior(get_string(spec, "behavior", where), where),
                                      get_bool(spec, "invert", where, false));
  }
  if (type == "ByteLevel")
    return std::make_unique<ByteLevelPre>(get_bool(spec, "add_prefix_space", where, true),
                                          get_bool(spec, "use_regex", where, true));
  if (type == "Digits") return std::make_unique<DigitsPre>(get_bool(spec, "individual_digits", where, false));
  if (type == "WhitespaceSplit") return std::make_unique<WhitespaceSplitPre>();
  if (type == "Whitespace") return std::make_unique<WhitespacePre>();
  if (type == "Metaspace") {
    std::string rep = spec.contains("replacement") ? get_string(spec, "replacement", where) : "\xE2\x96\x81";
    MLA_CHECK(count_code_points(rep) == 1, "{}.replacement: expected one character, got '{}'", where, rep);
    MetaspacePre::Prepend scheme = MetaspacePre::Prepend::Always;
    if (spec.contains("prepend_scheme")) {
      std::string s = get_string(spec, "prepend_scheme", where);
      if (s == "always")
        scheme = MetaspacePre::Prepend::Always;
      else if (s == "first")
        scheme = MetaspacePre::Prepend::First;
      else if (s == "never")
        scheme = MetaspacePre::Prepend::Never;
      else
        fail("{}.prepend_scheme: unknown value '{}' (always, first, never)", where, s);
    } else if (!get_bool(spec, "add_prefix_space", where, true)) {
      scheme = MetaspacePre::Prepend::Never;
    }
    return std::make_unique<MetaspacePre>(rep, scheme, get_bool(spec, "split", where, true));
  }
  fail("{}: unsupported pre-tokenizer type '{}' (supported: Sequence, Split, ByteLevel, Digits, Metaspace, "
       "Whitespace, WhitespaceSplit)",
       where, type);
}

}  // namespace mlaserve::tok
