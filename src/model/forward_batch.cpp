#include "model/forward_batch.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace mlaserve {

const char* forward_mode_name(ForwardMode m) {
  switch (m) {
    case ForwardMode::Idle: return "idle";
    case ForwardMode::Extend: return "extend";
    case ForwardMode::Decode: return "decode";
    case ForwardMode::Mixed: return "mixed";
  }
  return "?";
}

namespace {
void put_i32(std::string& o, int32_t v) { o.append(reinterpret_cast<const char*>(&v), 4); }
void put_vec(std::string& o, const std::vector<int32_t>& v) {
  put_i32(o, static_cast<int32_t>(v.size()));
  o.append(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}
int32_t get_i32(const char*& p, const char* end) {
  MLA_CHECK(end - p >= 4, "truncated step message");
  int32_t v;
  std::memcpy(&v, p, 4);
  p += 4;
  return v;
}
std::vector<int32_t> get_vec(const char*& p, const char* end) {
  const int32_t n = get_i32(p, end);
  MLA_CHECK(n >= 0 && end - p >= static_cast<int64_t>(n) * 4, "truncated step message");
  std::vector<int32_t> v(static_cast<size_t>(n));
  if (n > 0) std::memcpy(v.data(), p, static_cast<size_t>(n) * 4);  // (an empty vector's data() may be null)
  p += static_cast<int64_t>(n) * 4;
  return v;
}
}  // namespace

void serialize(const ForwardBatch& b, std::string& o) {
  put_i32(o, static_cast<int32_t>(b.mode));
  put_i32(o, b.page_size);
  put_i32(o, b.max_pages);
  put_i32(o, b.mtp_chain);
  put_i32(o, b.hidden_states ? 1 : 0);
  for (const auto* v : {&b.input_ids, &b.positions, &b.token_seq, &b.out_slots, &b.seq_q_start, &b.seq_prefix_lens,
                        &b.seq_lens, &b.page_table, &b.logit_rows, &b.seq_absorbed, &b.next_ids, &b.seq_drafts,
                        &b.hidden_rows, &b.kv_saves, &b.kv_loads})
    put_vec(o, *v);
}

ForwardBatch deserialize_forward_batch(const char*& p, const char* end) {
  ForwardBatch b;
  b.mode = static_cast<ForwardMode>(get_i32(p, end));
  b.page_size = get_i32(p, end);
  b.max_pages = get_i32(p, end);
  b.mtp_chain = get_i32(p, end);
  b.hidden_states = get_i32(p, end) != 0;
  for (auto* v : {&b.input_ids, &b.positions, &b.token_seq, &b.out_slots, &b.seq_q_start, &b.seq_prefix_lens,
                  &b.seq_lens, &b.page_table, &b.logit_rows, &b.seq_absorbed, &b.next_ids, &b.seq_drafts,
                  &b.hidden_rows, &b.kv_saves, &b.kv_loads})
    *v = get_vec(p, end);
  return b;
}

ForwardBatchBuilder::ForwardBatchBuilder(int32_t page_size) {
  MLA_CHECK(page_size > 0, "page size must be positive, got {}", page_size);
  b_.page_size = page_size;
  b_.seq_q_start.push_back(0);
}

void ForwardBatchBuilder::add(std::span<const int32_t> new_tokens, int32_t prefix_len, std::span<const int32_t> pages,
                              Logits logits) {
  const int32_t n = static_cast<int32_t>(new_tokens.size());
  add_logits_from(new_tokens, prefix_len, pages, logits == Logits::All ? 0 : logits == Logits::Last ? n - 1 : n);
}

void ForwardBatchBuilder::add_logits_from(std::span<const int32_t> new_tokens, int32_t prefix_len,
                                          std::span<const int32_t> pages, int32_t first_logit, int32_t room) {
  MLA_CHECK(!new_tokens.empty(), "a sequence in a batch needs at least one new token");
  MLA_CHECK(first_logit >= 0 && first_logit <= static_cast<int32_t>(new_tokens.size()),
            "first logit row {} of a sequence of {} new tokens", first_logit, new_tokens.size());
  MLA_CHECK(prefix_len >= 0, "negative prefix length {}", prefix_len);
  const int32_t total = prefix_len + static_cast<int32_t>(new_tokens.size());
  const int32_t ps = b_.page_size;
  MLA_CHECK(static_cast<int64_t>(pages.size()) * ps >= total, "{} pages of {} tokens cannot hold {} tokens",
            pages.size(), ps, total);
  const int32_t seq = b_.num_seqs();
  for (size_t i = 0; i < new_tokens.size(); ++i) {
    const int32_t pos = prefix_len + static_cast<int32_t>(i);
    const int32_t page = pages[static_cast<size_t>(pos / ps)];
    MLA_CHECK(page >= 0, "page table entry {} of sequence {} is unset", pos / ps, seq);
    if (static_cast<int32_t>(i) >= first_logit) b_.logit_rows.push_back(b_.num_tokens());
    b_.input_ids.push_back(new_tokens[i]);
    b_.positions.push_back(pos);
    b_.token_seq.push_back(seq);
    b_.out_slots.push_back(page * ps + pos % ps);
  }
  b_.seq_q_start.push_back(b_.num_tokens());
  b_.seq_prefix_lens.push_back(prefix_len);
  b_.seq_lens.push_back(total);
  MLA_CHECK(room >= 0, "negative room {}", room);
  int32_t needed = (total + ps - 1) / ps;
  for (; needed < static_cast<int32_t>(pages.size()) && needed * ps < total + room; ++needed)
    if (pages[static_cast<size_t>(needed)] < 0) break;
  pages_.emplace_back(pages.begin(), pages.begin() + needed);
  if (new_tokens.size() == 1 && prefix_len > 0) any_decode_ = true;
  else any_prefill_ = true;
}

void ForwardBatchBuilder::absorb_last(int32_t drafts) {
  MLA_CHECK(b_.num_seqs() > 0, "absorb_last: no sequence added");
  const auto last = static_cast<size_t>(b_.num_seqs() - 1);
  const int32_t n = b_.seq_q_start[last + 1] - b_.seq_q_start[last];
  MLA_CHECK(drafts >= 0 && drafts < n, "absorb_last: {} drafts among {} new tokens", drafts, n);
  b_.seq_absorbed.resize(static_cast<size_t>(b_.num_seqs()), 0);
  b_.seq_absorbed.back() = 1;
  if (drafts == 0) return;
  b_.seq_drafts.resize(static_cast<size_t>(b_.num_seqs()), 0);
  b_.seq_drafts.back() = drafts;
}

void ForwardBatchBuilder::hidden_of_last() {
  MLA_CHECK(b_.num_seqs() > 0, "hidden_of_last: no sequence added");
  const auto last = static_cast<size_t>(b_.num_seqs() - 1);
  for (int32_t t = b_.seq_q_start[last]; t < b_.seq_q_start[last + 1]; ++t) b_.hidden_rows.push_back(t);
}

ForwardBatch ForwardBatchBuilder::finish() {
  if (!b_.seq_absorbed.empty()) b_.seq_absorbed.resize(static_cast<size_t>(b_.num_seqs()), 0);
  if (!b_.seq_drafts.empty()) b_.seq_drafts.resize(static_cast<size_t>(b_.num_seqs()), 0);
  int32_t max_pages = 0;
  for (const auto& p : pages_) max_pages = std::max<int32_t>(max_pages, static_cast<int32_t>(p.size()));
  b_.max_pages = max_pages;
  b_.page_table.assign(static_cast<size_t>(max_pages) * pages_.size(), -1);
  for (size_t s = 0; s < pages_.size(); ++s)
    std::copy(pages_[s].begin(), pages_[s].end(), b_.page_table.begin() + static_cast<int64_t>(s) * max_pages);
  if (b_.num_tokens() == 0) b_.mode = ForwardMode::Idle;
  else if (any_prefill_ && any_decode_) b_.mode = ForwardMode::Mixed;
  else if (any_prefill_) b_.mode = ForwardMode::Extend;
  else b_.mode = ForwardMode::Decode;
  ForwardBatch out = std::move(b_);
  b_ = ForwardBatch{};
  b_.page_size = out.page_size;
  b_.seq_q_start.push_back(0);
  pages_.clear();
  any_prefill_ = any_decode_ = false;
  return out;
}

bool all_absorbed_under_auto(const ForwardBatch& b) {
  for (int32_t s = 0; s < b.num_seqs(); ++s)
    if (!b.absorbed_under_auto(s)) return false;
  return true;
}

bool is_graph_batch(const ForwardBatch& b) {
  const int32_t n = b.num_tokens();
  if (n == 0 || static_cast<int32_t>(b.logit_rows.size()) != n || !all_absorbed_under_auto(b)) return false;
  for (int32_t i = 0; i < n; ++i)
    if (b.logit_rows[static_cast<size_t>(i)] != i) return false;
  return true;
}

ForwardBatch pad_decode_batch(const ForwardBatch& b, int32_t tokens, int32_t dummy_page, int32_t page_size) {
  const int32_t n = b.num_tokens(), ns = n == 0 ? 0 : b.num_seqs();
  MLA_CHECK(n == 0 || is_graph_batch(b), "pad_decode_batch: not a decode batch ({} tokens, {} sequences)", n,
            b.num_seqs());
  MLA_CHECK(tokens >= n && dummy_page >= 0 && page_size > 0, "pad_decode_batch: {} tokens into {}", n, tokens);
  ForwardBatch p = b;
  p.mode = ForwardMode::Decode;
  p.page_size = page_size;
  p.max_pages = std::max(b.max_pages, 1);
  if (n == 0) {
    p.seq_q_start = {0};
    p.seq_absorbed.clear();
    p.next_ids.clear();
  }
  // The real sequences keep their rows (a decode token and its drafts: several tokens); one sequence of one token
  // per padding token follows them.
  const int32_t seqs = ns + (tokens - n);
  p.page_table.assign(static_cast<size_t>(seqs) * p.max_pages, -1);
  for (int32_t s = 0; s < ns; ++s)
    std::copy_n(b.page_table.begin() + static_cast<int64_t>(s) * b.max_pages, b.max_pages,
                p.page_table.begin() + static_cast<int64_t>(s) * p.max_pages);
  if (!p.seq_absorbed.empty()) p.seq_absorbed.resize(static_cast<size_t>(seqs), 0);
  if (n == 0) p.seq_drafts.clear();
  if (!p.seq_drafts.empty()) p.seq_drafts.resize(static_cast<size_t>(seqs), 0);
  for (int32_t s = ns, t = n; t < tokens; ++s, ++t) {
    p.page_table[static_cast<size_t>(s) * p.max_pages] = dummy_page;
    p.input_ids.push_back(0);
    if (!b.next_ids.empty() || n == 0) p.next_ids.push_back(0);
    p.positions.push_back(0);
    p.token_seq.push_back(s);
    p.out_slots.push_back(dummy_page * page_size);
    p.seq_q_start.push_back(t + 1);
    p.seq_prefix_lens.push_back(0);
    p.seq_lens.push_back(1);
    p.logit_rows.push_back(t);
  }
  p.moe_rows = {0, n};
  return p;
}

ForwardBatch dummy_decode_row(int32_t context, int32_t dummy_page, int32_t page_size) {
  MLA_CHECK(context >= 1 && dummy_page >= 0 && page_size > 0, "dummy_decode_row: context {} on page {}", context,
            dummy_page);
  const std::vector<int32_t> pages(static_cast<size_t>((context + page_size - 1) / page_size), dummy_page);
  const int32_t id = 0;
  ForwardBatchBuilder b(page_size);
  b.add(std::span<const int32_t>(&id, 1), context - 1, pages, ForwardBatchBuilder::Logits::Last);
  return b.finish();
}

}  // namespace mlaserve
