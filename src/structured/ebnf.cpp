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
  std::string text;  // Lit: the bytes; Class: the class as written; Ref: the rule's name
  std::vector<Node> kids;
  int lo = 0, hi = -1;  // Rep: the count (hi < 0: unbounded)
  int line = 0;
};

bool name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
         c == '.';
}

class Parser {
 public:
  explicit Parser(std::string_view g) : g_(g) {}

  std::map<std::string, Node> rules() {
    std::map<std::string, Node> out;
    skip();
    while (pos_ < g_.size()) {
      const int line = line_;
      const std::string name = ident();
      if (name.empty()) error("a rule must start with its name");
      skip();
      if (g_.substr(pos_, 3) != "::=") error(fmt::format("'::=' must follow the rule name '{}'", name));
      pos_ += 3;
      if (out.count(name)) error(fmt::format("the rule '{}' is defined twice", name));
      Node body = alternatives();
      body.line = line;
      out.emplace(name, std::move(body));
      skip();
    }
    return out;
  }

 private:
  [[noreturn]] void error(const std::string& what) const { fail("ebnf, line {}: {}", line_, what); }

  void skip() {  // whitespace (newlines too) and # comments
    while (pos_ < g_.size()) {
      const char c = g_[pos_];
      if (c == '#') {
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

  // Whether the next tokens are `name ::=` (the next rule starts), without moving.
  bool rule_ahead() {
    const size_t p = pos_;
    const int l = line_;
    const bool ahead = !ident().empty() && (skip(), g_.substr(pos_, 3) == "::=");
    pos_ = p;
    line_ = l;
    return ahead;
  }

  Node alternatives() {
    Node alt;
    alt.kind = Node::Alt;
    alt.line = line_;
    alt.kids.push_back(sequence());
    skip();
    while (pos_ < g_.size() && g_[pos_] == '|') {
      ++pos_;
      alt.kids.push_back(sequence());
      skip();
    }
    return alt;
  }

  Node sequence() {
    Node seq;
    seq.kind = Node::Seq;
    seq.line = line_;
    for (;;) {
      skip();
      if (pos_ >= g_.size() || g_[pos_] == '|' || g_[pos_] == ')' || rule_ahead()) break;
      Node item = primary();
      repeats(item);
      seq.kids.push_back(std::move(item));
    }
    return seq;
  }

  void repeats(Node& item) {
    for (;;) {
      if (pos_ >= g_.size()) return;
      const char c = g_[pos_];
      int lo, hi;
      if (c == '*') lo = 0, hi = -1, ++pos_;
      else if (c == '+') lo = 1, hi = -1, ++pos_;
      else if (c == '?') lo = 0, hi = 1, ++pos_;
      else if (c == '{') count(lo, hi);
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

  void count(int& lo, int& hi) {  // after '{': m}, m,}, m,n}
    ++pos_;
    auto number = [&]() {
      size_t start = pos_;
      while (pos_ < g_.size() && g_[pos_] >= '0' && g_[pos_] <= '9') ++pos_;
      if (start == pos_ || pos_ - start > 4) error("a repeat count must be a number below 10000");
      return std::stoi(std::string(g_.substr(start, pos_ - start)));
    };
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
    if (c == '"' || c == '\'') {
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
      if (++depth_ > 256) error("groups nest more than 256 deep");  // the parser and the converter recurse per level
      n = alternatives();
      --depth_;
      skip();
      if (pos_ >= g_.size() || g_[pos_] != ')') error("a group must end with ')'");
      ++pos_;
    } else if (name_char(c)) {
      n.kind = Node::Ref;
      n.text = ident();
    } else {
      error(fmt::format("unexpected '{}'", c));
    }
    return n;
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
  size_t pos_ = 0;
  int line_ = 1;
  int depth_ = 0;
};

using build::group;
using build::Rx;

class Converter {
 public:
  explicit Converter(const std::map<std::string, Node>& rules) : rules_(rules) {}

  Rx convert(const Node& n) {
    Rx r = of(n);
    if (r && r->size() > kMaxRegexBytes)
      fail("ebnf, line {}: the grammar's regex would exceed {} bytes", n.line, kMaxRegexBytes);
    return r;
  }

 private:
  Rx of(const Node& n) {
    switch (n.kind) {
      case Node::Lit: return regex_escape(n.text);
      case Node::Class: return n.text;
      case Node::Ref: {
        auto it = rules_.find(n.text);
        if (it == rules_.end()) fail("ebnf, line {}: the rule '{}' is not defined", n.line, n.text);
        return refs_.follow(&it->second, [&] { return convert(it->second); }, fmt::format("ebnf, line {}", n.line));
      }
      case Node::Seq: {
        std::string r;
        for (const Node& k : n.kids) {
          Rx x = convert(k);
          if (!x) return std::nullopt;
          r += group(*x);
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
        return group(*x) + (n.hi < 0 ? fmt::format("{{{},}}", n.lo) : fmt::format("{{{},{}}}", n.lo, n.hi));
      }
    }
    return std::nullopt;
  }

  const std::map<std::string, Node>& rules_;
  build::RefStack refs_;
};

}  // namespace

std::string ebnf_regex(std::string_view grammar) {
  const std::map<std::string, Node> rules = Parser(grammar).rules();
  auto root = rules.find("root");
  if (root == rules.end()) fail("ebnf: the grammar has no rule 'root' (the text it allows)");
  Converter c(rules);
  Rx r = c.convert(root->second);
  if (!r) fail("ebnf: the grammar allows no text (its rules recurse with no way to end)");
  return *r;
}

}  // namespace mlaserve::structured
