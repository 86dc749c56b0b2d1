// Evaluator of the Jinja interpreter: scopes, expressions with Python semantics, the filters / tests / methods /
// globals chat templates use, and rendering. Errors carry the template position of the expression at fault.
#include <algorithm>
#include <cmath>
#include <ctime>
#include <unordered_map>

#include <unicode/uchar.h>

#include "core/error.h"
#include "tokenizer/jinja.h"
#include "tokenizer/jinja_ast.h"
#include "tokenizer/unicode.h"

namespace mlaserve::jinja {

Body parse_template(const std::string& source, const std::string& name);

namespace {

// Thrown for errors at a position; converted to mlaserve::Error with the template name at the top.
struct EvalError {
  Pos pos;
  std::string msg;
};
[[noreturn]] void raise(Pos p, std::string msg) { throw EvalError{p, std::move(msg)}; }

// ------------------------------------------------------------------------------------------------ string helpers
std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t b = i;
    i += tok::utf8_seq_len(static_cast<unsigned char>(s[i]));
    out.push_back(s.substr(b, i - b));
  }
  return out;
}

std::string map_case(const std::string& s, bool upper) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    char32_t c = tok::next_code_point(s, i);
    tok::append_utf8(out, static_cast<char32_t>(upper ? u_toupper(static_cast<UChar32>(c))
                                                      : u_tolower(static_cast<UChar32>(c))));
  }
  return out;
}

bool is_py_space(char32_t c) { return tok::is_whitespace(c) || (c >= 0x1C && c <= 0x1F); }

// Python str.strip / lstrip / rstrip; chars == nullptr strips whitespace.
std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  std::vector<std::string> cps = code_points(s);
  auto strip_this = [&](const std::string& cp) {
    if (!chars) {
      size_t k = 0;
      return is_py_space(tok::next_code_point(cp, k));
    }
    return chars->find(cp) != std::string::npos;
  };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip_this(cps[b])) ++b;
  if (right)
    while (e > b && strip_this(cps[e - 1])) --e;
  std::string out;
  for (size_t k = b; k < e; ++k) out += cps[k];
  return out;
}

std::vector<std::string> py_split(const std::string& s, const std::string* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) fail("empty separator");
    size_t p = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      size_t f = s.find(*sep, p);
      if (f == std::string::npos) break;
      out.push_back(s.substr(p, f - p));
      p = f + sep->size();
    }
    out.push_back(s.substr(p));
    return out;
  }
  // Whitespace runs; no empty strings.
  std::vector<std::string> cps = code_points(s);
  size_t k = 0;
  auto space = [&](size_t i) {
    size_t z = 0;
    return is_py_space(tok::next_code_point(cps[i], z));
  };
  while (k < cps.size()) {
    while (k < cps.size() && space(k)) ++k;
    if (k >= cps.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
      std::string rest;
      for (size_t q = k; q < cps.size(); ++q) rest += cps[q];
      // Python keeps the remainder as is, minus leading whitespace only... and trailing whitespace too.
      out.push_back(py_strip(rest, nullptr, false, true));
      return out;
    }
    std::string w;
    while (k < cps.size() && !space(k)) w += cps[k++];
    out.push_back(w);
  }
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& rep, int64_t count) {
  std::string out;
  if (old.empty()) {
    std::vector<std::string> cps = code_points(s);
    int64_t n = 0;
    for (const auto& cp : cps) {
      if (count < 0 || n < count) {
        out += rep;
        ++n;
      }
      out += cp;
    }
    if (count < 0 || n < count) out += rep;
    return out;
  }
  size_t p = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    size_t f = s.find(old, p);
    if (f == std::string::npos) break;
    out.append(s, p, f - p);
    out += rep;
    p = f + old.size();
    ++n;
  }
  out.append(s, p, std::string::npos);
  return out;
}

// Python str.title(): a cased character after an uncased one starts a word.
std::string py_title(const std::string& s) {
  std::string out;
  size_t i = 0;
  bool prev_cased = false;
  while (i < s.size()) {
    char32_t c = tok::next_code_point(s, i);
    UChar32 u = static_cast<UChar32>(c);
    bool cased = u_hasBinaryProperty(u, UCHAR_CASED);
    tok::append_utf8(out, static_cast<char32_t>(prev_cased ? u_tolower(u) : u_totitle(u)));
    prev_cased = cased || (u_hasBinaryProperty(u, UCHAR_CASE_IGNORABLE) && prev_cased);
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  if (s.empty()) return s;
  size_t i = 0;
  char32_t c = tok::next_code_point(s, i);
  std::string out;
  tok::append_utf8(out, static_cast<char32_t>(u_totitle(static_cast<UChar32>(c))));
  return out + map_case(s.substr(i), false);
}

// ------------------------------------------------------------------------------------------------ scopes
struct Scope {
  std::unordered_map<std::string, Value> vars;
  Scope* parent = nullptr;
  const Value* lookup(const std::string& n) const {
    for (const Scope* s = this; s; s = s->parent) {
      auto it = s->vars.find(n);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

enum class Flow { Normal, Break, Continue };

Value arg_or(CallArgs& a, size_t idx, const char* name, Value dflt) {
  for (auto& [k, v] : a.keyword)
    if (k == name) return v;
  if (idx < a.positional.size()) return a.positional[idx];
  return dflt;
}

class Renderer {
 public:
  Renderer(const std::string& name, Scope* root) : name_(name), root_(root) {}

  Flow render(const Body& body, Scope& sc, std::string& out) {
    for (const auto& n : body) {
      Flow f = render_node(*n, sc, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

 private:
  // ---- statements
  Flow render_node(const Node& n, Scope& sc, std::string& out) {
    switch (n.kind) {
      case Node::Kind::Text: out += n.text; return Flow::Normal;
      case Node::Kind::Output: out += eval(*n.expr, sc).to_str(); return Flow::Normal;
      case Node::Kind::If:
        for (size_t i = 0; i < n.conds.size(); ++i)
          if (eval(*n.conds[i], sc).truthy()) return render(n.bodies[i], sc, out);
        if (n.bodies.size() > n.conds.size()) return render(n.bodies.back(), sc, out);
        return Flow::Normal;
      case Node::Kind::For: return render_for(n, sc, out);
      case Node::Kind::Set: {
        Value v = eval(*n.expr, sc);
        if (n.attr_target) {
          const Value* obj = sc.lookup(n.targets[0]);
          if (!obj || !obj->is_namespace())
            raise(n.pos, fmt::format("cannot assign attribute '{}' on '{}': not a namespace()", n.targets[1],
                                     n.targets[0]));
          obj->dict().set(n.targets[1], v);
        } else if (n.targets.size() == 1) {
          sc.vars[n.targets[0]] = v;
        } else {
          std::vector<Value> items = iterate(v, n.pos);
          if (items.size() != n.targets.size())
            raise(n.pos, fmt::format("cannot unpack {} values into {} names", items.size(), n.targets.size()));
          for (size_t i = 0; i < items.size(); ++i) sc.vars[n.targets[i]] = items[i];
        }
        return Flow::Normal;
      }
      case Node::Kind::SetBlock: {
        std::string body;
        Scope inner{{}, &sc};
        render(n.bodies[0], inner, body);
        Value v(body);
        if (n.expr) v = eval_with_body(*n.expr, sc, v);
        sc.vars[n.text] = v;
        return Flow::Normal;
      }
      case Node::Kind::FilterBlock: {
        std::string body;
        Scope inner{{}, &sc};
        render(n.bodies[0], inner, body);
        out += eval_with_body(*n.expr, sc, Value(body)).to_str();
        return Flow::Normal;
      }
      case Node::Kind::With: {
        Scope inner{{}, &sc};
        for (size_t i = 0; i < n.params.size(); ++i) inner.vars[n.params[i]] = eval(*n.defaults[i], sc);
        return render(n.bodies[0], inner, out);
      }
      case Node::Kind::Macro: {
        const Node* node = &n;
        Renderer* self = this;
        sc.vars[n.text] = Value::function(n.text, [self, node](CallArgs& a) { return self->call_macro(*node, a); });
        return Flow::Normal;
      }
      case Node::Kind::Break: return Flow::Break;
      case Node::Kind::Continue: return Flow::Continue;
    }
    return Flow::Normal;
  }

  Value eval_with_body(const Expr& e, Scope& sc, const Value& body) {
    Scope inner{{{"__body", body}}, &sc};
    return eval(e, inner);
  }

  Value call_macro(const Node& n, CallArgs& a) {
    Scope sc{{}, root_};
    if (a.positional.size() > n.params.size())
      raise(n.pos, fmt::format("macro '{}' takes {} arguments, got {}", n.text, n.params.size(), a.positional.size()));
    for (size_t i = 0; i < n.params.size(); ++i) {
      if (i < a.positional.size()) {
        sc.vars[n.params[i]] = a.positional[i];
      } else if (n.defaults[i]) {
        sc.vars[n.params[i]] = eval(*n.defaults[i], sc);
      } else {
        sc.vars[n.params[i]] = Value::undefined(n.params[i]);
      }
    }
    for (auto& [k, v] : a.keyword) {
      if (std::find(n.params.begin(), n.params.end(), k) == n.params.end())
        raise(n.pos, fmt::format("macro '{}' has no argument '{}'", n.text, k));
      sc.vars[k] = v;
    }
    std::string out;
    render(n.bodies[0], sc, out);
    return Value(out);
  }

  Flow render_for(const Node& n, Scope& sc, std::string& out) {
    Value seq = eval(*n.expr, sc);
    std::vector<Value> all = iterate(seq, n.expr->pos);
    // The loop filter ({% for x in xs if cond %}) applies before loop.* are computed.
    std::vector<Value> items;
    if (n.conds[0]) {
      for (auto& v : all) {
        Scope probe{{}, &sc};
        bind_targets(n, probe, v);
        if (eval(*n.conds[0], probe).truthy()) items.push_back(v);
      }
    } else {
      items = std::move(all);
    }
    if (items.empty()) {
      if (!n.bodies[1].empty()) {
        Scope inner{{}, &sc};
        return render(n.bodies[1], inner, out) == Flow::Break ? Flow::Normal : Flow::Normal;
      }
      return Flow::Normal;
    }
    int64_t len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len; ++i) {
      Scope inner{{}, &sc};
      bind_targets(n, inner, items[i]);
      Value loop = Value::name_space();
      Dict& d = loop.dict();
      d.set("index", Value(i + 1));
      d.set("index0", Value(i));
      d.set("revindex", Value(len - i));
      d.set("revindex0", Value(len - i - 1));
      d.set("first", Value(i == 0));
      d.set("last", Value(i == len - 1));
      d.set("length", Value(len));
      d.set("depth", Value(1));
      d.set("depth0", Value(0));
      d.set("previtem", i > 0 ? items[i - 1] : Value::undefined("there is no previous item"));
      d.set("nextitem", i + 1 < len ? items[i + 1] : Value::undefined("there is no next item"));
      d.set("cycle", Value::function("cycle", [i](CallArgs& a) {
              if (a.positional.empty()) fail("no items for cycling given");
              return a.positional[static_cast<size_t>(i) % a.positional.size()];
            }));
      inner.vars["loop"] = loop;
      Flow f = render(n.bodies[0], inner, out);
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  }

  void bind_targets(const Node& n, Scope& sc, const Value& v) {
    if (n.targets.size() == 1) {
      sc.vars[n.targets[0]] = v;
      return;
    }
    std::vector<Value> parts = iterate(v, n.pos);
    if (parts.size() != n.targets.size())
      raise(n.pos, fmt::format("cannot unpack {} values into {} loop variables", parts.size(), n.targets.size()));
    for (size_t i = 0; i < parts.size(); ++i) sc.vars[n.targets[i]] = parts[i];
  }

  // ---- expressions
 public:
  Value eval(const Expr& e, Scope& sc) {
    switch (e.kind) {
      case Expr::Kind::Const: return e.value;
      case Expr::Kind::Name: {
        const Value* v = sc.lookup(e.name);
        return v ? *v : Value::undefined("'" + e.name + "' is undefined");
      }
      case Expr::Kind::ListLit: {
        List l;
        for (const auto& a : e.args) l.push_back(eval(*a, sc));
        return Value::make_list(std::move(l), e.is_tuple);
      }
      case Expr::Kind::DictLit: {
        Value d = Value::make_dict();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value k = eval(*e.args[i], sc);
          if (!k.is_string()) raise(e.args[i]->pos, "only string keys are supported in dict literals");
          d.dict().set(k.str(), eval(*e.args[i + 1], sc));
        }
        return d;
      }
      case Expr::Kind::GetAttr: return get_attr(eval(*e.args[0], sc), e.name, e.pos);
      case Expr::Kind::GetItem: return get_item(eval(*e.args[0], sc), eval(*e.args[1], sc), e.pos);
      case Expr::Kind::Slice: {
        Value obj = eval(*e.args[0], sc);
        Value a = e.args[1] ? eval(*e.args[1], sc) : Value::none();
        Value b = e.args[2] ? eval(*e.args[2], sc) : Value::none();
        Value c = e.args[3] ? eval(*e.args[3], sc) : Value::none();
        return slice(obj, a, b, c, e.pos);
      }
      case Expr::Kind::Call: {
        Value f = eval(*e.args[0], sc);
        CallArgs a = collect_args(e, 1, sc);
        if (f.is_undefined()) raise(e.pos, undefined_msg(f));
        if (!f.is_function()) raise(e.pos, fmt::format("'{}' object is not callable", f.type_name()));
        return call(f, a, e.pos);
      }
      case Expr::Kind::Filter: {
        Value v = eval(*e.args[0], sc);
        CallArgs a = collect_args(e, 1, sc);
        return apply_filter(e.name, v, a, e.pos, sc);
      }
      case Expr::Kind::Test: {
        Value v = eval(*e.args[0], sc);
        CallArgs a = collect_args(e, 1, sc);
        bool r = apply_test(e.name, v, a, e.pos);
        return Value(e.negated ? !r : r);
      }
      case Expr::Kind::Unary: {
        Value v = eval(*e.args[0], sc);
        if (e.name == "not") return Value(!v.truthy());
        if (v.is_undefined()) raise(e.pos, undefined_msg(v));
        if (!v.is_number()) raise(e.pos, fmt::format("bad operand type for unary {}: '{}'", e.name, v.type_name()));
        if (e.name == "+") return v.is_float() ? Value(v.as_float()) : Value(v.as_int());
        return v.is_float() ? Value(-v.as_float()) : Value(-v.as_int());
      }
      case Expr::Kind::Binary: {
        if (e.name == "and") {
          Value l = eval(*e.args[0], sc);
          return l.truthy() ? eval(*e.args[1], sc) : l;
        }
        if (e.name == "or") {
          Value l = eval(*e.args[0], sc);
          return l.truthy() ? l : eval(*e.args[1], sc);
        }
        return binary(e.name, eval(*e.args[0], sc), eval(*e.args[1], sc), e.pos);
      }
      case Expr::Kind::Compare: {
        Value l = eval(*e.args[0], sc);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value r = eval(*e.args[i + 1], sc);
          if (!compare(e.ops[i], l, r, e.pos)) return Value(false);
          l = r;
        }
        return Value(true);
      }
      case Expr::Kind::CondExpr: {
        if (eval(*e.args[0], sc).truthy()) return eval(*e.args[1], sc);
        return e.args[2] ? eval(*e.args[2], sc) : Value::undefined("the inline if-expression evaluated to false");
      }
    }
    raise(e.pos, "internal: unknown expression");
  }

 private:
  CallArgs collect_args(const Expr& e, size_t first, Scope& sc) {
    CallArgs a;
    size_t nkw = e.kwnames.size();
    size_t npos = e.args.size() - first - nkw;
    for (size_t i = 0; i < npos; ++i) a.positional.push_back(eval(*e.args[first + i], sc));
    for (size_t i = 0; i < nkw; ++i) a.keyword.emplace_back(e.kwnames[i], eval(*e.args[first + npos + i], sc));
    return a;
  }

  Value call(const Value& f, CallArgs& a, Pos p) {
    try {
      return f.fn()(a);
    } catch (const EvalError&) {
      throw;
    } catch (const Error& err) {
      raise(p, err.what());
    }
  }

  static std::string undefined_msg(const Value& v) {
    return v.str().empty() ? std::string("value is undefined") : v.str();
  }

  // Python attribute then item lookup (Jinja's environment.getattr).
  Value get_attr(const Value& obj, const std::string& name, Pos p) {
    if (obj.is_undefined()) raise(p, undefined_msg(obj));
    if (Value m = method(obj, name, p); !m.is_undefined()) return m;
    if (obj.is_dict() || obj.is_namespace()) {
      if (const Value* v = obj.dict().find(name)) return *v;
    }
    return Value::undefined(fmt::format("'{}' has no attribute '{}'", describe(obj), name));
  }

  // Item then attribute lookup (Jinja's environment.getitem).
  Value get_item(const Value& obj, const Value& key, Pos p) {
    if (obj.is_undefined()) raise(p, undefined_msg(obj));
    if (obj.is_list() && (key.is_int() || key.is_bool())) {
      int64_t n = static_cast<int64_t>(obj.list().size()), i = key.as_int();
      if (i < 0) i += n;
      if (i >= 0 && i < n) return obj.list()[i];
      return Value::undefined(fmt::format("{} object has no element {}", obj.type_name(), key.as_int()));
    }
    if (obj.is_string() && (key.is_int() || key.is_bool())) {
      std::vector<std::string> cps = code_points(obj.str());
      int64_t n = static_cast<int64_t>(cps.size()), i = key.as_int();
      if (i < 0) i += n;
      if (i >= 0 && i < n) return Value(cps[i]);
      return Value::undefined("string index out of range");
    }
    if ((obj.is_dict() || obj.is_namespace()) && key.is_string()) {
      if (const Value* v = obj.dict().find(key.str())) return *v;
    }
    if (key.is_string()) {
      if (Value m = method(obj, key.str(), p); !m.is_undefined()) return m;
    }
    return Value::undefined(fmt::format("'{}' has no attribute {}", describe(obj), key.repr()));
  }

  static std::string describe(const Value& v) { return std::string(v.type_name()) + " object"; }

  static int64_t slice_index(const Value& v, Pos p) {
    if (!(v.is_int() || v.is_bool())) raise(p, "slice indices must be integers or None");
    return v.as_int();
  }

  template <typename T>
  static std::vector<T> py_slice(const std::vector<T>& xs, const Value& a, const Value& b, const Value& c, Pos p) {
    int64_t n = static_cast<int64_t>(xs.size());
    int64_t step = c.is_none() ? 1 : slice_index(c, p);
    if (step == 0) raise(p, "slice step cannot be zero");
    auto norm = [&](const Value& v, int64_t dflt, bool is_start) {
      if (v.is_none()) return dflt;
      int64_t i = slice_index(v, p);
      if (i < 0) i += n;
      if (step > 0) return std::clamp<int64_t>(i, 0, n);
      (void)is_start;
      return std::clamp<int64_t>(i, -1, n - 1);
    };
    std::vector<T> out;
    if (step > 0) {
      for (int64_t i = norm(a, 0, true), e = norm(b, n, false); i < e; i += step) out.push_back(xs[i]);
    } else {
      for (int64_t i = norm(a, n - 1, true), e = norm(b, -1, false); i > e; i += step) out.push_back(xs[i]);
    }
    return out;
  }

  Value slice(const Value& obj, const Value& a, const Value& b, const Value& c, Pos p) {
    if (obj.is_undefined()) raise(p, undefined_msg(obj));
    if (obj.is_list()) return Value::make_list(py_slice(obj.list(), a, b, c, p), obj.is_tuple());
    if (obj.is_string()) {
      std::string out;
      for (const auto& s : py_slice(code_points(obj.str()), a, b, c, p)) out += s;
      return Value(out);
    }
    raise(p, fmt::format("'{}' object is not subscriptable", obj.type_name()));
  }

  // ---- operators
  static bool is_intlike(const Value& v) { return v.is_int() || v.is_bool(); }

  Value binary(const std::string& op, const Value& l, const Value& r, Pos p) {
    if (op == "~") return Value(l.to_str() + r.to_str());
    if (l.is_undefined()) raise(p, undefined_msg(l));
    if (r.is_undefined()) raise(p, undefined_msg(r));
    auto type_error = [&]() {
      raise(p, fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, l.type_name(), r.type_name()));
    };
    if (op == "+") {
      if (l.is_string() && r.is_string()) return Value(l.str() + r.str());
      if (l.is_list() && r.is_list() && l.is_tuple() == r.is_tuple()) {
        List x = l.list();
        x.insert(x.end(), r.list().begin(), r.list().end());
        return Value::make_list(std::move(x), l.is_tuple());
      }
      if (l.is_string() || r.is_string())
        raise(p, fmt::format("can only concatenate str (not \"{}\") to str", l.is_string() ? r.type_name() : l.type_name()));
    }
    if (op == "*") {
      const Value* seq = l.is_string() || l.is_list() ? &l : r.is_string() || r.is_list() ? &r : nullptr;
      const Value* cnt = seq == &l ? &r : &l;
      if (seq && is_intlike(*cnt)) {
        int64_t k = std::max<int64_t>(0, cnt->as_int());
        if (seq->is_string()) {
          std::string out;
          for (int64_t i = 0; i < k; ++i) out += seq->str();
          return Value(out);
        }
        List out;
        for (int64_t i = 0; i < k; ++i) out.insert(out.end(), seq->list().begin(), seq->list().end());
        return Value::make_list(std::move(out), seq->is_tuple());
      }
    }
    if (op == "%" && l.is_string()) raise(p, "printf-style '%' string formatting is not supported; use format()");
    if (!l.is_number() || !r.is_number()) type_error();
    bool ints = is_intlike(l) && is_intlike(r);
    if (op == "+") return ints ? Value(l.as_int() + r.as_int()) : Value(l.as_float() + r.as_float());
    if (op == "-") return ints ? Value(l.as_int() - r.as_int()) : Value(l.as_float() - r.as_float());
    if (op == "*") return ints ? Value(l.as_int() * r.as_int()) : Value(l.as_float() * r.as_float());
    if (op == "/") {
      if (r.as_float() == 0) raise(p, "division by zero");
      return Value(l.as_float() / r.as_float());
    }
    if (op == "//" || op == "%") {
      if (ints) {
        int64_t a = l.as_int(), b = r.as_int();
        if (b == 0) raise(p, "integer division or modulo by zero");
        int64_t q = a / b, m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) {
          --q;
          m += b;
        }
        return op == "//" ? Value(q) : Value(m);
      }
      double a = l.as_float(), b = r.as_float();
      if (b == 0) raise(p, "float division or modulo by zero");
      double m = std::fmod(a, b);
      if (m != 0 && ((m < 0) != (b < 0))) m += b;
      return op == "//" ? Value(std::floor(a / b)) : Value(m);
    }
    if (op == "**") {
      if (ints && r.as_int() >= 0) {
        int64_t res = 1, base = l.as_int();
        for (int64_t e = r.as_int(); e > 0; --e) res *= base;
        return Value(res);
      }
      return Value(std::pow(l.as_float(), r.as_float()));
    }
    type_error();
    raise(p, "unsupported operator " + op);
  }

  // Python ordering for <, <=, >, >=.
  int order(const Value& a, const Value& b, Pos p) {
    if (a.is_number() && b.is_number()) {
      if (is_intlike(a) && is_intlike(b)) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
      return a.as_float() < b.as_float() ? -1 : a.as_float() > b.as_float();
    }
    if (a.is_string() && b.is_string()) return a.str() < b.str() ? -1 : a.str() > b.str();
    if (a.is_list() && b.is_list()) {
      size_t n = std::min(a.list().size(), b.list().size());
      for (size_t i = 0; i < n; ++i) {
        if (values_equal(a.list()[i], b.list()[i])) continue;
        return order(a.list()[i], b.list()[i], p);
      }
      return a.list().size() < b.list().size() ? -1 : a.list().size() > b.list().size();
    }
    if (a.is_undefined()) raise(p, undefined_msg(a));
    if (b.is_undefined()) raise(p, undefined_msg(b));
    raise(p, fmt::format("'<' not supported between instances of '{}' and '{}'", a.type_name(), b.type_name()));
  }

  bool contains(const Value& container, const Value& item, Pos p) {
    if (container.is_string()) {
      if (!item.is_string())
        raise(p, fmt::format("'in <string>' requires string as left operand, not {}", item.type_name()));
      return container.str().find(item.str()) != std::string::npos;
    }
    if (container.is_list()) {
      for (const auto& x : container.list())
        if (values_equal(x, item)) return true;
      return false;
    }
    if (container.is_dict()) return item.is_string() && container.dict().contains(item.str());
    if (container.is_undefined()) return false;
    raise(p, fmt::format("argument of type '{}' is not iterable", container.type_name()));
  }

  bool compare(const std::string& op, const Value& l, const Value& r, Pos p) {
    if (op == "==") return values_equal(l, r);
    if (op == "!=") return !values_equal(l, r);
    if (op == "in") return contains(r, l, p);
    if (op == "notin") return !contains(r, l, p);
    int c = order(l, r, p);
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;  // ">="
  }

 public:
  std::vector<Value> iterate(const Value& v, Pos p) {
    switch (v.kind()) {
      case Value::Kind::Undefined: return {};
      case Value::Kind::List: return v.list();
      case Value::Kind::Dict: {
        std::vector<Value> keys;
        for (const auto& [k, x] : v.dict().items()) keys.emplace_back(k);
        return keys;
      }
      case Value::Kind::String: {
        std::vector<Value> out;
        for (auto& s : code_points(v.str())) out.emplace_back(std::move(s));
        return out;
      }
      default: raise(p, fmt::format("'{}' object is not iterable", v.type_name()));
    }
  }

 private:
  int64_t length(const Value& v, Pos p) {
    if (v.is_string()) return static_cast<int64_t>(tok::count_code_points(v.str()));
    if (v.is_list()) return static_cast<int64_t>(v.list().size());
    if (v.is_dict() || v.is_namespace()) return static_cast<int64_t>(v.dict().size());
    if (v.is_undefined()) return 0;
    raise(p, fmt::format("object of type '{}' has no len()", v.type_name()));
  }

  // ---- methods of str / dict / list (bound to `obj`); Undefined when `name` is not one.
  Value method(const Value& obj, const std::string& name, Pos p) {
    auto bind = [&](auto fn) {
      Value self = obj;
      return Value::function(name, [self, fn, p, this](CallArgs& a) mutable { return fn(self, a); });
    };
    auto str_arg = [p](CallArgs& a, size_t i, const char* n) -> std::optional<std::string> {
      Value v = arg_or(a, i, n, Value::none());
      if (v.is_none()) return std::nullopt;
      if (!v.is_string()) raise(p, fmt::format("{}() argument must be str or None, not {}", n, v.type_name()));
      return v.str();
    };
    if (obj.is_string()) {
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        bool l = name != "rstrip", r = name != "lstrip";
        return bind([=](const Value& s, CallArgs& a) {
          auto chars = str_arg(a, 0, "chars");
          return Value(py_strip(s.str(), chars ? &*chars : nullptr, l, r));
        });
      }
      if (name == "split" || name == "rsplit") {
        bool reverse = name == "rsplit";
        return bind([=](const Value& s, CallArgs& a) {
          auto sep = str_arg(a, 0, "sep");
          int64_t maxsplit = arg_or(a, 1, "maxsplit", Value(-1)).as_int();
          if (reverse && maxsplit >= 0 && sep) {
            // rsplit with a limit: split from the right.
            std::vector<std::string> parts;
            std::string rest = s.str();
            while (static_cast<int64_t>(parts.size()) < maxsplit) {
              size_t f = rest.rfind(*sep);
              if (f == std::string::npos) break;
              parts.insert(parts.begin(), rest.substr(f + sep->size()));
              rest = rest.substr(0, f);
            }
            parts.insert(parts.begin(), rest);
            List l;
            for (auto& x : parts) l.emplace_back(x);
            return Value::make_list(std::move(l));
          }
          List l;
          for (auto& x : py_split(s.str(), sep ? &*sep : nullptr, reverse ? -1 : maxsplit)) l.emplace_back(x);
          return Value::make_list(std::move(l));
        });
      }
      if (name == "splitlines")
        return bind([](const Value& s, CallArgs&) {
          List l;
          std::string cur;
          const std::string& t = s.str();
          for (size_t i = 0; i < t.size(); ++i) {
            if (t[i] == '\n' || t[i] == '\r') {
              l.emplace_back(cur);
              cur.clear();
              if (t[i] == '\r' && i + 1 < t.size() && t[i + 1] == '\n') ++i;
            } else {
              cur += t[i];
            }
          }
          if (!cur.empty()) l.emplace_back(cur);
          return Value::make_list(std::move(l));
        });
      if (name == "startswith" || name == "endswith") {
        bool start = name == "startswith";
        return bind([=](const Value& s, CallArgs& a) {
          Value x = arg_or(a, 0, "prefix", Value::none());
          std::vector<std::string> opts;
          if (x.is_string()) {
            opts.push_back(x.str());
          } else if (x.is_list()) {
            for (const auto& y : x.list()) opts.push_back(y.to_str());
          } else {
            raise(p, fmt::format("{} first arg must be str or a tuple of str, not {}", name, x.type_name()));
          }
          for (const auto& o : opts) {
            const std::string& t = s.str();
            if (start ? t.compare(0, o.size(), o) == 0
                      : (t.size() >= o.size() && t.compare(t.size() - o.size(), o.size(), o) == 0))
              return Value(true);
          }
          return Value(false);
        });
      }
      if (name == "replace")
        return bind([=](const Value& s, CallArgs& a) {
          auto o = str_arg(a, 0, "old"), n = str_arg(a, 1, "new");
          if (!o || !n) raise(p, "replace() takes two strings");
          return Value(py_replace(s.str(), *o, *n, arg_or(a, 2, "count", Value(-1)).as_int()));
        });
      if (name == "upper" || name == "lower") {
        bool up = name == "upper";
        return bind([=](const Value& s, CallArgs&) { return Value(map_case(s.str(), up)); });
      }
      if (name == "title") return bind([](const Value& s, CallArgs&) { return Value(py_title(s.str())); });
      if (name == "capitalize") return bind([](const Value& s, CallArgs&) { return Value(py_capitalize(s.str())); });
      if (name == "find" || name == "rfind" || name == "index" || name == "count") {
        return bind([=](const Value& s, CallArgs& a) {
          auto sub = str_arg(a, 0, "sub");
          if (!sub) raise(p, fmt::format("{}() needs a string", name));
          const std::string& t = s.str();
          if (name == "count") {
            if (sub->empty()) return Value(static_cast<int64_t>(tok::count_code_points(t) + 1));
            int64_t c = 0;
            for (size_t f = t.find(*sub); f != std::string::npos; f = t.find(*sub, f + sub->size())) ++c;
            return Value(c);
          }
          size_t f = name == "rfind" ? t.rfind(*sub) : t.find(*sub);
          if (f == std::string::npos) {
            if (name == "index") raise(p, "substring not found");
            return Value(static_cast<int64_t>(-1));
          }
          return Value(static_cast<int64_t>(tok::count_code_points(std::string_view(t).substr(0, f))));
        });
      }
      if (name == "join")
        return bind([=, this](const Value& s, CallArgs& a) {
          std::string out;
          bool first = true;
          for (const auto& x : iterate(arg_or(a, 0, "iterable", Value::make_list()), p)) {
            if (!x.is_string()) raise(p, fmt::format("sequence item: expected str instance, {} found", x.type_name()));
            if (!first) out += s.str();
            first = false;
            out += x.str();
          }
          return Value(out);
        });
      if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "isalnum" || name == "isupper" ||
          name == "islower")
        return bind([=](const Value& s, CallArgs&) {
          const std::string& t = s.str();
          if (t.empty()) return Value(false);
          size_t i = 0;
          bool any_cased = false;
          while (i < t.size()) {
            UChar32 c = static_cast<UChar32>(tok::next_code_point(t, i));
            bool ok = true;
            if (name == "isdigit") ok = u_isdigit(c);
            if (name == "isalpha") ok = u_isalpha(c);
            if (name == "isalnum") ok = u_isalnum(c);
            if (name == "isspace") ok = is_py_space(static_cast<char32_t>(c));
            if (name == "isupper") {
              ok = !u_islower(c);
              any_cased = any_cased || u_isupper(c);
            }
            if (name == "islower") {
              ok = !u_isupper(c);
              any_cased = any_cased || u_islower(c);
            }
            if (!ok) return Value(false);
          }
          return Value((name != "isupper" && name != "islower") || any_cased);
        });
      if (name == "format")
        return bind([=, this](const Value& s, CallArgs& a) { return Value(py_format(s.str(), a, p)); });
      return Value::undefined();
    }
    if (obj.is_dict()) {
      if (name == "items" || name == "keys" || name == "values") {
        return bind([=](const Value& d, CallArgs&) {
          List l;
          for (const auto& [k, v] : d.dict().items()) {
            if (name == "items")
              l.push_back(Value::make_list({Value(k), v}, true));
            else if (name == "keys")
              l.emplace_back(k);
            else
              l.push_back(v);
          }
          return Value::make_list(std::move(l));
        });
      }
      if (name == "get")
        return bind([=](const Value& d, CallArgs& a) {
          Value k = arg_or(a, 0, "key", Value::none());
          if (k.is_string())
            if (const Value* v = d.dict().find(k.str())) return *v;
          return arg_or(a, 1, "default", Value::none());
        });
      if (name == "update" || name == "pop" || name == "setdefault" || name == "clear" || name == "popitem")
        return bind([=](const Value&, CallArgs&) -> Value {
          raise(p, fmt::format("access to attribute '{}' of 'dict' object is unsafe (templates are immutable)", name));
        });
      return Value::undefined();
    }
    if (obj.is_list()) {
      if (name == "index" || name == "count")
        return bind([=](const Value& l, CallArgs& a) {
          Value x = arg_or(a, 0, "value", Value::none());
          int64_t c = 0;
          for (size_t i = 0; i < l.list().size(); ++i) {
            if (!values_equal(l.list()[i], x)) continue;
            if (name == "index") return Value(static_cast<int64_t>(i));
            ++c;
          }
          if (name == "index") raise(p, "value is not in list");
          return Value(c);
        });
      if (name == "append" || name == "extend" || name == "pop" || name == "insert" || name == "remove" ||
          name == "sort" || name == "reverse" || name == "clear")
        return bind([=](const Value& l, CallArgs&) -> Value {
          raise(p, fmt::format("access to attribute '{}' of '{}' object is unsafe (templates are immutable)", name,
                               l.type_name()));
        });
    }
    return Value::undefined();
  }

  // str.format with {} / {0} / {name} fields (no format specs beyond ':' being rejected).
  std::string py_format(const std::string& f, CallArgs& a, Pos p) {
    std::string out;
    size_t auto_idx = 0;
    for (size_t i = 0; i < f.size(); ++i) {
      char c = f[i];
      if (c == '{' && i + 1 < f.size() && f[i + 1] == '{') {
        out += '{';
        ++i;
      } else if (c == '}' && i + 1 < f.size() && f[i + 1] == '}') {
        out += '}';
        ++i;
      } else if (c == '{') {
        size_t e = f.find('}', i);
        if (e == std::string::npos) raise(p, "format(): single '{' encountered");
        std::string field = f.substr(i + 1, e - i - 1);
        if (field.find_first_of(":!") != std::string::npos) raise(p, "format(): format specs are not supported");
        Value v;
        if (field.empty()) {
          if (auto_idx >= a.positional.size()) raise(p, "format(): not enough arguments");
          v = a.positional[auto_idx++];
        } else if (std::isdigit(static_cast<unsigned char>(field[0]))) {
          size_t k = std::stoul(field);
          if (k >= a.positional.size()) raise(p, "format(): index out of range");
          v = a.positional[k];
        } else {
          v = arg_or(a, SIZE_MAX, field.c_str(), Value::undefined());
          if (v.is_undefined()) raise(p, fmt::format("format(): missing argument '{}'", field));
        }
        out += v.to_str();
        i = e;
      } else {
        out += c;
      }
    }
    return out;
  }

  // ---- tests
  bool apply_test(const std::string& name, const Value& v, CallArgs& a, Pos p) {
    auto arg = [&](size_t i) {
      if (i >= a.positional.size()) raise(p, fmt::format("test '{}' needs an argument", name));
      return a.positional[i];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.is_bool();
    if (name == "true") return v.is_bool() && v.as_bool();
    if (name == "false") return v.is_bool() && !v.as_bool();
    if (name == "integer") return v.is_int();
    if (name == "float") return v.is_float();
    if (name == "number") return v.is_number();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict();
    if (name == "iterable") return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
    if (name == "sequence") return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
    if (name == "callable") return v.is_function();
    if (name == "lower") return v.is_string() && map_case(v.str(), false) == v.str();
    if (name == "upper") return v.is_string() && map_case(v.str(), true) == v.str();
    if (name == "odd" || name == "even") {
      if (!v.is_number()) raise(p, fmt::format("test '{}' needs a number", name));
      int64_t m = ((v.as_int() % 2) + 2) % 2;
      return name == "odd" ? m == 1 : m == 0;
    }
    if (name == "divisibleby") {
      int64_t d = arg(0).as_int();
      if (d == 0) raise(p, "divisibleby 0");
      return v.as_int() % d == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return values_equal(v, arg(0));
    if (name == "ne" || name == "!=") return !values_equal(v, arg(0));
    if (name == "lt" || name == "lessthan" || name == "<") return order(v, arg(0), p) < 0;
    if (name == "le" || name == "<=") return order(v, arg(0), p) <= 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return order(v, arg(0), p) > 0;
    if (name == "ge" || name == ">=") return order(v, arg(0), p) >= 0;
    if (name == "in") return contains(arg(0), v, p);
    if (name == "sameas") {
      Value o = arg(0);
      if (v.kind() != o.kind()) return false;
      if (v.is_none() || v.is_undefined()) return true;
      if (v.is_bool()) return v.as_bool() == o.as_bool();
      if (v.is_list()) return &v.list() == &o.list();
      if (v.is_dict() || v.is_namespace()) return &v.dict() == &o.dict();
      return values_equal(v, o);
    }
    raise(p, fmt::format("unknown test '{}'", name));
  }

  // ---- filters
  Value attribute_path(const Value& v, const std::string& path, Pos p) {
    Value cur = v;
    size_t s = 0;
    while (true) {
      size_t d = path.find('.', s);
      std::string part = path.substr(s, d == std::string::npos ? std::string::npos : d - s);
      // (digits past int64's range stay a string key, which no list has)
      const bool digits = !part.empty() && part.size() <= 18 && std::all_of(part.begin(), part.end(), ::isdigit);
      cur = digits ? get_item(cur, Value(static_cast<int64_t>(std::stoll(part))), p) : get_item(cur, Value(part), p);
      if (d == std::string::npos) return cur;
      s = d + 1;
    }
  }

  // sort / dictsort / unique keys: case-insensitive unless case_sensitive.
  Value sort_key(const Value& v, bool case_sensitive) {
    if (!case_sensitive && v.is_string()) return Value(map_case(v.str(), false));
    return v;
  }

  Value select_or_reject(const Value& v, CallArgs& a, Pos p, bool select, bool by_attr) {
    List out;
    size_t base = by_attr ? 1 : 0;
    std::string attr;
    if (by_attr) {
      if (a.positional.empty() || !a.positional[0].is_string()) raise(p, "selectattr/rejectattr need an attribute");
      attr = a.positional[0].str();
    }
    std::string test = a.positional.size() > base ? a.positional[base].to_str() : "";
    CallArgs targs;
    for (size_t i = base + 1; i < a.positional.size(); ++i) targs.positional.push_back(a.positional[i]);
    for (const auto& x : iterate(v, p)) {
      Value probe = by_attr ? attribute_path(x, attr, p) : x;
      bool ok = test.empty() ? probe.truthy() : apply_test(test, probe, targs, p);
      if (ok == select) out.push_back(x);
    }
    return Value::make_list(std::move(out));
  }

  Value apply_filter(const std::string& name, const Value& v, CallArgs& a, Pos p, Scope& sc) {
    auto need_string = [&](const Value& x) -> const std::string& {
      if (x.is_undefined()) raise(p, undefined_msg(x));
      if (!x.is_string()) raise(p, fmt::format("filter '{}' needs a string, got {}", name, x.type_name()));
      return x.str();
    };
    if (name == "tojson") {
      Value ind = arg_or(a, 0, "indent", Value::none());
      Value sep = arg_or(a, SIZE_MAX, "separators", Value::none());
      bool sort_keys = arg_or(a, SIZE_MAX, "sort_keys", Value(false)).truthy();
      std::string is, ks;
      if (sep.is_list() && sep.list().size() == 2) {
        is = sep.list()[0].to_str();
        ks = sep.list()[1].to_str();
      }
      try {
        return Value(v.to_json_text(ind.is_none() ? -1 : static_cast<int>(ind.as_int()), sep.is_list() ? &is : nullptr,
                                    sep.is_list() ? &ks : nullptr, sort_keys));
      } catch (const Error& e) {
        raise(p, e.what());
      }
    }
    if (name == "trim") {
      Value chars = arg_or(a, 0, "chars", Value::none());
      std::string c = chars.is_none() ? "" : chars.to_str();
      return Value(py_strip(v.to_str(), chars.is_none() ? nullptr : &c, true, true));
    }
    if (name == "length" || name == "count") return Value(length(v, p));
    if (name == "string") return Value(v.to_str());
    if (name == "safe" || name == "e" || name == "escape" || name == "forceescape") {
      if (name == "safe") return v;
      std::string out;
      for (char c : v.to_str()) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
      }
      return Value(out);
    }
    if (name == "upper" || name == "lower") return Value(map_case(v.to_str(), name == "upper"));
    if (name == "capitalize") return Value(py_capitalize(v.to_str()));
    if (name == "title") {
      // Jinja's title: words split on [-\s({\[<]+, each first character upper, the rest lower.
      std::string s = v.to_str(), out;
      bool start = true;
      size_t i = 0;
      while (i < s.size()) {
        char32_t c = tok::next_code_point(s, i);
        bool sep = tok::is_whitespace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
        UChar32 u = static_cast<UChar32>(c);
        tok::append_utf8(out, static_cast<char32_t>(sep ? u : start ? u_toupper(u) : u_tolower(u)));
        start = sep;
      }
      return Value(out);
    }
    if (name == "default" || name == "d") {
      Value dflt = arg_or(a, 0, "default_value", Value(""));
      bool boolean = arg_or(a, 1, "boolean", Value(false)).truthy();
      if (v.is_undefined() || (boolean && !v.truthy())) return dflt;
      return v;
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::make_list();
      if (!v.is_dict()) raise(p, fmt::format("filter 'items' needs a mapping, got {}", v.type_name()));
      List l;
      for (const auto& [k, x] : v.dict().items()) l.push_back(Value::make_list({Value(k), x}, true));
      return Value::make_list(std::move(l));
    }
    if (name == "dictsort") {
      if (!v.is_dict()) raise(p, "filter 'dictsort' needs a mapping");
      bool cs = arg_or(a, 0, "case_sensitive", Value(false)).truthy();
      bool by_value = arg_or(a, 1, "by", Value("key")).to_str() == "value";
      bool rev = arg_or(a, 2, "reverse", Value(false)).truthy();
      List l;
      for (const auto& [k, x] : v.dict().items()) l.push_back(Value::make_list({Value(k), x}, true));
      std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
        int c = order(sort_key(x.list()[by_value], cs), sort_key(y.list()[by_value], cs), p);
        return rev ? c > 0 : c < 0;
      });
      return Value::make_list(std::move(l));
    }
    if (name == "join") {
      std::string sep = arg_or(a, 0, "d", Value("")).to_str();
      Value attr = arg_or(a, 1, "attribute", Value::none());
      std::string out;
      bool first = true;
      for (const auto& x : iterate(v, p)) {
        if (!first) out += sep;
        first = false;
        out += (attr.is_none() ? x : attribute_path(x, attr.to_str(), p)).to_str();
      }
      return Value(out);
    }
    if (name == "list") return Value::make_list(iterate(v, p));
    if (name == "first" || name == "last") {
      std::vector<Value> xs = iterate(v, p);
      if (xs.empty()) return Value::undefined(fmt::format("No {} item, sequence was empty.", name));
      return name == "first" ? xs.front() : xs.back();
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::vector<std::string> cps = code_points(v.str());
        std::string out;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
        return Value(out);
      }
      std::vector<Value> xs = iterate(v, p);
      std::reverse(xs.begin(), xs.end());
      return Value::make_list(std::move(xs));
    }
    if (name == "sort") {
      bool rev = arg_or(a, 0, "reverse", Value(false)).truthy();
      bool cs = arg_or(a, 1, "case_sensitive", Value(false)).truthy();
      Value attr = arg_or(a, 2, "attribute", Value::none());
      std::vector<Value> xs = iterate(v, p);
      std::stable_sort(xs.begin(), xs.end(), [&](const Value& x, const Value& y) {
        Value kx = attr.is_none() ? x : attribute_path(x, attr.to_str(), p);
        Value ky = attr.is_none() ? y : attribute_path(y, attr.to_str(), p);
        int c = order(sort_key(kx, cs), sort_key(ky, cs), p);
        return rev ? c > 0 : c < 0;
      });
      return Value::make_list(std::move(xs));
    }
    if (name == "unique") {
      bool cs = arg_or(a, 0, "case_sensitive", Value(false)).truthy();
      Value attr = arg_or(a, 1, "attribute", Value::none());
      List out, seen;
      for (const auto& x : iterate(v, p)) {
        Value k = sort_key(attr.is_none() ? x : attribute_path(x, attr.to_str(), p), cs);
        bool dup = false;
        for (const auto& s : seen) dup = dup || values_equal(s, k);
        if (dup) continue;
        seen.push_back(k);
        out.push_back(x);
      }
      return Value::make_list(std::move(out));
    }
    if (name == "max" || name == "min") {
      bool cs = arg_or(a, 0, "case_sensitive", Value(false)).truthy();
      Value attr = arg_or(a, 1, "attribute", Value::none());
      std::vector<Value> xs = iterate(v, p);
      if (xs.empty()) return Value::undefined(fmt::format("No aggregated item, sequence was empty."));
      size_t best = 0;
      for (size_t i = 1; i < xs.size(); ++i) {
        Value ki = sort_key(attr.is_none() ? xs[i] : attribute_path(xs[i], attr.to_str(), p), cs);
        Value kb = sort_key(attr.is_none() ? xs[best] : attribute_path(xs[best], attr.to_str(), p), cs);
        int c = order(ki, kb, p);
        if (name == "max" ? c > 0 : c < 0) best = i;
      }
      return xs[best];
    }
    if (name == "sum") {
      Value attr = arg_or(a, 0, "attribute", Value::none());
      Value acc = arg_or(a, 1, "start", Value(static_cast<int64_t>(0)));
      for (const auto& x : iterate(v, p)) acc = binary("+", acc, attr.is_none() ? x : attribute_path(x, attr.to_str(), p), p);
      return acc;
    }
    if (name == "map") {
      List out;
      Value attr = arg_or(a, SIZE_MAX, "attribute", Value::none());
      if (!attr.is_none()) {
        Value dflt = arg_or(a, SIZE_MAX, "default", Value::undefined());
        for (const auto& x : iterate(v, p)) {
          Value r = attribute_path(x, attr.to_str(), p);
          out.push_back(r.is_undefined() && !dflt.is_undefined() ? dflt : r);
        }
        return Value::make_list(std::move(out));
      }
      if (a.positional.empty()) raise(p, "map needs a filter name or attribute=");
      std::string f = a.positional[0].to_str();
      CallArgs rest;
      rest.positional.assign(a.positional.begin() + 1, a.positional.end());
      rest.keyword = a.keyword;
      for (const auto& x : iterate(v, p)) {
        CallArgs c = rest;
        out.push_back(apply_filter(f, x, c, p, sc));
      }
      return Value::make_list(std::move(out));
    }
    if (name == "select" || name == "reject") return select_or_reject(v, a, p, name == "select", false);
    if (name == "selectattr" || name == "rejectattr") return select_or_reject(v, a, p, name == "selectattr", true);
    if (name == "attr") return get_attr(v, arg_or(a, 0, "name", Value("")).to_str(), p);
    if (name == "replace") {
      const std::string& s = v.is_string() ? v.str() : need_string(Value(v.to_str()));
      return Value(py_replace(s, arg_or(a, 0, "old", Value("")).to_str(), arg_or(a, 1, "new", Value("")).to_str(),
                              arg_or(a, 2, "count", Value::none()).is_none() ? -1 : arg_or(a, 2, "count", Value(-1)).as_int()));
    }
    if (name == "int") {
      Value dflt = arg_or(a, 0, "default", Value(static_cast<int64_t>(0)));
      if (v.is_number()) return Value(v.is_float() ? static_cast<int64_t>(std::trunc(v.as_float())) : v.as_int());
      if (v.is_string()) {
        std::string s = py_strip(v.str(), nullptr, true, true);
        try {
          size_t pos = 0;
          int64_t r = std::stoll(s, &pos, 10);
          if (pos == s.size()) return Value(r);
          double d = std::stod(s, &pos);
          if (pos == s.size()) return Value(static_cast<int64_t>(std::trunc(d)));
        } catch (const std::exception&) {
        }
      }
      return dflt;
    }
    if (name == "float") {
      Value dflt = arg_or(a, 0, "default", Value(0.0));
      if (v.is_number()) return Value(v.as_float());
      if (v.is_string()) {
        try {
          size_t pos = 0;
          std::string s = py_strip(v.str(), nullptr, true, true);
          double d = std::stod(s, &pos);
          if (pos == s.size()) return Value(d);
        } catch (const std::exception&) {
        }
      }
      return dflt;
    }
    if (name == "abs") {
      if (!v.is_number()) raise(p, fmt::format("bad operand type for abs(): '{}'", v.type_name()));
      return v.is_float() ? Value(std::fabs(v.as_float())) : Value(static_cast<int64_t>(std::llabs(v.as_int())));
    }
    if (name == "round") {
      int64_t prec = arg_or(a, 0, "precision", Value(static_cast<int64_t>(0))).as_int();
      std::string method = arg_or(a, 1, "method", Value("common")).to_str();
      double x = v.as_float(), m = std::pow(10.0, static_cast<double>(prec));
      double r;
      if (method == "ceil") {
        r = std::ceil(x * m) / m;
      } else if (method == "floor") {
        r = std::floor(x * m) / m;
      } else {
        // Python round(): correctly rounded, ties to even.
        char buf[64];
        std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(std::max<int64_t>(prec, 0)), x);
        r = std::strtod(buf, nullptr);
      }
      return Value(r);
    }
    if (name == "indent") {
      Value w = arg_or(a, 0, "width", Value(static_cast<int64_t>(4)));
      std::string pad = w.is_string() ? w.str() : std::string(static_cast<size_t>(std::max<int64_t>(0, w.as_int())), ' ');
      bool first = arg_or(a, 1, "first", Value(false)).truthy();
      bool blank = arg_or(a, 2, "blank", Value(false)).truthy();
      std::string s = v.to_str(), out;
      size_t start = 0;
      bool is_first = true;
      while (true) {
        size_t nl = s.find('\n', start);
        std::string line = s.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
        bool add = (is_first ? first : true) && (blank || !line.empty());
        if (add) out += pad;
        out += line;
        if (nl == std::string::npos) break;
        out += '\n';
        start = nl + 1;
        is_first = false;
      }
      return Value(out);
    }
    if (name == "wordcount") return Value(static_cast<int64_t>(py_split(v.to_str(), nullptr, -1).size()));
    if (name == "center") {
      int64_t width = arg_or(a, 0, "width", Value(static_cast<int64_t>(80))).as_int();
      std::string s = v.to_str();
      int64_t n = static_cast<int64_t>(tok::count_code_points(s));
      if (n >= width) return Value(s);
      int64_t total = width - n, left = total / 2 + (total & width & 1);
      return Value(std::string(left, ' ') + s + std::string(total - left, ' '));
    }
    if (name == "batch" || name == "slice" || name == "groupby" || name == "format" || name == "truncate" ||
        name == "wordwrap" || name == "xmlattr" || name == "urlencode" || name == "urlize" || name == "striptags" ||
        name == "filesizeformat" || name == "pprint")
      raise(p, fmt::format("filter '{}' is not supported", name));
    raise(p, fmt::format("unknown filter '{}'", name));
  }

  std::string name_;
  Scope* root_;
};

// The globals transformers' environment provides, plus Jinja's range / namespace / dict.
void add_globals(Scope& g) {
  g.vars["range"] = Value::function("range", [](CallArgs& a) {
    std::vector<int64_t> n;
    for (const auto& v : a.positional) {
      if (!(v.is_int() || v.is_bool())) fail("range() arguments must be integers, got {}", v.type_name());
      n.push_back(v.as_int());
    }
    int64_t start = 0, stop = 0, step = 1;
    if (n.size() == 1) {
      stop = n[0];
    } else if (n.size() >= 2) {
      start = n[0];
      stop = n[1];
      if (n.size() >= 3) step = n[2];
    } else {
      fail("range expected at least 1 argument");
    }
    if (step == 0) fail("range() arg 3 must not be zero");
    if ((stop - start) / step > 100000) fail("range() too large");
    List l;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) l.emplace_back(i);
    return Value::make_list(std::move(l));
  });
  g.vars["namespace"] = Value::function("namespace", [](CallArgs& a) {
    Value ns = Value::name_space();
    for (const auto& v : a.positional) {
      if (!v.is_dict()) fail("namespace() positional arguments must be mappings");
      for (const auto& [k, x] : v.dict().items()) ns.dict().set(k, x);
    }
    for (auto& [k, v] : a.keyword) ns.dict().set(k, v);
    return ns;
  });
  g.vars["dict"] = Value::function("dict", [](CallArgs& a) {
    Value d = Value::make_dict();
    for (const auto& v : a.positional)
      if (v.is_dict())
        for (const auto& [k, x] : v.dict().items()) d.dict().set(k, x);
    for (auto& [k, v] : a.keyword) d.dict().set(k, v);
    return d;
  });
  g.vars["raise_exception"] = Value::function("raise_exception", [](CallArgs& a) -> Value {
    fail("{}", a.positional.empty() ? std::string("raise_exception") : a.positional[0].to_str());
  });
  g.vars["strftime_now"] = Value::function("strftime_now", [](CallArgs& a) {
    std::string f = a.positional.empty() ? "%Y-%m-%d" : a.positional[0].to_str();
    std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[256];
    size_t n = std::strftime(buf, sizeof(buf), f.c_str(), &tm);
    return Value(std::string(buf, n));
  });
}

}  // namespace

Template::Template(const std::string& source, std::string name)
    : name_(std::move(name)), body_(std::make_unique<Body>(parse_template(source, name_))) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;

std::string Template::render(const Value& context) const {
  Scope globals;
  add_globals(globals);
  Scope root{{}, &globals};
  if (context.is_dict())
    for (const auto& [k, v] : context.dict().items()) root.vars[k] = v;
  Renderer r(name_, &root);
  std::string out;
  try {
    r.render(*body_, root, out);
  } catch (const EvalError& e) {
    fail("{} line {} column {}: {}", name_, e.pos.line, e.pos.col, e.msg);
  }
  return out;
}

}  // namespace mlaserve::jinja
