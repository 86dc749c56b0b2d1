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

int32_t argmax_row(const float* x, int64_t n) {
  int32_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = static_cast<int32_t>(i);
  return best;
}

TokenLogprob top_logprobs(const float* x, int64_t V, int32_t token, int32_t n) {
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
  return out;
}

}  // namespace mlaserve
