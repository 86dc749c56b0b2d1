#include "engine/offline.h"

#include <algorithm>
#include <cstring>

#include "core/log.h"

namespace mlaserve {

namespace {
int32_t argmax(const float* x, int64_t n) {
  int32_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = static_cast<int32_t>(i);
  return best;
}
}  // namespace

OfflineResult run_offline(DeepseekModel& model, const std::vector<std::vector<int32_t>>& prompts,
                          const OfflineOptions& opts) {
  const auto& cfg = model.config();
  const int64_t V = cfg.vocab_size;
  const int32_t ps = opts.page_size;
  const size_t n = prompts.size();
  for (size_t j = 0; j < n; ++j) MLA_CHECK(!prompts[j].empty(), "prompt {} is empty", j);

  // Pages for every sequence's whole lifetime, taken up front.
  int32_t total_pages = 0;
  std::vector<int32_t> need(n);
  for (size_t j = 0; j < n; ++j) {
    const int64_t len = static_cast<int64_t>(prompts[j].size()) + opts.max_new_tokens;
    need[j] = static_cast<int32_t>((len + ps - 1) / ps);
    total_pages += need[j];
  }
  PagePool pool(total_pages);
  KvCache cache(model.backend(), cfg, total_pages, ps);
  std::vector<std::vector<int32_t>> pages(n);
  for (size_t j = 0; j < n; ++j) pages[j] = *pool.alloc(need[j]);

  OfflineResult res;
  res.prompt_logits.resize(n);
  res.greedy.resize(n);
  std::vector<int32_t> next(n, -1);

  // Prefill: all prompts together; with chunking, step k carries chunk k of every prompt that has one.
  const size_t max_len = std::max_element(prompts.begin(), prompts.end(), [](auto& a, auto& b) { return a.size() < b.size(); })->size();
  const size_t chunk = opts.prefill_chunk > 0 ? static_cast<size_t>(opts.prefill_chunk) : max_len;
  for (size_t j = 0; j < n; ++j)
    res.prompt_logits[j] = Tensor::empty_host({opts.prompt_logits ? static_cast<int64_t>(prompts[j].size()) : 1, V}, DType::F32);
  for (size_t start = 0; start < max_len; start += chunk) {
    ForwardBatchBuilder bb(ps);
    std::vector<size_t> members;
    for (size_t j = 0; j < n; ++j) {
      if (start >= prompts[j].size()) continue;
      const size_t end = std::min(prompts[j].size(), start + chunk);
      bb.add(std::span<const int32_t>(prompts[j].data() + start, end - start), static_cast<int32_t>(start), pages[j],
             opts.prompt_logits);
      members.push_back(j);
    }
    ForwardBatch fb = bb.finish();
    Tensor logits = model.backend().to_host_f32(model.forward(fb, cache, opts.form));
    int64_t row = 0;
    for (size_t j : members) {
      const size_t end = std::min(prompts[j].size(), start + chunk);
      const int64_t rows = opts.prompt_logits ? static_cast<int64_t>(end - start) : 1;
      const int64_t dst_row = opts.prompt_logits ? static_cast<int64_t>(start) : 0;
      std::memcpy(res.prompt_logits[j].data_as<float>() + dst_row * V, logits.data_as<float>() + row * V,
                  static_cast<size_t>(rows * V) * sizeof(float));
      if (end == prompts[j].size()) next[j] = argmax(logits.data_as<float>() + (row + rows - 1) * V, V);
      row += rows;
    }
  }

  // Greedy decode: one token per live sequence per step.
  std::vector<bool> done(n, opts.max_new_tokens <= 0);
  std::vector<int32_t> len(n);
  for (size_t j = 0; j < n; ++j) len[j] = static_cast<int32_t>(prompts[j].size());
  for (int32_t step = 0; step < opts.max_new_tokens; ++step) {
    ForwardBatchBuilder bb(ps);
    std::vector<size_t> members;
    for (size_t j = 0; j < n; ++j) {
      if (done[j]) continue;
      res.greedy[j].push_back(next[j]);
      if (std::find(opts.stop_ids.begin(), opts.stop_ids.end(), next[j]) != opts.stop_ids.end() ||
          static_cast<int32_t>(res.greedy[j].size()) >= opts.max_new_tokens) {
        done[j] = true;
        continue;
      }
      bb.add(std::span<const int32_t>(&next[j], 1), len[j], pages[j], false);
      members.push_back(j);
    }
    if (members.empty()) break;
    ForwardBatch fb = bb.finish();
    Tensor logits = model.backend().to_host_f32(model.forward(fb, cache, opts.form));
    for (size_t r = 0; r < members.size(); ++r) {
      const size_t j = members[r];
      ++len[j];
      next[j] = argmax(logits.data_as<float>() + static_cast<int64_t>(r) * V, V);
    }
  }
  for (size_t j = 0; j < n; ++j) pool.free(pages[j]);
  pool.check_integrity();
  MLA_CHECK(pool.num_free() == pool.num_pages(), "offline run leaked pages");
  return res;
}

}  // namespace mlaserve
