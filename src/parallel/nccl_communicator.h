// NCCL communicator for GPU ranks: collectives on device tensors, enqueued on the rank's backend stream (so they
// are ordered with the model's kernels and can be captured in CUDA graphs). Built only with MLASERVE_CUDA.
#pragma once

#include <memory>
#include <string>

#include "parallel/communicator.h"

namespace mlaserve {

// 128 opaque bytes (ncclUniqueId) as a string, to hand to other ranks / nodes.
std::string nccl_unique_id();

class NcclCommunicator final : public Communicator {
 public:
  // Collective init: every rank of the group calls this (from its own thread) with the same id.
  NcclCommunicator(const std::string& unique_id, int size, int rank, int device, void* stream);
  ~NcclCommunicator() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce_sum(Tensor& t) override;
  void all_gather(const Tensor& in, Tensor& out) override;
  void all_gather_v(const Tensor& in, Tensor& out, const std::vector<int64_t>& counts) override;
  void reduce_scatter_sum(const Tensor& in, Tensor& out) override;
  void broadcast(Tensor& t, int root) override;
  void barrier() override;
  // Aborts the communicator (from any thread): collectives in flight return instead of waiting for a rank that
  // failed. The communicator is unusable afterwards.
  void abort() override;
  // ncclCommGetAsyncError (the watchdog's question), as a message naming the error; empty when healthy or aborted.
  std::string async_error() override;
  // A sub-group (ncclCommSplit): ranks with the same color, ordered by key.
  std::unique_ptr<NcclCommunicator> split(int color, int key);

 private:
  NcclCommunicator() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int size_ = 1, rank_ = 0;
};

}  // namespace mlaserve
