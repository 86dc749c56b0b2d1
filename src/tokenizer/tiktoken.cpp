#include "tokenizer/tiktoken.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pre_tokenizers.h"
#include "tokenizer/regex.h"

namespace mlaserve::tok {
namespace {

// Standard base64 (padding optional); false for any other character.
bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t pad = 0;
  for (char c : in) {
    int v;
    if (c >= 'A' && c <= 'Z') {
      v = c - 'A';
    } else if (c >= 'a' && c <= 'z') {
      v = c - 'a' + 26;
    } else if (c >= '0' && c <= '9') {
      v = c - '0' + 52;
    } else if (c == '+') {
      v = 62;
    } else if (c == '/') {
      v = 63;
    } else if (c == '=') {
      ++pad;
      continue;
    } else {
      return false;
    }
    if (pad) return false;  // data after padding
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return pad <= 2;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MLA_CHECK(f.good(), "cannot open '{}'", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Python source scanning: the string literal(s) after `pat_str =`.
class PySource {
 public:
  PySource(const std::string& s, const std::string& where) : s_(s), where_(where) {}

  void skip_space() {
    while (i_ < s_.size()) {
      char c = s_[i_];
      if (c == '#') {
        while (i_ < s_.size() && s_[i_] != '\n') ++i_;
      } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\\') {
        ++i_;
      } else {
        break;
      }
    }
  }
  bool eat(std::string_view lit) {
    skip_space();
    if (s_.compare(i_, lit.size(), lit) != 0) return false;
    i_ += lit.size();
    return true;
  }
  bool at_literal() {
    skip_space();
    size_t k = i_;
    while (k < s_.size() && k < i_ + 2 && std::string_view("rRbBuU").find(s_[k]) != std::string_view::npos) ++k;
    return k < s_.size() && (s_[k] == '"' || s_[k] == '\'');
  }
  // A string literal: r / b / u prefixes, single or triple quotes; escapes processed unless raw.
  std::string literal() {
    skip_space();
    bool raw = false;
    while (i_ < s_.size() && std::string_view("rRbBuU").find(s_[i_]) != std::string_view::npos) {
      raw = raw || s_[i_] == 'r' || s_[i_] == 'R';
      ++i_;
    }
    MLA_CHECK(i_ < s_.size() && (s_[i_] == '"' || s_[i_] == '\''), "{}: pat_str: expected a string literal",
              where_);
    const char q = s_[i_];
    const bool triple = s_.compare(i_, 3, std::string(3, q)) == 0;
    i_ += triple ? 3 : 1;
    std::string out;
    while (true) {
      MLA_CHECK(i_ < s_.size(), "{}: pat_str: unterminated string literal", where_);
      char c = s_[i_];
      if (c == q && (!triple || s_.compare(i_, 3, std::string(3, q)) == 0)) {
        i_ += triple ? 3 : 1;
        return out;
      }
      MLA_CHECK(triple || c != '\n', "{}: pat_str: unterminated string literal", where_);
      if (c == '\\' && i_ + 1 < s_.size()) {
        char e = s_[i_ + 1];
        i_ += 2;
        if (raw) {
          out += c;
          out += e;
          continue;
        }
        switch (e) {
          case '\\': out += '\\'; break;
          case '\'': out += '\''; break;
          case '"': out += '"'; break;
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case '\n': break;
          default:  // Python keeps unknown escapes (\p, \s, ...) as written
            out += '\\';
            out += e;
        }
        continue;
      }
      out += c;
      ++i_;
    }
  }
  // Juxtaposed literals concatenate, as in Python.
  std::string literals() {
    std::string out = literal();
    while (at_literal()) out += literal();
    return out;
  }
  bool seek(const std::regex& re) {
    std::smatch m;
    if (!std::regex_search(s_, m, re)) return false;
    i_ = static_cast<size_t>(m.position(0) + m.length(0));
    return true;
  }

 private:
  const std::string& s_;
  std::string where_;
  size_t i_ = 0;
};

// A Python integer literal (digits, '_' between them) of at most 2^24: sizes of a vocabulary (what the tokenizer
// allocates by), refused naming `what` past that.
int64_t py_int(const std::string& s, const std::string& what) {
  std::string digits;
  for (char c : s)
    if (c != '_') digits += c;
  MLA_CHECK(!digits.empty() && digits.size() <= 8 && std::stoll(digits) <= (int64_t{1} << 24),
            "{} is '{}', expected a whole number up to {}", what, s, int64_t{1} << 24);
  return std::stoll(digits);
}

// Kimi-K2's / Moonlight's TikTokenTokenizer.pat_str.
constexpr const char* kKimiPattern =
    R"([\p{Han}]+|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*)"
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

}  // namespace

std::vector<std::string> read_tiktoken_ranks(const std::string& path, size_t* count) {
  const std::string text = read_file(path);
  std::vector<std::string> by_rank;
  size_t n = 0, line_no = 0;
  std::string bytes;
  for (size_t b = 0; b < text.size();) {
    size_t e = text.find('\n', b);
    if (e == std::string::npos) e = text.size();
    std::string_view line(text.data() + b, e - b);
    b = e + 1;
    ++line_no;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.remove_suffix(1);
    if (line.empty()) continue;
    size_t sp = line.find_first_of(" \t");
    MLA_CHECK(sp != std::string_view::npos, "{}:{}: expected \"<base64 token> <rank>\"", path, line_no);
    std::string_view tok = line.substr(0, sp), rank_s = line.substr(line.find_first_not_of(" \t", sp));
    MLA_CHECK(base64_decode(tok, bytes) && !bytes.empty(), "{}:{}: '{}' is not a base64 token", path, line_no, tok);
    int64_t rank = -1;
    try {
      size_t used = 0;
      rank = std::stoll(std::string(rank_s), &used);
      if (used != rank_s.size()) rank = -1;
    } catch (const std::exception&) {
    }
    MLA_CHECK(rank >= 0 && rank <= (int64_t{1} << 24), "{}:{}: rank '{}' is not a whole number up to 2^24", path,
              line_no, rank_s);
    if (static_cast<size_t>(rank) >= by_rank.size()) by_rank.resize(rank + 1);
    MLA_CHECK(by_rank[rank].empty(), "{}:{}: rank {} is given twice", path, line_no, rank);
    by_rank[rank] = bytes;
    ++n;
  }
  MLA_CHECK(n > 0, "{}: no ranks in the file", path);
  if (count) *count = n;
  return by_rank;
}

std::unique_ptr<Tokenizer> Tokenizer::from_tiktoken(const std::vector<std::string>& ranks, const std::string& where,
                                                    const std::string& pattern,
                                                    const std::vector<AddedToken>& specials, size_t max_chars,
                                                    size_t max_run) {
  auto model = BpeModel::from_byte_ranks(ranks, where);
  nlohmann::json j;
  j["normalizer"] = nullptr;
  j["post_processor"] = nullptr;
  // tiktoken keeps the pattern's matches only (Removed with invert: the gaps are the delimiters).
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern", {{"Regex", rust_classes_to_onig(pattern, where + " pattern")}}},
         {"behavior", "Removed"},
         {"invert", true}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  j["decoder"] = {{"type", "ByteLevel"}};
  nlohmann::json added = nlohmann::json::array();
  for (const AddedToken& a : specials)
    added.push_back({{"id", a.id},
                     {"content", a.content},
                     {"single_word", a.single_word},
                     {"lstrip", a.lstrip},
                     {"rstrip", a.rstrip},
                     {"normalized", a.normalized},
                     {"special", a.special}});
  j["added_tokens"] = std::move(added);
  auto t = assemble(j, where, std::move(model), true);
  if (max_chars > 0) {
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    parts.push_back(make_long_run_split(max_chars, max_run > 0 ? max_run : max_chars));
    parts.push_back(std::move(t->pre_tokenizer_));
    t->pre_tokenizer_ = make_pre_tokenizer_sequence(std::move(parts));
  }
  return t;
}

TiktokenClassInfo kimi_tiktoken_class() {
  TiktokenClassInfo c;
  c.pattern = kKimiPattern;
  c.num_special = 256;
  c.max_chars = 400000;
  c.max_run = 25000;
  c.sort_tool_keys = true;
  return c;
}

TiktokenClassInfo read_tiktoken_class(const std::string& src, const std::string& where) {
  TiktokenClassInfo c;
  PySource py(src, where);
  if (py.seek(std::regex(R"(\bpat_str\s*(:\s*str\s*)?=)"))) {
    if (py.eat("\"|\".join(") || py.eat("'|'.join(")) {
      MLA_CHECK(py.eat("["), "{}: pat_str: expected a list of string literals in \"|\".join(...)", where);
      std::string joined;
      bool first = true;
      while (!py.eat("]")) {
        if (!first) MLA_CHECK(py.eat(","), "{}: pat_str: expected ',' between the list's literals", where);
        if (py.eat("]")) break;  // trailing comma
        joined += (first ? "" : "|") + py.literals();
        first = false;
      }
      c.pattern = joined;
    } else {
      bool paren = py.eat("(");
      c.pattern = py.literals();
      if (paren) MLA_CHECK(py.eat(")"), "{}: pat_str: expected ')'", where);
    }
    MLA_CHECK(!c.pattern.empty(), "{}: pat_str is empty", where);
  }
  std::smatch m;
  if (std::regex_search(src, m, std::regex(R"(\bnum_reserved_special_tokens\s*(:\s*int\s*)?=\s*([0-9_]+))")))
    c.num_special = py_int(m[2].str(), where + ": num_reserved_special_tokens");
  // The class's range of special ids may run past the reserved count (range(n, n + self.num_reserved... + 2)).
  static const std::regex extra(R"(num_base_tokens\s*\+\s*self\.num_reserved_special_tokens\s*\+\s*([0-9_]+))");
  if (std::regex_search(src, m, extra))
    c.num_special += py_int(m[1].str(), where + ": the special ids' range");
  std::smatch a, b;
  if (std::regex_search(src, a, std::regex(R"(\bTIKTOKEN_MAX_ENCODE_CHARS\s*=\s*([0-9_]+))")) &&
      std::regex_search(src, b, std::regex(R"(\bMAX_NO_WHITESPACES_CHARS\s*=\s*([0-9_]+))"))) {
    c.max_chars = static_cast<size_t>(py_int(a[1].str(), where + ": TIKTOKEN_MAX_ENCODE_CHARS"));
    c.max_run = static_cast<size_t>(py_int(b[1].str(), where + ": MAX_NO_WHITESPACES_CHARS"));
  }
  c.sort_tool_keys = src.find("deep_sort_dict(tools)") != std::string::npos;
  return c;
}

TiktokenTokenizer load_tiktoken_dir(const std::string& dir, const nlohmann::ordered_json& cfg,
                                    const std::string& cfg_path) {
  namespace fs = std::filesystem;
  const std::string model_path = (fs::path(dir) / "tiktoken.model").string();
  MLA_CHECK(fs::exists(model_path), "--tokenizer-path '{}': no tokenizer.json or tiktoken.model there", dir);

  size_t base = 0;
  std::vector<std::string> ranks = read_tiktoken_ranks(model_path, &base);

  // The class file: auto_map's AutoTokenizer module, else any tokenization_*.py that has a pat_str.
  std::vector<fs::path> candidates;
  if (auto am = cfg.find("auto_map"); am != cfg.end() && am->is_object() && am->contains("AutoTokenizer")) {
    const auto& at = (*am)["AutoTokenizer"];
    const auto& name = at.is_array() && !at.empty() ? at[0] : at;
    if (name.is_string()) {
      std::string ref = name.get<std::string>();  // "module.Class" or "repo--module.Class"
      if (size_t dd = ref.find("--"); dd != std::string::npos) ref = ref.substr(dd + 2);
      if (size_t dot = ref.rfind('.'); dot != std::string::npos) ref = ref.substr(0, dot);
      candidates.push_back(fs::path(dir) / (ref + ".py"));
    }
  }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("tokenization", 0) == 0 && e.path().extension() == ".py") candidates.push_back(e.path());
  }
  TiktokenClassInfo info;
  std::string class_file;
  for (const auto& p : candidates) {
    if (!fs::exists(p)) continue;
    TiktokenClassInfo c = read_tiktoken_class(read_file(p.string()), p.string());
    if (c.pattern.empty()) continue;
    info = c;
    class_file = p.string();
    break;
  }
  if (class_file.empty()) {
    MLA_LOG_WARN("{}: no tokenization_*.py with a pat_str next to tiktoken.model; using Kimi's TikTokenTokenizer "
                 "(its pattern, 256 special tokens)",
                 dir);
    info = kimi_tiktoken_class();
  }
  MLA_CHECK(info.num_special >= 0 && info.num_special < (1 << 20), "{}: {} special tokens", class_file,
            info.num_special);

  // Special ids: [len(ranks), len(ranks) + num_special), named by added_tokens_decoder, else <|reserved_token_N|>;
  // added_tokens_decoder's other ids past the ranks are added tokens too.
  std::map<int64_t, AddedToken> specials;
  for (int64_t id = static_cast<int64_t>(base); id < static_cast<int64_t>(base) + info.num_special; ++id) {
    AddedToken a;
    a.id = static_cast<int32_t>(id);
    a.content = fmt::format("<|reserved_token_{}|>", id);
    a.special = true;
    a.normalized = false;
    specials[id] = a;
  }
  if (auto atd = cfg.find("added_tokens_decoder"); atd != cfg.end() && !atd->is_null()) {
    MLA_CHECK(atd->is_object(), "{}: added_tokens_decoder must be an object of id -> token", cfg_path);
    for (auto it = atd->begin(); it != atd->end(); ++it) {
      int64_t id = -1;
      try {
        size_t used = 0;
        id = std::stoll(it.key(), &used);
        if (used != it.key().size()) id = -1;
      } catch (const std::exception&) {
      }
      MLA_CHECK(id >= 0 && id < INT32_MAX, "{}: added_tokens_decoder key '{}' is not a token id", cfg_path, it.key());
      const auto& v = it.value();
      const std::string w = fmt::format("{}: added_tokens_decoder['{}']", cfg_path, it.key());
      MLA_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(),
                "{}: expected an object with a string 'content'", w);
      if (id < static_cast<int64_t>(ranks.size()) && !ranks[id].empty()) {
        MLA_LOG_WARN("{}: id {} is a token of tiktoken.model; ignored", w, id);
        continue;
      }
      auto flag = [&](const char* k, bool dflt) {
        return v.contains(k) && v[k].is_boolean() ? v[k].get<bool>() : dflt;
      };
      AddedToken a;
      a.id = static_cast<int32_t>(id);
      a.content = v["content"].get<std::string>();
      a.special = flag("special", true);
      a.normalized = flag("normalized", false);
      a.lstrip = flag("lstrip", false);
      a.rstrip = flag("rstrip", false);
      a.single_word = flag("single_word", false);
      specials[id] = a;
    }
  }
  std::vector<AddedToken> list;
  for (auto& [id, a] : specials) list.push_back(std::move(a));
  TiktokenTokenizer out;
  out.tokenizer = Tokenizer::from_tiktoken(ranks, model_path, info.pattern, list, info.max_chars, info.max_run);
  out.sort_tool_keys = info.sort_tool_keys;
  out.pattern = info.pattern;
  MLA_LOG_INFO("{}: tiktoken vocabulary of {} ranks and {} special tokens (class {})", model_path, base, list.size(),
               class_file.empty() ? std::string("Kimi's, assumed") : class_file);
  return out;
}

}  // namespace mlaserve::tok
