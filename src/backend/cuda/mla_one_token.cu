// MLA attention of one decode token in one launch (mla_one_token): the preparation (q's RoPE, the latent row
// normalised, rotated and written to the cache), q_lat = q_nope W_UK, the attention over the paged latent cache,
// the combine of its parts and out = o_lat W_UV^T, for every head, where the usual path runs three kernels (q_lat
// with the preparation, the decode, W_UV with the combine) joined by two grid-wide dependencies.
//
// One thread-block cluster of kCluster blocks per head; the dependencies inside a head are cluster barriers with
// the data passed through distributed shared memory (docs/cuda.md: the cheapest dependency measured). Block r of
// head h:
//   - before the PDL wait: loads its slice of W_UK[h] (columns r * 64..), of W_UV[h] (rows r * 16..) and the cache
//     rows of its keys that earlier steps wrote (an even split of the context: at most kTileKeys);
//   - computes its 64 q_lat columns and stores them into every block of the cluster (barrier);
//   - the scores and the softmax-weighted latent sum over its keys (the newest key's row made from the latent as
//     the cache holds it; cluster 0 writes it to the cache);
//   - reads every block's partial (max, sum, 512 sums) from the cluster (barrier) and combines them into o_lat
//     (rounded to bf16, as the usual path stores it);
//   - its 16 rows of out.
// Every block re-reads the context of its head from L2, and holds its keys in shared memory: the kernel takes at most
// kOneTokenMaxCtx keys (longer contexts run the usual kernels, in a CUDA graph of their own: graph_variant).
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
constexpr int kTileKeys = kOneTokenMaxCtx / kC;
static_assert(KVR % (8 * kC) == 0 && VH % kC == 0 && kThreads % kCols == 0 && NOPE % (kThreads / kCols) == 0);
static_assert(kThreads * 2 == KVR, "each thread owns two latent columns");
static_assert(kRows % kWarps == 0, "out rows split evenly over the warps");
static_assert(kTileKeys <= kThreads, "a thread per key turns the scores into weights");

struct Smem {
  bf16 uk[NOPE][kCols];
  bf16 uv[kRows][KVR];
  bf16 keys[kTileKeys][W];
  float qlat[KVR];  // the head's q_lat, bf16-rounded, gathered from the cluster
  float qpe[ROPE];
  float qnope[NOPE];
  float qlat_part[kThreads / kCols][kCols];
  float score[kTileKeys];
  float part_o[KVR];  // this block's sums over its keys, and their max / sum of weights
  float part_m, part_l;
  float olat[KVR];
};

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t remote_addr(const void* local, uint32_t rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(smem_addr(local)), "r"(rank));
  return a;
}
__device__ __forceinline__ void st_remote(const float* local, uint32_t rank, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(remote_addr(local, rank)), "f"(v) : "memory");
}
__device__ __forceinline__ float ld_remote(const float* local, uint32_t rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote_addr(local, rank)) : "memory");
  return v;
}
__device__ __forceinline__ float2 ld_remote2(const float* local, uint32_t rank) {
  float2 v;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(remote_addr(local, rank))
               : "memory");
  return v;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Cache rows of keys [t0, t1) into s.keys, except the newest (ctx - 1: this step's, made from the latent).
__device__ __forceinline__ void load_keys(Smem& s, const MlaOneTokenArgs& a, int t0, int t1, int ctx) {
  constexpr int kChunks = W / 8;
  for (int u = threadIdx.x; u < (t1 - t0) * kChunks; u += kThreads) {
    const int k = t0 + u / kChunks, c = u % kChunks;
    if (k == ctx - 1) continue;
    const int64_t slot = static_cast<int64_t>(a.page_table[k / a.page_size]) * a.page_size + k % a.page_size;
    cp_async16(&s.keys[k - t0][c * 8], a.prep.cache + slot * W + c * 8, true);
  }
}

__global__ void __launch_bounds__(kThreads, 1) mla_one_token_kernel(const MlaOneTokenArgs a) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");  // this block runs
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t r = cluster_rank();
  const int h = static_cast<int>(blockIdx.x) / kC;
  const MlaPrepArgs& p = a.prep;
  // Metadata (positions, page table) was uploaded before the step; the weights and the cache rows of earlier steps
  // are not written by the kernel before this one: all loaded before the PDL wait.
  const int32_t pos = p.positions[0], ctx = pos + 1;
  const int per = (ctx + kC - 1) / kC;
  if (per > kTileKeys) __trap();  // the caller's bound (kOneTokenMaxCtx) broken: never read past shared memory
  const int k0 = min(ctx, static_cast<int>(r) * per), k1 = min(ctx, k0 + per);
  const bf16* head = a.kv_b + static_cast<int64_t>(h) * (NOPE + VH) * KVR;
  for (int u = tid; u < NOPE * kCols / 8; u += kThreads) {
    const int i = u / (kCols / 8), c = u % (kCols / 8);
    cp_async16(&s.uk[i][c * 8], head + static_cast<int64_t>(i) * KVR + r * kCols + c * 8, true);
  }
  for (int u = tid; u < kRows * KVR / 8; u += kThreads) {
    const int v = u / (KVR / 8), c = u % (KVR / 8);
    cp_async16(&s.uv[v][c * 8], head + static_cast<int64_t>(NOPE + r * kRows + v) * KVR + c * 8, true);
  }
  load_keys(s, a, k0, k1, ctx);
  cp_async_commit();
  pdl_wait();

  // q of head h: the nope part, and the rope part rotated as rope_q_pairs rounds it.
  const bf16* qh = p.q + static_cast<int64_t>(h) * (NOPE + ROPE);
  if (tid < NOPE) s.qnope[tid] = __bfloat162float(qh[tid]);
  if (tid < ROPE / 2) {
    bf16 y0, y1;
    rotated_pair(__bfloat162float(qh[NOPE + 2 * tid]), __bfloat162float(qh[NOPE + 2 * tid + 1]), tid, pos,
                 p.inv_freq, p.factor, y0, y1);
    s.qpe[2 * tid] = __bfloat162float(y0);
    s.qpe[2 * tid + 1] = __bfloat162float(y1);
  }
  const int n = k1 - k0;
  if (n > 0 && k1 == ctx) {  // the newest key: this step's latent row as the cache holds it (its read beside q's)
    bf16* row = s.keys[ctx - 1 - k0];
    latent_row(p.latent, row, KVR, ROPE, p.norm_w, p.eps, pos, p.inv_freq, p.factor);
    __syncthreads();
    if (h == 0) {
      bf16* dst = p.cache + static_cast<int64_t>(p.slots[0]) * W;
      for (int i = tid; i < W; i += kThreads) dst[i] = row[i];
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  {  // this block's q_lat columns, in quarters of the nope rows
    constexpr int kParts = kThreads / kCols, kPartRows = NOPE / kParts;
    const int c = tid % kCols, part = tid / kCols;
    float acc = 0.0f;
#pragma unroll 8
    for (int i = part * kPartRows; i < (part + 1) * kPartRows; ++i) acc += s.qnope[i] * __bfloat162float(s.uk[i][c]);
    s.qlat_part[part][c] = acc;
  }
  __syncthreads();
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every block of the cluster runs
  if (tid < kCols) {
    float v = 0.0f;
#pragma unroll
    for (int part = 0; part < kThreads / kCols; ++part) v += s.qlat_part[part][tid];
    v = bf16_round(v);
    for (uint32_t dst = 0; dst < kC; ++dst) st_remote(&s.qlat[r * kCols + tid], dst, v);
  }
  cluster_sync();  // q_lat complete in every block

  // Attention over keys [k0, k1) (at most kTileKeys: the caller keeps ctx <= kOneTokenMaxCtx). Thread tid owns latent
  // columns 2 tid, 2 tid + 1 of the weighted sum.
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
    acc = warp_sum(acc);
    if (lane == 0) s.score[k] = acc * a.softmax_scale;
  }
  __syncthreads();
  float m = -INFINITY, l = 0.0f, o0 = 0.0f, o1 = 0.0f;
  for (int k = 0; k < n; ++k) m = fmaxf(m, s.score[k]);
  __syncthreads();  // every thread has its max before the scores become weights
  if (tid < n) s.score[tid] = expf(s.score[tid] - m);
  __syncthreads();
  for (int k = 0; k < n; ++k) {
    const float w = s.score[k];
    const float2 c = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(s.keys[k])[tid]);
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
  cluster_sync();  // every block's partial is complete

  {  // combine the cluster's partials (a block without keys has m = -inf, l = 0: weight zero)
    float M = -INFINITY;
#pragma unroll
    for (int c = 0; c < kC; ++c) M = fmaxf(M, ld_remote(&s.part_m, c));
    float L = 0.0f, x0 = 0.0f, x1 = 0.0f;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const float mc = ld_remote(&s.part_m, c);
      const float e = mc == -INFINITY ? 0.0f : expf(mc - M);
      const float2 oc = ld_remote2(&s.part_o[2 * tid], c);
      L = fmaf(ld_remote(&s.part_l, c), e, L);
      x0 = fmaf(oc.x, e, x0);
      x1 = fmaf(oc.y, e, x1);
    }
    s.olat[2 * tid] = bf16_round(x0 / L);
    s.olat[2 * tid + 1] = bf16_round(x1 / L);
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");  // done reading the other blocks
  pdl_trigger();
  __syncthreads();
  // out rows r * kRows.. of head h: o_lat W_UV^T
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
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // no block leaves while others read its memory
}

std::atomic<uint64_t> g_smem_configured{0};  // devices whose shared-memory limit is set for the kernel

}  // namespace

int32_t mla_one_token_max_clusters() {
  if (set_max_dynamic_smem_once(mla_one_token_kernel, static_cast<int>(sizeof(Smem)), g_smem_configured) !=
      cudaSuccess)
    return 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kC * 256);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = sizeof(Smem);
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim = {static_cast<unsigned>(kC), 1, 1};
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, mla_one_token_kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

bool mla_one_token_fits(int32_t nh, int32_t nope, int32_t rope, int32_t v_head, int32_t kvr, int32_t max_clusters) {
  return nope == NOPE && rope == ROPE && v_head == VH && kvr == KVR && nh >= 1 && nh <= max_clusters;
}

cudaError_t mla_one_token(const MlaOneTokenArgs& a, int32_t nh, cudaStream_t stream) {
  const cudaError_t e =
      set_max_dynamic_smem_once(mla_one_token_kernel, static_cast<int>(sizeof(Smem)), g_smem_configured);
  if (e != cudaSuccess) return e;
  return launch_clustered(kC, mla_one_token_kernel, dim3(nh * kC), dim3(kThreads), sizeof(Smem), stream, a);
}

}  // namespace mlaserve::cuda
