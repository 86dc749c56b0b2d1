// CUDA kernel launchers: a plain C++17 header (no fmt / spdlog / backend.h) shared by the .cu files (nvcc,
// -std=c++17) and the CudaBackend (g++, C++20). Launchers take raw device pointers, sizes and a stream, enqueue
// their kernels and return the launch status (cudaGetLastError); they never synchronise or allocate.
//
// Element types: activations and the latent cache are bf16, norm weights and router logits fp32, ids int32.
// Every kernel has a CPU reference in backend/cpu (named in docs/cuda.md) and a test in tests/gpu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace mlaserve::cuda {

using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------------------------------------------------------
// Elementwise / row kernels (elementwise.cu)

// out[rows, cols] (bf16 if out_bf16 else f32) = mean + stddev * unit_uniform(seed, full index), the full index of
// element (r, c) being (r + row_offset) * full_cols + c + col_offset (core/random.h, bit-identical to the CPU).
cudaError_t fill_random(void* out, bool out_bf16, int64_t rows, int64_t cols, uint64_t seed, float mean, float stddev,
                        int64_t full_cols, int64_t row_offset, int64_t col_offset, cudaStream_t stream);

#ifdef MLASERVE_PROBE
// Probe builds: probe_start clears every kernel file's record buffer and turns recording on; probe_dump waits for the
// device, writes "grid block tag time_ns" lines of all buffers to `path` and turns recording off.
void probe_start();
void probe_dump(const char* path);
#endif

// out[n] = in[n] converted (bf16 <-> f32).
cudaError_t convert_bf16_to_f32(const bf16* in, float* out, int64_t n, cudaStream_t stream);
cudaError_t convert_f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream);

// out[T, H] = table[ids[t] - vocab_begin] when inside [0, vocab_rows), else 0.
// ids[t] < 0, -(k + 1), becomes prev[k] (0 when k >= n_prev). CPU reference: cpu::resolve_prev_ids.
cudaError_t resolve_prev_ids(int32_t* ids, int64_t n, const int32_t* prev, int64_t n_prev, cudaStream_t stream);
// counts[e] += the entries of ids [rows, k] equal to e over the rows that the device pairs (first row, rows) name
// (null: all rows); entries outside [0, E) skipped. CPU reference: cpu::count_experts.
cudaError_t count_experts(const int32_t* ids, int64_t rows, int32_t k, const int32_t* pairs, int32_t npairs,
                          int32_t E, long long* counts, cudaStream_t stream);

// The hierarchical cache's copies: for each of the npairs device pairs, (page, slot) when to_host else (slot, page),
// bytes [page * page_bytes, + page_bytes) of every layer l (device arrays layers[nlayers]) to / from host memory the
// device maps, at host + (slot * nlayers + l) * page_bytes. Waits for the kernels before it (PDL). CPU reference:
// Backend::copy_kv_pages.
cudaError_t copy_kv_pages(char* const* layers, int32_t nlayers, int64_t page_bytes, char* host, const int32_t* pairs,
                          int32_t npairs, bool to_host, cudaStream_t stream);

cudaError_t embedding(const bf16* table, int64_t vocab_rows, int64_t H, int64_t vocab_begin, const int32_t* ids,
                      int64_t T, bf16* out, cudaStream_t stream);

// out[N, D] = x * rsqrt(mean(x^2) + eps) * w (fp32 math). out may alias x.
cudaError_t rmsnorm(const bf16* x, const float* w, int64_t N, int64_t D, float eps, bf16* out, cudaStream_t stream);

// residual_out[N, D] = bf16(residual + x); out = rmsnorm(residual_out). out may alias x; residual_out may be residual
// (in place) and must not overlap it otherwise.
cudaError_t add_rmsnorm(const bf16* x, const bf16* residual, bf16* residual_out, const float* w, int64_t N, int64_t D,
                        float eps, bf16* out, cudaStream_t stream);

// out[N, I] = silu(gate_up[:, :I]) * gate_up[:, I:]   (gate_up: [N, 2I])
cudaError_t silu_mul(const bf16* gate_up, int64_t N, int64_t I, bf16* out, cudaStream_t stream);

// a[n] += b[n]
cudaError_t add_inplace(bf16* a, const bf16* b, int64_t n, cudaStream_t stream);

// out[r, :] = x[rows[r], :]  (rows of row_bytes bytes)
cudaError_t gather_rows(const void* x, int64_t row_bytes, const int32_t* rows, int64_t R, void* out,
                        cudaStream_t stream);

// Rotates adjacent pairs of the rope part of every head in place: q[T, nh, nope + rope].
// inv_freq: [rope / 2] (device); cos / sin scaled by `factor`.
cudaError_t rope_q(bf16* q, int64_t T, int32_t nh, int32_t nope, int32_t rope, const int32_t* positions,
                   const float* inv_freq, float factor, cudaStream_t stream);

// latent[T, kvr + rope]: c_kv = rmsnorm(c_kv) * norm_w, k_pe rotated; the row is written back in place and
// into cache[slots[t], :] (cache: [num_slots, kvr + rope]; cache_f8 instead: an FP8 cache of E4M3 codes, E5M2 when
// e5m2; MlaPrepArgs).
cudaError_t write_latent(bf16* latent, int64_t T, int32_t kvr, int32_t rope, const float* norm_w, float eps,
                         const int32_t* positions, const int32_t* slots, const float* inv_freq, float factor,
                         bf16* cache, uint8_t* cache_f8, bool e5m2, cudaStream_t stream);
// write_latent and rope_q (q: [T, nh, nope + rope]) in one launch, with the same results.
struct MlaPrepArgs {
  bf16* q;
  int64_t T;
  int32_t nh, nope, rope;
  bf16* latent;         // [T, kvr + rope]
  int32_t kvr;
  const float* norm_w;  // [kvr]
  float eps;
  const int32_t* positions;
  const int32_t* slots;
  const float* inv_freq;
  float factor;
  bf16* cache;
  uint8_t* cache_f8;    // instead of cache: an FP8 cache (rows written as codes; the latent keeps their values)
  bool cache_e5m2;      // cache_f8's codes are E5M2 (else E4M3)
};
cudaError_t rope_q_write_latent(const MlaPrepArgs& a, cudaStream_t stream);

// MLA attention of one decode token in one launch (mla_one_token.cu): the preparation (prep.T == 1), q_lat, the
// attention over the paged cache, the combine and W_UV, one thread-block cluster per head. out[h * v_head + i] as
// mla_prepare_attention gives it, the cache row written the same (q and latent are left as they were). The dims
// are DeepSeek's (every V2 / V3 model); the token's context (positions[0] + 1) at most kOneTokenMaxCtx keys (each
// block holds its share in shared memory: small enough to start as the kernel before leaves SMs; longer contexts
// lose to the usual kernels, measured at 1024 and 512).
constexpr int32_t kOneTokenCluster = 8, kOneTokenKvr = 512, kOneTokenRope = 64, kOneTokenNope = 128,
                  kOneTokenVHead = 128, kOneTokenMaxCtx = 256;
struct MlaOneTokenArgs {
  MlaPrepArgs prep;
  const int32_t* page_table;  // the token's page-table row
  int32_t page_size;
  const bf16* kv_b;  // [nh * (nope + v_head), kvr]: W_UK then W_UV rows of each head
  float softmax_scale;
  bf16* out;  // [nh * v_head]
};
// How many of mla_one_token's clusters the current device holds at once (0 unless it returns cudaSuccess).
cudaError_t mla_one_token_max_clusters(int32_t* clusters);
// Whether mla_one_token takes these dims: DeepSeek's MLA dims, and a cluster per head all on the GPU at once.
bool mla_one_token_fits(int32_t nh, int32_t nope, int32_t rope, int32_t v_head, int32_t kvr, int32_t max_clusters);
cudaError_t mla_one_token(const MlaOneTokenArgs& a, int32_t nh, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// MLA attention (mla_decode.cu, mla_prefill.cu)

// One unit of absorbed-form work: a token's keys [key_begin, key_end) (positions in its sequence).
struct MlaDecodeItem {
  int32_t token;       // row of q / out
  int32_t seq;         // row of the page table
  int32_t key_begin;   // first key position of this split
  int32_t key_end;     // one past the last key position
  int32_t partial;     // index of this split's partial row block, or -1: the only split, written to out directly
  int32_t cached_end = 0;  // keys below this were written by earlier steps: the fast kernels may load them before
                           // their PDL wait (0: none)
};

// Per token with more than one split: where its splits' partial results live.
struct MlaDecodeCombineItem {
  int32_t token;
  int32_t first_partial;
  int32_t num_partials;
};

struct MlaDecodeParams {
  const bf16* q_lat;       // [T, nh, kvr]    q_nope @ W_UK per head
  const bf16* q;           // [T, nh, nope + rope]: the rotated q_pe is read from here
  const bf16* cache;       // [num_slots, kvr + rope] = [num_pages * page_size, 576]
  const uint8_t* cache_f8; // instead of cache: the rows as FP8 codes (kFp8DecodeVariant, or the simple path)
  bool cache_e5m2;         // cache_f8's codes are E5M2 (else E4M3)
  const int32_t* page_table;  // [num_seqs, max_pages]
  int64_t num_slots = 0;      // rows of the cache (0: unknown; then no warpgroup-MMA kernel, which maps the cache)
  bool page_runs = true;      // warpgroup-MMA kernel: a tile over consecutive pages copied as one box
  const MlaDecodeItem* items; // [num_items]
  int32_t num_items;
  int32_t num_heads, kvr, rope, nope;
  int32_t page_size, max_pages;
  float softmax_scale;
  bf16* out_lat;           // [T, nh, kvr]: softmax(q k^T) @ c_kv per head
  float* partial_o;        // [num_partials, nh, kvr]: per split, normalised by its own softmax sum
  float* partial_lse;      // [num_partials, nh]: log2-sum-exp2 of the split's scaled scores
  // Fast-path pipeline (16-head groups; the backend uses kMlaDecodeDefaultVariant): 0: 32-key tiles, 2 stages,
  // 2 blocks/SM; 1: 3 stages; 2: 4 stages (1 block/SM); 3: 64-key tiles, 8 warps, 2 stages; 4: 32-key tiles, 8 warps,
  // QK^T dims split over warp pairs. Warp-specialised (a bulk-copy producer warp + 8 consumer warps, mbarrier ring,
  // Q in registers, one barrier per tile): 5: 32-key tiles, 5 stages, dims over warp pairs, 1 block/SM; 6: the same
  // with dims over 4 warps; 7: dims over 4 warps, 2 stages, 2 blocks/SM; 8: 64-key tiles, 2 stages, 1 block/SM.
  // 64-head groups: 1: 3 stages, else 2.
  int32_t variant = 0;
};
constexpr int kMlaDecodeVariants = 9;
constexpr int kMlaDecodeDefaultVariant = 7;  // measured fastest on H200 (docs/perf.md)
// Not a choice: the planners' variant for an FP8 cache (its kernel's occupancy; mla_decode takes it from cache_f8).
constexpr int kMlaDecodeFp8Variant = kMlaDecodeVariants;
// Absorbed-form attention over the paged latent cache (one KV head of 576 shared by all heads).
// Fast tensor-core path for kvr 512 / rope 64 (heads in groups of 16, 32 or 64); a simple path otherwise.
cudaError_t mla_decode(const MlaDecodeParams& p, bool allow_fast, cudaStream_t stream);
// The Hopper warpgroup-MMA kernel mla_decode takes for 64-head groups (kvr 512, rope 64, num_slots known): over a
// bf16 cache with pages of a multiple of 8 rows, or an FP8 cache; launched = false (nothing done) where it does not
// apply.
cudaError_t mla_decode_wgmma(const MlaDecodeParams& p, cudaStream_t stream, bool& launched);
cudaError_t mla_decode_wgmma_prepare();
// out_lat[token] = sum over splits of exp2(lse_i - lse) * partial_o_i
cudaError_t mla_decode_combine(const MlaDecodeCombineItem* items, int32_t num_items, const float* partial_o,
                               const float* partial_lse, int32_t num_heads, int32_t kvr, bf16* out_lat,
                               cudaStream_t stream);
// Keys per split the decode planner should use for num_tokens tokens with total_keys keys in all (longest max_ctx),
// chosen from the SM count: no split when the tokens alone fill a wave of blocks.
int32_t mla_decode_split_keys(int64_t total_keys, int64_t num_tokens, int64_t max_ctx, int32_t num_heads, int32_t kvr,
                              int32_t rope, int32_t num_sms, int32_t variant = kMlaDecodeDefaultVariant);

// Appends one decode token's work: its keys [0, ctx) in parts of at most `chunk` keys (equal parts in whole 64-key
// steps), each part writing its own partial result and one combine item gathering them; a single item writing the
// output directly when one part suffices. `row`: the token's page-table row; `partial`: the next free partial;
// `cached_end`: the keys its sequence had cached before this step (MlaDecodeItem::cached_end).
inline void plan_decode_token(int32_t token, int32_t row, int32_t ctx, int32_t chunk, std::vector<MlaDecodeItem>& items,
                              std::vector<MlaDecodeCombineItem>& combine, int32_t& partial, int32_t cached_end = 0) {
  const int32_t nsplit = (ctx + chunk - 1) / chunk;
  if (nsplit <= 1) {
    items.push_back({token, row, 0, ctx, -1, cached_end});
    return;
  }
  const int32_t len = ((ctx + nsplit - 1) / nsplit + 63) / 64 * 64;
  const int32_t first = partial;
  for (int32_t k0 = 0; k0 < ctx; k0 += len)
    items.push_back({token, row, k0, std::min(ctx, k0 + len), partial++, cached_end});
  combine.push_back({token, first, partial - first});
}

// Graph steps (CUDA graphs: the grid may not depend on the step): every decode token's keys in this many parts
// (some empty for short contexts), chosen from the token count so the blocks fill about one wave.
constexpr int32_t kMaxFixedSplits = 32;
int32_t mla_decode_fixed_splits(int64_t num_tokens, int32_t num_heads, int32_t kvr, int32_t rope, int32_t num_sms,
                                int32_t variant = kMlaDecodeDefaultVariant);

// Expanded-form (prefill) work: up to kPrefillBlockQ consecutive new tokens of one sequence.
constexpr int32_t kPrefillBlockQ = 128;
struct MlaPrefillItem {
  int32_t token_begin;  // first token row (q / out)
  int32_t num_tokens;   // <= kPrefillBlockQ
  int32_t pos_begin;    // position of the first token (the rest follow contiguously)
  int32_t kv_begin;     // first row of this sequence's context in kv / ctx_latent
};

struct MlaPrefillParams {
  const bf16* q;            // [T, nh, nope + rope] (rope part rotated)
  const bf16* kv;           // [L, nh, nope + v]   = kv_b_proj(c_kv) of every context position
  const bf16* ctx_latent;   // [L, kvr + rope]     gathered cache rows: k_pe read at column kvr
  const MlaPrefillItem* items;
  int32_t num_items;
  int32_t num_heads, nope, rope, v, kvr;
  float softmax_scale;
  bf16* out;                // [T, nh, v]
  int64_t num_q_rows;       // T
  int64_t num_ctx_rows;     // L
};
// Causal attention, expanded form. Hopper warpgroup MMAs fed by TMA for nope 128 / rope 64 / v 128 (q, kv and
// ctx_latent 16-byte aligned), a simple path otherwise.
cudaError_t mla_prefill(const MlaPrefillParams& p, bool allow_fast, cudaStream_t stream);

// ctx_latent[row, :] = cache[slot of (seq, pos)] for every context row; row_seq / row_pos: [L].
// cache_f8 instead of cache: an FP8 cache of E4M3 codes, E5M2 when e5m2 (their values in bf16).
cudaError_t mla_gather_context(const bf16* cache, const uint8_t* cache_f8, bool e5m2, int32_t width,
                               const int32_t* page_table, int32_t page_size, int32_t max_pages,
                               const int32_t* row_seq, const int32_t* row_pos, int64_t L, bf16* ctx_latent,
                               cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// MoE (moe.cu, moe_gemm*.cu)

enum class RouteMethod : int32_t { Greedy = 0, GroupLimitedGreedy = 1, NoauxTc = 2 };
struct RouteArgs {
  RouteMethod method = RouteMethod::Greedy;
  bool sigmoid = false;  // scoring function: sigmoid, else softmax
  int32_t top_k = 1, n_group = 1, topk_group = 1;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  int32_t n_fixed = 0, fixed_base = 0;  // after the picks, experts fixed_base + j (weight 1): k = top_k + n_fixed
  __host__ __device__ int32_t ids_per_token() const { return top_k + n_fixed; }
};
// ids[T, k], weights[T, k] from logits[T, E] (+ bias[E] or null). E <= 1024.
cudaError_t moe_route(const float* logits, const float* bias, int64_t T, int32_t E, const RouteArgs& a, int32_t* ids,
                      float* weights, cudaStream_t stream);

// Groups the T * k assignments by local expert (ids in [expert_begin, expert_begin + E)) into "positions":
//   expert_end[E]     one past the last position of each expert (positions of expert e: [end[e-1], end[e]))
//   pos_row[P]        token row of the assignment at each position (P <= T * k)
//   pos_weight[P]     its routing weight
//   assign_pos[T * k] position of each assignment, -1 when its expert is not local
//   tiles[max_tiles]  (expert << 20 | m_start) for every block_m-row tile of every expert; num_tiles[1]
// max_tiles must be >= ceil(T * k / block_m) + E.
struct MoeGroupOut {
  int32_t* expert_end;
  int32_t* pos_row;
  float* pos_weight;
  int32_t* assign_pos;
  int32_t* tiles;
  int32_t* num_tiles;
  int32_t* expert_counts;  // [E] tokens per expert (for the cuBLAS path and statistics)
  // [moe_group_hist_ints] scratch of the many-assignment path (two launches over many blocks); null or a size of 0:
  // one block groups them all.
  int32_t* hist = nullptr;
};
int64_t moe_group_hist_ints(int64_t T, int32_t k, int32_t E);
cudaError_t moe_group(const int32_t* ids, const float* weights, int64_t T, int32_t k, int32_t E, int32_t expert_begin,
                      int32_t block_m, const MoeGroupOut& out, cudaStream_t stream);
int32_t moe_max_tiles(int64_t T, int32_t k, int32_t E, int32_t block_m);
// Row tile the grouped GEMMs use for a given number of assignments per expert (64 for decode, 128 for prefill).
int32_t moe_block_m(int64_t assignments, int32_t E);

struct MoeGemmParams {
  const bf16* x;            // [T, H] activations (gate_up) or [P, I] (down: rows are positions)
  const int32_t* pos_row;   // gate_up: [P] row of x for each position; down: null (position = row)
  const bf16* w;            // gate_up: [E, 2I, H]; down: [E, H, I]
  const int32_t* tiles;
  const int32_t* num_tiles;
  const int32_t* expert_end;
  int32_t max_tiles;
  int32_t N, K;             // gate_up: N = I, K = H; down: N = H, K = I (K % 8 == 0)
  bf16* act;                // gate_up output [P, I] = silu(x W_gate^T) * (x W_up^T)
  float* y;                 // down output [P, H] = pos_weight * (act W_down^T)
  const float* pos_weight;  // [P]
  // FP8 experts: w holds F8_E4M3 codes, these their block scales ([E, ceil(rows / block_rows), ceil(K /
  // block_cols)] with rows = 2I or H), each tile made into bf16(code * scale) as dequant_experts makes it (K % 16 == 0,
  // block_cols % 16 == 0); null: bf16 weights.
  const float* w_scale = nullptr;
  int32_t block_rows = 0, block_cols = 0;
  // INT4 experts: w holds code pairs ([E, rows, K / 2], column 2 j in the low nibble), w_scale their group scales
  // (block_rows 1, block_cols the group: a multiple of 8, or >= K) and these the zero points (the same shape), each
  // tile made into bf16((code - zero) * scale) as dequant_experts makes it (K % 32 == 0).
  const float* w_zero = nullptr;
};
cudaError_t moe_gemm_gate_up(const MoeGemmParams& p, int32_t block_m, cudaStream_t stream);
cudaError_t moe_gemm_down(const MoeGemmParams& p, int32_t block_m, cudaStream_t stream);
// FP8 experts at decode sizes (moe_fp8_decode.cu): the same products as moe_gemm_gate_up / moe_gemm_down (gate_up
// true / false) over E local experts, the codes streamed into registers and made into bf16(code * scale) there (the
// dequantized model; only the summation order differs). For few rows per expert (kMoeFp8DecodeRowsPerExpert, a
// measured bound): each expert's weights are read once per 8-32 of its rows (the count of assignments sizes the
// passes). Needs moe_fp8_decode_fits; no tiles (expert_end, pos_row, pos_weight only).
constexpr int64_t kMoeFp8DecodeRowsPerExpert = 32;
bool moe_fp8_decode_fits(int64_t H, int64_t I, int64_t block_rows, int64_t block_cols);
cudaError_t moe_fp8_decode(const MoeGemmParams& p, bool gate_up, int32_t E, int64_t assignments, int32_t num_sms,
                           cudaStream_t stream);

// Each sets its kernels' dynamic-shared-memory attributes on the current device. The backend calls them at
// construction: setting a function attribute later, while another GPU of the process runs a collective, can block
// until that GPU is idle (seen as a deadlock with DP attention, one process driving two GPUs).
cudaError_t mla_decode_prepare();
cudaError_t mla_prefill_prepare();
cudaError_t moe_gemm_gate_up_prepare();
cudaError_t moe_gemm_down_prepare();

// out[t, :] = bf16(sum_j y[assign_pos[t * k + j], :]) over j in order, skipping -1; with add (the shared experts'
// output [T, H]) bf16(that + add[t, :]).
cudaError_t moe_combine(const float* y, const int32_t* assign_pos, int64_t T, int32_t k, int64_t H, bf16* out,
                        cudaStream_t stream, const bf16* add = nullptr);
// out[t, :] = bf16(sum_j pos_weight[p_j] * y[p_j, :]) with p_j = assign_pos[t * k + j] (skipping -1), y bf16; add
// as in moe_combine.
cudaError_t moe_combine_bf16(const bf16* y, const float* pos_weight, const int32_t* assign_pos, int64_t T, int32_t k,
                             int64_t H, bf16* out, cudaStream_t stream, const bf16* add = nullptr);
// xs[p, :] = x[pos_row[p], :] for p < P (P read from expert_end[E - 1]; rows up to max_p)
cudaError_t moe_gather_x(const bf16* x, int64_t H, const int32_t* pos_row, const int32_t* expert_end, int32_t E,
                         int64_t max_p, bf16* xs, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Small batches (gemv.cu): at most kGemvMaxRows token rows. Launched with programmatic dependent launch.

constexpr int kGemvMaxRows = 8;
// gemv_n takes at most kFewRows rows, moe_small kMoeSmallRows: they pay off against the batched cuBLAS GEMM and the
// grouped MoE kernels only up to there (measured on H200, docs/perf.md). Graph bucket sizes, so a padded graph step
// takes the path its eager step takes.
constexpr int kFewRows = 2;
constexpr int kMoeSmallRows = 4;
// FP8 experts on tensor cores (moe_small_tc_fits) take the small-batch MoE up to 16 rows: fp8_tile's mma holds 16
// tokens, and the grouped kernels convert every code of the experts they read in shared memory first.
constexpr int kMoeSmallTcRows = 16;
struct GemvArgs {
  const bf16* x;      // x[b][t][k] at x + b * sx + t * ldx + k
  int64_t ldx, sx;
  const bf16* w;      // gemv_t: W[b][n][k] at w + b * sw + n * ldw + k; gemv_n: W[b][k][n] at w + b * sw + k * ldw + n
  int64_t ldw, sw;
  void* y;            // y[b][t][n] at y + b * sy + t * ldy + n (elements of bf16, or f32 when y_f32)
  int64_t ldy, sy;
  int32_t T, N, K;
  bool y_f32;
  int32_t ks;         // set by the launcher
};
// Whether gemv_t takes x[T, K] (ldx) @ w[N, K] (ldw)^T: T in [1, kGemvMaxRows], K, ldx, ldw multiples of 8,
// x and w 16-byte aligned.
bool gemv_fits(int64_t T, int64_t K, const void* x, int64_t ldx, const void* w, int64_t ldw);
// y = x W^T for each of `batch` matrices (bf16 in, fp32 sums, bf16 or f32 out). num_sms sizes the K split. T >= 2 and
// K % 32 == 0: tensor cores (any T in [2, 8] costs about the same); else one warp per row (the faster at T = 1). Each
// token's result is independent of the others and of T within each kernel, so a graph step padded from T >= 2 rows to
// a larger bucket computes what the eager step does (T = 1 only ever pads to 1).
cudaError_t gemv_t(GemvArgs a, int32_t batch, int32_t num_sms, cudaStream_t stream);
// Two problems (a.T == b.T, a.K == b.K; one matrix each, e.g. two projections of the same x) in one launch. At 2-8
// rows each problem's rows are computed exactly as gemv_t computes them alone (two launches where gemv_t would take
// the lane kernel); at one row the K splits may be narrower than alone, so that the grid fits the GPU at once (the
// same products, summed in another order).
cudaError_t gemv_t_pair(GemvArgs a, GemvArgs b, int32_t num_sms, cudaStream_t stream);
// One token's add_rmsnorm as the input of a product (gemv_t_pair_norm): residual_out = bf16(residual + x), the row
// rmsnorm(residual_out) * w (eps). residual_out must not overlap residual or x.
struct AddNormIn {
  const bf16* x;
  const bf16* residual;
  bf16* residual_out;
  const float* w;
  float eps;
};
// gemv_t_pair at one row (a.T == b.T == 1) whose row is add_rmsnorm of n, computed by every block itself (a.x, b.x
// unused; one block writes residual_out): no norm launch, and the row never goes through global memory. The norm
// kernel's arithmetic over 256 threads: the same bits as add_rmsnorm then gemv_t_pair where add_rmsnorm uses 256
// threads (1024 <= K < 4096). K <= kPairNormMaxK, a multiple of 8.
constexpr int kPairNormMaxK = 8192;
cudaError_t gemv_t_pair_norm(GemvArgs a, GemvArgs b, const AddNormIn& n, int32_t num_sms, cudaStream_t stream);
// MLA's W_UV product at one token with the decode combine folded in: y[h] = o_lat[h] W_UV[h]^T for the nh heads
// (a.T == 1; W_UV[h]: a.N rows of a.K = kvr at a.w + h * a.sw; o_lat[h] at a.x + h * a.sx; y[h] at a.y + h * a.sy).
// With `item` (the token's MlaDecodeCombineItem, on the device) each block sums its head's splits from partial_o /
// partial_lse itself, as mla_decode_combine would (o_lat is not written); without, it reads o_lat, which the decode
// kernel wrote (one split). a.K <= kCombineUvMaxK; a.sw, a.sx multiples of 8.
constexpr int kCombineUvMaxK = 1024;
cudaError_t mla_combine_uv(GemvArgs a, int32_t nh, const MlaDecodeCombineItem* item, const float* partial_o,
                           const float* partial_lse, cudaStream_t stream);
// y = x W for each of `batch` matrices, bf16 out (T <= kFewRows, N and ldw multiples of 8, w 16-byte aligned).
cudaError_t gemv_n(GemvArgs a, int32_t batch, cudaStream_t stream);
// gemv_n and rope_q_write_latent(prep) in one launch (an extra row of blocks), with the same results: MLA decode's
// q_lat product reads only q's nope part, which the preparation leaves alone. prep.T == a.T.
cudaError_t gemv_n_prepare(GemvArgs a, int32_t batch, const MlaPrepArgs& prep, cudaStream_t stream);

// Router and routing in one kernel (moe_route of y = x router^T, logits fp32 in a.y with ldy == N experts):
// ids[T, top_k], weights[T, top_k] as moe_route gives them from the logits (a warp per expert row, full K: the sums
// may differ from gemv_t's K split in the last bit). E <= kMoeGateMaxExperts; T as moe_gate_fits says: up to 64
// experts (at most 8 blocks of 8 warps, one thread-block cluster) one or kMoeGateClusterRows tokens, each routed by
// a block of its own; more experts one token (the last block to finish routes it; one block routing token after
// token lost to gemv_t + moe_route at 2-8 rows, docs/perf.md). counter: a device word, 0 before the first launch
// (left 0 after each).
constexpr int kMoeGateMaxExperts = 256;
constexpr int kGateClusterMax = 8;      // blocks of the cluster path (the portable cluster size)
constexpr int kMoeGateClusterRows = 2;  // tokens the cluster path also takes
bool moe_gate_fits(int64_t T, int64_t E);
cudaError_t moe_gate(GemvArgs a, const float* bias, const RouteArgs& r, unsigned* counter, int32_t* ids,
                     float* weights, cudaStream_t stream);
// moe_gate at one row (a.T == 1) whose row is add_rmsnorm of n, computed by every block (a.x unused), as
// gemv_t_pair_norm does; one block writes residual_out, and the row to normed (the experts' input). K <= kPairNormMaxK.
cudaError_t moe_gate_norm(GemvArgs a, const float* bias, const RouteArgs& r, const AddNormIn& n, bf16* normed,
                          unsigned* counter, int32_t* ids, float* weights, cudaStream_t stream);
constexpr int kMoeSmallMaxK = 16;
struct MoeSmallArgs {
  const bf16* x;                 // [T, H] (row stride ldx)
  int64_t ldx;
  int32_t T, H;
  const int32_t* ids;            // [T, k] global expert ids
  const float* weights;          // [T, k]
  int32_t k;
  const bf16* gate_up;           // [E, 2I, H] local experts (gate rows then up rows)
  const bf16* down;              // [E, H, I]
  int32_t E, I, expert_begin;
  const bf16* shared_gate_up;    // [2 Is, H] or null (Is = 0)
  const bf16* shared_down;       // [H, Is]
  int32_t Is;
  bf16* act;                     // scratch [T * k, I]
  bf16* act_shared;              // scratch [T, Is]
  bf16* out;                     // [T, H] (row stride ldo) = routed experts (+ shared experts)
  int64_t ldo;
  // FP8 routed experts: gate_up / down hold F8_E4M3 codes, these their scales ([E, ceil(2I / br), ceil(H / bc)] and
  // [E, ceil(H / br), ceil(I / bc)], block_cols % 8 == 0); null: bf16 experts. With H, I and Is multiples of 64 and
  // block_cols a power-of-two multiple of 64, on tensor cores (each code's exact value, scaled per 64-column chunk in
  // f32: within the bf16 rounding of code * scale of the dequantized model); else 8 codes per 8-byte vector, each
  // times its block's scale and rounded to bf16 as dequant_experts rounds it (bit for bit the dequantized model).
  const float* gate_up_scale = nullptr;
  const float* down_scale = nullptr;
  int32_t block_rows = 0, block_cols = 0;
  // INT4 routed experts (moe_small_tc_fits of their group only): gate_up / down hold code pairs ([E, 2I, H / 2] and
  // [E, H, I / 2], column 2 j in the low nibble), the scales above per row and group (block_rows 1, block_cols the
  // group) and these their zero points (integers in [0, 16]; the same shapes). On tensor cores: (code - zero) . x
  // scaled per group in f32, within the bf16 rounding of (code - zero) * scale of the dequantized model.
  const float* gate_up_zero = nullptr;
  const float* down_zero = nullptr;
  // Every token's last n_fixed ids are the last n_fixed local experts (E - n_fixed + j) with weight 1 (shared experts
  // fused into the routed ones): at one token on tensor cores their tiles come first, loaded before the wait and
  // computed before the routing is read; elsewhere they go with the routed ones.
  int32_t n_fixed = 0;
};
// out = sum_k w * down_e(silu(gate_e x) * up_e x) over the local experts, rounded, plus the shared experts' MLP,
// rounded (as moe_experts + the dense shared MLP + add compute it). T <= kMoeSmallRows (kMoeSmallTcRows for FP8
// or INT4 experts on tensor cores), k <= kMoeSmallMaxK, H, I, Is multiples of 8. Two kernels (gate/up, persistent
// over a few blocks per SM of num_sms; down), the blocks finding the distinct experts from the ids themselves or
// (down, 2+ tokens) from gate/up's copy in plan_buf (16-byte aligned, moe_small_plan_bytes() bytes); no host sync.
size_t moe_small_plan_bytes();
// Whether moe_small runs FP8 (INT4) experts of these widths and scale blocks (groups) on tensor cores (then up to
// kMoeSmallTcRows tokens): H, I and Is multiples of 64, block_cols a power-of-two multiple of 64.
bool moe_small_tc_fits(int64_t H, int64_t I, int64_t Is, int64_t block_cols);
cudaError_t moe_small(MoeSmallArgs a, void* plan_buf, int32_t num_sms, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Weights kept quantized (dequant.cu)

struct DequantArgs {
  const uint8_t* w;      // FP8: [B, R, C] F8_E4M3 codes; INT4 (zero given): [B, R, C / 2] code pairs, column 2 j in
                         // the low nibble
  const float* scale;    // [B, ceil(R / block_rows), ceil(C / block_cols)]
  const float* zero = nullptr;  // INT4: each group's zero point (the scales' shape; block_rows 1, block_cols the group)
  int64_t B, R, C;       // C % 8 == 0
  int64_t block_rows, block_cols;  // block_cols % 8 == 0 (INT4: or >= C, one group per row)
  const int32_t* ids;    // null: every matrix; else only the matrices b that some ids[i] - expert_begin names
  int64_t num_ids;
  int32_t expert_begin;
  bf16* out;             // [B, R, C]: bf16(f8 * scale) or bf16((code - zero) * scale) of the element's block or
                         // group, each product rounded once as the host rounds it (matrices not named are left as
                         // they are)
};
// Launched without PDL: it waits for the kernels before it (the routing ids), and the kernels after it may read its
// output before their own PDL wait only through a kernel that waited. CPU references: the loader's dequantization
// (F8 -> f32 times the block's scale, rounded to bf16 on upload), cpu::dequant_int4 rounded to bf16.
cudaError_t dequant_experts(const DequantArgs& a, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Sampling (sampling.cu)

struct SampleRow {
  float temperature;         // 0: greedy
  int32_t top_k;             // <= 0: off
  float top_p;               // >= 1: off
  float min_p;               // <= 0: off
  float frequency_penalty, presence_penalty, repetition_penalty;
  uint64_t seed, step;
  int32_t penalty_begin, penalty_end;  // range in the penalty list
  int32_t pending_input;               // >= 0: input_ids[pending_input] is one more generated token (RowSampling)
  int32_t bias_begin, bias_end;        // range in the logit-bias list (ids unique within a row)
  int32_t mask_begin, mask_words;      // constrained decoding: the row's allowed-token bits in `allowed` (-1: none)
};
// What a step's sampling reads that changes from step to step, in device memory: a recorded graph's launch reads
// the step's own (staged before each replay at a fixed address).
struct SampleStep {
  int64_t R;                 // rows to sample (at most the launch's rows; the blocks of later rows return at once)
  const SampleRow* rows;     // [R]
  const int32_t* penalty_tokens;  // token ids of all rows' penalty lists
  const int32_t* penalty_counts;  // counts
  const int32_t* input_ids;       // the step's input ids, resolved (read for rows with pending_input >= 0)
  const int32_t* bias_tokens;     // token ids of all rows' logit-bias lists
  const float* bias_values;       // their biases (added to the logits before the penalties)
  const uint32_t* allowed;        // rows' allowed-token bitmasks (tokens without a set bit are never drawn)
  float* logprobs;           // [R] out or null
};
struct SampleParams {
  const float* logits;       // [rows, V]
  int64_t rows, V;           // the launch's rows (its grid), at least step->R
  int64_t min_rows;          // the fewest rows step->R may have (eager: rows; a graph's launch: 1)
  float* work;               // [rows, V] scratch
  int32_t* ids;              // [rows] out (the first step->R written)
  const SampleStep* step;    // device memory
};
// Plain greedy rows of a few rows are split into parts that depend only on (step->R, V), however many rows the launch
// has (its blocks then take several parts each): the same sums, so the same outputs, padded or not.
cudaError_t sample(const SampleParams& p, cudaStream_t stream);

}  // namespace mlaserve::cuda
