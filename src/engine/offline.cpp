#include "engine/offline.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/log.h"
#include "engine/sampler.h"

namespace mlaserve {

namespace {

// Runs one step of every DP group: batches[g] (null: idle) -> host logits per group.
using Stepper = std::function<std::vector<Tensor>(const std::vector<const ForwardBatch*>&)>;

int32_t pages_for(const std::vector<int32_t>& prompt, const OfflineOptions& o) {
  const int64_t len = static_cast<int64_t>(prompt.size()) + o.max_new_tokens;
  return static_cast<int32_t>((len + o.page_size - 1) / o.page_size);
}

// The shared driver: prompt j runs in DP group j % groups, with pages from that group's pool.
OfflineResult drive(int64_t vocab, int32_t groups, const std::vector<std::vector<int32_t>>& prompts,
                    const OfflineOptions& opts, const Stepper& step) {
  const int64_t V = vocab;
  const int32_t ps = opts.page_size;
  const size_t n = prompts.size();
  for (size_t j = 0; j < n; ++j) MLA_CHECK(!prompts[j].empty(), "prompt {} is empty", j);
  MLA_CHECK(opts.forced.empty() || opts.forced.size() == n, "forced tokens name {} prompts of {}", opts.forced.size(),
            n);
  for (size_t j = 0; j < opts.forced.size(); ++j)
    MLA_CHECK(static_cast<int64_t>(opts.forced[j].size()) >= int64_t{opts.max_new_tokens} - 1,
              "prompt {}: {} forced tokens for {} decode steps", j, opts.forced[j].size(), opts.max_new_tokens - 1);
  auto group_of = [&](size_t j) { return static_cast<int32_t>(j % static_cast<size_t>(groups)); };

  std::vector<int32_t> group_pages(static_cast<size_t>(groups), 0);
  for (size_t j = 0; j < n; ++j) group_pages[static_cast<size_t>(group_of(j))] += pages_for(prompts[j], opts);
  int32_t max_pages = 1;
  for (int32_t p : group_pages) max_pages = std::max(max_pages, p);
  std::vector<std::unique_ptr<PagePool>> pools;
  for (int32_t g = 0; g < groups; ++g) pools.push_back(std::make_unique<PagePool>(max_pages));
  std::vector<std::vector<int32_t>> pages(n);
  for (size_t j = 0; j < n; ++j) pages[j] = *pools[static_cast<size_t>(group_of(j))]->alloc(pages_for(prompts[j], opts));

  OfflineResult res;
  res.prompt_logits.resize(n);
  res.greedy.resize(n);
  std::vector<int32_t> next(n, -1);
  std::vector<std::vector<float>> step_logits(n);  // decode steps' rows, with opts.decode_logits

  // Runs one step where each group's sequences are given by members[g] (prompt index, tokens, prefix, logits).
  struct Entry {
    size_t j;
    std::span<const int32_t> tokens;
    int32_t prefix;
    ForwardBatchBuilder::Logits logits;
  };
  auto run = [&](const std::vector<std::vector<Entry>>& members) {
    std::vector<ForwardBatch> batches(static_cast<size_t>(groups));
    std::vector<const ForwardBatch*> ptrs(static_cast<size_t>(groups), nullptr);
    for (int32_t g = 0; g < groups; ++g) {
      if (members[static_cast<size_t>(g)].empty()) continue;
      ForwardBatchBuilder bb(ps);
      for (const Entry& e : members[static_cast<size_t>(g)]) bb.add(e.tokens, e.prefix, pages[e.j], e.logits);
      batches[static_cast<size_t>(g)] = bb.finish();
      ptrs[static_cast<size_t>(g)] = &batches[static_cast<size_t>(g)];
    }
    return step(ptrs);
  };

  // Prefill: step k carries chunk k of every prompt that has one.
  size_t max_len = 0;
  for (const auto& p : prompts) max_len = std::max(max_len, p.size());
  const size_t chunk = opts.prefill_chunk > 0 ? static_cast<size_t>(opts.prefill_chunk) : max_len;
  for (size_t j = 0; j < n; ++j)
    res.prompt_logits[j] = Tensor::empty_host({opts.prompt_logits ? static_cast<int64_t>(prompts[j].size()) : 1, V}, DType::F32);
  for (size_t start = 0; start < max_len; start += chunk) {
    std::vector<std::vector<Entry>> members(static_cast<size_t>(groups));
    for (size_t j = 0; j < n; ++j) {
      if (start >= prompts[j].size()) continue;
      const size_t end = std::min(prompts[j].size(), start + chunk);
      members[static_cast<size_t>(group_of(j))].push_back(
          {j, std::span<const int32_t>(prompts[j].data() + start, end - start), static_cast<int32_t>(start),
           opts.prompt_logits ? ForwardBatchBuilder::Logits::All : ForwardBatchBuilder::Logits::Last});
    }
    std::vector<Tensor> logits = run(members);
    for (int32_t g = 0; g < groups; ++g) {
      int64_t row = 0;
      for (const Entry& e : members[static_cast<size_t>(g)]) {
        const size_t j = e.j, end = static_cast<size_t>(e.prefix) + e.tokens.size();
        const int64_t rows = opts.prompt_logits ? static_cast<int64_t>(e.tokens.size()) : 1;
        const int64_t dst_row = opts.prompt_logits ? e.prefix : 0;
        const float* src = logits[static_cast<size_t>(g)].data_as<float>() + row * V;
        std::memcpy(res.prompt_logits[j].data_as<float>() + dst_row * V, src, static_cast<size_t>(rows * V) * sizeof(float));
        if (end == prompts[j].size()) next[j] = argmax_row(src + (rows - 1) * V, V);
        row += rows;
      }
    }
  }

  // Greedy decode: one token per live sequence per step.
  std::vector<bool> done(n, opts.max_new_tokens <= 0);
  std::vector<int32_t> len(n);
  for (size_t j = 0; j < n; ++j) len[j] = static_cast<int32_t>(prompts[j].size());
  for (int32_t s = 0; s < opts.max_new_tokens; ++s) {
    std::vector<std::vector<Entry>> members(static_cast<size_t>(groups));
    bool any = false;
    for (size_t j = 0; j < n; ++j) {
      if (done[j]) continue;
      res.greedy[j].push_back(next[j]);
      if (std::find(opts.stop_ids.begin(), opts.stop_ids.end(), next[j]) != opts.stop_ids.end() ||
          static_cast<int32_t>(res.greedy[j].size()) >= opts.max_new_tokens) {
        done[j] = true;
        continue;
      }
      const int32_t* fed = opts.forced.empty() ? &next[j] : &opts.forced[j][static_cast<size_t>(s)];
      members[static_cast<size_t>(group_of(j))].push_back(
          {j, std::span<const int32_t>(fed, 1), len[j], ForwardBatchBuilder::Logits::Last});
      any = true;
    }
    if (!any) break;
    std::vector<Tensor> logits = run(members);
    for (int32_t g = 0; g < groups; ++g) {
      int64_t row = 0;
      for (const Entry& e : members[static_cast<size_t>(g)]) {
        ++len[e.j];
        const float* src = logits[static_cast<size_t>(g)].data_as<float>() + row * V;
        next[e.j] = argmax_row(src, V);
        if (opts.decode_logits) step_logits[e.j].insert(step_logits[e.j].end(), src, src + V);
        ++row;
      }
    }
  }
  if (opts.decode_logits) {
    res.decode_logits.resize(n);
    for (size_t j = 0; j < n; ++j) {
      res.decode_logits[j] = Tensor::empty_host({static_cast<int64_t>(step_logits[j].size()) / V, V}, DType::F32);
      std::copy(step_logits[j].begin(), step_logits[j].end(), res.decode_logits[j].data_as<float>());
    }
  }
  for (size_t j = 0; j < n; ++j) pools[static_cast<size_t>(group_of(j))]->free(pages[j]);
  for (auto& p : pools) {
    p->check_integrity();
    MLA_CHECK(p->num_free() == p->num_pages(), "offline run leaked pages");
  }
  return res;
}

}  // namespace

OfflineResult run_offline(DeepseekModel& model, const std::vector<std::vector<int32_t>>& prompts,
                          const OfflineOptions& opts) {
  int32_t total = 0;
  for (const auto& p : prompts) total += pages_for(p, opts);
  KvCache cache(model.backend(), model.config(), std::max(total, 1), opts.page_size, opts.kv_cache_fp8);
  return drive(model.config().vocab_size, 1, prompts, opts, [&](const std::vector<const ForwardBatch*>& b) {
    return std::vector<Tensor>{model.backend().to_host_f32(model.forward(*b[0], cache, opts.form))};
  });
}

OfflineResult run_offline(RankSet& ranks, const std::vector<std::vector<int32_t>>& prompts, const OfflineOptions& opts) {
  const int32_t groups = ranks.dp_groups();
  std::vector<int32_t> group_pages(static_cast<size_t>(groups), 0);
  for (size_t j = 0; j < prompts.size(); ++j) group_pages[j % static_cast<size_t>(groups)] += pages_for(prompts[j], opts);
  ranks.allocate_kv(std::max(1, *std::max_element(group_pages.begin(), group_pages.end())), opts.page_size);
  return drive(ranks.config().vocab_size, groups, prompts, opts, [&](const std::vector<const ForwardBatch*>& b) {
    std::vector<std::vector<RowSampling>> greedy(b.size());
    LogitRows all(b.size());  // every row's logits
    for (size_t g = 0; g < b.size(); ++g) {
      if (!b[g]) continue;
      greedy[g].resize(b[g]->logit_rows.size());
      all[g].resize(b[g]->logit_rows.size());
      std::iota(all[g].begin(), all[g].end(), 0);
    }
    std::vector<GroupOutput> outs = ranks.step(b, greedy, all, opts.form);
    std::vector<Tensor> logits;
    for (auto& o : outs) logits.push_back(o.logits);
    return logits;
  });
}

}  // namespace mlaserve
