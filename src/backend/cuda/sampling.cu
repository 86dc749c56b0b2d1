// Sampling on the GPU, one block per row: penalties, temperature, top-k / top-p / min-p filters and a Gumbel-max
// draw whose noise is a counter-based function of (seed, step, token id), so it equals the CPU sampler
// (CpuBackend::sample, the reference) token for token. Thresholds are exact radix selections over the logits'
// ordered bit patterns (top-k: counts; top-p: probability mass), so ties at a threshold are all kept, as on the CPU.
#include <algorithm>
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "core/penalty.h"
#include "core/random.h"

namespace mlaserve::cuda {

namespace {

constexpr int kSampleThreads = 1024;

__device__ __forceinline__ uint32_t ordered_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block argmax (value desc, index asc) of (v, i); every thread gets the result.
__device__ void block_argmax(float& v, int& i, float* rv, int* ri) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) {
      v = ov;
      i = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    rv[warp] = v;
    ri[warp] = i;
  }
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? rv[lane] : 0.0f;
  i = lane < (blockDim.x >> 5) ? ri[lane] : -1;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) {
      v = ov;
      i = oi;
    }
  }
}

// Argmax of the row x[0, V) over the block (every thread gets it).
__device__ void row_argmax(const float* x, int64_t V, float& bv, int& bi, float* rv, int* ri) {
  bv = -INFINITY;
  bi = -1;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
    if (bi < 0 || x[v] > bv) {
      bv = x[v];
      bi = static_cast<int>(v);
    }
  block_argmax(bv, bi, rv, ri);
}

// sum of exp(x[v] - mx) over the row x[0, V) (every thread gets it).
__device__ float row_sum_exp(const float* x, int64_t V, float mx, float* red) {
  float z = 0.0f;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) z += expf(x[v] - mx);
  return block_sum(z, red);
}

// Plain greedy rows (temperature 0, no penalties) of a few rows are split over many blocks: block (b, r) writes the
// (max, lowest index of the max, sum of exp(x - max)) of parts c = b, b + gridDim.x, ... of row r to
// work[r * V + 3c ...]; sample_kernel merges the parts in order. Other rows return at once.
constexpr int kSplitThreads = 256, kMaxSplit = 64, kMinSplitLen = 1024;
__device__ __forceinline__ bool plain_greedy(const SampleRow& row) {
  return row.temperature <= 0.0f && row.penalty_begin == row.penalty_end && row.pending_input < 0 &&
         row.bias_begin == row.bias_end && row.mask_begin < 0;
}

// How many parts split each plain greedy row of a step of R rows: a few rows leave most SMs idle with one block each
// (256 blocks in all at most).
__host__ __device__ inline int32_t split_parts(int64_t R, int64_t V) {
  int64_t n = R > 1 ? 256 / R : 256;
  if (V / kMinSplitLen < n) n = V / kMinSplitLen;
  if (n > kMaxSplit) n = kMaxSplit;
  return static_cast<int32_t>(n < 1 ? 1 : n);
}

// The step's sampling parameters, read once per block (after the PDL wait: the upload before may still run).
__device__ __forceinline__ void load_step(const SampleStep* from, SampleStep& st) {
  if (threadIdx.x == 0) st = *from;
  __syncthreads();
}

__global__ void __launch_bounds__(kSplitThreads) greedy_parts_kernel(const SampleParams p) {
  pdl_wait();
  pdl_trigger();
  __shared__ float red[32];
  __shared__ int redi[32];
  __shared__ SampleStep st;
  load_step(p.step, st);
  const int64_t r = blockIdx.y;
  const int32_t parts = split_parts(st.R, p.V);
  if (r >= st.R || parts <= 1 || !plain_greedy(st.rows[r])) return;
  const int64_t len = (p.V + parts - 1) / parts;
  for (int32_t c = blockIdx.x; c < parts; c += gridDim.x) {  // (a padded launch: fewer blocks than the step's parts)
    const int64_t v0 = min(p.V, c * len), v1 = min(p.V, v0 + len);
    const float* lg = p.logits + r * p.V + v0;
    float bv;
    int bi;
    row_argmax(lg, v1 - v0, bv, bi, red, redi);
    const float z = st.logprobs && bi >= 0 ? row_sum_exp(lg, v1 - v0, bv, red) : 0.0f;
    if (threadIdx.x == 0) {
      float* part = p.work + r * p.V + 3 * c;
      part[0] = bv;
      part[1] = __int_as_float(bi < 0 ? -1 : static_cast<int>(v0) + bi);
      part[2] = z;
    }
  }
}

// x[tok] with the row's penalties for `cnt` occurrences (nothing for ids outside [0, V) or cnt <= 0).
__device__ __forceinline__ void penalise(float* x, int64_t V, const SampleRow& row, int32_t tok, int32_t cnt) {
  if (tok < 0 || tok >= V || cnt <= 0) return;
  x[tok] = penalised_logit(x[tok], row.repetition_penalty, row.frequency_penalty, row.presence_penalty, cnt);
}

__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const SampleParams p) {
  pdl_wait();
  pdl_trigger();
  __shared__ SampleStep st;
  load_step(p.step, st);
  __shared__ float red[32];
  __shared__ int redi[32];
  __shared__ float hist_mass[256];
  __shared__ int hist_cnt[256];
  __shared__ uint32_t sh_prefix;
  __shared__ float sh_mass_above;
  __shared__ int sh_need;

  const int64_t r = blockIdx.x;
  if (r >= st.R) return;
  const int32_t parts = split_parts(st.R, p.V);
  const int64_t V = p.V;
  const SampleRow& row = st.rows[r];  // read where used (L1): fewer registers live through the kernel
  const float* lg = p.logits + r * V;
  float* x = p.work + r * V;
  const int tid = threadIdx.x;

  const bool greedy = row.temperature <= 0.0f;
  if (plain_greedy(row) && parts > 1) {  // merge greedy_parts_kernel's parts: thread c reads part c (one load each)
    const float* part = x;
    float v = 0.0f, z = 0.0f;
    int i = -1;
    if (tid < parts) {
      v = part[3 * tid];
      i = __float_as_int(part[3 * tid + 1]);
      z = part[3 * tid + 2];
    }
    float m = v;
    int best = i;
    block_argmax(m, best, red, redi);  // (value desc, index asc), as the parts' own argmax
    if (tid == 0) p.ids[r] = best;
    if (st.logprobs) {
      const float zsum = block_sum(i >= 0 ? z * expf(v - m) : 0.0f, red);
      if (tid == 0) st.logprobs[r] = -logf(zsum);
    }
    return;
  }
  if (plain_greedy(row)) {  // plain argmax: read the logits in place
    float bv;
    int bi;
    row_argmax(lg, V, bv, bi, red, redi);
    if (st.logprobs) {
      const float z = row_sum_exp(lg, V, bv, red);
      if (tid == 0) st.logprobs[r] = -logf(z);
    }
    if (tid == 0) p.ids[r] = bi;
    return;
  }
  if (row.mask_begin >= 0) {  // constrained decoding: tokens outside the mask are never drawn
    const uint32_t* m = st.allowed + row.mask_begin;
    for (int64_t v = tid; v < V; v += blockDim.x)
      x[v] = v / 32 < row.mask_words && (m[v / 32] >> (v % 32) & 1u) ? lg[v] : -INFINITY;
  } else {
    for (int64_t v = tid; v < V; v += blockDim.x) x[v] = lg[v];
  }
  __syncthreads();
  for (int i = row.bias_begin + tid; i < row.bias_end; i += blockDim.x) {
    const int32_t tok = st.bias_tokens[i];
    if (tok >= 0 && tok < V) x[tok] += st.bias_values[i];
  }
  __syncthreads();
  // The pending token (a generated token still in flight when the row was built) counts once more: in its entry
  // when the list has one, else as an entry of its own (cpu::count_token).
  const int32_t pending = row.pending_input >= 0 ? st.input_ids[row.pending_input] : -1;
  bool listed = false;
  for (int i = row.penalty_begin + tid; i < row.penalty_end; i += blockDim.x) {
    const int32_t tok = st.penalty_tokens[i];
    const bool mine = tok == pending;
    listed |= mine;
    penalise(x, V, row, tok, st.penalty_counts[i] + (mine ? 1 : 0));
  }
  if (!__syncthreads_or(listed) && tid == 0) penalise(x, V, row, pending, 1);
  __syncthreads();
  if (!greedy)
    for (int64_t v = tid; v < V; v += blockDim.x) x[v] = x[v] / row.temperature;
  __syncthreads();

  float bv;
  int bi;
  row_argmax(x, V, bv, bi, red, redi);
  const float xmax = bv;
  float z = row_sum_exp(x, V, xmax, red);
  const float log_z = logf(z);
  if (greedy) {
    if (tid == 0) {
      p.ids[r] = bi;
      if (st.logprobs) st.logprobs[r] = -log_z;
    }
    return;
  }

  // top-k: the k-th largest key (exact, 4 radix passes of 8 bits).
  uint32_t kth_key = 0;
  if (row.top_k > 0 && row.top_k < V) {
    if (tid == 0) {
      sh_prefix = 0;
      sh_need = row.top_k;
    }
    for (int pass = 0; pass < 4; ++pass) {
      const int shift = 24 - 8 * pass;
      const uint32_t hi_mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
      for (int b = tid; b < 256; b += blockDim.x) hist_cnt[b] = 0;
      __syncthreads();
      const uint32_t prefix = sh_prefix;
      for (int64_t v = tid; v < V; v += blockDim.x) {
        const uint32_t k = ordered_key(x[v]);
        if ((k & hi_mask) == prefix) atomicAdd(&hist_cnt[(k >> shift) & 0xff], 1);
      }
      __syncthreads();
      if (tid == 0) {
        int need = sh_need;
        for (int b = 255; b >= 0; --b) {
          if (hist_cnt[b] >= need) {
            sh_prefix = prefix | (static_cast<uint32_t>(b) << shift);
            break;
          }
          need -= hist_cnt[b];
        }
        sh_need = need;
      }
      __syncthreads();
    }
    kth_key = sh_prefix;
  }

  // top-p over the top-k set: the largest key whose mass of keys >= it reaches top_p of the set's mass.
  uint32_t p_key = 0;
  if (row.top_p <= 0.0f) {
    p_key = ordered_key(xmax);
  } else if (row.top_p < 1.0f) {
    float zk = 0.0f;
    for (int64_t v = tid; v < V; v += blockDim.x)
      if (ordered_key(x[v]) >= kth_key) zk += expf(x[v] - xmax);
    zk = block_sum(zk, red);
    const float target = row.top_p * zk;
    if (tid == 0) {
      sh_prefix = 0;
      sh_mass_above = 0.0f;
    }
    for (int pass = 0; pass < 4; ++pass) {
      const int shift = 24 - 8 * pass;
      const uint32_t hi_mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
      for (int b = tid; b < 256; b += blockDim.x) hist_mass[b] = 0.0f;
      __syncthreads();
      const uint32_t prefix = sh_prefix;
      for (int64_t v = tid; v < V; v += blockDim.x) {
        const uint32_t k = ordered_key(x[v]);
        if (k >= kth_key && (k & hi_mask) == prefix) atomicAdd(&hist_mass[(k >> shift) & 0xff], expf(x[v] - xmax));
      }
      __syncthreads();
      if (tid == 0) {
        float above = sh_mass_above;
        int chosen = 0;
        for (int b = 255; b >= 0; --b) {
          if (above + hist_mass[b] >= target) {
            chosen = b;
            break;
          }
          above += hist_mass[b];
        }
        sh_prefix = prefix | (static_cast<uint32_t>(chosen) << shift);
        sh_mass_above = above;
      }
      __syncthreads();
    }
    p_key = sh_prefix;
  }
  const uint32_t min_key = kth_key > p_key ? kth_key : p_key;

  // Gumbel-max over the kept tokens.
  float best = -INFINITY;
  int besti = -1;
  for (int64_t v = tid; v < V; v += blockDim.x) {
    const float xv = x[v];
    if (ordered_key(xv) < min_key) continue;
    if (row.min_p > 0.0f && expf(xv - xmax) < row.min_p) continue;
    const float u = open_uniform(row.seed, row.step, static_cast<uint64_t>(v));
    const float s = xv - logf(-logf(u));
    if (besti < 0 || s > best) {
      best = s;
      besti = static_cast<int>(v);
    }
  }
  block_argmax(best, besti, red, redi);
  if (tid == 0) {
    p.ids[r] = besti;
    if (st.logprobs) st.logprobs[r] = x[besti] - xmax - log_z;
  }
}

}  // namespace

cudaError_t sample(const SampleParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  // The parts kernel runs when some row count the launch serves splits its rows (a padded launch's step may have
  // fewer rows than the launch, so more parts per row: its blocks then take several).
  if (split_parts(std::max<int64_t>(p.min_rows, 1), p.V) > 1) {
    const unsigned parts = static_cast<unsigned>(split_parts(p.rows, p.V));
    const cudaError_t e =
        launch(greedy_parts_kernel, dim3(parts, static_cast<unsigned>(p.rows)), kSplitThreads, 0, stream, p);
    if (e != cudaSuccess) return e;
  }
  return launch(sample_kernel, static_cast<unsigned>(p.rows), kSampleThreads, 0, stream, p);
}

}  // namespace mlaserve::cuda
