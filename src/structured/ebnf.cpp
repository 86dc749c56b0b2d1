#include "structured/ebnf.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <vector>

#include "core/error.h"
#include "structured/json_schema.h"
#include "structured/regex.h"
#include "structured/regex_build.h"

namespace mlaserve::structured {
namespace {

struct Node {
  enum Kind { Lit, Class, Ref, Seq, Alt, Rep } kind = Seq;
  std::string text;  // Lit: the bytes; Class: the class (or, from Lark, a regex) as written; Ref: the rule's name
  std::vector<Node> kids;
  int lo = 0, hi = -1;  // Rep: the count (hi < 0: unbounded)
  int line = 0;
};

// A Lark terminal (its name upper-case after any leading '_'), whose text holds no ignored pieces inside.
bool lark_terminal(const std::string& name) {
  const size_t i = name.find_first_not_of('_');
  return i != std::string::npos && name[i] >= 'A' && name[i] <= 'Z';
}

bool name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
         c == '.';
}

// Lark's common terminals (lark/grammars/common.lark) as regexes, for `%import common.NAME`.
const std::map<std::string, std::string>& lark_common() {
  static const std::map<std::string, std::string> m = {
      {"DIGIT", "[0-9]"},
      {"HEXDIGIT", "[0-9a-fA-F]"},
      {"INT", "[0-9]+"},
      {"SIGNED_INT", "[+-]?[0-9]+"},
      {"DECIMAL", "([0-9]+\\.[0-9]*|\\.[0-9]+)"},
      {"FLOAT", "([0-9]+[eE][+-]?[0-9]+|([0-9]+\\.[0-9]*|\\.[0-9]+)([eE][+-]?[0-9]+)?)"},
      {"SIGNED_FLOAT", "[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\\.[0-9]*|\\.[0-9]+)([eE][+-]?[0-9]+)?)"},
      {"NUMBER", "([0-9]+[eE][+-]?[0-9]+|([0-9]+\\.[0-9]*|\\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+)"},
      {"SIGNED_NUMBER", "[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\\.[0-9]*|\\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+)"},
      {"ESCAPED_STRING", "\"([^\"\\\\\\n]|\\\\.)*\""},
      {"LCASE_LETTER", "[a-z]"},
      {"UCASE_LETTER", "[A-Z]"},
      {"LETTER", "[A-Za-z]"},
      {"WORD", "[A-Za-z]+"},
      {"CNAME", "[_A-Za-z][_A-Za-z0-9]*"},
      {"WS_INLINE", "[ \\t]+"},
      {"WS", "[ \\t\\f\\r\\n]+"},
      {"CR", "\\r"},
      {"LF", "\\n"},
      {"NEWLINE", "(\\r?\\n)+"},
      {"SH_COMMENT", "#[^\\n]*"},
      {"CPP_COMMENT", "//[^\\n]*"},
  };
  return m;
}

class Parser {
 public:
  // lark: Lark's notation (vLLM's guided_grammar takes it too) instead of GBNF's.
  Parser(std::string_view g, bool lark) : g_(g), lark_(lark) {}

  // Lark's notation: the first statement is a directive or `[?!]name[.N]:` (read as Lark; a GBNF rule's "::="
  // is not).
  bool starts_lark() {
    skip();
    if (pos_ < g_.size() && (g_[pos_] == '%' || g_[pos_] == '?' || g_[pos_] == '!')) return true;
    ident();
    skip();
    return pos_ < g_.size() && g_[pos_] == ':' && g_.substr(pos_, 3) != "::=";
  }

  // A Lark grammar's %ignore items as one alternation (no kids: none), read by rules().
  const Node& ignored() const { return ignored_; }

  std::map<std::string, Node> rules() {
    std::map<std::string, Node> out;
    skip();
    while (pos_ < g_.size()) {
      const int line = line_;
      if (lark_ && g_[pos_] == '%') {
        directive(out);
        skip();
        continue;
      }
      if (lark_ && (g_[pos_] == '?' || g_[pos_] == '!')) ++pos_;  // inlining / keeping tokens: the same text
      std::string name = ident();
      if (name.empty()) error("a rule must start with its name");
      if (lark_) strip_priority(name);
      skip();
      if (lark_) {
        if (pos_ >= g_.size() || g_[pos_] != ':') error(fmt::format("':' must follow the rule name '{}'", name));
        ++pos_;
      } else {
        if (g_.substr(pos_, 3) != "::=") error(fmt::format("'::=' must follow the rule name '{}'", name));
        pos_ += 3;
      }
      if (out.count(name)) error(fmt::format("the rule '{}' is defined twice", name));
      Node body = alternatives();
      body.line = line;
      out.emplace(name, std::move(body));
      skip();
    }
    return out;
  }

 private:
  [[noreturn]] void error(const std::string& what) const {
    fail("{}, line {}: {}", lark_ ? "lark grammar" : "ebnf", line_, what);
  }

  // A Lark rule's priority (name.2) is not part of its name.
  void strip_priority(std::string& name) const {
    const size_t dot = name.find('.');
    if (dot != std::string::npos && dot + 1 < name.size() &&
        name.find_first_not_of("0123456789", dot + 1) == std::string::npos)
      name.resize(dot);
  }

  // %import common.NAME [-> ALIAS], %import common (A, B), %ignore ITEM (a terminal, string or regex that may stand
  // between any two tokens of the rules; several add up); other directives are errors.
  void directive(std::map<std::string, Node>& out) {
    ++pos_;
    const std::string what = ident();
    if (what == "ignore") {
      const int line = line_;
      Node item = alternatives();
      if (item.kids.size() == 1 && item.kids[0].kids.empty()) error("'%ignore' must name what it ignores");
      ignored_.kind = Node::Alt;
      if (ignored_.kids.empty()) ignored_.line = line;
      ignored_.kids.push_back(std::move(item));
      return;
    }
    if (what != "import") error(fmt::format("'%{}' is not supported", what));
    auto blanks = [&] {
      while (pos_ < g_.size() && (g_[pos_] == ' ' || g_[pos_] == '\t')) ++pos_;
    };
    blanks();
    const std::string path = ident();  // "common.NAME" or "common"
    std::vector<std::pair<std::string, std::string>> names;  // (common name, rule name)
    blanks();
    if (path.rfind("common.", 0) == 0) {
      std::string name = path.substr(7), as = name;
      if (g_.substr(pos_, 2) == "->") {
        pos_ += 2;
        blanks();
        as = ident();
      }
      names.emplace_back(name, as);
    } else if (path == "common" && pos_ < g_.size() && g_[pos_] == '(') {
      ++pos_;
      for (;;) {
        skip();
        const std::string name = ident();
        if (name.empty()) error("'%import common (...)' must list names");
        names.emplace_back(name, name);
        skip();
        if (pos_ < g_.size() && g_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (pos_ < g_.size() && g_[pos_] == ')') {
          ++pos_;
          break;
        }
        error("'%import common (...)' must end with ')'");
      }
    } else {
      error(fmt::format("only Lark's common terminals can be imported, not '{}'", path));
    }
    for (const auto& [name, as] : names) {
      const auto it = lark_common().find(name);
      if (it == lark_common().end()) error(fmt::format("'common.{}' is not a terminal this server knows", name));
      if (out.count(as)) error(fmt::format("the rule '{}' is defined twice", as));
      Node n;
      n.kind = Node::Class;
      n.text = "(" + it->second + ")";
      n.line = line_;
      out.emplace(as, std::move(n));
    }
  }

  void skip() {  // whitespace (newlines too) and # comments (Lark: // comments too)
    while (pos_ < g_.size()) {
      const char c = g_[pos_];
      if (lark_ && c == '/' && pos_ + 1 < g_.size() && g_[pos_ + 1] == '/') {
        while (pos_ < g_.size() && g_[pos_] != '\n') ++pos_;
      } else if (c == '#') {
        while (pos_ < g_.size() && g_[pos_] != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
        if (c == '\n') ++line_;
        ++pos_;
      } else {
        break;
      }
    }
  }

  std::string ident() {
    const size_t start = pos_;
    while (pos_ < g_.size() && name_char(g_[pos_])) ++pos_;
    return std::string(g_.substr(start, pos_ - start));
  }

  // Whether the next tokens are `name ::=` (Lark: `[?!]name[.N] :` or a directive) -- the next rule starts --
  // without moving.
  bool rule_ahead() {
    const size_t p = pos_;
    const int l = line_;
    bool ahead = false;
    if (lark_) {
      if (pos_ < g_.size() && g_[pos_] == '%') return true;
      if (pos_ < g_.size() && (g_[pos_] == '?' || g_[pos_] == '!')) ++pos_;
      ahead = !ident().empty() && (skip(), pos_ < g_.size() && g_[pos_] == ':');
    } else {
      ahead = !ident().empty() && (skip(), g_.substr(pos_, 3) == "::=");
    }
    pos_ = p;
    line_ = l;
    return ahead;
  }

  Node alternatives() {
    Node alt;
    alt.kind = Node::Alt;
    alt.line = line_;
    alt.kids.push_back(sequence());
    alias();
    while (pos_ < g_.size() && g_[pos_] == '|') {
      ++pos_;
      alt.kids.push_back(sequence());
      alias();
    }
    return alt;
  }

  void alias() {  // Lark's "-> name" after an alternative names its tree node: no text
    skip();
    if (!lark_ || g_.substr(pos_, 2) != "->") return;
    pos_ += 2;
    skip();
    if (ident().empty()) error("'->' must be followed by a name");
    skip();
  }

  Node sequence() {
    Node seq;
    seq.kind = Node::Seq;
    seq.line = line_;
    for (;;) {
      skip();
      if (pos_ >= g_.size() || g_[pos_] == '|' || g_[pos_] == ')' || (lark_ && g_[pos_] == ']') ||
          (lark_ && g_.substr(pos_, 2) == "->") || rule_ahead())
        break;
      Node item = primary();
      repeats(item);
      seq.kids.push_back(std::move(item));
    }
    return seq;
  }

  void repeats(Node& item) {
    for (;;) {
      if (lark_) {  // Lark writes "item ~ 3" with blanks around the ~
        size_t p = pos_;
        while (p < g_.size() && (g_[p] == ' ' || g_[p] == '\t')) ++p;
        if (p < g_.size() && g_[p] == '~') pos_ = p;
      }
      if (pos_ >= g_.size()) return;
      const char c = g_[pos_];
      int lo, hi;
      if (c == '*') lo = 0, hi = -1, ++pos_;
      else if (c == '+') lo = 1, hi = -1, ++pos_;
      else if (c == '?') lo = 0, hi = 1, ++pos_;
      else if (c == '{' && !lark_) count(lo, hi);
      else if (c == '~' && lark_) tilde(lo, hi);
      else return;
      Node rep;
      rep.kind = Node::Rep;
      rep.lo = lo;
      rep.hi = hi;
      rep.line = line_;
      rep.kids.push_back(std::move(item));
      item = std::move(rep);
    }
  }

  int number() {  // a repeat count
    const size_t start = pos_;
    while (pos_ < g_.size() && g_[pos_] >= '0' && g_[pos_] <= '9') ++pos_;
    if (start == pos_ || pos_ - start > 4) error("a repeat count must be a number below 10000");
    return std::stoi(std::string(g_.substr(start, pos_ - start)));
  }

  void tilde(int& lo, int& hi) {  // Lark's item ~ n and item ~ n..m
    ++pos_;
    skip();
    lo = hi = number();
    if (g_.substr(pos_, 2) == "..") {
      pos_ += 2;
      hi = number();
    }
    if (hi < lo) error("a repeat count's maximum is below its minimum");
  }

  void count(int& lo, int& hi) {  // after '{': m}, m,}, m,n}
    ++pos_;
    lo = number();
    hi = lo;
    if (pos_ < g_.size() && g_[pos_] == ',') {
      ++pos_;
      hi = pos_ < g_.size() && g_[pos_] == '}' ? -1 : number();
    }
    if (pos_ >= g_.size() || g_[pos_] != '}') error("a repeat count must end with '}'");
    ++pos_;
    if (hi >= 0 && hi < lo) error("a repeat count's maximum is below its minimum");
  }

  Node primary() {
    Node n;
    n.line = line_;
    const char c = g_[pos_];
    if (lark_ && c == '"') {
      lark_string(n);
    } else if (lark_ && c == '/') {
      lark_regex(n);
    } else if (lark_ && c == '[') {  // an optional item
      ++pos_;
      Node body = group_body(']');
      n.kind = Node::Rep;
      n.lo = 0;
      n.hi = 1;
      n.kids.push_back(std::move(body));
    } else if (lark_ && c == '{') {
      error("templates are not supported");
    } else if (c == '"' || c == '\'') {
      n.kind = Node::Lit;
      n.text = literal(c);
    } else if (c == '[') {
      n.kind = Node::Class;
      const size_t start = pos_++;
      if (pos_ < g_.size() && g_[pos_] == '^') ++pos_;
      bool first = true;
      while (pos_ < g_.size() && (g_[pos_] != ']' || first)) {
        if (g_[pos_] == '\\') ++pos_;
        if (pos_ < g_.size() && g_[pos_] == '\n') error("a character class must end on its line");
        ++pos_;
        first = false;
      }
      if (pos_ >= g_.size()) error("a character class must end with ']'");
      ++pos_;
      n.text = std::string(g_.substr(start, pos_ - start));
    } else if (c == '(') {
      ++pos_;
      n = group_body(')');
    } else if (name_char(c)) {
      n.kind = Node::Ref;
      n.text = ident();
    } else {
      error(fmt::format("unexpected '{}'", c));
    }
    return n;
  }

  Node group_body(char close) {  // after the opening bracket
    if (++depth_ > 256) error("groups nest more than 256 deep");  // the parser and the converter recurse per level
    Node n = alternatives();
    --depth_;
    skip();
    if (pos_ >= g_.size() || g_[pos_] != close) error(fmt::format("a group must end with '{}'", close));
    ++pos_;
    return n;
  }

  // Lark: "text", "text"i (any case), "a".."z" (a range of characters).
  void lark_string(Node& n) {
    const std::string s = literal('"');
    if (g_.substr(pos_, 2) == "..") {
      pos_ += 2;
      if (pos_ >= g_.size() || g_[pos_] != '"') error("a range must be \"a\"..\"z\"");
      const std::string t = literal('"');
      const auto one = [&](const std::string& x) {  // the single code point of x
        std::vector<uint32_t> cps;
        if (!decode_utf8(x, cps) || cps.size() != 1) error("a range's ends must be single characters");
        return cps[0];
      };
      const uint32_t lo = one(s), hi = one(t);
      if (hi < lo) error("a character range is out of order");
      n.kind = Node::Class;
      n.text = fmt::format("[\\U{:08X}-\\U{:08X}]", lo, hi);
      return;
    }
    if (pos_ < g_.size() && g_[pos_] == 'i' && (pos_ + 1 >= g_.size() || !name_char(g_[pos_ + 1]))) {
      ++pos_;
      n.kind = Node::Class;  // a regex with both cases of each ASCII letter
      for (char ch : s) {
        const char lo = static_cast<char>(ch | 0x20);
        if (lo >= 'a' && lo <= 'z') n.text += fmt::format("[{}{}]", lo, static_cast<char>(lo - 32));
        else n.text += regex_escape(std::string(1, ch));
      }
      n.text = "(" + n.text + ")";
      return;
    }
    n.kind = Node::Lit;
    n.text = s;
  }

  // Lark: /regex/ (no flags), kept as the regex it is (\/ is a slash).
  void lark_regex(Node& n) {
    ++pos_;
    std::string r;
    while (pos_ < g_.size() && g_[pos_] != '/') {
      if (g_[pos_] == '\n') error("a regex must end on its line");
      if (g_[pos_] == '\\' && pos_ + 1 < g_.size()) {
        if (g_[pos_ + 1] == '/') {
          r += '/';
          pos_ += 2;
          continue;
        }
        r += g_[pos_++];
      }
      r += g_[pos_++];
    }
    if (pos_ >= g_.size()) error("a regex must end with '/'");
    ++pos_;
    if (pos_ < g_.size() && std::string_view("imslux").find(g_[pos_]) != std::string_view::npos)
      error(fmt::format("the regex flag '{}' is not supported", g_[pos_]));
    try {
      compile_regex(r);
    } catch (const Error& e) {
      error(e.what());
    }
    n.kind = Node::Class;
    n.text = "(" + r + ")";
  }

  std::string literal(char quote) {
    ++pos_;
    std::string out;
    auto hex = [&](int digits) {
      uint32_t v = 0;
      for (int i = 0; i < digits; ++i) {
        if (pos_ >= g_.size()) error("a hex escape needs hex digits");
        const char d = g_[pos_++];
        const int x = d >= '0' && d <= '9' ? d - '0' : d >= 'a' && d <= 'f' ? d - 'a' + 10
                      : d >= 'A' && d <= 'F' ? d - 'A' + 10 : -1;
        if (x < 0) error("a hex escape needs hex digits");
        v = v * 16 + static_cast<uint32_t>(x);
      }
      return v;
    };
    while (pos_ < g_.size() && g_[pos_] != quote) {
      const char c = g_[pos_++];
      if (c == '\n') error("a string must end on its line");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= g_.size()) break;
      const char e = g_[pos_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'x': append_utf8(out, hex(2)); break;
        case 'u': append_utf8(out, hex(4)); break;
        case 'U': append_utf8(out, hex(8)); break;
        default: out += e;  // \\ \" \' and any other character as itself
      }
    }
    if (pos_ >= g_.size()) error("a string must end with its quote");
    ++pos_;
    return out;
  }

  std::string_view g_;
  bool lark_ = false;
  size_t pos_ = 0;
  int line_ = 1;
  int depth_ = 0;
  Node ignored_;
};

using build::group;
using build::Rx;

class Converter {
 public:
  // With a Lark grammar's %ignore items, the rules' sequences and repeats allow them between their elements (not
  // inside terminals: upper-case names, strings, regexes); ignored() is that piece of regex, empty without.
  // what: how errors name the grammar ("ebnf" or "lark grammar"); ignored: Parser::ignored().
  Converter(const std::map<std::string, Node>& rules, const Node& ignored, const char* what)
      : rules_(rules), what_(what) {
    if (ignored.kids.empty()) return;
    in_terminal_ = true;
    Rx x = convert(ignored);
    in_terminal_ = false;
    if (!x || x->empty()) fail("{}, line {}: '%ignore' matches no text", what_, ignored.line);
    ignore_ = group(*x) + "*";
  }
  const std::string& ignored() const { return ignore_; }

  Rx convert(const Node& n) {
    Rx r = of(n);
    if (r && r->size() > kMaxRegexBytes)
      fail("{}, line {}: the grammar's regex would exceed {} bytes", what_, n.line, kMaxRegexBytes);
    return r;
  }

 private:
  Rx of(const Node& n) {
    switch (n.kind) {
      case Node::Lit: return regex_escape(n.text);
      case Node::Class: return n.text;
      case Node::Ref: {
        auto it = rules_.find(n.text);
        if (it == rules_.end()) fail("{}, line {}: the rule '{}' is not defined", what_, n.line, n.text);
        const bool outer = in_terminal_;
        in_terminal_ = outer || lark_terminal(n.text);
        Rx r = refs_.follow(&it->second, [&] { return convert(it->second); },
                            fmt::format("{}, line {}", what_, n.line));
        in_terminal_ = outer;
        return r;
      }
      case Node::Seq: {
        std::string r;
        bool first = true;
        for (const Node& k : n.kids) {
          Rx x = convert(k);
          if (!x) return std::nullopt;
          if (!first && between()) r += ignore_;
          r += group(*x);
          first = false;
        }
        return r;
      }
      case Node::Alt: {
        std::vector<std::string> alts;
        for (const Node& k : n.kids)
          if (Rx x = convert(k)) alts.push_back(std::move(*x));
        return alts.empty() ? Rx() : Rx(build::join(alts));
      }
      case Node::Rep: {
        Rx x = convert(n.kids[0]);
        if (!x) return n.lo == 0 ? Rx(std::string()) : Rx();  // taken zero times
        if (between() && n.hi != 0 && n.hi != 1) {  // x (ignored x){lo-1, hi-1}, optional when lo is 0
          const std::string one = group(*x);
          std::string r = one;
          r += "(?:";
          r += ignore_;
          r += one;
          r += ")";
          const int lo = std::max(n.lo - 1, 0);
          r += n.hi < 0 ? fmt::format("{{{},}}", lo) : fmt::format("{{{},{}}}", lo, n.hi - 1);
          return n.lo == 0 ? "(?:" + r + ")?" : r;
        }
        return group(*x) + (n.hi < 0 ? fmt::format("{{{},}}", n.lo) : fmt::format("{{{},{}}}", n.lo, n.hi));
      }
    }
    return std::nullopt;
  }

  bool between() const { return !ignore_.empty() && !in_terminal_; }

  const std::map<std::string, Node>& rules_;
  const char* what_;
  build::RefStack refs_;
  std::string ignore_;
  bool in_terminal_ = false;
};

}  // namespace

std::string ebnf_regex(std::string_view grammar) {
  const bool lark = Parser(grammar, true).starts_lark();
  Parser parser(grammar, lark);
  const std::map<std::string, Node> rules = parser.rules();
  auto root = rules.find(lark ? "start" : "root");
  if (root == rules.end())
    fail("{}", lark ? "lark grammar: the grammar has no rule 'start' (the text it allows)"
                    : "ebnf: the grammar has no rule 'root' (the text it allows)");
  const char* what = lark ? "lark grammar" : "ebnf";
  Converter c(rules, parser.ignored(), what);
  Rx r = c.convert(root->second);
  if (!r) fail("{}: the grammar allows no text (its rules recurse with no way to end)", what);
  if (!c.ignored().empty()) {  // ignored text may also lead and trail the whole
    std::string all = c.ignored();
    all += group(*r);
    all += c.ignored();
    return all;
  }
  return *r;
}

}  // namespace mlaserve::structured
