// Offline generation without a scheduler: runs a fixed set of prompts through the model, prefill (optionally in
// chunks) then greedy decode one token at a time through the paged latent cache. Used by `mlaserve generate`,
// `mlaserve eval-logits` and the model tests. With several attention-DP groups (RankSet), prompts are spread
// round-robin over the groups and all groups step together (a group with nothing left runs IDLE).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "engine/page_pool.h"
#include "engine/rank_set.h"
#include "model/deepseek_model.h"

namespace mlaserve {

struct OfflineOptions {
  int32_t max_new_tokens = 0;
  bool prompt_logits = true;    // return logits at every prompt position
  int32_t prefill_chunk = 0;    // > 0: prefill each prompt in chunks of this many tokens (one step per chunk)
  MlaForm form = MlaForm::Auto;
  int32_t page_size = 16;
  std::optional<DType> kv_cache_fp8;  // one model on one backend: an FP8 latent cache's type (RankSet: ParallelConfig)
  std::vector<int64_t> stop_ids;  // greedy generation of a sequence stops after one of these (empty: never)
  // Teacher forcing: per prompt (all or none), the tokens its decode steps take in turn instead of its greedy picks
  // (at least max_new_tokens - 1 of them; `greedy` still reports the picks). The model tests compare each step's
  // logits with a reference's along the reference's own tokens.
  std::vector<std::vector<int32_t>> forced;
  bool decode_logits = false;  // keep each decode step's logits (OfflineResult::decode_logits)
};

struct OfflineResult {
  std::vector<Tensor> prompt_logits;          // per prompt: F32 [len, vocab] (or [1, vocab]: last position only)
  std::vector<std::vector<int32_t>> greedy;   // per prompt: generated ids
  std::vector<Tensor> decode_logits;          // with decode_logits, per prompt: F32 [decode steps, vocab]
};

// One model on one backend.
OfflineResult run_offline(DeepseekModel& model, const std::vector<std::vector<int32_t>>& prompts,
                          const OfflineOptions& opts);
// Every rank of a parallel layout (allocates the ranks' KV caches).
OfflineResult run_offline(RankSet& ranks, const std::vector<std::vector<int32_t>>& prompts, const OfflineOptions& opts);

}  // namespace mlaserve
