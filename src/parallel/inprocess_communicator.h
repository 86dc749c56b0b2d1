// In-process communicator for CPU ranks: the ranks are threads of one process sharing an InProcessGroup.
// Collectives rendezvous on a generation barrier; every rank reduces in rank order, so all ranks get
// bit-identical results. A rank that fails calls abort(), which wakes every waiter with an error instead of a
// hang; a barrier that waits longer than the timeout throws, naming the collective and the ranks missing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace mlaserve {

class InProcessGroup {
 public:
  explicit InProcessGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(300));
  int size() const { return size_; }
  // Waits until all ranks arrive (or throws on abort / timeout).
  void arrive_and_wait(int rank, const char* what);
  void abort(const std::string& why);
  // Wakes only `rank` (its waits and later collectives throw): what an abort on one node does to a communicator that
  // spans nodes (NCCL), where the other nodes' ranks go on waiting. Tests of several simulated nodes use it.
  void abort_rank(int rank);
  // Tests: what NCCL does after an asynchronous error: async_error() returns `why`, and collectives stop completing
  // (ranks wait in them until an abort or the timeout).
  void fail_async(const std::string& why);
  std::string async_error();
  void post(int rank, const void* p) { slots_[static_cast<size_t>(rank)] = p; }
  const void* slot(int rank) const { return slots_[static_cast<size_t>(rank)]; }

 private:
  int size_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<char> present_;
  std::vector<char> rank_aborted_;
  bool aborted_ = false;
  std::string abort_reason_;
  std::string async_error_;  // fail_async: collectives stall
  std::vector<const void*> slots_;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  void all_reduce_sum(Tensor& t) override;
  void all_gather(const Tensor& in, Tensor& out) override;
  void all_gather_v(const Tensor& in, Tensor& out, const std::vector<int64_t>& counts) override;
  void reduce_scatter_sum(const Tensor& in, Tensor& out) override;
  void broadcast(Tensor& t, int root) override;
  void barrier() override { group_->arrive_and_wait(rank_, "barrier"); }
  void abort() override { group_->abort("another rank failed"); }
  std::string async_error() override { return group_->async_error(); }
  InProcessGroup& group() { return *group_; }

 private:
  std::shared_ptr<InProcessGroup> group_;
  int rank_;
  std::vector<float> temp_;
};

// Makes `size` communicators over one new group (index = rank).
std::vector<std::unique_ptr<InProcessCommunicator>> make_inprocess_communicators(int size);

}  // namespace mlaserve
