// The routing of one token by one warp (moe_route's kernel and the fused router of gemv.cu): scores from the
// logits (softmax or sigmoid), the optional correction bias, group limiting, top-k with ties to the lower index,
// normalisation and scaling, in the CPU reference's order (cpu::route_token).
#pragma once

#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {

// Is (va, ia) ranked before (vb, ib)? Higher value first, lower index on ties (the CPU's partial_sort order).
__device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// A group's score from its experts' choice values c[0, per): the sum of the best two (noaux_tc) or the best.
__device__ __forceinline__ float group_score(const float* c, int per, RouteMethod method) {
  const float ninf = -INFINITY;
  if (method == RouteMethod::NoauxTc) {
    float b1 = ninf, b2 = ninf;
    for (int i = 0; i < per; ++i) {
      if (c[i] > b1) {
        b2 = b1;
        b1 = c[i];
      } else if (c[i] > b2) {
        b2 = c[i];
      }
    }
    return per >= 2 ? b1 + b2 : b1;
  }
  float g = ninf;
  for (int i = 0; i < per; ++i) g = fmaxf(g, c[i]);
  return g;
}

// lg: the token's E logits (read through L2: another block may have written them in this kernel); s: 3E floats of
// shared memory for this warp; ids / weights: the token's ids_per_token() outputs (its picks, then the fixed experts).
__device__ __forceinline__ void route_token_warp(const float* lg, const float* bias, int32_t E, const RouteArgs& a,
                                                 float* s, int32_t* ids, float* weights) {
  const int lane = threadIdx.x & 31;
  float* choice = s + E;
  float* taken = choice + E;
  const float ninf = -INFINITY;

  if (!a.sigmoid) {
    float m = ninf;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, __ldcg(lg + e));
    m = warp_max(m);
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) {
      const float v = expf(__ldcg(lg + e) - m);
      s[e] = v;
      sum += v;
    }
    sum = warp_sum(sum);
    const float inv = 1.0f / sum;
    for (int e = lane; e < E; e += 32) s[e] *= inv;
  } else {
    for (int e = lane; e < E; e += 32) s[e] = 1.0f / (1.0f + expf(-__ldcg(lg + e)));
  }
  for (int e = lane; e < E; e += 32) {
    choice[e] = s[e] + (bias ? bias[e] : 0.0f);
    taken[e] = 0.0f;
  }
  __syncwarp();

  if (a.method != RouteMethod::Greedy && a.n_group > 1) {
    const int per = E / a.n_group;
    float gscore = ninf;
    if (lane < a.n_group) gscore = group_score(choice + lane * per, per, a.method);
    // Rank of this lane's group: groups with a higher score, or an equal score and a lower index, come first.
    int rank = 0;
    for (int h = 0; h < a.n_group; ++h) {
      const float gh = __shfl_sync(0xffffffffu, gscore, h);
      if (lane < a.n_group && h != lane && ranks_before(gh, h, gscore, lane)) ++rank;
    }
    const bool keep_mine = lane < a.n_group && rank < a.topk_group;
    const unsigned keep_mask = __ballot_sync(0xffffffffu, keep_mine);
    __syncwarp();
    for (int e = lane; e < E; e += 32)
      if (!((keep_mask >> (e / per)) & 1u)) choice[e] = ninf;
    __syncwarp();
  }

  // Lane i keeps the i-th pick (top_k <= 32): ids and weights are written once, after the normalisation.
  int my_id = -1;
  float my_w = 0.0f;
  for (int i = 0; i < a.top_k; ++i) {
    float bv = 0.0f;
    int bi = -1;
    for (int e = lane; e < E; e += 32) {
      if (taken[e] != 0.0f) continue;
      if (bi < 0 || ranks_before(choice[e], e, bv, bi)) {
        bv = choice[e];
        bi = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi >= 0 && (bi < 0 || ranks_before(ov, oi, bv, bi))) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == i) {
      my_id = bi;
      my_w = s[bi];
    }
    if (lane == 0) taken[bi] = 1.0f;
    __syncwarp();
  }
  // The CPU sums the picked weights in pick order: lane 0 does the same from the lanes' values.
  float wsum = 0.0f;
  for (int i = 0; i < a.top_k; ++i) wsum += __shfl_sync(0xffffffffu, my_w, i);
  if (lane < a.top_k) {
    float w = my_w;
    if (a.norm_topk_prob) w /= wsum + 1e-20f;
    ids[lane] = my_id;
    weights[lane] = w * a.routed_scaling_factor;
  } else if (lane < a.ids_per_token()) {  // the fixed experts (fused shared experts)
    ids[lane] = a.fixed_base + lane - a.top_k;
    weights[lane] = 1.0f;
  }
}

// The same routing for tokens [0, T) with a whole block of at least E threads, thread e owning expert e: every rank
// is counted at once (no serial top-k). logits: row t at logits + t * ldl (read through L2); ids / weights:
// [T, ids_per_token()].
// The softmax sum may round differently from route_token_warp's in the last bit; the picks follow the same order.
// Tokens go one after another (measured on H200: one token takes about 1 us; a warp per token with each lane ranking
// its experts was slower, the loop over shared memory being latency-bound).
constexpr int kBlockRouteMax = 256;  // experts (and at least this many threads)
// SHARED: logits in this block's shared memory (else global memory, read through L2).
template <bool SHARED = false>
__device__ __forceinline__ void route_block(const float* logits, int64_t ldl, int T, const float* bias, int32_t E,
                                            const RouteArgs& a, int32_t* ids, float* weights) {
  __shared__ float red[32], choice_s[kBlockRouteMax], gscore_s[32], pick_w[32];
  __shared__ int32_t pick_id[32];
  const int e = threadIdx.x;
  const bool in = e < E;
  const float ninf = -INFINITY;
  for (int t = 0; t < T; ++t) {
    const float lg = !in ? ninf : SHARED ? logits[t * ldl + e] : __ldcg(logits + t * ldl + e);
    float s;
    if (!a.sigmoid) {
      const float m = block_max(lg, red);
      const float v = in ? expf(lg - m) : 0.0f;
      const float sum = block_sum(v, red);
      s = v * (1.0f / sum);
    } else {
      s = 1.0f / (1.0f + expf(-lg));
    }
    float c = in ? s + (bias ? bias[e] : 0.0f) : ninf;
    if (in) choice_s[e] = c;
    __syncthreads();
    if (a.method != RouteMethod::Greedy && a.n_group > 1) {
      const int per = E / a.n_group;
      if (e < a.n_group) gscore_s[e] = group_score(choice_s + e * per, per, a.method);
      __syncthreads();
      if (in) {
        const int g = e / per;
        int rank = 0;
        for (int h = 0; h < a.n_group; ++h) rank += h != g && ranks_before(gscore_s[h], h, gscore_s[g], g);
        if (rank >= a.topk_group) c = ninf;
      }
      __syncthreads();
      if (in) choice_s[e] = c;
      __syncthreads();
    }
    if (in) {
      int rank = 0;
      for (int j = 0; j < E; ++j) rank += j != e && ranks_before(choice_s[j], j, c, e);
      if (rank < a.top_k) {
        pick_id[rank] = e;
        pick_w[rank] = s;
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the warp kernel's normalisation: picked weights summed in pick order
      const int lane = threadIdx.x;
      const float my_w = lane < a.top_k ? pick_w[lane] : 0.0f;
      float wsum = 0.0f;
      for (int i = 0; i < a.top_k; ++i) wsum += __shfl_sync(0xffffffffu, my_w, i);
      if (lane < a.top_k) {
        float w = my_w;
        if (a.norm_topk_prob) w /= wsum + 1e-20f;
        ids[t * a.ids_per_token() + lane] = pick_id[lane];
        weights[t * a.ids_per_token() + lane] = w * a.routed_scaling_factor;
      } else if (lane < a.ids_per_token()) {
        ids[t * a.ids_per_token() + lane] = a.fixed_base + lane - a.top_k;
        weights[t * a.ids_per_token() + lane] = 1.0f;
      }
    }
    __syncthreads();
  }
}

}  // namespace mlaserve::cuda
