// A Jinja2 interpreter for Hugging Face chat templates: the subset real templates use, rendered with the settings
// transformers uses (trim_blocks, lstrip_blocks, loop controls, no autoescape, a tojson that does not escape
// non-ASCII or HTML, raise_exception, strftime_now). See docs/tokenizer.md for the supported syntax. Anything
// outside it is an mlaserve::Error naming the template line and column.
#pragma once

#include <memory>
#include <string>

#include "tokenizer/jinja_value.h"

namespace mlaserve::jinja {

struct Node;

class Template {
 public:
  // Parses `source`; `name` prefixes error messages (e.g. "chat template").
  explicit Template(const std::string& source, std::string name = "template");
  ~Template();
  Template(Template&&) noexcept;

  // Renders with the variables of `context` (a Dict value) on top of the built-in globals.
  std::string render(const Value& context) const;

 private:
  std::string name_;
  std::unique_ptr<std::vector<std::unique_ptr<Node>>> body_;
};

}  // namespace mlaserve::jinja
