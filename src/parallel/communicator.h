// Communicator: the collectives the parallel layouts need. Implementations: single-rank (this file),
// in-process for CPU ranks and NCCL for GPUs (parallel issue). Every rank must issue the same collectives
// with the same shapes in the same order; sizes are in elements of the tensor's dtype.
#pragma once

#include "core/tensor.h"

namespace mlaserve {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: t = sum over ranks of t.
  virtual void all_reduce_sum(Tensor& t) = 0;
  // out[size * n, ...] = concat over ranks of in[n, ...] along dim 0.
  virtual void all_gather(const Tensor& in, Tensor& out) = 0;
  virtual void barrier() = 0;
};

// The trivial group of one rank: every collective is the identity.
class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(Tensor&) override {}
  void all_gather(const Tensor& in, Tensor& out) override;
  void barrier() override {}
};

}  // namespace mlaserve
