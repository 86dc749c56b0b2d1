// RankSet: every rank of one model replica in this process (CPU ranks as threads, or one GPU each), run in
// lockstep. A step takes one ForwardBatch per attention-DP group (an empty batch: that group runs an IDLE
// forward and still joins every collective) and returns the host logits of each group. When every group is
// empty nothing runs. A rank that fails aborts the communicator groups, so no other rank hangs.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "model/deepseek_model.h"
#include "parallel/communicator.h"

namespace mlaserve {

struct ParallelConfig {
  int32_t tp_size = 1;
  int32_t dp_size = 1;  // attention-DP groups (DP attention); 1 = plain TP
  std::string device = "auto";
};

class RankSet {
 public:
  RankSet(const ModelConfig& config, const ParallelConfig& pc, const std::string& model_dir, const LoadOptions& lo);
  ~RankSet();

  int32_t num_ranks() const { return pc_.tp_size; }
  int32_t dp_groups() const { return pc_.dp_size; }
  const ModelConfig& config() const { return config_; }
  Backend& backend(int rank) { return *ranks_[static_cast<size_t>(rank)]->backend; }
  int64_t weight_bytes_per_rank() const;
  DType act_dtype() const { return ranks_[0]->backend->act_dtype(); }

  // Gives every rank a latent cache of `num_pages` pages (ranks of one DP group hold the same sequences).
  void allocate_kv(int32_t num_pages, int32_t page_size);
  // One forward on every rank; batches[g] for DP group g. Returns F32 host logits [rows_g, vocab] per group.
  std::vector<Tensor> step(const std::vector<const ForwardBatch*>& batches, MlaForm form = MlaForm::Auto);

 private:
  struct Rank {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Communicator> world, attn;
    std::unique_ptr<DeepseekModel> model;
    std::unique_ptr<KvCache> kv;
    std::thread thread;
  };
  void run_on_all(const std::function<void(int)>& fn);
  void worker(int rank);
  void stop_workers();

  ModelConfig config_;
  ParallelConfig pc_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<std::function<void()>> abort_groups_;

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::string> errors_;
};

}  // namespace mlaserve
