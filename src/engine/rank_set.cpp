#include "engine/rank_set.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>

#include "backend/backend_factory.h"
#include "backend/cpu/cpu_kernels.h"
#include "core/log.h"
#include "parallel/inprocess_communicator.h"
#ifdef MLASERVE_HAS_CUDA
#include "parallel/nccl_communicator.h"
#endif

namespace mlaserve {

namespace {
// Node 0 -> other nodes. kStep launches a step there; kFinish (sent when node 0 begins to finish a step) makes them
// finish that step and reply, so under overlap scheduling they too launch step N + 1 before waiting for step N. Steps,
// finishes and replies carry the step's number: a reply for the wrong step is an error, not wrong tokens. kAbort
// (with the error): a step or cache change node 0 had sent failed there; the other nodes abort their communicators
// and stop with that error (RankSet::stop_nodes). kReload (with a checkpoint folder): load it into the weights in
// place (RankSet::reload_weights); kMemory ('R' release or 'U' resume): RankSet::release_memory / resume_memory; each
// node answers both with kReloaded and its first error (empty: done).
enum Op : char { kStep = 'S', kFinish = 'F', kKv = 'K', kQuit = 'Q', kAbort = 'A', kReload = 'W', kMemory = 'M' };
// Other nodes -> node 0: kReply (a finished step's outputs), or kFailed (with the error) when a node stops on an error
// of its own; node 0 watches for it (and for a closed connection) while its ranks wait, and aborts its communicators
// (RankSet::run_on_all): its ranks may wait in collectives that node will never join.
enum ReplyOp : char { kReply = 'R', kFailed = 'E', kReloaded = 'L' };
constexpr int64_t kMaxSampledRows = 1 << 16;

void put(std::string& o, const void* p, size_t n) { o.append(static_cast<const char*>(p), n); }
template <typename T>
void put_pod(std::string& o, const T& v) {
  put(o, &v, sizeof v);
}
template <typename T>
T get(const char*& p, const char* end) {
  MLA_CHECK(end - p >= static_cast<int64_t>(sizeof(T)), "truncated message between nodes");
  T v;
  std::memcpy(&v, p, sizeof v);
  p += sizeof v;
  return v;
}
template <typename T>
void put_vec(std::string& o, const std::vector<T>& v) {
  put_pod(o, static_cast<int64_t>(v.size()));
  put(o, v.data(), v.size() * sizeof(T));
}
template <typename T>
std::vector<T> get_vec(const char*& p, const char* end) {
  const int64_t n = get<int64_t>(p, end);
  // (divided, not multiplied: a corrupt count could overflow the product)
  MLA_CHECK(n >= 0 && n <= (end - p) / static_cast<int64_t>(sizeof(T)), "truncated message between nodes");
  std::vector<T> v(static_cast<size_t>(n));
  if (n > 0) std::memcpy(static_cast<void*>(v.data()), p, static_cast<size_t>(n) * sizeof(T));  // (data() may be null)
  p += n * static_cast<int64_t>(sizeof(T));
  return v;
}
// Chained MTP drafts (ForwardBatch::mtp_chain >= 2): each sequence of a group's batch whose last new token is a logit
// row chains from the row its sequence keeps last. Known on every rank from the batches alone (the collectives of
// every chained forward need every group's token count): its last new token, its drafts, its logit rows' first,
// and how many drafts it makes (its page table's room after its last new token, at most the chain).
struct ChainSeq {
  int32_t last = 0, drafts = 0, first_row = 0, len = 0;
};
std::vector<ChainSeq> chain_seqs(const ForwardBatch& b, int32_t chain) {
  std::vector<int32_t> row_of(static_cast<size_t>(b.num_tokens()), -1);
  for (size_t r = 0; r < b.logit_rows.size(); ++r)
    row_of[static_cast<size_t>(b.logit_rows[r])] = static_cast<int32_t>(r);
  std::vector<ChainSeq> out;
  for (int32_t s = 0; s < b.num_seqs(); ++s) {
    ChainSeq c;
    const auto at = static_cast<size_t>(s);
    c.last = b.seq_q_start[at + 1] - 1;
    if (row_of[static_cast<size_t>(c.last)] < 0) continue;  // a prompt chunk before the last samples nothing
    c.drafts = b.seq_drafts.empty() ? 0 : b.seq_drafts[at];
    MLA_CHECK(c.drafts >= 0 && c.drafts < b.seq_q_start[at + 1] - b.seq_q_start[at], "step: sequence {} has {} drafts",
              s, c.drafts);
    c.first_row = row_of[static_cast<size_t>(c.last - c.drafts)];
    MLA_CHECK(c.first_row >= 0 && c.first_row + c.drafts == row_of[static_cast<size_t>(c.last)],
              "step: sequence {}'s drafts are not logit rows", s);
    int32_t pages = 0;
    while (pages < b.max_pages && b.page_table[at * static_cast<size_t>(b.max_pages) + pages] >= 0) ++pages;
    c.len = std::clamp(pages * b.page_size - b.positions[static_cast<size_t>(c.last)], 1, chain);
    out.push_back(c);
  }
  return out;
}

// Runs the chained drafts of group g on one rank after forward_draft (its drafts, one per logit row, in
// sampled[2R, 3R) on every rank of the group): the ids sampled for the group's rows come to the host, which decides
// the row each sequence keeps last (its drafts that its draws confirm), then chain step j = 2.. makes draft j of every
// sequence with room for it from draft j - 1 and the MTP layer's output at that row (forward_draft_chain). The drafts
// of step j land after those of step j - 1 in sampled[3R, ...); slots (the group's leader) gets each one's place
// row * chain + (j - 1). Returns how many were written.
int64_t chain_drafts(DeepseekModel& model, Backend& be, KvCache& kv, Tensor& sampled, const ForwardBatch& b,
                     int64_t R, int32_t chain, const std::vector<std::vector<ChainSeq>>& groups, int32_t g, int32_t d,
                     std::vector<int32_t>* slots) {
  const std::vector<ChainSeq>& seqs = groups[static_cast<size_t>(g)];
  std::vector<int32_t> ids(static_cast<size_t>(R));
  if (R > 0) be.download(sampled.rows(0, R), ids.data());
  // Per sequence: its token the chain starts from, that token's logit row, and its input to the next chained step
  // (the row of the previous drafts and of the previous MTP output).
  std::vector<int32_t> from_token(seqs.size()), from_row(seqs.size()), prev_at(seqs.size()), hidden_at(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    const ChainSeq& c = seqs[i];
    int32_t kept = 0;  // the drafts that the draws before them confirm
    while (kept < c.drafts && ids[static_cast<size_t>(c.first_row + kept)] ==
                                  b.input_ids[static_cast<size_t>(c.last - c.drafts + kept + 1)])
      ++kept;
    from_token[i] = c.last - c.drafts + kept;
    from_row[i] = c.first_row + kept;
    prev_at[i] = from_row[i];     // its first draft: sampled[2R + row]
    hidden_at[i] = from_token[i];  // forward_draft's output row: its token
  }
  Tensor prev = sampled.rows(2 * R, 3 * R);
  int64_t written = 0;
  const std::vector<RowSampling> greedy(seqs.size());
  for (int32_t j = 2; j <= chain; ++j) {
    DpStepInfo info;
    for (const auto& gs : groups)
      info.num_tokens.push_back(static_cast<int32_t>(std::count_if(gs.begin(), gs.end(), [j](const ChainSeq& c) {
        return c.len >= j;
      })));
    if (std::all_of(info.num_tokens.begin(), info.num_tokens.end(), [](int32_t n) { return n == 0; })) break;
    ForwardBatch cb;
    cb.page_size = b.page_size;
    cb.max_pages = b.max_pages;
    cb.seq_q_start = {0};
    std::vector<int32_t> hidden_rows, members;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (seqs[i].len < j) continue;
      const int32_t n = cb.num_tokens(), pos = b.positions[static_cast<size_t>(from_token[i])] + j - 1;
      const auto row = b.page_table.begin() + static_cast<int64_t>(b.token_seq[static_cast<size_t>(seqs[i].last)]) *
                                                   b.max_pages;
      cb.input_ids.push_back(-(prev_at[i] + 1));
      cb.positions.push_back(pos);
      cb.token_seq.push_back(n);
      cb.out_slots.push_back(row[pos / b.page_size] * b.page_size + pos % b.page_size);
      cb.seq_q_start.push_back(n + 1);
      cb.seq_prefix_lens.push_back(pos);
      cb.seq_lens.push_back(pos + 1);
      cb.page_table.insert(cb.page_table.end(), row, row + b.max_pages);
      cb.logit_rows.push_back(n);
      hidden_rows.push_back(hidden_at[i]);
      members.push_back(static_cast<int32_t>(i));
    }
    cb.mode = cb.num_tokens() > 0 ? ForwardMode::Decode : ForwardMode::Idle;
    const int64_t n = cb.num_tokens();
    Tensor logits = model.forward_draft_chain(cb, hidden_rows, prev, kv, d > 1 ? &info : nullptr);
    Tensor out = sampled.rows(3 * R + written, 3 * R + written + n);
    // Every rank of the group samples them (greedy over the same gathered logits): the next chained step reads them.
    if (n > 0) be.sample(logits, std::span<const RowSampling>(greedy).first(static_cast<size_t>(n)), out, nullptr);
    for (int64_t k = 0; k < n; ++k) {
      const auto i = static_cast<size_t>(members[static_cast<size_t>(k)]);
      if (slots) slots->push_back(from_row[i] * chain + (j - 1));
      prev_at[i] = static_cast<int32_t>(k);
      hidden_at[i] = static_cast<int32_t>(k);
    }
    prev = out;
    written += n;
  }
  return written;
}

// Group g's rows whose logits come back, or null for none.
const std::vector<int32_t>* rows_of_group(const LogitRows& rows, int32_t g) {
  if (g < 0 || static_cast<size_t>(g) >= rows.size() || rows[static_cast<size_t>(g)].empty()) return nullptr;
  return &rows[static_cast<size_t>(g)];
}

void put_sampling(std::string& o, const std::vector<RowSampling>& rows) {
  put_pod(o, static_cast<int64_t>(rows.size()));
  for (const RowSampling& r : rows) {
    put_pod(o, r.temperature);
    put_pod(o, r.top_k);
    put_pod(o, r.top_p);
    put_pod(o, r.min_p);
    put_pod(o, r.frequency_penalty);
    put_pod(o, r.presence_penalty);
    put_pod(o, r.repetition_penalty);
    put_pod(o, r.seed);
    put_pod(o, r.step);
    put_vec(o, r.penalty_counts);
    put_pod(o, r.pending_input);
    put_vec(o, r.logit_bias);
    put_vec(o, r.allowed ? *r.allowed : std::vector<uint32_t>{});
    put_pod(o, static_cast<int8_t>(r.allowed ? 1 : 0));
  }
}
std::vector<RowSampling> get_sampling(const char*& p, const char* end) {
  const int64_t n = get<int64_t>(p, end);
  MLA_CHECK(n >= 0 && n < (int64_t{1} << 24), "bad sampling rows in a step message");
  std::vector<RowSampling> rows(static_cast<size_t>(n));
  for (RowSampling& r : rows) {
    r.temperature = get<float>(p, end);
    r.top_k = get<int32_t>(p, end);
    r.top_p = get<float>(p, end);
    r.min_p = get<float>(p, end);
    r.frequency_penalty = get<float>(p, end);
    r.presence_penalty = get<float>(p, end);
    r.repetition_penalty = get<float>(p, end);
    r.seed = get<uint64_t>(p, end);
    r.step = get<uint64_t>(p, end);
    r.penalty_counts = get_vec<std::pair<int32_t, int32_t>>(p, end);
    r.pending_input = get<int32_t>(p, end);
    r.logit_bias = get_vec<std::pair<int32_t, float>>(p, end);
    auto mask = get_vec<uint32_t>(p, end);
    if (get<int8_t>(p, end)) r.allowed = std::make_shared<const std::vector<uint32_t>>(std::move(mask));
  }
  return rows;
}

}  // namespace

RankSet::RankSet(const ModelConfig& config, const ParallelConfig& pc, const std::string& model_dir, const LoadOptions& lo)
    : config_(config), pc_(pc), model_dir_(model_dir) {
  const int32_t n = pc_.tp_size, d = pc_.dp_size;
  MLA_CHECK(n >= 1, "--tp must be >= 1, got {}", n);
  MLA_CHECK(d >= 1 && n % d == 0, "--dp {} must divide --tp {} with --enable-dp-attention", d, n);
  MLA_CHECK(pc_.nnodes >= 1 && n % pc_.nnodes == 0, "--tp {} must be a multiple of --nnodes {}", n, pc_.nnodes);
  const int32_t rpn = ranks_per_node(), at = attn_tp();
  for (int32_t i = 0; i < rpn; ++i) {
    auto rk = std::make_unique<Rank>();
    rk->global = pc_.node_rank * rpn + i;
    rk->backend = make_backend(pc_.device, pc_.device_of(i), pc_.backend);
    if (pc_.wrap_backend) rk->backend = pc_.wrap_backend(std::move(rk->backend), rk->global);
    ranks_.push_back(std::move(rk));
  }
  const bool gpu = ranks_[0]->backend->device() == Device::CUDA;
  MLA_CHECK(pc_.nnodes == 1 || gpu || pc_.comm_factory, "--nnodes {}: several nodes need GPU ranks (NCCL)", pc_.nnodes);

  std::string nccl_id;
  if (gpu && n > 1) {
#ifdef MLASERVE_HAS_CUDA
    connect_nodes(pc_.node_rank == 0 ? nccl_unique_id() : std::string());
    nccl_id = link_->payload();
#else
    fail("multi-GPU layouts need a CUDA build");
#endif
  } else if (n > 1 && pc_.comm_factory) {
    if (pc_.nnodes > 1) connect_nodes(std::string());
    for (auto& rk : ranks_) {
      rk->world = pc_.comm_factory(rk->global, -1);
      if (at > 1 && d > 1) rk->attn = pc_.comm_factory(rk->global, rk->global / at);
      for (Communicator* c : {rk->world.get(), rk->attn.get()})
        if (c) comms_.push_back(c);
    }
  } else if (n > 1) {
    auto world = make_inprocess_communicators(n);
    for (int32_t r = 0; r < n; ++r) {
      comms_.push_back(world[static_cast<size_t>(r)].get());
      ranks_[static_cast<size_t>(r)]->world = std::move(world[static_cast<size_t>(r)]);
    }
    if (at > 1 && d > 1)
      for (int32_t gi = 0; gi < d; ++gi) {
        auto attn = make_inprocess_communicators(at);
        for (int32_t k = 0; k < at; ++k) {
          comms_.push_back(attn[static_cast<size_t>(k)].get());
          ranks_[static_cast<size_t>(gi * at + k)]->attn = std::move(attn[static_cast<size_t>(k)]);
        }
      }
  }

  // Per rank, in parallel: communicators (NCCL init is collective) and this rank's weight shard.
  try {
    run_on_all([&](int i) {
      Rank& rk = *ranks_[static_cast<size_t>(i)];
      ParallelPlan plan = ParallelPlan::make(n, d, rk.global);
      plan.expert_parallel = pc_.expert_parallel;
#ifdef MLASERVE_HAS_CUDA
      if (gpu && n > 1) {
        auto world = std::make_unique<NcclCommunicator>(nccl_id, n, rk.global, pc_.device_of(i),
                                                        rk.backend->native_stream());
        if (at > 1 && d > 1) {
          auto attn = world->split(plan.dp_rank, rk.global);
          auto* a = attn.get();
          std::lock_guard<std::mutex> lk(mu_);
          comms_.push_back(a);
          rk.attn = std::move(attn);
        }
        auto* w = world.get();
        {
          std::lock_guard<std::mutex> lk(mu_);
          comms_.push_back(w);
        }
        rk.world = std::move(world);
      }
#endif
      Communicator* attn_comm = d > 1 ? rk.attn.get() : rk.world.get();
      rk.model = std::make_unique<DeepseekModel>(config_, *rk.backend, plan, rk.world.get(), attn_comm);
      rk.model->load(model_dir, lo);
      if (pc_.count_experts && rk.global == 0) rk.model->enable_expert_counts();
      if (pc_.capture_routes) rk.model->enable_route_capture();
    });
  } catch (...) {
    stop_workers();
    throw;
  }
}

std::string RankSet::communicator_error() {
  std::vector<Communicator*> comms;
  {
    std::lock_guard<std::mutex> lk(mu_);
    comms = comms_;
  }
  for (Communicator* c : comms)
    if (std::string e = c->async_error(); !e.empty()) return e;
  return {};
}

void RankSet::connect_nodes(const std::string& payload) {
  RendezvousConfig rc;
  rc.nnodes = pc_.nnodes;
  rc.node_rank = pc_.node_rank;
  rc.ranks_per_node = ranks_per_node();
  rc.addr = pc_.dist_init_addr;
  rc.timeout = pc_.dist_timeout;
  link_ = NodeLink::connect(rc, payload);
}

RankSet::~RankSet() {
  if (link_ && pc_.node_rank == 0 && pc_.nnodes > 1) {
    try {
      link_->broadcast(std::string(1, kQuit));
    } catch (const std::exception&) {
    }
  }
  stop_workers();
  // Graphs before the communicators whose collectives they hold (the ranks' members go after this).
  for (auto& r : ranks_)
    if (r && r->backend) {
      try {
        r->backend->bind_thread();
        r->backend->release_graphs();
      } catch (const std::exception&) {
      }
    }
}

void RankSet::stop_workers() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& r : ranks_)
    if (r && r->thread.joinable()) r->thread.join();
}

int64_t RankSet::weight_bytes_per_rank() const { return ranks_[0]->model ? ranks_[0]->model->weight_bytes() : 0; }

int64_t RankSet::kv_bytes_free() const {
  int64_t m = -1;
  for (const auto& r : ranks_) {
    const int64_t f = r->backend->persistent_bytes_free();
    if (f >= 0) m = m < 0 ? f : std::min(m, f);
  }
  // Graphs add one page per layer that no request owns (allocate_kv): keep room for it and the layers' alignment.
  if (m >= 0 && pc_.cuda_graph_max_bs > 0 && ranks_[0]->backend->supports_graphs()) m = std::max<int64_t>(0, m - (64LL << 20));
  // The samples kept on the device (Rank::sampled, at most kMaxSampledRows rows of 12 bytes).
  if (m >= 0) m = std::max<int64_t>(0, m - (1LL << 20));
  return m;
}

void RankSet::worker(int local) {
  uint64_t seen = 0;
  ranks_[static_cast<size_t>(local)]->backend->bind_thread();
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    std::string err;
    try {
      (*job)(local);
    } catch (const std::exception& e) {
      err = e.what();
      abort_communicators();  // wake the other ranks out of their collectives
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!err.empty()) errors_.push_back(fmt::format("rank {}: {}", ranks_[static_cast<size_t>(local)]->global, err));
      --pending_;
    }
    done_cv_.notify_all();
  }
}

void RankSet::run_on_all(const std::function<void(int)>& fn, std::chrono::milliseconds timeout) {
  // Node 0 with other nodes watches them while its ranks work, so even one rank runs on a worker thread.
  const bool watch = link_ && pc_.node_rank == 0 && pc_.nnodes > 1;
  if (ranks_.size() == 1 && !watch) {
    ranks_[0]->backend->bind_thread();
    fn(0);
    return;
  }
  if (!ranks_[0]->thread.joinable())
    for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->thread = std::thread([this, r] { worker(static_cast<int>(r)); });
  std::unique_lock<std::mutex> lk(mu_);
  job_ = &fn;
  pending_ = static_cast<int>(ranks_.size());
  errors_.clear();
  ++generation_;
  cv_.notify_all();
  const auto done = [&] { return pending_ == 0; };
  // While the ranks work, every 20 ms: the other nodes (node 0: a kFailed message or a lost connection) and the
  // communicators' asynchronous errors. Either means this node's ranks may wait in collectives that never complete:
  // abort the communicators (they return) and fail the step naming it.
  std::string failure;
  bool finished = false;
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (!(finished = done_cv_.wait_for(lk, std::chrono::milliseconds(20), done)) &&
         std::chrono::steady_clock::now() < until) {
    if (!failure.empty()) continue;
    lk.unlock();
    std::optional<NodeLink::NodeFailure> f;
    if (watch) {
      try {
        f = link_->poll_failure(kFailed);
      } catch (const std::exception& e) {
        f = NodeLink::NodeFailure{0, e.what()};
      }
    }
    if (f) failure = f->node > 0 ? fmt::format("node {} failed: {}", f->node, f->what) : f->what;
    if (failure.empty()) failure = communicator_error();
    if (!failure.empty()) {
      MLA_LOG_ERROR("{}; aborting this node's communicators", failure);
      abort_communicators();
    }
    lk.lock();
  }
  if (!finished) {
    // A rank is stuck in a collective: abort the communicators so every rank returns, then report.
    const int stuck = pending_;
    lk.unlock();
    abort_communicators();
    lk.lock();
    done_cv_.wait_for(lk, std::chrono::seconds(30), [&] { return pending_ == 0; });
    job_ = nullptr;
    fail("{} of {} ranks did not finish a step within {} s (a rank missed a collective?); communicators aborted",
         stuck, ranks_.size(), timeout.count() / 1000.0);
  }
  job_ = nullptr;
  if (!failure.empty() || !errors_.empty()) {
    std::string all = failure;
    for (const auto& e : errors_) all += (all.empty() ? "" : "; ") + e;
    fail("{}", all);
  }
}

void RankSet::allocate_kv(int32_t num_pages, int32_t page_size, int32_t host_slots) {
  const bool remote = link_ && pc_.node_rank == 0 && pc_.nnodes > 1;
  if (remote) {
    check_not_stopped();
    std::string m(1, kKv);
    put(m, &num_pages, 4);
    put(m, &page_size, 4);
    put(m, &host_slots, 4);
    link_->broadcast(m);
  }
  try {
    allocate_kv_local(num_pages, page_size, host_slots);
  } catch (const std::exception& e) {
    if (remote) stop_nodes(e.what());
    throw;
  }
}

void RankSet::allocate_kv_local(int32_t num_pages, int32_t page_size, int32_t host_slots) {
  // Graphs: one more page that no request owns, for the rows that pad a batch to its graph's size.
  const bool graphs = pc_.cuda_graph_max_bs > 0 && ranks_[0]->backend->supports_graphs();
  graph_sizes_.clear();
  // Every logit row of a step has a token in the cache, so a step never has more rows than the cache tokens.
  sampled_rows_ = std::clamp<int64_t>(static_cast<int64_t>(num_pages) * page_size, 1, kMaxSampledRows);
  // A graph's sampling writes, and with attention TP sends, the ids of all its rows.
  const int64_t graph_rows = graphs ? cuda_graph_batch_sizes(pc_.cuda_graph_max_bs).back() : 0;
  run_on_all([&](int i) {
    Rank& r = *ranks_[static_cast<size_t>(i)];
    // Graphs recorded over a previous cache would replay on its memory: drop them first.
    r.model->clear_graphs();
    r.backend->release_graphs();
    // Ids, logprobs and, with the MTP layer, its drafts.
    const int64_t per_row = config_.mtp_layers > 0 ? 2 + kMaxMtpChain : 2;  // (the chained drafts after the first)
    const int64_t need = std::max<int64_t>(per_row * sampled_rows_, graph_rows);
    if (!r.sampled.defined() || r.sampled.numel() < need) r.sampled = r.backend->alloc({need}, DType::I32);
    r.model->set_prev_ids(r.sampled.rows(0, sampled_rows_));
    r.kv = std::make_unique<KvCache>(*r.backend, config_, num_pages + (graphs ? 1 : 0), page_size, pc_.kv_cache_fp8);
    if (host_slots > 0) r.kv->enable_host(host_slots);
  });
  page_size_ = page_size;
  if (graphs) {
    dummy_page_ = num_pages;
    capture_graphs();
  }
}

std::vector<int32_t> cuda_graph_batch_sizes(int32_t max_bs) {
  std::vector<int32_t> v;
  for (int32_t b = 1; b <= max_bs;) {
    v.push_back(b);
    b = b < 8 ? b * 2 : b < 256 ? b + 8 : b + 32;
  }
  if (max_bs > 0 && v.back() != max_bs) v.push_back(max_bs);
  return v;
}

namespace {

// The padded batches of a graph step with DP attention: every group's real rows within the gathered rows (blocks of
// `block` rows, real[g] real ones at the start of block g), the same pairs in every group's batch.
void set_group_moe_rows(ForwardBatch& b, const std::vector<int32_t>& real, int32_t block) {
  b.moe_rows.clear();
  for (size_t g = 0; g < real.size(); ++g) {
    b.moe_rows.push_back(static_cast<int32_t>(g) * block);
    b.moe_rows.push_back(real[g]);
  }
}

}  // namespace

Tensor RankSet::logprobs_after(Rank& rk, int64_t R) {
  return Tensor::view(static_cast<int32_t*>(rk.sampled.data()) + R, {R}, DType::F32, rk.sampled.device());
}

GraphSampling RankSet::graph_sampling(Rank& rk, int32_t n, std::span<const RowSampling> rows) {
  const int32_t at = attn_tp();
  GraphSampling gs;
  gs.sample = rk.global % at == 0;
  gs.rows = rows;
  gs.ids = rk.sampled.rows(0, n);
  if (gs.sample && !rows.empty()) gs.logprobs = logprobs_after(rk, static_cast<int64_t>(rows.size()));
  // All n ids (a graph's counts are fixed; the rows past the step's are not read). (`after` runs within the call.)
  if (at > 1) gs.after = [this, &rk, ids = gs.ids] { share_ids(rk, ids); };
  return gs;
}

void RankSet::share_ids(Rank& rk, const Tensor& ids) {
  Communicator* group = pc_.dp_size > 1 ? rk.attn.get() : rk.world.get();
  rk.backend->collective([group, t = ids]() mutable { group->broadcast(t, 0); });
}

void RankSet::capture_graphs() {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> sizes = cuda_graph_batch_sizes(pc_.cuda_graph_max_bs);
  const int32_t d = pc_.dp_size;
  ForwardBatch empty;
  empty.page_size = page_size_;
  empty.seq_q_start = {0};
  // Every group runs the same padded batch of dummy rows. One eager step first: the backends learn the attention
  // shapes that graph steps plan for up front.
  for (size_t k = 0; k <= sizes.size(); ++k) {
    const int32_t n = k == 0 ? 1 : sizes[k - 1];
    ForwardBatch padded = pad_decode_batch(empty, n, dummy_page_, page_size_);
    if (d > 1) set_group_moe_rows(padded, std::vector<int32_t>(static_cast<size_t>(d), 0), n);
    DpStepInfo info;
    info.num_tokens.assign(static_cast<size_t>(d), n);
    run_on_all(
        [&](int i) {
          Rank& rk = *ranks_[static_cast<size_t>(i)];
          // (the graphs serving replays: each samples the rows staged before it, none here)
          const GraphSampling gs = graph_sampling(rk, n, {});
          if (k == 0) rk.model->forward(padded, *rk.kv, MlaForm::Auto, d > 1 ? &info : nullptr);
          else rk.model->forward_graph(padded, *rk.kv, d > 1 ? &info : nullptr, &gs);
          rk.backend->synchronize();
        },
        pc_.step_timeout);
  }
  // One token at each context where the backend switches kernels (Backend::graph_variant_contexts), over the dummy
  // page zeroed first (its slots are the keys): recorded now, not when a request first gets there.
  std::vector<int32_t> contexts = ranks_[0]->backend->graph_variant_contexts();
  std::erase_if(contexts, [&](int32_t c) { return config_.max_position_embeddings > 0 &&
                                                  c > config_.max_position_embeddings; });
  for (int32_t c : contexts) {
    ForwardBatch row = dummy_decode_row(c, dummy_page_, page_size_);
    set_group_moe_rows(row, std::vector<int32_t>(static_cast<size_t>(d), 0), 1);  // (as a padded batch has)
    DpStepInfo info;
    info.num_tokens.assign(static_cast<size_t>(d), 1);
    run_on_all(
        [&](int i) {
          Rank& rk = *ranks_[static_cast<size_t>(i)];
          for (int64_t l = 0; l < rk.kv->num_layers(); ++l) {
            Tensor page = rk.kv->layer(l).rows(static_cast<int64_t>(dummy_page_) * page_size_,
                                                static_cast<int64_t>(dummy_page_ + 1) * page_size_);
            rk.backend->zero(page);
          }
          const GraphSampling gs = graph_sampling(rk, 1, {});
          rk.model->forward_graph(row, *rk.kv, d > 1 ? &info : nullptr, &gs);
          rk.backend->synchronize();
        },
        pc_.step_timeout);
  }
  graph_sizes_ = sizes;
  MLA_LOG_INFO("graphs: decode batches of {} sizes up to {} tokens and {} more one-token contexts recorded in {:.1f} s",
               sizes.size(), sizes.back(), contexts.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

int32_t RankSet::graph_size_for(const std::vector<const ForwardBatch*>& batches, MlaForm form) const {
  if (graph_sizes_.empty() || form != MlaForm::Auto) return 0;
  int32_t most = 0;
  for (const ForwardBatch* b : batches) {
    if (!b || b->num_tokens() == 0) continue;  // an idle group replays with padding only
    if (!is_graph_batch(*b)) return 0;  // prefill anywhere: every group runs eagerly
    most = std::max(most, b->num_tokens());
  }
  // The largest group decides (never the sum): every group pads to that size.
  if (most == 0 || most > graph_sizes_.back()) return 0;
  return *std::lower_bound(graph_sizes_.begin(), graph_sizes_.end(), most);
}

void RankSet::launch_local(const std::vector<const ForwardBatch*>& batches,
                           const std::vector<std::vector<RowSampling>>& sampling, const LogitRows& logit_rows,
                           MlaForm form, Launched& h) {
  const int32_t d = pc_.dp_size, at = attn_tp();
  DpStepInfo info;
  bool prev_ids = false;
  for (const ForwardBatch* b : batches) {
    info.num_tokens.push_back(b ? b->num_tokens() : 0);
    if (b) prev_ids |= std::any_of(b->input_ids.begin(), b->input_ids.end(), [](int32_t id) { return id < 0; });
  }
  if (prev_ids) ++prev_id_steps_;
  ForwardBatch idle;
  idle.page_size = 1;
  idle.seq_q_start = {0};
  // The same decision on every rank and node (it depends only on the step): replay a graph or run eagerly.
  const int32_t graph_size = graph_size_for(batches, form);
  if (graph_size > 0) ++graph_steps_;
  DpStepInfo graph_info;
  graph_info.num_tokens.assign(static_cast<size_t>(d), graph_size);
  // Each group's batch padded to the graph's size, once per group (its ranks share it).
  std::vector<ForwardBatch> padded;
  if (graph_size > 0) {
    for (int32_t g = 0; g < d; ++g) {
      const ForwardBatch* b = batches[static_cast<size_t>(g)];
      padded.push_back(pad_decode_batch(b ? *b : idle, graph_size, dummy_page_, page_size_));
    }
    if (d > 1)
      for (ForwardBatch& p : padded) set_group_moe_rows(p, info.num_tokens, graph_size);
  }
  // Speculative decoding with the MTP layer: every step runs it after the model (ForwardBatch::next_ids), then its
  // chained drafts where the batches ask for them (every group the same chain).
  const bool mtp = config_.mtp_layers > 0;
  int32_t chain = 0;
  std::vector<std::vector<ChainSeq>> chains;
  if (mtp) {  // (pad_decode_batch pads them: a padded batch has them too)
    for (size_t g = 0; g < batches.size(); ++g) {
      if (!batches[g]) continue;
      MLA_CHECK(batches[g]->next_ids.size() == static_cast<size_t>(batches[g]->num_tokens()),
                "step: group {}'s batch has {} next ids for {} tokens (the MTP layer needs one per token)", g,
                batches[g]->next_ids.size(), batches[g]->num_tokens());
      MLA_CHECK(batches[g]->mtp_chain >= 0 && batches[g]->mtp_chain <= kMaxMtpChain,
                "step: group {}'s batch asks for a chain of {} MTP drafts (at most {})", g, batches[g]->mtp_chain,
                kMaxMtpChain);
      MLA_CHECK(batches[g]->seq_drafts.empty() || batches[g]->seq_drafts.size() ==
                                                      static_cast<size_t>(batches[g]->num_seqs()),
                "step: group {}'s batch has {} draft counts for {} sequences", g, batches[g]->seq_drafts.size(),
                batches[g]->num_seqs());
      chain = std::max(chain, batches[g]->mtp_chain);
    }
    if (chain >= 2)
      for (const ForwardBatch* b : batches) chains.push_back(b ? chain_seqs(*b, chain) : std::vector<ChainSeq>{});
  }
  h.chain_width = chain >= 2 ? chain : 0;
  h.chain_slots.assign(ranks_.size(), {});
  h.rows.assign(ranks_.size(), -1);
  h.tickets.assign(ranks_.size(), 0);
  h.logit_tickets.assign(ranks_.size(), 0);
  h.logit_cols.assign(ranks_.size(), 0);
  h.row_downloads.assign(ranks_.size(), {});
  run_on_all(
      [&](int i) {
        Rank& rk = *ranks_[static_cast<size_t>(i)];
        const int32_t g = rk.global / at;
        const ForwardBatch& b = batches[static_cast<size_t>(g)] ? *batches[static_cast<size_t>(g)] : idle;
        const int64_t R = static_cast<int64_t>(b.logit_rows.size());
        const bool leader = rk.global % at == 0;
        MLA_CHECK(R <= sampled_rows_, "step: {} logit rows in group {}, more than the {} kept on the device "
                  "(allocate_kv first)", R, g, sampled_rows_);
        // The group's leading rank samples its rows on the device; only ids and logprobs go to the host.
        std::span<const RowSampling> params;
        if (leader && R > 0) {
          params = sampling[static_cast<size_t>(g)];
          MLA_CHECK(static_cast<int64_t>(params.size()) == R, "step: {} sampling rows for {} logit rows of group {}",
                    params.size(), R, g);
        }
        Tensor logits;
        if (graph_size > 0) {  // the graph samples too (and brings the ids to the group's other ranks)
          const GraphSampling gs = graph_sampling(rk, graph_size, params);
          logits = rk.model->forward_graph(padded[static_cast<size_t>(g)], *rk.kv, d > 1 ? &graph_info : nullptr, &gs)
                       .rows(0, b.num_tokens());
        } else {
          logits = rk.model->forward(b, *rk.kv, form, d > 1 ? &info : nullptr);
        }
        MLA_LOG_TRACE("rank {}: forward enqueued", rk.global);
        if (R > 0 && graph_size == 0) {
          Tensor ids = rk.sampled.rows(0, R);
          if (leader) {
            Tensor lps = logprobs_after(rk, R);
            rk.backend->sample(logits, params, ids, &lps);
          }
          // The other ranks of the group need the ids too (the next step, and the MTP layer, read them on the device).
          if (at > 1) share_ids(rk, ids);
        }
        if (mtp) {
          // The MTP layer over the same tokens (every rank, idle groups too: its MoE joins the collectives); its
          // greedy token per logit row is the draft after that row's sample, kept after the logprobs.
          const ForwardBatch& fb = graph_size > 0 ? padded[static_cast<size_t>(g)] : b;
          const DpStepInfo* di = d > 1 ? (graph_size > 0 ? &graph_info : &info) : nullptr;
          Tensor draft_logits = rk.model->forward_draft(fb, fb.next_ids, *rk.kv, di);
          if (R > 0 && (leader || !chains.empty())) {  // (a chain reads them on every rank of the group)
            Tensor drafts = rk.sampled.rows(2 * R, 3 * R);
            const std::vector<RowSampling> greedy(static_cast<size_t>(R));
            rk.backend->sample(draft_logits.rows(0, R), greedy, drafts, nullptr);
          }
        }
        int64_t chained = 0;
        if (!chains.empty())
          chained = chain_drafts(*rk.model, *rk.backend, *rk.kv, rk.sampled, b, R, chain, chains, g, d,
                                 leader ? &h.chain_slots[static_cast<size_t>(i)] : nullptr);
        if (leader && R > 0) {
          h.rows[static_cast<size_t>(i)] = R;
          h.tickets[static_cast<size_t>(i)] =
              rk.backend->download_start(rk.sampled.rows(0, (mtp ? 3 : 2) * R + chained));
          const std::vector<int32_t>* keep = rows_of_group(logit_rows, g);
          if (keep) {  // top-N logprobs: those rows' logits too, without waiting for them here
            MLA_CHECK(logits.dtype() == DType::F32, "step: logits must be F32");
            // Moved to the front in ascending order (row j from row keep[j] >= j: no row is overwritten before it
            // is read; the sampler, earlier on the stream, has read them all), then one download.
            const int64_t n = static_cast<int64_t>(keep->size());
            for (int64_t j = 0; j < n; ++j) {
              const int32_t r = (*keep)[static_cast<size_t>(j)];
              MLA_CHECK(r >= j && r < R && (j == 0 || r > (*keep)[static_cast<size_t>(j - 1)]),
                        "step: logit rows of group {} must be ascending rows below {}", g, R);
              if (r != j) {
                Tensor dst = logits.rows(j, j + 1);
                rk.backend->copy(logits.rows(r, r + 1), dst);
              }
            }
            h.logit_cols[static_cast<size_t>(i)] = logits.size(-1);
            h.logit_tickets[static_cast<size_t>(i)] = rk.backend->download_start(logits.rows(0, n));
          }
        }
        if (leader && !b.hidden_rows.empty()) {  // return_hidden_states: those rows of the final hidden state
          const Tensor& last = rk.model->last_hidden();
          const int64_t n = static_cast<int64_t>(b.hidden_rows.size());
          Launched::RowDownloads& d = h.row_downloads[static_cast<size_t>(i)];
          d.rows = n;
          if (b.hidden_states) {  // (else only their routed experts)
            d.cols = last.size(1);
            d.dtype = last.dtype();
            Tensor rows = rk.backend->scratch({n, d.cols}, d.dtype);
            rk.backend->gather_rows(last, b.hidden_rows, rows);  // (it checks the rows)
            d.hidden = rk.backend->download_start(rows);
          }
          if (rk.model->captures_routes()) {  // [MoE layers, T of the forward, k]: each row's ids of every layer
            const Tensor& routes = rk.model->last_routes();
            const int64_t M = routes.size(0), Tf = routes.size(1), k = routes.size(2);
            std::vector<int32_t> at;
            for (int32_t r : b.hidden_rows)
              for (int64_t m = 0; m < M; ++m) at.push_back(static_cast<int32_t>(m * Tf + r));
            Tensor picked = rk.backend->scratch({n * M, k}, DType::I32);
            if (M > 0) rk.backend->gather_rows(routes.reshape({M * Tf, k}), at, picked);
            d.moe_layers = M;
            d.route_width = k;
            d.routes = rk.backend->download_start(picked);
          }
        }
        rk.backend->end_step();
        MLA_LOG_TRACE("rank {}: step issued", rk.global);
      },
      pc_.step_timeout);
}

void RankSet::finish_local(Launched& h) {
  const int32_t at = attn_tp();
  run_on_all(
      [&](int i) {
        Rank& rk = *ranks_[static_cast<size_t>(i)];
        const int64_t R = h.rows[static_cast<size_t>(i)];
        GroupOutput& o = h.out[static_cast<size_t>(rk.global / at)];
        if (R >= 0) finish_rows(rk, h, i, R, o);
        if (const Launched::RowDownloads& d = h.row_downloads[static_cast<size_t>(i)]; d.rows > 0) {
          if (d.cols > 0) {
            Tensor host = Tensor::empty_host({d.rows, d.cols}, d.dtype);  // (downloaded after the ids and the logits)
            rk.backend->download_finish(d.hidden, host.data());
            o.hidden.resize(static_cast<size_t>(host.numel()));
            cpu::convert(host.data(), d.dtype, o.hidden.data(), DType::F32, host.numel());
          }
          if (rk.model->captures_routes()) o.routes = all_layers_routes(rk, d);
        }
      },
      pc_.step_timeout);
}

std::vector<int32_t> RankSet::all_layers_routes(Rank& rk, const Launched::RowDownloads& d) {
  const int64_t M = d.moe_layers, L = config_.num_hidden_layers, k = config_.num_experts_per_tok, rows = d.rows;
  const int64_t w = d.route_width;  // the picks, then any fused shared experts (not reported)
  std::vector<int32_t> moe(static_cast<size_t>(rows * M * w));
  rk.backend->download_finish(d.routes, moe.data());
  std::vector<int32_t> out(static_cast<size_t>(rows * L * k), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t l = 0; l < L; ++l)
      if (const int64_t m = config_.moe_index(l); m >= 0)
        std::copy_n(moe.begin() + (r * M + m) * w, k, out.begin() + (r * L + l) * k);
  return out;
}

void RankSet::finish_rows(Rank& rk, Launched& h, int i, int64_t R, GroupOutput& o) {
  const bool mtp = config_.mtp_layers > 0;
  const std::vector<int32_t>& slots = h.chain_slots[static_cast<size_t>(i)];
  std::vector<int32_t> host(static_cast<size_t>((mtp ? 3 : 2) * R) + slots.size());
  MLA_LOG_TRACE("rank {}: waiting for the ids", rk.global);
  rk.backend->download_finish(h.tickets[static_cast<size_t>(i)], host.data());
  o.ids.assign(host.begin(), host.begin() + R);
  o.logprobs.resize(static_cast<size_t>(R));
  std::memcpy(o.logprobs.data(), host.data() + R, static_cast<size_t>(R) * sizeof(float));
  if (mtp) {  // [R, width]: the first draft of every row, the chained ones where their chain starts
    const int64_t w = std::max(1, h.chain_width);
    o.drafts.assign(static_cast<size_t>(R * w), -1);
    for (int64_t r = 0; r < R; ++r) o.drafts[static_cast<size_t>(r * w)] = host[static_cast<size_t>(2 * R + r)];
    for (size_t k = 0; k < slots.size(); ++k) o.drafts[static_cast<size_t>(slots[k])] = host[3 * R + k];
  }
  if (const std::vector<int32_t>* keep = rows_of_group(h.logit_rows, rk.global / attn_tp())) {
    o.logits = Tensor::empty_host({static_cast<int64_t>(keep->size()), h.logit_cols[static_cast<size_t>(i)]},
                                  DType::F32);
    rk.backend->download_finish(h.logit_tickets[static_cast<size_t>(i)], o.logits.data());
  }
}

std::vector<GroupOutput> RankSet::step(const std::vector<const ForwardBatch*>& batches,
                                       const std::vector<std::vector<RowSampling>>& sampling,
                                       const LogitRows& logit_rows, MlaForm form) {
  Launched h = launch(batches, sampling, logit_rows, form);
  return finish(h);
}

RankSet::Launched RankSet::launch(const std::vector<const ForwardBatch*>& batches,
                                  const std::vector<std::vector<RowSampling>>& sampling,
                                  const LogitRows& logit_rows, MlaForm form) {
  const int32_t d = pc_.dp_size;
  MLA_CHECK(pc_.node_rank == 0, "RankSet::step runs on node 0 only");
  MLA_CHECK(static_cast<int32_t>(batches.size()) == d && static_cast<int32_t>(sampling.size()) == d,
            "step: {} batches and {} sampling lists for {} DP groups", batches.size(), sampling.size(), d);
  bool any = false;
  for (const ForwardBatch* b : batches) any |= b && b->num_tokens() > 0;
  Launched h;
  h.out.resize(static_cast<size_t>(d));
  MLA_CHECK(static_cast<int32_t>(logit_rows.size()) <= d, "step: logit rows for {} groups of {}", logit_rows.size(), d);
  h.logit_rows = logit_rows;
  if (!any) return h;  // every group idle: no forward at all
  MLA_CHECK(weights_lost_.empty(), "the model has no weights: {}", weights_lost_);
  MLA_CHECK(!released_, "the GPU memory is released (/release_memory_occupation): no step runs until it is resumed");
  const bool remote = link_ && pc_.nnodes > 1;
  if (remote) check_not_stopped();
  h.ran = true;
  h.remote = remote;
  if (remote) {
    h.seq = ++remote_seq_;
    std::string m(1, kStep);
    put_pod(m, h.seq);
    put_pod(m, static_cast<char>(form));
    for (int32_t g = 0; g < d; ++g) {
      const ForwardBatch* b = batches[static_cast<size_t>(g)];
      put_pod(m, static_cast<char>(b ? 1 : 0));
      if (b) serialize(*b, m);
      put_sampling(m, sampling[static_cast<size_t>(g)]);
      const std::vector<int32_t>* keep = rows_of_group(logit_rows, g);
      put_vec(m, keep ? *keep : std::vector<int32_t>{});
    }
    link_->broadcast(m);
  }
  try {
    launch_local(batches, sampling, logit_rows, form, h);
  } catch (const std::exception& e) {
    if (remote) stop_nodes(e.what());
    throw;
  }
  return h;
}

void RankSet::abort_communicators() {
  std::vector<Communicator*> comms;
  {
    std::lock_guard<std::mutex> lk(mu_);
    comms = comms_;
  }
  for (Communicator* c : comms) c->abort();
}

void RankSet::on_counting_rank(const std::function<void(Rank&)>& fn) {
  MLA_CHECK(pc_.count_experts, "expert distribution recording is off (--expert-distribution-recorder-mode)");
  MLA_CHECK(pc_.node_rank == 0, "the routed experts are counted on node 0");
  MLA_CHECK(!released_, "the GPU memory is released (/release_memory_occupation): resume it first");
  MLA_CHECK(weights_lost_.empty(), "the model has no weights: {}", weights_lost_);
  const std::string err = on_local_ranks([&](Rank& rk) {
    if (rk.global == 0) fn(rk);
  });
  MLA_CHECK(err.empty(), "{}", err);
}

std::vector<int64_t> RankSet::expert_counts() {
  std::vector<int64_t> counts;
  on_counting_rank([&](Rank& rk) {
    const Tensor& c = rk.model->expert_counts();
    counts.resize(static_cast<size_t>(c.numel()));
    rk.backend->download(c, counts.data());
  });
  return counts;
}

std::optional<DeepseekModel::WeightRows> RankSet::read_weight(const std::string& name, int64_t rows) {
  check_not_stopped();
  MLA_CHECK(!released_, "the GPU memory is released (/release_memory_occupation): resume it before reading weights");
  std::vector<std::optional<DeepseekModel::WeightRows>> parts;
  std::mutex mu;
  const std::string err = on_local_ranks([&](Rank& rk) {
    auto part = rk.model->read_weight(name, rows);
    std::lock_guard<std::mutex> lk(mu);
    parts.push_back(std::move(part));
  });
  MLA_CHECK(err.empty(), "{}", err);
  std::optional<DeepseekModel::WeightRows> out;
  for (auto& p : parts) {
    if (!p) continue;
    if (!out) {
      out = std::move(p);
      continue;
    }
    for (size_t i = 0; i < out->values.size(); ++i)
      if (p->held[i] && !out->held[i]) {
        out->values[i] = p->values[i];
        out->held[i] = 1;
      }
  }
  if (!out) return out;
  const auto missing = std::count(out->held.begin(), out->held.end(), uint8_t{0});
  MLA_CHECK(missing == 0, "'{}': {} of the {} values asked for are held by other nodes' ranks only (this reads node "
            "{}'s)", name, missing, out->held.size(), pc_.node_rank);
  return out;
}

void RankSet::set_profiler(bool on) {
  const std::string err = on_local_ranks([&](Rank& rk) { rk.backend->profiler(on); });
  MLA_CHECK(err.empty(), "{}", err);
}

void RankSet::reset_expert_counts() {
  on_counting_rank([&](Rank& rk) { rk.backend->zero(rk.model->expert_counts()); });
}

void RankSet::read_kv_rows(int32_t group, std::span<const int32_t> pages, int64_t skip, int64_t n, char* out) {
  MLA_CHECK(pc_.nnodes == 1, "KV transfer between servers needs the layout on one node (--nnodes {})", pc_.nnodes);
  MLA_CHECK(group >= 0 && group < pc_.dp_size, "KV transfer: DP group {} of {}", group, pc_.dp_size);
  check_not_stopped();
  MLA_CHECK(!released_, "KV transfer while the memory is released");
  const std::string err = on_local_ranks([&](Rank& rk) {
    if (rk.global == group * attn_tp()) rk.kv->read_rows(pages, skip, n, out);
  });
  MLA_CHECK(err.empty(), "{}", err);
}

void RankSet::write_kv_rows(int32_t group, std::span<const int32_t> pages,
                            const std::function<const char*(int64_t)>& token) {
  MLA_CHECK(pc_.nnodes == 1, "KV transfer between servers needs the layout on one node (--nnodes {})", pc_.nnodes);
  MLA_CHECK(group >= 0 && group < pc_.dp_size, "KV transfer: DP group {} of {}", group, pc_.dp_size);
  check_not_stopped();
  MLA_CHECK(!released_, "KV transfer while the memory is released");
  const std::string err = on_local_ranks([&](Rank& rk) {
    if (rk.global / attn_tp() == group) rk.kv->write_rows(pages, token);
  });
  MLA_CHECK(err.empty(), "{}", err);
}

std::string RankSet::on_local_ranks(const std::function<void(Rank&)>& fn) {
  std::vector<std::string> errors(ranks_.size());
  run_on_all([&](int i) {
    Rank& rk = *ranks_[static_cast<size_t>(i)];
    try {  // caught here: a rank's exception would abort the communicators (these jobs run no collective)
      fn(rk);
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(i)] = fmt::format("rank {}: {}", rk.global, e.what());
    }
  });
  for (const std::string& e : errors)
    if (!e.empty()) return e;
  return {};
}

std::string RankSet::reload_local(const std::string& dir) {
  return on_local_ranks([&](Rank& rk) {
    rk.model->reload(dir);
    rk.backend->synchronize();
  });
}

std::string RankSet::on_every_node(const std::string& msg, const std::function<std::string()>& local) {
  const bool remote = link_ && pc_.nnodes > 1;
  if (remote) link_->broadcast(msg);
  std::string err = local();
  for (int32_t node = 1; remote && node < pc_.nnodes; ++node) {
    const std::string r = link_->recv_from(node);
    MLA_CHECK(!r.empty() && (r[0] == kReloaded || r[0] == kFailed), "node {} answered '{}' to '{}'", node,
              r.empty() ? ' ' : r[0], msg[0]);
    if (r[0] == kFailed) throw Error(fmt::format("node {} stopped: {}", node, r.substr(1)));
    if (err.empty() && r.size() > 1) err = fmt::format("node {}: {}", node, r.substr(1));
  }
  return err;
}

void RankSet::reload_weights(const std::string& dir) {
  MLA_CHECK(pc_.node_rank == 0, "RankSet::reload_weights runs on node 0 only");
  MLA_CHECK(weights_lost_.empty(), "the model has no weights: {}", weights_lost_);
  MLA_CHECK(!released_, "the GPU memory is released (/release_memory_occupation): resume it before updating weights");
  const bool remote = link_ && pc_.nnodes > 1;
  if (remote) check_not_stopped();
  // Every node loads `d`; the first error of any (empty: none).
  auto everywhere = [&](const std::string& d) {
    std::string m(1, kReload);
    put_vec(m, std::vector<char>(d.begin(), d.end()));
    return on_every_node(m, [&] { return reload_local(d); });
  };
  std::string err, back;
  try {
    err = everywhere(dir);
    if (!err.empty()) {
      MLA_LOG_WARN("updating the weights from {} failed ({}); loading {} again", dir, err, model_dir_);
      back = everywhere(model_dir_);
    }
  } catch (const std::exception& e) {  // the channel to the other nodes failed: their weights are unknown
    weights_lost_ = fmt::format("updating the weights from {} failed: {}; restart the server", dir, e.what());
    if (remote) stop_nodes(weights_lost_);
    throw;
  }
  if (err.empty()) {
    MLA_LOG_INFO("weights updated from {}", dir);
    model_dir_ = dir;
    return;
  }
  if (back.empty()) fail("{} (the weights of {} are loaded again)", err, model_dir_);
  weights_lost_ = fmt::format("updating the weights from {} failed ({}), and loading {} again failed too ({}); "
                              "restart the server", dir, err, model_dir_, back);
  if (remote) stop_nodes(weights_lost_);
  fail("{}", weights_lost_);
}

std::string RankSet::memory_local(bool release) {
  return on_local_ranks([&](Rank& rk) {
    if (release) {
      rk.backend->synchronize();
      rk.backend->release_persistent();
    } else {
      rk.backend->resume_persistent();
      rk.model->refill();
      rk.backend->synchronize();
    }
  });
}

void RankSet::release_memory() { set_memory_released(true); }
void RankSet::resume_memory() { set_memory_released(false); }

void RankSet::set_memory_released(bool release) {
  MLA_CHECK(pc_.node_rank == 0, "RankSet::release_memory / resume_memory run on node 0 only");
  MLA_CHECK(weights_lost_.empty(), "the model has no weights: {}", weights_lost_);
  MLA_CHECK(released_ != release, "the GPU memory is {}", release ? "released already" : "not released");
  const bool remote = link_ && pc_.nnodes > 1;
  if (remote) check_not_stopped();
  std::string err;
  try {
    err = on_every_node(std::string{kMemory, release ? 'R' : 'U'}, [&] { return memory_local(release); });
  } catch (const std::exception& e) {
    err = e.what();
  }
  // (A failed release leaves the ranks that could released: resume_memory takes theirs again.)
  if (release || err.empty()) released_ = release;
  if (err.empty()) return;
  weights_lost_ = fmt::format("{} the GPU memory failed: {}; restart the server",
                              release ? "releasing" : "taking again", err);
  if (remote) stop_nodes(weights_lost_);
  fail("{}", weights_lost_);
}

void RankSet::check_not_stopped() const {
  MLA_CHECK(stopped_.empty(), "the layout of {} nodes stopped after a failed step (restart it): {}", pc_.nnodes,
            stopped_);
}

void RankSet::stop_nodes(const std::string& why) {
  if (!stopped_.empty()) return;
  stopped_ = why;
  MLA_LOG_ERROR("a step sent to the other nodes failed on node 0; stopping the layout of {} nodes: {}", pc_.nnodes,
                why);
  abort_communicators();
  std::string m(1, kAbort);
  put_vec(m, std::vector<char>(why.begin(), why.end()));
  try {
    link_->broadcast(m);
  } catch (const std::exception& e) {
    MLA_LOG_WARN("telling the other nodes to stop: {}", e.what());
  }
}

std::vector<GroupOutput> RankSet::finish(Launched& h) {
  if (!h.ran) return std::move(h.out);
  h.ran = false;
  if (!h.remote) {
    finish_local(h);
    return std::move(h.out);
  }
  try {
    return finish_remote(h);
  } catch (const std::exception& e) {
    stop_nodes(e.what());
    throw;
  }
}

std::vector<GroupOutput> RankSet::finish_remote(Launched& h) {
  const int32_t d = pc_.dp_size, at = attn_tp(), rpn = ranks_per_node();
  check_not_stopped();
  {  // the other nodes finish this step alongside
    std::string m(1, kFinish);
    put_pod(m, h.seq);
    link_->broadcast(m);
  }
  finish_local(h);
  std::vector<GroupOutput>& out = h.out;
  // Outputs of groups led by ranks of other nodes, node by node, in group order.
  const int64_t V = config_.vocab_size;
  for (int32_t node = 1; node < pc_.nnodes; ++node) {
    bool leads = false;
    for (int32_t g = 0; g < d; ++g) leads |= (g * at) / rpn == node;
    if (!leads) continue;
    const std::string msg = link_->recv_from(node);
    MLA_CHECK(!msg.empty() && (msg[0] == kReply || msg[0] == kFailed), "unknown reply from node {}", node);
    if (msg[0] == kFailed) fail("node {} failed: {}", node, msg.substr(1));
    const char* p = msg.data() + 1;
    const char* end = msg.data() + msg.size();
    const uint64_t seq = get<uint64_t>(p, end);
    MLA_CHECK(seq == h.seq, "node {} replied for step {} while node 0 finishes step {}", node, seq, h.seq);
    for (int32_t g = 0; g < d; ++g) {
      if ((g * at) / rpn != node) continue;
      GroupOutput& o = out[static_cast<size_t>(g)];
      o.ids = get_vec<int32_t>(p, end);
      o.logprobs = get_vec<float>(p, end);
      o.drafts = get_vec<int32_t>(p, end);
      o.hidden = get_vec<float>(p, end);
      o.routes = get_vec<int32_t>(p, end);
      if (const std::vector<int32_t>* keep = rows_of_group(h.logit_rows, g)) {
        std::vector<float> l = get_vec<float>(p, end);
        const int64_t rows = static_cast<int64_t>(keep->size());
        MLA_CHECK(static_cast<int64_t>(l.size()) == rows * V, "bad logits from node {}", node);
        o.logits = Tensor::empty_host({rows, V}, DType::F32);
        if (!l.empty()) std::memcpy(o.logits.data(), l.data(), l.size() * sizeof(float));
      }
    }
  }
  return std::move(out);
}

void RankSet::follow() {
  MLA_CHECK(pc_.node_rank > 0 && link_, "RankSet::follow runs on nodes other than 0");
  try {
    follow_steps();
  } catch (const std::exception& e) {
    if (!told_to_stop_) {  // node 0 may wait in collectives this node will never join: tell it
      MLA_LOG_ERROR("node {} stops: {}", pc_.node_rank, e.what());
      try {
        link_->send(std::string(1, kFailed) + e.what());
      } catch (const std::exception& e2) {
        MLA_LOG_WARN("telling node 0: {}", e2.what());
      }
    }
    throw;
  }
}

void RankSet::follow_steps() {
  const int32_t d = pc_.dp_size, at = attn_tp(), rpn = ranks_per_node();
  std::deque<Launched> running;  // launched here, not finished yet, oldest first (as on node 0)
  for (;;) {
    const std::string msg = link_->recv();
    MLA_CHECK(!msg.empty(), "empty message from node 0");
    const char* p = msg.data() + 1;
    const char* end = msg.data() + msg.size();
    if (msg[0] == kQuit) return;
    if (msg[0] == kAbort) {
      told_to_stop_ = true;
      const std::vector<char> why = get_vec<char>(p, end);
      abort_communicators();  // steps running here wait in collectives node 0 never joined
      fail("node 0 stopped the layout after a failed step: {}", std::string(why.begin(), why.end()));
    }
    if (msg[0] == kMemory) {
      MLA_CHECK(running.empty(), "node 0 released or took the GPU memory while {} steps run", running.size());
      const bool release = get<char>(p, end) == 'R';
      link_->send(std::string(1, kReloaded) + memory_local(release));
      continue;
    }
    if (msg[0] == kReload) {
      MLA_CHECK(running.empty(), "node 0 updated the weights while {} steps run", running.size());
      const std::vector<char> dir = get_vec<char>(p, end);
      const std::string err = reload_local(std::string(dir.begin(), dir.end()));
      if (err.empty()) model_dir_ = std::string(dir.begin(), dir.end());
      link_->send(std::string(1, kReloaded) + err);
      continue;
    }
    if (msg[0] == kKv) {
      MLA_CHECK(running.empty(), "node 0 resized the KV cache while {} steps run", running.size());
      const int32_t pages = get<int32_t>(p, end), ps = get<int32_t>(p, end), host = get<int32_t>(p, end);
      allocate_kv(pages, ps, host);
      continue;
    }
    if (msg[0] == kFinish) {
      const uint64_t seq = get<uint64_t>(p, end);
      MLA_CHECK(!running.empty() && running.front().seq == seq,
                "node 0 finished step {}, but the oldest step running here is {}", seq,
                running.empty() ? std::string("none") : std::to_string(running.front().seq));
      Launched h = std::move(running.front());
      running.pop_front();
      finish_local(h);
      std::string reply(1, kReply);
      put_pod(reply, seq);
      bool leads = false;
      for (int32_t g = 0; g < d; ++g) {
        if ((g * at) / rpn != pc_.node_rank) continue;
        leads = true;
        const GroupOutput& o = h.out[static_cast<size_t>(g)];
        put_vec(reply, o.ids);
        put_vec(reply, o.logprobs);
        put_vec(reply, o.drafts);
        put_vec(reply, o.hidden);
        put_vec(reply, o.routes);
        if (rows_of_group(h.logit_rows, g)) {
          std::vector<float> l;
          if (o.logits.defined() && o.logits.numel() > 0)
            l.assign(o.logits.data_as<float>(), o.logits.data_as<float>() + o.logits.numel());
          put_vec(reply, l);
        }
      }
      if (leads) link_->send(reply);
      continue;
    }
    MLA_CHECK(msg[0] == kStep, "unknown message '{}' from node 0", msg[0]);
    const uint64_t seq = get<uint64_t>(p, end);
    MLA_CHECK(seq > remote_seq_, "step {} from node 0 after step {}", seq, remote_seq_);
    remote_seq_ = seq;
    const MlaForm form = static_cast<MlaForm>(get<char>(p, end));
    LogitRows logit_rows(static_cast<size_t>(d));
    std::vector<ForwardBatch> storage(static_cast<size_t>(d));
    std::vector<const ForwardBatch*> batches(static_cast<size_t>(d), nullptr);
    std::vector<std::vector<RowSampling>> sampling(static_cast<size_t>(d));
    for (int32_t g = 0; g < d; ++g) {
      if (get<char>(p, end)) {
        storage[static_cast<size_t>(g)] = deserialize_forward_batch(p, end);
        batches[static_cast<size_t>(g)] = &storage[static_cast<size_t>(g)];
      }
      sampling[static_cast<size_t>(g)] = get_sampling(p, end);
      logit_rows[static_cast<size_t>(g)] = get_vec<int32_t>(p, end);
    }
    Launched h;
    h.out.resize(static_cast<size_t>(d));
    h.logit_rows = logit_rows;
    h.seq = seq;
    launch_local(batches, sampling, logit_rows, form, h);
    running.push_back(std::move(h));
    ++followed_steps_;
    if (running.size() > 1) ++followed_overlapped_;
  }
}

}  // namespace mlaserve
