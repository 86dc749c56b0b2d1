// Engine: the serving loop of one model replica, on its own thread. The replica's ranks (RankSet: one, or
// --tp ranks, possibly in --dp attention-DP groups) run in lockstep; each attention-DP group has its own
// Scheduler, KV pool and prefix cache. Every step: drain the inbox (requests dispatched to a group by the
// LoadBalancer), each group schedules its batch, the ranks run one forward (groups with nothing to do run IDLE;
// when all are empty nothing runs), each group samples its own rows and commits. Because one thread takes every
// decision, all ranks always agree on the step (same collectives, same shapes).
#pragma once

#include <condition_variable>
#include <deque>
#include <optional>
#include <memory>
#include <mutex>
#include <thread>

#include "engine/engine_api.h"
#include "engine/load_balancer.h"
#include "engine/rank_set.h"
#include "engine/scheduler.h"
#include "engine/step_trace.h"

namespace mlaserve {

struct EngineOptions {
  int32_t page_size = 16;
  int32_t num_pages = 0;  // per DP group
  int32_t max_running_requests = 256;  // per DP group
  int32_t chunked_prefill_size = 8192;  // per DP group
  int64_t context_len = 0;
  bool enable_radix_cache = true;
  int32_t host_pages = 0;  // per DP group: the hierarchical cache's host tier (SchedulerConfig::host_pages); 0: none
  bool check_integrity = false;  // after every step (tests)
  std::string load_balance_method = "round_robin";
  BalanceThresholds balance;
  // Overlap scheduling: plan and launch step N+1 while step N runs (tokens sampled in N reach N+1 on the device;
  // stop checks happen one step late, never with wrong output). Off: plan, run, commit in turn.
  bool overlap = true;
  std::vector<int32_t> eos_token_ids;
  // Requests wait in order of GenerateRequest::priority (lower first), then arrival; decode retracts the lowest
  // priority first. Off: a request with a non-zero priority is refused.
  bool priority_scheduling = false;
  bool longest_prefix_first = false;  // SchedulerConfig::longest_prefix_first
  // SchedulerConfig::priority_preemption / priority_preemption_threshold (SGLang's priority preemption).
  bool priority_preemption = false;
  int32_t priority_preemption_threshold = 10;
  // Speculative decoding with n-gram drafts (SchedulerConfig::spec_draft_tokens; 0: off). With overlap scheduling a
  // request's step after one checking its drafts waits for it (its inputs depend on how many drafts were kept).
  int32_t spec_draft_tokens = 0;
  int32_t spec_ngram_min = 1;
  int32_t spec_ngram_max = 3;
  int32_t spec_max_batch = 0;  // SchedulerConfig::spec_max_batch
  // With RankSet::counts_experts: the expert distribution is recorded from the start (as after ExpertRecordOp::Start).
  bool record_experts = false;
};

using PhaseClock = std::chrono::steady_clock;

class Engine final : public EngineClient {
 public:
  Engine(std::unique_ptr<RankSet> ranks, const EngineOptions& opts);
  ~Engine() override;

  void submit(GenerateRequest req) override;
  void abort(const std::string& rid, FinishReason reason) override;
  std::vector<RankStats> stats() const override;
  bool flush_cache() override;
  void update_weights(WeightUpdate u, std::function<void(const WeightUpdateResult&)> done) override;
  void pause_generation(PauseMode mode, std::function<void(bool)> done) override;
  void release_memory(std::function<void(const WeightUpdateResult&)> done) override;
  void resume_memory(std::function<void(const WeightUpdateResult&)> done) override;
  void expert_record(ExpertRecordOp op, std::function<void(const ExpertRecord&)> done) override;
  void get_weights(std::string name, int64_t rows, std::function<void(const std::vector<WeightValues>&)> done) override;
  void profile(const ProfileRequest& r, std::function<void(const ProfileResult&)> done) override;
  void export_kv(std::vector<int32_t> tokens, std::string salt, int32_t begin, int32_t max_tokens,
                 std::function<void(KvRows)> done, int32_t rank = -1) override;
  int32_t choose_rank(std::span<const int32_t> prompt, std::string_view salt) override;
  bool continue_generation() override;
  bool is_paused() const override;
  bool memory_released() const override;
  int64_t max_context_len() const override { return opts_.context_len; }
  int64_t hidden_size() const override;
  std::vector<int32_t> eos_token_ids() const override { return opts_.eos_token_ids; }
  void shutdown() override;

 private:
  void loop();
  void step();          // one synchronous step (no overlap)
  void overlap_step();  // plan and launch the next step, then finish the running one
  // One RowSampling per logit row of each group; logit_rows: the rows that ask for top-N logprobs.
  std::vector<std::vector<RowSampling>> sampling_rows(const std::vector<StepPlan>& plans, LogitRows& logit_rows);
  void constrain(Req& r, RowSampling& row) const;
  std::vector<int32_t> stop_tokens(const SamplingParams& sp) const;
  void ban_stop_tokens(const SamplingParams& sp, RowSampling& row) const;
  std::vector<std::vector<SampleResult>> collect(std::vector<StepPlan>& plans, std::vector<GroupOutput>& outs);
  // Waits for the running step and resolves its samples (or aborts its requests if it failed).
  void finish_inflight();
  // Launches the planned step (its requests advance) as the one in flight; false if it failed (aborted).
  bool launch(std::vector<StepPlan> plans);
  void abort_plans(const std::vector<StepPlan>& plans, const std::string& why);
  void publish_stats();
  void deliver_outputs();

  std::unique_ptr<RankSet> ranks_;
  EngineOptions opts_;
  std::vector<std::unique_ptr<Scheduler>> scheds_;  // one per attention-DP group
  LoadBalancer balancer_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<int32_t, GenerateRequest>> inbox_;  // (group, request)
  std::deque<std::pair<std::string, FinishReason>> aborts_;
  int flush_requests_ = 0;
  int flush_done_ = 0;
  bool flush_ok_ = false;
  std::condition_variable flush_cv_;
  // Weight updates asked for (mu_), oldest first: the first runs once no request runs or is in flight. Requests
  // submitted before it (`ahead`: the inbox's requests in front of it) run first; those after it wait.
  // (Also the memory's release and resumption: they wait as an update does.)
  enum class Job { Weights, Release, Resume };
  struct PendingUpdate {
    WeightUpdate u;
    std::function<void(const WeightUpdateResult&)> done;
    size_t ahead = 0;
    Job job = Job::Weights;
  };
  // Queues a job (false: shutting down).
  bool queue_update(PendingUpdate p);
  // The first pending job run now (engine thread): its outcome.
  WeightUpdateResult run_job(const PendingUpdate& job);
  std::deque<PendingUpdate> updates_;
  // The first pending update, when nothing runs or the engine is paused (engine thread; false: not yet). Aborts
  // first if it asks.
  bool run_update(bool abort_first);
  // Pauses asked for (mu_), oldest first; `ahead` as for updates (the inbox's requests submitted before, which a
  // drain runs and an abort ends).
  struct PendingPause {
    PauseMode mode;
    std::function<void(bool)> done;
    size_t ahead = 0;
  };
  std::deque<PendingPause> pauses_;
  // The first pending pause once it can take effect (a drain: nothing left to run); engine thread.
  void run_pause();
  // Control jobs (expert distribution recording, profiling) asked for (mu_), in order; run by the engine thread
  // between steps (and at shutdown). False: shutting down, not queued.
  bool queue_control(std::function<void()> job);
  std::deque<std::function<void()>> controls_;
  ExpertRecord run_record(ExpertRecordOp op);
  // export_kv's job (engine thread; the step in flight finished first).
  // Every group's prefix cache flushed (engine thread; false if some still held pages), and the load balancer's
  // record of them.
  bool flush_caches();
  KvRows run_export(const std::vector<int32_t>& tokens, const std::string& salt, int32_t begin, int32_t max_tokens,
                    int32_t group);
  // A request's kv_prefix into group g's prefix cache (engine thread, no step in flight); then dropped from it.
  void import_prefix(int32_t g, GenerateRequest& r);
  ProfileResult run_profile(const ProfileRequest& r);
  // Profiling: the spans of the engine thread and of each step (StepTrace), while active.
  StepTrace trace_;
  // The arguments of a step's spans: per DP group its tokens and sequences, whether any prefills, the graph size.
  nlohmann::json step_args(const std::vector<StepPlan>& plans) const;
  // A step's results are in: its span, and the end of a profile of num_steps.
  void traced_step(PhaseClock::time_point launched, const nlohmann::json& args);
  // Engine thread: whether recording, and the counts of the recording not on the device (before a stop, or before the
  // memory was released: the device's start from zero again after resume_memory).
  bool recording_ = false;
  std::vector<int64_t> recorded_;
  // recorded_ plus the device's counts (unless the memory is released); the total of the recording so far.
  std::vector<int64_t> recorded_counts(bool released);
  bool paused_ = false;  // mu_ (set and cleared by the engine thread and continue_generation)
  bool released_ = false;  // mu_: the memory is released (no step runs); engine thread writes
  bool stop_ = false;
  std::vector<RankStats> published_;
  uint64_t steps_ = 0;
  // Outputs of the current step, delivered after the stats are published (so a client that sees a request finish
  // never reads stats from before it). Engine thread only.
  std::vector<std::pair<std::function<void(const GenerateOutput&)>, GenerateOutput>> deferred_;
  struct InFlight {
    std::vector<StepPlan> plans;
    RankSet::Launched launched;
    PhaseClock::time_point launched_at;  // (profiling)
    nlohmann::json trace_args;
  };
  std::optional<InFlight> inflight_;
  // Outputs reach their callbacks on a thread of their own, step by step in order, so what the callbacks cost
  // (posting to a thousand connections) stays off the step loop.
  using OutputBatch = std::vector<std::pair<std::function<void(const GenerateOutput&)>, GenerateOutput>>;
  void output_loop();
  std::mutex out_mu_;
  std::condition_variable out_cv_;
  std::deque<OutputBatch> out_queue_;
  bool out_stop_ = false;
  std::thread out_thread_;
  int64_t pipelined_steps_ = 0;  // steps launched before the previous one finished
  // MLASERVE_ENGINE_STATS=1: where the engine thread's time goes (logged at shutdown).
  struct PhaseTimes {
    double schedule = 0, launch = 0, wait = 0, resolve = 0, deliver = 0, total = 0;
    int64_t iterations = 0;
  };
  bool phase_stats_ = false;
  PhaseTimes phases_;
  std::thread thread_;
};

}  // namespace mlaserve
