#include "tokenizer/bpe.h"

#include <queue>

#include "core/error.h"
#include "tokenizer/json_util.h"
#include "tokenizer/pre_tokenizers.h"
#include "tokenizer/unicode.h"

namespace mlaserve::tok {

BpeModel::BpeModel(const nlohmann::json& spec, const std::string& where) {
  std::string type = opt_string(spec, "type", where).value_or("BPE");
  MLA_CHECK(type == "BPE", "{}: unsupported model type '{}' (only BPE is implemented)", where, type);
  auto dropout = spec.find("dropout");
  MLA_CHECK(dropout == spec.end() || dropout->is_null() || (dropout->is_number() && dropout->get<double>() == 0.0),
            "{}.dropout: BPE dropout is random and not supported for inference", where);
  unk_token_ = opt_string(spec, "unk_token", where);
  prefix_ = opt_string(spec, "continuing_subword_prefix", where).value_or("");
  suffix_ = opt_string(spec, "end_of_word_suffix", where).value_or("");
  fuse_unk_ = get_bool(spec, "fuse_unk", where, false);
  byte_fallback_ = get_bool(spec, "byte_fallback", where, false);
  ignore_merges_ = get_bool(spec, "ignore_merges", where, false);

  const auto& vocab = get_field(spec, "vocab", where);
  MLA_CHECK(vocab.is_object(), "{}.vocab: expected an object of token -> id", where);
  vocab_.reserve(vocab.size());
  int32_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    MLA_CHECK(it.value().is_number_integer() && it.value().get<int64_t>() >= 0 &&
                  it.value().get<int64_t>() < INT32_MAX,
              "{}.vocab['{}']: expected a non-negative integer id", where, it.key());
    int32_t id = it.value().get<int32_t>();
    vocab_[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  id_to_token_.resize(max_id + 1);
  has_id_.resize(max_id + 1, false);
  for (const auto& [tok, id] : vocab_) {
    id_to_token_[id] = tok;
    has_id_[id] = true;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(fmt::format("<0x{:02X}>", b));
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }

  const auto& merges = get_field(spec, "merges", where);
  MLA_CHECK(merges.is_array(), "{}.merges: expected an array", where);
  merges_.reserve(merges.size() * 2);
  for (size_t i = 0; i < merges.size(); ++i) {
    const auto& m = merges[i];
    std::string a, b;
    if (m.is_string()) {  // legacy "a b"
      const std::string& s = m.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      MLA_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                "{}.merges[{}]: '{}' is not two tokens separated by one space", where, i, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      MLA_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
                "{}.merges[{}]: expected \"a b\" or [\"a\", \"b\"]", where, i);
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b);
    MLA_CHECK(ia != vocab_.end(), "{}.merges[{}]: token '{}' is not in the vocab", where, i, a);
    MLA_CHECK(ib != vocab_.end(), "{}.merges[{}]: token '{}' is not in the vocab", where, i, b);
    // The merged token drops b's continuing-subword prefix (as HF does, unconditionally by length).
    MLA_CHECK(b.size() >= prefix_.size(), "{}.merges[{}]: '{}' is shorter than the subword prefix", where, i, b);
    std::string merged = a + b.substr(prefix_.size());
    auto im = vocab_.find(merged);
    MLA_CHECK(im != vocab_.end(), "{}.merges[{}]: merged token '{}' is not in the vocab", where, i, merged);
    // A repeated pair keeps its last rank, as HF's HashMap collect does.
    merges_[pair_key(ia->second, ib->second)] = Merge{static_cast<int32_t>(i), im->second};
  }
}

std::unique_ptr<BpeModel> BpeModel::from_byte_ranks(const std::vector<std::string>& bytes_by_id,
                                                    const std::string& where) {
  std::unique_ptr<BpeModel> m(new BpeModel());
  m->ignore_merges_ = true;
  std::fill(std::begin(m->byte_ids_), std::end(m->byte_ids_), -1);
  std::unordered_map<std::string_view, int32_t> by_bytes;
  by_bytes.reserve(bytes_by_id.size());
  m->vocab_.reserve(bytes_by_id.size());
  m->id_to_token_.resize(bytes_by_id.size());
  m->has_id_.resize(bytes_by_id.size(), false);
  for (size_t id = 0; id < bytes_by_id.size(); ++id) {
    const std::string& b = bytes_by_id[id];
    if (b.empty()) continue;
    MLA_CHECK(by_bytes.emplace(b, static_cast<int32_t>(id)).second, "{}: two ranks for one token (rank {})", where,
              id);
    std::string t;
    for (unsigned char c : b) t += byte_char_utf8(c);
    m->vocab_[t] = static_cast<int32_t>(id);
    m->id_to_token_[id] = std::move(t);
    m->has_id_[id] = true;
  }
  for (int c = 0; c < 256; ++c) {
    const char ch = static_cast<char>(c);
    MLA_CHECK(by_bytes.count(std::string_view(&ch, 1)), "{}: byte 0x{:02X} has no rank (every byte must be a token)",
              where, c);
  }
  m->merges_.reserve(bytes_by_id.size() * 4);
  for (const auto& [b, id] : by_bytes) {
    for (size_t k = 1; k < b.size(); ++k) {
      auto l = by_bytes.find(b.substr(0, k)), r = by_bytes.find(b.substr(k));
      if (l != by_bytes.end() && r != by_bytes.end()) m->merges_[pair_key(l->second, r->second)] = Merge{id, id};
    }
  }
  return m;
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= has_id_.size() || !has_id_[id]) return nullptr;
  return &id_to_token_[id];
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() <= kMaxCachedWordBytes) {
    {
      std::lock_guard<std::mutex> lock(cache_mu_);
      auto it = cache_.find(word);
      if (it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    size_t first = out.size();
    tokenize_uncached(word, out);
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.emplace(std::string(word), std::vector<int32_t>(out.begin() + first, out.end()));
    return;
  }
  tokenize_uncached(word, out);
}

void BpeModel::tokenize_uncached(std::string_view w, std::vector<int32_t>& out) const {
  // Initial symbols: one per character (with prefix / suffix decorations), unknown ones via byte fallback or unk.
  std::vector<int32_t> syms;
  syms.reserve(w.size());
  std::string buf;
  bool have_unk = false;  // a pending (possibly fused) unk symbol
  auto flush_unk = [&] {
    if (have_unk) {
      syms.push_back(vocab_.at(*unk_token_));
      have_unk = false;
    }
  };
  size_t i = 0;
  while (i < w.size()) {
    size_t b = i;
    i += utf8_seq_len(static_cast<unsigned char>(w[i]));
    std::string_view ch = w.substr(b, i - b);
    std::string_view key = ch;
    if ((b > 0 && !prefix_.empty()) || (i == w.size() && !suffix_.empty())) {
      buf.clear();
      if (b > 0) buf += prefix_;
      buf += ch;
      if (i == w.size()) buf += suffix_;
      key = buf;
    }
    auto it = vocab_.find(key);
    if (it != vocab_.end()) {
      flush_unk();
      syms.push_back(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (unsigned char c : key) all = all && byte_ids_[c] >= 0;
      if (all) {
        // A pending unk stays pending (it is written before the next known character), as in HF.
        for (unsigned char c : key) syms.push_back(byte_ids_[c]);
        continue;
      }
    }
    if (unk_token_) {
      MLA_CHECK(vocab_.count(*unk_token_), "tokenizer.json model.unk_token '{}' is not in the vocab", *unk_token_);
      if (have_unk && !fuse_unk_) flush_unk();
      have_unk = true;
    }
    // No unk token: the character is dropped, as HF does.
  }
  flush_unk();
  merge_word(syms);
  out.insert(out.end(), syms.begin(), syms.end());
}

void BpeModel::merge_word(std::vector<int32_t>& syms) const {
  size_t n = syms.size();
  if (n < 2) return;
  if (n <= 20) {
    // Short words: repeatedly merge the lowest-rank adjacent pair (leftmost on ties). Same result as the heap below.
    while (syms.size() >= 2) {
      int32_t best_rank = INT32_MAX, best_id = -1;
      size_t best_pos = 0;
      for (size_t k = 0; k + 1 < syms.size(); ++k) {
        auto it = merges_.find(pair_key(syms[k], syms[k + 1]));
        if (it != merges_.end() && it->second.rank < best_rank) {
          best_rank = it->second.rank;
          best_id = it->second.new_id;
          best_pos = k;
        }
      }
      if (best_id < 0) break;
      syms[best_pos] = best_id;
      syms.erase(syms.begin() + best_pos + 1);
    }
    return;
  }
  // Long words: a min-heap of candidate merges (rank, position) over a linked list of symbols.
  struct Sym {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Sym> s(n);
  for (size_t k = 0; k < n; ++k)
    s[k] = Sym{syms[k], static_cast<int32_t>(k) - 1, k + 1 < n ? static_cast<int32_t>(k + 1) : -1, true};
  using Cand = std::pair<int32_t, int32_t>;  // (rank, pos)
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> q;
  auto push = [&](int32_t pos) {
    if (pos < 0 || s[pos].next < 0) return;
    auto it = merges_.find(pair_key(s[pos].id, s[s[pos].next].id));
    if (it != merges_.end()) q.push({it->second.rank, pos});
  };
  for (size_t k = 0; k + 1 < n; ++k) push(static_cast<int32_t>(k));
  while (!q.empty()) {
    auto [rank, pos] = q.top();
    q.pop();
    if (!s[pos].alive || s[pos].next < 0) continue;
    int32_t nx = s[pos].next;
    auto it = merges_.find(pair_key(s[pos].id, s[nx].id));
    if (it == merges_.end() || it->second.rank != rank) continue;  // stale candidate
    s[pos].id = it->second.new_id;
    s[nx].alive = false;
    s[pos].next = s[nx].next;
    if (s[pos].next >= 0) s[s[pos].next].prev = pos;
    push(s[pos].prev);
    push(pos);
  }
  syms.clear();
  for (int32_t k = 0; k >= 0; k = s[k].next) syms.push_back(s[k].id);
}

}  // namespace mlaserve::tok
