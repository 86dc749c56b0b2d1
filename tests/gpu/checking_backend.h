// CheckingBackend: runs a model on the CUDA backend and, for every op, the CPU reference op on copies of the same
// inputs (the GPU's current values, converted to F32), then compares the outputs. Errors do not accumulate from op
// to op, so the first op whose output disagrees is the culprit. Slow (every input is downloaded): tiny models only.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "backend/forwarding_backend.h"
#include "gpu_test_util.h"

namespace mlaserve::test {

class CheckingBackend final : public ForwardingBackend {
 public:
  struct Record {
    std::string op;
    int64_t index;
    double rel_l2, max_rel;
    int64_t nonfinite;
  };

  // Memory, transfers and sampling go to the GPU backend (ForwardingBackend); the ops below run on both.
  explicit CheckingBackend(Backend& gpu) : ForwardingBackend(gpu), g_(gpu), c_(make_cpu_backend()) {}
  std::vector<Record> records;

  std::string name() const override { return "checking(" + g_.name() + ")"; }
  void set_rope(const std::vector<float>& f, float a) override {
    g_.set_rope(f, a);
    c_->set_rope(f, a);
  }
  void begin_step(const ForwardBatch& b) override {
    g_.begin_step(b);
    c_->begin_step(b);
  }
  void set_input_ids(std::span<const int32_t> ids) override {
    g_.set_input_ids(ids);
    c_->set_input_ids(ids);
  }
  void begin_substep(const ForwardBatch& b) override {
    g_.begin_substep(b);
    c_->begin_substep(b);
  }

  void embedding(const Tensor& table, int64_t vb, Tensor& out) override {
    Tensor t = cpu_copy(table), o = cpu_like(out);
    c_->embedding(t, vb, o);
    g_.embedding(table, vb, out);
    check("embedding", o, out);
  }
  void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
    Tensor xc = cpu_copy(x), wc = cpu_copy(w), oc = cpu_like(out);
    c_->rmsnorm(xc, wc, eps, oc);
    g_.rmsnorm(x, w, eps, out);
    check("rmsnorm", oc, out);
  }
  void add_rmsnorm(const Tensor& x, Tensor& r, const Tensor& w, float eps, Tensor& out) override {
    Tensor xc = cpu_copy(x), rc = cpu_copy(r), wc = cpu_copy(w), oc = cpu_like(out);
    c_->add_rmsnorm(xc, rc, wc, eps, oc);
    g_.add_rmsnorm(x, r, w, eps, out);
    check("add_rmsnorm.residual", rc, r);
    check("add_rmsnorm.out", oc, out);
  }
  void add_rmsnorm_linear_pair(const Tensor& x, const Tensor& r, Tensor& r_out, const Tensor& nw, float eps,
                               Tensor& normed, const Tensor& w1, Tensor& y1, const Tensor& w2, Tensor& y2) override {
    Tensor xc = cpu_copy(x), rc = cpu_copy(r), roc = cpu_like(r_out), nwc = cpu_copy(nw), nc = cpu_like(normed);
    Tensor w1c = cpu_copy(w1), w2c = cpu_copy(w2), y1c = cpu_like(y1), y2c = cpu_like(y2);
    c_->add_rmsnorm_linear_pair(xc, rc, roc, nwc, eps, nc, w1c, y1c, w2c, y2c);
    g_.add_rmsnorm_linear_pair(x, r, r_out, nw, eps, normed, w1, y1, w2, y2);
    check("add_rmsnorm_linear_pair.residual", roc, r_out);
    check("add_rmsnorm_linear_pair " + shape_str(w1.shape()), y1c, y1);
    check("add_rmsnorm_linear_pair " + shape_str(w2.shape()), y2c, y2);
  }
  void linear(const Tensor& x, const Tensor& w, Tensor& y) override {
    Tensor xc = cpu_copy(x), wc = cpu_copy(w), yc = cpu_like(y);
    c_->linear(xc, wc, yc);
    g_.linear(x, w, y);
    check("linear " + shape_str(w.shape()), yc, y);
  }
  void silu_mul(const Tensor& gu, Tensor& out) override {
    Tensor gc = cpu_copy(gu), oc = cpu_like(out);
    c_->silu_mul(gc, oc);
    g_.silu_mul(gu, out);
    check("silu_mul", oc, out);
  }
  void copy(const Tensor& src, Tensor& dst) override { g_.copy(src, dst); }
  void zero(Tensor& t) override { g_.zero(t); }
  void add(Tensor& a, const Tensor& b) override {
    Tensor ac = cpu_copy(a), bc = cpu_copy(b);
    c_->add(ac, bc);
    g_.add(a, b);
    check("add", ac, a);
  }
  void gather_logit_rows(const Tensor& x, Tensor& out) override {
    Tensor xc = cpu_copy(x), oc = cpu_like(out);
    c_->gather_logit_rows(xc, oc);
    g_.gather_logit_rows(x, out);
    check("gather_logit_rows", oc, out);
  }
  void gather_rows(const Tensor& x, std::span<const int32_t> rows, Tensor& out) override {
    Tensor xc = cpu_copy(x), oc = cpu_like(out);
    c_->gather_rows(xc, rows, oc);
    g_.gather_rows(x, rows, out);
    check("gather_rows", oc, out);
  }
  void interleave_blocks(const Tensor& parts, int64_t n, Tensor& out) override {
    Tensor pc = cpu_copy(parts), oc = cpu_like(out);
    c_->interleave_blocks(pc, n, oc);
    g_.interleave_blocks(parts, n, out);
    check("interleave_blocks", oc, out);
  }
  void mla_write_latent(Tensor& latent, const Tensor& w, float eps, Tensor& cache) override {
    Tensor lc = cpu_copy(latent), wc = cpu_copy(w), cc = cpu_copy(cache);
    c_->mla_write_latent(lc, wc, eps, cc);
    g_.mla_write_latent(latent, w, eps, cache);
    check("mla_write_latent.latent", lc, latent);
  }
  void mla_rope_q(Tensor& q, int32_t nh, int32_t nope, int32_t rope) override {
    Tensor qc = cpu_copy(q);
    c_->mla_rope_q(qc, nh, nope, rope);
    g_.mla_rope_q(q, nh, nope, rope);
    check("mla_rope_q", qc, q);
  }
  void mla_attention(const Tensor& q, const Tensor& cache, const Tensor& kv_b, const MlaParams& p, Tensor& out) override {
    Tensor qc = cpu_copy(q), cc = cpu_copy(cache), kc = cpu_copy(kv_b), oc = cpu_like(out);
    c_->mla_attention(qc, cc, kc, p, oc);
    g_.mla_attention(q, cache, kv_b, p, out);
    check("mla_attention", oc, out);
  }
  void moe_route(const Tensor& logits, const Tensor* bias, const RouterParams& p, Tensor& ids, Tensor& w) override {
    Tensor lc = cpu_copy(logits), bc = bias ? cpu_copy(*bias) : Tensor(), ic = c_->alloc(ids.shape(), DType::I32),
           wc = cpu_like(w);
    c_->moe_route(lc, bias ? &bc : nullptr, p, ic, wc);
    g_.moe_route(logits, bias, p, ids, w);
    report_ids("moe_route", ic, ids);
    check("moe_route.weights", wc, w);
  }
  void add_rmsnorm_moe_gate(const Tensor& x, const Tensor& r, Tensor& r_out, const Tensor& nw, float eps,
                            Tensor& normed, const Tensor& router, const Tensor* bias, const RouterParams& p,
                            Tensor& ids, Tensor& w) override {
    Tensor xc = cpu_copy(x), rc = cpu_copy(r), roc = cpu_like(r_out), nwc = cpu_copy(nw), nc = cpu_like(normed);
    Tensor rtc = cpu_copy(router), bc = bias ? cpu_copy(*bias) : Tensor(), ic = c_->alloc(ids.shape(), DType::I32),
           wc = cpu_like(w);
    c_->add_rmsnorm_moe_gate(xc, rc, roc, nwc, eps, nc, rtc, bias ? &bc : nullptr, p, ic, wc);
    g_.add_rmsnorm_moe_gate(x, r, r_out, nw, eps, normed, router, bias, p, ids, w);
    check("add_rmsnorm_moe_gate.residual", roc, r_out);
    check("add_rmsnorm_moe_gate.normed", nc, normed);
    report_ids("add_rmsnorm_moe_gate", ic, ids);
    check("add_rmsnorm_moe_gate.weights", wc, w);
  }
  void moe_experts(const Tensor& x, const Tensor& ids, const Tensor& w, const Tensor& gu, const Tensor& dn, int32_t eb,
                   const Tensor* sg, const Tensor* sd, int32_t nf, Tensor& out) override {
    Tensor xc = cpu_copy(x), wc = cpu_copy(w), guc = cpu_copy(gu), dnc = cpu_copy(dn), oc = cpu_like(out);
    Tensor sgc = sg ? cpu_copy(*sg) : Tensor(), sdc = sd ? cpu_copy(*sd) : Tensor();
    Tensor ic = c_->alloc(ids.shape(), DType::I32);
    g_.download(ids, ic.data());
    c_->moe_experts(xc, ic, wc, guc, dnc, eb, sg ? &sgc : nullptr, sd ? &sdc : nullptr, nf, oc);
    g_.moe_experts(x, ids, w, gu, dn, eb, sg, sd, nf, out);
    check("moe_experts", oc, out);
  }

 private:
  // Prints how many routed ids of the GPU differ from the CPU's (near-ties may differ; the weights are checked).
  void report_ids(const char* op, const Tensor& cpu_ids, const Tensor& gpu_ids) {
    Tensor ig = g_.to_host_f32(gpu_ids), ich = c_->to_host_f32(cpu_ids);
    int64_t mism = 0;
    for (int64_t i = 0; i < ig.numel(); ++i) mism += ig.data_as<float>()[i] != ich.data_as<float>()[i];
    if (mism) std::printf("  %s #%lld: %lld of %lld ids differ\n", op, static_cast<long long>(counter_),
                          static_cast<long long>(mism), static_cast<long long>(ig.numel()));
  }
  Tensor cpu_copy(const Tensor& t) {
    if (t.dtype() == DType::I32) {
      Tensor h = c_->alloc(t.shape(), DType::I32);
      g_.download(t, h.data());
      return h;
    }
    return g_.to_host_f32(t);
  }
  Tensor cpu_like(const Tensor& t) { return c_->alloc(t.shape(), t.dtype() == DType::I32 ? DType::I32 : DType::F32); }
  void check(const std::string& op, const Tensor& ref, const Tensor& got_dev) {
    Tensor got = g_.to_host_f32(got_dev);
    const Diff d = diff(ref, got);
    Record r{op, counter_++, d.rel_l2, d.max_abs / std::max(d.ref_max, 1e-30), d.nan};
    if (r.rel_l2 > 2e-2 || r.nonfinite)
      std::printf("  op #%lld %-40s rel_l2 %.2e max %.2e nonfinite %lld\n", static_cast<long long>(r.index),
                  op.c_str(), r.rel_l2, r.max_rel, static_cast<long long>(r.nonfinite));
    records.push_back(r);
  }

  Backend& g_;
  std::unique_ptr<Backend> c_;
  int64_t counter_ = 0;
};

}  // namespace mlaserve::test
