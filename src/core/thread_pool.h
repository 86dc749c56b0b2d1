// A small fixed thread pool for the CPU backend. parallel_for splits [0, n) into contiguous chunks.
// Calls from several threads at once (CPU ranks) are safe: a caller that finds the pool busy runs its
// loop inline, so ranks never wait on each other through the pool.
#pragma once

#include <cstdint>
#include <functional>

namespace mlaserve {

// Number of worker threads (MLASERVE_NUM_THREADS, else hardware concurrency).
int num_cpu_threads();

// fn(begin, end) over disjoint chunks covering [0, n); at least `grain` items per chunk.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace mlaserve
