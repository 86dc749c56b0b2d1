// ForwardBatch: the per-step batch description, built once on the host before layer 0 and handed to the
// backend (which uploads it once). It is a ragged batch of sequences; each contributes either a chunk of
// prefill tokens (possibly continuing a prefix already in the paged latent cache) or one decode token.
// A batch with no tokens is an IDLE step (DP attention: the rank still joins every collective).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mlaserve {

enum class ForwardMode : uint8_t { Idle, Extend, Decode, Mixed };
const char* forward_mode_name(ForwardMode m);

// Which MLA form the attention uses. Auto: expanded for steps that carry prefill, absorbed for pure decode.
enum class MlaForm : uint8_t { Auto, Expanded, Absorbed };

// The longest chain of MTP drafts a step may ask for (ForwardBatch::mtp_chain).
inline constexpr int32_t kMaxMtpChain = 8;

struct ForwardBatch {
  ForwardMode mode = ForwardMode::Idle;
  int32_t page_size = 0;
  int32_t max_pages = 0;  // columns of page_table

  // Per token, [num_tokens]. An id -(k + 1) is not known on the host yet: it is the id sampled for logit row k of
  // this DP group's previous step, which stayed on the device (overlap scheduling; DeepseekModel::set_prev_ids).
  std::vector<int32_t> input_ids;
  std::vector<int32_t> positions;   // absolute position in its sequence
  std::vector<int32_t> token_seq;   // index of the sequence the token belongs to
  std::vector<int32_t> out_slots;   // latent-cache slot written by the token: page * page_size + offset

  // Per sequence, [num_seqs] (seq_q_start has num_seqs + 1 entries: cu_seqlens of the new tokens)
  std::vector<int32_t> seq_q_start;
  std::vector<int32_t> seq_prefix_lens;  // tokens already cached before this step
  std::vector<int32_t> seq_lens;         // prefix + new tokens: the context attended to by the last token
  std::vector<int32_t> page_table;       // [num_seqs, max_pages], row-major, unused entries -1

  // Token rows whose logits are returned, in output order.
  std::vector<int32_t> logit_rows;
  // Token rows whose final hidden state (DeepseekModel::last_hidden) the step brings to the host, in that order
  // (SamplingParams::return_hidden_states); empty: none.
  std::vector<int32_t> hidden_rows;
  // Whether the hidden_rows' final hidden states come back (false: only what else is captured for them, their routed
  // experts: no request of the step returns hidden states).
  bool hidden_states = true;
  // Per sequence (empty: none): 1 when its new tokens attend in the absorbed MLA form however many they are (a decode
  // token and its drafts: a few tokens after a long cached context), as one new token always does under Auto.
  std::vector<int32_t> seq_absorbed;
  // Per token (empty: none), for the MTP layer (DeepseekModel::forward_draft): the token after it in its sequence,
  // -(k + 1) for the id this step samples for logit row k (negative here names this step's samples, not the previous
  // step's). Padding tokens have 0.
  std::vector<int32_t> next_ids;
  // MTP drafts chained after each sequence's last kept token (DeepseekModel::forward_draft_chain): 2 or more makes
  // the rank set run the MTP layer again mtp_chain - 1 times after forward_draft (0 or 1: forward_draft's one draft
  // per logit row). A sequence chains as far as its page table has room: up to its last new token's position +
  // mtp_chain - 1.
  int32_t mtp_chain = 0;
  // Per sequence (empty: none): how many of its new tokens, at the end, are drafts this step checks.
  std::vector<int32_t> seq_drafts;
  // Pairs (first row, rows) naming the rows of the step's MoE input that are real tokens (empty: every row): a batch
  // padded for a graph has its real rows only, and with DP attention each group's within the gathered rows (blocks of
  // DpStepInfo::num_tokens[g] rows in group order). Only the counting of routed experts reads them
  // (Backend::count_experts); a graph reads them on the device, so their number stays with the graph's size.
  std::vector<int32_t> moe_rows;
  // The hierarchical cache's copies (RadixCache::Copies), carried out before the forward on every rank of the group:
  // pairs (device page, host slot) to the host, then pairs (host slot, device page) back to the device.
  std::vector<int32_t> kv_saves, kv_loads;

  int32_t num_tokens() const { return static_cast<int32_t>(input_ids.size()); }
  int32_t num_seqs() const { return static_cast<int32_t>(seq_lens.size()); }
  bool has_prefill() const { return mode == ForwardMode::Extend || mode == ForwardMode::Mixed; }
  // Whether sequence s attends in the absorbed form under MlaForm::Auto.
  bool absorbed_under_auto(int32_t s) const {
    return seq_q_start[s + 1] - seq_q_start[s] == 1 || (!seq_absorbed.empty() && seq_absorbed[s] != 0);
  }
};

// True when every sequence's new tokens attend in the absorbed form under MlaForm::Auto (one new token, or a decode
// token and its drafts) and every token is a logit row, in order: the steps CUDA graphs replay.
bool is_graph_batch(const ForwardBatch& b);
// Whether every sequence of `b` attends in the absorbed form under MlaForm::Auto.
bool all_absorbed_under_auto(const ForwardBatch& b);
// Pads a graph batch (or an empty one: an idle DP group) to `tokens` tokens with sequences of one token each. The
// added sequences are token 0 at position 0 reading and writing only page `dummy_page` (a page no request owns);
// their logit rows follow the real ones, so rows [0, real) of the logits are the real ones. Its moe_rows are
// {0, real}.
ForwardBatch pad_decode_batch(const ForwardBatch& b, int32_t tokens, int32_t dummy_page, int32_t page_size);

// One decode token at position context - 1 whose every page is `dummy_page` (the page no request owns): a step of
// that context for recording its graph; its keys are whatever the dummy page holds.
ForwardBatch dummy_decode_row(int32_t context, int32_t dummy_page, int32_t page_size);

// Byte serialisation, for sending a step to the ranks of other nodes.
void serialize(const ForwardBatch& b, std::string& out);
ForwardBatch deserialize_forward_batch(const char*& p, const char* end);

// Builds a ForwardBatch sequence by sequence.
class ForwardBatchBuilder {
 public:
  explicit ForwardBatchBuilder(int32_t page_size);
  enum class Logits : uint8_t { None, Last, All };
  // Adds a sequence whose first `prefix_len` tokens are already cached; `new_tokens` follow them.
  // `pages` must cover prefix_len + new_tokens.size() positions. `logits` picks which new tokens' logits
  // are returned (none: a prefill chunk that is not the prompt's last).
  void add(std::span<const int32_t> new_tokens, int32_t prefix_len, std::span<const int32_t> pages, Logits logits);
  // The same, returning the logits of new tokens [first_logit, new_tokens.size()) (a prompt chunk whose prompt
  // logprobs are asked for; first_logit == new_tokens.size(): none).
  // `room`: positions after the new tokens whose pages the page table keeps too (where `pages` has them).
  void add_logits_from(std::span<const int32_t> new_tokens, int32_t prefix_len, std::span<const int32_t> pages,
                       int32_t first_logit, int32_t room = 0);
  void add(std::span<const int32_t> new_tokens, int32_t prefix_len, std::span<const int32_t> pages, bool all_logits) {
    add(new_tokens, prefix_len, pages, all_logits ? Logits::All : Logits::Last);
  }
  // The sequence added last attends in the absorbed form (ForwardBatch::seq_absorbed); its last `drafts` new tokens
  // are drafts (ForwardBatch::seq_drafts).
  void absorb_last(int32_t drafts = 0);
  // Every new token of the sequence added last is a hidden row (ForwardBatch::hidden_rows).
  void hidden_of_last();
  ForwardBatch finish();

 private:
  ForwardBatch b_;
  std::vector<std::vector<int32_t>> pages_;
  bool any_prefill_ = false, any_decode_ = false;
};

}  // namespace mlaserve
