// Communicator: the collectives the parallel layouts need. Implementations: single-rank (this file),
// in-process for CPU ranks and NCCL for GPUs (parallel issue). Every rank must issue the same collectives
// with the same shapes in the same order; sizes are in elements of the tensor's dtype.
#pragma once

#include <vector>

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
  // Unequal sizes: rank r contributes counts[r] rows (in has counts[rank] rows); out has sum(counts) rows,
  // rank r's rows first at offset sum(counts[:r]).
  virtual void all_gather_v(const Tensor& in, Tensor& out, const std::vector<int64_t>& counts) = 0;
  // out[n, ...] = sum over ranks of rows [rank * n, (rank + 1) * n) of in[size * n, ...].
  virtual void reduce_scatter_sum(const Tensor& in, Tensor& out) = 0;
  // Copies root's t into every rank's t (same shape everywhere).
  virtual void broadcast(Tensor& t, int root) = 0;
  virtual void barrier() = 0;
  // From any thread: collectives in flight on this rank return with an error instead of waiting for a rank that
  // failed (in-process groups wake every rank of the group; NCCL only this process's, so other nodes must be told:
  // RankSet's kAbort / kFailed). The communicator is unusable afterwards. (One rank: nothing to wake.)
  virtual void abort() {}
  // From any thread: a message when the communicator failed outside a call (NCCL's asynchronous errors: a peer or
  // link lost), after which its collectives may never return; empty while healthy. RankSet polls it while its ranks
  // work and aborts the communicators when it is set.
  virtual std::string async_error() { return {}; }
};

// The trivial group of one rank: every collective is the identity.
class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(Tensor&) override {}
  void all_gather(const Tensor& in, Tensor& out) override;
  void all_gather_v(const Tensor& in, Tensor& out, const std::vector<int64_t>& counts) override;
  void reduce_scatter_sum(const Tensor& in, Tensor& out) override;
  void broadcast(Tensor&, int) override {}
  void barrier() override {}
};

}  // namespace mlaserve
