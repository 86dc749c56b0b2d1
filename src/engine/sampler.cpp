#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/random.h"

namespace mlaserve {

void SamplerState::observe_prompt(std::span<const int32_t> ids) {
  for (int32_t id : ids) ++seen[id];
}

void SamplerState::observe_output(int32_t id) {
  ++output_counts[id];
  ++seen[id];
}

int32_t argmax_row(const float* x, int64_t n) {
  int32_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = static_cast<int32_t>(i);
  return best;
}

namespace {

// Fills lp with log_softmax(x).
void log_softmax(const float* x, int64_t n, std::vector<float>& lp) {
  lp.resize(static_cast<size_t>(n));
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(static_cast<double>(x[i] - m));
  const float lse = m + static_cast<float>(std::log(s));
  for (int64_t i = 0; i < n; ++i) lp[i] = x[i] - lse;
}

}  // namespace

SampleResult sample_row(const float* raw, int64_t V, const SamplingParams& p, SamplerState& st,
                        std::vector<float>& x) {
  SampleResult r;
  x.assign(raw, raw + V);
  if (p.repetition_penalty != 1.0f)
    for (const auto& [id, _] : st.seen) {
      if (id < 0 || id >= V) continue;
      float& v = x[static_cast<size_t>(id)];
      v = v > 0 ? v / p.repetition_penalty : v * p.repetition_penalty;
    }
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f)
    for (const auto& [id, count] : st.output_counts) {
      if (id < 0 || id >= V) continue;
      x[static_cast<size_t>(id)] -= p.frequency_penalty * static_cast<float>(count) + p.presence_penalty;
    }

  if (p.temperature <= 0.0f || p.top_k == 1) {
    r.token = argmax_row(x.data(), V);
  } else {
    // Probabilities at this temperature, then the filters, on the candidates sorted by probability.
    const float inv_t = 1.0f / p.temperature;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < V; ++i) m = std::max(m, x[i]);
    std::vector<int32_t> idx(static_cast<size_t>(V));
    std::iota(idx.begin(), idx.end(), 0);
    std::vector<float> prob(static_cast<size_t>(V));
    double total = 0.0;
    for (int64_t i = 0; i < V; ++i) {
      prob[i] = std::exp((x[i] - m) * inv_t);
      total += prob[i];
    }
    int64_t keep = V;
    if (p.top_k > 0 && p.top_k < V) keep = p.top_k;
    auto by_prob = [&](int32_t a, int32_t b) { return prob[a] > prob[b] || (prob[a] == prob[b] && a < b); };
    if (keep < V) {
      std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), by_prob);
    } else {
      std::sort(idx.begin(), idx.end(), by_prob);
    }
    double kept = 0.0;
    for (int64_t i = 0; i < keep; ++i) kept += prob[idx[i]];
    if (p.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p (of the top-k mass)
      double c = 0.0;
      int64_t n = 0;
      while (n < keep) {
        c += prob[idx[n]];
        ++n;
        if (c >= p.top_p * kept) break;
      }
      keep = std::max<int64_t>(n, 1);
    }
    if (p.min_p > 0.0f) {  // drop candidates below min_p * the best one
      const float thr = p.min_p * prob[idx[0]];
      int64_t n = 1;
      while (n < keep && prob[idx[n]] >= thr) ++n;
      keep = n;
    }
    kept = 0.0;
    for (int64_t i = 0; i < keep; ++i) kept += prob[idx[i]];
    const uint64_t r64 = splitmix64(st.seed ^ splitmix64(st.step * 0x9e3779b97f4a7c15ull + 1));
    const double u = static_cast<double>(r64 >> 11) * (1.0 / 9007199254740992.0) * kept;
    double c = 0.0;
    r.token = idx[static_cast<size_t>(keep - 1)];
    for (int64_t i = 0; i < keep; ++i) {
      c += prob[idx[i]];
      if (u < c) {
        r.token = idx[i];
        break;
      }
    }
    (void)total;
  }
  ++st.step;

  if (p.return_logprob || p.top_logprobs_num > 0) {
    std::vector<float> lp;
    log_softmax(raw, V, lp);
    r.logprob.token = r.token;
    r.logprob.logprob = lp[static_cast<size_t>(r.token)];
    const int64_t k = std::min<int64_t>(p.top_logprobs_num, V);
    if (k > 0) {
      std::vector<int32_t> idx(static_cast<size_t>(V));
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                        [&](int32_t a, int32_t b) { return lp[a] > lp[b] || (lp[a] == lp[b] && a < b); });
      for (int64_t i = 0; i < k; ++i) r.logprob.top.emplace_back(idx[i], lp[idx[i]]);
    }
  }
  return r;
}

}  // namespace mlaserve
