// DpController: --dp D without DP attention: D independent replicas (each an Engine over its own --tp ranks)
// behind one EngineClient. Each request goes to one replica (LoadBalancer: round robin, or the replica with the
// fewest tokens in flight; a request may pin data_parallel_rank); aborts follow the request.
#pragma once

#include <memory>
#include <vector>

#include "engine/engine_api.h"
#include "engine/load_balancer.h"

namespace mlaserve {

class DpController final : public EngineClient {
 public:
  // `cache_tokens`: one replica's prefix cache size in tokens (LoadBalancer's; 0: no prefix cache).
  DpController(std::vector<std::unique_ptr<EngineClient>> replicas, const std::string& method,
               int64_t cache_tokens = 0, const BalanceThresholds& thresholds = {});
  ~DpController() override;
  void submit(GenerateRequest req) override;
  void abort(const std::string& rid, FinishReason reason) override;
  std::vector<RankStats> stats() const override;
  bool flush_cache() override;
  // Replica after replica; if one fails, those updated before it load their previous weights again.
  void update_weights(WeightUpdate u, std::function<void(const WeightUpdateResult&)> done) override;
  // Every replica; `done` once all have paused (true when each did).
  void pause_generation(PauseMode mode, std::function<void(bool)> done) override;
  bool continue_generation() override;
  bool is_paused() const override;
  bool memory_released() const override;  // any replica's
  // Every replica (at once); `done` with the first failure, once all answered.
  void release_memory(std::function<void(const WeightUpdateResult&)> done) override;
  void resume_memory(std::function<void(const WeightUpdateResult&)> done) override;
  // Every replica (at once); a dump sums their counts. `done` once all answered (the first failure's message).
  void expert_record(ExpertRecordOp op, std::function<void(const ExpertRecord&)> done) override;
  void get_weights(std::string name, int64_t rows, std::function<void(const std::vector<WeightValues>&)> done) override;
  // Every replica (at once), each its own trace ("replica<r>" in its name); `done` once all answered.
  void profile(const ProfileRequest& r, std::function<void(const ProfileResult&)> done) override;
  // From the replica that caches the longest prefix (each asked for its length first).
  void export_kv(std::vector<int32_t> tokens, std::string salt, int32_t begin, int32_t max_tokens,
                 std::function<void(KvRows)> done, int32_t rank = -1) override;
  int32_t choose_rank(std::span<const int32_t> prompt, std::string_view salt) override;
  int64_t max_context_len() const override { return replicas_[0]->max_context_len(); }
  int64_t hidden_size() const override { return replicas_[0]->hidden_size(); }
  std::vector<int32_t> eos_token_ids() const override { return replicas_[0]->eos_token_ids(); }
  void shutdown() override;

 private:
  struct UpdateChain {
    WeightUpdate u;
    std::function<void(const WeightUpdateResult&)> done;
    std::vector<std::string> previous;  // of the replicas updated so far
  };
  void update_next(std::shared_ptr<UpdateChain> c);
  // Calls `op` on every replica with one callback that calls `done` once all answered (the first failure's result).
  void on_all(const std::function<void(EngineClient&, std::function<void(const WeightUpdateResult&)>)>& op,
              std::function<void(const WeightUpdateResult&)> done);
  // Replicas [0, c->previous.size()) load their previous weights again (the last first), then c->done(why).
  void roll_back(std::shared_ptr<UpdateChain> c, std::string why);

  std::vector<std::unique_ptr<EngineClient>> replicas_;
  LoadBalancer balancer_;
};

}  // namespace mlaserve
