// Shared by the micro-benchmarks (cuda_kernel_bench.cpp, sync_bench.cu): CK(call) checks a CUDA runtime call (prints
// the failing call and exits); time_ms times a piece of GPU work.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

// Median milliseconds of f (work enqueued on `stream`) over `iters` runs, after `warmup` untimed ones; CUDA events.
inline double time_ms(const std::function<void()>& f, int warmup = 3, int iters = 20, cudaStream_t stream = nullptr) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) f();
  std::vector<float> ts;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a, stream));
    f();
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}
