// Sampling one token from one row of logits (host memory), with the request's parameters. The result depends
// only on the row, the parameters, the request's token history and (seed, step): never on the batch.
// Order (as SGLang / vLLM): repetition penalty (prompt + output tokens), frequency and presence penalties
// (output tokens), then temperature 0 -> argmax, else temperature, top-k, top-p, min-p and a draw.
// Logprobs are of the model's distribution (log_softmax of the raw logits).
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "engine/engine_api.h"

namespace mlaserve {

struct SampleResult {
  int32_t token = -1;
  TokenLogprob logprob;  // filled when asked
};

struct SamplerState {
  // Counts of each generated token so far (frequency / presence penalties).
  std::unordered_map<int32_t, int32_t> output_counts;
  // Tokens of prompt + output (repetition penalty); kept as a set-like map.
  std::unordered_map<int32_t, int32_t> seen;
  uint64_t seed = 0;
  uint64_t step = 0;  // draws so far
  void observe_prompt(std::span<const int32_t> ids);
  void observe_output(int32_t id);
};

// Index of the largest value (the lowest index among ties).
int32_t argmax_row(const float* x, int64_t n);

// `scratch` is reused across calls to avoid allocations.
SampleResult sample_row(const float* logits, int64_t vocab, const SamplingParams& p, SamplerState& state,
                        std::vector<float>& scratch);

}  // namespace mlaserve
