#include "backend/cpu/cpu_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "core/penalty.h"
#include "core/random.h"
#include "core/thread_pool.h"

namespace mlaserve::cpu {

namespace {
// Every E4M3 code's value (checkpoint loading converts billions of them).
const std::array<float, 256> kF8E4M3 = [] {
  std::array<float, 256> t{};
  for (int v = 0; v < 256; ++v) t[static_cast<size_t>(v)] = f8e4m3_to_f32(static_cast<uint8_t>(v));
  return t;
}();
// Every E5M2 code's value (an E5M2 latent cache).
const std::array<float, 256> kF8E5M2 = [] {
  std::array<float, 256> t{};
  for (int v = 0; v < 256; ++v) t[static_cast<size_t>(v)] = f8e5m2_to_f32(static_cast<uint8_t>(v));
  return t;
}();
}  // namespace

void dequant_fp8(const uint8_t* w, const float* scale, int64_t B, int64_t R, int64_t C, int64_t block_rows,
                 int64_t block_cols, float* out) {
  const int64_t sr = (R + block_rows - 1) / block_rows, sc = (C + block_cols - 1) / block_cols;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = (b * R + r) * C + c;
        out[i] = kF8E4M3[w[i]] * scale[(b * sr + r / block_rows) * sc + c / block_cols];
      }
}

void dequant_int4(const uint8_t* w, const float* scale, const float* zero, int64_t B, int64_t R, int64_t C,
                  int64_t group, float* out) {
  const int64_t G = (C + group - 1) / group;
  parallel_for(B * R, 16, [&](int64_t rb, int64_t re) {
    for (int64_t row = rb; row < re; ++row)
      for (int64_t c = 0; c < C; ++c) {
        const int32_t code = (w[row * (C / 2) + c / 2] >> (4 * (c & 1))) & 15;
        const int64_t g = row * G + c / group;
        out[row * C + c] = (static_cast<float>(code) - zero[g]) * scale[g];
      }
  });
}

void quantize_fp8(const float* w, int64_t R, int64_t C, int64_t block_rows, int64_t block_cols, uint8_t* codes,
                  float* scales) {
  const int64_t sr = (R + block_rows - 1) / block_rows, sc = (C + block_cols - 1) / block_cols;
  parallel_for(sr, 1, [&](int64_t ib, int64_t ie) {
    for (int64_t i = ib; i < ie; ++i)
      for (int64_t j = 0; j < sc; ++j) {
        const int64_t r1 = std::min(R, (i + 1) * block_rows), c0 = j * block_cols, c1 = std::min(C, c0 + block_cols);
        float amax = 0.0f;
        for (int64_t r = i * block_rows; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * C + c]));
        const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
        scales[i * sc + j] = s;
        for (int64_t r = i * block_rows; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) codes[r * C + c] = f32_to_e4m3(w[r * C + c] / s);
      }
  });
}

void convert(const void* src, DType sd, void* dst, DType dd, int64_t n) {
  if (sd == dd) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(sd));
    return;
  }
  auto load = [&](int64_t i) -> float {
    switch (sd) {
      case DType::F32: return static_cast<const float*>(src)[i];
      case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
      case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
      case DType::F8_E4M3: return kF8E4M3[static_cast<const uint8_t*>(src)[i]];
      case DType::F8_E5M2: return kF8E5M2[static_cast<const uint8_t*>(src)[i]];
      case DType::I32: return static_cast<float>(static_cast<const int32_t*>(src)[i]);
      default: fail("convert: unsupported source dtype {}", dtype_name(sd));
    }
  };
  if (dd == DType::F32) {
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = load(i);
  } else if (dd == DType::BF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(load(i));
  } else if (dd == DType::F8_E4M3) {
    uint8_t* d = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_e4m3(load(i));
  } else if (dd == DType::F8_E5M2) {
    uint8_t* d = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_e5m2(load(i));
  } else {
    fail("convert: unsupported destination dtype {}", dtype_name(dd));
  }
}

void count_experts(const int32_t* ids, int64_t rows, int32_t k, const int32_t* pairs, int32_t npairs, int32_t E,
                   int64_t* counts) {
  auto count_rows = [&](int64_t first, int64_t n) {
    const int64_t end = std::min(rows, first + std::max<int64_t>(n, 0));
    for (int64_t r = std::max<int64_t>(first, 0); r < end; ++r)
      for (int32_t j = 0; j < k; ++j) {
        const int32_t e = ids[r * k + j];
        if (e >= 0 && e < E) ++counts[e];
      }
  };
  if (!pairs) {
    count_rows(0, rows);
    return;
  }
  for (int32_t p = 0; p < npairs; ++p) count_rows(pairs[2 * p], pairs[2 * p + 1]);
}

void resolve_prev_ids(int32_t* ids, int64_t n, const int32_t* prev, int64_t n_prev) {
  for (int64_t t = 0; t < n; ++t)
    if (ids[t] < 0) {
      const int64_t k = -static_cast<int64_t>(ids[t]) - 1;
      ids[t] = k < n_prev ? prev[k] : 0;
    }
}

void rmsnorm_row(const float* x, const float* w, int64_t D, float eps, float* out) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = w[d] * (x[d] * inv);
}

void silu_mul_row(const float* gu, int64_t I, float* out) {
  for (int64_t i = 0; i < I; ++i) {
    const float g = gu[i];
    out[i] = g / (1.0f + std::exp(-g)) * gu[I + i];
  }
}

void rope_pairs(float* x, int64_t dim, int32_t pos, const float* inv_freq, float factor) {
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float ang = inv_freq[i] * static_cast<float>(pos);
    const float c = std::cos(ang) * factor, s = std::sin(ang) * factor;
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = x0 * c - x1 * s;
    x[2 * i + 1] = x0 * s + x1 * c;
  }
}

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void weight_rows_to_f32(const void* w, DType wd, int64_t K, int64_t row0, int64_t nrows, float* buf) {
  if (wd == DType::F32) {
    std::memcpy(buf, static_cast<const float*>(w) + row0 * K, static_cast<size_t>(nrows * K) * sizeof(float));
  } else {
    MLA_CHECK(wd == DType::BF16, "cpu linear: unsupported weight dtype {}", dtype_name(wd));
    const uint16_t* p = static_cast<const uint16_t*>(w) + row0 * K;
    for (int64_t i = 0; i < nrows * K; ++i) buf[i] = bf16_to_f32(p[i]);
  }
}

void linear_block(const float* x, int64_t N, int64_t K, const void* w, DType wd, int64_t M, float* y, int64_t b,
                  int64_t e) {
  constexpr int64_t kRows = 16;
  std::vector<float> buf(static_cast<size_t>(kRows * K));
  for (int64_t o0 = b; o0 < e; o0 += kRows) {
    const int64_t nr = std::min(kRows, e - o0);
    weight_rows_to_f32(w, wd, K, o0, nr, buf.data());
    for (int64_t n = 0; n < N; ++n) {
      const float* xr = x + n * K;
      float* yr = y + n * M + o0;
      for (int64_t j = 0; j < nr; ++j) yr[j] = dot(xr, buf.data() + j * K, K);
    }
  }
}

}  // namespace

void linear(const float* x, int64_t N, int64_t K, const void* w, DType wd, int64_t M, float* y, bool parallel) {
  if (N == 0 || M == 0) return;
  if (!parallel) {
    linear_block(x, N, K, w, wd, M, y, 0, M);
    return;
  }
  parallel_for(M, 16, [&](int64_t b, int64_t e) { linear_block(x, N, K, w, wd, M, y, b, e); });
}

namespace {

// Weights of one head's W_UK ([nope, kvr]) or W_UV ([v, kvr]) rows of kv_b, as fp32.
std::vector<float> head_rows(const void* kv_b, DType dt, int64_t kvr, int64_t row0, int64_t nrows) {
  std::vector<float> out(static_cast<size_t>(nrows * kvr));
  weight_rows_to_f32(kv_b, dt, kvr, row0, nrows, out.data());
  return out;
}

void softmax_inplace(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

inline int64_t slot_of(const ForwardBatch& b, int32_t seq, int64_t pos) {
  const int32_t page = b.page_table[static_cast<size_t>(seq) * b.max_pages + pos / b.page_size];
  return static_cast<int64_t>(page) * b.page_size + pos % b.page_size;
}

// Cache row `slot` as F32: in place, or (an FP8 cache) its codes' values written to buf [cache_width].
const float* cache_row(const MlaArgs& a, int64_t slot, float* buf) {
  if (!a.cache_f8) return a.cache + slot * a.cache_width;
  const uint8_t* codes = a.cache_f8 + slot * a.cache_width;
  const std::array<float, 256>& value = a.cache_e5m2 ? kF8E5M2 : kF8E4M3;
  for (int64_t i = 0; i < a.cache_width; ++i) buf[i] = value[codes[i]];
  return buf;
}

// Absorbed form for one token and one head: attention over the 576-wide latent with one KV head.
void absorbed_token_head(const MlaArgs& a, int64_t t, int64_t h, const std::vector<float>& w_uk,
                         const std::vector<float>& w_uv, std::vector<float>& scratch) {
  const auto& b = *a.batch;
  const MlaParams& p = a.p;
  const int64_t kvr = p.kv_lora, hd = p.qk_nope + p.qk_rope;
  const int32_t seq = b.token_seq[static_cast<size_t>(t)];
  const int64_t ctx = b.positions[static_cast<size_t>(t)] + 1;  // causal: positions 0..pos
  const float* q = a.q + (t * p.num_heads + h) * hd;
  // q_lat[c] = sum_n q_nope[n] * W_UK[n, c]
  scratch.assign(static_cast<size_t>(kvr + ctx + kvr + a.cache_width), 0.0f);
  float* q_lat = scratch.data();
  float* scores = q_lat + kvr;
  float* o_lat = scores + ctx;
  float* row_buf = o_lat + kvr;
  for (int64_t n = 0; n < p.qk_nope; ++n) {
    const float qn = q[n];
    const float* wr = w_uk.data() + n * kvr;
    for (int64_t c = 0; c < kvr; ++c) q_lat[c] += qn * wr[c];
  }
  for (int64_t j = 0; j < ctx; ++j) {
    const float* row = cache_row(a, slot_of(b, seq, j), row_buf);
    scores[j] = (dot(q_lat, row, kvr) + dot(q + p.qk_nope, row + kvr, p.qk_rope)) * p.softmax_scale;
  }
  softmax_inplace(scores, ctx);
  for (int64_t j = 0; j < ctx; ++j) {
    const float* row = cache_row(a, slot_of(b, seq, j), row_buf);
    const float pj = scores[j];
    for (int64_t c = 0; c < kvr; ++c) o_lat[c] += pj * row[c];
  }
  float* out = a.out + (t * p.num_heads + h) * p.v_head;
  for (int64_t v = 0; v < p.v_head; ++v) out[v] = dot(w_uv.data() + v * kvr, o_lat, kvr);
}

}  // namespace

void mla_attention(const MlaArgs& a) {
  const ForwardBatch& b = *a.batch;
  const MlaParams& p = a.p;
  const int64_t nh = p.num_heads, kvr = p.kv_lora, nope = p.qk_nope, rope = p.qk_rope, vh = p.v_head;
  const int64_t hd = nope + rope;
  MLA_CHECK(a.cache_width == kvr + rope, "mla_attention: cache width {} != kv_lora + rope {}", a.cache_width, kvr + rope);

  // Which sequences take which form.
  std::vector<int32_t> absorbed_seqs, expanded_seqs;
  for (int32_t s = 0; s < b.num_seqs(); ++s) {
    const bool absorbed = p.form == MlaForm::Absorbed || (p.form == MlaForm::Auto && b.absorbed_under_auto(s));
    (absorbed ? absorbed_seqs : expanded_seqs).push_back(s);
  }

  if (!absorbed_seqs.empty()) {
    // Per-head W_UK / W_UV in fp32, shared by all tokens.
    std::vector<std::vector<float>> w_uk(nh), w_uv(nh);
    parallel_for(nh, 1, [&](int64_t hb, int64_t he) {
      for (int64_t h = hb; h < he; ++h) {
        w_uk[h] = head_rows(a.kv_b, a.kv_b_dtype, kvr, h * (nope + vh), nope);
        w_uv[h] = head_rows(a.kv_b, a.kv_b_dtype, kvr, h * (nope + vh) + nope, vh);
      }
    });
    std::vector<int64_t> tokens;
    for (int32_t s : absorbed_seqs)
      for (int32_t t = b.seq_q_start[s]; t < b.seq_q_start[s + 1]; ++t) tokens.push_back(t);
    const int64_t work = static_cast<int64_t>(tokens.size()) * nh;
    parallel_for(work, 4, [&](int64_t wb, int64_t we) {
      std::vector<float> scratch;
      for (int64_t w = wb; w < we; ++w) absorbed_token_head(a, tokens[w / nh], w % nh, w_uk[w % nh], w_uv[w % nh], scratch);
    });
  }

  for (int32_t s : expanded_seqs) {
    // Expanded form: k_nope and v for every context position from kv_b_proj(c_kv); MHA with a shared k_pe.
    const int64_t L = b.seq_lens[s];
    std::vector<float> ckv(static_cast<size_t>(L * kvr)), k_pe(static_cast<size_t>(L * rope)), row_buf(a.cache_width);
    for (int64_t j = 0; j < L; ++j) {
      const float* row = cache_row(a, slot_of(b, s, j), row_buf.data());
      std::memcpy(ckv.data() + j * kvr, row, kvr * sizeof(float));
      std::memcpy(k_pe.data() + j * rope, row + kvr, rope * sizeof(float));
    }
    const int64_t kvw = nh * (nope + vh);
    std::vector<float> kv(static_cast<size_t>(L * kvw));  // [L, nh, nope + v]
    linear(ckv.data(), L, kvr, a.kv_b, a.kv_b_dtype, kvw, kv.data(), true);
    const int32_t t0 = b.seq_q_start[s], t1 = b.seq_q_start[s + 1];
    parallel_for(static_cast<int64_t>(t1 - t0) * nh, 4, [&](int64_t wb, int64_t we) {
      std::vector<float> scores;
      for (int64_t w = wb; w < we; ++w) {
        const int64_t t = t0 + w / nh, h = w % nh;
        const int64_t ctx = b.positions[static_cast<size_t>(t)] + 1;
        const float* q = a.q + (t * nh + h) * hd;
        scores.resize(static_cast<size_t>(ctx));
        for (int64_t j = 0; j < ctx; ++j) {
          const float* k_nope = kv.data() + j * kvw + h * (nope + vh);
          scores[j] = (dot(q, k_nope, nope) + dot(q + nope, k_pe.data() + j * rope, rope)) * p.softmax_scale;
        }
        softmax_inplace(scores.data(), ctx);
        float* out = a.out + (t * nh + h) * vh;
        std::fill(out, out + vh, 0.0f);
        for (int64_t j = 0; j < ctx; ++j) {
          const float* v = kv.data() + j * kvw + h * (nope + vh) + nope;
          const float pj = scores[j];
          for (int64_t d = 0; d < vh; ++d) out[d] += pj * v[d];
        }
      }
    });
  }
  (void)hd;
}

namespace {
// Monotone map of floats to unsigned integers (larger float, larger key): thresholds compare these.
inline uint32_t ordered_key(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
}  // namespace

void count_token(std::vector<std::pair<int32_t, int32_t>>& counts, int32_t id) {
  for (auto& [tok, cnt] : counts)
    if (tok == id) {
      ++cnt;
      return;
    }
  counts.emplace_back(id, 1);
}

void sample_row(const float* logits, int64_t V, const RowSampling& sp, float* x, int32_t* id, float* logprob) {
  std::copy(logits, logits + V, x);
  if (sp.allowed) {
    const std::vector<uint32_t>& m = *sp.allowed;
    for (int64_t v = 0; v < V; ++v)
      if (static_cast<size_t>(v / 32) >= m.size() || !(m[static_cast<size_t>(v / 32)] >> (v % 32) & 1u))
        x[v] = -std::numeric_limits<float>::infinity();
  }
  for (const auto& [tok, bias] : sp.logit_bias)
    if (tok >= 0 && tok < V) x[tok] += bias;
  for (const auto& [tok, cnt] : sp.penalty_counts) {
    if (tok < 0 || tok >= V || cnt <= 0) continue;
    x[tok] = penalised_logit(x[tok], sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty, cnt);
  }
  const bool greedy = sp.temperature <= 0.0f;
  if (!greedy)
    for (int64_t v = 0; v < V; ++v) x[v] = x[v] / sp.temperature;
  int64_t best = 0;
  for (int64_t v = 1; v < V; ++v)
    if (x[v] > x[best]) best = v;
  const float xmax = x[best];
  float z = 0.0f;
  for (int64_t v = 0; v < V; ++v) z += std::exp(x[v] - xmax);
  const float log_z = std::log(z);
  if (greedy) {
    *id = static_cast<int32_t>(best);
    *logprob = -log_z;
    return;
  }
  // top-k: key of the k-th largest logit; keep keys >= it.
  std::vector<uint32_t> keys(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) keys[v] = ordered_key(x[v]);
  uint32_t kth_key = 0;
  if (sp.top_k > 0 && sp.top_k < V) {
    std::vector<uint32_t> k2 = keys;
    std::nth_element(k2.begin(), k2.begin() + (sp.top_k - 1), k2.end(), std::greater<uint32_t>());
    kth_key = k2[static_cast<size_t>(sp.top_k - 1)];
  }
  // top-p over the top-k set: the largest key whose mass of keys >= it reaches top_p of the set's mass.
  uint32_t p_key = 0;
  if (sp.top_p < 1.0f) {
    std::vector<int64_t> order;
    float zk = 0.0f;
    for (int64_t v = 0; v < V; ++v)
      if (keys[v] >= kth_key) {
        order.push_back(v);
        zk += std::exp(x[v] - xmax);
      }
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys[a] > keys[b] || (keys[a] == keys[b] && a < b); });
    const float target = sp.top_p * zk;
    float cum = 0.0f;
    p_key = keys[order.front()];
    for (int64_t v : order) {
      cum += std::exp(x[v] - xmax);
      p_key = keys[v];
      if (cum >= target) break;
    }
  }
  const uint32_t min_key = std::max(kth_key, p_key);
  float best_s = -std::numeric_limits<float>::infinity();
  int64_t chosen = -1;
  for (int64_t v = 0; v < V; ++v) {
    if (keys[v] < min_key) continue;
    if (sp.min_p > 0.0f && std::exp(x[v] - xmax) < sp.min_p) continue;
    const float u = open_uniform(sp.seed, sp.step, static_cast<uint64_t>(v));
    const float s = x[v] - std::log(-std::log(u));
    if (chosen < 0 || s > best_s) {
      best_s = s;
      chosen = v;
    }
  }
  *id = static_cast<int32_t>(chosen);
  *logprob = x[chosen] - xmax - log_z;
}

void route_token(const float* logits, const float* bias, int64_t E, const RouterParams& p, int32_t* ids, float* weights) {
  std::vector<float> s(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  if (p.scoring == ScoringFunc::Softmax) {
    std::copy(logits, logits + E, s.begin());
    softmax_inplace(s.data(), E);
  } else {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  }
  for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + (bias ? bias[e] : 0.0f);

  const float ninf = -std::numeric_limits<float>::infinity();
  if (p.method != TopkMethod::Greedy && p.n_group > 1) {
    const int64_t per = E / p.n_group;
    std::vector<float> gscore(static_cast<size_t>(p.n_group));
    for (int64_t g = 0; g < p.n_group; ++g) {
      const float* c = choice.data() + g * per;
      if (p.method == TopkMethod::NoauxTc) {  // sum of the two best in the group
        float b1 = ninf, b2 = ninf;
        for (int64_t i = 0; i < per; ++i) {
          if (c[i] > b1) { b2 = b1; b1 = c[i]; }
          else if (c[i] > b2) b2 = c[i];
        }
        gscore[g] = per >= 2 ? b1 + b2 : b1;
      } else {  // group_limited_greedy: best in the group
        gscore[g] = *std::max_element(c, c + per);
      }
    }
    std::vector<int32_t> gorder(static_cast<size_t>(p.n_group));
    std::iota(gorder.begin(), gorder.end(), 0);
    std::stable_sort(gorder.begin(), gorder.end(), [&](int32_t x, int32_t y) { return gscore[x] > gscore[y]; });
    std::vector<char> keep(static_cast<size_t>(p.n_group), 0);
    for (int32_t i = 0; i < p.topk_group; ++i) keep[gorder[i]] = 1;
    for (int64_t e = 0; e < E; ++e)
      if (!keep[e / per]) choice[e] = ninf;
  }
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + p.top_k, order.end(), [&](int32_t x, int32_t y) {
    return choice[x] > choice[y] || (choice[x] == choice[y] && x < y);
  });
  float sum = 0.0f;
  for (int32_t i = 0; i < p.top_k; ++i) {
    ids[i] = order[i];
    weights[i] = s[order[i]];
    sum += weights[i];
  }
  if (p.norm_topk_prob) {
    const float denom = sum + 1e-20f;
    for (int32_t i = 0; i < p.top_k; ++i) weights[i] /= denom;
  }
  for (int32_t i = 0; i < p.top_k; ++i) weights[i] *= p.routed_scaling_factor;
  for (int32_t j = 0; j < p.n_fixed; ++j) {
    ids[p.top_k + j] = p.fixed_base + j;
    weights[p.top_k + j] = 1.0f;
  }
}

void moe_experts(const MoeArgs& a) {
  const int64_t T = a.T, H = a.H, k = a.k, I = a.I, E = a.E;
  std::fill(a.out, a.out + T * H, 0.0f);
  if (T == 0) return;
  // Assignments (token, slot) per local expert.
  std::vector<std::vector<int64_t>> assigned(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = static_cast<int64_t>(a.ids[t * k + j]) - a.expert_begin;
      if (e >= 0 && e < E) assigned[e].push_back(t * k + j);
    }
  // Each assignment's expert output, weighted, in its own row: summing per token afterwards in slot order keeps
  // the result independent of which other tokens are in the batch.
  std::vector<float> contrib(static_cast<size_t>(T * k * H), 0.0f);
  std::vector<char> has(static_cast<size_t>(T * k), 0);
  const size_t esz = dtype_size(a.wdtype);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (!assigned[e].empty()) active.push_back(e);
  parallel_for(static_cast<int64_t>(active.size()), 1, [&](int64_t b, int64_t en) {
    std::vector<float> xs, gu, act, y;
    for (int64_t ai = b; ai < en; ++ai) {
      const int64_t e = active[ai];
      const auto& rows = assigned[e];
      const int64_t n = static_cast<int64_t>(rows.size());
      xs.resize(static_cast<size_t>(n * H));
      for (int64_t i = 0; i < n; ++i) std::memcpy(xs.data() + i * H, a.x + (rows[i] / k) * H, H * sizeof(float));
      gu.resize(static_cast<size_t>(n * 2 * I));
      act.resize(static_cast<size_t>(n * I));
      y.resize(static_cast<size_t>(n * H));
      linear(xs.data(), n, H, static_cast<const char*>(a.gate_up) + e * 2 * I * H * esz, a.wdtype, 2 * I, gu.data(), false);
      for (int64_t i = 0; i < n; ++i) silu_mul_row(gu.data() + i * 2 * I, I, act.data() + i * I);
      linear(act.data(), n, I, static_cast<const char*>(a.down) + e * H * I * esz, a.wdtype, H, y.data(), false);
      for (int64_t i = 0; i < n; ++i) {
        const float w = a.weights[rows[i]];
        float* dst = contrib.data() + rows[i] * H;
        for (int64_t d = 0; d < H; ++d) dst[d] = w * y[i * H + d];
        has[rows[i]] = 1;
      }
    }
  });
  parallel_for(T, 16, [&](int64_t b, int64_t en) {
    for (int64_t t = b; t < en; ++t)
      for (int64_t j = 0; j < k; ++j) {
        if (!has[t * k + j]) continue;
        const float* c = contrib.data() + (t * k + j) * H;
        for (int64_t d = 0; d < H; ++d) a.out[t * H + d] += c[d];
      }
  });
}

}  // namespace mlaserve::cpu
