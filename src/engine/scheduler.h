// Scheduler: continuous batching for one DP rank, host-only (no model, no device). Each step it picks the
// decode tokens of running requests and prefill chunks of waiting ones under the budgets, takes KV pages for
// them (evicting prefix-cache pages, or retracting running requests when decode runs out), and describes the
// step as a ForwardBatch. After the forward, `commit` takes the sampled tokens and decides what finished.
//
// Invariants (check_integrity): every page is exactly one of free / held by one running request / cached in
// the radix tree (requests may share cached pages they locked); a running request holds pages covering its
// kv_len tokens; at most one request is mid-prefill (chunked).
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine_api.h"
#include "engine/page_pool.h"
#include "engine/radix_cache.h"
#include "engine/sampler.h"
#include "model/forward_batch.h"

namespace mlaserve {

struct SchedulerConfig {
  int32_t page_size = 16;
  int32_t num_pages = 0;
  int32_t max_running_requests = 256;
  int32_t chunked_prefill_size = 8192;  // prefill tokens per step (<= 0: unlimited)
  int64_t context_len = 4096;
  bool enable_radix_cache = true;
  // The hierarchical cache (SGLang's --enable-hierarchical-cache): host slots of a host tier the prefix cache keeps
  // evicted pages in (RadixCache::enable_host_tier); 0: none. The steps carry the copies (take_copies).
  int32_t host_pages = 0;
  std::vector<int32_t> eos_token_ids;
  // Logit rows of prompt logprobs (SamplingParams::logprob_start_len) per step: their full logits come to the host,
  // so a prompt that asks for them is prefilled in chunks of at most this many such rows.
  int32_t max_prompt_logprob_rows = 512;
  // Waiting requests in order of (priority, arrival) instead of arrival, and decode retracts the running request
  // of the largest (priority, arrival) first instead of the newest.
  bool priority_scheduling = false;
  // SGLang's --schedule-policy lpm: while at most kLpmMaxWaiting requests wait, they are tried in order of the longest
  // prefix the cache holds for them (longest first; after priority with priority scheduling), else in arrival order.
  bool longest_prefix_first = false;
  // With priority scheduling (SGLang's priority preemption): a waiting request that cannot be admitted (no pages for
  // its prompt, or max_running_requests reached) retracts running requests whose priority value exceeds its own by
  // more than priority_preemption_threshold, the largest (priority, arrival) first, until it fits.
  bool priority_preemption = false;
  int32_t priority_preemption_threshold = 10;
  // Speculative decoding with n-gram drafts (prompt lookup; SGLang's NGRAM, vLLM's "ngram"): a decoding request
  // whose last tokens (spec_ngram_max down to spec_ngram_min of them) occurred earlier in its prompt or output
  // proposes up to spec_draft_tokens tokens that followed them; one step checks them all (1 + drafts rows) and keeps
  // the drafts its own draws agree with, plus the first draw that disagrees. Under overlap scheduling a request whose
  // decode token is still in flight drafts too: the match ends at the token before it, the token after the match
  // guesses the one in flight and the drafts follow the guess (the step's draws check them against the real token).
  // 0: off.
  int32_t spec_draft_tokens = 0;
  int32_t spec_ngram_min = 1;
  int32_t spec_ngram_max = 3;
  // Drafts from the model's MTP layer instead (SGLang's EAGLE / NEXTN, vLLM's deepseek_mtp): every step runs the
  // MTP layer after the model (ForwardBatch::next_ids), whose greedy token after a request's last sample is its first
  // draft for the next step; with spec_draft_tokens 2 or more the layer chains on its own drafts
  // (ForwardBatch::mtp_chain; a decoding request's pages keep room for the chain's positions). A request that may
  // draft waits for its step in flight (its drafts come from that step), and does not back off (the MTP layer runs
  // anyway).
  bool spec_model_drafts = false;
  // No drafts in a step with more decoding requests than this (vLLM's disable_by_batch_size; 0: no limit): a step
  // that checks drafts is several tokens for every drafting request in it.
  int32_t spec_max_batch = 0;
};

// The tokens that followed the most recent earlier occurrence of `seq`'s last n tokens (n from max_n down to min_n:
// the longest match first), k of them, repeating with the match's period where they reach the end of `seq`; empty
// when none occurred. Looks back at most kNgramWindow tokens.
inline constexpr size_t kNgramWindow = size_t{1} << 15;
inline constexpr int32_t kMaxDraftBackoff = 16;
std::vector<int32_t> ngram_draft(std::span<const int32_t> seq, int32_t min_n, int32_t max_n, int32_t k);

enum class ReqState { Waiting, Prefilling, Decoding, Finished };

struct Req {
  std::string rid;
  std::vector<int32_t> prompt;   // the original input ids
  std::vector<int32_t> output;   // generated ids
  std::vector<int32_t> fill;     // prompt + output: the tokens whose KV the request needs
  std::string cache_salt;        // GenerateRequest::cache_salt: its tree of the prefix cache
  SamplingParams sampling;
  std::function<void(const GenerateOutput&)> on_output;
  SamplerState sampler;

  ReqState state = ReqState::Waiting;
  std::vector<int32_t> pages;           // cover positions [0, kv_len + this step's tokens)
  RadixCache::Node* prefix_node = nullptr;  // locked cached prefix (its pages lead `pages`)
  int32_t prefix_pages = 0;            // how many of `pages` belong to the cache
  int32_t kv_len = 0;                  // tokens whose latent is in the cache
  int32_t cached_tokens = 0;           // prompt tokens served by the prefix cache (first admission)
  int32_t loaded_tokens = 0;           // of the last admission's prefix, those copied back from the host tier
  int32_t emitted = 0;                 // output tokens already reported
  uint64_t admit_order = 0;
  int32_t priority = 0;                // GenerateRequest::priority
  uint64_t arrival = 0;                // order of add()
  bool counted = false;                // prompt counted in the stats (first admission)
  int32_t in_flight = 0;               // tokens of a step that ran (advance) but whose sample is not back (resolve)
  int32_t pending_row = -1;            // logit row of the newest such token in the step that samples it
  int32_t plan_refs = 0;               // launched plans (advance) not yet resolved that name this request
  bool drafting = false;               // its step in flight checks drafts: the next token is not known before it
  // Drafting backs off while its drafts are not kept: after a check that kept none, the next draft_backoff decode
  // steps propose none (doubling up to kMaxDraftBackoff with every such check; a kept draft resets it).
  int32_t draft_backoff = 0;
  int32_t draft_skip = 0;
  std::vector<int32_t> model_drafts;  // SchedulerConfig::spec_model_drafts: the MTP layer's tokens after the last one
  std::vector<TokenLogprob> pending_lps;  // logprobs not yet reported
  // Prompt logprobs (sampling.logprob_start_len >= 0): those of prompt positions lp_first_row + 1 on, one per logit
  // row from prompt position lp_first_row up to the prompt's second last, collected as the chunks resolve and
  // reported with the first token (prompt_lps_done from then on).
  std::vector<TokenLogprob> prompt_lps;
  bool prompt_lps_done = true;
  // sampling.return_hidden_states: rows of final hidden states not yet reported ([n, hidden_width] row-major), and
  // the positions [0, hidden_have) whose rows were collected (a prefix match never reaches past it: the positions
  // after it are computed, once each even across a retraction).
  std::vector<float> hidden;
  int32_t hidden_width = 0;
  int32_t hidden_have = 0;
  std::vector<int32_t> routes;  // sampling.return_routed_experts: the same positions' routed experts, not yet reported
  std::shared_ptr<const std::vector<uint32_t>> allowed_mask;  // sampling.allowed_token_ids as a mask; null: all
  // With a thinking budget: the output index where the open thinking section's tokens begin (0: the prompt left it
  // open), -1 while none is open.
  int32_t think_since = -1;
  int32_t constraint_state = 0;  // sampling.constraint's state after the resolved output tokens
  std::string constraint_error;  // the constraint failed (its draw ran unconstrained): the request ends with it
  // The constraint allows no first token and no stop token may end its text there (its language only the empty text):
  // nothing is drawn (max_new_tokens set to 0) and the request stops with no tokens.
  bool empty_text = false;
  FinishReason finish;
};

// Whether `seq` (up to `end` elements) ends with the non-empty `pattern`.
inline bool ends_with(const std::vector<int32_t>& seq, size_t end, const std::vector<int32_t>& pattern) {
  return !pattern.empty() && end >= pattern.size() &&
         std::equal(pattern.begin(), pattern.end(), seq.begin() + static_cast<std::ptrdiff_t>(end - pattern.size()));
}
// The thinking budget's forced token for the request's next draw (its resolved tokens plus `in_flight` more), or -1.
int32_t forced_think_token(const Req& r, int32_t in_flight);
// Whether the next draw needs the request's previous token on the host (a constraint, a multi-token bad word, or a
// thinking budget whose forcing may start): under overlap scheduling its step waits for that token.
bool waits_for_previous_token(const Req& r);

// One scheduled unit of work: `num_tokens` tokens of `req` starting at position req->kv_len.
struct ScheduledSeq {
  Req* req = nullptr;
  int32_t num_tokens = 0;
  bool wants_logits = false;  // samples a token (its last row): last chunk of the prompt, or a decode token
  // Prompt logprobs: logit rows of prompt positions [lp_first_pos, lp_first_pos + lp_rows) (each gives the logprob of
  // the prompt token after it), before the sampled row. Rows of a step: every seq's lp_rows, then its sampled row.
  int32_t lp_rows = 0;
  int32_t lp_first_pos = 0;
  bool prefill = false;  // prompt tokens (a chunk of them), not a generated one
  int32_t kv_end = 0;    // req->kv_len after this step (set when it launches)
  // Speculative decoding: draft tokens after the decode token (num_tokens = 1 + drafts), each with a sampled row.
  std::vector<int32_t> drafts;
  int32_t sampled_rows() const { return wants_logits ? 1 + static_cast<int32_t>(drafts.size()) : 0; }
  int32_t rows() const { return lp_rows + sampled_rows(); }
};

struct StepPlan {
  std::vector<ScheduledSeq> seqs;
  ForwardBatch batch;  // logit rows follow `seqs` order, rows() of each
  bool blocked = false;  // schedule(allow_retract = false) needed a retraction: nothing was planned
  // Some input ids are the samples of the step still running (ForwardBatch: -(row + 1)): the batch is valid only
  // as the very next step on the same ranks (the sampled ids stay on the device), else refresh() it first.
  bool uses_prev_ids = false;
  int32_t mtp_chain = 0;  // ForwardBatch::mtp_chain: the MTP drafts this step makes (1 where it checks none)
  // The step's hidden states (GroupOutput::hidden, [batch.hidden_rows, hidden_width]), set before resolve: every new
  // token of each sequence whose request returns them, in sequence order.
  std::vector<float> hidden;
  int32_t hidden_width = 0;
  std::vector<int32_t> routes;  // (GroupOutput::routes: [rows, routes_width])
  int32_t routes_width = 0;
  // Positions past a request's last new token that its chained drafts write (the MTP layer's cache).
  int32_t chain_room() const { return mtp_chain > 1 ? mtp_chain - 1 : 0; }
  bool empty() const { return seqs.empty(); }
};

// What a step brought back for one position of a request that wants its rows (SamplingParams::wants_rows).
struct RowOutputs {
  std::span<const float> hidden;
  std::span<const int32_t> routes;
};

// A token whose sample has not come back yet (overlap scheduling); never sent to the model.
inline constexpr int32_t kPendingToken = -1;

class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig cfg);
  ~Scheduler();
  // A waiting request sharing this many tokens (or a page, if more) beyond its cached prefix with the uncached part of
  // a running request's prompt (in prefill, or its last chunk's step in flight) waits until they are cached
  // (schedule()).
  static constexpr int64_t kShareDefer = 32;
  static constexpr size_t kLpmMaxWaiting = 128;

  const SchedulerConfig& config() const { return cfg_; }
  // Throws mlaserve::Error for requests that can never run (empty, too long for the context or the pool).
  void validate(const GenerateRequest& r) const;
  void add(GenerateRequest r);
  // Removes the request wherever it is and reports `reason` to it. Returns false if unknown.
  bool abort(const std::string& rid, const FinishReason& reason, bool cache_kv = true);
  // Plans the next step (possibly empty). With allow_retract = false (a step is still running, so its requests'
  // pages are in use), a plan that would need to retract comes back `blocked` and empty instead.
  StepPlan schedule(bool allow_retract = true);
  // Applies the results of the planned step's logit rows (rows() per seq in order: the prompt logprobs, then the
  // sampled token): advance + resolve + erase_finished.
  void commit(StepPlan& plan, const std::vector<SampleResult>& sampled);
  // Overlap scheduling splits commit in two. advance: what the step does without its samples (kv lengths grow,
  // each sampled row leaves a kPendingToken in the request's tokens), so the next step can be planned while this
  // one runs; that plan feeds the pending tokens from the device (uses_prev_ids) and may be launched before this
  // step resolves, so a request can have two tokens in flight. resolve: the samples arrive, oldest first; pending
  // tokens are replaced, stop / length checks run, outputs go out. A request that finished while a later step was
  // already running gets that step's token dropped.
  void advance(StepPlan& plan);
  void resolve(StepPlan& plan, const std::vector<SampleResult>& sampled);
  // A plan made before the previous step resolved: drops requests that finished meanwhile and rebuilds the
  // batch with the now-known tokens.
  void refresh(StepPlan& plan);
  // A launched plan (advance) that will never resolve (its step failed): its requests stop waiting for it.
  void drop(StepPlan& plan);
  // A step that failed (before or after it was launched): its requests end with `reason` and their KV is not cached
  // (the step may have written part of it). If it carried the prefix cache's copies, the loaded edges and the saved
  // host slots may hold anything: the cache matches and keeps nothing until it can be emptied (nothing locked).
  void fail(const StepPlan& plan, const FinishReason& reason);
  // Frees finished requests that no launched, unresolved plan names.
  void erase_finished();
  bool flush_cache();
  // Moves the prefix cache's copies between device pages and host slots (hierarchical cache) into the plan's batch,
  // which must be launched: right before a plan is launched (after any refresh), never for a plan that is dropped.
  void take_copies(StepPlan& plan);
  // Whether a decoding request may propose drafts this step (speculative decoding on; no token in flight; its draws
  // depend on nothing the drafts would change: no penalties, constraint, bad words or thinking budget).
  bool may_draft(const Req& r) const;
  // Priority preemption (SchedulerConfig::priority_preemption) for the head of the waiting queue: retracts running
  // requests for it while it does not fit and one is far enough below it. Without allow_retract (a step is in flight)
  // nothing is retracted: true when a retraction is wanted (the plan is then blocked until nothing runs).
  bool preempt_for_waiting(bool allow_retract);
  // Tokens of the waiting request w's first chunk that do not fit now (0: it fits), or -1 when the running requests
  // are at max_running_requests. Leaves w waiting, as it was. freed: the tokens retracting all of `victims` would
  // make available to w (their own pages, a decoding one's page of headroom, and their cached prefixes' pages that
  // no other request, w included, holds).
  int64_t admission_shortfall(Req& w, int32_t headroom, std::span<Req* const> victims, int64_t& freed);
  // The tokens of a waiting request's first prefill chunk (its remaining tokens within the chunked-prefill budget).
  int64_t first_chunk(const Req& w) const;
  // Retracts a running request and puts it back into the waiting queue.
  void retract_to_waiting(Req& victim);
  // Finishes every waiting and running request with `reason` (shutdown).
  void abort_all(const FinishReason& reason);
  // Puts every running request back into the waiting queue, in its order, ahead of those waiting (their KV goes
  // to the prefix cache; a pause's retract mode). No step may be in flight.
  void retract_all();

  // Prefill / decode disaggregation. The device pages of the longest prefix of `tokens` cached here
  // (RadixCache::device_prefix; none while the cache is set aside after a failed step).
  std::vector<int32_t> device_prefix(std::span<const int32_t> tokens, std::string_view salt) const;
  // Caches tokens[0, n) (n: their length in whole pages) whose rows come from elsewhere: pages for the part not cached
  // yet are taken (evicting unlocked ones; as many as there are when not all can be had: the rows' first pages) and
  // `write(pages, first_token)` fills them before they enter the tree. The rows are there from token `from` on: when
  // less than that is cached here, nothing is written. Returns the tokens cached from the start afterwards (0 with
  // the cache off).
  int32_t import_prefix(std::span<const int32_t> tokens, std::string_view salt,
                        const std::function<void(std::span<const int32_t>, int32_t)>& write, int32_t from = 0);

  bool has_work() const { return !waiting_.empty() || num_running() > 0; }
  int32_t num_running() const {
    int32_t n = 0;
    for (const auto& r : running_) n += r->state != ReqState::Finished;
    return n;
  }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  const PagePool& pool() const { return pool_; }
  const RadixCache& cache() const { return cache_; }
  RankStats stats() const;
  void check_integrity() const;
  // Sampling state of a scheduled request (the engine samples with it).
  static SamplerState& sampler_of(Req& r) { return r.sampler; }

 private:
  bool ensure_pages(int32_t n, const Req* protect);
  bool take_pages(Req& r, int32_t upto_tokens, const Req* protect);
  void admit(Req& r);
  // Undoes admit() for a request that stays waiting (its cached prefix unlocked, no pages).
  void unadmit(Req& r);
  // KV tokens r may still take: free and evictable pages less `headroom` (the next step's decode pages, roughly),
  // and the room left in its own pages.
  int64_t available_tokens(const Req& r, int32_t headroom) const;
  void release(Req& r, bool cache_kv);
  void retract(Req& r);
  // After a prefill chunk ran: its whole pages go into the prefix cache at once (not only when the request ends), so
  // requests admitted later share them; pages another request cached meanwhile replace the request's own copies.
  void cache_prefill(Req& r, int32_t kv_end);
  // Into the waiting queue: by (priority, arrival) with priority scheduling, else at the back (or the front: a
  // retracted request goes first).
  void enqueue(std::unique_ptr<Req> r, bool front);
  void finish(Req& r, FinishReason reason, bool cache_kv = true);
  // Drops the prefix cache's contents and its untaken copies; false (nothing dropped) while a request holds a lock.
  bool empty_cache();
  void emit(Req& r);
  // A sampled token into the request's output (pending: it replaces the oldest token in flight, else it follows the
  // kept drafts), with its stop / length checks: finishes the request when it ends there.
  // `row`: the row that drew the token (its hidden state and routed experts, as the request asks), kept with it.
  void take_token(Req& r, const SampleResult& sr, bool pending, const RowOutputs& row = {});
  void build_batch(StepPlan& plan);
  // ForwardBatch::next_ids of the plan's batch (MTP drafts).
  void set_next_ids(StepPlan& plan) const;
  // First prompt position whose logit row the request still needs for its prompt logprobs (-1: none).
  static int32_t lp_first_row(const Req& r);
  // Plans `n` new tokens of a prefilling request (its prompt-logprob rows set from its position).
  ScheduledSeq prefill_seq(Req& r, int32_t n) const;

  SchedulerConfig cfg_;
  PagePool pool_;
  RadixCache cache_;
  std::deque<std::unique_ptr<Req>> waiting_;
  std::vector<std::unique_ptr<Req>> running_;  // admission order
  uint64_t admit_counter_ = 0;
  bool cache_suspect_ = false;  // a failed step carried the cache's copies (fail): no matches, nothing cached
  uint64_t arrival_counter_ = 0;
  RankStats counters_;
  uint64_t seed_counter_ = 0x5eed;
};

}  // namespace mlaserve
