// The Jinja interpreter construct by construct against jinja2 with transformers' settings
// (data/jinja_cases.jsonl, from tools/tokenizer/make_jinja_cases.py), plus its error reporting.
#include <gtest/gtest.h>

#include "core/error.h"
#include "test_data.h"
#include "tokenizer/jinja.h"

namespace mlaserve::jinja {
namespace {

using tok::testing::data_path;
using tok::testing::read_jsonl;
using tok::testing::show;

std::string render(const std::string& src, const nlohmann::ordered_json& ctx = nlohmann::ordered_json::object()) {
  return Template(src, "t").render(Value::from_json(ctx));
}

std::string error_of(const std::string& src, const nlohmann::ordered_json& ctx = nlohmann::ordered_json::object()) {
  try {
    std::string out = render(src, ctx);
    return "no error, rendered " + out;
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(Jinja, MatchesJinja2WithTransformersSettings) {
  auto cases = read_jsonl(data_path("jinja_cases.jsonl"));
  ASSERT_GT(cases.size(), 70u);
  for (const auto& c : cases) {
    std::string src = c["template"].get<std::string>();
    SCOPED_TRACE(show(src));
    if (c.contains("error")) {
      std::string got = error_of(src, c["context"]);
      EXPECT_EQ(got.rfind("no error", 0), std::string::npos) << "jinja2: " << c["error"] << "; mlaserve: " << got;
      std::string want = c["error"].get<std::string>();
      if (want.rfind("TemplateError: ", 0) == 0) {
        EXPECT_NE(got.find(want.substr(15)), std::string::npos) << got;
      }
      continue;
    }
    std::string got;
    try {
      got = render(src, c["context"]);
    } catch (const Error& e) {
      ADD_FAILURE() << e.what();
      continue;
    }
    EXPECT_EQ(got, c["output"].get<std::string>()) << "got " << show(got) << " want " << show(c["output"]);
  }
}

TEST(Jinja, SyntaxErrorsNamePosition) {
  EXPECT_NE(error_of("line one\n  {% include 'x' %}").find("t line 2 column 6: unsupported tag 'include'"),
            std::string::npos)
      << error_of("line one\n  {% include 'x' %}");
  EXPECT_NE(error_of("{% if x %}never closed").find("missing '{% endif %}'"), std::string::npos);
  EXPECT_NE(error_of("{{ 1 + }}").find("line 1 column 8"), std::string::npos) << error_of("{{ 1 + }}");
  EXPECT_NE(error_of("{{ 'abc }}").find("unterminated string"), std::string::npos);
  EXPECT_NE(error_of("ok\n{{ x\n").find("unclosed"), std::string::npos);
  EXPECT_NE(error_of("{% for x in y recursive %}{% endfor %}").find("recursive"), std::string::npos);
  EXPECT_NE(error_of("{{ f(*args) }}").find("not supported"), std::string::npos);
  EXPECT_NE(error_of("{# open comment").find("unclosed comment"), std::string::npos);
  EXPECT_NE(error_of("{{ a ? b }}").find("unexpected character '?'"), std::string::npos);
}

TEST(Jinja, RuntimeErrorsNamePosition) {
  std::string e = error_of("a\n  {{ x.y }}");
  EXPECT_NE(e.find("t line 2 column 7"), std::string::npos) << e;
  EXPECT_NE(e.find("'x' is undefined"), std::string::npos) << e;
  e = error_of("{{ raise_exception('bad input') }}");
  EXPECT_NE(e.find("bad input"), std::string::npos) << e;
  e = error_of("{{ 1 | truncate(3) }}");
  EXPECT_NE(e.find("filter 'truncate' is not supported"), std::string::npos) << e;
}

TEST(Jinja, GenerationTagRendersItsBody) {
  // transformers' {% generation %} (assistant masks) renders its body unchanged.
  EXPECT_EQ(render("{%- generation -%} gen {{ 1 }} {%- endgeneration -%}!"), "gen 1!");
}

TEST(Jinja, PythonFloatAndReprFormatting) {
  EXPECT_EQ(python_float(1.0), "1.0");
  EXPECT_EQ(python_float(1e16), "1e+16");
  EXPECT_EQ(python_float(1234567890123456.0), "1234567890123456.0");
  EXPECT_EQ(python_float(0.0001), "0.0001");
  EXPECT_EQ(python_float(0.00001), "1e-05");
  EXPECT_EQ(python_float(-2.5e-300), "-2.5e-300");
  EXPECT_EQ(python_float(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(python_str_repr("it's"), "\"it's\"");
  EXPECT_EQ(python_str_repr("a\"b'c"), "'a\"b\\'c'");
  EXPECT_EQ(python_str_repr("\x01\u00a0\u00e9"), "'\\x01\\xa0\u00e9'");
}

}  // namespace
}  // namespace mlaserve::jinja
