// Backend: the seam between the model (which composes layers) and the device that runs them.
// The model owns no kernels; it calls these ops on tensors the backend allocated. Every op has a CPU
// reference (backend/cpu) and each GPU kernel is tested against it. Ops run in order on the backend's stream;
// only the explicit to_host copies synchronise.
//
// Shapes below: T = tokens in the step, H = hidden, E = local experts, k = experts per token,
// nh = local attention heads, kvr = kv_lora_rank, rope = qk_rope_head_dim.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "io/model_config.h"
#include "model/forward_batch.h"

namespace mlaserve {

struct RouterParams {
  TopkMethod method = TopkMethod::Greedy;
  ScoringFunc scoring = ScoringFunc::Softmax;
  int32_t top_k = 1;
  int32_t n_group = 1;
  int32_t topk_group = 1;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  // Shared experts fused into the routed ones: after its top_k picks every token takes n_fixed more experts,
  // fixed_base + j with weight 1, so ids / weights are [T, top_k + n_fixed] (ids_per_token()).
  int32_t n_fixed = 0;
  int32_t fixed_base = 0;

  int32_t ids_per_token() const { return top_k + n_fixed; }

  static RouterParams from_config(const ModelConfig& c) {
    RouterParams p;
    p.method = c.topk_method;
    p.scoring = c.scoring_func;
    p.top_k = static_cast<int32_t>(c.num_experts_per_tok);
    p.n_group = static_cast<int32_t>(c.n_group);
    p.topk_group = static_cast<int32_t>(c.topk_group);
    p.norm_topk_prob = c.norm_topk_prob;
    p.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
    return p;
  }
};

struct MlaParams {
  int32_t num_heads = 0;  // local heads
  int32_t qk_nope = 0, qk_rope = 0, v_head = 0, kv_lora = 0;
  float softmax_scale = 1.0f;
  MlaForm form = MlaForm::Auto;
};

// Per-row parameters of Backend::sample (the engine's sampler). Order of application: repetition, frequency and
// presence penalties on the listed tokens; then temperature; then top-k, top-p (over the top-k set's renormalised
// probabilities) and min-p; then a Gumbel-max draw. Thresholds keep every token tied with the last one kept.
struct RowSampling {
  float temperature = 0.0f;  // <= 0: greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // <= 0 or >= vocab: off
  float top_p = 1.0f;        // >= 1: off; <= 0: only the most likely token(s)
  float min_p = 0.0f;        // <= 0: off; else keep p >= min_p * p_max
  float frequency_penalty = 0.0f;   // logit -= frequency_penalty * count
  float presence_penalty = 0.0f;    // logit -= presence_penalty (count > 0)
  float repetition_penalty = 1.0f;  // logit > 0 ? logit / r : logit * r
  // Counter-based randomness: token v's Gumbel noise is a function of (seed, step, v) only (open_uniform in
  // core/random.h), so every backend draws the same token; advance `step` once per generated token.
  uint64_t seed = 0, step = 0;
  // (token id, count) of the tokens generated so far, ids unique, counts > 0.
  std::vector<std::pair<int32_t, int32_t>> penalty_counts;
  // >= 0: one more generated token, not in penalty_counts: this step's input id at that token index, read on the
  // device after resolve_prev_ids (overlap scheduling: the token sampled by the step still running). It counts as
  // one more occurrence of its id (added to its entry, or a new entry of count 1).
  int32_t pending_input = -1;
  // (token id, bias) added to the logits before the penalties (-inf: never drawn), ids unique.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Constrained decoding: only tokens whose bit is set (bit t % 32 of word t / 32) may be drawn (the others' logits
  // are -inf from the start; ids past the mask too). Null: every token.
  std::shared_ptr<const std::vector<uint32_t>> allowed;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;
  // Element type of activations and of the latent KV cache on this backend (or the cache in FP8 E4M3, which every
  // mla_* op below takes: model/kv_cache.h).
  virtual DType act_dtype() const = 0;

  // ---- memory ----
  // Persistent memory (weights, KV cache), zero-filled. On a GPU: taken up front, never in the steady state.
  virtual Tensor alloc(const Shape& shape, DType dtype) = 0;
  // Step-scoped memory for activations: contents undefined, valid until the next begin_step (an arena that
  // begin_step resets; no device allocation per step).
  virtual Tensor scratch(const Shape& shape, DType dtype) = 0;
  // Scratch taken after scratch_mark() may be handed out again after scratch_release(mark) (the model releases each
  // layer's temporaries at the layer's end, so the arena holds one layer's worth). Tensors from before the mark stay.
  virtual size_t scratch_mark() { return 0; }
  virtual void scratch_release(size_t mark) { (void)mark; }
  // SGLang's /release_memory_occupation (--enable-memory-saver): gives the persistent memory (weights, KV cache) back
  // to the device, keeping its addresses, so that another process (an RL trainer beside the server) can use it;
  // resume_persistent takes it again at the same addresses (recorded graphs stay valid) with every byte zero but what
  // the backend keeps there itself (restored): the weights must be loaded again, the KV cache is empty. The CPU keeps
  // its memory and zeroes it (the same contract to test against).
  virtual void release_persistent() { fail("the {} backend cannot release its memory", name()); }
  virtual void resume_persistent() { fail("the {} backend cannot release its memory", name()); }
  // Bytes of persistent memory still free for alloc() (the latent KV pool is sized from it); -1: no fixed budget.
  virtual int64_t persistent_bytes_free() const { return -1; }
  // Waits for every op issued so far.
  virtual void synchronize() {}
  // Profiling (/start_profile, /stop_profile): the device profiler's capture range (CUDA: cudaProfilerStart / Stop,
  // what `nsys profile --capture-range=cudaProfilerApi` records); nothing elsewhere.
  virtual void profiler(bool on) { (void)on; }
  // Makes the calling thread use this backend's device (cudaSetDevice); every rank thread calls it first.
  virtual void bind_thread() {}
  // The device stream (cudaStream_t) collectives must be ordered on; null on the CPU.
  virtual void* native_stream() { return nullptr; }
  // The element type weights of source dtype `src` are kept in on this backend.
  virtual DType weight_dtype(DType src) const = 0;
  // Uploads a host tensor, converting its elements to `dtype` (F32/F16/BF16/F8_E4M3/F8_E5M2 sources).
  virtual Tensor upload(const Tensor& host, DType dtype) = 0;
  // Copies a host tensor into an existing backend tensor of the same element count, converting elements.
  virtual void upload_into(const Tensor& host, Tensor& dst) = 0;
  // Downloads to a new host F32 tensor (converting).
  virtual Tensor to_host_f32(const Tensor& t) = 0;
  // Copies the raw bytes of a backend tensor to host memory (t.nbytes() bytes), waiting for it.
  virtual void download(const Tensor& t, void* dst) = 0;
  // Starts copying t's raw bytes to the host and returns at once (the device keeps working on what was issued);
  // download_finish(ticket, dst) waits for that copy and writes its bytes to dst. Up to kMaxDownloads may be in
  // flight; they finish in the order they started. Default: a synchronous copy kept until finished.
  static constexpr int kMaxDownloads = 8;
  virtual uint64_t download_start(const Tensor& t);
  virtual void download_finish(uint64_t ticket, void* dst);
  // The hierarchical cache's host tier (KvCache::enable_host): host memory that copy_kv_pages reads and writes
  // (pinned and mapped into the device's address space on CUDA; plain memory on the CPU), given back by free_host.
  virtual void* alloc_host(size_t bytes);
  virtual void free_host(void* p);
  // For each pair (page, slot) of `saves`, then each pair (slot, page) of `loads`: bytes [page * page_bytes, +
  // page_bytes) of every tensor of `layers` (a page of each layer's cache) copied to (saves) or from (loads) host block
  // `slot` of `host` (a block holds that page of each layer in turn: layers.size() * page_bytes), in stream order with
  // the ops around it. Default: memcpy (tensors in host memory).
  virtual void copy_kv_pages(std::span<Tensor* const> layers, int64_t page_bytes, char* host,
                             std::span<const int32_t> saves, std::span<const int32_t> loads);
  // Deterministic pseudo-random fill for dummy weights: value = mean + stddev * u, u uniform with unit variance,
  // a function of (seed, index in the FULL tensor) only, so every backend and shard layout agrees. t is viewed
  // as [rows, cols]; its element (r, c) is full element (r + row_offset) * full_cols + c + col_offset.
  virtual void fill_random(Tensor& t, uint64_t seed, float mean, float stddev, int64_t full_cols, int64_t row_offset,
                           int64_t col_offset) = 0;

  // ---- per step ----
  // Uploads the step's metadata once; every op below reads it (positions, slots, page table, ...).
  virtual void begin_step(const ForwardBatch& batch) = 0;
  // Input ids of this step that are negative, -(k + 1), become prev[k]: the ids sampled in the previous step,
  // which stayed on the device (overlap scheduling launches a step before the previous one's ids reach the host).
  // prev: I32 [n] backend tensor; k >= n gives id 0 (the host checks the range). Recorded in graphs.
  virtual void resolve_prev_ids(const Tensor& prev) = 0;
  // The step's input ids become `ids` (as many as before); its other metadata and the scratch handed out so far
  // stay. Negative ids are resolved as begin_step's are (resolve_prev_ids). A second forward over the same tokens
  // with other ids: the draft layer (MTP) reads the token after each position where the model read the token itself.
  virtual void set_input_ids(std::span<const int32_t> ids) = 0;
  // A further forward within the step (the MTP layer's chained drafts): `batch`'s metadata replaces the step's as
  // begin_step's would, but the scratch handed out so far stays valid (earlier forwards' outputs are its inputs).
  virtual void begin_substep(const ForwardBatch& batch) = 0;
  // The step's last op has been issued (idle statistics mark the end of its device work here).
  virtual void end_step() {}

  // ---- graphs (CUDA graphs for decode steps; backends without them keep these defaults) ----
  // A graph step is a decode batch (is_graph_batch: one token per sequence, or decode tokens with their drafts, all
  // in the absorbed form, every token a logit row). begin_graph_step lays its metadata out at offsets
  // that depend only on the token count (so a graph recorded for that count reads each later step's metadata) and
  // splits attention work into a fixed number of parts per token. It needs an earlier begin_step + mla_attention of
  // the same model (the attention shapes are learnt there).
  virtual bool supports_graphs() const { return false; }
  // Graphs of one token count may differ by the kernels a step of that batch takes (e.g. by context length): the
  // model keeps one graph per (token count, variant).
  virtual int32_t graph_variant(const ForwardBatch& /*batch*/) const { return 0; }
  // The contexts (keys of its token) from which a one-token step has another graph_variant, ascending: the rank set
  // records a graph for each at startup too, so no step waits for a recording.
  virtual std::vector<int32_t> graph_variant_contexts() const { return {}; }
  virtual void begin_graph_step(const ForwardBatch& batch) { begin_step(batch); }
  // Records the ops issued until graph_capture_end instead of running them; returns the graph's id.
  virtual void graph_capture_begin() { fail("the {} backend has no graphs", name()); }
  virtual int32_t graph_capture_end() { fail("the {} backend has no graphs", name()); }
  // Runs a recorded graph on this step's metadata (after begin_graph_step with the same token count).
  virtual void graph_replay(int32_t graph) { fail("the {} backend has no graph {}", name(), graph); }
  // Destroys every graph (before the communicators their collectives use).
  virtual void release_graphs() {}
  // Runs a collective (a Communicator call on this rank's tensors) in the step's order: at once where the device
  // stream orders it (NCCL enqueues on the stream, and a CUDA graph being recorded captures it); GraphRecorder
  // records it with the ops. The closure owns what it uses (tensor views, communicator pointer).
  virtual void collective(std::function<void()> fn) { fn(); }

  // ---- ops ----
  // out[T, H] = table[ids - vocab_begin] for ids in [vocab_begin, vocab_begin + rows), else 0.
  virtual void embedding(const Tensor& table, int64_t vocab_begin, Tensor& out) = 0;
  // out[N, D] = x * rsqrt(mean(x^2) + eps) * w (fp32 math). out may alias x.
  virtual void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) = 0;
  // residual[N, D] += x; out = rmsnorm(residual).
  virtual void add_rmsnorm(const Tensor& x, Tensor& residual, const Tensor& w, float eps, Tensor& out) = 0;
  // y[N, out] = x[N, in] @ w[out, in]^T. y may be act_dtype or F32.
  virtual void linear(const Tensor& x, const Tensor& w, Tensor& y) = 0;
  // Two products of the same input, y1 = x @ w1^T and y2 = x @ w2^T (e.g. the q and latent projections): the default
  // runs the two linears; a backend may run them as one launch.
  virtual void linear_pair(const Tensor& x, const Tensor& w1, Tensor& y1, const Tensor& w2, Tensor& y2) {
    linear(x, w1, y1);
    linear(x, w2, y2);
  }
  // add_rmsnorm with the sums written to residual_out (not in place; it must not overlap residual or x), then
  // linear_pair of the normalised rows: the default runs the ops (normed receives the rows); a backend may fuse them
  // (the CUDA one does at one token, where normed is left unwritten).
  virtual void add_rmsnorm_linear_pair(const Tensor& x, const Tensor& residual, Tensor& residual_out,
                                       const Tensor& norm_w, float eps, Tensor& normed, const Tensor& w1, Tensor& y1,
                                       const Tensor& w2, Tensor& y2) {
    copy(residual, residual_out);
    add_rmsnorm(x, residual_out, norm_w, eps, normed);
    linear_pair(normed, w1, y1, w2, y2);
  }
  // out[N, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
  virtual void silu_mul(const Tensor& gate_up, Tensor& out) = 0;
  // t = 0.
  virtual void zero(Tensor& t) = 0;
  // dst = src (same element count and dtype), device to device.
  virtual void copy(const Tensor& src, Tensor& dst) = 0;
  // a += b (same shape)
  virtual void add(Tensor& a, const Tensor& b) = 0;
  // out[R, C] = x[logit_rows of the step, C]
  virtual void gather_logit_rows(const Tensor& x, Tensor& out) = 0;
  // out[n, C] = x[rows[i], C] for the n rows given on the host.
  virtual void gather_rows(const Tensor& x, std::span<const int32_t> rows, Tensor& out) = 0;
  // parts[n * R, C] (n blocks of R rows, e.g. each rank's slice of the vocabulary) -> out[R, n * C] with
  // out[i, r * C + c] = parts[r * R + i, c].
  virtual void interleave_blocks(const Tensor& parts, int64_t n, Tensor& out) = 0;

  // MLA, part 1. latent[T, kvr + rope] = kv_a_proj_with_mqa(x): normalise c_kv with `kv_norm`, rotate k_pe
  // (adjacent pairs, YaRN-scaled cos/sin), write both into cache rows out_slots. cache: [slots, kvr + rope]. With an
  // FP8 cache the row is written as E4M3 codes and latent keeps the values the codes stand for.
  virtual void mla_write_latent(Tensor& latent, const Tensor& kv_norm, float eps, Tensor& cache) = 0;
  // MLA, part 2. q[T, nh * (nope + rope)]: rotate the rope part of every head in place.
  virtual void mla_rope_q(Tensor& q, int32_t num_heads, int32_t qk_nope, int32_t qk_rope) = 0;
  // MLA, parts 1 and 2 together (mla_write_latent, then mla_rope_q): the default runs the two ops; a backend may
  // fuse them.
  virtual void mla_prepare(Tensor& q, int32_t num_heads, int32_t qk_nope, int32_t qk_rope, Tensor& latent,
                           const Tensor& kv_norm, float eps, Tensor& cache) {
    mla_write_latent(latent, kv_norm, eps, cache);
    mla_rope_q(q, num_heads, qk_nope, qk_rope);
  }
  // MLA, part 3: causal attention of q over the paged latent cache (this step's tokens already written).
  // kv_b: [nh * (nope + v), kvr]. out: [T, nh * v].
  virtual void mla_attention(const Tensor& q, const Tensor& cache, const Tensor& kv_b, const MlaParams& p,
                             Tensor& out) = 0;

  // mla_prepare, then mla_attention (p gives the heads and dims): the default runs the two ops; a backend may fuse
  // them (the CUDA one does at 1-2 decode tokens). The cache rows and out are the result; q and latent may be left
  // as they were (the CUDA one-token kernel reads them only).
  virtual void mla_prepare_attention(Tensor& q, Tensor& latent, const Tensor& kv_norm, float eps, Tensor& cache,
                                     const Tensor& kv_b, const MlaParams& p, Tensor& out) {
    mla_prepare(q, p.num_heads, p.qk_nope, p.qk_rope, latent, kv_norm, eps, cache);
    mla_attention(q, cache, kv_b, p, out);
  }

  // MoE routing from router logits[T, E_total] (F32) and optional correction bias[E_total] (F32).
  // topk_ids[T, k] (I32, global expert ids), topk_weights[T, k] (F32, scaled); k = p.ids_per_token() (the fixed
  // experts after the picks).
  virtual void moe_route(const Tensor& logits, const Tensor* bias, const RouterParams& p, Tensor& topk_ids,
                         Tensor& topk_weights) = 0;
  // moe_route of logits = linear(x[T, H], router[E_total, H]) in F32: the default runs the two ops; a backend may
  // fuse them (the CUDA one does for one row).
  virtual void moe_gate(const Tensor& x, const Tensor& router, const Tensor* bias, const RouterParams& p,
                        Tensor& topk_ids, Tensor& topk_weights);
  // add_rmsnorm with the sums written to residual_out (as add_rmsnorm_linear_pair), then moe_gate of the normalised
  // rows, which `normed` receives (the experts' input): the default runs the ops; a backend may fuse them (the CUDA
  // one does at one row).
  virtual void add_rmsnorm_moe_gate(const Tensor& x, const Tensor& residual, Tensor& residual_out, const Tensor& norm_w,
                                    float eps, Tensor& normed, const Tensor& router, const Tensor* bias,
                                    const RouterParams& p, Tensor& topk_ids, Tensor& topk_weights) {
    copy(residual, residual_out);
    add_rmsnorm(x, residual_out, norm_w, eps, normed);
    moe_gate(normed, router, bias, p, topk_ids, topk_weights);
  }
  // Expert distribution recording: counts[e] (I64 [E_total]) += the (row, k) pairs of topk_ids [R, k] (I32) that chose
  // expert e, over the rows the step's ForwardBatch::moe_rows names (all R when it has none); ids outside [0, E_total)
  // are skipped. A recorded graph reads moe_rows when it replays. CPU reference: CpuBackend.
  virtual void count_experts(const Tensor& topk_ids, Tensor& counts) {
    (void)topk_ids;
    (void)counts;
    fail("the {} backend cannot count routed experts", name());
  }
  // Whether moe_experts takes routed experts kept in FP8 (F8_E4M3 gate_up / down with their BlockScales): the loader
  // then keeps an FP8 checkpoint's experts quantized (half the memory of bf16) instead of dequantizing them.
  virtual bool takes_fp8_experts() const { return false; }
  // Whether moe_experts takes routed experts kept in INT4 (U8 gate_up / down of code pairs with BlockScales holding
  // scales and zeros): the loader then keeps a 4-bit checkpoint's experts quantized (about a quarter of the memory of
  // bf16).
  virtual bool takes_int4_experts() const { return false; }
  // out[T, H] = sum_k w * down_e(silu(gate_e x) * up_e x) over the experts in [expert_begin, expert_begin + E).
  // gate_up: [E, 2I, H] (gate rows then up rows), down: [E, H, I]. With shared experts (shared_gate_up [2 Is, H] and
  // shared_down [H, Is], both or neither) their MLP is added: out = routed + down_s(silu(gate_s x) * up_s x), each
  // term in the activation type before the sum (as linear + silu_mul + linear + add would give).
  // n_fixed: every token's last n_fixed ids are the last n_fixed local experts, expert_begin + E - n_fixed + j, with
  // weight 1 (shared experts fused into the routed ones: RouterParams::n_fixed); a backend may start on them before it
  // reads the ids (the CPU backend checks it).
  virtual void moe_experts(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& gate_up,
                           const Tensor& down, int32_t expert_begin, const Tensor* shared_gate_up,
                           const Tensor* shared_down, int32_t n_fixed, Tensor& out) = 0;

  // Samples one token per row of logits[R, V] (F32) with params[r]: ids[R] (I32, backend tensor) and, when
  // logprobs is given, the chosen token's log-probability under the penalised, temperature-scaled distribution
  // (before the top-k / top-p / min-p filters; temperature 0 counts as 1). CPU reference: CpuBackend::sample.
  virtual void sample(const Tensor& logits, std::span<const RowSampling> params, Tensor& ids, Tensor* logprobs) = 0;
  // sample()'s argument checks, shared by the backends: shapes and dtypes, and every pending input a token of the
  // step (of step_tokens). Returns R, the rows.
  static int64_t check_sample(const Tensor& logits, std::span<const RowSampling> params, const Tensor& ids,
                              const Tensor* logprobs, int64_t step_tokens);
  // Sampling recorded in a decode graph. stage_sample gives this step's rows (R <= the step's tokens) and where their
  // log-probabilities go (F32 [R], or null), between begin_graph_step and the recording or replay of the graph;
  // sample_staged(logits [n, V], ids [n]) samples the staged rows of logits' first R rows into ids' first R (the
  // others are not written), as sample() would. While a graph records, sample_staged is recorded: each replay
  // samples the rows staged before it. Backends with graphs implement both (CPU reference: GraphRecorder over
  // CpuBackend::sample).
  virtual void stage_sample(std::span<const RowSampling> /*params*/, const Tensor* /*logprobs*/) {
    fail("the {} backend has no graphs to sample in", name());
  }
  virtual void sample_staged(const Tensor& /*logits*/, Tensor& /*ids*/) {
    fail("the {} backend has no graphs to sample in", name());
  }
  // Their checks, shared by the backends: pending inputs and R within the step, logprobs F32 [R] (returns R);
  // logits F32 [n, V], ids I32 [n] with n >= the rows staged (staged: -1 when none were this step).
  static int64_t check_staged_sample(std::span<const RowSampling> params, const Tensor* logprobs, int64_t step_tokens);
  static void check_sample_staged(const Tensor& logits, const Tensor& ids, int64_t staged);

  // Rotary tables: inverse frequencies [rope / 2] and the cos/sin multiplier, set once at model load.
  virtual void set_rope(const std::vector<float>& inv_freq, float attention_factor) = 0;

 private:
  // The default download_start's copies, oldest first, with their tickets.
  std::deque<std::pair<uint64_t, std::vector<char>>> done_downloads_;
  uint64_t next_download_ = 0;
};

// The width Is of moe_experts' shared experts (0 without them) after checking their shapes against x [T, H] and out.
int64_t shared_experts_width(const Tensor& x, const Tensor* gate_up, const Tensor* down, const Tensor& out);
// y = down(silu(gate x) * up x) with gate_up [2 Is, H], down [H, Is] (Is > 0), through the backend's linear /
// silu_mul; its intermediates in scratch, released before it returns.
void shared_experts_mlp(Backend& be, const Tensor& x, const Tensor& gate_up, const Tensor& down, int64_t Is, Tensor& y);
// out += shared_experts_mlp(x) (the shared experts of Backend::moe_experts where a backend has no fused path);
// nothing without them.
void add_shared_experts(Backend& be, const Tensor& x, const Tensor* gate_up, const Tensor* down, Tensor& out);

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace mlaserve
