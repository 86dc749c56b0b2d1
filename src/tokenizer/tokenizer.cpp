#include "tokenizer/tokenizer.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "tokenizer/bpe.h"
#include "tokenizer/decoders.h"
#include "tokenizer/json_util.h"
#include "tokenizer/normalizers.h"
#include "tokenizer/pre_tokenizers.h"
#include "tokenizer/unicode.h"

namespace mlaserve::tok {

// ------------------------------------------------------------------------------------------------ added tokens
// Leftmost-longest, non-overlapping matching of the added tokens' contents (the Aho-Corasick "LeftmostLongest"
// semantics HF uses), with a byte trie: candidate starts are filtered by their first byte.
class Tokenizer::Matcher {
 public:
  struct Match {
    size_t start, end;
    size_t token;  // index into the tokenizer's added_
  };
  void add(std::string_view pattern, size_t token) {
    if (pattern.empty()) return;
    if (nodes_.empty()) nodes_.emplace_back();
    int32_t n = 0;
    for (unsigned char c : pattern) {
      int32_t next = child(n, c);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_[n].kids.push_back({c, next});
        nodes_.emplace_back();
      }
      n = next;
    }
    if (nodes_[n].token < 0) nodes_[n].token = static_cast<int64_t>(token);
    first_[static_cast<unsigned char>(pattern[0])] = true;
  }
  bool empty() const { return nodes_.empty(); }
  void find_all(std::string_view text, std::vector<Match>& out) const {
    out.clear();
    if (nodes_.empty()) return;
    size_t i = 0;
    while (i < text.size()) {
      if (!first_[static_cast<unsigned char>(text[i])]) {
        ++i;
        continue;
      }
      int32_t n = 0;
      size_t best_end = 0;
      int64_t best = -1;
      for (size_t k = i; k < text.size(); ++k) {
        n = child(n, static_cast<unsigned char>(text[k]));
        if (n < 0) break;
        if (nodes_[n].token >= 0) {
          best = nodes_[n].token;
          best_end = k + 1;
        }
      }
      if (best >= 0) {
        out.push_back({i, best_end, static_cast<size_t>(best)});
        i = best_end;
      } else {
        ++i;
      }
    }
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> kids;
    int64_t token = -1;
  };
  int32_t child(int32_t n, unsigned char c) const {
    for (const auto& [k, v] : nodes_[n].kids)
      if (k == c) return v;
    return -1;
  }
  std::vector<Node> nodes_;
  bool first_[256] = {};
};

namespace {

bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t i = s.size();
  return is_word_char(prev_code_point(s, i));
}
bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t i = 0;
  return is_word_char(next_code_point(s, i));
}
// Start of the whitespace run that ends `s` (s.size() when none).
size_t trailing_space_start(std::string_view s) {
  size_t i = s.size();
  while (i > 0) {
    size_t k = i;
    if (!is_whitespace(prev_code_point(s, k))) break;
    i = k;
  }
  return i;
}
// Length of the whitespace run that starts `s`.
size_t leading_space_len(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t k = i;
    if (!is_whitespace(next_code_point(s, k))) break;
    i = k;
  }
  return i;
}

// ------------------------------------------------------------------------------------------------ post-processors
class TemplateProcessor : public PostProcessor {
 public:
  TemplateProcessor(std::vector<int32_t> prefix, std::vector<int32_t> suffix)
      : prefix_(std::move(prefix)), suffix_(std::move(suffix)) {}
  void process(std::vector<int32_t>& ids) const override {
    ids.insert(ids.begin(), prefix_.begin(), prefix_.end());
    ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  }

 private:
  std::vector<int32_t> prefix_, suffix_;
};

class SequenceProcessor : public PostProcessor {
 public:
  std::vector<std::unique_ptr<PostProcessor>> parts;
  void process(std::vector<int32_t>& ids) const override {
    for (const auto& p : parts) p->process(ids);
  }
};

int32_t json_id(const nlohmann::json& v, const std::string& where) {
  MLA_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < INT32_MAX,
            "{}: expected a token id, got {}", where, v.dump());
  return v.get<int32_t>();
}

std::unique_ptr<PostProcessor> make_post_processor(const nlohmann::json& spec, const std::string& where) {
  if (spec.is_null()) return nullptr;
  std::string type = get_string(spec, "type", where);
  if (type == "ByteLevel") return nullptr;  // only trims offsets; ids are unchanged
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceProcessor>();
    const auto& list = get_field(spec, "processors", where);
    MLA_CHECK(list.is_array(), "{}.processors: expected an array", where);
    for (size_t i = 0; i < list.size(); ++i) {
      auto p = make_post_processor(list[i], fmt::format("{}.processors[{}]", where, i));
      if (p) seq->parts.push_back(std::move(p));
    }
    return seq;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    const auto& cls = get_field(spec, "cls", where);
    const auto& sep = get_field(spec, "sep", where);
    MLA_CHECK(cls.is_array() && cls.size() == 2 && sep.is_array() && sep.size() == 2,
              "{}: cls and sep must be [token, id]", where);
    return make_template_processor({json_id(cls[1], where + ".cls[1]")}, {json_id(sep[1], where + ".sep[1]")});
  }
  if (type == "TemplateProcessing") {
    const auto& single = get_field(spec, "single", where);
    const auto& specials = get_field(spec, "special_tokens", where);
    MLA_CHECK(single.is_array(), "{}.single: expected an array", where);
    std::vector<int32_t> prefix, suffix;
    bool seen_seq = false;
    for (size_t i = 0; i < single.size(); ++i) {
      std::string w = fmt::format("{}.single[{}]", where, i);
      const auto& piece = single[i];
      if (piece.contains("Sequence")) {
        MLA_CHECK(!seen_seq, "{}: a single-sequence template with two sequences", w);
        seen_seq = true;
      } else if (piece.contains("SpecialToken")) {
        std::string name = get_string(piece["SpecialToken"], "id", w + ".SpecialToken");
        auto it = specials.find(name);
        MLA_CHECK(it != specials.end(), "{}: special token '{}' is not in special_tokens", w, name);
        const auto& ids = get_field(*it, "ids", where + ".special_tokens." + name);
        for (const auto& id : ids) (seen_seq ? suffix : prefix).push_back(json_id(id, w));
      } else {
        fail("{}: expected {{\"Sequence\": ...}} or {{\"SpecialToken\": ...}}, got {}", w, piece.dump());
      }
    }
    return make_template_processor(std::move(prefix), std::move(suffix));
  }
  fail("{}: unsupported post-processor type '{}' (supported: ByteLevel, TemplateProcessing, BertProcessing, "
       "RobertaProcessing, Sequence)",
       where, type);
}

}  // namespace

std::unique_ptr<PostProcessor> make_template_processor(std::vector<int32_t> prefix, std::vector<int32_t> suffix) {
  return std::make_unique<TemplateProcessor>(std::move(prefix), std::move(suffix));
}

// ------------------------------------------------------------------------------------------------ tokenizer
Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MLA_CHECK(f.good(), "cannot open tokenizer file '{}'", path);
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
  return from_json(j, path);
}

std::unique_ptr<Tokenizer> Tokenizer::from_json(const nlohmann::json& j, const std::string& where) {
  MLA_CHECK(j.is_object(), "{}: expected a JSON object", where);
  return assemble(j, where, std::make_unique<BpeModel>(get_field(j, "model", where), where + " model"));
}

std::unique_ptr<Tokenizer> Tokenizer::assemble(const nlohmann::json& j, const std::string& where,
                                               std::unique_ptr<BpeModel> model, bool stored_ids) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  auto get = [&](const char* k) -> const nlohmann::json& {
    static const nlohmann::json null;
    auto it = j.find(k);
    return it == j.end() ? null : *it;
  };
  t->model_ = std::move(model);
  t->normalizer_ = make_normalizer(get("normalizer"), where + " normalizer");
  t->pre_tokenizer_ = make_pre_tokenizer(get("pre_tokenizer"), where + " pre_tokenizer");
  t->post_processor_ = make_post_processor(get("post_processor"), where + " post_processor");
  t->decoder_ = make_decoder(get("decoder"), where + " decoder");

  // Added tokens get their ids as HF re-derives them on load: the model's id when the content is in its vocab,
  // else the next id after the vocab / the previous added tokens. (For well-formed files, the stored ids.)
  const auto& added = get("added_tokens");
  MLA_CHECK(added.is_null() || added.is_array(), "{} added_tokens: expected an array", where);
  int32_t max_added = -1;
  for (size_t i = 0; added.is_array() && i < added.size(); ++i) {
    std::string w = fmt::format("{} added_tokens[{}]", where, i);
    const auto& a = added[i];
    AddedToken tok;
    tok.content = get_string(a, "content", w);
    check_utf8(tok.content, w + ".content");
    tok.single_word = get_bool(a, "single_word", w, false);
    tok.lstrip = get_bool(a, "lstrip", w, false);
    tok.rstrip = get_bool(a, "rstrip", w, false);
    tok.special = get_bool(a, "special", w, false);
    tok.normalized = get_bool(a, "normalized", w, !tok.special);
    if (tok.content.empty()) continue;
    if (auto it = t->added_by_content_.find(tok.content); it != t->added_by_content_.end()) {
      tok.id = it->second;  // same content again: the later flags win
      t->added_[t->added_by_id_[tok.id]] = tok;
      continue;
    }
    if (stored_ids) {
      MLA_CHECK(a.contains("id") && a["id"].is_number_integer() && a["id"].get<int64_t>() >= 0 &&
                    a["id"].get<int64_t>() < INT32_MAX,
                "{}: expected a non-negative integer id", w);
      tok.id = a["id"].get<int32_t>();
      MLA_CHECK(!t->added_by_id_.count(tok.id) && !t->model_->id_to_token(tok.id), "{}: id {} is taken twice", w,
                tok.id);
    } else if (auto mid = t->model_->token_to_id(tok.content)) {
      tok.id = *mid;
    } else {
      int32_t vs = static_cast<int32_t>(t->model_->vocab_size());
      tok.id = max_added < 0 ? vs : (max_added >= vs || vs == 0 ? max_added + 1 : vs);
    }
    if (a.contains("id") && a["id"].is_number_integer() && a["id"].get<int64_t>() != tok.id)
      MLA_LOG_WARN("{}: token '{}' stored with id {} gets id {} (as Hugging Face assigns it)", w, tok.content,
                   a["id"].get<int64_t>(), tok.id);
    max_added = std::max(max_added, tok.id);
    t->added_by_content_[tok.content] = tok.id;
    t->added_by_id_[tok.id] = t->added_.size();
    t->added_.push_back(tok);
  }
  t->vocab_size_ = t->model_->vocab_size();
  for (const auto& [tok, id] : t->model_->vocab()) t->vocab_size_ = std::max(t->vocab_size_, static_cast<size_t>(id) + 1);
  for (const auto& a : t->added_) t->vocab_size_ = std::max(t->vocab_size_, static_cast<size_t>(a.id) + 1);
  // Matching sets: special tokens first, then the others (HF's order; it matters only for equal contents).
  t->raw_matcher_ = std::make_unique<Matcher>();
  t->normalized_matcher_ = std::make_unique<Matcher>();
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < t->added_.size(); ++i) {
      const AddedToken& a = t->added_[i];
      if (a.special != (pass == 0)) continue;
      if (!a.normalized) {
        t->raw_matcher_->add(a.content, i);
      } else {
        std::string n = a.content;
        if (t->normalizer_) t->normalizer_->normalize(n);
        t->normalized_matcher_->add(n, i);
      }
    }
  }
  return t;
}

void Tokenizer::set_post_processor(std::unique_ptr<PostProcessor> p) { post_processor_ = std::move(p); }

// Splits `text` on the added tokens of `m` (HF's AddedVocabulary::find_matches).
void Tokenizer::split_added(const Matcher& m, const std::string& text, bool at_origin,
                            std::vector<Segment>& out) const {
  thread_local std::vector<Matcher::Match> matches;
  m.find_all(text, matches);
  size_t start_offset = 0;
  std::string_view s = text;
  for (const auto& mt : matches) {
    size_t start = mt.start, stop = mt.end;
    const AddedToken& a = added_[mt.token];
    if (start < start_offset) continue;  // swallowed by the previous token's rstrip
    if (a.single_word) {
      bool start_space = start == 0 || !ends_with_word(s.substr(0, start));
      bool stop_space = stop == s.size() || !starts_with_word(s.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (a.lstrip) start = std::max(trailing_space_start(s.substr(0, start)), start_offset);
    if (a.rstrip) stop += leading_space_len(s.substr(stop));
    if (start_offset < start)
      out.push_back(Segment{text.substr(start_offset, start - start_offset), -1, at_origin && start_offset == 0});
    out.push_back(Segment{{}, a.id, false});
    start_offset = stop;
  }
  if (start_offset < text.size())
    out.push_back(Segment{text.substr(start_offset), -1, at_origin && start_offset == 0});
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  check_utf8(text, "the text to encode");
  std::vector<int32_t> ids;
  // 1. Added tokens that match the raw text; 2. normalize the rest and match the normalized added tokens.
  std::vector<Segment> raw, segs;
  split_added(*raw_matcher_, std::string(text), true, raw);
  for (auto& seg : raw) {
    if (seg.id >= 0) {
      segs.push_back(std::move(seg));
      continue;
    }
    if (normalizer_) normalizer_->normalize(seg.text);
    split_added(*normalized_matcher_, seg.text, seg.at_origin, segs);
  }
  // 3. Pre-tokenize and run the model on each remaining segment.
  thread_local Pieces pieces, scratch;
  for (auto& seg : segs) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    pieces.clear();
    pieces.push_back(Piece{std::move(seg.text), seg.at_origin});
    if (pre_tokenizer_) pre_tokenizer_->apply(pieces, scratch);
    for (const auto& p : pieces) model_->tokenize(p.text, ids);
  }
  if (add_special_tokens && post_processor_) post_processor_->process(ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    auto it = added_by_id_.find(id);
    if (it != added_by_id_.end()) {
      const AddedToken& a = added_[it->second];
      if (skip_special_tokens && a.special) continue;
      tokens.push_back(a.content);
      continue;
    }
    if (const std::string* t = model_->id_to_token(id)) tokens.push_back(*t);
  }
  if (decoder_) {
    decoder_->decode_chain(tokens);
    std::string out;
    for (const auto& t : tokens) out += t;
    return out;
  }
  std::string out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i) out += ' ';
    out += tokens[i];
  }
  return out;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto it = added_by_content_.find(std::string(token));
  if (it != added_by_content_.end()) return it->second;
  return model_->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  auto it = added_by_id_.find(id);
  if (it != added_by_id_.end()) return added_[it->second].content;
  if (const std::string* t = model_->id_to_token(id)) return *t;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::token_bytes(int32_t id) const {
  if (added_by_id_.count(id)) return std::nullopt;
  const std::string* t = model_->id_to_token(id);
  if (!t) return std::nullopt;
  std::vector<std::string> tokens{*t};
  if (!decoder_) return *t;
  decoder_->decode_chain_raw(tokens);
  std::string out;
  for (const auto& s : tokens) out += s;
  return out;
}

bool Tokenizer::is_special(int32_t id) const {
  auto it = added_by_id_.find(id);
  return it != added_by_id_.end() && added_[it->second].special;
}

size_t Tokenizer::vocab_size() const { return vocab_size_; }

}  // namespace mlaserve::tok
