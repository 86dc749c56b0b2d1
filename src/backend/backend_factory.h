// Picks the backend for --device (auto: CUDA when built with it and a GPU is present, else CPU).
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

namespace mlaserve {
std::unique_ptr<Backend> make_backend(const std::string& device);
}  // namespace mlaserve
