// Values of the Jinja interpreter (chat templates), with Python semantics where templates can observe them:
// reference semantics for lists / dicts / namespaces, insertion-ordered dicts, Python str() and repr() when
// printed, json.dumps for tojson, and Jinja's Undefined (prints as "", is falsy and iterates as empty; any
// attribute or item lookup on it is an error).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace mlaserve::jinja {

class Value;
using List = std::vector<Value>;

// An insertion-ordered dict with string keys (what chat templates and JSON messages use).
class Dict {
 public:
  bool contains(std::string_view k) const { return index_.count(std::string(k)) > 0; }
  const Value* find(std::string_view k) const;
  Value* find(std::string_view k);
  void set(const std::string& k, Value v);
  const std::vector<std::pair<std::string, Value>>& items() const { return items_; }
  size_t size() const { return items_.size(); }

 private:
  std::vector<std::pair<std::string, Value>> items_;
  std::unordered_map<std::string, size_t> index_;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};
using Function = std::function<Value(CallArgs&)>;

class Value {
 public:
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Function };

  Value() = default;  // Undefined
  static Value undefined(std::string hint = {}) {
    Value v;
    v.str_ = std::move(hint);
    return v;
  }
  static Value none() { return Value(Kind::None); }
  Value(bool b) : kind_(Kind::Bool), int_(b) {}
  Value(int v) : kind_(Kind::Int), int_(v) {}
  Value(int64_t v) : kind_(Kind::Int), int_(v) {}
  Value(double v) : kind_(Kind::Float), float_(v) {}
  Value(std::string s) : kind_(Kind::String), str_(std::move(s)) {}
  Value(const char* s) : kind_(Kind::String), str_(s) {}
  static Value make_list(List items = {}, bool tuple = false) {
    Value v(Kind::List);
    v.list_ = std::make_shared<List>(std::move(items));
    v.tuple_ = tuple;
    return v;
  }
  static Value make_dict() {
    Value v(Kind::Dict);
    v.dict_ = std::make_shared<Dict>();
    return v;
  }
  static Value name_space() {
    Value v(Kind::Namespace);
    v.dict_ = std::make_shared<Dict>();
    return v;
  }
  static Value function(std::string name, Function f) {
    Value v(Kind::Function);
    v.str_ = std::move(name);
    v.fn_ = std::make_shared<Function>(std::move(f));
    return v;
  }

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_bool() const { return kind_ == Kind::Bool; }
  bool is_int() const { return kind_ == Kind::Int; }
  bool is_float() const { return kind_ == Kind::Float; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_list() const { return kind_ == Kind::List; }
  bool is_tuple() const { return kind_ == Kind::List && tuple_; }
  bool is_dict() const { return kind_ == Kind::Dict; }
  bool is_namespace() const { return kind_ == Kind::Namespace; }
  bool is_function() const { return kind_ == Kind::Function; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return kind_ == Kind::Float ? static_cast<int64_t>(float_) : int_; }
  double as_float() const { return kind_ == Kind::Float ? float_ : static_cast<double>(int_); }
  const std::string& str() const { return str_; }  // String; Undefined: the hint; Function: its name
  List& list() const { return *list_; }
  Dict& dict() const { return *dict_; }  // Dict and Namespace
  Function& fn() const { return *fn_; }

  bool truthy() const;
  // Python str(): what {{ value }} prints.
  std::string to_str() const;
  // Python repr(): how values print inside lists and dicts.
  std::string repr() const;
  // json.dumps(value, ensure_ascii=False, indent=indent, separators=..., sort_keys=...); indent < 0: none.
  std::string to_json_text(int indent = -1, const std::string* item_sep = nullptr, const std::string* key_sep = nullptr,
                           bool sort_keys = false) const;
  const char* type_name() const;

  static Value from_json(const nlohmann::ordered_json& j);
  nlohmann::ordered_json to_json() const;

 private:
  explicit Value(Kind k) : kind_(k) {}
  Kind kind_ = Kind::Undefined;
  bool tuple_ = false;
  int64_t int_ = 0;
  double float_ = 0;
  std::string str_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Function> fn_;
};

// Python float repr (shortest round-trip digits; "1.0", "1e+20", "1e-05", "inf", "nan").
std::string python_float(double v);
// Python repr of a str (quotes chosen as Python does; non-printable characters escaped).
std::string python_str_repr(std::string_view s);
// Python == (1 == 1.0 == True; lists and dicts compare deeply; Undefined equals only Undefined).
bool values_equal(const Value& a, const Value& b);

}  // namespace mlaserve::jinja
