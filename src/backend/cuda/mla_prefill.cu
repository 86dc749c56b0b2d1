// MLA prefill attention, expanded form: causal multi-head attention of q [T, nh, nope + rope] over keys
// [k_nope (from kv_b_proj(c_kv)) | k_pe (shared, from the cache)] and values v (from kv_b_proj(c_kv)), for a ragged
// batch whose prefix may already be in the paged cache (the context rows are gathered first). CPU reference:
// cpu::mla_attention (expanded branch).
//
// Fast path (nope 128, rope 64, v 128): FlashAttention-2 style, one block of 8 warps per (128 queries, head), each
// warp 16 query rows, Q fragments held in registers, K/V tiles of 64 keys double-buffered with cp.async, online
// softmax in log2 space, P kept in registers as the A operand of P @ V. Every K/V tile a block loads serves its 128
// queries: at 64 queries per block (4 warps, two blocks per SM) long prompts were bound by the tiles' L2 traffic
// (~64 FLOP per byte; docs/perf.md, forty-first session); a third K / V stage measured no faster.
#include <cmath>

#include <cuda_fp8.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

__global__ void gather_context_kernel(const bf16* cache, const uint8_t* cache_f8, bool e5m2, int32_t width,
                                      const int32_t* page_table, int32_t page_size, int32_t max_pages,
                                      const int32_t* row_seq, const int32_t* row_pos, bf16* ctx) {
  const int64_t r = blockIdx.x;
  const int32_t seq = row_seq[r], pos = row_pos[r];
  const int64_t slot = static_cast<int64_t>(page_table[static_cast<int64_t>(seq) * max_pages + pos / page_size]) *
                           page_size + pos % page_size;
  bf16* dst = ctx + r * width;
  if (cache_f8) {  // an FP8 cache: its codes' values (exact in bf16)
    const uint8_t* src = cache_f8 + slot * width;
    const CacheCodes codes = cache_codes(cache_f8, e5m2);
    if ((width & 3) == 0) {
      for (int i = threadIdx.x; i < width / 4; i += blockDim.x) {
        uint32_t lo, hi;
        cache_codes4_bf16(reinterpret_cast<const uint32_t*>(src)[i], lo, hi, codes);
        reinterpret_cast<uint2*>(dst)[i] = make_uint2(lo, hi);
      }
    } else {
      for (int i = threadIdx.x; i < width; i += blockDim.x)
        dst[i] = __float2bfloat16_rn(cache_code_value(src[i], codes));
    }
    return;
  }
  const bf16* src = cache + slot * width;
  if ((width & 7) == 0) {
    for (int i = threadIdx.x; i < width / 8; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
  }
}

namespace fa {
constexpr int NOPE = 128, ROPE = 64, DQK = 192, DV = 128, KVR = 512;
constexpr int BN = 64;
constexpr int LDK = DQK + 8;  // 400 B rows
constexpr int LDV = DV + 8;   // 272 B rows
constexpr int BM = kPrefillBlockQ, NW = BM / 16, NT = NW * 32;  // a warp per 16 queries
constexpr size_t smem_bytes = sizeof(bf16) * (BM * LDK + 2 * BN * LDK + 2 * BN * LDV);
}  // namespace fa

__global__ void __launch_bounds__(fa::NT, 1) mla_prefill_fast_kernel(const MlaPrefillParams p) {
  using namespace fa;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + BM * LDK;      // [2][BN][LDK]
  bf16* sV = sK + 2 * BN * LDK;  // [2][BN][LDV]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const MlaPrefillItem it = p.items[blockIdx.x];
  const int h = blockIdx.y, nh = p.num_heads;
  const int kv_w = NOPE + DV;             // kv row width per head
  const int lat_w = KVR + ROPE;           // context latent row width
  const int kmax = it.pos_begin + it.num_tokens;  // keys [0, kmax)
  const int n_tiles = (kmax + BN - 1) / BN;

  for (int c = tid; c < BM * (DQK / 8); c += NT) {
    const int r = c / (DQK / 8), col = (c % (DQK / 8)) * 8;
    const bool ok = r < it.num_tokens;
    const bf16* src = p.q + (static_cast<int64_t>(it.token_begin + (ok ? r : 0)) * nh + h) * DQK + col;
    cp_async16(sQ + r * LDK + col, src, ok);
  }
  auto load_tile = [&](int kt, int stage) {
    bf16* k = sK + stage * BN * LDK;
    bf16* v = sV + stage * BN * LDV;
    constexpr int CK = DQK / 8, CV = DV / 8, CR = CK + CV;  // 24 + 16 chunks per key
    for (int c = tid; c < BN * CR; c += NT) {
      const int r = c / CR, cc = c % CR;
      const int key = kt * BN + r;
      const bool ok = key < kmax;
      const int64_t row = it.kv_begin + (ok ? key : 0);
      if (cc < NOPE / 8) {
        cp_async16(k + r * LDK + cc * 8, p.kv + (row * nh + h) * kv_w + cc * 8, ok);
      } else if (cc < CK) {
        const int col = (cc - NOPE / 8) * 8;
        cp_async16(k + r * LDK + NOPE + col, p.ctx_latent + row * lat_w + KVR + col, ok);
      } else {
        const int col = (cc - CK) * 8;
        cp_async16(v + r * LDV + col, p.kv + (row * nh + h) * kv_w + NOPE + col, ok);
      }
    }
  };
  load_tile(0, 0);
  cp_async_commit();

  const int r0 = warp * 16 + g, r1 = r0 + 8;
  const bool rows = warp * 16 < it.num_tokens;  // (a warp past the item's tokens only loads and waits)
  const int pos0 = it.pos_begin + min(r0, it.num_tokens - 1);
  const int pos1 = it.pos_begin + min(r1, it.num_tokens - 1);
  const float scale = p.softmax_scale * kLog2e;

  uint32_t qf[DQK / 16][4];
  float o[DV / 8][4];
#pragma unroll
  for (int i = 0; i < DV / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  for (int kt = 0; kt < n_tiles; ++kt) {
    cp_async_wait<0>();
    __syncthreads();
    if (kt + 1 < n_tiles) load_tile(kt + 1, (kt + 1) & 1);
    cp_async_commit();
    if (!rows) continue;
    if (kt == 0) {
#pragma unroll
      for (int ks = 0; ks < DQK / 16; ++ks)
        ldmatrix_x4(qf[ks], sQ + (warp * 16 + (lane & 15)) * LDK + ks * 16 + (lane >> 4) * 8);
    }
    const bf16* K = sK + (kt & 1) * BN * LDK;
    const bf16* V = sV + (kt & 1) * BN * LDV;

    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < DQK / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, K + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDK + ks * 16 + ((lane >> 3) & 1) * 8);
        mma_bf16(s[2 * np], qf[ks], b[0], b[1]);
        mma_bf16(s[2 * np + 1], qf[ks], b[2], b[3]);
      }
    }
    const int key0 = kt * BN;
    const bool need_mask = key0 + BN - 1 > it.pos_begin;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      const int k = key0 + nt * 8 + 2 * t4;
      s[nt][0] = (need_mask && k > pos0) ? -INFINITY : s[nt][0] * scale;
      s[nt][1] = (need_mask && k + 1 > pos0) ? -INFINITY : s[nt][1] * scale;
      s[nt][2] = (need_mask && k > pos1) ? -INFINITY : s[nt][2] * scale;
      s[nt][3] = (need_mask && k + 1 > pos1) ? -INFINITY : s[nt][3] * scale;
      mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
      mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float a0 = exp2f(m0 - mn0), a1 = exp2f(m1 - mn1);
    m0 = mn0;
    m1 = mn1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - mn0);
      s[nt][1] = exp2f(s[nt][1] - mn0);
      s[nt][2] = exp2f(s[nt][2] - mn1);
      s[nt][3] = exp2f(s[nt][3] - mn1);
      rs0 += s[nt][0] + s[nt][1];
      rs1 += s[nt][2] + s[nt][3];
    }
    l0 = l0 * a0 + rs0;
    l1 = l1 * a1 + rs1;
#pragma unroll
    for (int i = 0; i < DV / 8; ++i) {
      o[i][0] *= a0;
      o[i][1] *= a0;
      o[i][2] *= a1;
      o[i][3] *= a1;
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      const bf16* vrow = V + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDV + (lane >> 4) * 8;
#pragma unroll
      for (int dp = 0; dp < DV / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vrow + dp * 16);
        mma_bf16(o[2 * dp], a, b[0], b[1]);
        mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
  bf16* out0 = p.out + (static_cast<int64_t>(it.token_begin + r0) * nh + h) * DV + 2 * t4;
  bf16* out1 = p.out + (static_cast<int64_t>(it.token_begin + r1) * nh + h) * DV + 2 * t4;
#pragma unroll
  for (int i = 0; i < DV / 8; ++i) {
    if (r0 < it.num_tokens) *reinterpret_cast<uint32_t*>(out0 + i * 8) = pack_bf16x2(o[i][0] * inv0, o[i][1] * inv0);
    if (r1 < it.num_tokens) *reinterpret_cast<uint32_t*>(out1 + i * 8) = pack_bf16x2(o[i][2] * inv1, o[i][3] * inv1);
  }
}

// Simple path for any dims: one block per (token, head), keys in chunks of blockDim, fp32 throughout.
constexpr int kSimpleThreads = 128;
constexpr int kSimpleMaxCols = 8;  // v <= 1024

__global__ void __launch_bounds__(kSimpleThreads) mla_prefill_simple_kernel(const MlaPrefillParams p) {
  extern __shared__ float sq[];  // [nope + rope] query, then [kSimpleThreads] probabilities
  __shared__ float red[32];
  const MlaPrefillItem it = p.items[blockIdx.x / kPrefillBlockQ];
  const int r = blockIdx.x % kPrefillBlockQ;
  if (r >= it.num_tokens) return;
  const int h = blockIdx.y, nh = p.num_heads, hd = p.nope + p.rope, kvw = p.nope + p.v, latw = p.kvr + p.rope;
  const int64_t th = static_cast<int64_t>(it.token_begin + r) * nh + h;
  const int pos = it.pos_begin + r;
  float* sp = sq + hd;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) sq[i] = __bfloat162float(p.q[th * hd + i]);
  __syncthreads();
  const float scale = p.softmax_scale * kLog2e;
  float m = -INFINITY, l = 0.0f;
  float o[kSimpleMaxCols];
#pragma unroll
  for (int i = 0; i < kSimpleMaxCols; ++i) o[i] = 0.0f;
  const int nkeys = pos + 1;
  for (int k0 = 0; k0 < nkeys; k0 += kSimpleThreads) {
    const int key = k0 + threadIdx.x;
    float s = -INFINITY;
    if (key < nkeys) {
      const int64_t row = it.kv_begin + key;
      const bf16* kn = p.kv + (row * nh + h) * kvw;
      const bf16* kp = p.ctx_latent + row * latw + p.kvr;
      float acc = 0.0f;
      for (int d = 0; d < p.nope; ++d) acc += sq[d] * __bfloat162float(kn[d]);
      for (int d = 0; d < p.rope; ++d) acc += sq[p.nope + d] * __bfloat162float(kp[d]);
      s = acc * scale;
    }
    const float m_new = fmaxf(m, block_max(s, red));
    const float e = key < nkeys ? exp2f(s - m_new) : 0.0f;
    const float sum = block_sum(e, red);
    const float alpha = exp2f(m - m_new);
    l = l * alpha + sum;
    m = m_new;
    sp[threadIdx.x] = e;
    __syncthreads();
    const int n = min(kSimpleThreads, nkeys - k0);
#pragma unroll
    for (int i = 0; i < kSimpleMaxCols; ++i) o[i] *= alpha;
    for (int j = 0; j < n; ++j) {
      const bf16* v = p.kv + ((it.kv_begin + k0 + j) * static_cast<int64_t>(nh) + h) * kvw + p.nope;
      const float pj = sp[j];
#pragma unroll
      for (int i = 0; i < kSimpleMaxCols; ++i) {
        const int c = threadIdx.x + i * kSimpleThreads;
        if (c < p.v) o[i] += pj * __bfloat162float(v[c]);
      }
    }
    __syncthreads();
  }
  const float inv = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kSimpleMaxCols; ++i) {
    const int c = threadIdx.x + i * kSimpleThreads;
    if (c < p.v) p.out[th * p.v + c] = __float2bfloat16_rn(o[i] * inv);
  }
}

}  // namespace

cudaError_t mla_gather_context(const bf16* cache, const uint8_t* cache_f8, bool e5m2, int32_t width,
                               const int32_t* page_table, int32_t page_size, int32_t max_pages,
                               const int32_t* row_seq, const int32_t* row_pos, int64_t L, bf16* ctx_latent,
                               cudaStream_t stream) {
  if (L == 0) return cudaSuccess;
  gather_context_kernel<<<static_cast<unsigned>(L), 64, 0, stream>>>(cache, cache_f8, e5m2, width, page_table,
                                                                      page_size, max_pages, row_seq, row_pos,
                                                                      ctx_latent);
  return cudaGetLastError();
}

namespace {
cudaError_t configure_prefill_fast() {
  static std::atomic<uint64_t> configured{0};  // one bit per device
  return set_max_dynamic_smem_once(mla_prefill_fast_kernel, static_cast<int>(fa::smem_bytes), configured);
}
}  // namespace

cudaError_t mla_prefill_prepare() { return configure_prefill_fast(); }

cudaError_t mla_prefill(const MlaPrefillParams& p, bool allow_fast, cudaStream_t stream) {
  if (p.num_items == 0 || p.num_heads == 0) return cudaSuccess;
  if (allow_fast && p.nope == fa::NOPE && p.rope == fa::ROPE && p.v == fa::DV && p.kvr == fa::KVR) {
    if (cudaError_t e = configure_prefill_fast(); e != cudaSuccess) return e;
    dim3 grid(static_cast<unsigned>(p.num_items), static_cast<unsigned>(p.num_heads));
    mla_prefill_fast_kernel<<<grid, fa::NT, fa::smem_bytes, stream>>>(p);
    return cudaGetLastError();
  }
  if (p.v > kSimpleThreads * kSimpleMaxCols) return cudaErrorInvalidValue;
  dim3 grid(static_cast<unsigned>(p.num_items * kPrefillBlockQ), static_cast<unsigned>(p.num_heads));
  const size_t smem = sizeof(float) * (p.nope + p.rope + kSimpleThreads);
  mla_prefill_simple_kernel<<<grid, kSimpleThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaserve::cuda
