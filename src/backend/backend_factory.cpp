#include "backend/backend_factory.h"

#include "core/error.h"

namespace mlaserve {

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu" || device == "auto") return make_cpu_backend();
  if (device == "cuda")
    fail("--device cuda: this build has no CUDA backend (configure with -DMLASERVE_CUDA=ON)");
  fail("--device: expected auto, cpu or cuda, got '{}'", device);
}

}  // namespace mlaserve
