#include "backend/backend_factory.h"

#include "backend/forwarding_backend.h"
#include "core/error.h"
#ifdef MLASERVE_HAS_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace mlaserve {

std::unique_ptr<Backend> make_backend(const std::string& device_in, int device_index, const BackendOptions& opts) {
  std::string device = device_in;
  if (device == "auto") {
#ifdef MLASERVE_HAS_CUDA
    device = cuda_device_count() > 0 ? "cuda" : "cpu";
#else
    device = "cpu";
#endif
  }
  if (device == "cpu") {
    if (opts.cpu_graphs) return std::make_unique<GraphRecorder>(make_cpu_backend());
    return make_cpu_backend();
  }
  if (device == "cuda") {
#ifdef MLASERVE_HAS_CUDA
    MLA_CHECK(device_index < cuda_device_count(), "--device cuda: GPU {} requested but {} visible", device_index,
              cuda_device_count());
    CudaBackendOptions o;
    o.mem_fraction_static = opts.mem_fraction_static;
    o.scratch_bytes = opts.scratch_bytes;
    return make_cuda_backend(device_index, o);
#else
    (void)opts;
    fail("--device cuda: this build has no CUDA backend (configure with -DMLASERVE_CUDA=ON)");
#endif
  }
  fail("--device: expected auto, cpu or cuda, got '{}'", device_in);
}

}  // namespace mlaserve
