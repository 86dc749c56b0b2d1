// Per-request sampling state and the host-side helpers around Backend::sample (which draws the tokens on the
// device: penalties, temperature, top-k / top-p / min-p, counter-based noise keyed on (seed, step, token), so every
// backend draws the same token). Here: the request's RNG key and token counts, the RowSampling built from them,
// and top-N logprobs computed on the host for the rare requests that ask for them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "engine/engine_api.h"

namespace mlaserve {

struct SampleResult {
  int32_t token = -1;
  TokenLogprob logprob;  // filled when the request asks for logprobs
  // With the MTP layer: its greedy tokens after `token` (the next step's drafts; one, or a chain where the step
  // chains from this row).
  std::vector<int32_t> drafts;
};

struct SamplerState {
  std::unordered_map<int32_t, int32_t> output_counts;  // generated token -> count (penalties)
  uint64_t seed = 0;
  uint64_t step = 0;  // tokens drawn so far
  void observe_output(int32_t id) { ++output_counts[id]; }
  // The device sampler's parameters for this request's next token.
  RowSampling row(const SamplingParams& p) const;
};

// Whether any penalty is on (the sampler then needs the request's generated tokens).
inline bool penalised(const SamplingParams& p) {
  return p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f || p.repetition_penalty != 1.0f;
}

// Whether the request's next draw depends on its previous token's value on the host (its constraint's state, or
// the end of its output for a bad word of two or more tokens): under overlap scheduling such a step waits for it.
bool needs_previous_token(const SamplingParams& p);
// The token's logit becomes -inf in this draw (its logit_bias entry, or a new one).
void ban_token(RowSampling& row, int32_t id);
// vLLM's bad words: the last token of every sequence in p.bad_words_ids whose other tokens end `output` is banned.
void ban_bad_words(const SamplingParams& p, std::span<const int32_t> output, RowSampling& row);
// The bit mask (bit t % 32 of word t / 32) of these ids (non-negative).
std::shared_ptr<const std::vector<uint32_t>> token_mask(std::span<const int32_t> ids);
inline bool mask_has(const std::vector<uint32_t>& mask, int32_t id) {
  const size_t w = static_cast<size_t>(id / 32);
  return id >= 0 && w < mask.size() && (mask[w] >> (id % 32) & 1u);
}
// Only the tokens of `mask` stay allowed in this draw (with row.allowed already set: those of both).
void restrict_to(RowSampling& row, const std::shared_ptr<const std::vector<uint32_t>>& mask);

// Index of the largest value (the lowest index among ties).
int32_t argmax_row(const float* x, int64_t n);
// The n most likely tokens of log_softmax(x), best first (ties: lower id first), the logprob and rank of `token`, and
// the logprobs of `ids` (in their order; ids in [0, vocab)).
TokenLogprob top_logprobs(const float* x, int64_t vocab, int32_t token, int32_t n, std::span<const int32_t> ids = {});

}  // namespace mlaserve
