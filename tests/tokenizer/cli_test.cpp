// `mlaserve tokenize` end to end: the JSON-lines contract on stdin / stdout with the real DeepSeek tokenizer.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "test_data.h"

namespace {

std::vector<nlohmann::ordered_json> run_lines(const std::vector<std::string>& lines) {
  std::string in = std::filesystem::temp_directory_path() / ("mlaserve_tok_cli_" + std::to_string(::getpid()));
  {
    std::ofstream f(in, std::ios::binary);
    for (const auto& l : lines) f << l << "\n";
  }
  std::string cmd = std::string(MLASERVE_BINARY) + " tokenize --tokenizer-path '" +
                    mlaserve::tok::testing::deepseek_dir() + "' < '" + in + "'";
  int status = -1;
  const std::string out = mlaserve::tok::testing::command_output(cmd, status);
  EXPECT_EQ(status, 0);
  std::filesystem::remove(in);
  std::vector<nlohmann::ordered_json> rows;
  size_t b = 0;
  while (b < out.size()) {
    size_t e = out.find('\n', b);
    rows.push_back(nlohmann::ordered_json::parse(out.substr(b, e - b)));
    b = e + 1;
  }
  return rows;
}

TEST(TokenizeCommand, JsonLinesContract) {
  auto rows = run_lines({
      R"({"text": "Hello world"})",
      R"({"text": "Hello world", "add_special_tokens": true})",
      R"({"ids": [0, 19923, 2058, 1]})",
      R"({"ids": [0, 19923, 2058, 1], "skip_special_tokens": true})",
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "add_generation_prompt": true})",
      "not json",
      R"({"text": "no error after a bad line", "add_special_tokens": "yes"})",
      R"({"ids": [19923, 2058], "stream": true})",
      R"({"unknown": 1})",
      R"({"messages": "x"})",
  });
  ASSERT_EQ(rows.size(), 10u);
  EXPECT_EQ(rows[0], nlohmann::ordered_json::parse(R"({"ids": [19923, 2058]})"));
  EXPECT_EQ(rows[1], nlohmann::ordered_json::parse(R"({"ids": [0, 19923, 2058]})"));
  EXPECT_EQ(rows[2]["text"], "<｜begin▁of▁sentence｜>Hello world<｜end▁of▁sentence｜>");
  EXPECT_EQ(rows[3]["text"], "Hello world");
  EXPECT_EQ(rows[4]["text"], "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>");
  auto ids = rows[4]["ids"].get<std::vector<int32_t>>();
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 0);  // written by the template, not added again
  EXPECT_NE(ids[1], 0);
  EXPECT_TRUE(rows[5].contains("error"));
  EXPECT_TRUE(rows[6].contains("error"));
  EXPECT_EQ(rows[7]["text"], "Hello world");
  EXPECT_EQ(rows[7]["pieces"], nlohmann::ordered_json::parse(R"(["Hello", " world"])"));
  EXPECT_TRUE(rows[8].contains("error"));
  EXPECT_TRUE(rows[9].contains("error"));
}

TEST(TokenizeCommand, MissingTokenizerIsAnError) {
  std::string cmd = std::string(MLASERVE_BINARY) + " tokenize --tokenizer-path /nonexistent < /dev/null 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[512];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  EXPECT_NE(pclose(p), 0);
  EXPECT_NE(out.find("no tokenizer.json"), std::string::npos) << out;
}

}  // namespace
