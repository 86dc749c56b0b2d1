// What one dependency between phases of GPU work costs (a micro-benchmark of cuda_kernel_bench, not a test): the
// question behind a persistent per-layer decode kernel (docs/cuda.md, "What 700 tok/s would take"). A chain of P
// phases, each block of each phase reading two values the previous phase wrote (its own and its neighbour's) and
// writing one, run three ways:
//   pdl:      one kernel per phase, launched with programmatic dependent launch and replayed as a CUDA graph (what a
//             decode step does today: griddepcontrol.wait, then launch_dependents);
//   barrier:  one persistent kernel, a whole-grid barrier between phases (arrival counter, relaxed polling, fence);
//   flags:    one persistent kernel, each block waiting only for the two blocks whose values it reads.
// Reported: microseconds per phase (median of the timed runs), for grids of one and two blocks per SM.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_util.h"

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Phase value of block b: 1 + prev[b] + prev[b + 1 mod G].
__device__ __forceinline__ unsigned step_value(const unsigned* prev, int b, int G) {
  return 1u + __ldcg(prev + b) + __ldcg(prev + (b + 1) % G);
}

__global__ void pdl_phase_kernel(const unsigned* prev, unsigned* cur) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (threadIdx.x == 0) cur[blockIdx.x] = step_value(prev, blockIdx.x, gridDim.x);
}

// vals: [P + 1][G] (row 0 the input); counters: [P + 1], zero before the launch.
__global__ void barrier_kernel(unsigned* vals, unsigned* counters, int P) {
  const int G = gridDim.x, b = blockIdx.x;
  for (int i = 1; i <= P; ++i) {
    if (threadIdx.x == 0) {
      vals[i * G + b] = step_value(vals + (i - 1) * G, b, G);
      __threadfence();
      atomicAdd(counters + i, 1u);
      while (ld_relaxed(counters + i) < static_cast<unsigned>(G)) {
      }
      __threadfence();
    }
    __syncthreads();
  }
}

// flags: [P + 1][G], zero before the launch; row 0 is never waited for.
__global__ void flags_kernel(unsigned* vals, unsigned* flags, int P) {
  const int G = gridDim.x, b = blockIdx.x;
  for (int i = 1; i <= P; ++i) {
    if (threadIdx.x == 0) {
      if (i > 1) {
        const unsigned* f = flags + (i - 1) * G;
        while (ld_relaxed(f + b) == 0 || ld_relaxed(f + (b + 1) % G) == 0) {
        }
        __threadfence();
      }
      vals[i * G + b] = step_value(vals + (i - 1) * G, b, G);
      __threadfence();
      atomicExch(flags + i * G + b, 1u);
    }
    __syncthreads();
  }
}

// Median microseconds of fn (enqueued on stream s) over `runs` runs after two warm-ups.
template <typename F>
double time_us(cudaStream_t s, int runs, F fn) {
  return 1000.0 * time_ms(fn, 2, runs, s);
}

// Checks the last phase's values against the host's recurrence (every method must compute the same chain).
bool check(const unsigned* d_last, int G, int P) {
  std::vector<unsigned> v(static_cast<size_t>(G), 0), w(static_cast<size_t>(G));
  for (int i = 1; i <= P; ++i) {
    for (int b = 0; b < G; ++b) w[b] = 1u + v[b] + v[(b + 1) % G];
    v.swap(w);
  }
  std::vector<unsigned> got(static_cast<size_t>(G));
  CK(cudaMemcpy(got.data(), d_last, G * sizeof(unsigned), cudaMemcpyDeviceToHost));
  return got == v;
}

void run(int G, int P, int runs) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned *vals = nullptr, *sync = nullptr;
  const size_t n = static_cast<size_t>(P + 1) * G;
  CK(cudaMalloc(&vals, n * sizeof(unsigned)));
  CK(cudaMalloc(&sync, n * sizeof(unsigned)));
  CK(cudaMemset(vals, 0, n * sizeof(unsigned)));

  // pdl: P kernels recorded once into a graph.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 1; i <= P; ++i) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(G);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, pdl_phase_kernel, static_cast<const unsigned*>(vals + (i - 1) * G),
                             vals + static_cast<size_t>(i) * G));
  }
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  const double pdl = time_us(s, runs, [&] { CK(cudaGraphLaunch(exec, s)); });
  const bool pdl_ok = check(vals + static_cast<size_t>(P) * G, G, P);

  CK(cudaMemset(vals, 0, n * sizeof(unsigned)));
  const double barrier = time_us(s, runs, [&] {
    CK(cudaMemsetAsync(sync, 0, (P + 1) * sizeof(unsigned), s));
    barrier_kernel<<<G, kThreads, 0, s>>>(vals, sync, P);
    CK(cudaGetLastError());
  });
  const bool barrier_ok = check(vals + static_cast<size_t>(P) * G, G, P);

  CK(cudaMemset(vals, 0, n * sizeof(unsigned)));
  const double flags = time_us(s, runs, [&] {
    CK(cudaMemsetAsync(sync, 0, n * sizeof(unsigned), s));
    flags_kernel<<<G, kThreads, 0, s>>>(vals, sync, P);
    CK(cudaGetLastError());
  });
  const bool flags_ok = check(vals + static_cast<size_t>(P) * G, G, P);

  // The memsets are inside the timed region of the persistent kernels: time them alone and take them off.
  const double memset_barrier =
      time_us(s, runs, [&] { CK(cudaMemsetAsync(sync, 0, (P + 1) * sizeof(unsigned), s)); });
  const double memset_flags = time_us(s, runs, [&] { CK(cudaMemsetAsync(sync, 0, n * sizeof(unsigned), s)); });
  std::printf("sync G=%d P=%d: pdl %.2f us/phase%s, barrier %.2f us/phase%s, flags %.2f us/phase%s\n", G, P, pdl / P,
              pdl_ok ? "" : " (WRONG VALUES)", (barrier - memset_barrier) / P, barrier_ok ? "" : " (WRONG VALUES)",
              (flags - memset_flags) / P, flags_ok ? "" : " (WRONG VALUES)");
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaFree(vals));
  CK(cudaFree(sync));
  CK(cudaStreamDestroy(s));
}

}  // namespace

// Entry point for cuda_kernel_bench ("sync"). The persistent kernels need every block resident at once: the grids
// are at most the resident capacity the occupancy API reports.
void bench_sync() {
  int dev = 0, sms = 0, per_sm_b = 0, per_sm_f = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_b, barrier_kernel, kThreads, 0));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_f, flags_kernel, kThreads, 0));
  const int per_sm = std::min({per_sm_b, per_sm_f, 2});
  for (int k = 1; k <= per_sm; ++k) run(k * sms, 64, 20);
}
