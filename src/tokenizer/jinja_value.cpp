#include "tokenizer/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include <unicode/uchar.h>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace mlaserve::jinja {

const Value* Dict::find(std::string_view k) const {
  auto it = index_.find(std::string(k));
  return it == index_.end() ? nullptr : &items_[it->second].second;
}
Value* Dict::find(std::string_view k) {
  auto it = index_.find(std::string(k));
  return it == index_.end() ? nullptr : &items_[it->second].second;
}
void Dict::set(const std::string& k, Value v) {
  auto it = index_.find(k);
  if (it != index_.end()) {
    items_[it->second].second = std::move(v);
    return;
  }
  index_[k] = items_.size();
  items_.emplace_back(k, std::move(v));
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool:
    case Kind::Int: return int_ != 0;
    case Kind::Float: return float_ != 0.0;
    case Kind::String: return !str_.empty();
    case Kind::List: return !list_->empty();
    case Kind::Dict: return dict_->size() > 0;
    case Kind::Namespace:
    case Kind::Function: return true;
  }
  return false;
}

const char* Value::type_name() const {
  switch (kind_) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List: return tuple_ ? "tuple" : "list";
    case Kind::Dict: return "dict";
    case Kind::Namespace: return "Namespace";
    case Kind::Function: return "function";
  }
  return "?";
}

std::string python_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout: positional for 1e-4 <= |v| < 1e16, else d.ddde+XX.
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp = std::stoi(sci.substr(e + 1));
  bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      if (static_cast<int>(digits.size()) <= exp + 1) {
        out += digits + std::string(exp + 1 - digits.size(), '0') + ".0";
      } else {
        out.append(digits, 0, exp + 1);
        out += '.';
        out.append(digits, exp + 1, std::string::npos);
      }
    } else {
      out += "0.";
      out.append(static_cast<size_t>(-exp - 1), '0');
      out += digits;
    }
    return out;
  }
  out += digits[0];
  if (digits.size() > 1) {
    out += '.';
    out.append(digits, 1, std::string::npos);
  }
  char eb[16];
  std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return out + eb;
}

namespace {

bool python_printable(char32_t c) {
  if (c == ' ') return true;
  if (c < 0x20 || c == 0x7F) return false;
  if (c < 0x7F) return true;
  int8_t t = u_charType(static_cast<UChar32>(c));
  switch (t) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR: return false;
    default: return true;
  }
}

void json_string(std::string& out, std::string_view s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", c);
          out += b;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void json_dump(const Value& v, std::string& out, int indent, int level, const std::string& item_sep,
               const std::string& key_sep, bool sort_keys) {
  auto newline = [&](int lvl) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * lvl), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::None: out += "null"; return;
    case Value::Kind::Bool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::Int: out += std::to_string(v.as_int()); return;
    case Value::Kind::Float: {
      double d = v.as_float();
      if (std::isnan(d))
        out += "NaN";
      else if (std::isinf(d))
        out += d > 0 ? "Infinity" : "-Infinity";
      else
        out += python_float(d);
      return;
    }
    case Value::Kind::String: json_string(out, v.str()); return;
    case Value::Kind::List: {
      const List& l = v.list();
      if (l.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < l.size(); ++i) {
        if (i) out += item_sep;
        newline(level + 1);
        json_dump(l[i], out, indent, level + 1, item_sep, key_sep, sort_keys);
      }
      newline(level);
      out += ']';
      return;
    }
    case Value::Kind::Dict:
    case Value::Kind::Namespace: {
      if (v.is_namespace()) fail("Object of type Namespace is not JSON serializable");
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict().items()) items.push_back(&kv);
      if (sort_keys) std::sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      if (items.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        newline(level + 1);
        json_string(out, items[i]->first);
        out += key_sep;
        json_dump(items[i]->second, out, indent, level + 1, item_sep, key_sep, sort_keys);
      }
      newline(level);
      out += '}';
      return;
    }
    case Value::Kind::Undefined: fail("Object of type Undefined is not JSON serializable");
    case Value::Kind::Function: fail("Object of type function is not JSON serializable");
  }
}

}  // namespace

std::string python_str_repr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos, has_double = s.find('"') != std::string_view::npos;
  char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  size_t i = 0;
  while (i < s.size()) {
    size_t b = i;
    char32_t c = tok::next_code_point(s, i);
    if (c == static_cast<char32_t>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!python_printable(c)) {
      char buf[16];
      if (c < 0x100)
        std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      else if (c < 0x10000)
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      else
        std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out.append(s.substr(b, i - b));
    }
  }
  out += q;
  return out;
}

std::string Value::to_str() const {
  switch (kind_) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return int_ ? "True" : "False";
    case Kind::Int: return std::to_string(int_);
    case Kind::Float: return python_float(float_);
    case Kind::String: return str_;
    case Kind::Namespace: return "<Namespace>";
    case Kind::Function: return "<function " + str_ + ">";
    default: return repr();
  }
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::String: return python_str_repr(str_);
    case Kind::List: {
      std::string out(1, tuple_ ? '(' : '[');
      for (size_t i = 0; i < list_->size(); ++i) {
        if (i) out += ", ";
        out += (*list_)[i].repr();
      }
      if (tuple_ && list_->size() == 1) out += ',';
      out += tuple_ ? ')' : ']';
      return out;
    }
    case Kind::Dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : dict_->items()) {
        if (!first) out += ", ";
        first = false;
        out += python_str_repr(k) + ": " + v.repr();
      }
      return out + "}";
    }
    default: return to_str();
  }
}

std::string Value::to_json_text(int indent, const std::string* item_sep, const std::string* key_sep,
                                bool sort_keys) const {
  std::string is = item_sep ? *item_sep : (indent >= 0 ? "," : ", ");
  std::string ks = key_sep ? *key_sep : ": ";
  std::string out;
  json_dump(*this, out, indent, 0, is, ks, sort_keys);
  return out;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return Value(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& x : j) l.push_back(from_json(x));
      return make_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = make_dict();
      for (auto it = j.begin(); it != j.end(); ++it) d.dict().set(it.key(), from_json(it.value()));
      return d;
    }
    default: return none();
  }
}

nlohmann::ordered_json Value::to_json() const {
  switch (kind_) {
    case Kind::None: return nullptr;
    case Kind::Bool: return as_bool();
    case Kind::Int: return int_;
    case Kind::Float: return float_;
    case Kind::String: return str_;
    case Kind::List: {
      auto a = nlohmann::ordered_json::array();
      for (const auto& x : *list_) a.push_back(x.to_json());
      return a;
    }
    case Kind::Dict:
    case Kind::Namespace: {
      auto o = nlohmann::ordered_json::object();
      for (const auto& [k, v] : dict_->items()) o[k] = v.to_json();
      return o;
    }
    default: return nullptr;
  }
}

bool values_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if ((a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool())) return a.as_int() == b.as_int();
    return a.as_float() == b.as_float();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return true;
    case Value::Kind::String: return a.str() == b.str();
    case Value::Kind::List: {
      if (a.is_tuple() != b.is_tuple() || a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i)
        if (!values_equal(a.list()[i], b.list()[i])) return false;
      return true;
    }
    case Value::Kind::Dict: {
      if (a.dict().size() != b.dict().size()) return false;
      for (const auto& [k, v] : a.dict().items()) {
        const Value* o = b.dict().find(k);
        if (!o || !values_equal(v, *o)) return false;
      }
      return true;
    }
    case Value::Kind::Namespace: return &a.dict() == &b.dict();
    case Value::Kind::Function: return &a.fn() == &b.fn();
    default: return false;
  }
}

}  // namespace mlaserve::jinja
