// The CPU backend: reference semantics for every op (fp32 activations and latent cache, bf16 or fp32
// weights, fp32 accumulation), multi-threaded with the core thread pool. Every result row depends only on
// its own inputs, never on which other rows share the batch, so a request's logits are the same alone or
// in any batch.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "core/random.h"
#include "core/thread_pool.h"

namespace mlaserve {

namespace {

const float* f32(const Tensor& t) {
  MLA_CHECK(t.dtype() == DType::F32, "cpu backend: expected an F32 tensor, got {}", dtype_name(t.dtype()));
  return t.data_as<const float>();
}
float* f32m(Tensor& t) {
  MLA_CHECK(t.dtype() == DType::F32, "cpu backend: expected an F32 tensor, got {}", dtype_name(t.dtype()));
  return t.data_as<float>();
}
int64_t rows_of(const Tensor& t) { return t.dim() == 0 ? 1 : t.numel() / t.size(-1); }

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  Device device() const override { return Device::CPU; }
  DType act_dtype() const override { return DType::F32; }
  DType weight_dtype(DType src) const override { return src == DType::BF16 ? DType::BF16 : DType::F32; }

  Tensor alloc(const Shape& shape, DType dtype) override {
    Tensor t = Tensor::empty_host(shape, dtype);
    std::lock_guard<std::mutex> lk(held_mu_);
    std::erase_if(held_, [](const Held& h) { return h.storage.expired(); });
    held_.push_back(Held{t.storage(), t.data(), t.nbytes()});
    return t;
  }
  // The memory stays (the host's); released, every persistent byte still in use becomes zero, as a device's would be
  // lost, and writing it before resume_persistent is an error the callers must not make (not checked).
  void release_persistent() override {
    std::lock_guard<std::mutex> lk(held_mu_);
    for (const Held& h : held_)
      if (auto keep = h.storage.lock()) std::memset(h.data, 0, h.bytes);
  }
  void resume_persistent() override {}
  Tensor scratch(const Shape& shape, DType dtype) override { return Tensor::empty_host(shape, dtype); }

  void zero(Tensor& t) override { std::memset(t.data(), 0, t.nbytes()); }

  void copy(const Tensor& src, Tensor& dst) override {
    MLA_CHECK(src.nbytes() == dst.nbytes() && src.dtype() == dst.dtype(), "copy: {} {} into {} {}",
              dtype_name(src.dtype()), shape_str(src.shape()), dtype_name(dst.dtype()), shape_str(dst.shape()));
    if (src.data() != dst.data()) std::memcpy(dst.data(), src.data(), src.nbytes());
  }

  Tensor upload(const Tensor& host, DType dtype) override {
    Tensor out = Tensor::empty_host(host.shape(), dtype);
    cpu::convert(host.data(), host.dtype(), out.data(), dtype, host.numel());
    return out;
  }

  void upload_into(const Tensor& host, Tensor& dst) override {
    MLA_CHECK(host.numel() == dst.numel(), "upload_into: {} elements into {}", host.numel(), dst.numel());
    cpu::convert(host.data(), host.dtype(), dst.data(), dst.dtype(), host.numel());
  }

  void download(const Tensor& t, void* dst) override { std::memcpy(dst, t.data(), t.nbytes()); }

  void sample(const Tensor& logits, std::span<const RowSampling> params, Tensor& ids, Tensor* logprobs) override {
    const int64_t V = logits.size(-1), R = check_sample(logits, params, ids, logprobs, step_.num_tokens());
    const float* lp = f32(logits);
    int32_t* out = ids.data_as<int32_t>();
    float* lpo = logprobs ? f32m(*logprobs) : nullptr;
    parallel_for(R, 1, [&](int64_t b, int64_t e) {
      std::vector<float> work(static_cast<size_t>(V));
      for (int64_t r = b; r < e; ++r) {
        float l = 0.0f;
        const RowSampling& sp = params[static_cast<size_t>(r)];
        if (sp.pending_input >= 0) {
          RowSampling with = sp;
          with.pending_input = -1;
          cpu::count_token(with.penalty_counts, step_.input_ids[static_cast<size_t>(sp.pending_input)]);
          cpu::sample_row(lp + r * V, V, with, work.data(), out + r, &l);
        } else {
          cpu::sample_row(lp + r * V, V, sp, work.data(), out + r, &l);
        }
        if (lpo) lpo[r] = l;
      }
    });
  }

  Tensor to_host_f32(const Tensor& t) override {
    Tensor out = Tensor::empty_host(t.shape(), DType::F32);
    cpu::convert(t.data(), t.dtype(), out.data(), DType::F32, t.numel());
    return out;
  }

  void fill_random(Tensor& t, uint64_t seed, float mean, float stddev, int64_t full_cols, int64_t row_offset,
                   int64_t col_offset) override {
    const int64_t cols = t.dim() == 0 ? 1 : t.size(-1);
    const int64_t rows = t.numel() / std::max<int64_t>(cols, 1);
    parallel_for(rows, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const uint64_t idx = static_cast<uint64_t>((r + row_offset) * full_cols + c + col_offset);
          const float v = mean + stddev * unit_uniform(seed, idx);
          const int64_t i = r * cols + c;
          if (t.dtype() == DType::BF16) t.data_as<uint16_t>()[i] = f32_to_bf16(v);
          else f32m(t)[i] = v;
        }
    });
  }

  void begin_step(const ForwardBatch& batch) override { step_ = batch; }
  void begin_substep(const ForwardBatch& batch) override { step_ = batch; }  // scratch is never reused here
  void set_input_ids(std::span<const int32_t> ids) override {
    MLA_CHECK(ids.size() == step_.input_ids.size(), "set_input_ids: {} ids for a step of {} tokens", ids.size(),
              step_.input_ids.size());
    step_.input_ids.assign(ids.begin(), ids.end());
  }

  void resolve_prev_ids(const Tensor& prev) override {
    MLA_CHECK(prev.dtype() == DType::I32, "resolve_prev_ids: prev must be I32");
    cpu::resolve_prev_ids(step_.input_ids.data(), step_.num_tokens(), prev.data_as<int32_t>(), prev.numel());
  }

  void embedding(const Tensor& table, int64_t vocab_begin, Tensor& out) override {
    const int64_t H = table.size(1), V = table.size(0);
    const int64_t T = step_.num_tokens();
    MLA_CHECK(out.numel() == T * H, "embedding: output has {} elements, expected {}", out.numel(), T * H);
    float* o = f32m(out);
    parallel_for(T, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const int64_t id = step_.input_ids[static_cast<size_t>(t)] - vocab_begin;
        if (id < 0 || id >= V) {
          std::fill(o + t * H, o + (t + 1) * H, 0.0f);
        } else {
          cpu::convert(static_cast<const char*>(table.data()) + id * H * dtype_size(table.dtype()), table.dtype(),
                       o + t * H, DType::F32, H);
        }
      }
    });
  }

  void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
    const int64_t D = x.size(-1), N = rows_of(x);
    MLA_CHECK(w.numel() == D && out.numel() == x.numel(), "rmsnorm: shape mismatch");
    const float* xp = f32(x);
    const float* wp = f32(w);
    float* op = f32m(out);
    parallel_for(N, 8, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) cpu::rmsnorm_row(xp + n * D, wp, D, eps, op + n * D);
    });
  }

  void add_rmsnorm(const Tensor& x, Tensor& residual, const Tensor& w, float eps, Tensor& out) override {
    const int64_t D = x.size(-1), N = rows_of(x);
    MLA_CHECK(residual.numel() == x.numel() && out.numel() == x.numel() && w.numel() == D, "add_rmsnorm: shape mismatch");
    const float* xp = f32(x);
    float* rp = f32m(residual);
    const float* wp = f32(w);
    float* op = f32m(out);
    parallel_for(N, 8, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        for (int64_t d = 0; d < D; ++d) rp[n * D + d] += xp[n * D + d];
        cpu::rmsnorm_row(rp + n * D, wp, D, eps, op + n * D);
      }
    });
  }

  void linear(const Tensor& x, const Tensor& w, Tensor& y) override {
    const int64_t K = x.size(-1), N = rows_of(x), M = w.size(0);
    MLA_CHECK(w.dim() == 2 && w.size(1) == K, "linear: weight {} does not match input width {}", shape_str(w.shape()), K);
    MLA_CHECK(y.numel() == N * M, "linear: output has {} elements, expected {}x{}", y.numel(), N, M);
    cpu::linear(f32(x), N, K, w.data(), w.dtype(), M, f32m(y), /*parallel=*/true);
  }

  void silu_mul(const Tensor& gate_up, Tensor& out) override {
    const int64_t I2 = gate_up.size(-1), N = rows_of(gate_up), I = I2 / 2;
    MLA_CHECK(out.numel() == N * I, "silu_mul: shape mismatch");
    const float* g = f32(gate_up);
    float* o = f32m(out);
    parallel_for(N, 16, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) cpu::silu_mul_row(g + n * I2, I, o + n * I);
    });
  }

  void add(Tensor& a, const Tensor& b) override {
    MLA_CHECK(a.numel() == b.numel(), "add: shape mismatch");
    float* ap = f32m(a);
    const float* bp = f32(b);
    parallel_for(a.numel(), 4096, [&](int64_t s, int64_t e) {
      for (int64_t i = s; i < e; ++i) ap[i] += bp[i];
    });
  }

  void gather_logit_rows(const Tensor& x, Tensor& out) override {
    const int64_t C = x.size(-1);
    const auto& rows = step_.logit_rows;
    MLA_CHECK(out.numel() == static_cast<int64_t>(rows.size()) * C, "gather_logit_rows: shape mismatch");
    const float* xp = f32(x);
    float* op = f32m(out);
    for (size_t r = 0; r < rows.size(); ++r) std::memcpy(op + r * C, xp + rows[r] * C, C * sizeof(float));
  }

  void gather_rows(const Tensor& x, std::span<const int32_t> rows, Tensor& out) override {
    const int64_t C = x.size(-1), n = x.numel() / std::max<int64_t>(C, 1);
    const size_t row_bytes = static_cast<size_t>(C) * dtype_size(x.dtype());
    MLA_CHECK(out.numel() == static_cast<int64_t>(rows.size()) * C && out.dtype() == x.dtype(),
              "gather_rows: shape mismatch");
    for (size_t r = 0; r < rows.size(); ++r) {
      MLA_CHECK(rows[r] >= 0 && rows[r] < n, "gather_rows: row {} of {}", rows[r], n);
      std::memcpy(static_cast<char*>(out.data()) + r * row_bytes,
                  static_cast<const char*>(x.data()) + static_cast<size_t>(rows[r]) * row_bytes, row_bytes);
    }
  }

  void interleave_blocks(const Tensor& parts, int64_t n, Tensor& out) override {
    const int64_t C = parts.size(-1), R = n > 0 ? parts.numel() / C / n : 0;
    MLA_CHECK(n > 0 && parts.numel() == n * R * C && out.numel() == parts.numel() && out.dtype() == parts.dtype(),
              "interleave_blocks: parts {} in {} blocks into {}", shape_str(parts.shape()), n, shape_str(out.shape()));
    const size_t row = static_cast<size_t>(C) * dtype_size(parts.dtype());
    const auto* src = static_cast<const char*>(parts.data());
    auto* dst = static_cast<char*>(out.data());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < R; ++i)
        std::memcpy(dst + static_cast<size_t>(i * n + r) * row, src + static_cast<size_t>(r * R + i) * row, row);
  }

  void set_rope(const std::vector<float>& inv_freq, float attention_factor) override {
    inv_freq_ = inv_freq;
    rope_factor_ = attention_factor;
  }

  void mla_write_latent(Tensor& latent, const Tensor& kv_norm, float eps, Tensor& cache) override {
    const int64_t W = latent.size(-1), kvr = kv_norm.numel(), rope = W - kvr;
    const int64_t T = step_.num_tokens();
    MLA_CHECK(cache.size(-1) == W, "mla_write_latent: cache row width {} != latent width {}", cache.size(-1), W);
    MLA_CHECK(rope == static_cast<int64_t>(inv_freq_.size()) * 2, "mla_write_latent: rope width {} vs {} frequencies",
              rope, inv_freq_.size());
    float* lp = f32m(latent);
    // An FP8 cache holds each value's E4M3 / E5M2 code; the latent row keeps the value the cache holds (as the
    // GPU's does).
    const DType cd = cache.dtype();
    const bool fp8 = cd == DType::F8_E4M3 || cd == DType::F8_E5M2;
    float* cp = fp8 ? nullptr : f32m(cache);
    uint8_t* c8 = fp8 ? cache.data_as<uint8_t>() : nullptr;
    const float* wp = f32(kv_norm);
    const int64_t slots = cache.size(0);
    parallel_for(T, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        float* row = lp + t * W;
        cpu::rmsnorm_row(row, wp, kvr, eps, row);
        cpu::rope_pairs(row + kvr, rope, step_.positions[static_cast<size_t>(t)], inv_freq_.data(), rope_factor_);
        const int64_t slot = step_.out_slots[static_cast<size_t>(t)];
        MLA_CHECK(slot >= 0 && slot < slots, "mla_write_latent: slot {} outside the cache of {} slots", slot, slots);
        if (!fp8) {
          std::memcpy(cp + slot * W, row, W * sizeof(float));
          continue;
        }
        cpu::convert(row, DType::F32, c8 + slot * W, cd, W);
        cpu::convert(c8 + slot * W, cd, row, DType::F32, W);
      }
    });
  }

  void mla_rope_q(Tensor& q, int32_t num_heads, int32_t qk_nope, int32_t qk_rope) override {
    const int64_t T = step_.num_tokens(), hd = qk_nope + qk_rope;
    MLA_CHECK(q.numel() == T * num_heads * hd, "mla_rope_q: shape mismatch");
    float* qp = f32m(q);
    parallel_for(T, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t h = 0; h < num_heads; ++h)
          cpu::rope_pairs(qp + (t * num_heads + h) * hd + qk_nope, qk_rope, step_.positions[static_cast<size_t>(t)],
                          inv_freq_.data(), rope_factor_);
    });
  }

  void mla_attention(const Tensor& q, const Tensor& cache, const Tensor& kv_b, const MlaParams& p, Tensor& out) override {
    cpu::MlaArgs a;
    a.batch = &step_;
    a.q = f32(q);
    if (cache.dtype() == DType::F8_E4M3 || cache.dtype() == DType::F8_E5M2) {
      a.cache_f8 = cache.data_as<const uint8_t>();
      a.cache_e5m2 = cache.dtype() == DType::F8_E5M2;
    } else {
      a.cache = f32(cache);
    }
    a.cache_width = cache.size(-1);
    a.kv_b = kv_b.data();
    a.kv_b_dtype = kv_b.dtype();
    a.p = p;
    a.out = f32m(out);
    MLA_CHECK(q.numel() == static_cast<int64_t>(step_.num_tokens()) * p.num_heads * (p.qk_nope + p.qk_rope),
              "mla_attention: q shape mismatch");
    MLA_CHECK(out.numel() == static_cast<int64_t>(step_.num_tokens()) * p.num_heads * p.v_head,
              "mla_attention: out shape mismatch");
    MLA_CHECK(kv_b.size(0) == static_cast<int64_t>(p.num_heads) * (p.qk_nope + p.v_head) && kv_b.size(1) == p.kv_lora,
              "mla_attention: kv_b_proj shape {} mismatch", shape_str(kv_b.shape()));
    cpu::mla_attention(a);
  }

  void moe_route(const Tensor& logits, const Tensor* bias, const RouterParams& p, Tensor& topk_ids,
                 Tensor& topk_weights) override {
    const int64_t T = rows_of(logits), E = logits.size(-1);
    const int64_t k = p.ids_per_token();
    MLA_CHECK(topk_ids.numel() == T * k && topk_weights.numel() == T * k, "moe_route: shape mismatch");
    const float* lp = f32(logits);
    const float* bp = bias ? f32(*bias) : nullptr;
    int32_t* ids = topk_ids.data_as<int32_t>();
    float* ws = f32m(topk_weights);
    parallel_for(T, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) cpu::route_token(lp + t * E, bp, E, p, ids + t * k, ws + t * k);
    });
  }

  void count_experts(const Tensor& topk_ids, Tensor& counts) override {
    MLA_CHECK(topk_ids.dtype() == DType::I32 && topk_ids.dim() == 2 && counts.dtype() == DType::I64,
              "count_experts: ids {} {} (I32 [rows, k]), counts {} (I64)", dtype_name(topk_ids.dtype()),
              shape_str(topk_ids.shape()), dtype_name(counts.dtype()));
    const std::vector<int32_t>& pairs = step_.moe_rows;
    MLA_CHECK(pairs.size() % 2 == 0, "count_experts: the step's moe_rows has {} entries (pairs)", pairs.size());
    cpu::count_experts(topk_ids.data_as<int32_t>(), topk_ids.size(0), static_cast<int32_t>(topk_ids.size(1)),
                       pairs.empty() ? nullptr : pairs.data(), static_cast<int32_t>(pairs.size() / 2),
                       static_cast<int32_t>(counts.numel()), counts.data_as<int64_t>());
  }

  // Routed experts kept FP8 (F8_E4M3 [E, R, C]) or INT4 (U8 [E, R, C / 2]) with their BlockScales, as bf16 [E, R, C].
  static Tensor bf16_experts(const Tensor& w) {
    const BlockScales* s = w.block_scales();
    const bool int4 = w.dtype() == DType::U8;
    MLA_CHECK(s && w.dim() == 3 && (int4 ? s->int4() : w.dtype() == DType::F8_E4M3 && !s->int4()),
              "moe_experts: quantized experts need both matrices in F8_E4M3 [E, rows, cols] with their block scales or "
              "in U8 [E, rows, cols / 2] with their scales and zeros");
    const Shape shape{w.size(0), w.size(1), int4 ? 2 * w.size(2) : w.size(2)};
    Tensor f = Tensor::empty_host(shape, DType::F32), o = Tensor::empty_host(shape, DType::BF16);
    if (int4)
      cpu::dequant_int4(w.data_as<const uint8_t>(), s->scale.data_as<const float>(), s->zero.data_as<const float>(),
                        shape[0], shape[1], shape[2], s->block_cols, f.data_as<float>());
    else
      cpu::dequant_fp8(w.data_as<const uint8_t>(), s->scale.data_as<const float>(), shape[0], shape[1], shape[2],
                       s->block_rows, s->block_cols, f.data_as<float>());
    cpu::convert(f.data(), DType::F32, o.data(), DType::BF16, f.numel());
    return o;
  }

  void moe_experts(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& gate_up,
                   const Tensor& down, int32_t expert_begin, const Tensor* shared_gate_up, const Tensor* shared_down,
                   int32_t n_fixed, Tensor& out) override {
    if (gate_up.dtype() == DType::U8 || down.dtype() == DType::U8 || gate_up.dtype() == DType::F8_E4M3 ||
        down.dtype() == DType::F8_E4M3) {
      // Experts kept FP8 or INT4: dequantized and rounded to bf16 (as the CUDA kernels, and as the loader's
      // dequantization gives a quantized checkpoint's bf16 model), then below.
      moe_experts(x, topk_ids, topk_weights, bf16_experts(gate_up), bf16_experts(down), expert_begin, shared_gate_up,
                  shared_down, n_fixed, out);
      return;
    }
    cpu::MoeArgs a;
    a.x = f32(x);
    a.T = rows_of(x);
    a.H = x.size(-1);
    a.k = topk_ids.size(-1);
    a.ids = topk_ids.data_as<const int32_t>();
    a.weights = f32(topk_weights);
    a.E = gate_up.size(0);
    a.I = gate_up.size(1) / 2;
    a.gate_up = gate_up.data();
    a.down = down.data();
    a.wdtype = gate_up.dtype();
    a.expert_begin = expert_begin;
    a.out = f32m(out);
    MLA_CHECK(down.dtype() == gate_up.dtype() && down.size(0) == a.E && down.size(1) == a.H && down.size(2) == a.I,
              "moe_experts: down {} does not match gate_up {}", shape_str(down.shape()), shape_str(gate_up.shape()));
    MLA_CHECK(n_fixed == 0 || (n_fixed > 0 && n_fixed < a.k && n_fixed <= a.E),
              "moe_experts: {} fixed experts with {} ids per token and {} experts", n_fixed, a.k, a.E);
    for (int64_t t = 0; t < a.T; ++t)
      for (int64_t j = 0; j < n_fixed; ++j) {
        const int64_t p = t * a.k + a.k - n_fixed + j, want = expert_begin + a.E - n_fixed + j;
        MLA_CHECK(a.ids[p] == want && a.weights[p] == 1.0f,
                  "moe_experts: token {}'s fixed id {} is {} with weight {}, not expert {} with weight 1", t, j,
                  a.ids[p], a.weights[p], want);
      }
    cpu::moe_experts(a);
    add_shared_experts(*this, x, shared_gate_up, shared_down, out);
  }

 private:
  ForwardBatch step_;
  std::vector<float> inv_freq_;
  float rope_factor_ = 1.0f;
  // The persistent tensors (weak: a tensor no longer used is gone), for release_persistent.
  struct Held {
    std::weak_ptr<void> storage;
    void* data;
    size_t bytes;
  };
  std::mutex held_mu_;
  std::vector<Held> held_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace mlaserve
