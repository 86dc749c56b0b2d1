#include "parallel/inprocess_communicator.h"

#include <cstring>

#include <fmt/format.h>

#include "core/error.h"

namespace mlaserve {

InProcessGroup::InProcessGroup(int size, std::chrono::milliseconds timeout)
    : size_(size),
      timeout_(timeout),
      present_(static_cast<size_t>(size), 0),
      rank_aborted_(static_cast<size_t>(size), 0),
      slots_(static_cast<size_t>(size), nullptr) {
  MLA_CHECK(size >= 1, "communicator group size must be >= 1");
}

void InProcessGroup::arrive_and_wait(int rank, const char* what) {
  std::unique_lock<std::mutex> lk(mu_);
  const char& mine = rank_aborted_[static_cast<size_t>(rank)];
  if (aborted_) fail("collective {} on rank {}: group aborted ({})", what, rank, abort_reason_);
  if (mine) fail("collective {} on rank {}: this rank's communicator was aborted", what, rank);
  const uint64_t gen = generation_;
  present_[static_cast<size_t>(rank)] = 1;
  if (++arrived_ == size_ && async_error_.empty()) {
    arrived_ = 0;
    std::fill(present_.begin(), present_.end(), 0);
    ++generation_;
    cv_.notify_all();
    return;
  }
  if (!cv_.wait_for(lk, timeout_, [&] { return generation_ != gen || aborted_ || mine; })) {
    std::string missing;
    for (int r = 0; r < size_; ++r)
      if (!present_[static_cast<size_t>(r)]) missing.append(missing.empty() ? "" : ",").append(std::to_string(r));
    aborted_ = true;
    abort_reason_ = fmt::format("{} timed out after {} ms waiting for ranks {}", what, timeout_.count(), missing);
    cv_.notify_all();
    fail("collective {}", abort_reason_);
  }
  if (generation_ == gen && aborted_) fail("collective {} on rank {}: group aborted ({})", what, rank, abort_reason_);
  if (generation_ == gen && mine) fail("collective {} on rank {}: this rank's communicator was aborted", what, rank);
}

void InProcessGroup::fail_async(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  async_error_ = why;
}

std::string InProcessGroup::async_error() {
  std::lock_guard<std::mutex> lk(mu_);
  return async_error_;
}

void InProcessGroup::abort_rank(int rank) {
  std::lock_guard<std::mutex> lk(mu_);
  rank_aborted_[static_cast<size_t>(rank)] = 1;
  cv_.notify_all();
}

void InProcessGroup::abort(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = why;
  }
  cv_.notify_all();
}

void InProcessCommunicator::all_reduce_sum(Tensor& t) {
  MLA_CHECK(t.device() == Device::CPU && t.dtype() == DType::F32, "in-process all_reduce needs host F32 tensors");
  if (size() == 1) return;
  const int64_t n = t.numel();
  group_->post(rank_, t.data());
  group_->arrive_and_wait(rank_, "all_reduce");
  temp_.assign(static_cast<size_t>(n), 0.0f);
  for (int r = 0; r < size(); ++r) {
    const float* src = static_cast<const float*>(group_->slot(r));
    for (int64_t i = 0; i < n; ++i) temp_[static_cast<size_t>(i)] += src[i];
  }
  group_->arrive_and_wait(rank_, "all_reduce");  // everyone has read every input
  if (n > 0) std::memcpy(t.data(), temp_.data(), static_cast<size_t>(n) * sizeof(float));  // empty: null pointers
}

void InProcessCommunicator::all_gather(const Tensor& in, Tensor& out) {
  MLA_CHECK(in.device() == Device::CPU && out.device() == Device::CPU, "in-process all_gather needs host tensors");
  MLA_CHECK(out.nbytes() == in.nbytes() * static_cast<size_t>(size()), "all_gather: output of {} bytes for {} x {} bytes",
            out.nbytes(), size(), in.nbytes());
  group_->post(rank_, in.data());
  group_->arrive_and_wait(rank_, "all_gather");
  for (int r = 0; r < size(); ++r)
    if (in.nbytes() > 0)
      std::memcpy(static_cast<char*>(out.data()) + static_cast<size_t>(r) * in.nbytes(), group_->slot(r), in.nbytes());
  group_->arrive_and_wait(rank_, "all_gather");
}

void InProcessCommunicator::all_gather_v(const Tensor& in, Tensor& out, const std::vector<int64_t>& counts) {
  MLA_CHECK(static_cast<int>(counts.size()) == size(), "all_gather_v: {} counts for {} ranks", counts.size(), size());
  const size_t row = in.dim() > 0 && in.size(0) > 0 ? in.nbytes() / static_cast<size_t>(in.size(0))
                                                    : (out.dim() > 0 && out.size(0) > 0 ? out.nbytes() / static_cast<size_t>(out.size(0)) : 0);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  MLA_CHECK(in.dim() >= 1 && in.size(0) == counts[static_cast<size_t>(rank_)] && out.size(0) == total,
            "all_gather_v: rank {} has {} rows (count {}), output {} rows (total {})", rank_, in.size(0),
            counts[static_cast<size_t>(rank_)], out.size(0), total);
  group_->post(rank_, in.data());
  group_->arrive_and_wait(rank_, "all_gather_v");
  size_t off = 0;
  for (int r = 0; r < size(); ++r) {
    const size_t bytes = static_cast<size_t>(counts[static_cast<size_t>(r)]) * row;
    if (bytes) std::memcpy(static_cast<char*>(out.data()) + off, group_->slot(r), bytes);
    off += bytes;
  }
  group_->arrive_and_wait(rank_, "all_gather_v");
}

void InProcessCommunicator::reduce_scatter_sum(const Tensor& in, Tensor& out) {
  MLA_CHECK(in.dtype() == DType::F32 && out.dtype() == DType::F32, "in-process reduce_scatter needs F32");
  MLA_CHECK(in.numel() == out.numel() * size(), "reduce_scatter: input {} elements for output {} x {}", in.numel(),
            size(), out.numel());
  const int64_t n = out.numel();
  group_->post(rank_, in.data());
  group_->arrive_and_wait(rank_, "reduce_scatter");
  float* o = out.data_as<float>();
  std::fill(o, o + n, 0.0f);
  for (int r = 0; r < size(); ++r) {
    const float* src = static_cast<const float*>(group_->slot(r)) + static_cast<int64_t>(rank_) * n;
    for (int64_t i = 0; i < n; ++i) o[i] += src[i];
  }
  group_->arrive_and_wait(rank_, "reduce_scatter");
}

void InProcessCommunicator::broadcast(Tensor& t, int root) {
  MLA_CHECK(t.device() == Device::CPU, "in-process broadcast needs host tensors");
  if (size() == 1) return;
  group_->post(rank_, t.data());
  group_->arrive_and_wait(rank_, "broadcast");
  if (rank_ != root && t.nbytes() > 0) std::memcpy(t.data(), group_->slot(root), t.nbytes());
  group_->arrive_and_wait(rank_, "broadcast");
}

std::vector<std::unique_ptr<InProcessCommunicator>> make_inprocess_communicators(int size) {
  auto g = std::make_shared<InProcessGroup>(size);
  std::vector<std::unique_ptr<InProcessCommunicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<InProcessCommunicator>(g, r));
  return out;
}

}  // namespace mlaserve
