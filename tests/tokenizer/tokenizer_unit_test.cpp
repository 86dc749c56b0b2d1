// Unit tests of the tokenizer's building blocks: UTF-8 handling, regex translation, errors for bad input and bad
// files, tokenizer_config.json / generation_config.json loading and named chat templates.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "json_mutation.h"
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

// tokenizer.json files with random fields replaced by values of other types and ranges, removed, or added (a small
// BPE tokenizer with every kind of part): each is either loaded, and then encodes and decodes without a crash (errors
// of its own allowed), or refused with an Error naming the file; never another exception.
// A small BPE tokenizer.json with every kind of part (normalizers, pre-tokenizers, decoders, a template, added
// tokens): ids 0-7 plain tokens, 8 <s>, 9 </s>, 10 "ba" (added).
nlohmann::json small_tokenizer_json() {
  return nlohmann::json::parse(R"({
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Replace",
        "pattern": {"String": "  "}, "content": " "}, {"type": "Prepend", "prepend": "_"}, {"type": "Strip",
        "strip_left": true, "strip_right": false}]},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}| ?\\p{L}+|\\s+"}, "behavior": "Isolated",
         "invert": false},
        {"type": "Digits", "individual_digits": true},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
    "model": {"type": "BPE", "unk_token": null, "byte_fallback": false, "fuse_unk": false,
              "ignore_merges": false, "dropout": null, "continuing_subword_prefix": null,
              "end_of_word_suffix": null,
              "vocab": {"_": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4, "1": 5, "2": 6, "Ġa": 7, "<s>": 8, "</s>": 9},
              "merges": ["a b", ["Ġ", "a"]]},
    "decoder": {"type": "Sequence", "decoders": [{"type": "ByteLevel"}, {"type": "Replace",
        "pattern": {"String": "_"}, "content": " "}, {"type": "Fuse"}, {"type": "Strip", "content": " ",
        "start": 1, "stop": 0}]},
    "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}}], "pair": [],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [8], "tokens": ["<s>"]}}},
    "added_tokens": [
      {"id": 8, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false,
       "special": true},
      {"id": 9, "content": "</s>", "single_word": false, "lstrip": true, "rstrip": false, "normalized": false,
       "special": true},
      {"id": 10, "content": "ba", "single_word": true, "lstrip": false, "rstrip": false, "normalized": true,
       "special": false}]})");;
}

TEST(Tokenizer, MutatedFilesAreLoadedOrRefusedClearly) {
  const nlohmann::json base = small_tokenizer_json();
  const std::vector<int32_t> unedited = Tokenizer::from_json(base, "t.json")->encode("ab 12 <s>ba", true);
  ASSERT_GT(unedited.size(), 2u);
  EXPECT_EQ(unedited.front(), 8);  // the template's <s>
  const std::vector<nlohmann::json> values = test::edge_values(
      {"BPE", "Sequence", "Split", "ByteLevel", "Replace", "Isolated", "Removed", "MergedWithNext", "(", "[a-",
       "\\p{Q}", nlohmann::json{{"Regex", "("}}, nlohmann::json{{"String", ""}}, nlohmann::json{{"Regex", ""}},
       nlohmann::json{{"type", "Sequence"}}, nlohmann::json::array({"a", "c"}), "a", "a b", "x y z"});
  std::mt19937_64 rng(20261207);
  int64_t loaded = 0, refused = 0;
  for (int it = 0; it < 3000; ++it) {
    nlohmann::json j = base;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) test::mutate_json(j, rng, values);
    std::unique_ptr<Tokenizer> tok;
    try {
      tok = Tokenizer::from_json(j, "t.json");
      ++loaded;
    } catch (const Error& e) {
      ++refused;
      ASSERT_NE(std::string(e.what()).find("t.json"), std::string::npos) << e.what() << "\n" << j.dump();
      continue;
    } catch (const std::exception& e) {
      FAIL() << "not a clear error: " << e.what() << "\n" << j.dump();
    }
    for (const char* text : {"", "ab ab  12 3", "<s>ba </s>ab", "a\xC3\xA9 \xE4\xB8\x96 \xF0\x9F\x98\x80"}) {
      try {
        const std::vector<int32_t> ids = tok->encode(text, true);
        (void)tok->decode(ids, false);
        (void)tok->decode(ids, true);
        const std::vector<int32_t> odd = {0, 3, 9, 10, 11, 1 << 20, -1};
        (void)tok->decode(odd, false);
      } catch (const Error&) {
      } catch (const std::exception& e) {
        FAIL() << "not a clear error: " << e.what() << " encoding '" << text << "' with\n" << j.dump();
      }
    }
  }
  EXPECT_GT(loaded, 100);
  EXPECT_GT(refused, 100);
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

// tokenizer_config.json and generation_config.json with random edits (as the tokenizer.json test above): the
// tokenizer is either loaded, and then encodes with its special tokens and renders its chat templates without a
// crash (template errors allowed), or refused with an Error naming the file; never another exception.
TEST(PretrainedTokenizer, MutatedConfigsAreLoadedOrRefusedClearly) {
  nlohmann::json config = nlohmann::json::parse(R"({
    "add_bos_token": true, "add_eos_token": false, "clean_up_tokenization_spaces": false, "legacy": true,
    "model_max_length": 4096, "pad_token": null, "eos_token": "</s>",
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false, "normalized": true, "rstrip": false,
                  "single_word": false},
    "added_tokens_decoder": {"8": {"content": "<s>", "lstrip": false, "normalized": false, "rstrip": false,
                                   "single_word": false, "special": true}},
    "chat_template": [
      {"name": "default", "template": ""},
      {"name": "tool_use", "template": "{{ tools | length if tools else 0 }} {{ messages | length }}"}]})");
  config["chat_template"][0]["template"] =
      "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
      "{% if add_generation_prompt %}assistant:{% endif %}";
  const nlohmann::json generation = nlohmann::json::parse(R"({"bos_token_id": 8, "eos_token_id": [9, 8],
                                                              "temperature": 0.6, "top_p": 0.95})");
  TempDir d;
  d.write("tokenizer.json", small_tokenizer_json().dump());
  const std::vector<nlohmann::json> values = test::edge_values(
      {"<s>", "</s>", "ba", "{{ bos_token }}", "{% for %}", "{{ messages[0].content | upper }}",
       nlohmann::json{{"name", "default"}}, nlohmann::json{{"template", "x"}}, nlohmann::json{{"content", 5}},
       nlohmann::json::array({nlohmann::json{{"name", 1}, {"template", 2}}})});
  const nlohmann::ordered_json msgs =
      nlohmann::ordered_json::parse(R"([{"role": "user", "content": "ab"}, {"role": "assistant", "content": "12"}])");
  d.write("tokenizer_config.json", config.dump());
  d.write("generation_config.json", generation.dump());
  {
    const auto unedited = PretrainedTokenizer::load(d.path());
    EXPECT_EQ(unedited->apply_chat_template(msgs, true), "<s>user: ab\nassistant: 12\nassistant:");
    EXPECT_EQ(unedited->eos_token_ids(), (std::vector<int32_t>{9, 8}));
  }
  // An id past 32 bits is refused (it was truncated: 4294967297 became token 1).
  d.write("generation_config.json", R"({"eos_token_id": [9, 4294967297]})");
  EXPECT_NE(err([&] { PretrainedTokenizer::load(d.path()); }).find("generation_config.json: eos_token_id entries must "
                                                                   "be token ids (32-bit integers), got 4294967297"),
            std::string::npos);
  std::mt19937_64 rng(20261207);
  int64_t loaded = 0, refused = 0;
  for (int it = 0; it < 1000; ++it) {
    nlohmann::json c = config, g = generation;
    const bool edit_config = rng() % 3 != 0;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) test::mutate_json(edit_config ? c : g, rng, values);
    d.write("tokenizer_config.json", c.dump());
    d.write("generation_config.json", g.dump());
    const char* file = edit_config ? "tokenizer_config.json" : "generation_config.json";
    std::unique_ptr<PretrainedTokenizer> p;
    try {
      p = PretrainedTokenizer::load(d.path());
      ++loaded;
    } catch (const Error& e) {
      ++refused;
      ASSERT_NE(std::string(e.what()).find(file), std::string::npos) << e.what() << "\n" << c.dump() << g.dump();
      continue;
    } catch (const std::exception& e) {
      FAIL() << "not a clear error: " << e.what() << "\n" << c.dump() << "\n" << g.dump();
    }
    try {
      (void)p->encode("ab <s>", true);
      (void)p->eos_token_ids();
      for (const std::string& name : p->chat_template_names())
        (void)p->apply_chat_template(msgs, true, nlohmann::ordered_json::object(), name);
    } catch (const Error&) {
    } catch (const std::exception& e) {
      FAIL() << "not a clear error: " << e.what() << "\n" << c.dump() << "\n" << g.dump();
    }
  }
  EXPECT_GT(loaded, 100);
  EXPECT_GT(refused, 50);
}

}  // namespace
}  // namespace mlaserve::tok
