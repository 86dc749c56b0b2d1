#include "backend/backend.h"

#include <algorithm>
#include <cstring>
#include <new>

namespace mlaserve {

namespace {

// The rows' checks of sample() and stage_sample() (`what`): logprobs F32 [R], every pending input a token of the step.
void check_rows(const char* what, std::span<const RowSampling> params, const Tensor* logprobs, int64_t step_tokens) {
  const int64_t R = static_cast<int64_t>(params.size());
  MLA_CHECK(!logprobs || (logprobs->dtype() == DType::F32 && logprobs->numel() == R), "{}: logprobs must be F32 [{}]",
            what, R);
  for (const RowSampling& s : params)
    MLA_CHECK(s.pending_input < step_tokens, "{}: pending input {} of a {}-token step", what, s.pending_input,
              step_tokens);
}

}  // namespace

int64_t Backend::check_sample(const Tensor& logits, std::span<const RowSampling> params, const Tensor& ids,
                              const Tensor* logprobs, int64_t step_tokens) {
  const int64_t R = logits.dim() >= 1 ? logits.numel() / std::max<int64_t>(logits.size(-1), 1) : 0;
  MLA_CHECK(static_cast<int64_t>(params.size()) == R, "sample: {} parameter rows for {} logit rows", params.size(), R);
  MLA_CHECK(logits.dtype() == DType::F32, "sample: logits must be F32");
  MLA_CHECK(ids.dtype() == DType::I32 && ids.numel() == R, "sample: ids must be I32 [{}]", R);
  check_rows("sample", params, logprobs, step_tokens);
  return R;
}

int64_t Backend::check_staged_sample(std::span<const RowSampling> params, const Tensor* logprobs,
                                     int64_t step_tokens) {
  const int64_t R = static_cast<int64_t>(params.size());
  MLA_CHECK(R <= step_tokens, "stage_sample: {} rows for a step of {} tokens", R, step_tokens);
  check_rows("stage_sample", params, logprobs, step_tokens);
  return R;
}

void Backend::check_sample_staged(const Tensor& logits, const Tensor& ids, int64_t staged) {
  MLA_CHECK(staged >= 0, "sample_staged: no rows were staged this step (stage_sample first)");
  MLA_CHECK(logits.dim() == 2 && logits.dtype() == DType::F32, "sample_staged: logits must be F32 [rows, vocab]");
  MLA_CHECK(logits.size(0) >= staged, "sample_staged: {} rows staged for {} logit rows", staged, logits.size(0));
  MLA_CHECK(ids.dtype() == DType::I32 && ids.numel() == logits.size(0), "sample_staged: ids must be I32 [{}]",
            logits.size(0));
}

void Backend::moe_gate(const Tensor& x, const Tensor& router, const Tensor* bias, const RouterParams& p,
                       Tensor& topk_ids, Tensor& topk_weights) {
  MLA_CHECK(x.dim() == 2 && router.dim() == 2 && router.size(1) == x.size(1),
            "moe_gate: router {} does not match input {}", shape_str(router.shape()), shape_str(x.shape()));
  Tensor logits = scratch({x.size(0), router.size(0)}, DType::F32);
  linear(x, router, logits);
  moe_route(logits, bias, p, topk_ids, topk_weights);
}

uint64_t Backend::download_start(const Tensor& t) {
  MLA_CHECK(done_downloads_.size() < static_cast<size_t>(kMaxDownloads), "more than {} downloads in flight",
            kMaxDownloads);
  std::vector<char> bytes(t.nbytes());
  download(t, bytes.data());
  done_downloads_.emplace_back(next_download_, std::move(bytes));
  return next_download_++;
}

void Backend::download_finish(uint64_t ticket, void* dst) {
  MLA_CHECK(!done_downloads_.empty() && done_downloads_.front().first == ticket,
            "download {} finished out of order or twice", ticket);
  const std::vector<char>& b = done_downloads_.front().second;
  if (!b.empty()) std::memcpy(dst, b.data(), b.size());
  done_downloads_.pop_front();
}

void* Backend::alloc_host(size_t bytes) {
  void* p = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t{64});
  std::memset(p, 0, bytes);
  return p;
}

void Backend::free_host(void* p) { ::operator delete(p, std::align_val_t{64}); }

void Backend::copy_kv_pages(std::span<Tensor* const> layers, int64_t page_bytes, char* host,
                            std::span<const int32_t> saves, std::span<const int32_t> loads) {
  const auto bytes = static_cast<size_t>(page_bytes);
  for (const bool to_host : {true, false}) {
    const std::span<const int32_t> pairs = to_host ? saves : loads;
    for (size_t i = 0; i + 1 < pairs.size(); i += 2) {
      const int32_t page = to_host ? pairs[i] : pairs[i + 1], slot = to_host ? pairs[i + 1] : pairs[i];
      char* h = host + static_cast<size_t>(slot) * layers.size() * bytes;
      for (Tensor* t : layers) {
        char* d = static_cast<char*>(t->data()) + static_cast<size_t>(page) * bytes;
        if (to_host) std::memcpy(h, d, bytes);
        else std::memcpy(d, h, bytes);
        h += bytes;
      }
    }
  }
}

int64_t shared_experts_width(const Tensor& x, const Tensor* gate_up, const Tensor* down, const Tensor& out) {
  if (!gate_up && !down) return 0;
  MLA_CHECK(gate_up && down, "moe_experts: shared experts need both their gate_up and down weights");
  const int64_t H = x.size(-1), Is = down->size(-1);
  MLA_CHECK(gate_up->dim() == 2 && gate_up->size(0) == 2 * Is && gate_up->size(1) == H && down->dim() == 2 &&
                down->size(0) == out.size(-1),
            "moe_experts: shared experts gate_up {} / down {} do not match hidden {}", shape_str(gate_up->shape()),
            shape_str(down->shape()), H);
  return Is;
}

void shared_experts_mlp(Backend& be, const Tensor& x, const Tensor& gate_up, const Tensor& down, int64_t Is,
                        Tensor& y) {
  const int64_t H = x.size(-1), T = H ? x.numel() / H : 0;
  const size_t mark = be.scratch_mark();
  Tensor gu = be.scratch({T, 2 * Is}, be.act_dtype()), act = be.scratch({T, Is}, be.act_dtype());
  be.linear(x, gate_up, gu);
  be.silu_mul(gu, act);
  be.linear(act, down, y);
  be.scratch_release(mark);
}

void add_shared_experts(Backend& be, const Tensor& x, const Tensor* gate_up, const Tensor* down, Tensor& out) {
  const int64_t Is = shared_experts_width(x, gate_up, down, out);
  if (Is == 0) return;
  const int64_t H = x.size(-1), T = H ? x.numel() / H : 0;
  const size_t mark = be.scratch_mark();
  Tensor y = be.scratch({T, out.size(-1)}, out.dtype());
  shared_experts_mlp(be, x, *gate_up, *down, Is, y);
  be.add(out, y);
  be.scratch_release(mark);
}

}  // namespace mlaserve
