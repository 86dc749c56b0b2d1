// Device helpers shared by the kernels: bf16 packing, warp reductions, cp.async, ldmatrix and the bf16 tensor-core
// MMA (m16n8k16, fp32 accumulate). Fragment layouts are the PTX ISA's for mma.m16n8k16 .row.col:
//   A (16x16): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C (16x8):  c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)      with g = lane / 4, t = lane % 4.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mlaserve::cuda {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024). `red` is __shared__ float[32].
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = lane < nw ? red[lane] : 0.0f;
  return warp_sum(r);
}
// Weights are read once per step: a 16-byte load that does not allocate in L1 (kept for the activations).
__device__ __forceinline__ uint4 ld_weights(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = lane < nw ? red[lane] : -INFINITY;
  return warp_max(r);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Whether a pointer allows 16-byte loads and stores (host side: which kernel variant to launch).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Eight bf16 values of a 16-byte load as floats, and back.
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                    pack_bf16x2(f[6], f[7]));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

constexpr float kLog2e = 1.4426950408889634f;  // softmax in log2 space: exp(x) = 2^(x log2 e)

// 2^x, the hardware approximation (flushes denormals; exact enough for softmax weights).
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// Named barriers (ids 1..15; 0 is __syncthreads): sync waits for `threads` arrivals, arrive only counts itself.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy accesses (wgmma, TMA, bulk copies).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// 16-byte async copy global -> shared; zero-fills the destination when !pred (nothing is read then).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Thread-block clusters. Every thread of each block calls these at the same points (.aligned). A block's first
// cluster_arrive_relaxed + cluster_wait pair ensures every block of the cluster runs before any touches another's
// shared memory; cluster_sync orders shared-memory writes before the barrier against reads after it.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Block `rank`'s copy of a shared-memory variable, as a generic pointer (mapa): plain loads and stores through it
// let the compiler keep many in flight (the cluster barriers order them).
template <typename T>
__device__ __forceinline__ T* in_block(T* local, uint32_t rank) {
  uint64_t out;
  asm("mapa.u64 %0, %1, %2;\n" : "=l"(out) : "l"(reinterpret_cast<uint64_t>(local)), "r"(rank));
  return reinterpret_cast<T*>(out);
}

// mbarriers in shared memory (phase-parity waits) and bulk copies (cp.async.bulk) that complete on them.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile(
      "{\n .reg .b64 st;\n mbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// bytes (a multiple of 16) from global to shared, completing as transaction bytes on bar.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
}

// c += a * b  (bf16 inputs, fp32 accumulators)
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

inline int ceil_div_i(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Programmatic dependent launch (PDL). A kernel launched with launch() may start while the kernel before it on the
// stream still runs: everything before pdl_wait() may only read memory no earlier kernel of the step writes (the
// weights), and pdl_wait() must run in every block before it touches anything else. pdl_wait returns when the
// previous kernel has finished and its writes are visible; as each kernel waits, that covers all earlier kernels.
// pdl_trigger() lets the next kernel start launching (its blocks take free SM slots and prefetch its weights).
// Without the launch attribute both are no-ops.
#ifdef MLASERVE_PROBE
// Probe builds (-DMLASERVE_PROBE=ON; tools/device/probe_step.sh): thread 0 of every block appends (grid, block, tag,
// %globaltimer) records to this translation unit's buffer: tag 0 when it reaches pdl_wait(), 1 when the wait
// returns, others where a kernel calls probe_mark. CudaBackend records one graph step (probe_start / probe_dump).
struct ProbeRecord {
  unsigned long long grid, time;
  unsigned block, tag;
};
constexpr unsigned kProbeCap = 1u << 19;
struct ProbeBuf {
  unsigned on, n;
  ProbeRecord rec[kProbeCap];
};
namespace {
__device__ ProbeBuf g_probe;
}
__device__ __forceinline__ void probe_mark(unsigned tag) {
  if (threadIdx.x != 0 || !*(volatile unsigned*)&g_probe.on) return;
  unsigned long long t, g;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
  const unsigned i = atomicAdd(&g_probe.n, 1u);
  if (i < kProbeCap) g_probe.rec[i] = {g, t, blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), tag};
}
// Host: every translation unit's buffer (registered at load).
std::vector<void* (*)()>& probe_buffers();
namespace {
void* probe_buffer_address() {
  void* p = nullptr;
  cudaGetSymbolAddress(&p, g_probe);
  return p;
}
const bool probe_registered = (probe_buffers().push_back(&probe_buffer_address), true);
}  // namespace
__device__ __forceinline__ void pdl_wait() {
  probe_mark(0);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  probe_mark(1);
}
#else
__device__ __forceinline__ void probe_mark(unsigned) {}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
#endif
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// Whether launch() sets the PDL attribute: on unless MLASERVE_PDL=0 (read once).
bool pdl_enabled();

// launch() in thread-block clusters of cluster_x blocks along x (grid.x a multiple of it; 0: no clusters).
template <typename... P, typename... A>
cudaError_t launch_clustered(unsigned cluster_x, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, A&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {cluster_x, 1, 1};
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...);
  return e == cudaSuccess ? cudaGetLastError() : e;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed (PDL),
// for kernels that call pdl_wait() first (see above). Returns the launch status.
template <typename... P, typename... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... args) {
  return launch_clustered(0, kernel, grid, block, smem, stream, std::forward<A>(args)...);
}

}  // namespace mlaserve::cuda

// cudaFuncSetAttribute is per function AND per device: remember, per kernel instantiation (its own static mask),
// which devices have been configured, so several GPUs in one process each get the attribute.
template <typename Kernel>
inline cudaError_t set_max_dynamic_smem_once(Kernel kernel, int bytes, std::atomic<uint64_t>& configured_devices) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if (configured_devices.load(std::memory_order_acquire) & bit) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) configured_devices.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}
