#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <mutex>

#include "core/error.h"

namespace mlaserve {

namespace {

void nccl_check(ncclResult_t r, const char* what) {
  MLA_CHECK(r == ncclSuccess, "NCCL {} failed: {}", what, ncclGetErrorString(r));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::U8: return ncclUint8;
    default: fail("NCCL: unsupported dtype {}", dtype_name(t));
  }
}

}  // namespace

struct NcclCommunicator::Impl {
  std::mutex mu;  // abort and async_error, which other threads call
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
};

std::string nccl_unique_id() {
  ncclUniqueId id;
  nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int size, int rank, int device, void* stream)
    : impl_(std::make_unique<Impl>()), size_(size), rank_(rank) {
  MLA_CHECK(unique_id.size() == sizeof(ncclUniqueId), "NCCL unique id has {} bytes, expected {}", unique_id.size(),
            sizeof(ncclUniqueId));
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof id);
  impl_->device = device;
  impl_->stream = static_cast<cudaStream_t>(stream);
  MLA_CHECK(cudaSetDevice(device) == cudaSuccess, "cudaSetDevice({}) failed", device);
  nccl_check(ncclCommInitRank(&impl_->comm, size, id, rank), "ncclCommInitRank");
}

NcclCommunicator::~NcclCommunicator() {
  if (impl_ && impl_->comm) ncclCommDestroy(impl_->comm);
}

void NcclCommunicator::abort() {
  if (!impl_) return;
  std::lock_guard<std::mutex> lk(impl_->mu);
  if (impl_->comm) {
    ncclCommAbort(impl_->comm);
    impl_->comm = nullptr;
  }
}

std::string NcclCommunicator::async_error() {
  if (!impl_) return {};
  std::lock_guard<std::mutex> lk(impl_->mu);
  if (!impl_->comm) return {};
  ncclResult_t r = ncclSuccess;
  if (ncclCommGetAsyncError(impl_->comm, &r) != ncclSuccess || r == ncclSuccess || r == ncclInProgress) return {};
  const char* last = ncclGetLastError(impl_->comm);
  return fmt::format("NCCL asynchronous error on rank {} of {}: {}{}{}", rank_, size_, ncclGetErrorString(r),
                     last && *last ? ": " : "", last ? last : "");
}

void NcclCommunicator::all_reduce_sum(Tensor& t) {
  if (size_ == 1 || t.numel() == 0) return;
  nccl_check(ncclAllReduce(t.data(), t.data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), ncclSum,
                           impl_->comm, impl_->stream),
             "all_reduce");
}

void NcclCommunicator::all_gather(const Tensor& in, Tensor& out) {
  MLA_CHECK(out.nbytes() == in.nbytes() * static_cast<size_t>(size_), "all_gather: output size mismatch");
  nccl_check(ncclAllGather(in.data(), out.data(), static_cast<size_t>(in.numel()), nccl_type(in.dtype()), impl_->comm,
                           impl_->stream),
             "all_gather");
}

void NcclCommunicator::all_gather_v(const Tensor& in, Tensor& out, const std::vector<int64_t>& counts) {
  MLA_CHECK(static_cast<int>(counts.size()) == size_, "all_gather_v: {} counts for {} ranks", counts.size(), size_);
  // As broadcasts from every rank in one group call (NCCL has no native gather-v).
  const int64_t row = out.size(0) > 0 ? out.numel() / out.size(0) : 0;
  const size_t esz = dtype_size(out.dtype());
  nccl_check(ncclGroupStart(), "group start");
  int64_t off = 0;
  for (int r = 0; r < size_; ++r) {
    const int64_t n = counts[static_cast<size_t>(r)] * row;
    char* dst = static_cast<char*>(out.data()) + static_cast<size_t>(off) * esz;
    if (n > 0)
      nccl_check(ncclBroadcast(r == rank_ ? in.data() : dst, dst, static_cast<size_t>(n), nccl_type(out.dtype()), r,
                               impl_->comm, impl_->stream),
                 "all_gather_v");
    off += n;
  }
  nccl_check(ncclGroupEnd(), "group end");
}

void NcclCommunicator::reduce_scatter_sum(const Tensor& in, Tensor& out) {
  MLA_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: size mismatch");
  nccl_check(ncclReduceScatter(in.data(), out.data(), static_cast<size_t>(out.numel()), nccl_type(out.dtype()), ncclSum,
                               impl_->comm, impl_->stream),
             "reduce_scatter");
}

void NcclCommunicator::broadcast(Tensor& t, int root) {
  nccl_check(ncclBroadcast(t.data(), t.data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), root, impl_->comm,
                           impl_->stream),
             "broadcast");
}

void NcclCommunicator::barrier() {
  // A one-element all-reduce, then wait for it: every rank has reached this point.
  void* p = nullptr;
  MLA_CHECK(cudaMallocAsync(&p, 4, impl_->stream) == cudaSuccess, "barrier: allocation failed");
  nccl_check(ncclAllReduce(p, p, 1, ncclFloat32, ncclSum, impl_->comm, impl_->stream), "barrier");
  cudaFreeAsync(p, impl_->stream);
  MLA_CHECK(cudaStreamSynchronize(impl_->stream) == cudaSuccess, "barrier: stream sync failed");
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::split(int color, int key) {
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator());
  c->impl_ = std::make_unique<Impl>();
  c->impl_->stream = impl_->stream;
  c->impl_->device = impl_->device;
  nccl_check(ncclCommSplit(impl_->comm, color, key, &c->impl_->comm, nullptr), "ncclCommSplit");
  nccl_check(ncclCommCount(c->impl_->comm, &c->size_), "ncclCommCount");
  nccl_check(ncclCommUserRank(c->impl_->comm, &c->rank_), "ncclCommUserRank");
  return c;
}

}  // namespace mlaserve
