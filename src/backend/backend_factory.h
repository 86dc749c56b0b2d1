// Picks the backend for --device (auto: CUDA when built with it and a GPU is present, else CPU).
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

namespace mlaserve {

struct BackendOptions {
  double mem_fraction_static = 0.85;  // cuda: fraction of the GPU taken for weights + the latent KV pool
  int64_t scratch_bytes = 0;          // cuda: bytes of activation scratch (0: min(8 GiB, what is left))
  // cpu: graphs as recorded op closures (GraphRecorder), so CUDA-graph code paths run without a GPU (tests).
  bool cpu_graphs = false;
};

// device: auto (cuda when this build has it and a GPU is present, else cpu) | cpu | cuda.
// device_index: the local GPU (ignored on the CPU).
std::unique_ptr<Backend> make_backend(const std::string& device, int device_index = 0, const BackendOptions& opts = {});

}  // namespace mlaserve
