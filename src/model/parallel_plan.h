// ParallelPlan: how this rank's weights are cut and which collectives it joins.
//  - tp_size ranks in all (the "world" of one model replica); dense MLP, shared and routed experts are split on
//    the intermediate dimension over all of them (all-reduce over the world). With expert_parallel the routed
//    experts are split by expert instead: rank r holds experts [r * E / tp_size, (r + 1) * E / tp_size) whole
//    (vLLM's --enable-expert-parallel, SGLang's --ep-size; the same all-reduce sums every rank's experts' share).
//  - Attention heads, embedding and lm_head (vocabulary) are split over the attention-TP group of
//    attn_tp_size = tp_size / dp_size ranks (all-reduce / all-gather over that group).
//  - dp_size > 1 is DP attention: dp_size groups each run attention on their own tokens; before every MLP the
//    groups' hidden states are gathered over the world and each group keeps its own rows after.
#pragma once

#include <cstdint>
#include <vector>

namespace mlaserve {

struct ParallelPlan {
  int32_t tp_size = 1, tp_rank = 0;
  int32_t attn_tp_size = 1, attn_tp_rank = 0;
  int32_t dp_size = 1, dp_rank = 0;  // attention data parallelism (1: off)
  bool expert_parallel = false;      // routed experts split by expert over the world, not by their width

  // Rank `rank` of `tp` ranks with `dp` attention-DP groups (contiguous groups of tp / dp ranks).
  static ParallelPlan make(int32_t tp, int32_t dp, int32_t rank) {
    ParallelPlan p;
    p.tp_size = tp;
    p.tp_rank = rank;
    p.dp_size = dp;
    p.attn_tp_size = tp / dp;
    p.attn_tp_rank = rank % p.attn_tp_size;
    p.dp_rank = rank / p.attn_tp_size;
    return p;
  }
};

// Per step, with DP attention: how many tokens every DP group runs (all ranks agree on it).
struct DpStepInfo {
  std::vector<int32_t> num_tokens;  // [dp_size]
};

}  // namespace mlaserve
