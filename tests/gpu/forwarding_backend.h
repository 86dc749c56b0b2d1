// ForwardingBackend: a Backend that forwards every call to an inner backend; tests override the ops they watch.
// RouteRecorder / RouteReplayer record the MoE routing decisions of one run and force (or compare) them in another,
// which separates numerical differences from discrete routing flips (near-tied experts that bf16 rounding reorders).
#pragma once

#include <vector>

#include "backend/backend.h"

namespace mlaserve::test {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(Backend& inner) : b_(inner) {}
  std::string name() const override { return b_.name(); }
  Device device() const override { return b_.device(); }
  DType act_dtype() const override { return b_.act_dtype(); }
  DType weight_dtype(DType s) const override { return b_.weight_dtype(s); }
  Tensor alloc(const Shape& s, DType d) override { return b_.alloc(s, d); }
  Tensor scratch(const Shape& s, DType d) override { return b_.scratch(s, d); }
  size_t scratch_mark() override { return b_.scratch_mark(); }
  void scratch_release(size_t m) override { b_.scratch_release(m); }
  int64_t persistent_bytes_free() const override { return b_.persistent_bytes_free(); }
  void synchronize() override { b_.synchronize(); }
  Tensor upload(const Tensor& h, DType d) override { return b_.upload(h, d); }
  void upload_into(const Tensor& h, Tensor& d) override { b_.upload_into(h, d); }
  Tensor to_host_f32(const Tensor& t) override { return b_.to_host_f32(t); }
  void download(const Tensor& t, void* dst) override { b_.download(t, dst); }
  void fill_random(Tensor& t, uint64_t s, float m, float sd, int64_t fc, int64_t ro, int64_t co) override {
    b_.fill_random(t, s, m, sd, fc, ro, co);
  }
  void begin_step(const ForwardBatch& b) override { b_.begin_step(b); }
  void embedding(const Tensor& t, int64_t vb, Tensor& o) override { b_.embedding(t, vb, o); }
  void rmsnorm(const Tensor& x, const Tensor& w, float e, Tensor& o) override { b_.rmsnorm(x, w, e, o); }
  void add_rmsnorm(const Tensor& x, Tensor& r, const Tensor& w, float e, Tensor& o) override { b_.add_rmsnorm(x, r, w, e, o); }
  void linear(const Tensor& x, const Tensor& w, Tensor& y) override { b_.linear(x, w, y); }
  void silu_mul(const Tensor& g, Tensor& o) override { b_.silu_mul(g, o); }
  void copy(const Tensor& s, Tensor& d) override { b_.copy(s, d); }
  void zero(Tensor& t) override { b_.zero(t); }
  void add(Tensor& a, const Tensor& b) override { b_.add(a, b); }
  void gather_logit_rows(const Tensor& x, Tensor& o) override { b_.gather_logit_rows(x, o); }
  void interleave_blocks(const Tensor& p, int64_t n, Tensor& o) override { b_.interleave_blocks(p, n, o); }
  bool supports_graphs() const override { return b_.supports_graphs(); }
  void begin_graph_step(const ForwardBatch& b) override { b_.begin_graph_step(b); }
  void graph_capture_begin() override { b_.graph_capture_begin(); }
  int32_t graph_capture_end() override { return b_.graph_capture_end(); }
  void graph_replay(int32_t g) override { b_.graph_replay(g); }
  void release_graphs() override { b_.release_graphs(); }
  void mla_write_latent(Tensor& l, const Tensor& w, float e, Tensor& c) override { b_.mla_write_latent(l, w, e, c); }
  void mla_rope_q(Tensor& q, int32_t a, int32_t b, int32_t c) override { b_.mla_rope_q(q, a, b, c); }
  void mla_attention(const Tensor& q, const Tensor& c, const Tensor& k, const MlaParams& p, Tensor& o) override {
    b_.mla_attention(q, c, k, p, o);
  }
  void moe_route(const Tensor& l, const Tensor* bias, const RouterParams& p, Tensor& i, Tensor& w) override {
    b_.moe_route(l, bias, p, i, w);
  }
  void moe_experts(const Tensor& x, const Tensor& i, const Tensor& w, const Tensor& g, const Tensor& d, int32_t eb,
                   Tensor& o) override {
    b_.moe_experts(x, i, w, g, d, eb, o);
  }
  void sample(const Tensor& l, std::span<const RowSampling> p, Tensor& i, Tensor* lp) override { b_.sample(l, p, i, lp); }
  void set_rope(const std::vector<float>& f, float a) override { b_.set_rope(f, a); }

 protected:
  Backend& b_;
};

struct RouteLog {
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> weights;
};

class RouteRecorder final : public ForwardingBackend {
 public:
  RouteRecorder(Backend& inner, RouteLog& log) : ForwardingBackend(inner), log_(log) {}
  void moe_route(const Tensor& l, const Tensor* bias, const RouterParams& p, Tensor& i, Tensor& w) override {
    b_.moe_route(l, bias, p, i, w);
    std::vector<int32_t> ids(static_cast<size_t>(i.numel()));
    std::vector<float> ws(static_cast<size_t>(w.numel()));
    b_.download(i, ids.data());
    b_.download(w, ws.data());
    log_.ids.push_back(std::move(ids));
    log_.weights.push_back(std::move(ws));
  }

 private:
  RouteLog& log_;
};

// force: overwrite this run's routing with the log's; otherwise count the (token, slot) choices that differ.
class RouteReplayer final : public ForwardingBackend {
 public:
  RouteReplayer(Backend& inner, const RouteLog& log, bool force) : ForwardingBackend(inner), log_(log), force_(force) {}
  int64_t flips = 0, decisions = 0;
  void moe_route(const Tensor& l, const Tensor* bias, const RouterParams& p, Tensor& i, Tensor& w) override {
    b_.moe_route(l, bias, p, i, w);
    if (call_ >= log_.ids.size()) return;
    const auto& ref = log_.ids[call_];
    if (static_cast<int64_t>(ref.size()) == i.numel()) {
      if (force_) {
        Tensor hi = Tensor::empty_host(i.shape(), DType::I32), hw = Tensor::empty_host(w.shape(), DType::F32);
        std::copy(ref.begin(), ref.end(), hi.data_as<int32_t>());
        std::copy(log_.weights[call_].begin(), log_.weights[call_].end(), hw.data_as<float>());
        b_.upload_into(hi, i);
        b_.upload_into(hw, w);
      } else {
        std::vector<int32_t> got(ref.size());
        b_.download(i, got.data());
        const int64_t k = i.size(-1);
        for (size_t t = 0; t * k < ref.size(); ++t) {  // as sets: the order of equal-weight picks is irrelevant
          std::vector<int32_t> a(ref.begin() + t * k, ref.begin() + (t + 1) * k), b(got.begin() + t * k, got.begin() + (t + 1) * k);
          std::sort(a.begin(), a.end());
          std::sort(b.begin(), b.end());
          flips += a != b;
          ++decisions;
        }
      }
    }
    ++call_;
  }

 private:
  const RouteLog& log_;
  bool force_;
  size_t call_ = 0;
};

}  // namespace mlaserve::test
