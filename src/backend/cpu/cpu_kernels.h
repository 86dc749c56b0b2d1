// CPU reference kernels. These define the semantics every other backend is tested against.
#pragma once

#include <cstdint>

#include "backend/backend.h"

namespace mlaserve::cpu {

// Element conversion between F32 / F16 / BF16 / F8_E4M3 / F8_E5M2 (to F32, BF16 or an FP8 type: f32_to_e4m3 /
// f32_to_e5m2 of the value).
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n);
// FP8 weights kept quantized, as F32: out[b][r][c] = f8[b][r][c] * scale[b][r / block_rows][c / block_cols] (w: B
// matrices of R x C codes; scale: [B, ceil(R / block_rows), ceil(C / block_cols)]). The reference of cuda::dequant_fp8
// (which rounds each product to bf16).
void dequant_fp8(const uint8_t* w, const float* scale, int64_t B, int64_t R, int64_t C, int64_t block_rows,
                 int64_t block_cols, float* out);
// INT4 weights kept quantized, as F32: out[b][r][c] = (code - zero) * scale, code the 4-bit value of column c (byte
// c / 2 of the row, the low nibble for even c), zero and scale [b][r][c / group] (w: B matrices of R x C / 2 bytes;
// scale, zero: [B, R, ceil(C / group)]; C even). The reference of cuda::dequant_int4 (which rounds each to bf16).
void dequant_int4(const uint8_t* w, const float* scale, const float* zero, int64_t B, int64_t R, int64_t C,
                  int64_t group, float* out);
// An R x C matrix quantized to FP8 in blocks of block_rows x block_cols (--quantization fp8): each block's scale is
// its largest magnitude / 448 (1 for an all-zero block), its codes f32_to_e4m3(w / scale); scales as dequant_fp8
// reads them ([ceil(R / block_rows), ceil(C / block_cols)]).
void quantize_fp8(const float* w, int64_t R, int64_t C, int64_t block_rows, int64_t block_cols, uint8_t* codes,
                  float* scales);

// counts[e] += the entries of ids [rows, k] equal to e, over the rows the `pairs` (first row, rows) name (null: all
// rows); entries outside [0, E) and rows past `rows` are skipped (Backend::count_experts).
void count_experts(const int32_t* ids, int64_t rows, int32_t k, const int32_t* pairs, int32_t npairs, int32_t E,
                   int64_t* counts);
// ids[t] < 0, -(k + 1), becomes prev[k] (0 when k >= n_prev); others stay (Backend::resolve_prev_ids).
void resolve_prev_ids(int32_t* ids, int64_t n, const int32_t* prev, int64_t n_prev);
void rmsnorm_row(const float* x, const float* w, int64_t D, float eps, float* out);
void silu_mul_row(const float* gate_up, int64_t I, float* out);
// Rotates adjacent pairs (x[2i], x[2i+1]) by angle pos * inv_freq[i]; cos/sin scaled by `factor`.
void rope_pairs(float* x, int64_t dim, int32_t pos, const float* inv_freq, float factor);
// y[N, M] = x[N, K] @ w[M, K]^T; w is F32 or BF16.
void linear(const float* x, int64_t N, int64_t K, const void* w, DType wdtype, int64_t M, float* y, bool parallel);

struct MlaArgs {
  const ForwardBatch* batch = nullptr;
  const float* q = nullptr;      // [T, nh, nope + rope], rope part already rotated
  const float* cache = nullptr;  // [slots, cache_width] = [c_kv (kvr) | k_pe (rope)]
  const uint8_t* cache_f8 = nullptr;  // instead of cache: the same rows as FP8 codes (read as their values)
  bool cache_e5m2 = false;            // cache_f8's codes are E5M2 (else E4M3)
  int64_t cache_width = 0;
  const void* kv_b = nullptr;    // [nh * (nope + v), kvr]: per head W_UK rows then W_UV rows
  DType kv_b_dtype = DType::F32;
  MlaParams p;
  float* out = nullptr;          // [T, nh, v]
};
void mla_attention(const MlaArgs& a);

// One more occurrence of `id` in a penalty list of unique ids: its count + 1, or a new entry (id, 1) at the end.
void count_token(std::vector<std::pair<int32_t, int32_t>>& counts, int32_t id);
// One row of Backend::sample (see RowSampling). work: [V] scratch. Writes the id and the log-probability.
void sample_row(const float* logits, int64_t V, const RowSampling& sp, float* work, int32_t* id, float* logprob);

void route_token(const float* logits, const float* bias, int64_t E, const RouterParams& p, int32_t* ids, float* weights);

struct MoeArgs {
  const float* x = nullptr;  // [T, H]
  int64_t T = 0, H = 0, k = 0, E = 0, I = 0;
  const int32_t* ids = nullptr;    // [T, k] global expert ids
  const float* weights = nullptr;  // [T, k]
  const void* gate_up = nullptr;   // [E, 2I, H]
  const void* down = nullptr;      // [E, H, I]
  DType wdtype = DType::BF16;
  int32_t expert_begin = 0;
  float* out = nullptr;  // [T, H]
};
void moe_experts(const MoeArgs& a);

}  // namespace mlaserve::cpu
