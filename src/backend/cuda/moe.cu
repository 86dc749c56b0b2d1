// MoE routing (greedy, group-limited greedy, noaux_tc), grouping of the assignments by expert, and the weighted
// combine. CPU references: cpu::route_token and cpu::moe_experts.
#include <algorithm>
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/route.cuh"

namespace mlaserve::cuda {

namespace {

constexpr int kRouteWarps = 4;

// One warp per token. Shared memory per warp: s[E], choice[E], taken[E].
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(const float* logits, const float* bias,
                                                                    int64_t T, int32_t E, RouteArgs a, int32_t* ids,
                                                                    float* weights) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ float route_smem[];
  const int warp = threadIdx.x >> 5;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (t >= T) return;
  route_token_warp(logits + t * E, bias, E, a, route_smem + static_cast<int64_t>(warp) * 3 * E,
                   ids + t * a.ids_per_token(), weights + t * a.ids_per_token());
}

// Counts the assignments [i0, i1) per local expert into cnt (shared memory, zeroed).
__device__ void count_assignments(const int32_t* ids, int64_t i0, int64_t i1, int32_t E, int32_t expert_begin,
                                  int32_t* cnt) {
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const int e = ids[i] - expert_begin;
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
}

// Thread 0 of a grouping block: expert e's positions start after the earlier experts' (added to cursor[e]); with
// `write` also expert_end, expert_counts and the tiles.
__device__ void expert_starts(const int32_t* count, int32_t E, int32_t block_m, bool write, int32_t* cursor,
                              const MoeGroupOut& out) {
  int32_t off = 0, n_tiles = 0;
  for (int e = 0; e < E; ++e) {
    cursor[e] += off;
    if (write) {
      for (int m = 0; m < count[e]; m += block_m) out.tiles[n_tiles++] = (e << 20) | (off + m);
      out.expert_end[e] = off + count[e];
      out.expert_counts[e] = count[e];
    }
    off += count[e];
  }
  if (write) out.num_tiles[0] = n_tiles;
}

// The block's assignments [i0, i1) at the positions its cursors give (in any order within an expert).
__device__ void place_assignments(const int32_t* ids, const float* weights, int64_t i0, int64_t i1, int32_t k,
                                  int32_t E, int32_t expert_begin, int32_t* cursor, const MoeGroupOut& out) {
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const int e = ids[i] - expert_begin;
    if (e >= 0 && e < E) {
      const int pos = atomicAdd(&cursor[e], 1);
      out.pos_row[pos] = static_cast<int32_t>(i / k);
      out.pos_weight[pos] = weights[i];
      out.assign_pos[i] = pos;
    } else {
      out.assign_pos[i] = -1;
    }
  }
}

constexpr int kGroupThreads = 1024;

__global__ void __launch_bounds__(kGroupThreads) moe_group_kernel(const int32_t* ids, const float* weights,
                                                                  int64_t n_assign, int32_t k, int32_t E,
                                                                  int32_t expert_begin, int32_t block_m,
                                                                  MoeGroupOut out) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ int32_t grp_smem[];
  int32_t* cnt = grp_smem;        // [E]
  int32_t* cursor = cnt + E;      // [E]
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = cursor[e] = 0;
  __syncthreads();
  count_assignments(ids, 0, n_assign, E, expert_begin, cnt);
  __syncthreads();
  if (threadIdx.x == 0) expert_starts(cnt, E, block_m, true, cursor, out);
  __syncthreads();
  place_assignments(ids, weights, 0, n_assign, k, E, expert_begin, cursor, out);
}

// Many assignments (prefill): the grouping over many blocks in two launches, `chunk` assignments per block (at least
// kGroupChunk, at most kGroupMaxBlocks blocks: each block reads every block's counts).
constexpr int kGroupChunk = 1024, kGroupChunkThreads = 256, kGroupMaxBlocks = 256;
constexpr int64_t kGroupManyAssignments = 8192;

int64_t group_blocks(int64_t n_assign) {
  return std::min<int64_t>((n_assign + kGroupChunk - 1) / kGroupChunk, kGroupMaxBlocks);
}

// Pass 1: each block's count of its chunk's assignments per local expert, into hist[block][E].
__global__ void __launch_bounds__(kGroupChunkThreads) moe_group_count_kernel(const int32_t* ids, int64_t n_assign,
                                                                             int64_t chunk, int32_t E,
                                                                             int32_t expert_begin, int32_t* hist) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ int32_t grp_smem[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) grp_smem[e] = 0;
  __syncthreads();
  count_assignments(ids, blockIdx.x * chunk, min(n_assign, (blockIdx.x + 1) * chunk), E, expert_begin, grp_smem);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[static_cast<int64_t>(blockIdx.x) * E + e] = grp_smem[e];
}

// Pass 2: a block's positions of expert e follow every earlier expert's and the earlier blocks' of e; block 0 writes
// the per-expert outputs and the tiles as moe_group_kernel does.
__global__ void __launch_bounds__(kGroupChunkThreads) moe_group_place_kernel(const int32_t* ids, const float* weights,
                                                                             int64_t n_assign, int64_t chunk,
                                                                             int32_t k, int32_t E,
                                                                             int32_t expert_begin, int32_t block_m,
                                                                             const int32_t* hist, MoeGroupOut out) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ int32_t grp_smem[];
  int32_t* total = grp_smem;   // [E]
  int32_t* cursor = total + E;  // [E]
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t all = 0, before = 0;
    for (int b = 0; b < static_cast<int>(gridDim.x); ++b) {
      const int32_t c = hist[static_cast<int64_t>(b) * E + e];
      before += b < static_cast<int>(blockIdx.x) ? c : 0;
      all += c;
    }
    total[e] = all;
    cursor[e] = before;
  }
  __syncthreads();
  if (threadIdx.x == 0) expert_starts(total, E, block_m, blockIdx.x == 0, cursor, out);
  __syncthreads();
  place_assignments(ids, weights, blockIdx.x * chunk, min(n_assign, (blockIdx.x + 1) * chunk), k, E, expert_begin,
                    cursor, out);
}

// bf16(bf16(sum) + add): the routed experts' sum rounded, then the shared experts' output added (as two bf16 ops).
__device__ __forceinline__ float plus_shared(float acc, const bf16* add, int64_t i) {
  return add ? __bfloat162float(__float2bfloat16_rn(acc)) + __bfloat162float(add[i]) : acc;
}

__global__ void moe_combine_kernel(const float* y, const int32_t* assign_pos, int32_t k, int64_t H, const bf16* add,
                                   bf16* out) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const int32_t* ap = assign_pos + t * k;
  bf16* o = out + t * H;
  const bf16* a = add ? add + t * H : nullptr;
  if ((H & 3) == 0) {
    for (int64_t i = threadIdx.x; i < H / 4; i += blockDim.x) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int j = 0; j < k; ++j) {
        const int32_t pos = ap[j];
        if (pos < 0) continue;
        const float4 v = reinterpret_cast<const float4*>(y + static_cast<int64_t>(pos) * H)[i];
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
      reinterpret_cast<uint32_t*>(o)[2 * i] =
          pack_bf16x2(plus_shared(acc.x, a, 4 * i), plus_shared(acc.y, a, 4 * i + 1));
      reinterpret_cast<uint32_t*>(o)[2 * i + 1] =
          pack_bf16x2(plus_shared(acc.z, a, 4 * i + 2), plus_shared(acc.w, a, 4 * i + 3));
    }
  } else {
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j)
        if (ap[j] >= 0) acc += y[static_cast<int64_t>(ap[j]) * H + i];
      o[i] = __float2bfloat16_rn(plus_shared(acc, a, i));
    }
  }
}

// VEC: eight columns per thread with 16-byte loads (H % 8 == 0, 16-byte aligned rows); the same sums.
template <bool VEC>
__global__ void moe_combine_bf16_kernel(const bf16* y, const float* pos_weight, const int32_t* assign_pos, int32_t k,
                                        int64_t H, const bf16* add, bf16* out) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const int32_t* ap = assign_pos + t * k;
  bf16* o = out + t * H;
  const bf16* a = add ? add + t * H : nullptr;
  for (int64_t i = threadIdx.x; i < (VEC ? H / 8 : H); i += blockDim.x) {
    if constexpr (VEC) {
      float acc[8] = {}, v[8];
      for (int j = 0; j < k; ++j) {
        const int32_t pos = ap[j];
        if (pos < 0) continue;
        const float w = pos_weight[pos];
        unpack8(reinterpret_cast<const uint4*>(y + static_cast<int64_t>(pos) * H)[i], v);
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] += w * v[c];
      }
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] = plus_shared(acc[c], a, 8 * i + c);
      reinterpret_cast<uint4*>(o)[i] = pack8(acc);
    } else {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j) {
        const int32_t pos = ap[j];
        if (pos >= 0) acc += pos_weight[pos] * __bfloat162float(y[static_cast<int64_t>(pos) * H + i]);
      }
      o[i] = __float2bfloat16_rn(plus_shared(acc, a, i));
    }
  }
}

__global__ void moe_gather_x_kernel(const bf16* x, int64_t H, const int32_t* pos_row, const int32_t* expert_end,
                                    int32_t E, bf16* xs) {
  pdl_wait();
  pdl_trigger();
  const int64_t p = blockIdx.x;
  if (p >= expert_end[E - 1]) return;
  const bf16* src = x + static_cast<int64_t>(pos_row[p]) * H;
  bf16* dst = xs + p * H;
  if ((H & 7) == 0) {
    for (int64_t i = threadIdx.x; i < H / 8; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace

cudaError_t moe_route(const float* logits, const float* bias, int64_t T, int32_t E, const RouteArgs& a, int32_t* ids,
                      float* weights, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  if (E > 1024 || a.top_k > E || a.ids_per_token() > 32 || a.n_fixed < 0 ||
      (a.n_group > 1 && (a.n_group > 32 || E % a.n_group != 0)))
    return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * 3 * E * kRouteWarps;
  const unsigned blocks = static_cast<unsigned>((T + kRouteWarps - 1) / kRouteWarps);
  return launch(moe_route_kernel, blocks, kRouteWarps * 32, smem, stream, logits, bias, T, E, a, ids, weights);
}

int32_t moe_max_tiles(int64_t T, int32_t k, int32_t E, int32_t block_m) {
  return static_cast<int32_t>((T * k + block_m - 1) / block_m + E);
}

int32_t moe_block_m(int64_t assignments, int32_t E) { return assignments > 96LL * E ? 128 : 64; }

int64_t moe_group_hist_ints(int64_t T, int32_t k, int32_t E) {
  const int64_t n = T * k;
  return n >= kGroupManyAssignments ? group_blocks(n) * E : 0;
}

cudaError_t moe_group(const int32_t* ids, const float* weights, int64_t T, int32_t k, int32_t E, int32_t expert_begin,
                      int32_t block_m, const MoeGroupOut& out, cudaStream_t stream) {
  if (E > 2047 || T * k >= (1 << 20)) return cudaErrorInvalidValue;
  const size_t smem = sizeof(int32_t) * 2 * E;
  const int64_t n = T * k;
  if (moe_group_hist_ints(T, k, E) > 0 && out.hist) {
    const int64_t blocks = group_blocks(n), chunk = (n + blocks - 1) / blocks;
    if (cudaError_t e = launch(moe_group_count_kernel, static_cast<unsigned>(blocks), kGroupChunkThreads, smem / 2,
                               stream, ids, n, chunk, E, expert_begin, out.hist);
        e != cudaSuccess)
      return e;
    return launch(moe_group_place_kernel, static_cast<unsigned>(blocks), kGroupChunkThreads, smem, stream, ids,
                  weights, n, chunk, k, E, expert_begin, block_m, static_cast<const int32_t*>(out.hist), out);
  }
  return launch(moe_group_kernel, 1, kGroupThreads, smem, stream, ids, weights, n, k, E, expert_begin, block_m, out);
}

cudaError_t moe_combine(const float* y, const int32_t* assign_pos, int64_t T, int32_t k, int64_t H, bf16* out,
                        cudaStream_t stream, const bf16* add) {
  if (T == 0) return cudaSuccess;
  return launch(moe_combine_kernel, static_cast<unsigned>(T), 256, 0, stream, y, assign_pos, k, H, add, out);
}

cudaError_t moe_combine_bf16(const bf16* y, const float* pos_weight, const int32_t* assign_pos, int64_t T, int32_t k,
                             int64_t H, bf16* out, cudaStream_t stream, const bf16* add) {
  if (T == 0) return cudaSuccess;
  if (H % 8 == 0 && aligned16(y) && aligned16(out) && (!add || aligned16(add)))
    return launch(moe_combine_bf16_kernel<true>, static_cast<unsigned>(T), 256, 0, stream, y, pos_weight, assign_pos,
                  k, H, add, out);
  return launch(moe_combine_bf16_kernel<false>, static_cast<unsigned>(T), 256, 0, stream, y, pos_weight, assign_pos, k,
                H, add, out);
}

cudaError_t moe_gather_x(const bf16* x, int64_t H, const int32_t* pos_row, const int32_t* expert_end, int32_t E,
                         int64_t max_p, bf16* xs, cudaStream_t stream) {
  if (max_p == 0) return cudaSuccess;
  return launch(moe_gather_x_kernel, static_cast<unsigned>(max_p), 128, 0, stream, x, H, pos_row, expert_end, E, xs);
}

}  // namespace mlaserve::cuda
