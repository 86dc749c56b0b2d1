// Engine: one DP rank's serving loop on its own thread: inbox -> Scheduler::schedule -> DeepseekModel::forward
// -> sample -> Scheduler::commit -> outputs. Implements EngineClient for a single rank (tp = dp = 1); the
// parallel layouts compose several of these (engine/dp_controller, parallel issue).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "engine/engine_api.h"
#include "engine/scheduler.h"
#include "model/deepseek_model.h"

namespace mlaserve {

struct EngineOptions {
  int32_t page_size = 16;
  int32_t num_pages = 0;
  int32_t max_running_requests = 256;
  int32_t chunked_prefill_size = 8192;
  int64_t context_len = 0;
  bool enable_radix_cache = true;
  bool check_integrity = false;  // after every step (tests)
  std::vector<int32_t> eos_token_ids;
};

class Engine final : public EngineClient {
 public:
  // Takes ownership of the backend and the loaded model.
  Engine(std::unique_ptr<Backend> backend, std::unique_ptr<DeepseekModel> model, const EngineOptions& opts);
  ~Engine() override;

  void submit(GenerateRequest req) override;
  void abort(const std::string& rid, FinishReason reason) override;
  std::vector<RankStats> stats() const override;
  bool flush_cache() override;
  int64_t max_context_len() const override { return opts_.context_len; }
  std::vector<int32_t> eos_token_ids() const override { return opts_.eos_token_ids; }
  void shutdown() override;

 private:
  void loop();
  void step();
  void publish_stats();

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<DeepseekModel> model_;
  EngineOptions opts_;
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<Scheduler> sched_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenerateRequest> inbox_;
  std::deque<std::pair<std::string, FinishReason>> aborts_;
  int flush_requests_ = 0;
  int flush_done_ = 0;
  bool flush_ok_ = false;
  std::condition_variable flush_cv_;
  bool stop_ = false;
  RankStats published_;
  std::vector<float> scratch_;
  std::thread thread_;
};

}  // namespace mlaserve
