// Chat templates rendered exactly as transformers' apply_chat_template (goldens from the device: DeepSeek-V3's
// template from the npm package, plus templates in data/templates/ written in the style of Llama 3, Qwen, Mistral,
// Gemma, DeepSeek-R1 and a kitchen sink of the Jinja subset), and the ids of DeepSeek's rendered prompts.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "test_data.h"
#include "tokenizer/jinja.h"
#include "tokenizer/tokenizer_config.h"

namespace mlaserve::tok {
namespace {

using testing::data_path;
using testing::read_jsonl;
using testing::show;

std::string read_file(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(ChatTemplateGolden, MatchesTransformers) {
  auto ds = PretrainedTokenizer::load(testing::deepseek_dir());
  auto cases = read_jsonl(data_path("chat_cases.jsonl"));
  auto golden = read_jsonl(data_path("chat.jsonl"));
  ASSERT_EQ(golden.size(), cases.size() + 1);  // + the renderer line
  EXPECT_EQ(golden.back()["renderer"], "transformers.apply_chat_template");
  int rendered = 0, errors = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    const auto& g = golden[i];
    std::string name = c["template"].get<std::string>();
    SCOPED_TRACE(fmt::format("case {} ({})", i, name));
    auto render = [&]() {
      if (name == "deepseek_v3")
        return ds->apply_chat_template(c["messages"], c["add_generation_prompt"].get<bool>(), c["vars"]);
      jinja::Template t(read_file(data_path("templates/" + name)), name);
      return ds->render_chat_template(t, c["messages"], c["add_generation_prompt"].get<bool>(), c["vars"]);
    };
    if (g.contains("error")) {
      std::string want = g["error"].get<std::string>();
      try {
        std::string got = render();
        ADD_FAILURE() << "expected an error like " << want << ", rendered " << show(got);
      } catch (const Error& e) {
        ++errors;
        // raise_exception's message must come through.
        if (want.rfind("TemplateError: ", 0) == 0) {
          EXPECT_NE(std::string(e.what()).find(want.substr(15)), std::string::npos) << e.what();
        }
      }
      continue;
    }
    std::string want = g["text"].get<std::string>();
    std::string got;
    try {
      got = render();
    } catch (const Error& e) {
      ADD_FAILURE() << "error: " << e.what();
      continue;
    }
    ++rendered;
    EXPECT_EQ(got, want) << "got " << show(got) << "\nwant " << show(want);
    if (g.contains("ids")) {
      EXPECT_EQ(ds->encode(got), g["ids"].get<std::vector<int32_t>>());
    }
  }
  EXPECT_GT(rendered, 60);
  EXPECT_GE(errors, 9);
}

}  // namespace
}  // namespace mlaserve::tok
