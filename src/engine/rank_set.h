// RankSet: the ranks of one model replica that live in this process (CPU ranks as threads, or one GPU each), run
// in lockstep. A step takes one ForwardBatch per attention-DP group (null: that group runs an IDLE forward and still
// joins every collective) and returns the host logits of each group. When every group is empty nothing runs.
// A rank that fails aborts the communicator groups, so no other rank hangs.
//
// Several nodes (--nnodes > 1, GPU ranks over NCCL): node 0 owns the RankSet that the engine drives; it sends each
// step to the other nodes over the NodeLink control channel, and receives the logits of DP groups whose leading
// rank lives elsewhere. Other nodes run follow() until node 0 is done. Global rank = node_rank * ranks_per_node +
// local rank.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "model/deepseek_model.h"
#include "parallel/communicator.h"
#include "parallel/rendezvous.h"

namespace mlaserve {

struct ParallelConfig {
  int32_t tp_size = 1;
  int32_t dp_size = 1;  // attention-DP groups (DP attention); 1 = plain TP
  bool expert_parallel = false;  // routed experts split by expert over the tp_size ranks (ParallelPlan)
  std::string device = "auto";
  BackendOptions backend;
  int32_t device_offset = 0;  // first local GPU of this replica (--dp replicas in one process use disjoint GPUs)
  int32_t device_step = 1;    // GPUs between local ranks (--gpu-id-step)
  // The GPU of local rank i.
  int32_t device_of(int32_t local_rank) const { return device_offset + local_rank * device_step; }
  int32_t nnodes = 1;
  int32_t node_rank = 0;
  std::string dist_init_addr;
  std::chrono::milliseconds dist_timeout{std::chrono::seconds(120)};
  // A step that has not finished on every rank after this long is stuck (a rank missed a collective): the
  // communicators are aborted and the step fails with an error instead of hanging.
  std::chrono::milliseconds step_timeout{std::chrono::seconds(600)};
  // Decode steps of up to this many tokens per DP group replay graphs recorded after allocate_kv (CUDA graphs;
  // backends without graphs ignore it). 0: off (--disable-cuda-graph).
  int32_t cuda_graph_max_bs = 0;
  // Expert distribution recording (--expert-distribution-recorder-mode): global rank 0 counts the routed experts of
  // every step (DeepseekModel::enable_expert_counts; it routes every real token, DP attention's gathered rows too).
  bool count_experts = false;
  // SGLang's --enable-return-routed-experts: every rank keeps each step's routed experts (DeepseekModel::
  // enable_route_capture) and the leading ranks bring those of the batch's hidden_rows back with them.
  bool capture_routes = false;
  // The latent KV cache's FP8 type (--kv-cache-dtype fp8_e4m3 / fp8_e5m2), none for the backend's activation type.
  std::optional<DType> kv_cache_fp8;
  // Tests only: communicators for CPU ranks of simulated nodes in one process (so the multi-node control path runs
  // without GPUs): (global rank, attention-DP group or -1 for the world) -> that rank's communicator.
  std::function<std::unique_ptr<Communicator>(int32_t global_rank, int32_t dp_group)> comm_factory;
  // Tests only: wraps each rank's backend (e.g. to force recorded MoE routing on the GPUs of a layout).
  std::function<std::unique_ptr<Backend>(std::unique_ptr<Backend> made, int32_t global_rank)> wrap_backend;
};

// What one DP group's leading rank hands back after a step.
struct GroupOutput {
  std::vector<int32_t> ids;       // sampled on the device, one per logit row
  std::vector<float> logprobs;    // of the sampled ids
  Tensor logits;                  // host F32 [n, vocab]: the n rows its LogitRows entry named, in that order
  // With the MTP layer: its greedy token after each row's sample (else empty); with chained drafts (mtp_chain k >= 2)
  // [rows, k] row-major: the chain after the row whose sample is the last one its sequence keeps, -1 elsewhere.
  std::vector<int32_t> drafts;
  // The final hidden states of its batch's hidden_rows, in that order: [rows, hidden] row-major (else empty).
  std::vector<float> hidden;
  // With ParallelConfig::capture_routes, the routed experts of the same rows: [rows, num_hidden_layers,
  // num_experts_per_tok] (dense layers' entries 0, as SGLang's).
  std::vector<int32_t> routes;
};

// Per DP group, the logit rows (indices into its batch's logit_rows) whose full logits come back to the host (top-N
// logprobs), ascending; an empty list (or no entry) for none.
using LogitRows = std::vector<std::vector<int32_t>>;

// Batch sizes recorded as graphs: 1, 2, 4, 8, then every 8 up to 256, then every 32, and max_bs itself.
std::vector<int32_t> cuda_graph_batch_sizes(int32_t max_bs);

class RankSet {
 public:
  RankSet(const ModelConfig& config, const ParallelConfig& pc, const std::string& model_dir, const LoadOptions& lo);
  ~RankSet();

  int32_t num_ranks() const { return pc_.tp_size; }
  int32_t dp_groups() const { return pc_.dp_size; }
  bool captures_routes() const { return pc_.capture_routes; }
  bool is_leader_node() const { return pc_.node_rank == 0; }
  const ModelConfig& config() const { return config_; }
  Backend& backend(int local_rank) { return *ranks_[static_cast<size_t>(local_rank)]->backend; }
  int64_t weight_bytes_per_rank() const;
  DType act_dtype() const { return ranks_[0]->backend->act_dtype(); }
  // The latent KV cache's element type (ParallelConfig::kv_cache_fp8).
  DType kv_dtype() const { return KvCache::dtype_on(*ranks_[0]->backend, pc_.kv_cache_fp8); }
  // Bytes a rank may still give to its KV cache (-1: no fixed budget, e.g. the CPU).
  int64_t kv_bytes_free() const;

  // Loads the checkpoint in DIR into every rank's weights in place (DeepseekModel::reload; recorded graphs stay
  // valid), on every node; no step may be running. If any rank fails, every rank loads the checkpoint it had again
  // and this throws the failure (the model is as before); if that fails too, every later step and update fails
  // naming it (and other nodes stop).
  void reload_weights(const std::string& dir);
  // The checkpoint the weights came from (the last update's).
  const std::string& model_dir() const { return model_dir_; }
  // SGLang's /release_memory_occupation: every rank gives its persistent memory (weights, KV cache) back to the device
  // (Backend::release_persistent), on every node; steps and updates are refused until resume_memory. No step may
  // be running. resume_memory takes the memory again (zeroed) and loads the weights again (DeepseekModel::refill):
  // the KV cache's contents are gone (the caller forgets its prefix cache). A failure of either leaves no model
  // (every later step fails naming it).
  void release_memory();
  void resume_memory();
  bool memory_released() const { return released_; }

  // ParallelConfig::count_experts: the routed (token, expert) pairs per layer counted since the last reset
  // ([num_hidden_layers * n_routed_experts], row-major), after every step issued so far; reset zeroes them. Both
  // wait for the device; not while the memory is released.
  bool counts_experts() const { return pc_.count_experts; }
  // Backend::profiler on every rank of this node (other nodes' ranks are not profiled).
  void set_profiler(bool on);
  // SGLang's /get_weights_by_name: the first `rows` rows (a vector's first `rows` elements) of the checkpoint tensor
  // `name`, put together from this node's ranks (DeepseekModel::read_weight); nullopt when the model holds no such
  // tensor. Throws when part of them is held only by other nodes' ranks, or while the memory is released. No step
  // may be in flight.
  std::optional<DeepseekModel::WeightRows> read_weight(const std::string& name, int64_t rows);
  std::vector<int64_t> expert_counts();
  void reset_expert_counts();

  // Gives every rank a latent cache of `num_pages` pages (ranks of one DP group hold the same sequences).
  // host_slots > 0: every rank's cache gets a host tier of that many page blocks (KvCache::enable_host).
  void allocate_kv(int32_t num_pages, int32_t page_size, int32_t host_slots = 0);
  // Prefill / decode disaggregation: DP group g's latent rows in token order (KvCache::read_rows: tokens
  // [skip, skip + n) of the pages' slots, from the group's first rank), and every slot of `pages` written from
  // token(i) on every rank of the group (KvCache::write_rows; `token` is called from the ranks' threads at once).
  // No step may be in flight. One node only (other nodes' memory is out of reach).
  void read_kv_rows(int32_t group, std::span<const int32_t> pages, int64_t skip, int64_t n, char* out);
  void write_kv_rows(int32_t group, std::span<const int32_t> pages,
                     const std::function<const char*(int64_t)>& token);
  // The cache's layers and bytes per token and layer (after allocate_kv).
  int64_t kv_layers() const { return ranks_[0]->kv ? ranks_[0]->kv->num_layers() : 0; }
  int64_t kv_row_bytes() const { return ranks_[0]->kv ? ranks_[0]->kv->row_bytes() : 0; }
  // One forward on every rank; batches[g] for DP group g, sampling[g] one RowSampling per logit row of it. Each
  // group's leading rank samples on its device and only the ids (and their logprobs) come back, and the full logits
  // of the rows logit_rows[g] names (moved to the front of the logits on the device, so only those cross to the
  // host).
  std::vector<GroupOutput> step(const std::vector<const ForwardBatch*>& batches,
                                const std::vector<std::vector<RowSampling>>& sampling, const LogitRows& logit_rows,
                                MlaForm form = MlaForm::Auto);
  // step() in two halves, for overlap scheduling: launch issues the step on every rank and returns while the
  // devices work (the ids come back through an asynchronous copy; they also stay on each rank of the group, where
  // the next step's input ids -(row + 1) read them); finish waits for that copy. Launches finish in order; at most
  // two may be outstanding. A batch with such ids must be launched right after the step whose rows it names.
  struct Launched {
    std::vector<GroupOutput> out;
    std::vector<int64_t> rows;        // per local rank: logit rows it downloads (-1: none)
    std::vector<uint64_t> tickets;    // per local rank: its download
    std::vector<uint64_t> logit_tickets;  // per local rank, with logit rows: their download (after tickets')
    std::vector<int64_t> logit_cols;      // and their columns
    // Per local rank, with hidden rows (ForwardBatch::hidden_rows, its group's leading rank): their downloads, after
    // the others (rows 0: none).
    struct RowDownloads {
      int64_t rows = 0, cols = 0;
      DType dtype = DType::F32;
      uint64_t hidden = 0;
      uint64_t routes = 0;  // capturing routes: the rows' [MoE layers, k] ids
      int64_t moe_layers = 0, route_width = 0;  // route_width: ids per row (the picks, then fused shared experts)
    };
    std::vector<RowDownloads> row_downloads;
    LogitRows logit_rows;
    // Chained MTP drafts: the drafts per logit row (GroupOutput::drafts' width; 0 without chains) and per local rank
    // the place (row * width + column) of each chained draft it downloads after the first drafts, in order.
    int32_t chain_width = 0;
    std::vector<std::vector<int32_t>> chain_slots;
    bool ran = false, remote = false;
    uint64_t seq = 0;  // with other nodes: this step's number in node 0's messages
  };
  Launched launch(const std::vector<const ForwardBatch*>& batches,
                  const std::vector<std::vector<RowSampling>>& sampling, const LogitRows& logit_rows,
                  MlaForm form = MlaForm::Auto);
  std::vector<GroupOutput> finish(Launched& launched);
  // Steps whose batches took input ids from the previous step's samples on the device.
  int64_t prev_id_steps() const { return prev_id_steps_; }
  // Nodes other than 0: serve node 0's steps until it finishes. Each step is launched when it arrives and finished
  // when node 0 finishes it, so a step launched behind a running one (overlap scheduling) is queued here too. On an
  // error of this node's own, node 0 is told (it aborts its communicators) before the error is thrown.
  void follow();
  // On a following node: steps served, and those launched while an earlier one still ran.
  int64_t followed_steps() const { return followed_steps_; }
  int64_t followed_overlapped_steps() const { return followed_overlapped_; }
  // Token counts (per DP group) that have a recorded graph; empty when graphs are off.
  const std::vector<int32_t>& graph_batch_sizes() const { return graph_sizes_; }
  // Steps that replayed a graph so far.
  int64_t graph_steps() const { return graph_steps_; }
  // The graph size a step of these batches would replay (0: it runs eagerly).
  int32_t graph_size_for(const std::vector<const ForwardBatch*>& batches, MlaForm form) const;

 private:
  struct Rank {
    int global = 0;
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Communicator> world, attn;
    std::unique_ptr<DeepseekModel> model;
    std::unique_ptr<KvCache> kv;
    // The group's last samples, on the device: ids [0, R) then their logprobs [R, 2R) and, with the MTP layer, its
    // drafts [2R, 3R) (one download); the ids
    // reach every rank of the group (broadcast from its leading rank) and feed the next step.
    Tensor sampled;
    std::thread thread;
  };
  void run_on_all(const std::function<void(int)>& fn, std::chrono::milliseconds timeout = std::chrono::hours(2));
  void worker(int local);
  void stop_workers();
  // Rendezvous with the other nodes (node 0 hands out `payload`); keeps the link as the control channel.
  void connect_nodes(const std::string& payload);
  // Issues the step on the local ranks (outputs of groups led by a local rank land in h), then waits for them.
  void launch_local(const std::vector<const ForwardBatch*>& batches,
                    const std::vector<std::vector<RowSampling>>& sampling, const LogitRows& logit_rows, MlaForm form,
                    Launched& h);
  void finish_local(Launched& h);
  // A leading rank's sampled ids, drafts and logits (R logit rows) into o.
  void finish_rows(Rank& rk, Launched& h, int i, int64_t R, GroupOutput& o);
  // A leading rank's routed experts of its hidden rows, every layer's (dense layers 0).
  std::vector<int32_t> all_layers_routes(Rank& rk, const Launched::RowDownloads& d);
  void follow_steps();  // follow()'s loop
  // Node 0, with other nodes: finish() of a step they run too (they finish it alongside and send their outputs).
  std::vector<GroupOutput> finish_remote(Launched& h);
  void allocate_kv_local(int32_t num_pages, int32_t page_size, int32_t host_slots);
  // fn on the rank that counts experts (global rank 0, on this node's first worker); its error thrown here.
  void on_counting_rank(const std::function<void(Rank&)>& fn);
  // fn on every local rank (its exceptions caught there): the first rank's error, empty when none failed.
  std::string on_local_ranks(const std::function<void(Rank&)>& fn);
  // DeepseekModel::reload on every local rank: the first rank's error, empty when all loaded DIR.
  std::string reload_local(const std::string& dir);
  // Backend::release_persistent (release) or resume_persistent + DeepseekModel::refill on every local rank: the first
  // rank's error, empty when all did.
  std::string memory_local(bool release);
  // release_memory (true) and resume_memory (false).
  void set_memory_released(bool release);
  // Node 0: sends `msg` to the other nodes (when there are), runs `local`, and gathers their answers (kReloaded with
  // an error or none); the first error of any node, empty when none.
  std::string on_every_node(const std::string& msg, const std::function<std::string()>& local);
  // Node 0, after a step it sent to the other nodes failed here: their ranks ran (or wait in) collectives this node
  // never joined, so the layout cannot go on. Aborts the local communicators, tells the other nodes to stop with
  // `why`, and makes every later call fail with it.
  void stop_nodes(const std::string& why);
  void check_not_stopped() const;  // fails, naming the error, once stop_nodes ran
  // Aborts every local communicator (from any thread, mu_ not held): collectives in flight return with an error.
  void abort_communicators();
  // The first asynchronous error of this node's communicators (Communicator::async_error), empty when none (mu_ not
  // held).
  std::string communicator_error();
  void capture_graphs();
  // A graph step's sampling on rank rk (graph of n tokens; rows: what the rank samples, none but on a group's
  // leading rank): into the rank's sampled ids, logprobs after the R ids, with attention TP the ids then broadcast.
  GraphSampling graph_sampling(Rank& rk, int32_t n, std::span<const RowSampling> rows);
  // Brings a group's leading rank's sampled ids to the group's other ranks (attention TP), in the step's order.
  void share_ids(Rank& rk, const Tensor& ids);
  // F32 [R] after a leading rank's R sampled ids (its logprobs).
  static Tensor logprobs_after(Rank& rk, int64_t R);
  int32_t attn_tp() const { return pc_.tp_size / pc_.dp_size; }
  int32_t ranks_per_node() const { return pc_.tp_size / pc_.nnodes; }

  ModelConfig config_;
  ParallelConfig pc_;
  std::unique_ptr<NodeLink> link_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // local ranks
  // Every local rank's communicators, as they are made (mu_): aborted together, their asynchronous errors polled.
  std::vector<Communicator*> comms_;
  std::vector<int32_t> graph_sizes_;
  int64_t graph_steps_ = 0, prev_id_steps_ = 0, followed_steps_ = 0, followed_overlapped_ = 0;
  uint64_t remote_seq_ = 0;  // steps sent to (node 0) or received from (others) the other nodes
  std::string stopped_;      // node 0: why the layout of several nodes stopped (empty: it runs)
  std::string model_dir_;
  std::string weights_lost_;  // why the weights are neither the old nor the new checkpoint's (empty: they are)
  bool released_ = false;     // release_memory ran (resume_memory not yet)
  bool told_to_stop_ = false;  // other nodes: node 0 stopped the layout (kAbort), so this node's error is no news
  int64_t sampled_rows_ = 0;  // capacity of Rank::sampled (rows)
  int32_t dummy_page_ = -1, page_size_ = 0;  // graphs: padded rows read and write only this page

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::string> errors_;
};

}  // namespace mlaserve
