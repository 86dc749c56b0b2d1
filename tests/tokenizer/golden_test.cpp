// Token-for-token agreement with Hugging Face `tokenizers` 0.23 (goldens from tools/tokenizer/make_goldens.py):
// the real DeepSeek-V3 tokenizer on the whole corpus, and 15 tokenizers of other families (trained on the device,
// with other normalizers / pre-tokenizers / models / post-processors / decoders) on its hand-written part plus
// 500 random strings.
#include <gtest/gtest.h>

#include <filesystem>

#include "test_data.h"
#include "tokenizer/tokenizer.h"

namespace mlaserve::tok {
namespace {

using testing::corpus_texts;
using testing::read_jsonl;
using testing::show;

std::vector<int32_t> ids_of(const nlohmann::ordered_json& j) { return j.get<std::vector<int32_t>>(); }

// Compares one tokenizer with its goldens; returns the number of mismatching texts (reports the first few).
int compare_with_goldens(const Tokenizer& tok, const std::vector<std::string>& texts,
                         const std::vector<nlohmann::ordered_json>& golden, const std::string& name) {
  EXPECT_LE(golden.size(), texts.size());
  int bad = 0;
  for (size_t i = 0; i < golden.size(); ++i) {
    const auto& g = golden[i];
    const std::string& text = texts[i];
    std::vector<int32_t> want = ids_of(g["ids"]);
    std::vector<int32_t> got = tok.encode(text);
    std::vector<int32_t> want_sp = g.contains("ids_special") ? ids_of(g["ids_special"]) : want;
    std::vector<int32_t> got_sp = tok.encode(text, true);
    std::string want_dec = g.contains("decoded") ? g["decoded"].get<std::string>() : text;
    std::string got_dec = tok.decode(want);
    std::string want_skip = g.contains("decoded_skip") ? g["decoded_skip"].get<std::string>() : want_dec;
    std::string got_skip = tok.decode(want, true);
    if (got != want || got_sp != want_sp || got_dec != want_dec || got_skip != want_skip) {
      if (++bad <= 8) {
        nlohmann::json d;
        d["text"] = text;
        if (got != want) d["ids"] = {{"want", want}, {"got", got}};
        if (got_sp != want_sp) d["ids_special"] = {{"want", want_sp}, {"got", got_sp}};
        if (got_dec != want_dec) d["decoded"] = {{"want", want_dec}, {"got", got_dec}};
        if (got_skip != want_skip) d["decoded_skip"] = {{"want", want_skip}, {"got", got_skip}};
        ADD_FAILURE() << name << " text #" << i << ": " << d.dump();
      }
    }
  }
  return bad;
}

TEST(TokenizerGolden, DeepSeekV3MatchesHuggingFace) {
  auto tok = Tokenizer::from_file(testing::deepseek_dir() + "/tokenizer.json");
  auto texts = corpus_texts();
  auto golden = read_jsonl(testing::data_path("deepseek_v3.jsonl"));
  ASSERT_EQ(golden.size(), texts.size());
  EXPECT_GT(texts.size(), 3000u);
  EXPECT_EQ(compare_with_goldens(*tok, texts, golden, "deepseek_v3"), 0);
}

TEST(TokenizerGolden, DeepSeekV3DecodeEncodeRoundTrip) {
  auto tok = Tokenizer::from_file(testing::deepseek_dir() + "/tokenizer.json");
  int bad = 0;
  for (const auto& text : corpus_texts()) {
    std::string back = tok->decode(tok->encode(text));
    if (back != text && ++bad <= 5) ADD_FAILURE() << show(text) << " -> " << show(back);
  }
  EXPECT_EQ(bad, 0);
}

TEST(TokenizerGolden, OtherFamiliesMatchHuggingFace) {
  auto texts = corpus_texts();
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(MLASERVE_TOKENIZER_FAMILIES)) {
    std::string f = e.path().filename().string();
    if (f.size() > 15 && f.ends_with(".tokenizer.json")) names.push_back(f.substr(0, f.size() - 15));
  }
  std::sort(names.begin(), names.end());
  EXPECT_GE(names.size(), 15u);
  for (const auto& name : names) {
    std::string base = std::string(MLASERVE_TOKENIZER_FAMILIES) + "/" + name;
    std::unique_ptr<Tokenizer> tok;
    try {
      tok = Tokenizer::from_file(base + ".tokenizer.json");
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << ": " << e.what();
      continue;
    }
    auto golden = read_jsonl(base + ".jsonl");
    EXPECT_GT(golden.size(), 600u) << name;
    int bad = compare_with_goldens(*tok, texts, golden, name);
    EXPECT_EQ(bad, 0) << name << ": " << bad << " of " << golden.size() << " texts differ";
  }
}

}  // namespace
}  // namespace mlaserve::tok
