// Tests override the ops they watch on ForwardingBackend (src/backend/forwarding_backend.h).
// RouteRecorder / RouteReplayer record the MoE routing decisions of one run and force (or compare) them in another,
// which separates numerical differences from discrete routing flips (near-tied experts that bf16 rounding reorders).
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "backend/forwarding_backend.h"

namespace mlaserve::test {

using mlaserve::ForwardingBackend;

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
  // Owning its inner backend (a rank's backend in a RankSet, through ParallelConfig::wrap_backend).
  RouteReplayer(std::unique_ptr<Backend> inner, const RouteLog& log, bool force)
      : ForwardingBackend(*inner), log_(log), force_(force), owned_(std::move(inner)) {}
  int64_t flips = 0, decisions = 0;
  // Attention is not watched: the inner backend's own fused preparation + attention runs (e.g. the CUDA one-token
  // kernel), as in the engine.
  void mla_prepare_attention(Tensor& q, Tensor& l, const Tensor& nw, float eps, Tensor& c, const Tensor& kvb,
                             const MlaParams& p, Tensor& o) override {
    b_.mla_prepare_attention(q, l, nw, eps, c, kvb, p, o);
  }
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
  std::unique_ptr<Backend> owned_;
};

}  // namespace mlaserve::test
