#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace mlaserve {

RowSampling SamplerState::row(const SamplingParams& p) const {
  RowSampling r;
  r.temperature = p.temperature;
  r.top_k = p.top_k > 0 ? p.top_k : 0;
  r.top_p = p.top_p;
  r.min_p = p.min_p;
  r.frequency_penalty = p.frequency_penalty;
  r.presence_penalty = p.presence_penalty;
  r.repetition_penalty = p.repetition_penalty;
  r.seed = seed;
  r.step = step;
  r.logit_bias = p.logit_bias;
  if (penalised(p)) {
    r.penalty_counts.assign(output_counts.begin(), output_counts.end());
    std::sort(r.penalty_counts.begin(), r.penalty_counts.end());
  }
  return r;
}

bool needs_previous_token(const SamplingParams& p) {
  return p.constraint != nullptr ||
         std::any_of(p.bad_words_ids.begin(), p.bad_words_ids.end(), [](const auto& w) { return w.size() > 1; });
}

void ban_token(RowSampling& row, int32_t id) {
  for (auto& [tok, bias] : row.logit_bias)
    if (tok == id) {
      bias = -std::numeric_limits<float>::infinity();
      return;
    }
  row.logit_bias.emplace_back(id, -std::numeric_limits<float>::infinity());
}

void ban_bad_words(const SamplingParams& p, std::span<const int32_t> output, RowSampling& row) {
  for (const std::vector<int32_t>& w : p.bad_words_ids) {
    if (w.empty() || w.size() - 1 > output.size()) continue;
    if (std::equal(w.begin(), w.end() - 1, output.end() - static_cast<std::ptrdiff_t>(w.size() - 1)))
      ban_token(row, w.back());
  }
}

std::shared_ptr<const std::vector<uint32_t>> token_mask(std::span<const int32_t> ids) {
  auto m = std::make_shared<std::vector<uint32_t>>();
  for (int32_t id : ids) {
    if (id < 0) continue;
    const size_t w = static_cast<size_t>(id / 32);
    if (w >= m->size()) m->resize(w + 1, 0u);
    (*m)[w] |= 1u << (id % 32);
  }
  return m;
}

void restrict_to(RowSampling& row, const std::shared_ptr<const std::vector<uint32_t>>& mask) {
  if (!mask) return;
  if (!row.allowed) {
    row.allowed = mask;
    return;
  }
  auto both = std::make_shared<std::vector<uint32_t>>(std::min(row.allowed->size(), mask->size()));
  for (size_t i = 0; i < both->size(); ++i) (*both)[i] = (*row.allowed)[i] & (*mask)[i];
  row.allowed = std::move(both);
}

int32_t argmax_row(const float* x, int64_t n) {
  int32_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = static_cast<int32_t>(i);
  return best;
}

TokenLogprob top_logprobs(const float* x, int64_t V, int32_t token, int32_t n, std::span<const int32_t> ids) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) m = std::max(m, x[i]);
  double s = 0.0;
  for (int64_t i = 0; i < V; ++i) s += std::exp(static_cast<double>(x[i] - m));
  const float lse = m + static_cast<float>(std::log(s));
  TokenLogprob out;
  out.token = token;
  out.logprob = x[token] - lse;
  out.rank = 1 + static_cast<int32_t>(std::count_if(x, x + V, [&](float v) { return v > x[token]; }));
  const int64_t k = std::min<int64_t>(n, V);
  if (k > 0) {
    std::vector<int32_t> idx(static_cast<size_t>(V));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
    for (int64_t i = 0; i < k; ++i) out.top.emplace_back(idx[i], x[idx[i]] - lse);
  }
  out.ids.reserve(ids.size());
  for (int32_t id : ids) out.ids.emplace_back(id, x[id] - lse);
  return out;
}

}  // namespace mlaserve
