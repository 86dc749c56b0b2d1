// MLA_HOST_DEVICE: functions compiled for the CPU and, under nvcc, for the GPU too (one definition for a CUDA kernel
// and its CPU reference). Plain C++17.
#pragma once

#if defined(__CUDACC__)
#define MLA_HOST_DEVICE __host__ __device__
#else
#define MLA_HOST_DEVICE
#endif
