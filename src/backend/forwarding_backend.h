// ForwardingBackend: a Backend that hands every call to an inner backend. Decorators override what they change:
// GraphRecorder (graphs as recorded op closures, so the graph path runs on the CPU) and the GPU tests' routing
// recorders.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace mlaserve {

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
  void bind_thread() override { b_.bind_thread(); }
  void* native_stream() override { return b_.native_stream(); }
  Tensor upload(const Tensor& h, DType d) override { return b_.upload(h, d); }
  void upload_into(const Tensor& h, Tensor& d) override { b_.upload_into(h, d); }
  Tensor to_host_f32(const Tensor& t) override { return b_.to_host_f32(t); }
  void download(const Tensor& t, void* dst) override { b_.download(t, dst); }
  uint64_t download_start(const Tensor& t) override { return b_.download_start(t); }
  void download_finish(uint64_t k, void* dst) override { b_.download_finish(k, dst); }
  void fill_random(Tensor& t, uint64_t s, float m, float sd, int64_t fc, int64_t ro, int64_t co) override {
    b_.fill_random(t, s, m, sd, fc, ro, co);
  }
  void* alloc_host(size_t n) override { return b_.alloc_host(n); }
  void free_host(void* p) override { b_.free_host(p); }
  void copy_kv_pages(std::span<Tensor* const> l, int64_t pb, char* h, std::span<const int32_t> s,
                     std::span<const int32_t> ld) override {
    b_.copy_kv_pages(l, pb, h, s, ld);
  }
  void begin_step(const ForwardBatch& b) override { b_.begin_step(b); }
  void resolve_prev_ids(const Tensor& p) override { b_.resolve_prev_ids(p); }
  void set_input_ids(std::span<const int32_t> ids) override { b_.set_input_ids(ids); }
  void begin_substep(const ForwardBatch& b) override { b_.begin_substep(b); }
  void end_step() override { b_.end_step(); }
  bool supports_graphs() const override { return b_.supports_graphs(); }
  bool takes_fp8_experts() const override { return b_.takes_fp8_experts(); }
  bool takes_int4_experts() const override { return b_.takes_int4_experts(); }
  int32_t graph_variant(const ForwardBatch& b) const override { return b_.graph_variant(b); }
  std::vector<int32_t> graph_variant_contexts() const override { return b_.graph_variant_contexts(); }
  void begin_graph_step(const ForwardBatch& b) override { b_.begin_graph_step(b); }
  void graph_capture_begin() override { b_.graph_capture_begin(); }
  int32_t graph_capture_end() override { return b_.graph_capture_end(); }
  void graph_replay(int32_t g) override { b_.graph_replay(g); }
  void release_graphs() override { b_.release_graphs(); }
  void release_persistent() override { b_.release_persistent(); }
  void resume_persistent() override { b_.resume_persistent(); }
  void collective(std::function<void()> fn) override { b_.collective(std::move(fn)); }
  void embedding(const Tensor& t, int64_t vb, Tensor& o) override { b_.embedding(t, vb, o); }
  void rmsnorm(const Tensor& x, const Tensor& w, float e, Tensor& o) override { b_.rmsnorm(x, w, e, o); }
  void add_rmsnorm(const Tensor& x, Tensor& r, const Tensor& w, float e, Tensor& o) override {
    b_.add_rmsnorm(x, r, w, e, o);
  }
  void linear(const Tensor& x, const Tensor& w, Tensor& y) override { b_.linear(x, w, y); }
  void silu_mul(const Tensor& g, Tensor& o) override { b_.silu_mul(g, o); }
  void zero(Tensor& t) override { b_.zero(t); }
  void copy(const Tensor& s, Tensor& d) override { b_.copy(s, d); }
  void add(Tensor& a, const Tensor& b) override { b_.add(a, b); }
  void gather_logit_rows(const Tensor& x, Tensor& o) override { b_.gather_logit_rows(x, o); }
  void gather_rows(const Tensor& x, std::span<const int32_t> r, Tensor& o) override { b_.gather_rows(x, r, o); }
  void interleave_blocks(const Tensor& p, int64_t n, Tensor& o) override { b_.interleave_blocks(p, n, o); }
  void mla_write_latent(Tensor& l, const Tensor& w, float e, Tensor& c) override { b_.mla_write_latent(l, w, e, c); }
  void mla_rope_q(Tensor& q, int32_t a, int32_t b, int32_t c) override { b_.mla_rope_q(q, a, b, c); }
  void mla_attention(const Tensor& q, const Tensor& c, const Tensor& k, const MlaParams& p, Tensor& o) override {
    b_.mla_attention(q, c, k, p, o);
  }
  void moe_route(const Tensor& l, const Tensor* bias, const RouterParams& p, Tensor& i, Tensor& w) override {
    b_.moe_route(l, bias, p, i, w);
  }
  void moe_experts(const Tensor& x, const Tensor& i, const Tensor& w, const Tensor& g, const Tensor& d, int32_t eb,
                   const Tensor* sg, const Tensor* sd, int32_t nf, Tensor& o) override {
    b_.moe_experts(x, i, w, g, d, eb, sg, sd, nf, o);
  }
  void count_experts(const Tensor& i, Tensor& c) override { b_.count_experts(i, c); }
  void profiler(bool on) override { b_.profiler(on); }
  void sample(const Tensor& l, std::span<const RowSampling> p, Tensor& i, Tensor* lp) override { b_.sample(l, p, i, lp); }
  void stage_sample(std::span<const RowSampling> p, const Tensor* lp) override { b_.stage_sample(p, lp); }
  void sample_staged(const Tensor& l, Tensor& i) override { b_.sample_staged(l, i); }
  void set_rope(const std::vector<float>& f, float a) override { b_.set_rope(f, a); }

 protected:
  Backend& b_;
};

// Graphs as recorded closures over the inner backend's ops (meant for the CPU, whose ops read the step's metadata
// when they run): between graph_capture_begin and graph_capture_end every op and collective is recorded instead of
// run; graph_replay runs the recording against the current step. The model and the rank set then take exactly the
// path they take with CUDA graphs (padding, fixed sizes, DP-attention decisions), so CPU tests cover it.
class GraphRecorder final : public ForwardingBackend {
 public:
  explicit GraphRecorder(std::unique_ptr<Backend> inner) : ForwardingBackend(*inner), owned_(std::move(inner)) {}
  std::string name() const override { return b_.name() + "+graphs"; }
  bool supports_graphs() const override { return true; }
  void begin_step(const ForwardBatch& b) override;
  void begin_substep(const ForwardBatch& b) override;
  void begin_graph_step(const ForwardBatch& b) override;
  void graph_capture_begin() override;
  int32_t graph_capture_end() override;
  void graph_replay(int32_t g) override;
  void release_graphs() override { graphs_.clear(); }
  void collective(std::function<void()> fn) override { run(std::move(fn)); }

  void resolve_prev_ids(const Tensor& p) override { run([this, p] { b_.resolve_prev_ids(p); }); }
  void set_input_ids(std::span<const int32_t> ids) override {
    run([this, v = std::vector<int32_t>(ids.begin(), ids.end())] { b_.set_input_ids(v); });
  }
  void embedding(const Tensor& t, int64_t vb, Tensor& o) override {
    run([this, t, vb, o]() mutable { b_.embedding(t, vb, o); });
  }
  void rmsnorm(const Tensor& x, const Tensor& w, float e, Tensor& o) override {
    run([this, x, w, e, o]() mutable { b_.rmsnorm(x, w, e, o); });
  }
  void add_rmsnorm(const Tensor& x, Tensor& r, const Tensor& w, float e, Tensor& o) override {
    run([this, x, r, w, e, o]() mutable { b_.add_rmsnorm(x, r, w, e, o); });
  }
  void linear(const Tensor& x, const Tensor& w, Tensor& y) override {
    run([this, x, w, y]() mutable { b_.linear(x, w, y); });
  }
  void silu_mul(const Tensor& g, Tensor& o) override { run([this, g, o]() mutable { b_.silu_mul(g, o); }); }
  void zero(Tensor& t) override { run([this, t]() mutable { b_.zero(t); }); }
  void copy(const Tensor& s, Tensor& d) override { run([this, s, d]() mutable { b_.copy(s, d); }); }
  void add(Tensor& a, const Tensor& x) override { run([this, a, x]() mutable { b_.add(a, x); }); }
  void gather_logit_rows(const Tensor& x, Tensor& o) override {
    run([this, x, o]() mutable { b_.gather_logit_rows(x, o); });
  }
  void gather_rows(const Tensor& x, std::span<const int32_t> r, Tensor& o) override {
    run([this, x, v = std::vector<int32_t>(r.begin(), r.end()), o]() mutable { b_.gather_rows(x, v, o); });
  }
  void interleave_blocks(const Tensor& p, int64_t n, Tensor& o) override {
    run([this, p, n, o]() mutable { b_.interleave_blocks(p, n, o); });
  }
  void mla_write_latent(Tensor& l, const Tensor& w, float e, Tensor& c) override {
    run([this, l, w, e, c]() mutable { b_.mla_write_latent(l, w, e, c); });
  }
  void mla_rope_q(Tensor& q, int32_t a, int32_t n, int32_t r) override {
    run([this, q, a, n, r]() mutable { b_.mla_rope_q(q, a, n, r); });
  }
  void mla_attention(const Tensor& q, const Tensor& c, const Tensor& k, const MlaParams& p, Tensor& o) override {
    run([this, q, c, k, p, o]() mutable { b_.mla_attention(q, c, k, p, o); });
  }
  void moe_route(const Tensor& l, const Tensor* bias, const RouterParams& p, Tensor& i, Tensor& w) override {
    run([this, l, bias, p, i, w]() mutable { b_.moe_route(l, bias, p, i, w); });
  }
  void count_experts(const Tensor& i, Tensor& c) override { run([this, i, c]() mutable { b_.count_experts(i, c); }); }
  void moe_experts(const Tensor& x, const Tensor& i, const Tensor& w, const Tensor& g, const Tensor& d, int32_t eb,
                   const Tensor* sg, const Tensor* sd, int32_t nf, Tensor& o) override {
    const Tensor sgv = sg ? *sg : Tensor(), sdv = sd ? *sd : Tensor();
    run([this, x, i, w, g, d, eb, sgv, sdv, nf, o]() mutable {
      b_.moe_experts(x, i, w, g, d, eb, sgv.defined() ? &sgv : nullptr, sdv.defined() ? &sdv : nullptr, nf, o);
    });
  }
  void sample(const Tensor& l, std::span<const RowSampling> p, Tensor& i, Tensor* lp) override;
  // The staged rows are kept here; a recorded sample_staged samples those staged before its replay.
  void stage_sample(std::span<const RowSampling> p, const Tensor* lp) override;
  void sample_staged(const Tensor& l, Tensor& i) override;

 private:
  void run(std::function<void()> op);
  // A step begins (`what`: the call, named if a graph is being recorded): nothing staged, its token count kept.
  void new_step(const char* what, const ForwardBatch& b, bool graph);
  std::unique_ptr<Backend> owned_;
  bool graph_step_ = false, recording_ = false;
  std::vector<RowSampling> staged_;
  Tensor staged_logprobs_;  // (undefined: none)
  int64_t staged_rows_ = -1;  // -1: nothing staged this step
  int64_t step_tokens_ = 0;
  std::vector<std::function<void()>> current_;
  std::vector<std::vector<std::function<void()>>> graphs_;
};

}  // namespace mlaserve
