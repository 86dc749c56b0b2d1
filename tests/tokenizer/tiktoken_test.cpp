// tiktoken vocabularies (Kimi-K2 / Moonlight checkpoints: tiktoken.model + a tokenization_*.py class): ids against
// tiktoken itself (goldens from its WebAssembly build, tools/tokenizer/make_tiktoken_goldens.cjs) over the corpus
// and texts of their own, with o200k_base's ranks under Kimi's pattern and cl100k_base's under its own; the class
// file's reading, the pattern rewrite, the encode's cuts, the tools' sorted keys and the errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "test_data.h"
#include "tokenizer/jinja.h"
#include "tokenizer/pre_tokenizers.h"
#include "tokenizer/regex.h"
#include "tokenizer/tiktoken.h"
#include "tokenizer/tokenizer_config.h"

namespace mlaserve::tok {
namespace {

using testing::data_path;
using testing::read_jsonl;
namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  auto p = fs::temp_directory_path() /
           ("mlaserve_tiktoken_" + std::to_string(::getpid()) + "_" + tag + "_" + info->name());
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

void write(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The npm package's ranks ("! <first rank> <base64> <base64> ...") as a tiktoken.model file.
void write_ranks(const std::string& encoder, const fs::path& out) {
  const fs::path src = fs::path(MLASERVE_TIKTOKEN_NPM) / "encoders" / (encoder + ".json");
  ASSERT_TRUE(fs::exists(src)) << src << " missing: run scripts/setup.sh (npm install in tests/npm)";
  auto j = nlohmann::json::parse(slurp(src));
  const std::string& s = j["bpe_ranks"].get_ref<const std::string&>();
  std::string lines;
  long rank = 0;
  bool next_is_offset = false;
  for (size_t b = 0; b <= s.size();) {
    size_t e = s.find(' ', b);
    if (e == std::string::npos) e = s.size();
    std::string f = s.substr(b, e - b);
    b = e + 1;
    if (f.empty()) continue;
    if (next_is_offset) {
      rank = std::stol(f);
      next_is_offset = false;
    } else if (f == "!") {
      next_is_offset = true;
    } else {
      lines += f + " " + std::to_string(rank++) + "\n";
    }
  }
  write(out, lines);
}

// A checkpoint folder for fixture `name`: tiktoken.model, its class file and tokenizer_config.json.
fs::path fixture_dir(const std::string& name) {
  fs::path dir = fresh_dir(name);
  const fs::path src = fs::path(data_path("tiktoken")) / name;
  for (const auto& e : fs::directory_iterator(src)) {
    const std::string n = e.path().filename().string();
    if (n.ends_with(".py") || n == "tokenizer_config.json") fs::copy_file(e.path(), dir / n);
  }
  auto fx = nlohmann::json::parse(slurp(src / "fixture.json"));
  write_ranks(fx["ranks"].get<std::string>(), dir / "tiktoken.model");
  return dir;
}

std::vector<int32_t> ids_of(const nlohmann::ordered_json& row) { return row["ids"].get<std::vector<int32_t>>(); }

void check_goldens(const std::string& name) {
  fs::path dir = fixture_dir(name);
  auto tok = PretrainedTokenizer::load(dir.string());
  const auto texts = testing::corpus_texts();
  const auto golden = read_jsonl(data_path("tiktoken/" + name + "/ids.jsonl"));
  ASSERT_EQ(golden.size(), texts.size());
  int bad = 0;
  for (size_t i = 0; i < texts.size() && bad < 5; ++i) {
    auto ids = tok->encode(texts[i]);
    if (ids != ids_of(golden[i])) {
      ++bad;
      ADD_FAILURE() << name << " corpus line " << i + 1 << ": " << testing::show(texts[i]);
    } else {
      EXPECT_EQ(tok->decode(ids), texts[i]) << name << " corpus line " << i + 1;
    }
  }
  for (const auto& row : read_jsonl(data_path("tiktoken/" + name + "/extra.jsonl"))) {
    const std::string text = row["text"].get<std::string>();
    auto ids = tok->encode(text);
    EXPECT_EQ(ids, ids_of(row)) << name << " extra text of " << text.size() << " bytes: "
                                << testing::show(text.substr(0, 80));
    EXPECT_EQ(tok->decode(ids), text);
  }
  fs::remove_all(dir);
}

TEST(Tiktoken, KimiPatternOverO200kMatchesTiktoken) { check_goldens("kimi"); }

TEST(Tiktoken, Cl100kMatchesTiktoken) { check_goldens("cl100k"); }

TEST(Tiktoken, SpecialTokensAsKimisClassLaysThemOut) {
  fs::path dir = fixture_dir("kimi");
  auto tok = PretrainedTokenizer::load(dir.string());
  const int32_t base = 199998;  // o200k_base's number of ranks
  EXPECT_EQ(tok->bos_token_id(), base);
  EXPECT_EQ(tok->eos_token_id(), base + 1);
  EXPECT_EQ(tok->eos_token_ids(), std::vector<int32_t>{base + 1});
  EXPECT_EQ(tok->tokenizer().token_to_id("<|im_middle|>"), base + 17);
  EXPECT_EQ(tok->tokenizer().token_to_id("<|reserved_token_200003|>"), base + 5);  // unnamed: reserved
  EXPECT_EQ(tok->tokenizer().vocab_size(), static_cast<size_t>(base + 256));
  EXPECT_TRUE(tok->tokenizer().is_special(base + 2));
  // Decoding: specials as their text, or skipped; a token's bytes; tokens in GPT-2 byte characters.
  auto ids = tok->encode("[BOS]Hi<|im_end|>");
  ASSERT_EQ(ids.front(), base);
  EXPECT_EQ(tok->decode(ids), "[BOS]Hi<|im_end|>");
  EXPECT_EQ(tok->decode(ids, true), "Hi");
  auto space = tok->encode(" ");
  ASSERT_EQ(space.size(), 1u);
  EXPECT_EQ(tok->tokenizer().id_to_token(space[0]), "\xC4\xA0");  // "Ġ"
  EXPECT_EQ(tok->tokenizer().token_bytes(space[0]), " ");
  fs::remove_all(dir);
}

TEST(Tiktoken, ChatTemplateSeesToolsWithSortedKeysWhenTheClassSortsThem) {
  fs::path dir = fixture_dir("kimi");
  auto cfg = nlohmann::ordered_json::parse(slurp(dir / "tokenizer_config.json"));
  cfg["chat_template"] = "{{ tools | tojson }}|{% for m in messages %}{{ m | tojson }}{% endfor %}";
  write(dir / "tokenizer_config.json", cfg.dump());
  auto msgs = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "x"}])");
  auto extra = nlohmann::ordered_json::parse(
      R"({"tools": [{"type": "function", "function": {"name": "f", "description": "d",
          "parameters": {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}}}]})");
  auto kimi = PretrainedTokenizer::load(dir.string());
  std::string out = kimi->apply_chat_template(msgs, false, extra);
  EXPECT_EQ(out.substr(0, out.find('|')),
            R"([{"function": {"description": "d", "name": "f", "parameters": {"properties": {"a": {"type": )"
            R"("integer"}, "b": {"type": "string"}}, "type": "object"}}, "type": "function"}])");
  EXPECT_EQ(out.substr(out.find('|') + 1), R"({"role": "user", "content": "x"})");  // messages keep their order

  fs::path other = fixture_dir("cl100k");
  write(other / "tokenizer_config.json", cfg.dump());  // same template; this class does not sort
  auto plain = PretrainedTokenizer::load(other.string());
  std::string o = plain->apply_chat_template(msgs, false, extra);
  EXPECT_EQ(o.substr(0, o.find('|')),
            R"([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": )"
            R"("object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}}}])");
  fs::remove_all(dir);
  fs::remove_all(other);
}

// `mlaserve tokenize` (as `serve` does) takes a folder with tiktoken.model and no tokenizer.json.
TEST(Tiktoken, TokenizeCommandLoadsTheFolder) {
  fs::path dir = fixture_dir("kimi");
  const std::string text = "[BOS]汉字 and MixedCase text<|im_end|>";
  write(dir / "in.jsonl", nlohmann::json{{"text", text}}.dump() + "\n");
  const std::string cmd = std::string(MLASERVE_BINARY) + " tokenize --tokenizer-path '" + dir.string() + "' < '" +
                          (dir / "in.jsonl").string() + "' 2>/dev/null";
  int status = -1;
  const std::string out = testing::command_output(cmd, status);
  EXPECT_EQ(status, 0) << out;
  auto tok = PretrainedTokenizer::load(dir.string());
  EXPECT_EQ(nlohmann::json::parse(out)["ids"].get<std::vector<int32_t>>(), tok->encode(text)) << out;
  EXPECT_EQ(tok->encode(text).front(), 199998);
  fs::remove_all(dir);
}

TEST(Tiktoken, ReadsTheClassFile) {
  auto c = read_tiktoken_class(slurp(fs::path(data_path("tiktoken/kimi/tokenization_kimi.py"))), "kimi.py");
  EXPECT_EQ(c.pattern, kimi_tiktoken_class().pattern);
  EXPECT_EQ(c.num_special, 256);
  EXPECT_EQ(c.max_chars, 400000u);
  EXPECT_EQ(c.max_run, 25000u);
  EXPECT_TRUE(c.sort_tool_keys);

  // One literal; juxtaposed literals; plain strings with escapes; a range past the reserved count; no cuts.
  auto d = read_tiktoken_class(R"(
class T:
    num_reserved_special_tokens = 1_0
    pat_str = r"\p{L}+|" r'\s+'   # comment
    def __init__(self):
        ids = range(num_base_tokens, num_base_tokens + self.num_reserved_special_tokens + 2)
)",
                               "t.py");
  EXPECT_EQ(d.pattern, R"(\p{L}+|\s+)");
  EXPECT_EQ(d.num_special, 12);
  EXPECT_EQ(d.max_chars, 0u);
  EXPECT_FALSE(d.sort_tool_keys);
  auto e = read_tiktoken_class("pat_str = \"|\".join(['a\\\\b', \"\\\\p{N}\\n\", ])\n", "e.py");
  EXPECT_EQ(e.pattern, "a\\b|\\p{N}\n");
  auto f = read_tiktoken_class("pat_str = (\n  \"x\"\n  \"\\s\"\n)\n", "f.py");
  EXPECT_EQ(f.pattern, "x\\s");  // Python keeps an unknown escape as written
  EXPECT_TRUE(read_tiktoken_class("class T:\n    pass\n", "g.py").pattern.empty());
  // Sizes past 2^24 are refused naming the file and the name (a 20-digit count escaped as std::out_of_range).
  try {
    read_tiktoken_class("pat_str = r'a'\nnum_reserved_special_tokens = 99999999999999999999\n", "n.py");
    ADD_FAILURE() << "a 20-digit count was read";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("n.py: num_reserved_special_tokens is '99999999999999999999'"),
              std::string::npos)
        << err.what();
  }
  try {
    read_tiktoken_class("pat_str = \"|\".join([r\"a\", r\"b\n", "h.py");
    ADD_FAILURE() << "an unterminated literal was read";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("h.py"), std::string::npos) << err.what();
  }
}

TEST(Tiktoken, ClassIntersectionsBecomeLookaheads) {
  EXPECT_EQ(rust_classes_to_onig(R"([\p{L}&&[^\p{Han}]]+)", "p"), R"((?:(?=[\p{L}])[^\p{Han}])+)");
  EXPECT_EQ(rust_classes_to_onig(R"([a-z[0-9]]|[^\s])", "p"), R"([a-z0-9]|[^\s])");
  EXPECT_EQ(rust_classes_to_onig(R"(\[x&&y\]|[]a])", "p"), R"(\[x&&y\]|[]a])");
  // Matching: Han characters are letters but not in the intersection; a negated intersection takes the rest.
  auto matches = [](const std::string& pat, const std::string& text) {
    Regex re(rust_classes_to_onig(pat, "p"), "p");
    std::vector<std::string> out;
    re.for_each_match(text, [&](size_t b, size_t e) { out.push_back(text.substr(b, e - b)); });
    return out;
  };
  EXPECT_EQ(matches(R"([\p{L}&&[^\p{Han}]]+)", "ab汉字cd"), (std::vector<std::string>{"ab", "cd"}));
  EXPECT_EQ(matches(R"([^\p{L}&&[^\p{Han}]]+)", "ab汉字cd1"), (std::vector<std::string>{"汉字", "1"}));
  EXPECT_EQ(matches(R"([\p{L}&&[a-m]&&[^c]]+)", "abcdxyz"), (std::vector<std::string>{"ab", "d"}));
  EXPECT_THROW(rust_classes_to_onig("[abc", "p"), Error);
}

TEST(Tiktoken, LongRunsAndLongTextsAreCut) {
  auto cut = make_long_run_split(10, 4);
  auto pieces_of = [&](const std::string& text) {
    Pieces pieces{Piece{text, true}}, scratch;
    cut->apply(pieces, scratch);
    std::vector<std::string> out;
    for (const auto& p : pieces) out.push_back(p.text);
    return out;
  };
  EXPECT_EQ(pieces_of("aaaaaa"), (std::vector<std::string>{"aaaa", "aa"}));
  // A change of class starts a run without a cut; the fifth whitespace in a row is cut off.
  EXPECT_EQ(pieces_of("ab  \t\n x"), (std::vector<std::string>{"ab  \t\n", " x"}));
  EXPECT_EQ(pieces_of("abcd efgh"), (std::vector<std::string>{"abcd efgh"}));
  // Chunks of 10 code points (a chunk boundary also starts a run); multi-byte characters count once.
  EXPECT_EQ(pieces_of("a b c d e f g h"), (std::vector<std::string>{"a b c d e ", "f g h"}));
  EXPECT_EQ(pieces_of("é é é é é x"), (std::vector<std::string>{"é é é é é ", "x"}));
  EXPECT_EQ(pieces_of("\u3000\u3000\u3000\u3000\u3000"),  // ideographic spaces are whitespace to Python
            (std::vector<std::string>{"\u3000\u3000\u3000\u3000", "\u3000"}));
  EXPECT_EQ(pieces_of(""), std::vector<std::string>{});
}

TEST(Tiktoken, BadFilesAreNamed) {
  fs::path dir = fresh_dir("bad");
  auto load_error = [&]() -> std::string {
    try {
      PretrainedTokenizer::load(dir.string());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(load_error().find("no tokenizer.json (or tiktoken.model)"), std::string::npos) << load_error();
  std::string ranks;
  for (int b = 0; b < 256; ++b) {
    std::string one(1, static_cast<char>(b));
    static const char* d = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    uint32_t v = static_cast<unsigned char>(one[0]);
    ranks += std::string{d[v >> 2], d[(v & 3) << 4], '=', '='} + " " + std::to_string(b) + "\n";
  }
  write(dir / "tiktoken.model", ranks + "not*base64 256\n");
  EXPECT_NE(load_error().find("tiktoken.model:257: 'not*base64' is not a base64 token"), std::string::npos)
      << load_error();
  write(dir / "tiktoken.model", ranks + "YWI= 5\n");
  EXPECT_NE(load_error().find("tiktoken.model:257: rank 5 is given twice"), std::string::npos) << load_error();
  write(dir / "tiktoken.model", ranks.substr(ranks.find('\n') + 1));  // byte 0 has no rank
  EXPECT_NE(load_error().find("byte 0x00 has no rank"), std::string::npos) << load_error();
  // A valid file without a class file: Kimi's class is assumed; "ab" is a token.
  write(dir / "tiktoken.model", ranks + "YWI= 256\n");
  auto tok = PretrainedTokenizer::load(dir.string());
  EXPECT_EQ(tok->encode("ab a"), (std::vector<int32_t>{256, 32, 97}));
  EXPECT_EQ(tok->tokenizer().token_to_id("<|reserved_token_257|>"), 257);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mlaserve::tok
