// ParallelPlan: how this rank's weights are cut. Attention heads are split over the attention-TP group
// (attn_tp_size = tp_size / dp_size with DP attention, = tp_size otherwise); dense MLP, shared and routed
// experts (on the intermediate dimension), embedding and lm_head (on the vocabulary) over the whole TP group.
#pragma once

#include <cstdint>

namespace mlaserve {

struct ParallelPlan {
  int32_t tp_size = 1, tp_rank = 0;
  int32_t attn_tp_size = 1, attn_tp_rank = 0;
};

}  // namespace mlaserve
