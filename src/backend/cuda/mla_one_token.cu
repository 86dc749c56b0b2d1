// MLA attention of one decode token in one launch (mla_one_token): the preparation (q's RoPE, the latent row
// normalised, rotated and written to the cache), q_lat = q_nope W_UK, the attention over the paged latent cache,
// the combine of its parts and out = o_lat W_UV^T, for every head, where the usual path runs three kernels (q_lat
// with the preparation, the decode, W_UV with the combine) joined by two grid-wide dependencies.
//
// One thread-block cluster of kCluster blocks per head; the dependencies inside a cluster are cluster barriers
// with the data passed through distributed shared memory (docs/cuda.md: the cheapest dependency measured). Block r:
//   - before the PDL wait: loads its slice of the head's W_UK (columns r * 64..) and W_UV (rows r * 16..) and the
//     cache rows of its keys that earlier steps wrote (an even split of the context: at most KT = 32 keys, so that
//     the blocks are small enough to start as the kernel before leaves SMs);
//   - computes its 64 q_lat columns and stores them into every block of the cluster (barrier);
//   - the scores and the softmax-weighted latent sums over its keys (the newest key's row made from the latent as
//     the cache holds it; the first cluster writes it to the cache);
//   - reads every block's partials (max, sum, 512 sums) from the cluster (barrier) and combines them into
//     o_lat (rounded to bf16, as the usual path stores it);
//   - its 16 rows of the head's out.
// An FP8 cache (MlaPrepArgs::cache_f8): the keys' codes become the bf16 of their values as they are loaded, and the
// newest row is made and written as the codes' values / codes (E4M3, or E5M2 with cache_e5m2), as the usual
// preparation does.
// Every cluster re-reads the context from L2, and each block holds its keys in shared memory: the kernel takes at
// most kOneTokenMaxCtx keys (longer contexts run the usual kernels, in CUDA graphs of their own:
// Backend::graph_variant).
// CPU reference: CpuBackend::mla_prepare_attention (mla_prepare then mla_attention).
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/prepare.cuh"

namespace mlaserve::cuda {
namespace {

constexpr int kC = kOneTokenCluster;
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int KVR = kOneTokenKvr, ROPE = kOneTokenRope, NOPE = kOneTokenNope, VH = kOneTokenVHead, W = KVR + ROPE;
constexpr int kCols = KVR / kC;  // q_lat columns per block
constexpr int kRows = VH / kC;   // out rows per block
static_assert(KVR % (8 * kC) == 0 && VH % kC == 0 && kThreads % kCols == 0 && NOPE % (kThreads / kCols) == 0);
static_assert(kThreads * 2 == KVR, "each thread owns two latent columns");
static_assert(kRows % kWarps == 0, "out rows split evenly over the warps");
constexpr int kTileKeys = kOneTokenMaxCtx / kC;  // keys a block holds at most
static_assert(kTileKeys <= kThreads, "a thread per key turns the scores into weights");

// KT: the most keys a block holds.
template <int KT>
struct Smem {
  bf16 uk[NOPE][kCols];
  bf16 uv[kRows][KVR];
  bf16 keys[KT][W];
  float qlat[KVR];  // the head's q_lat, bf16-rounded, gathered from the cluster
  float qpe[ROPE];
  float qnope[NOPE];
  float qlat_part[kThreads / kCols][kCols];
  float score[KT];
  float part_o[KVR];  // this block's sums over its keys, and their max / sum of weights
  float part_m, part_l;
  float olat[KVR];
};

// Hopper's opt-in limit per block, less latent_row's static reduction buffer.
static_assert(sizeof(Smem<kTileKeys>) + 32 * sizeof(float) <= 227 * 1024, "the slices and the keys fit one SM");

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Cache rows of keys [t0, t1) into s.keys, except the newest (ctx - 1: this step's, made from the latent). An FP8
// cache: 16 codes a thread, loaded at once and stored as the bf16 of their values (exact).
template <int KT>
__device__ __forceinline__ void load_keys(Smem<KT>& s, const MlaOneTokenArgs& a, int t0, int t1, int ctx) {
  if (a.prep.cache_f8) {
    static_assert(W % 16 == 0, "rows of whole 16-code chunks");
    constexpr int kChunks8 = W / 16;
    const CacheCodes codes = cache_codes(a.prep.cache_f8, a.prep.cache_e5m2);
    for (int u = threadIdx.x; u < (t1 - t0) * kChunks8; u += kThreads) {
      const int k = t0 + u / kChunks8, c = u % kChunks8;
      if (k == ctx - 1) continue;
      const int64_t slot = static_cast<int64_t>(a.page_table[k / a.page_size]) * a.page_size + k % a.page_size;
      const uint4 v = *reinterpret_cast<const uint4*>(a.prep.cache_f8 + slot * W + c * 16);
      uint32_t w[8];
      cache_codes4_bf16(v.x, w[0], w[1], codes);
      cache_codes4_bf16(v.y, w[2], w[3], codes);
      cache_codes4_bf16(v.z, w[4], w[5], codes);
      cache_codes4_bf16(v.w, w[6], w[7], codes);
      *reinterpret_cast<uint4*>(&s.keys[k - t0][c * 16]) = make_uint4(w[0], w[1], w[2], w[3]);
      *reinterpret_cast<uint4*>(&s.keys[k - t0][c * 16 + 8]) = make_uint4(w[4], w[5], w[6], w[7]);
    }
    return;
  }
  constexpr int kChunks = W / 8;
  for (int u = threadIdx.x; u < (t1 - t0) * kChunks; u += kThreads) {
    const int k = t0 + u / kChunks, c = u % kChunks;
    if (k == ctx - 1) continue;
    const int64_t slot = static_cast<int64_t>(a.page_table[k / a.page_size]) * a.page_size + k % a.page_size;
    cp_async16(&s.keys[k - t0][c * 8], a.prep.cache + slot * W + c * 8, true);
  }
}

template <int KT>
__global__ void __launch_bounds__(kThreads, 1) mla_one_token_kernel(const MlaOneTokenArgs a) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem<KT>& s = *reinterpret_cast<Smem<KT>*>(smem_raw);
  cluster_arrive_relaxed();  // this block runs
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t r = cluster_rank();
  const int h = static_cast<int>(blockIdx.x) / kC;  // the cluster's head
  const MlaPrepArgs& p = a.prep;
  // Metadata (positions, page table) was uploaded before the step; the weights and the cache rows of earlier steps
  // are not written by the kernel before this one: all loaded before the PDL wait.
  const int32_t pos = p.positions[0], ctx = pos + 1;
  const int per = (ctx + kC - 1) / kC;
  if (per > KT) __trap();  // the caller's bound broken: never read past shared memory
  const int k0 = min(ctx, static_cast<int>(r) * per), k1 = min(ctx, k0 + per);
  {
    const bf16* head = a.kv_b + static_cast<int64_t>(h) * (NOPE + VH) * KVR;
    for (int u = tid; u < NOPE * kCols / 8; u += kThreads) {
      const int i = u / (kCols / 8), c = u % (kCols / 8);
      cp_async16(&s.uk[i][c * 8], head + static_cast<int64_t>(i) * KVR + r * kCols + c * 8, true);
    }
    for (int u = tid; u < kRows * KVR / 8; u += kThreads) {
      const int v = u / (KVR / 8), c = u % (KVR / 8);
      cp_async16(&s.uv[v][c * 8], head + static_cast<int64_t>(NOPE + r * kRows + v) * KVR + c * 8, true);
    }
  }
  load_keys(s, a, k0, k1, ctx);
  cp_async_commit();
  pdl_wait();

  {  // q of the head: the nope part, and the rope part rotated as rope_q_pairs rounds it
    const bf16* qh = p.q + static_cast<int64_t>(h) * (NOPE + ROPE);
    if (tid < NOPE) s.qnope[tid] = __bfloat162float(qh[tid]);
    if (tid < ROPE / 2) {
      bf16 y0, y1;
      rotated_pair(__bfloat162float(qh[NOPE + 2 * tid]), __bfloat162float(qh[NOPE + 2 * tid + 1]), tid, pos,
                   p.inv_freq, p.factor, y0, y1);
      s.qpe[2 * tid] = __bfloat162float(y0);
      s.qpe[2 * tid + 1] = __bfloat162float(y1);
    }
  }
  const int n = k1 - k0;
  if (n > 0 && k1 == ctx) {  // the newest key: this step's latent row as the cache holds it (its read beside q's)
    bf16* row = s.keys[ctx - 1 - k0];
    const CacheCodes codes = cache_codes(p.cache_f8, p.cache_e5m2);
    latent_row(p.latent, row, KVR, ROPE, p.norm_w, p.eps, pos, p.inv_freq, p.factor, codes);
    __syncthreads();
    if (h == 0 && p.cache_f8) {  // as codes (exact: the row holds their values)
      uint8_t* dst = p.cache_f8 + static_cast<int64_t>(p.slots[0]) * W;
      for (int i = tid; i < W; i += kThreads) dst[i] = cache_code(__bfloat162float(row[i]), codes);
    } else if (h == 0) {
      bf16* dst = p.cache + static_cast<int64_t>(p.slots[0]) * W;
      for (int i = tid; i < W; i += kThreads) dst[i] = row[i];
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  probe_mark(4);  // probe builds: where each phase ends (tools/device/probe_phases.py)
  {  // this block's q_lat columns, in quarters of the nope rows
    constexpr int kParts = kThreads / kCols, kPartRows = NOPE / kParts;
    const int c = tid % kCols, part = tid / kCols;
    float acc = 0.0f;
#pragma unroll 8
    for (int i = part * kPartRows; i < (part + 1) * kPartRows; ++i)
      acc += s.qnope[i] * __bfloat162float(s.uk[i][c]);
    s.qlat_part[part][c] = acc;
  }
  __syncthreads();
  cluster_wait();  // every block of the cluster runs
  if (tid < kCols) {
    float v = 0.0f;
#pragma unroll
    for (int part = 0; part < kThreads / kCols; ++part) v += s.qlat_part[part][tid];
    v = bf16_round(v);
    for (uint32_t dst = 0; dst < kC; ++dst) *in_block(&s.qlat[r * kCols + tid], dst) = v;
  }
  cluster_sync();  // q_lat complete in every block
  probe_mark(5);

  // Attention over keys [k0, k1) (at most KT: the caller picks KT for the context), each key row read once.
  // Thread tid owns latent columns 2 tid, 2 tid + 1 of the weighted sums.
  for (int k = warp; k < n; k += kWarps) {
    const __nv_bfloat162* kr = reinterpret_cast<const __nv_bfloat162*>(s.keys[k]);
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < W / 64; ++i) {
      const int j = lane + 32 * i;  // pair j: columns 2j, 2j + 1
      const float2 f = __bfloat1622float2(kr[j]);
      const float* qv = 2 * j < KVR ? &s.qlat[2 * j] : &s.qpe[2 * j - KVR];
      acc = fmaf(f.x, qv[0], fmaf(f.y, qv[1], acc));
    }
    const float sc = warp_sum(acc);
    if (lane == 0) s.score[k] = sc * a.softmax_scale;
  }
  __syncthreads();
  float m = -INFINITY, l = 0.0f, o0 = 0.0f, o1 = 0.0f;
  for (int k = 0; k < n; ++k) m = fmaxf(m, s.score[k]);
  __syncthreads();  // every thread has the maximum before the scores become weights
  if (tid < n) s.score[tid] = expf(s.score[tid] - m);
  __syncthreads();
  for (int k = 0; k < n; ++k) {
    const float2 c = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(s.keys[k])[tid]);
    const float w = s.score[k];
    l += w;
    o0 = fmaf(w, c.x, o0);
    o1 = fmaf(w, c.y, o1);
  }
  s.part_o[2 * tid] = o0;
  s.part_o[2 * tid + 1] = o1;
  if (tid == 0) {
    s.part_m = m;
    s.part_l = l;
  }
  probe_mark(6);
  cluster_sync();  // every block's partial is complete
  probe_mark(7);

  {  // combine the cluster's partials (a block without keys: m = -inf, l = 0, weight 0)
    float mc[kC], lc[kC], M = -INFINITY;
    float2 oc[kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      mc[c] = *in_block(&s.part_m, c);
      lc[c] = *in_block(&s.part_l, c);
      oc[c] = *in_block(reinterpret_cast<float2*>(&s.part_o[2 * tid]), c);
    }
#pragma unroll
    for (int c = 0; c < kC; ++c) M = fmaxf(M, mc[c]);
    float L = 0.0f, x0 = 0.0f, x1 = 0.0f;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const float e = mc[c] == -INFINITY ? 0.0f : expf(mc[c] - M);
      L = fmaf(lc[c], e, L);
      x0 = fmaf(oc[c].x, e, x0);
      x1 = fmaf(oc[c].y, e, x1);
    }
    s.olat[2 * tid] = bf16_round(x0 / L);
    s.olat[2 * tid + 1] = bf16_round(x1 / L);
  }
  cluster_arrive();  // done reading the other blocks
  pdl_trigger();
  __syncthreads();
  // out rows r * kRows.. of the head: o_lat W_UV^T
#pragma unroll
  for (int i = 0; i < kRows / kWarps; ++i) {
    const int row = warp * (kRows / kWarps) + i;
    const __nv_bfloat162* u = reinterpret_cast<const __nv_bfloat162*>(s.uv[row]);
    float acc = 0.0f;
#pragma unroll
    for (int j = lane; j < KVR / 2; j += 32) {
      const float2 f = __bfloat1622float2(u[j]);
      acc = fmaf(f.x, s.olat[2 * j], fmaf(f.y, s.olat[2 * j + 1], acc));
    }
    acc = warp_sum(acc);
    if (lane == 0) a.out[static_cast<int64_t>(h) * VH + r * kRows + row] = __float2bfloat16_rn(acc);
  }
  probe_mark(8);
  cluster_wait();  // no block leaves while others read its memory
}

constexpr auto kKernel = mla_one_token_kernel<kTileKeys>;
constexpr size_t kSmemBytes = sizeof(Smem<kTileKeys>);
std::atomic<uint64_t> g_smem_configured{0};  // devices whose shared-memory limit is set for the kernel

cudaError_t configure() { return set_max_dynamic_smem_once(kKernel, static_cast<int>(kSmemBytes), g_smem_configured); }

}  // namespace

cudaError_t mla_one_token_max_clusters(int32_t* clusters) {
  *clusters = 0;
  cudaError_t e = configure();
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kC * 256);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim = {static_cast<unsigned>(kC), 1, 1};
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  e = cudaOccupancyMaxActiveClusters(&n, kKernel, &cfg);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  *clusters = n;
  return cudaSuccess;
}

bool mla_one_token_fits(int32_t nh, int32_t nope, int32_t rope, int32_t v_head, int32_t kvr, int32_t max_clusters) {
  return nope == NOPE && rope == ROPE && v_head == VH && kvr == KVR && nh >= 1 && nh <= max_clusters;
}

cudaError_t mla_one_token(const MlaOneTokenArgs& a, int32_t nh, cudaStream_t stream) {
  const cudaError_t e = configure();
  if (e != cudaSuccess) return e;
  return launch_clustered(kC, kKernel, dim3(nh * kC), dim3(kThreads), kSmemBytes, stream, a);
}

}  // namespace mlaserve::cuda
