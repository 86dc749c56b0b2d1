#include "structured/regex.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

#include "core/error.h"

namespace mlaserve::structured {

namespace {

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;  // code-point ranges, inclusive
constexpr uint32_t kMaxCp = 0x10FFFF;

struct Node {
  // an empty Concat matches the empty string; Byte: the raw byte 0xFF (\C, never in UTF-8 text); Absent: any text
  // that holds none of `lits` (Onigmo's absent operator (?~a|b) of literals); Multiple: what kids[0] matches whose
  // decimal digits make a multiple of `min` ((?%k:...))
  enum Kind { Set, Concat, Alt, Repeat, Byte, Absent, Multiple } kind = Concat;
  Ranges ranges;
  std::vector<std::vector<uint32_t>> lits;
  std::vector<Node> kids;
  int min = 0, max = -1;  // Repeat: max -1 = unbounded; Multiple: min is k
};

Ranges normalized(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1) out.back().second = std::max(out.back().second, hi);
    else out.emplace_back(lo, hi);
  }
  return out;
}

Ranges complement(const Ranges& r0) {
  const Ranges r = normalized(r0);
  Ranges out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : r) {
    if (lo > next) out.emplace_back(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMaxCp) out.emplace_back(next, kMaxCp);
  return out;
}

// A pattern as error messages quote it: whole when short, else its start and its length (a schema's regex can be
// megabytes long).
std::string quoted(std::string_view pattern) {
  constexpr size_t kShown = 160;
  if (pattern.size() <= kShown) return fmt::format("'{}'", pattern);
  size_t cut = kShown;
  while (cut > 0 && (static_cast<unsigned char>(pattern[cut]) & 0xC0) == 0x80) --cut;  // whole UTF-8 characters
  return fmt::format("'{}...' ({} bytes)", pattern.substr(0, cut), pattern.size());
}

const Ranges kDigit{{'0', '9'}};
const Ranges kWord{{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
const Ranges kSpace{{'\t', '\r'}, {' ', ' '}};

class Parser {
 public:
  explicit Parser(std::string_view pattern) : pattern_(pattern) {
    size_t bad = 0;
    if (!decode_utf8(pattern, cps_, &bad)) fail("regex {}: not valid UTF-8 at byte {}", quoted(pattern), bad);
  }

  Node parse() {
    Node n = alt();
    if (pos_ < cps_.size()) error("unbalanced ')'");
    return n;
  }

 private:
  [[noreturn]] void error(const std::string& what) const {
    fail("regex {}: {} at position {}", quoted(pattern_), what, pos_);
  }
  static constexpr int kMaxGroupDepth = 1024;  // the parser and the compiler recurse once per level (~1 KB)
  int depth_ = 0;
  bool eof() const { return pos_ >= cps_.size(); }
  uint32_t peek(size_t k = 0) const { return pos_ + k < cps_.size() ? cps_[pos_ + k] : 0xFFFFFFFFu; }
  uint32_t take() {
    if (eof()) error("unexpected end");
    return cps_[pos_++];
  }

  Node alt() {
    Node first = concat();
    if (peek() != '|') return first;
    Node n;
    n.kind = Node::Alt;
    n.kids.push_back(std::move(first));
    while (peek() == '|') {
      ++pos_;
      n.kids.push_back(concat());
    }
    return n;
  }

  Node concat() {
    Node n;
    while (!eof() && peek() != '|' && peek() != ')') n.kids.push_back(repeat());
    if (n.kids.size() == 1) return std::move(n.kids[0]);
    return n;  // moved (a conditional expression with `n` in it copied the whole subtree at every nesting level)
  }

  static constexpr int64_t kMaxCount = 999999;
  // {n}, {n,}, {n,m} at pos_ (on '{'); false (pos_ unchanged) when it is not one: '{' is then a literal.
  bool counted(int& lo, int& hi) {
    size_t p = pos_ + 1;
    auto number = [&](int& v) {
      const size_t s = p;
      int64_t x = 0;
      while (p < cps_.size() && cps_[p] >= '0' && cps_[p] <= '9') {
        x = std::min<int64_t>(x * 10 + (cps_[p++] - '0'), kMaxCount + 1);
      }
      if (x > kMaxCount) {  // a quantifier no automaton could hold (Python's re and PCRE2 refuse it too)
        pos_ = s;
        error(fmt::format("a repeat count is larger than {}", kMaxCount));
      }
      v = static_cast<int>(x);
      return p > s;
    };
    const bool has_lo = number(lo);  // {,n}: 0 to n, as Python reads it
    hi = lo;
    if (p < cps_.size() && cps_[p] == ',') {
      ++p;
      if (!number(hi)) {
        if (!has_lo) return false;
        hi = -1;
      }
    } else if (!has_lo) {
      return false;
    }
    if (p >= cps_.size() || cps_[p] != '}') return false;
    pos_ = p + 1;
    if (hi >= 0 && hi < lo) error("a repeat count's maximum is below its minimum");
    return true;
  }

  Node repeat() {
    const uint32_t c = peek();
    if (c == '*' || c == '+' || c == '?') error("nothing to repeat");
    Node a = atom();
    for (;;) {
      int lo = 0, hi = -1;
      const uint32_t q = peek();
      if (q == '*') {
        ++pos_;
      } else if (q == '+') {
        ++pos_;
        lo = 1;
      } else if (q == '?') {
        ++pos_;
        hi = 1;
      } else if (q == '{' && counted(lo, hi)) {
      } else {
        break;
      }
      if (peek() == '?' || peek() == '+') ++pos_;  // lazy / possessive: the same language
      Node r;
      r.kind = Node::Repeat;
      r.min = lo;
      r.max = hi;
      r.kids.push_back(std::move(a));
      a = std::move(r);
    }
    return a;
  }

  static Node set(Ranges r) {
    Node n;
    n.kind = Node::Set;
    n.ranges = normalized(std::move(r));
    return n;
  }

  uint32_t hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      const uint32_t c = take();
      const int d = c >= '0' && c <= '9' ? static_cast<int>(c - '0')
                    : c >= 'a' && c <= 'f' ? static_cast<int>(c - 'a' + 10)
                    : c >= 'A' && c <= 'F' ? static_cast<int>(c - 'A' + 10)
                                           : -1;
      if (d < 0) error("a hex escape needs hex digits");
      v = v * 16 + static_cast<uint32_t>(d);
    }
    return v;
  }

  // After a backslash: a class shorthand (into `cls`, returns true) or one code point (into cp).
  bool escape(Ranges& cls, uint32_t& cp) {
    const uint32_t c = take();
    switch (c) {
      case 'd': cls = kDigit; return true;
      case 'D': cls = complement(kDigit); return true;
      case 'w': cls = kWord; return true;
      case 'W': cls = complement(kWord); return true;
      case 's': cls = kSpace; return true;
      case 'S': cls = complement(kSpace); return true;
      case 'n': cp = '\n'; return false;
      case 't': cp = '\t'; return false;
      case 'r': cp = '\r'; return false;
      case 'f': cp = '\f'; return false;
      case 'v': cp = '\v'; return false;
      case 'a': cp = 7; return false;
      case '0': cp = 0; return false;
      case 'x': cp = hex(2); return false;
      case 'u': cp = hex(4); return false;
      case 'U': cp = hex(8); return false;
      default: break;
    }
    if (c < 0x80 && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')))
      error(fmt::format("the escape '\\{}' is not supported (backreferences, anchors and word boundaries are not)",
                        static_cast<char>(c)));
    cp = c;
    return false;
  }

  Node klass() {  // after '['
    bool negate = false;
    if (peek() == '^') {
      ++pos_;
      negate = true;
    }
    Ranges r;
    bool first = true;
    for (;;) {
      if (eof()) error("unterminated character class");
      uint32_t c = take();
      if (c == ']' && !first) break;
      first = false;
      Ranges cls;
      if (c == '\\') {
        if (escape(cls, c)) {
          r.insert(r.end(), cls.begin(), cls.end());
          continue;
        }
      } else if (c == '[' && peek() == ':') {
        error("POSIX classes ([:name:]) are not supported");
      }
      uint32_t hi = c;
      if (peek() == '-' && peek(1) != ']' && peek(1) != 0xFFFFFFFFu) {
        ++pos_;
        hi = take();
        if (hi == '\\' && escape(cls, hi)) error("a class shorthand cannot end a range");
        if (hi < c) error("a character range is out of order");
      }
      r.emplace_back(c, hi);
    }
    return set(negate ? complement(r) : r);
  }

  // After "(?%": the modulus, ':', and the group up to ')'.
  Node multiple() {
    int64_t k = 0;
    for (uint32_t c = take(); c != ':'; c = take()) {
      if (c < '0' || c > '9' || (k == 0 && c == '0')) error("(?%k:...) takes a whole number k from 1 to 2^24");
      k = k * 10 + (c - '0');
      if (k > kMaxModulus) error("(?%k:...) takes a whole number k from 1 to 2^24");
    }
    if (k == 0) error("(?%k:...) takes a whole number k from 1 to 2^24");
    if (++depth_ > kMaxGroupDepth) error(fmt::format("groups nest more than {} deep", kMaxGroupDepth));
    Node n;
    n.kind = Node::Multiple;
    n.min = static_cast<int>(k);
    n.kids.push_back(alt());
    --depth_;
    if (take() != ')') error("missing ')'");
    return n;
  }
  static constexpr int64_t kMaxModulus = int64_t{1} << 24;

  // After "(?~": literal alternatives up to ')' (escapes of one code point allowed), kMaxAbsentCps code points in all
  // (its automaton is built in time their count squared).
  static constexpr size_t kMaxAbsentCps = 1024;
  Node absent() {
    Node n;
    n.kind = Node::Absent;
    n.lits.emplace_back();
    for (size_t total = 0;; ++total) {
      if (total > kMaxAbsentCps)
        error(fmt::format("the absent operator (?~...) holds more than {} characters", kMaxAbsentCps));
      const uint32_t c = take();
      if (c == ')' || c == '|') {
        if (n.lits.back().empty()) error("an alternative of the absent operator (?~...) is empty");
        if (c == ')') return n;
        n.lits.emplace_back();
        continue;
      }
      uint32_t cp = c;
      if (c == '\\') {
        Ranges cls;
        if (escape(cls, cp)) error("the absent operator (?~...) takes literal alternatives only");
      } else if (c == '(' || c == '[' || c == '.' || c == '*' || c == '+' || c == '?' || c == '{' || c == '^' ||
                 c == '$') {
        error("the absent operator (?~...) takes literal alternatives only");
      }
      n.lits.back().push_back(cp);
    }
  }

  Node atom() {
    const size_t at = pos_;
    const uint32_t c = take();
    switch (c) {
      case '(': {
        if (peek() == '?') {
          ++pos_;
          const uint32_t k = take();
          if (k == ':') {
          } else if (k == '~') {
            return absent();
          } else if (k == '%') {
            return multiple();
          } else if (k == 'P' || (k == '<' && peek() != '=' && peek() != '!')) {
            if (k == 'P' && take() != '<') error("only (?P<name>...) groups are supported after (?P");
            while (take() != '>') {
            }
          } else {
            error("lookaround, flags and other (?...) groups are not supported");
          }
        }
        if (++depth_ > kMaxGroupDepth) error(fmt::format("groups nest more than {} deep", kMaxGroupDepth));
        Node n = alt();
        --depth_;
        if (take() != ')') error("missing ')'");
        return n;
      }
      case '[':
        return klass();
      case '.':
        return set(complement({{'\n', '\n'}}));
      case '^':
        if (at != 0) error("'^' is supported only at the start");
        return Node{};
      case '$':
        if (pos_ != cps_.size()) error("'$' is supported only at the end");
        return Node{};
      case ')':
        error("unbalanced ')'");
      case '\\': {
        if (peek() == 'C') {  // mlaserve's marker byte of special tokens (structured/token_constraint.h)
          ++pos_;
          Node n;
          n.kind = Node::Byte;
          return n;
        }
        Ranges cls;
        uint32_t cp = 0;
        if (escape(cls, cp)) return set(cls);
        return set({{cp, cp}});
      }
      default:
        return set({{c, c}});
    }
  }

  std::string_view pattern_;
  std::vector<uint32_t> cps_;
  size_t pos_ = 0;
};

// The UTF-8 byte-range sequences of code points [a, b], all of one encoded length n: each sequence is a product of
// byte ranges. Split until, at every continuation level, the range either keeps the higher bits or spans every
// lower value.
void split_same_len(uint32_t a, uint32_t b, int n, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out) {
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((a & ~m) != (b & ~m)) {
      if ((a & m) != 0) {
        split_same_len(a, a | m, n, out);
        split_same_len((a | m) + 1, b, n, out);
        return;
      }
      if ((b & m) != m) {
        split_same_len(a, (b & ~m) - 1, n, out);
        split_same_len(b & ~m, b, n, out);
        return;
      }
    }
  }
  auto encode = [n](uint32_t cp, uint8_t* o) {
    if (n == 1) {
      o[0] = static_cast<uint8_t>(cp);
      return;
    }
    for (int k = n - 1; k > 0; --k) {
      o[k] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
      cp >>= 6;
    }
    o[0] = static_cast<uint8_t>((0xF00u >> n) | cp);  // 110xxxxx, 1110xxxx, 11110xxx
  };
  uint8_t ea[4], eb[4];
  encode(a, ea);
  encode(b, eb);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (int k = 0; k < n; ++k) seq.emplace_back(ea[k], eb[k]);
  out.push_back(std::move(seq));
}

void utf8_sequences(uint32_t lo, uint32_t hi, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out) {
  static constexpr uint32_t kLast[4] = {0x7F, 0x7FF, 0xFFFF, kMaxCp};
  for (int n = 1; n <= 4; ++n) {
    const uint32_t first = n == 1 ? 0 : kLast[n - 2] + 1;
    uint32_t a = std::max(lo, first), b = std::min(hi, kLast[n - 1]);
    if (a > b) continue;
    if (n == 3) {  // no surrogates
      if (a <= 0xD7FF) split_same_len(a, std::min(b, 0xD7FFu), 3, out);
      if (b >= 0xE000) split_same_len(std::max(a, 0xE000u), b, 3, out);
      continue;
    }
    split_same_len(a, b, n, out);
  }
}

class Builder {
 public:
  Builder(Nfa& nfa, size_t max_states, std::string_view pattern) : nfa_(nfa), max_(max_states), pattern_(pattern) {}

  struct Frag {
    int32_t start, end;
  };

  int32_t state() {
    if (nfa_.states.size() >= max_) fail("regex {}: its automaton would exceed {} states", quoted(pattern_), max_);
    nfa_.states.emplace_back();
    return static_cast<int32_t>(nfa_.states.size() - 1);
  }
  void eps(int32_t a, int32_t b) { nfa_.states[static_cast<size_t>(a)].eps.push_back(b); }

  // Edges from s to e reading one code point of `ranges` (its UTF-8 bytes).
  void set_edges(int32_t s, int32_t e, const Ranges& ranges) {
    std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
    for (const auto& [lo, hi] : ranges) utf8_sequences(lo, hi, seqs);
    for (const auto& seq : seqs) {
      int32_t cur = s;
      for (size_t k = 0; k < seq.size(); ++k) {
        const int32_t to = k + 1 == seq.size() ? e : state();
        nfa_.states[static_cast<size_t>(cur)].edges.push_back({seq[k].first, seq[k].second, to});
        cur = to;
      }
    }
  }

  // The absent operator: an Aho-Corasick automaton of the literals' code points whose nodes where a literal ends
  // (there or at a suffix) are left out, every other node accepting.
  Frag absent(const Node& n) {
    std::vector<std::map<uint32_t, int>> kid(1);
    std::vector<char> out(1, 0);
    std::set<uint32_t> alphabet;
    for (const auto& lit : n.lits) {
      int v = 0;
      for (uint32_t c : lit) {
        alphabet.insert(c);
        auto it = kid[static_cast<size_t>(v)].find(c);
        int w = 0;
        if (it != kid[static_cast<size_t>(v)].end()) {
          w = it->second;
        } else {
          w = static_cast<int>(kid.size());
          kid.emplace_back();
          out.push_back(0);
          kid[static_cast<size_t>(v)][c] = w;
        }
        v = w;
      }
      out[static_cast<size_t>(v)] = 1;
    }
    std::vector<int> fail(kid.size(), 0), order{0};
    for (size_t i = 0; i < order.size(); ++i) {  // breadth first
      const int v = order[i];
      for (const auto& [c, w] : kid[static_cast<size_t>(v)]) {
        int f = fail[static_cast<size_t>(v)];
        while (f != 0 && !kid[static_cast<size_t>(f)].count(c)) f = fail[static_cast<size_t>(f)];
        fail[static_cast<size_t>(w)] = v != 0 && kid[static_cast<size_t>(f)].count(c) ? kid[static_cast<size_t>(f)][c]
                                                                                      : 0;
        out[static_cast<size_t>(w)] |= out[static_cast<size_t>(fail[static_cast<size_t>(w)])];
        order.push_back(w);
      }
    }
    auto delta = [&](int v, uint32_t c) {
      while (v != 0 && !kid[static_cast<size_t>(v)].count(c)) v = fail[static_cast<size_t>(v)];
      const auto it = kid[static_cast<size_t>(v)].find(c);
      return it == kid[static_cast<size_t>(v)].end() ? 0 : it->second;
    };
    Ranges others;
    for (uint32_t c : alphabet) others.emplace_back(c, c);
    others = complement(others);
    std::vector<int32_t> st(kid.size(), -1);
    for (size_t v = 0; v < kid.size(); ++v)
      if (!out[v]) st[v] = state();
    const int32_t e = state();
    for (size_t v = 0; v < kid.size(); ++v) {
      if (out[v]) continue;
      eps(st[v], e);
      std::map<int, Ranges> to;
      for (uint32_t c : alphabet)
        if (const int t = delta(static_cast<int>(v), c); !out[static_cast<size_t>(t)]) to[t].emplace_back(c, c);
      for (const auto& [t, r] : to) set_edges(st[v], st[static_cast<size_t>(t)], normalized(r));
      if (!others.empty()) set_edges(st[v], st[0], others);
    }
    return {st[0], e};
  }

  // (?%k:...): the group's automaton times the remainders mod k of the number its digits make so far (other bytes
  // leave the remainder as it is): the pairs (state, remainder) reachable from (start, 0); the end is (end, 0).
  Frag multiple(const Node& n) {
    Nfa sub;
    Builder b(sub, max_, pattern_);
    const Frag f = b.build(n.kids[0]);
    const int64_t k = n.min;
    std::unordered_map<int64_t, int32_t> id;  // state * k + remainder
    std::vector<std::pair<int32_t, int32_t>> todo;
    auto pair = [&](int32_t s, int32_t r) {
      const auto [it, fresh] = id.try_emplace(s * k + r, 0);
      if (fresh) {
        it->second = state();
        todo.emplace_back(s, r);
      }
      return it->second;
    };
    auto edge = [&](int32_t from, int lo, int hi, int32_t to) {
      nfa_.states[static_cast<size_t>(from)].edges.push_back({static_cast<uint8_t>(lo), static_cast<uint8_t>(hi), to});
    };
    const int32_t start = pair(f.start, 0);
    while (!todo.empty()) {
      const auto [s, r] = todo.back();
      todo.pop_back();
      const int32_t me = id[s * k + r];
      const Nfa::State& st = sub.states[static_cast<size_t>(s)];
      for (int32_t t : st.eps) eps(me, pair(t, r));
      for (const Nfa::Edge& e : st.edges) {
        if (e.lo < '0') edge(me, e.lo, std::min<int>(e.hi, '0' - 1), pair(e.to, r));
        if (e.hi > '9') edge(me, std::max<int>(e.lo, '9' + 1), e.hi, pair(e.to, r));
        for (int d = std::max<int>(e.lo, '0'); d <= std::min<int>(e.hi, '9'); ++d)
          edge(me, d, d, pair(e.to, static_cast<int32_t>((int64_t{r} * 10 + (d - '0')) % k)));
      }
    }
    const auto end = id.find(int64_t{f.end} * k);
    return {start, end != id.end() ? end->second : state()};
  }

  Frag build(const Node& n) {
    switch (n.kind) {
      case Node::Multiple:
        return multiple(n);
      case Node::Set: {
        const int32_t s = state(), e = state();
        set_edges(s, e, n.ranges);
        return {s, e};
      }
      case Node::Absent:
        return absent(n);
      case Node::Byte: {
        const int32_t s = state(), e = state();
        nfa_.states[static_cast<size_t>(s)].edges.push_back({0xFF, 0xFF, e});
        return {s, e};
      }
      case Node::Concat: {
        const int32_t s = state();
        int32_t cur = s;
        for (const Node& k : n.kids) {
          const Frag f = build(k);
          eps(cur, f.start);
          cur = f.end;
        }
        return {s, cur};
      }
      case Node::Alt: {
        const int32_t s = state(), e = state();
        for (const Node& k : n.kids) {
          const Frag f = build(k);
          eps(s, f.start);
          eps(f.end, e);
        }
        return {s, e};
      }
      case Node::Repeat: {
        const int32_t s = state();
        int32_t cur = s;
        for (int i = 0; i < n.min; ++i) {
          const Frag f = build(n.kids[0]);
          eps(cur, f.start);
          cur = f.end;
        }
        if (n.max < 0) {
          const Frag f = build(n.kids[0]);
          const int32_t e = state();
          eps(cur, f.start);
          eps(cur, e);
          eps(f.end, f.start);
          eps(f.end, e);
          return {s, e};
        }
        const int32_t e = state();
        for (int i = n.min; i < n.max; ++i) {
          const Frag f = build(n.kids[0]);
          eps(cur, f.start);
          eps(cur, e);
          cur = f.end;
        }
        eps(cur, e);
        return {s, e};
      }
    }
    return {0, 0};
  }

 private:
  Nfa& nfa_;
  size_t max_;
  std::string_view pattern_;
};

constexpr int32_t kUnknown = -2;

}  // namespace

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
    return;
  }
  const int n = cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
  out += static_cast<char>((0xF00u >> n) | (cp >> (6 * (n - 1))));  // 110xxxxx, 1110xxxx or 11110xxx
  for (int i = n - 2; i >= 0; --i) out += static_cast<char>(0x80 | (cp >> (6 * i) & 0x3F));
}

bool decode_utf8(std::string_view text, std::vector<uint32_t>& out, size_t* bad_at) {
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<uint8_t>(text[i]);
    const int n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    bool ok = n > 0 && i + n <= text.size();
    uint32_t cp = n == 1 ? b : b & (0x7F >> n);
    for (int k = 1; ok && k < n; ++k) {
      const auto c = static_cast<uint8_t>(text[i + k]);
      ok = (c >> 6) == 2;
      cp = cp << 6 | (c & 0x3F);
    }
    if (!ok) {
      if (bad_at) *bad_at = i;
      return false;
    }
    out.push_back(cp);
    i += static_cast<size_t>(n);
  }
  return true;
}

Nfa compile_regex(std::string_view pattern, size_t max_states) {
  const Node root = Parser(pattern).parse();
  Nfa nfa;
  Builder b(nfa, max_states, pattern);
  const Builder::Frag f = b.build(root);
  nfa.start = f.start;
  nfa.accept = f.end;
  return nfa;
}

std::shared_ptr<const Nfa> compile_regex_shared(const std::string& pattern) {
  static std::mutex mu;
  static std::vector<std::pair<std::string, std::shared_ptr<const Nfa>>> kept;  // most recently used last
  {
    std::lock_guard<std::mutex> lk(mu);
    for (auto it = kept.begin(); it != kept.end(); ++it)
      if (it->first == pattern) {
        std::rotate(it, it + 1, kept.end());
        return kept.back().second;
      }
  }
  auto nfa = std::make_shared<const Nfa>(compile_regex(pattern));  // outside the lock: it may take a while
  std::lock_guard<std::mutex> lk(mu);
  for (const auto& k : kept)
    if (k.first == pattern) return k.second;  // another thread compiled it meanwhile
  kept.emplace_back(pattern, nfa);
  size_t states = 0;
  for (const auto& k : kept) states += k.second->states.size();
  while (kept.size() > 1 && (kept.size() > kCompiledRegexes || states > kCompiledRegexStates)) {
    states -= kept.front().second->states.size();
    kept.erase(kept.begin());
  }
  return nfa;
}

Dfa::Dfa(Nfa nfa, size_t max_states) : nfa_(std::move(nfa)), max_states_(max_states) {
  intern(closure({nfa_.start}));
}

std::vector<int32_t> Dfa::closure(std::vector<int32_t> seeds) const {
  std::vector<char> seen(nfa_.states.size(), 0);
  std::vector<int32_t> out, stack;
  for (int32_t s : seeds)
    if (!seen[static_cast<size_t>(s)]) {
      seen[static_cast<size_t>(s)] = 1;
      stack.push_back(s);
    }
  while (!stack.empty()) {
    const int32_t s = stack.back();
    stack.pop_back();
    out.push_back(s);
    for (int32_t t : nfa_.states[static_cast<size_t>(s)].eps)
      if (!seen[static_cast<size_t>(t)]) {
        seen[static_cast<size_t>(t)] = 1;
        stack.push_back(t);
      }
  }
  // Only states with byte edges (and the accept state) tell states apart.
  std::vector<int32_t> kept;
  for (int32_t s : out)
    if (!nfa_.states[static_cast<size_t>(s)].edges.empty() || s == nfa_.accept) kept.push_back(s);
  std::sort(kept.begin(), kept.end());
  return kept;
}

int32_t Dfa::intern(std::vector<int32_t> set) {
  if (set.empty()) return kDead;
  if (auto it = ids_.find(set); it != ids_.end()) return it->second;
  MLA_CHECK(sets_.size() < max_states_, "the regex's automaton needs more than {} states", max_states_);
  const auto id = static_cast<int32_t>(sets_.size());
  accepting_.push_back(std::binary_search(set.begin(), set.end(), nfa_.accept));
  std::array<int32_t, 256> row;
  row.fill(kUnknown);
  next_.push_back(row);
  ids_.emplace(set, id);
  sets_.push_back(std::move(set));
  return id;
}

int32_t Dfa::step(int32_t state, uint8_t byte) {
  if (state < 0) return kDead;
  const int32_t known = next_[static_cast<size_t>(state)][byte];
  if (known != kUnknown) return known;
  std::vector<int32_t> seeds;
  for (int32_t s : sets_[static_cast<size_t>(state)])
    for (const Nfa::Edge& e : nfa_.states[static_cast<size_t>(s)].edges)
      if (byte >= e.lo && byte <= e.hi) seeds.push_back(e.to);
  const int32_t id = seeds.empty() ? kDead : intern(closure(std::move(seeds)));
  next_[static_cast<size_t>(state)][byte] = id;
  return id;
}

int32_t Dfa::walk(int32_t state, std::string_view bytes) {
  for (char c : bytes) {
    state = step(state, static_cast<uint8_t>(c));
    if (state < 0) return kDead;
  }
  return state;
}

}  // namespace mlaserve::structured
