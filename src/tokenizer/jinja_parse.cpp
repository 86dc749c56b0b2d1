// Lexer and parser of the Jinja interpreter. The lexer applies Jinja's whitespace rules as transformers
// configures them: newlines normalized and one trailing newline dropped (keep_trailing_newline=False),
// lstrip_blocks (spaces/tabs before a {% %} or {# #} tag on its line are dropped), trim_blocks (the newline
// after %} or #} is dropped), and the explicit '-' / '+' markers.
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "tokenizer/jinja_ast.h"
#include "tokenizer/unicode.h"

namespace mlaserve::jinja {

Body parse_template(const std::string& source, const std::string& name);

namespace {

struct Token {
  enum Type { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof } type;
  std::string value;
  Pos pos;
};

const char* type_name(Token::Type t) {
  switch (t) {
    case Token::Text: return "text";
    case Token::VarBegin: return "'{{'";
    case Token::VarEnd: return "'}}'";
    case Token::BlockBegin: return "'{%'";
    case Token::BlockEnd: return "'%}'";
    case Token::Name: return "name";
    case Token::String: return "string";
    case Token::Int: return "integer";
    case Token::Float: return "float";
    case Token::Op: return "operator";
    case Token::Eof: return "end of template";
  }
  return "?";
}

class Lexer {
 public:
  Lexer(const std::string& src, const std::string& name) : name_(name) {
    // Newlines: \r\n and \r become \n; one trailing newline is dropped.
    src_.reserve(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == '\r') {
        src_ += '\n';
        if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
      } else {
        src_ += src[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    size_t i = 0, n = src_.size();
    bool line_starting = true;
    while (i < n) {
      size_t j = find_tag(i);
      if (j == std::string::npos) {
        emit_text(src_.substr(i), i);
        break;
      }
      std::string text = src_.substr(i, j - i);
      char kind = src_[j + 1];
      char sign = j + 2 < n && (src_[j + 2] == '-' || src_[j + 2] == '+') ? src_[j + 2] : 0;
      if (sign == '-') {
        size_t e = text.find_last_not_of(" \t\n\r\f\v");
        text.erase(e == std::string::npos ? 0 : e + 1);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: only spaces/tabs between the line start and the tag.
        size_t lpos = text.rfind('\n');
        lpos = lpos == std::string::npos ? 0 : lpos + 1;
        if ((lpos > 0 || line_starting) && text.find_first_not_of(" \t", lpos) == std::string::npos)
          text.erase(lpos);
      }
      emit_text(text, i);
      size_t k = j + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        size_t e = src_.find("#}", k);
        if (e == std::string::npos) error(j, "unclosed comment");
        char end_sign = e > k && (src_[e - 1] == '-' || src_[e - 1] == '+') ? src_[e - 1] : 0;
        i = after_end(e + 2, end_sign, true);
      } else if (kind == '%' && is_raw(k)) {
        i = lex_raw(j, k);
      } else {
        bool block = kind == '%';
        tokens_.push_back({block ? Token::BlockBegin : Token::VarBegin, "", pos(j)});
        i = lex_expression(k, block);
      }
      line_starting = i > 0 && src_[i - 1] == '\n';
    }
    tokens_.push_back({Token::Eof, "", pos(n)});
    return std::move(tokens_);
  }

  // Line and column (in code points) of offset `off`. Tokens ask in increasing order: the column is counted on from
  // the last answer's when both are on one line (counting from the line's start each time was quadratic in a long
  // line, and real templates are often one line).
  Pos pos(size_t off) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), off);
    size_t line = static_cast<size_t>(it - line_starts_.begin());
    size_t start = line_starts_[line - 1];
    if (line != last_line_ || off < last_off_) {
      last_line_ = line;
      last_off_ = start;
      last_col_ = 1;
    }
    last_col_ += tok::count_code_points(std::string_view(src_).substr(last_off_, off - last_off_));
    last_off_ = off;
    return Pos{static_cast<int>(line), static_cast<int>(last_col_)};
  }

 private:
  [[noreturn]] void error(size_t off, const std::string& msg) const {
    Pos p = pos(off);
    fail("{} line {} column {}: {}", name_, p.line, p.col, msg);
  }

  void emit_text(const std::string& t, size_t off) {
    if (!t.empty()) tokens_.push_back({Token::Text, t, pos(off)});
  }

  size_t find_tag(size_t from) const {
    size_t i = from;
    while (true) {
      i = src_.find('{', i);
      if (i == std::string::npos || i + 1 >= src_.size()) return std::string::npos;
      char c = src_[i + 1];
      if (c == '{' || c == '%' || c == '#') return i;
      ++i;
    }
  }

  // Position after a tag's end at `e` (just past "%}", "}}" or "#}"), applying '-' and trim_blocks.
  size_t after_end(size_t e, char end_sign, bool trims) const {
    if (end_sign == '-') {
      while (e < src_.size() && std::strchr(" \t\n\r\f\v", src_[e])) ++e;
    } else if (end_sign != '+' && trims && e < src_.size() && src_[e] == '\n') {
      ++e;
    }
    return e;
  }

  static bool is_ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

  bool word_at(size_t k, const char* w) const {
    size_t n = std::strlen(w);
    return src_.compare(k, n, w) == 0 && (k + n >= src_.size() || !is_ident_char(src_[k + n]));
  }

  size_t skip_ws(size_t k) const {
    while (k < src_.size() && std::strchr(" \t\n\r\f\v", src_[k])) ++k;
    return k;
  }

  // After "{%" (and its sign) at k: is this "raw %}"?
  bool is_raw(size_t k) const {
    k = skip_ws(k);
    if (!word_at(k, "raw")) return false;
    k = skip_ws(k + 3);
    return src_.compare(k, 2, "%}") == 0 || src_.compare(k, 3, "-%}") == 0 || src_.compare(k, 3, "+%}") == 0;
  }

  size_t lex_raw(size_t tag, size_t k) {
    k = skip_ws(skip_ws(k) + 3);
    char s = src_[k] == '%' ? 0 : src_[k];
    size_t body = after_end(k + (s ? 3 : 2), s, true);
    // Find {%[-+]? endraw [-+]?%}
    size_t f = body;
    while (true) {
      f = src_.find("{%", f);
      if (f == std::string::npos) error(tag, "unclosed {% raw %} block");
      size_t q = f + 2;
      char bsign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
      q = skip_ws(q + (bsign ? 1 : 0));
      if (word_at(q, "endraw")) {
        q = skip_ws(q + 6);
        char esign = src_[q] == '-' || src_[q] == '+' ? src_[q] : 0;
        if (src_.compare(q + (esign ? 1 : 0), 2, "%}") == 0) {
          std::string text = src_.substr(body, f - body);
          if (bsign == '-') {
            size_t e = text.find_last_not_of(" \t\n\r\f\v");
            text.erase(e == std::string::npos ? 0 : e + 1);
          }
          emit_text(text, body);
          return after_end(q + (esign ? 1 : 0) + 2, esign, true);
        }
      }
      f += 2;
    }
  }

  size_t lex_expression(size_t k, bool block) {
    int depth = 0;
    size_t n = src_.size();
    while (true) {
      while (k < n && std::strchr(" \t\n\r\f\v", src_[k])) ++k;
      if (k >= n) error(k, block ? "unclosed '{%' tag: missing '%}'" : "unclosed '{{': missing '}}'");
      if (depth == 0) {
        const char* close = block ? "%}" : "}}";
        char sign = (src_[k] == '-' || (block && src_[k] == '+')) ? src_[k] : 0;
        if (src_.compare(k + (sign ? 1 : 0), 2, close) == 0) {
          tokens_.push_back({block ? Token::BlockEnd : Token::VarEnd, "", pos(k)});
          return after_end(k + (sign ? 1 : 0) + 2, sign, block);
        }
      }
      char c = src_[k];
      size_t start = k;
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        while (k < n && is_ident_char(src_[k])) ++k;
        tokens_.push_back({Token::Name, src_.substr(start, k - start), pos(start)});
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        auto digits = [&] {
          while (k < n && (std::isdigit(static_cast<unsigned char>(src_[k])) || src_[k] == '_')) ++k;
        };
        digits();
        bool is_float = false;
        if (k + 1 < n && src_[k] == '.' && std::isdigit(static_cast<unsigned char>(src_[k + 1]))) {
          ++k;
          digits();
          is_float = true;
        }
        if (k < n && (src_[k] == 'e' || src_[k] == 'E')) {
          size_t q = k + 1;
          if (q < n && (src_[q] == '+' || src_[q] == '-')) ++q;
          if (q < n && std::isdigit(static_cast<unsigned char>(src_[q]))) {
            k = q;
            digits();
            is_float = true;
          }
        }
        std::string v;
        for (size_t q = start; q < k; ++q)
          if (src_[q] != '_') v += src_[q];
        tokens_.push_back({is_float ? Token::Float : Token::Int, v, pos(start)});
      } else if (c == '\'' || c == '"') {
        tokens_.push_back({Token::String, lex_string(k), pos(start)});
      } else {
        static const char* two[] = {"//", "**", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* t : two)
          if (src_.compare(k, 2, t) == 0) op = t;
        if (op.empty()) {
          if (!std::strchr("+-*/%~<>=()[]{},.:|", c)) error(k, fmt::format("unexpected character '{}'", c));
          op = std::string(1, c);
        }
        if (op == "(" || op == "[" || op == "{") ++depth;
        if (op == ")" || op == "]" || op == "}") --depth;
        k += op.size();
        tokens_.push_back({Token::Op, op, pos(start)});
      }
    }
  }

  // A Python string literal at k (k is left after it), escapes decoded as Python's unicode-escape.
  std::string lex_string(size_t& k) {
    char q = src_[k];
    size_t start = k++;
    std::string out;
    while (true) {
      if (k >= src_.size()) error(start, "unterminated string literal");
      char c = src_[k];
      if (c == q) {
        ++k;
        return out;
      }
      if (c != '\\' || k + 1 >= src_.size()) {
        out += c;
        ++k;
        continue;
      }
      char e = src_[k + 1];
      k += 2;
      auto hex = [&](int len) {
        if (k + len > src_.size()) error(start, "truncated escape in string literal");
        char32_t v = 0;
        for (int i = 0; i < len; ++i) {
          char h = src_[k + i];
          int d = std::isdigit(static_cast<unsigned char>(h)) ? h - '0'
                  : (h >= 'a' && h <= 'f')                    ? h - 'a' + 10
                  : (h >= 'A' && h <= 'F')                    ? h - 'A' + 10
                                                              : -1;
          if (d < 0) error(start, "bad hex escape in string literal");
          v = v * 16 + d;
        }
        k += len;
        tok::append_utf8(out, v);
      };
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'v': out += '\v'; break;
        case '\n': break;
        case 'x': hex(2); break;
        case 'u': hex(4); break;
        case 'U': hex(8); break;
        default:
          if (e >= '0' && e <= '7') {
            int v = e - '0';
            for (int i = 0; i < 2 && k < src_.size() && src_[k] >= '0' && src_[k] <= '7'; ++i) v = v * 8 + (src_[k++] - '0');
            tok::append_utf8(out, static_cast<char32_t>(v));
          } else {
            out += '\\';
            out += e;
          }
      }
    }
  }

  std::string src_;
  std::string name_;
  std::vector<size_t> line_starts_;
  mutable size_t last_line_ = 0, last_off_ = 0, last_col_ = 1;  // pos()'s last answer
  std::vector<Token> tokens_;
};

// ------------------------------------------------------------------------------------------------ parser
class Parser {
 public:
  Parser(std::vector<Token> toks, std::string name) : t_(std::move(toks)), name_(std::move(name)) {}

  Body parse_all() {
    Body b = parse_body({});
    if (cur().type != Token::Eof) error(cur(), "unexpected tag");
    return b;
  }

 private:
  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[i_ < t_.size() - 1 ? i_++ : i_]; }

  [[noreturn]] void error(const Pos& p, const std::string& msg) const {
    fail("{} line {} column {}: {}", name_, p.line, p.col, msg);
  }
  [[noreturn]] void error(const Token& t, const std::string& msg) const { error(t.pos, msg); }
  bool is_op(const char* op) const { return cur().type == Token::Op && cur().value == op; }
  bool is_name(const char* n) const { return cur().type == Token::Name && cur().value == n; }
  void expect_op(const char* op) {
    if (!is_op(op)) error(cur(), fmt::format("expected '{}', got {}", op, describe(cur())));
    next();
  }
  std::string expect_name() {
    if (cur().type != Token::Name) error(cur(), fmt::format("expected a name, got {}", describe(cur())));
    return next().value;
  }
  void expect_block_end() {
    if (cur().type != Token::BlockEnd) error(cur(), fmt::format("expected '%}}', got {}", describe(cur())));
    next();
  }
  static std::string describe(const Token& t) {
    if (t.type == Token::Name || t.type == Token::Op) return "'" + t.value + "'";
    return type_name(t.type);
  }

  ExprPtr make(Expr::Kind k, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->pos = at.pos;
    return e;
  }

  // Bounds on what a template nests (the parser, the renderer and the trees' destructors recurse through it): jinja2
  // itself stops at Python's recursion limit well before these.
  static constexpr int kMaxNesting = 256;     // brackets, unary operators and blocks inside each other
  static constexpr int kMaxExprDepth = 1024;  // levels of one expression's tree (operator chains included)
  // A level of nesting for the scope of one parse call.
  class Nested {
   public:
    Nested(Parser& p, const Token& at) : p_(p) {
      if (++p_.nesting_ > kMaxNesting)
        p_.error(at, fmt::format("the template nests deeper than {} levels", kMaxNesting));
    }
    ~Nested() { --p_.nesting_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;

   private:
    Parser& p_;
  };
  // child as parent's next argument, the parent's depth updated.
  void adopt(Expr& parent, ExprPtr child) {
    if (child) {
      parent.depth = std::max(parent.depth, child->depth + 1);
      if (parent.depth > kMaxExprDepth)
        error(parent.pos, fmt::format("an expression nested deeper than {} levels", kMaxExprDepth));
    }
    parent.args.push_back(std::move(child));
  }

  // ---- statements
  // Parses nodes until a block tag whose keyword is in `ends` (left unconsumed, positioned at its keyword).
  Body parse_body(const std::vector<std::string>& ends) {
    const Nested nested(*this, cur());
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Token::Eof) {
        if (!ends.empty()) error(t, fmt::format("missing '{{% {} %}}'", ends.back()));
        return body;
      }
      if (t.type == Token::Text) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::Text;
        n->pos = t.pos;
        n->text = t.value;
        body.push_back(std::move(n));
        next();
      } else if (t.type == Token::VarBegin) {
        next();
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::Output;
        n->pos = t.pos;
        n->expr = parse_tuple(true);
        if (cur().type != Token::VarEnd) error(cur(), fmt::format("expected '}}}}', got {}", describe(cur())));
        next();
        body.push_back(std::move(n));
      } else if (t.type == Token::BlockBegin) {
        const Token& kw = peek();
        if (kw.type != Token::Name) error(kw, "expected a tag name after '{%'");
        for (const auto& e : ends)
          if (kw.value == e) {
            next();  // at the keyword
            return body;
          }
        next();
        body.push_back(parse_statement());
      } else {
        error(t, fmt::format("unexpected {}", describe(t)));
      }
    }
  }

  NodePtr parse_statement() {
    const Token& kw = cur();
    auto n = std::make_unique<Node>();
    n->pos = kw.pos;
    std::string k = next().value;
    if (k == "if") {
      n->kind = Node::Kind::If;
      n->conds.push_back(parse_tuple(true));
      expect_block_end();
      while (true) {
        n->bodies.push_back(parse_body({"elif", "else", "endif"}));
        std::string e = next().value;
        if (e == "elif") {
          n->conds.push_back(parse_tuple(true));
          expect_block_end();
        } else if (e == "else") {
          expect_block_end();
          n->bodies.push_back(parse_body({"endif"}));
          next();
          expect_block_end();
          break;
        } else {
          expect_block_end();
          break;
        }
      }
    } else if (k == "for") {
      n->kind = Node::Kind::For;
      n->targets = parse_targets();
      if (!is_name("in")) error(cur(), "expected 'in' in for loop");
      next();
      n->expr = parse_tuple(false);
      if (is_name("recursive")) error(cur(), "recursive for loops are not supported");
      if (is_name("if")) {
        next();
        n->conds.push_back(parse_expression(true));
      } else {
        n->conds.push_back(nullptr);
      }
      expect_block_end();
      n->bodies.push_back(parse_body({"else", "endfor"}));
      if (next().value == "else") {
        expect_block_end();
        n->bodies.push_back(parse_body({"endfor"}));
        next();
      } else {
        n->bodies.emplace_back();
      }
      expect_block_end();
    } else if (k == "set") {
      std::string first = expect_name();
      if (is_op(".")) {
        next();
        n->kind = Node::Kind::Set;
        n->attr_target = true;
        n->targets = {first, expect_name()};
        expect_op("=");
        n->expr = parse_tuple(true);
        expect_block_end();
      } else {
        std::vector<std::string> names{first};
        while (is_op(",")) {
          next();
          if (cur().type != Token::Name) break;
          names.push_back(next().value);
        }
        if (is_op("=")) {
          next();
          n->kind = Node::Kind::Set;
          n->targets = names;
          n->expr = parse_tuple(true);
          expect_block_end();
        } else {
          if (names.size() != 1) error(cur(), "expected '=' in set");
          n->kind = Node::Kind::SetBlock;
          n->text = first;
          if (is_op("|")) n->expr = parse_filter_chain(body_placeholder(cur()));
          expect_block_end();
          n->bodies.push_back(parse_body({"endset"}));
          next();
          expect_block_end();
        }
      }
    } else if (k == "macro") {
      n->kind = Node::Kind::Macro;
      n->text = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        n->params.push_back(expect_name());
        if (is_op("=")) {
          next();
          n->defaults.push_back(parse_expression(true));
        } else {
          n->defaults.push_back(nullptr);
        }
        if (!is_op(")")) expect_op(",");
      }
      next();
      expect_block_end();
      n->bodies.push_back(parse_body({"endmacro"}));
      next();
      if (cur().type == Token::Name) next();  // {% endmacro name %}
      expect_block_end();
    } else if (k == "break" || k == "continue") {
      n->kind = k == "break" ? Node::Kind::Break : Node::Kind::Continue;
      expect_block_end();
    } else if (k == "generation") {
      // transformers' {% generation %} marks assistant text for masks; it renders its body.
      n->kind = Node::Kind::With;
      expect_block_end();
      n->bodies.push_back(parse_body({"endgeneration"}));
      next();
      expect_block_end();
    } else if (k == "with") {
      n->kind = Node::Kind::With;
      while (cur().type == Token::Name) {
        n->params.push_back(next().value);
        expect_op("=");
        n->defaults.push_back(parse_expression(true));
        if (is_op(",")) next();
      }
      expect_block_end();
      n->bodies.push_back(parse_body({"endwith"}));
      next();
      expect_block_end();
    } else if (k == "filter") {
      n->kind = Node::Kind::FilterBlock;
      n->expr = parse_filter_chain(body_placeholder(kw), true);
      expect_block_end();
      n->bodies.push_back(parse_body({"endfilter"}));
      next();
      expect_block_end();
    } else {
      error(kw, fmt::format("unsupported tag '{}' (supported: if, for, set, macro, break, continue, filter, with, "
                            "raw, generation)",
                            k));
    }
    return n;
  }

  ExprPtr body_placeholder(const Token& at) {
    auto e = make(Expr::Kind::Name, at);
    e->name = "__body";
    return e;
  }

  // `| f(args) | g` applied to `node`; with `bare`, the first filter has no leading '|' ({% filter upper %}).
  ExprPtr parse_filter_chain(ExprPtr node, bool bare = false) {
    if (bare) node = parse_filter(std::move(node));
    while (is_op("|")) {
      next();
      node = parse_filter(std::move(node));
    }
    return node;
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    bool paren = is_op("(");
    if (paren) next();
    names.push_back(expect_name());
    while (is_op(",")) {
      next();
      names.push_back(expect_name());
    }
    if (paren) expect_op(")");
    return names;
  }

  // ---- expressions (Jinja's precedence, lowest first)
  ExprPtr parse_tuple(bool with_condexpr) {
    const Token& at = cur();
    ExprPtr first = parse_expression(with_condexpr);
    if (!is_op(",")) return first;
    auto t = make(Expr::Kind::ListLit, at);
    t->is_tuple = true;
    adopt(*t, std::move(first));
    while (is_op(",")) {
      next();
      if (cur().type == Token::BlockEnd || cur().type == Token::VarEnd || is_op(")") || is_op("=")) break;
      adopt(*t, parse_expression(with_condexpr));
    }
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    const Nested nested(*this, cur());
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    const Nested nested(*this, cur());
    const Token& at = cur();
    ExprPtr e = parse_or();
    while (is_name("if")) {
      next();
      auto c = make(Expr::Kind::CondExpr, at);
      adopt(*c, parse_or());
      adopt(*c, std::move(e));
      if (is_name("else")) {
        next();
        adopt(*c, parse_condexpr());
      } else {
        adopt(*c, nullptr);
      }
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(const char* op, ExprPtr l, ExprPtr r, const Token& at) {
    auto b = make(Expr::Kind::Binary, at);
    b->name = op;
    adopt(*b, std::move(l));
    adopt(*b, std::move(r));
    return b;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      const Token& at = next();
      e = binary("or", std::move(e), parse_and(), at);
    }
    return e;
  }
  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      const Token& at = next();
      e = binary("and", std::move(e), parse_not(), at);
    }
    return e;
  }
  ExprPtr parse_not() {
    const Nested nested(*this, cur());
    if (is_name("not")) {
      const Token& at = next();
      auto u = make(Expr::Kind::Unary, at);
      u->name = "not";
      adopt(*u, parse_not());
      return u;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    const Token& at = cur();
    ExprPtr e = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().type == Token::Op &&
          (cur().value == "==" || cur().value == "!=" || cur().value == "<" || cur().value == ">" ||
           cur().value == "<=" || cur().value == ">=")) {
        op = next().value;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && peek().type == Token::Name && peek().value == "in") {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Kind::Compare, at);
        adopt(*cmp, std::move(e));
      }
      cmp->ops.push_back(op);
      adopt(*cmp, parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(e);
  }
  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& at = next();
      e = binary(at.value == "+" ? "+" : "-", std::move(e), parse_concat(), at);
    }
    return e;
  }
  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      const Token& at = next();
      e = binary("~", std::move(e), parse_math2(), at);
    }
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& at = next();
      std::string op = at.value;
      e = binary(op == "*" ? "*" : op == "/" ? "/" : op == "//" ? "//" : "%", std::move(e), parse_pow(), at);
    }
    return e;
  }
  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      const Token& at = next();
      e = binary("**", std::move(e), parse_unary(true), at);
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter) {
    const Nested nested(*this, cur());
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& at = next();
      auto u = make(Expr::Kind::Unary, at);
      u->name = at.value;
      adopt(*u, parse_unary(false));
      e = std::move(u);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    switch (t.type) {
      case Token::Name: {
        next();
        auto c = make(Expr::Kind::Const, t);
        if (t.value == "true" || t.value == "True") {
          c->value = Value(true);
        } else if (t.value == "false" || t.value == "False") {
          c->value = Value(false);
        } else if (t.value == "none" || t.value == "None") {
          c->value = Value::none();
        } else {
          c->kind = Expr::Kind::Name;
          c->name = t.value;
        }
        return c;
      }
      case Token::String: {
        std::string s;
        while (cur().type == Token::String) s += next().value;  // adjacent literals concatenate
        auto c = make(Expr::Kind::Const, t);
        c->value = Value(s);
        return c;
      }
      case Token::Int: {
        next();
        auto c = make(Expr::Kind::Const, t);
        try {
          c->value = Value(static_cast<int64_t>(std::stoll(t.value)));
        } catch (const std::exception&) {
          error(t, "integer literal out of range");
        }
        return c;
      }
      case Token::Float: {
        next();
        auto c = make(Expr::Kind::Const, t);
        c->value = Value(std::strtod(t.value.c_str(), nullptr));  // (past the range: inf, as Python's float)
        return c;
      }
      case Token::Op:
        if (t.value == "(") {
          next();
          if (is_op(")")) {
            next();
            auto l = make(Expr::Kind::ListLit, t);
            l->is_tuple = true;
            return l;
          }
          ExprPtr e = parse_tuple(true);
          expect_op(")");
          return e;
        }
        if (t.value == "[") {
          next();
          auto l = make(Expr::Kind::ListLit, t);
          while (!is_op("]")) {
            adopt(*l, parse_expression(true));
            if (!is_op("]")) expect_op(",");
          }
          next();
          return l;
        }
        if (t.value == "{") {
          next();
          auto d = make(Expr::Kind::DictLit, t);
          while (!is_op("}")) {
            adopt(*d, parse_expression(true));
            expect_op(":");
            adopt(*d, parse_expression(true));
            if (!is_op("}")) expect_op(",");
          }
          next();
          return d;
        }
        break;
      default: break;
    }
    error(t, fmt::format("unexpected {} in expression", describe(t)));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      const Token& at = cur();
      if (is_op(".")) {
        next();
        if (cur().type == Token::Name) {
          auto g = make(Expr::Kind::GetAttr, at);
          g->name = next().value;
          adopt(*g, std::move(e));
          e = std::move(g);
        } else if (cur().type == Token::Int) {
          auto g = make(Expr::Kind::GetItem, at);
          adopt(*g, std::move(e));
          auto c = make(Expr::Kind::Const, cur());
          const Token& index = next();
          errno = 0;
          const long long i = std::strtoll(index.value.c_str(), nullptr, 10);
          if (errno == ERANGE) error(index, "integer literal out of range");
          c->value = Value(static_cast<int64_t>(i));
          adopt(*g, std::move(c));
          e = std::move(g);
        } else {
          error(cur(), "expected an attribute name after '.'");
        }
      } else if (is_op("[")) {
        next();
        e = parse_subscript(std::move(e), at);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj, const Token& at) {
    // [i] or [a:b:c]
    ExprPtr parts[3];
    int idx = 0;
    bool is_slice = false;
    while (!is_op("]")) {
      if (is_op(":")) {
        next();
        is_slice = true;
        if (++idx > 2) error(cur(), "too many ':' in slice");
        continue;
      }
      if (parts[idx]) error(cur(), "expected ']'");
      parts[idx] = parse_expression(true);
    }
    next();
    if (!is_slice) {
      if (!parts[0]) error(at, "empty subscript");
      auto g = make(Expr::Kind::GetItem, at);
      adopt(*g, std::move(obj));
      adopt(*g, std::move(parts[0]));
      return g;
    }
    auto s = make(Expr::Kind::Slice, at);
    adopt(*s, std::move(obj));
    for (auto& p : parts) adopt(*s, std::move(p));
    return s;
  }

  // Arguments "(a, b, k=v)" into e->args (after any existing ones) and e->kwnames.
  void parse_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) error(cur(), "*args / **kwargs in calls are not supported");
      if (cur().type == Token::Name && peek().type == Token::Op && peek().value == "=") {
        e.kwnames.push_back(next().value);
        next();
        adopt(e, parse_expression(true));
      } else {
        if (!e.kwnames.empty()) error(cur(), "positional argument after keyword argument");
        adopt(e, parse_expression(true));
      }
      if (!is_op(")")) expect_op(",");
    }
    next();
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto c = make(Expr::Kind::Call, cur());
    adopt(*c, std::move(callee));
    parse_args(*c);
    return c;
  }

  ExprPtr parse_filter(ExprPtr node) {
    const Token& at = cur();
    auto f = make(Expr::Kind::Filter, at);
    f->name = expect_name();
    while (is_op(".")) {  // dotted filter names
      next();
      f->name += "." + expect_name();
    }
    adopt(*f, std::move(node));
    if (is_op("(")) parse_args(*f);
    return f;
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        next();
        e = parse_filter(std::move(e));
      } else if (is_name("is")) {
        const Token& at = next();
        auto t = make(Expr::Kind::Test, at);
        if (is_name("not")) {
          next();
          t->negated = true;
        }
        t->name = expect_name();
        adopt(*t, std::move(e));
        if (is_op("(")) {
          parse_args(*t);
        } else if ((cur().type == Token::Name || cur().type == Token::String || cur().type == Token::Int ||
                    cur().type == Token::Float || is_op("(") || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) error(cur(), "you cannot chain multiple tests with 'is'");
          adopt(*t, parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  int nesting_ = 0;  // Nested levels now open
  size_t i_ = 0;
  std::string name_;
};

}  // namespace

Body parse_template(const std::string& source, const std::string& name) {
  Lexer lx(source, name);
  Parser p(lx.run(), name);
  return p.parse_all();
}

}  // namespace mlaserve::jinja
