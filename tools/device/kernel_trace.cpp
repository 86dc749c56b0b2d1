// A kernel timeline for the GPU machine, which has no nsys: an LD_PRELOAD library that records every kernel's start
// and end on the GPU through CUPTI's activity API (graph-launched kernels one by one) and writes them as CSV
// ("Start (ns),Duration (ns),Name", mangled names) to $KT_OUT when the process exits. Read by tools/device/timeline.py
// (tools/device/trace_step.sh runs both). Tracing costs time: a V2-Lite batch-1 step measured 2.69 ms traced against
// 2.16 untraced, so gaps and the durations of short kernels are inflated; compare kernels within one trace only.
// build (here): g++ -O2 -shared -fPIC -I/usr/local/cuda/include tools/device/kernel_trace.cpp -o .devcarry/lib/libkt.so \
//                 -L/usr/local/cuda/lib -lcupti   (and copy libcupti.so.13 next to it)
// run:          KT_OUT=/tmp/kt.csv LD_PRELOAD=$PWD/.devcarry/lib/libkt.so mlaserve bench-one-batch ...
//               (LD_PRELOAD on the program itself: a wrapper such as timeout would write the file too)
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Row {
  unsigned long long start, end;
  std::string name;
};
std::mutex mu;
std::vector<Row> rows;
size_t buffers = 0, records = 0;

void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = 8 << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  ++buffers;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS)
    if (++records, rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      rows.push_back({k->start, k->end, k->name ? k->name : "?"});
    }
  std::free(buffer);
}

struct Tracer {
  Tracer() {
    const CUptiResult r1 = cuptiActivityRegisterCallbacks(requested, completed);
    const CUptiResult r2 = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (r1 != CUPTI_SUCCESS || r2 != CUPTI_SUCCESS)
      std::fprintf(stderr, "kernel_trace: CUPTI activity setup failed (%d, %d)\n", int(r1), int(r2));
    // Buffers are handed over every 50 ms by CUPTI's own thread: at exit the CUDA context may be gone already.
    cuptiActivityFlushPeriod(50);
  }
  ~Tracer() {
    const CUptiResult r = cuptiActivityFlushAll(1);
    std::lock_guard<std::mutex> lock(mu);
    std::fprintf(stderr, "kernel_trace: flush %d, %zu buffers, %zu records, %zu kernels\n", int(r), buffers, records,
                 rows.size());
    const char* out = std::getenv("KT_OUT");
    FILE* f = std::fopen(out ? out : "kt.csv", "w");
    if (!f) return;
    std::fprintf(f, "Start (ns),Duration (ns),Name\n");
    for (const Row& r : rows) {
      std::string n = r.name;
      for (char& c : n)
        if (c == ',' || c == '"') c = ' ';
      std::fprintf(f, "%llu,%llu,%s\n", r.start, r.end - r.start, n.c_str());
    }
    std::fclose(f);
  }
} tracer;

}  // namespace
