// What a persistent whole-step decode kernel could reach at one token (a micro-benchmark of cuda_kernel_bench, not a
// test): the question behind #6's 700 tok/s (docs/perf.md, eleventh session). A V2-Lite decode step at one token is
// 26 MoE layers of 8 dependent phases; each phase streams its weights and needs the whole output of the phase
// before. Here every SM runs one block for the whole step, phases separated by a grid barrier (one arrival counter);
// each phase's consumers read the previous phase's output (the activations) from L2, dot it with their bytes and
// write their outputs. Two ways to bring the bytes:
//   ring:   a producer warp streams the block's share into a ring of shared-memory stages with bulk copies
//           (mbarrier full / empty handshake) for the consumer warps (layer_stream_kernel);
//   direct: every warp loads its own units into registers, the next one before computing the current
//           (layer_direct_kernel).
// Four modes:
//   ahead:  loads run ahead across the phase barriers, waiting only where the bytes depend on an earlier result
//           (the routed experts, after the router's phase);
//   phase:  a phase's bytes start only once that phase may start (no streaming across a barrier);
//   stream: nobody waits at the barriers: the same bytes as one stream (the floor of these consumers);
//   drain:  as stream, the consumers barely touch the bytes (the floor of the loads).
// Reported: microseconds per layer and the bytes' rate, against the engine's ~72 us per layer; also the layers with
// their five short phases merged into one (4 phases), and a plain streaming read of the same bytes.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/cuda/common.cuh"
#include "bench_util.h"

namespace {

using mlaserve::cuda::bulk_copy_g2s;
using mlaserve::cuda::mbar_arrive;
using mlaserve::cuda::mbar_init;
using mlaserve::cuda::mbar_wait;
using mlaserve::cuda::smem_addr;

struct Phase {
  const uint8_t* w;      // the phase's weights, contiguous
  long long bytes;       // a multiple of 16
  long long routed_from;  // byte offset from which the bytes depend on phase `dep` (bytes: none do)
  int dep;
};

constexpr int kAct = 1024;  // activations each phase reads from the previous phase's output

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void wait_count(const unsigned* ctr, unsigned target) {
  while (static_cast<int>(ld_acquire(ctr) - target) < 0) {
  }
}
// mbar_arrive with the stage's transaction bytes announced.
__device__ __forceinline__ void mbar_arrive_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
          smem_addr(bar)),
      "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s_evict_first(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "{\n .reg .b64 pol;\n createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
      " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], pol;\n}\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void consumers_sync(int threads) {
  asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory");
}

// out: [n][gridDim.x * NW] floats; ctr counts phase arrivals (G per phase) from `base`.
template <int NW, int CHUNK, int STAGES, int SPLIT, bool EVICT>
__global__ void __launch_bounds__((NW + 1) * 32, 1)
    layer_stream_kernel(const Phase* phases, int n, float* out, unsigned* ctr, unsigned base, int mode) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  float* act = reinterpret_cast<float*>(smem + STAGES * CHUNK);
  uint64_t* full = reinterpret_cast<uint64_t*>(act + kAct);
  uint64_t* empty = full + STAGES;
  const int G = gridDim.x, b = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int out_len = G * NW;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, NW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == NW) {  // producer
    if (lane >= SPLIT) return;
    uint32_t k = 0;
    for (int p = 0; p < n; ++p) {
      const Phase ph = phases[p];
      const long long nc = (ph.bytes + CHUNK - 1) / CHUNK;
      if (mode == 1 && p > 0) wait_count(ctr, base + static_cast<unsigned>(p * G));
      bool dep_done = false;
      for (long long c = b; c < nc; c += G, ++k) {
        const long long off = c * CHUNK;
        if (mode == 0 && !dep_done && off >= ph.routed_from) {
          wait_count(ctr, base + static_cast<unsigned>((ph.dep + 1) * G));
          dep_done = true;
        }
        const int s = k % STAGES;
        if (k >= STAGES) mbar_wait(empty + s, ((k / STAGES) - 1) & 1);
        const uint32_t sz = static_cast<uint32_t>(min(static_cast<long long>(CHUNK), ph.bytes - off));
        if (lane == 0) mbar_arrive_tx(full + s, sz);
        __syncwarp(SPLIT == 32 ? 0xffffffffu : (1u << (SPLIT & 31)) - 1);
        // lane i copies part i (parts of CHUNK / SPLIT bytes; the last chunk of a phase may be shorter)
        const uint32_t part = CHUNK / SPLIT, lo = lane * part;
        if (lo < sz) {
          const uint32_t len = min(part, sz - lo);
          if (EVICT)
            bulk_g2s_evict_first(ring + s * CHUNK + lo, ph.w + off + lo, len, full + s);
          else
            bulk_copy_g2s(ring + s * CHUNK + lo, ph.w + off + lo, len, full + s);
        }
      }
    }
    return;
  }

  // consumers
  constexpr int kCons = NW * 32;
  uint32_t k = 0;
  for (int p = 0; p < n; ++p) {
    const Phase ph = phases[p];
    const long long nc = (ph.bytes + CHUNK - 1) / CHUNK;
    if (mode < 2 && p > 0 && tid == 0) wait_count(ctr, base + static_cast<unsigned>(p * G));
    consumers_sync(kCons);
    for (int i = tid; i < kAct; i += kCons)
      act[i] = p == 0 ? 1.0f / (1 + i) : i < out_len ? __ldcg(out + static_cast<size_t>(p - 1) * out_len + i) : 0.f;
    consumers_sync(kCons);
    float acc = 0.f;
    for (long long c = b; c < nc; c += G, ++k) {
      const int s = k % STAGES;
      mbar_wait(full + s, (k / STAGES) & 1);
      const int nv = static_cast<int>(min(static_cast<long long>(CHUNK), ph.bytes - c * CHUNK) / 16);
      const uint4* src = reinterpret_cast<const uint4*>(ring + s * CHUNK);
      const int e0 = static_cast<int>((c * CHUNK / 2) & (kAct - 1));
      if (mode != 3) {
#pragma unroll 4
        for (int v = warp * 32 + lane; v < nv; v += kCons) {
          const uint4 x = src[v];
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x);
          const float4* a = reinterpret_cast<const float4*>(act + ((e0 + v * 8) & (kAct - 1)));
          const float4 a0 = a[0], a1 = a[1];
          const float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
          const float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
          acc += fmaf(f0.x, a0.x, f0.y * a0.y) + fmaf(f1.x, a0.z, f1.y * a0.w) + fmaf(f2.x, a1.x, f2.y * a1.y) +
                 fmaf(f3.x, a1.z, f3.y * a1.w);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) out[static_cast<size_t>(p) * out_len + b * NW + warp] = __sinf(acc);
    consumers_sync(kCons);
    if (tid == 0) {
      __threadfence();
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(ctr) : "memory");
    }
  }
}

// The same phases without a ring: every warp loads its own units (U 16-byte words per lane, 512 * U bytes) straight
// into registers and, in the ahead mode, issues the loads of its next unit (in this phase or the next one it has work
// in) before it computes the current one, so they are in flight across the phase barrier. Routed units are loaded
// early only once the router's phase is complete. Units go round the grid's warps SM by SM.
template <int U, int NWARP>
__global__ void __launch_bounds__(NWARP * 32, 1)
    layer_direct_kernel(const Phase* phases, int n, float* out, unsigned* ctr, unsigned base, int mode) {
  __shared__ float act[kAct];
  constexpr int UB = 32 * 16 * U;
  const int G = gridDim.x, b = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int NWG = G * NWARP, gw = warp * G + b, out_len = NWG;
  auto units = [&](int q) { return (phases[q].bytes + UB - 1) / UB; };
  auto load = [&](uint4(&r)[U], int q, long long u) {
    const uint8_t* src = phases[q].w + u * UB;
    const long long rem = phases[q].bytes - u * UB;
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int off = (j * 32 + lane) * 16;
      r[j] = off < rem ? __ldcs(reinterpret_cast<const uint4*>(src + off)) : make_uint4(0, 0, 0, 0);
    }
  };
  auto first_unit = [&](int q) {
    while (q < n && gw >= units(q)) ++q;
    return q;
  };
  // May unit u of phase q be loaded while phase p runs (its bytes may depend on a phase not yet complete)?
  auto allowed = [&](int q, long long u, int p) {
    return mode >= 2 || u * UB < phases[q].routed_from || phases[q].dep < p;
  };
  uint4 cur[U], nxt[U];
  int cp = -1;
  long long cu = 0;
  for (int p = 0; p < n; ++p) {
    if (mode < 2 && p > 0) {
      if (tid == 0) wait_count(ctr, base + static_cast<unsigned>(p * G));
      __syncthreads();
    }
    for (int i = tid; i < kAct; i += NWARP * 32)
      act[i] = p == 0 ? 1.0f / (1 + i) : i < out_len ? __ldcg(out + static_cast<size_t>(p - 1) * out_len + i) : 0.f;
    __syncthreads();
    float acc = 0.f;
    const long long nu = units(p);
    for (long long u = gw; u < nu; u += NWG) {
      if (cp != p || cu != u) load(cur, p, u);
      long long un = u + NWG;
      int pn = p;
      if (un >= nu) {
        pn = first_unit(p + 1);
        un = gw;
      }
      const bool pf = pn < n && (mode != 1 || pn == p) && allowed(pn, un, p);
      if (pf) load(nxt, pn, un);
      const int e0 = static_cast<int>((u * UB / 2) & (kAct - 1));
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (mode == 3) {
          acc += __uint_as_float((cur[j].x ^ cur[j].y ^ cur[j].z ^ cur[j].w) & 0x3f800000u);
          continue;
        }
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&cur[j]);
        const float4* a = reinterpret_cast<const float4*>(act + ((e0 + (j * 32 + lane) * 8) & (kAct - 1)));
        const float4 a0 = a[0], a1 = a[1];
        const float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
        const float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
        acc += fmaf(f0.x, a0.x, f0.y * a0.y) + fmaf(f1.x, a0.z, f1.y * a0.w) + fmaf(f2.x, a1.x, f2.y * a1.y) +
               fmaf(f3.x, a1.z, f3.y * a1.w);
      }
      if (pf) {
#pragma unroll
        for (int j = 0; j < U; ++j) cur[j] = nxt[j];
        cp = pn;
        cu = un;
      } else {
        cp = -1;
      }
    }
    if (cp < 0 && mode == 0) {  // no unit here, or the next could not be loaded early: try now, before the barrier
      const int pn = first_unit(p + 1);
      if (pn < n && allowed(pn, gw, p)) {
        load(cur, pn, gw);
        cp = pn;
        cu = gw;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) out[static_cast<size_t>(p) * out_len + gw] = __sinf(acc);
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(ctr) : "memory");
    }
  }
}

__global__ void fill_kernel(__nv_bfloat16* w, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ static_cast<uint32_t>(i >> 32) * 40503u;
    h ^= h >> 15;
    w[i] = __float2bfloat16(static_cast<float>(h & 0xffff) / 32768.0f - 1.0f);
  }
}

// The plain rate of reading n 16-byte words: every thread loads 4 words in flight per step.
__global__ void plain_read_kernel(const uint4* w, size_t n, unsigned* sink) {
  unsigned x = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = __ldcs(w + i + j * stride);
#pragma unroll
    for (int j = 0; j < 4; ++j) x ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n; i += stride) x ^= __ldcs(w + i).x;
  if (x == 0x12345678u) *sink = x;
}

// One V2-Lite MoE layer at one token (bytes of bf16 weights read per phase); ctx cache rows for the decode.
std::vector<long long> layer_bytes(int ctx, long long* routed_gu, long long* routed_dn) {
  const long long H = 2048, I = 1408, E = 8;  // 6 routed + 2 shared experts
  *routed_gu = 2 * 2 * I * H * 2;
  *routed_dn = 2 * H * I * 2;
  return {(3072 + 576) * H * 2,  // q / latent pair
          16LL * 128 * 512 * 2,  // q_lat (W_UK)
          ctx * 1152LL,          // latent cache rows
          16LL * 512 * 128 * 2,  // combine + W_UV
          H * H * 2,             // o_proj
          64 * H * 2,            // router
          E * 2 * I * H * 2,     // gate / up
          E * H * I * 2};        // down
}

// The step's weights (layers x one layer's phases) and the phase table, made once per context length.
struct Step {
  int sms = 0, layers = 0, ctx = 0, n = 0;
  bool merged = false;
  long long layer_bytes = 0;
  uint8_t* w = nullptr;
  Phase* phases = nullptr;
  float* out = nullptr;  // [n][4096 + sms * 32] floats: room for either kernel's outputs
  unsigned* ctr = nullptr;
  unsigned base = 0;
};

// merged: the five short phases between the pair and gate / up as one (4 phases per layer instead of 8), to see
// what each dependency costs.
Step make_step(int layers, int ctx, bool merged) {
  Step st;
  st.merged = merged;
  st.layers = layers;
  st.ctx = ctx;
  int dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&st.sms, cudaDevAttrMultiProcessorCount, dev));
  long long rgu = 0, rdn = 0;
  std::vector<long long> per = layer_bytes(ctx, &rgu, &rdn);
  if (merged) per = {per[0], per[1] + per[2] + per[3] + per[4] + per[5], per[6], per[7]};
  for (long long x : per) st.layer_bytes += x;
  const size_t total = static_cast<size_t>(st.layer_bytes) * layers;
  CK(cudaMalloc(&st.w, total));
  fill_kernel<<<4 * st.sms, 256>>>(reinterpret_cast<__nv_bfloat16*>(st.w), total / 2);
  CK(cudaGetLastError());
  std::vector<Phase> ph;
  size_t off = 0;
  for (int l = 0; l < layers; ++l) {
    const size_t gu = per.size() - 2;  // gate / up, then down, depend on the phase before gate / up
    const int router = static_cast<int>(ph.size() + gu) - 1;
    for (size_t i = 0; i < per.size(); ++i) {
      Phase p{st.w + off, per[i], per[i], 0};
      if (i == gu) p = Phase{st.w + off, per[i], rgu, router};
      if (i == gu + 1) p = Phase{st.w + off, per[i], rdn, router};
      ph.push_back(p);
      off += static_cast<size_t>(per[i]);
    }
  }
  st.n = static_cast<int>(ph.size());
  CK(cudaMalloc(&st.phases, st.n * sizeof(Phase)));
  CK(cudaMemcpy(st.phases, ph.data(), st.n * sizeof(Phase), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&st.out, static_cast<size_t>(st.n) * st.sms * 32 * sizeof(float)));
  CK(cudaMalloc(&st.ctr, sizeof(unsigned)));
  CK(cudaMemset(st.ctr, 0, sizeof(unsigned)));
  return st;
}

void free_step(Step& st) {
  CK(cudaFree(st.w));
  CK(cudaFree(st.phases));
  CK(cudaFree(st.out));
  CK(cudaFree(st.ctr));
}

void plain_read(Step& st, int runs) {
  unsigned* sink = nullptr;
  CK(cudaMalloc(&sink, sizeof(unsigned)));
  const size_t total = static_cast<size_t>(st.layer_bytes) * st.layers;
  for (int tpb : {512, 1024}) {
    const double ms = time_ms(
        [&] { plain_read_kernel<<<st.sms, tpb>>>(reinterpret_cast<const uint4*>(st.w), total / 16, sink); }, 2, runs);
    std::printf("plain read %d threads x %d blocks: %.2f TB/s\n", tpb, st.sms, total / ms / 1e9);
  }
  CK(cudaFree(sink));
}

// Times kern (one block per SM, `threads`, `smem` bytes) in the four modes; out_len outputs per phase.
void measure(Step& st, const char* name, const void* kern, int threads, size_t smem, int out_len, int runs) {
  if (smem > 48 * 1024)
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, threads, smem));
  if (per_sm < 1) {
    std::printf("%s: does not fit\n", name);
    return;
  }
  std::vector<float> last[4];
  double us[4];
  const char* names[4] = {"ahead", "phase", "stream", "drain"};
  for (int mode = 0; mode < 4; ++mode) {
    const double ms = time_ms(
        [&] {
          void* args[] = {&st.phases, &st.n, &st.out, &st.ctr, &st.base, &mode};
          CK(cudaLaunchCooperativeKernel(kern, dim3(st.sms), dim3(threads), args, smem));
          st.base += static_cast<unsigned>(st.n * st.sms);
        },
        2, runs);
    us[mode] = 1000.0 * ms / st.layers;
    last[mode].resize(static_cast<size_t>(out_len));
    CK(cudaMemcpy(last[mode].data(), st.out + static_cast<size_t>(st.n - 1) * out_len, out_len * sizeof(float),
                  cudaMemcpyDeviceToHost));
  }
  std::printf("%s ctx=%d (%d layers, %d phases each, %.1f MB each):", name, st.ctx, st.layers, st.n / st.layers,
              st.layer_bytes / 1e6);
  for (int mode = 0; mode < 4; ++mode)
    std::printf(" %s %.1f us (%.2f TB/s)", names[mode], us[mode], st.layer_bytes / us[mode] / 1e6);
  std::printf("%s\n", last[0] == last[1] ? "" : " (ahead and phase DIFFER)");
}

template <int NW, int CHUNK, int STAGES, int SPLIT, bool EVICT>
void ring(Step& st, int runs) {
  char name[96];
  std::snprintf(name, sizeof name, "ring NW=%d chunk=%dK stages=%d split=%d%s", NW, CHUNK / 1024, STAGES, SPLIT,
                EVICT ? " evict-first" : "");
  const size_t smem = static_cast<size_t>(STAGES) * CHUNK + kAct * sizeof(float) + 2 * STAGES * sizeof(uint64_t);
  measure(st, name, reinterpret_cast<const void*>(layer_stream_kernel<NW, CHUNK, STAGES, SPLIT, EVICT>),
          (NW + 1) * 32, smem, st.sms * NW, runs);
}

template <int U, int NWARP>
void direct(Step& st, int runs) {
  char name[96];
  std::snprintf(name, sizeof name, "direct U=%d warps=%d", U, NWARP);
  measure(st, name, reinterpret_cast<const void*>(layer_direct_kernel<U, NWARP>), NWARP * 32, 0, st.sms * NWARP, runs);
}

}  // namespace

// Entry point for cuda_kernel_bench ("layer [ctx]"): microseconds per V2-Lite layer at one token.
void bench_layer(int ctx) {
  for (bool merged : {false, true}) {
    Step st = make_step(26, ctx, merged);
    if (!merged) plain_read(st, 20);
    ring<16, 16384, 13, 1, true>(st, 20);
    ring<8, 16384, 13, 8, true>(st, 20);
    direct<4, 32>(st, 20);
    free_step(st);
  }
}
