// Internal: tokens and syntax tree of the Jinja interpreter (jinja_parse.cpp builds it, jinja_eval.cpp runs it).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace mlaserve::jinja {

struct Pos {
  int line = 1, col = 1;
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Const,      // value
    Name,       // name
    ListLit,    // args (tuple: is_tuple)
    DictLit,    // args = key0, value0, key1, value1, ...
    GetAttr,    // args[0].name
    GetItem,    // args[0][args[1]]
    Slice,      // args[0][args[1]:args[2]:args[3]] (null entries = omitted)
    Call,       // args[0](args[1..n_positional], kwargs...)
    Filter,     // args[0] | name(args[1..], kwargs...)
    Test,       // args[0] is [not] name(args[1..])
    Unary,      // op ("-", "+", "not") args[0]
    Binary,     // args[0] op args[1]: + - * / // % ** ~ and or
    Compare,    // args[0] ops[0] args[1] ops[1] args[2] ...
    CondExpr,   // args[1] if args[0] else args[2] (args[2] may be null)
  };
  Kind kind;
  Pos pos;
  Value value;
  std::string name;  // Name / GetAttr / Filter / Test / Unary / Binary op
  std::vector<ExprPtr> args;
  std::vector<std::string> kwnames;  // Call / Filter / Test: names of the trailing keyword arguments
  std::vector<std::string> ops;      // Compare
  bool is_tuple = false;
  bool negated = false;  // Test
  int depth = 1;         // levels of the tree below and including this node (the parser bounds it)
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, FilterBlock, With };
  Kind kind;
  Pos pos;
  std::string text;                    // Text; SetBlock / Macro name
  ExprPtr expr;                        // Output; For iterable; Set value; FilterBlock: filter chain on a Name "__body"
  std::vector<ExprPtr> conds;          // If: one per branch; For: [filter condition or null]
  std::vector<Body> bodies;            // If: one per cond (+ else); For: [body, else]; others: [body]
  std::vector<std::string> targets;    // For / Set loop or assignment names; Set "ns.attr": {"ns", "attr"}
  bool attr_target = false;            // Set: targets = {object, attribute}
  std::vector<std::string> params;     // Macro parameter names; With variable names
  std::vector<ExprPtr> defaults;       // Macro defaults (null = required); With values
};

}  // namespace mlaserve::jinja
