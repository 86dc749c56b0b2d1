// Unit tests of the tokenizer's building blocks: UTF-8 handling, regex translation, errors for bad input and bad
// files, tokenizer_config.json / generation_config.json loading and named chat templates.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "test_data.h"
#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_config.h"
#include "tokenizer/unicode.h"

namespace mlaserve::tok {
namespace {

std::string err(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Utf8, LossyDecodingReplacesMaximalSubparts) {
  EXPECT_EQ(utf8_lossy("abc"), "abc");
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");             // truncated 4-byte: one U+FFFD
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98" "a"), "\xEF\xBF\xBD" "a");
  EXPECT_EQ(utf8_lossy("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");     // overlong: two
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate: three
  EXPECT_EQ(utf8_lossy("\xE2\x82"), "\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("\xFF" "b"), "\xEF\xBF\xBD" "b");
}

TEST(Utf8, CompletePrefixAndValidation) {
  EXPECT_EQ(complete_utf8_prefix("ab\xE4\xB8"), 2u);
  EXPECT_EQ(complete_utf8_prefix("ab\xE4\xB8\xAD"), 5u);
  EXPECT_EQ(complete_utf8_prefix(""), 0u);
  EXPECT_EQ(find_invalid_utf8("hello 世界"), std::string::npos);
  EXPECT_EQ(find_invalid_utf8("hello\xFFworld"), 5u);
  EXPECT_NE(err([] { check_utf8("ab\xC3", "input"); }).find("invalid UTF-8 in input at byte 2"), std::string::npos);
}

TEST(Regex, OnigurumaCompatibility) {
  // \s includes U+0085 (NEL) as in Oniguruma; \w includes combining marks.
  Regex ws("\\s+", "test");
  size_t s, e;
  ASSERT_TRUE(ws.find("a\xC2\x85" "b", 0, s, e));
  EXPECT_EQ(s, 1u);
  EXPECT_EQ(e, 3u);
  Regex word("\\w+", "test");
  ASSERT_TRUE(word.find("e\xCC\x81!", 0, s, e));  // e + U+0301
  EXPECT_EQ(e, 3u);
  EXPECT_EQ(onig_to_pcre2("[^\\s\\p{L}]"), "[^\\t\\n\\x{0B}\\f\\r\\x{85}\\p{Z}\\p{L}]");
  // Empty matches right after a match are skipped (Oniguruma's iterator).
  Regex star("a*", "test");
  std::vector<std::pair<size_t, size_t>> m;
  star.for_each_match("baab", [&](size_t b, size_t e2) { m.emplace_back(b, e2); });
  EXPECT_EQ(m, (std::vector<std::pair<size_t, size_t>>{{0, 0}, {1, 3}, {4, 4}}));
  EXPECT_NE(err([] { Regex r("(unclosed", "tokenizer.json pre_tokenizer"); }).find("tokenizer.json pre_tokenizer: bad regex"),
            std::string::npos);
}

TEST(Tokenizer, InvalidUtf8IsAClearError) {
  auto tok = Tokenizer::from_file(testing::deepseek_dir() + "/tokenizer.json");
  EXPECT_NE(err([&] { tok->encode("ok \xE4\xB8 broken"); }).find("invalid UTF-8 in the text to encode at byte 3"),
            std::string::npos);
  EXPECT_TRUE(tok->encode("").empty());
}

TEST(Tokenizer, BadFilesNameTheField) {
  auto from = [](const char* js) { return err([&] { Tokenizer::from_json(nlohmann::json::parse(js), "x.json"); }); };
  std::string model = R"("model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]})";
  EXPECT_EQ(from(("{" + model + "}").c_str()), "(no error)");
  EXPECT_NE(from(("{" + model + R"(, "normalizer": {"type": "Precompiled"}})").c_str())
                .find("x.json normalizer: unsupported normalizer type 'Precompiled'"),
            std::string::npos);
  EXPECT_NE(from(("{" + model + R"(, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Odd"}})").c_str())
                .find("behavior: unknown split behavior 'Odd'"),
            std::string::npos);
  EXPECT_NE(from(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a c"]}})").find("merges[0]: token 'c'"),
            std::string::npos);
  EXPECT_NE(from(R"({"model": {"type": "Unigram", "vocab": []}})").find("unsupported model type 'Unigram'"),
            std::string::npos);
}

TEST(Tokenizer, AddedTokenOptions) {
  // lstrip / rstrip / single_word / normalized on a tiny byte-level-free vocabulary.
  nlohmann::json j = nlohmann::json::parse(R"({
    "normalizer": {"type": "Lowercase"},
    "pre_tokenizer": {"type": "WhitespaceSplit"},
    "model": {"type": "BPE", "unk_token": "?", "vocab": {"?": 0, "a": 1, "b": 2, "ab": 3, "<m>": 4, "x": 5}, "merges": [["a", "b"]]},
    "added_tokens": [
      {"id": 4, "content": "<m>", "lstrip": true, "rstrip": true, "single_word": false, "normalized": false, "special": true},
      {"id": 6, "content": "ba", "single_word": true, "lstrip": false, "rstrip": false, "normalized": true, "special": false}
    ]})");
  auto tok = Tokenizer::from_json(j, "inline");
  EXPECT_EQ(tok->encode("a  <m>  b"), (std::vector<int32_t>{1, 4, 2}));
  EXPECT_EQ(tok->encode("BA xba ba"), (std::vector<int32_t>{6, 5, 2, 1, 6}));  // normalized, single_word
  EXPECT_EQ(tok->encode("ab"), (std::vector<int32_t>{3}));  // merge
  std::vector<int32_t> dec{1, 4, 2};
  EXPECT_EQ(tok->decode(dec, true), "a b");
  EXPECT_TRUE(tok->is_special(4));
  EXPECT_FALSE(tok->is_special(6));
}

class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() / ("mlaserve_tok_" + std::to_string(::getpid()) + "_" +
                                                      std::to_string(counter_++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string path() const { return path_.string(); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path_ / name) << text; }

 private:
  std::filesystem::path path_;
  static inline int counter_ = 0;
};

TEST(PretrainedTokenizer, DeepSeekConfig) {
  auto p = PretrainedTokenizer::load(testing::deepseek_dir());
  EXPECT_EQ(p->bos_token(), "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(p->bos_token_id(), 0);
  EXPECT_EQ(p->eos_token_id(), 1);
  EXPECT_TRUE(p->add_bos_token());
  EXPECT_FALSE(p->add_eos_token());
  EXPECT_EQ(p->eos_token_ids(), std::vector<int32_t>{1});
  // add_special_tokens prepends bos (LlamaTokenizerFast); tokenizer.json's own ByteLevel post-processor adds none.
  std::vector<int32_t> plain = p->encode("Hello world");
  std::vector<int32_t> with = p->encode("Hello world", true);
  ASSERT_EQ(with.size(), plain.size() + 1);
  EXPECT_EQ(with[0], 0);
  EXPECT_EQ(std::vector<int32_t>(with.begin() + 1, with.end()), plain);
  auto raw = Tokenizer::from_file(testing::deepseek_dir() + "/tokenizer.json");
  EXPECT_EQ(raw->encode("Hello world", true), plain);
}

TEST(PretrainedTokenizer, NamedTemplatesGenerationConfigAndAddedTokenObjects) {
  TempDir d;
  std::filesystem::copy_file(testing::deepseek_dir() + "/tokenizer.json", d.path() + "/tokenizer.json");
  d.write("tokenizer_config.json", R"({
    "bos_token": {"__type": "AddedToken", "content": "<｜begin▁of▁sentence｜>", "lstrip": false},
    "eos_token": "<｜end▁of▁sentence｜>",
    "add_bos_token": false, "add_eos_token": true,
    "chat_template": [
      {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"},
      {"name": "tool_use", "template": "TOOLS {{ tools | length if tools else 0 }} {{ messages | length }}"}
    ]})");
  d.write("generation_config.json", R"({"bos_token_id": 0, "eos_token_id": [1, 128804]})");
  auto p = PretrainedTokenizer::load(d.path());
  EXPECT_EQ(p->eos_token_ids(), (std::vector<int32_t>{1, 128804}));
  std::vector<int32_t> ids = p->encode("Hi", true);
  EXPECT_NE(ids.front(), 0);
  EXPECT_EQ(ids.back(), 1);
  nlohmann::ordered_json msgs = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "Hi"}])");
  EXPECT_EQ(p->apply_chat_template(msgs, true), "<｜begin▁of▁sentence｜>[user]Hi");
  nlohmann::ordered_json vars{{"tools", nlohmann::ordered_json::array({1, 2})}};
  EXPECT_EQ(p->apply_chat_template(msgs, true, vars), "TOOLS 2 1");
  EXPECT_EQ(p->apply_chat_template(msgs, true, nlohmann::ordered_json::object(), "tool_use"), "TOOLS 0 1");
  EXPECT_NE(err([&] { p->apply_chat_template(msgs, true, nlohmann::ordered_json::object(), "nope"); })
                .find("no chat template named 'nope' (have: default, tool_use)"),
            std::string::npos);
  // chat_template.jinja overrides the default template.
  d.write("chat_template.jinja", "JINJA FILE {{ messages[0].content }}\n");
  EXPECT_EQ(PretrainedTokenizer::load(d.path())->apply_chat_template(msgs, false), "JINJA FILE Hi");
  // A broken template is reported with its file and position at load time.
  d.write("chat_template.jinja", "ok\n{% for %}");
  EXPECT_NE(err([&] { PretrainedTokenizer::load(d.path()); }).find("chat_template.jinja line 2 column 8"),
            std::string::npos)
      << err([&] { PretrainedTokenizer::load(d.path()); });
}

}  // namespace
}  // namespace mlaserve::tok
