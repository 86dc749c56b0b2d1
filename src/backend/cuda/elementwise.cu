// Row and elementwise kernels: dummy-weight RNG, conversions, embedding, RMSNorm (+ residual add), SiLU-and-mul,
// add, row gather, RoPE on q and the latent-cache write. CPU references: backend/cpu/cpu_backend.cpp.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/prepare.cuh"
#include "core/random.h"

namespace mlaserve::cuda {

namespace {

int grid_for(int64_t n, int threads, int max_blocks = 65536) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<int>(b < max_blocks ? b : max_blocks);
}

__global__ void fill_random_kernel(void* out, bool out_bf16, int64_t n, int64_t cols, uint64_t seed, float mean,
                                   float stddev, int64_t full_cols, int64_t row_offset, int64_t col_offset) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    const uint64_t idx = static_cast<uint64_t>((r + row_offset) * full_cols + c + col_offset);
    // Explicit roundings: the CPU computes mean + stddev * u without a fused multiply-add.
    const float v = __fadd_rn(mean, __fmul_rn(stddev, unit_uniform(seed, idx)));
    if (out_bf16) static_cast<bf16*>(out)[i] = __float2bfloat16_rn(v);
    else static_cast<float*>(out)[i] = v;
  }
}

__global__ void bf16_to_f32_kernel(const bf16* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}
__global__ void f32_to_bf16_kernel(const float* in, bf16* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void resolve_prev_ids_kernel(int32_t* ids, int64_t n, const int32_t* prev, int64_t n_prev) {
  pdl_wait();
  pdl_trigger();
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t id = ids[t];
    if (id < 0) {
      const int64_t k = -static_cast<int64_t>(id) - 1;
      ids[t] = k < n_prev ? prev[k] : 0;
    }
  }
}

__global__ void count_experts_kernel(const int32_t* ids, int64_t rows, int32_t k, const int32_t* pairs,
                                     int32_t npairs, int32_t E, unsigned long long* counts) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k;
    bool real = pairs == nullptr;
    for (int32_t p = 0; p < npairs && !real; ++p) real = r >= pairs[2 * p] && r < pairs[2 * p] + pairs[2 * p + 1];
    const int32_t e = ids[i];
    if (real && e >= 0 && e < E) atomicAdd(counts + e, 1ull);
  }
}

__global__ void copy_kv_pages_kernel(char* const* layers, int32_t nlayers, int64_t page_bytes, char* host,
                                     const int32_t* pairs, bool to_host) {
  pdl_wait();
  const int32_t a = pairs[2 * blockIdx.x], b = pairs[2 * blockIdx.x + 1];
  const int64_t page = to_host ? a : b, slot = to_host ? b : a;
  char* d = layers[blockIdx.y] + page * page_bytes;
  char* h = host + (slot * nlayers + blockIdx.y) * page_bytes;
  char* dst = to_host ? h : d;
  const char* src = to_host ? d : h;
  if (page_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(h)) % 16 == 0) {
    for (int64_t i = threadIdx.x; i < page_bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int64_t i = threadIdx.x; i < page_bytes; i += blockDim.x) dst[i] = src[i];
  }
}

__global__ void embedding_kernel(const bf16* table, int64_t vocab_rows, int64_t H, int64_t vocab_begin,
                                 const int32_t* ids, bf16* out) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const int64_t id = static_cast<int64_t>(ids[t]) - vocab_begin;
  bf16* o = out + t * H;
  const bool inside = id >= 0 && id < vocab_rows;
  if ((H & 7) == 0) {
    const uint4* src = reinterpret_cast<const uint4*>(table + (inside ? id : 0) * H);
    uint4* dst = reinterpret_cast<uint4*>(o);
    for (int64_t i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = inside ? src[i] : make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x)
      o[i] = inside ? table[id * H + i] : __float2bfloat16_rn(0.0f);
  }
}

// One block per row. ADD: residual_out = bf16(residual + x) first, and the norm reads the rounded sum.
template <bool ADD>
__global__ void rmsnorm_kernel(const bf16* x, const bf16* residual, bf16* residual_out, const float* w, int64_t D,
                               float eps, bf16* out) {
  __shared__ float red[32];
  pdl_wait();
  const int64_t row = blockIdx.x;
  const bf16* xr = x + row * D;
  const bf16* rr = ADD ? residual + row * D : nullptr;
  bf16* ro = ADD ? residual_out + row * D : nullptr;
  const bf16* src = ADD ? ro : xr;
  bf16* o = out + row * D;
  float ss = 0.0f;
  const bool vec = (D & 7) == 0;
  if (vec) {
    for (int64_t i = threadIdx.x; i < D / 8; i += blockDim.x) {
      uint4 xv = reinterpret_cast<const uint4*>(xr)[i];
      if (ADD) xv = add_residual8(xv, reinterpret_cast<const uint4*>(rr)[i], reinterpret_cast<uint4*>(ro) + i);
      add_squares8(ss, xv);
    }
  } else {
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      float v = __bfloat162float(xr[i]);
      if (ADD) {
        const bf16 r = __float2bfloat16_rn(__bfloat162float(rr[i]) + v);
        ro[i] = r;
        v = __bfloat162float(r);
      }
      ss += v * v;
    }
  }
  ss = block_sum(ss, red);
  pdl_trigger();  // after this kernel's reads: the next kernel's early weight loads would hold them up
  const float inv = rms_inverse(ss, D, eps);
  if (vec) {
    for (int64_t i = threadIdx.x; i < D / 8; i += blockDim.x)
      reinterpret_cast<uint4*>(o)[i] = scale8(reinterpret_cast<const uint4*>(src)[i], w + i * 8, inv);
  } else {
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
      o[i] = __float2bfloat16_rn(w[i] * (__bfloat162float(src[i]) * inv));
  }
}

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// VEC: eight columns per thread with 16-byte loads and stores (I % 8 == 0, 16-byte aligned rows); the same values.
template <bool VEC>
__global__ void silu_mul_kernel(const bf16* gu, int64_t N, int64_t I, bf16* out) {
  pdl_wait();
  pdl_trigger();
  const int64_t w = VEC ? I / 8 : I, n = N * w;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / w, c = i - r * w;
    if constexpr (VEC) {
      const uint4* row = reinterpret_cast<const uint4*>(gu + r * 2 * I);
      float g[8], u[8];
      unpack8(row[c], g);
      unpack8(row[w + c], u);
#pragma unroll
      for (int j = 0; j < 8; ++j) g[j] = silu_times(g[j], u[j]);
      reinterpret_cast<uint4*>(out)[i] = pack8(g);
    } else {
      const bf16* row = gu + r * 2 * I;
      out[i] = __float2bfloat16_rn(silu_times(__bfloat162float(row[c]), __bfloat162float(row[I + c])));
    }
  }
}

template <bool VEC>
__global__ void add_kernel(bf16* a, const bf16* b, int64_t n) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (VEC ? n / 8 : n);
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (VEC) {
      float x[8], y[8];
      unpack8(reinterpret_cast<const uint4*>(a)[i], x);
      unpack8(reinterpret_cast<const uint4*>(b)[i], y);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] += y[j];
      reinterpret_cast<uint4*>(a)[i] = pack8(x);
    } else {
      a[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
    }
  }
}

__global__ void gather_rows_kernel(const char* x, int64_t row_bytes, const int32_t* rows, char* out) {
  pdl_wait();
  pdl_trigger();
  const int64_t r = blockIdx.x;
  const char* src = x + static_cast<int64_t>(rows[r]) * row_bytes;
  char* dst = out + r * row_bytes;
  if ((row_bytes & 15) == 0) {
    for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) dst[i] = src[i];
  }
}

__global__ void rope_q_kernel(bf16* q, int64_t T, int32_t nh, int32_t nope, int32_t rope, const int32_t* positions,
                              const float* inv_freq, float factor) {
  pdl_wait();
  pdl_trigger();
  rope_q_pairs(q, T * nh * (rope / 2), nh, nope, rope, positions, inv_freq, factor,
               blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
               static_cast<int64_t>(gridDim.x) * blockDim.x);
}

__global__ void write_latent_kernel(bf16* latent, int32_t kvr, int32_t rope, const float* w, float eps,
                                    const int32_t* positions, const int32_t* slots, const float* inv_freq,
                                    float factor, bf16* cache, uint8_t* cache_f8, bool e5m2) {
  pdl_wait();
  pdl_trigger();
  write_latent_row(blockIdx.x, latent, kvr, rope, w, eps, positions, slots, inv_freq, factor, cache, cache_f8, e5m2);
}

// Both in one launch: blocks [0, T) write the latent rows, the rest rotate q.
__global__ void rope_q_write_latent_kernel(MlaPrepArgs a) {
  pdl_wait();
  pdl_trigger();
  mla_prepare_block(a, blockIdx.x, gridDim.x);
}

}  // namespace

#ifdef MLASERVE_PROBE
std::vector<void* (*)()>& probe_buffers() {
  static std::vector<void* (*)()> b;
  return b;
}

void probe_start() {
  const unsigned header[2] = {1u, 0u};
  for (auto addr : probe_buffers()) cudaMemcpy(addr(), header, sizeof(header), cudaMemcpyHostToDevice);
}

void probe_dump(const char* path) {
  cudaDeviceSynchronize();
  FILE* f = std::fopen(path, "w");
  for (auto addr : probe_buffers()) {
    char* p = static_cast<char*>(addr());
    unsigned header[2] = {0u, 0u};
    cudaMemcpy(header, p, sizeof(header), cudaMemcpyDeviceToHost);
    const unsigned n = std::min(header[1], kProbeCap);
    std::vector<ProbeRecord> rec(n);
    cudaMemcpy(rec.data(), p + offsetof(ProbeBuf, rec), n * sizeof(ProbeRecord), cudaMemcpyDeviceToHost);
    const unsigned off[2] = {0u, 0u};
    cudaMemcpy(p, off, sizeof(off), cudaMemcpyHostToDevice);
    if (f)
      for (const ProbeRecord& r : rec) std::fprintf(f, "%llu %u %u %llu\n", r.grid, r.block, r.tag, r.time);
  }
  if (f) std::fclose(f);
}
#endif

bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MLASERVE_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

cudaError_t fill_random(void* out, bool out_bf16, int64_t rows, int64_t cols, uint64_t seed, float mean, float stddev,
                        int64_t full_cols, int64_t row_offset, int64_t col_offset, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  fill_random_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, out_bf16, n, cols, seed, mean, stddev, full_cols,
                                                             row_offset, col_offset);
  return cudaGetLastError();
}

cudaError_t convert_bf16_to_f32(const bf16* in, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  bf16_to_f32_kernel<<<grid_for(n, 256), 256, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}
cudaError_t convert_f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  f32_to_bf16_kernel<<<grid_for(n, 256), 256, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t resolve_prev_ids(int32_t* ids, int64_t n, const int32_t* prev, int64_t n_prev, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launch(resolve_prev_ids_kernel, grid_for(n, 256), 256, 0, stream, ids, n, prev, n_prev);
}

cudaError_t count_experts(const int32_t* ids, int64_t rows, int32_t k, const int32_t* pairs, int32_t npairs,
                          int32_t E, long long* counts, cudaStream_t stream) {
  if (rows * k == 0) return cudaSuccess;
  return launch(count_experts_kernel, grid_for(rows * k, 256, 1024), 256, 0, stream, ids, rows, k, pairs, npairs, E,
                reinterpret_cast<unsigned long long*>(counts));
}

cudaError_t copy_kv_pages(char* const* layers, int32_t nlayers, int64_t page_bytes, char* host, const int32_t* pairs,
                          int32_t npairs, bool to_host, cudaStream_t stream) {
  if (npairs == 0 || nlayers == 0) return cudaSuccess;
  return launch(copy_kv_pages_kernel, dim3(static_cast<unsigned>(npairs), static_cast<unsigned>(nlayers)), 256, 0,
                stream, layers, nlayers, page_bytes, host, pairs, to_host);
}

cudaError_t embedding(const bf16* table, int64_t vocab_rows, int64_t H, int64_t vocab_begin, const int32_t* ids,
                      int64_t T, bf16* out, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  return launch(embedding_kernel, static_cast<unsigned>(T), 128, 0, stream, table, vocab_rows, H, vocab_begin, ids, out);
}

static int norm_threads(int64_t D) { return D >= 4096 ? 512 : (D >= 1024 ? 256 : 128); }

cudaError_t rmsnorm(const bf16* x, const float* w, int64_t N, int64_t D, float eps, bf16* out, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  return launch(rmsnorm_kernel<false>, static_cast<unsigned>(N), norm_threads(D), 0, stream, x, nullptr, nullptr, w, D,
                eps, out);
}

cudaError_t add_rmsnorm(const bf16* x, const bf16* residual, bf16* residual_out, const float* w, int64_t N, int64_t D,
                        float eps, bf16* out, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  return launch(rmsnorm_kernel<true>, static_cast<unsigned>(N), norm_threads(D), 0, stream, x, residual, residual_out,
                w, D, eps, out);
}

cudaError_t silu_mul(const bf16* gate_up, int64_t N, int64_t I, bf16* out, cudaStream_t stream) {
  if (N * I == 0) return cudaSuccess;
  if (I % 8 == 0 && aligned16(gate_up) && aligned16(out))
    return launch(silu_mul_kernel<true>, grid_for(N * I / 8, 256), 256, 0, stream, gate_up, N, I, out);
  return launch(silu_mul_kernel<false>, grid_for(N * I, 256), 256, 0, stream, gate_up, N, I, out);
}

cudaError_t add_inplace(bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n % 8 == 0 && aligned16(a) && aligned16(b))
    return launch(add_kernel<true>, grid_for(n / 8, 256), 256, 0, stream, a, b, n);
  return launch(add_kernel<false>, grid_for(n, 256), 256, 0, stream, a, b, n);
}

cudaError_t gather_rows(const void* x, int64_t row_bytes, const int32_t* rows, int64_t R, void* out,
                        cudaStream_t stream) {
  if (R == 0 || row_bytes == 0) return cudaSuccess;
  return launch(gather_rows_kernel, static_cast<unsigned>(R), 128, 0, stream, static_cast<const char*>(x), row_bytes,
                rows, static_cast<char*>(out));
}

cudaError_t rope_q(bf16* q, int64_t T, int32_t nh, int32_t nope, int32_t rope, const int32_t* positions,
                   const float* inv_freq, float factor, cudaStream_t stream) {
  const int64_t n = T * nh * (rope / 2);
  if (n == 0) return cudaSuccess;
  return launch(rope_q_kernel, grid_for(n, 256), 256, 0, stream, q, T, nh, nope, rope, positions, inv_freq, factor);
}

cudaError_t write_latent(bf16* latent, int64_t T, int32_t kvr, int32_t rope, const float* norm_w, float eps,
                         const int32_t* positions, const int32_t* slots, const float* inv_freq, float factor,
                         bf16* cache, uint8_t* cache_f8, bool e5m2, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  return launch(write_latent_kernel, static_cast<unsigned>(T), 128, 0, stream, latent, kvr, rope, norm_w, eps, positions,
                slots, inv_freq, factor, cache, cache_f8, e5m2);
}

cudaError_t rope_q_write_latent(const MlaPrepArgs& a, cudaStream_t stream) {
  if (a.T == 0) return cudaSuccess;
  const int64_t pairs = a.T * a.nh * (a.rope / 2);
  const int64_t rope_blocks = std::min<int64_t>(std::max<int64_t>((pairs + 127) / 128, 1), 1024);
  return launch(rope_q_write_latent_kernel, static_cast<unsigned>(a.T + rope_blocks), 128, 0, stream, a);
}

}  // namespace mlaserve::cuda
