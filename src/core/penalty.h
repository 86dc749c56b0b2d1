// The sampler's penalties on one logit, shared by the CPU sampler (cpu::sample_row) and the GPU's (sampling.cu):
// repetition (logit > 0 ? logit / r : logit * r), then frequency (- f * count) and presence (- p), for a token
// generated `count` > 0 times. Plain C++17.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace mlaserve {

MLA_HOST_DEVICE inline float penalised_logit(float v, float repetition, float frequency, float presence,
                                             int32_t count) {
  if (repetition != 1.0f) v = v > 0.0f ? v / repetition : v * repetition;
  v -= frequency * static_cast<float>(count);
  return v - presence;
}

}  // namespace mlaserve
