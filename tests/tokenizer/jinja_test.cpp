// The Jinja interpreter construct by construct against jinja2 with transformers' settings
// (data/jinja_cases.jsonl, from tools/tokenizer/make_jinja_cases.py), plus its error reporting.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

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

// Nesting past the bounds is a template error naming its place, not a stack overflow in the parser, the renderer or
// the trees' destructors: brackets, blocks and operator chains.
TEST(Jinja, DeepNestingIsAnError) {
  const int n = 20000;
  std::string e = error_of("{{ " + std::string(n, '(') + "1" + std::string(n, ')') + " }}");
  EXPECT_NE(e.find("the template nests deeper than 256 levels"), std::string::npos) << e.substr(0, 200);
  e = error_of("{{ " + std::string(n, '[') + "1" + std::string(n, ']') + " }}");
  EXPECT_NE(e.find("the template nests deeper than 256 levels"), std::string::npos) << e.substr(0, 200);
  std::string ifs;
  for (int i = 0; i < 300; ++i) ifs += "{% if true %}";
  for (int i = 0; i < 300; ++i) ifs += "{% endif %}";
  e = error_of(ifs);
  EXPECT_NE(e.find("the template nests deeper than 256 levels"), std::string::npos) << e.substr(0, 200);
  std::string chain = "{{ 1";
  for (int i = 0; i < n; ++i) chain += " ~ 1";
  e = error_of(chain + " }}");
  EXPECT_NE(e.find("an expression nested deeper than 1024 levels"), std::string::npos) << e.substr(0, 200);
  std::string attrs = "{{ x";
  for (int i = 0; i < n; ++i) attrs += ".a";
  e = error_of(attrs + " }}");
  EXPECT_NE(e.find("an expression nested deeper than 1024 levels"), std::string::npos) << e.substr(0, 200);
  // Within the bounds: 200 chained operators and 60 brackets render as Jinja does.
  std::string fine = "{{ " + std::string(60, '(') + "'a'";
  for (int i = 0; i < 200; ++i) fine += " ~ 'b'";
  EXPECT_EQ(render(fine + std::string(60, ')') + " }}"), "a" + std::string(200, 'b'));
  // A long one-line template (its positions counted on, not from the line's start each time).
  std::string flat;
  for (int i = 0; i < n; ++i) flat += "{{ x }}";
  EXPECT_EQ(render(flat, {{"x", "y"}}), std::string(n, 'y'));
  EXPECT_NE(error_of(flat + "{{ 1 + }}", {{"x", "y"}}).find("line 1 column " + std::to_string(7 * n + 8)),
            std::string::npos);
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

// Real chat templates (tests/tokenizer/data/templates) with random edits (pieces of Jinja syntax, long numbers and
// deep nesting inserted, characters removed): each either fails to parse or render with an Error, or renders; never
// another exception (an integer literal past 64 bits escaped as std::out_of_range before), never a crash.
TEST(Jinja, EditedTemplatesParseAndRenderOrFailClearly) {
  std::vector<std::string> sources;
  for (const auto& e : std::filesystem::directory_iterator(data_path("templates"))) {
    std::ifstream in(e.path());
    sources.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GE(sources.size(), 5u);
  const std::vector<std::string> pieces = {
      "{{", "}}", "{%", "%}", "{#", "#}", "(", ")", "[", "]", "{", "}", "|", "'", "\"", ".", ",", ":", "-", "~",
      " if ", " else ", " for ", " in ", " not ", " and ", " is ", "endif", "endfor", "set ", "macro ", "loop.",
      "99999999999999999999999", "1e999", "-0", "0.5", "[0]", "[-1]", "[1:3]", "|length", "|tojson", "|int",
      "|string", "|items", "messages", "message['content']", "range(100)", "((((((((((", ")))))))))))",
      std::string(3000, '('), std::string(3000, '['), "{% if x %}"};
  nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "hello", "tool_calls": [{"type": "function",
                  "function": {"name": "f", "arguments": {"a": 1}}}]},
                 {"role": "tool", "content": "42"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})");
  const Value context = Value::from_json(ctx);
  std::mt19937_64 rng(20261207);
  int rendered = 0, refused = 0;
  for (int it = 0; it < 1500; ++it) {
    std::string src = sources[rng() % sources.size()];
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits && !src.empty(); ++e) {
      const size_t at = rng() % src.size();
      if (rng() % 3 == 0)
        src.erase(at, 1 + rng() % 8);
      else
        src.insert(at, pieces[rng() % pieces.size()]);
    }
    try {
      (void)Template(src, "t").render(context);
      ++rendered;
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a clear error: " << e.what() << "\n" << src;
    }
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GT(rendered, 20);
  EXPECT_GT(refused, 500);
}

}  // namespace
}  // namespace mlaserve::jinja
