// Kernel micro-benchmarks on the GPU (not a test): the MLA decode kernel alone (bytes of latent cache read per
// second; FLOP/s with 128 heads) and the grouped MoE GEMMs (bytes of expert weights read per second at decode
// batch sizes, FLOP/s at prefill sizes), and what one dependency between phases of GPU work costs (sync_bench.cu).
// Random data (fill_random), CUDA events, median of 20 runs after warm-up.
// usage: cuda_kernel_bench [mla [variant]|mla128|moe|moefp8|sync|layer [ctx]|all] (mla 9: the FP8-cache kernel)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/kernels.h"
#include "bench_util.h"

using namespace mlaserve::cuda;

namespace {

template <typename T>
T* dev(size_t n) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}
template <typename T>
T* upload(const std::vector<T>& v) {
  T* p = dev<T>(v.size());
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

int num_sms() {
  cudaDeviceProp p{};
  CK(cudaGetDeviceProperties(&p, 0));
  return p.multiProcessorCount;
}

// in_order: each sequence's pages consecutive (as a fresh page pool hands them out), else shuffled.
double bench_mla(int batch, int ctx, int nh, int page_size, int variant, bool wgmma = false, bool in_order = false) {
  const int kvr = 512, rope = 64, nope = 128, W = kvr + rope;
  const int64_t slots = static_cast<int64_t>(batch) * ctx;
  const int pages_per_seq = ctx / page_size;
  // kMlaDecodeFp8Variant: an FP8 cache (random codes of magnitude below 2^8, no NaN)
  const bool fp8 = variant == kMlaDecodeFp8Variant;
  bf16* cache = fp8 ? nullptr : dev<bf16>(slots * W);
  uint8_t* cache_f8 = fp8 ? dev<uint8_t>(slots * W) : nullptr;
  if (fp8) {
    std::vector<uint8_t> codes(static_cast<size_t>(slots) * W);
    uint64_t x = 88172645463325252ull;
    for (auto& c : codes) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      c = static_cast<uint8_t>(x & 0xf7);
    }
    CK(cudaMemcpy(cache_f8, codes.data(), codes.size(), cudaMemcpyHostToDevice));
  } else {
    CK(fill_random(cache, true, slots, W, 1, 0.0f, 1.0f, W, 0, 0, nullptr));
  }
  bf16* q_lat = dev<bf16>(static_cast<size_t>(batch) * nh * kvr);
  bf16* q = dev<bf16>(static_cast<size_t>(batch) * nh * (nope + rope));
  CK(fill_random(q_lat, true, static_cast<int64_t>(batch) * nh, kvr, 2, 0.0f, 0.05f, kvr, 0, 0, nullptr));
  CK(fill_random(q, true, static_cast<int64_t>(batch) * nh, nope + rope, 3, 0.0f, 0.1f, nope + rope, 0, 0, nullptr));
  std::vector<int32_t> table(static_cast<size_t>(batch) * pages_per_seq);
  std::iota(table.begin(), table.end(), 0);
  std::mt19937_64 rng(5);
  if (!in_order) std::shuffle(table.begin(), table.end(), rng);
  const int32_t chunk = mla_decode_split_keys(slots, batch, ctx, nh, kvr, rope, num_sms(), variant);
  std::vector<MlaDecodeItem> items;
  std::vector<MlaDecodeCombineItem> comb;
  int32_t partial = 0;
  for (int t = 0; t < batch; ++t) plan_decode_token(t, t, ctx, chunk, items, comb, partial);
  MlaDecodeParams p{};
  p.q_lat = q_lat;
  p.q = q;
  p.cache = cache;
  p.cache_f8 = cache_f8;
  p.page_table = upload(table);
  p.num_slots = wgmma ? slots : 0;  // 0: no warpgroup-MMA kernel
  p.items = upload(items);
  p.num_items = static_cast<int32_t>(items.size());
  p.num_heads = nh;
  p.kvr = kvr;
  p.rope = rope;
  p.nope = nope;
  p.page_size = page_size;
  p.max_pages = pages_per_seq;
  p.softmax_scale = 0.1f;
  p.variant = variant;
  p.out_lat = dev<bf16>(static_cast<size_t>(batch) * nh * kvr);
  p.partial_o = dev<float>(static_cast<size_t>(std::max(partial, 1)) * nh * kvr);
  p.partial_lse = dev<float>(static_cast<size_t>(std::max(partial, 1)) * nh);
  MlaDecodeCombineItem* d_comb = upload(comb);
  const double t_kernel = time_ms([&] { CK(mla_decode(p, true, nullptr)); });
  const double t_comb = time_ms([&] {
    CK(mla_decode_combine(d_comb, static_cast<int32_t>(comb.size()), p.partial_o, p.partial_lse, nh, kvr, p.out_lat,
                          nullptr));
  });
  const double bytes = static_cast<double>(slots) * W * (fp8 ? 1 : 2);
  const double flops = static_cast<double>(slots) * nh * (W + kvr) * 2;
  std::printf("mla_decode%s v%d batch %4d ctx %5d heads %3d page %2d%s: split %5d keys (%4zu blocks x %d groups)  "
              "kernel %7.3f ms"
              "  %5.2f TB/s  %6.1f TFLOP/s | +combine %6.3f ms -> %5.2f TB/s\n",
              wgmma ? " wgmma" : "", variant, batch, ctx, nh, page_size, in_order ? " in order" : "", chunk,
              items.size(),
              nh % 64 == 0 && (!fp8 || wgmma) ? nh / 64 : (nh + 15) / 16, t_kernel,
              bytes / t_kernel / 1e9, flops / t_kernel / 1e9, t_comb, bytes / (t_kernel + t_comb) / 1e9);
  CK(cudaFree(fp8 ? static_cast<void*>(cache_f8) : static_cast<void*>(cache)));
  CK(cudaFree(q_lat));
  CK(cudaFree(q));
  CK(cudaFree(p.out_lat));
  CK(cudaFree(p.partial_o));
  CK(cudaFree(p.partial_lse));
  return bytes / t_kernel / 1e9;
}

// k distinct random experts of E per token; n_touched: how many experts are named.
std::vector<int32_t> random_ids(int T, int E, int k, uint64_t seed, int& n_touched) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(T) * k);
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> all(static_cast<size_t>(E));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < k; ++j) ids[static_cast<size_t>(t) * k + j] = all[static_cast<size_t>(j)];
  }
  std::vector<char> touched(static_cast<size_t>(E), 0);
  for (int32_t e : ids) touched[static_cast<size_t>(e)] = 1;
  n_touched = static_cast<int>(std::count(touched.begin(), touched.end(), 1));
  return ids;
}

struct GroupBuffers {
  int32_t block_m, max_tiles;
  MoeGroupOut out;
};
// moe_group's outputs for T tokens of k experts of E, on the device.
GroupBuffers group_buffers(int T, int E, int k) {
  const int64_t P = static_cast<int64_t>(T) * k;
  const int32_t bm = moe_block_m(P, E), max_tiles = moe_max_tiles(T, k, E, bm);
  return {bm, max_tiles, MoeGroupOut{dev<int32_t>(E), dev<int32_t>(P), dev<float>(P), dev<int32_t>(P),
                                     dev<int32_t>(max_tiles), dev<int32_t>(1), dev<int32_t>(E)}};
}

// The grouped GEMMs' parameters for gate/up (x -> act) and down (act -> y) over moe_group's output g.
std::pair<MoeGemmParams, MoeGemmParams> moe_params(const bf16* x, const MoeGroupOut& g, const void* gu, const void* dn,
                                                   int32_t max_tiles, int H, int I, bf16* act, float* y) {
  MoeGemmParams gp{};
  gp.x = x;
  gp.pos_row = g.pos_row;
  gp.w = static_cast<const bf16*>(gu);
  gp.tiles = g.tiles;
  gp.num_tiles = g.num_tiles;
  gp.expert_end = g.expert_end;
  gp.max_tiles = max_tiles;
  gp.N = I;
  gp.K = H;
  gp.act = act;
  MoeGemmParams dp = gp;
  dp.x = act;
  dp.pos_row = nullptr;
  dp.w = static_cast<const bf16*>(dn);
  dp.N = H;
  dp.K = I;
  dp.act = nullptr;
  dp.y = y;
  dp.pos_weight = g.pos_weight;
  return {gp, dp};
}

void bench_moe(int T, int E, int k, int H, int I) {
  int n_touched = 0;
  const std::vector<int32_t> ids = random_ids(T, E, k, 9, n_touched);
  std::vector<float> w(ids.size(), 0.1f);
  int32_t* d_ids = upload(ids);
  float* d_w = upload(w);
  bf16* x = dev<bf16>(static_cast<size_t>(T) * H);
  CK(fill_random(x, true, T, H, 4, 0.0f, 1.0f, H, 0, 0, nullptr));
  bf16* gu = dev<bf16>(static_cast<size_t>(E) * 2 * I * H);
  bf16* dn = dev<bf16>(static_cast<size_t>(E) * H * I);
  CK(fill_random(gu, true, static_cast<int64_t>(E) * 2 * I, H, 5, 0.0f, 0.02f, H, 0, 0, nullptr));
  CK(fill_random(dn, true, static_cast<int64_t>(E) * H, I, 6, 0.0f, 0.02f, I, 0, 0, nullptr));
  const int64_t P = static_cast<int64_t>(T) * k;
  const auto [bm, max_tiles, g] = group_buffers(T, E, k);
  bf16* act = dev<bf16>(static_cast<size_t>(P) * I);
  float* y = dev<float>(static_cast<size_t>(P) * H);
  bf16* out = dev<bf16>(static_cast<size_t>(T) * H);
  const auto [gp, dp] = moe_params(x, g, gu, dn, max_tiles, H, I, act, y);
  const double t_group = time_ms([&] { CK(moe_group(d_ids, d_w, T, k, E, 0, bm, g, nullptr)); });
  const double t_gu = time_ms([&] { CK(moe_gemm_gate_up(gp, bm, nullptr)); });
  const double t_dn = time_ms([&] { CK(moe_gemm_down(dp, bm, nullptr)); });
  const double t_comb = time_ms([&] { CK(moe_combine(y, g.assign_pos, T, k, H, out, nullptr)); });
  const double b_gu = static_cast<double>(n_touched) * 2 * I * H * 2, b_dn = static_cast<double>(n_touched) * H * I * 2;
  const double f_gu = 2.0 * P * 2 * I * H, f_dn = 2.0 * P * H * I;
  std::printf("moe T %5d E %3d k %d H %4d I %4d (tile %3d, %d experts used): group %6.3f ms | gate_up %7.3f ms %6.0f GB/s "
              "%6.1f TFLOP/s | down %7.3f ms %6.0f GB/s %6.1f TFLOP/s | combine %6.3f ms | experts %7.3f ms %6.0f GB/s\n",
              T, E, k, H, I, bm, n_touched, t_group, t_gu, b_gu / t_gu / 1e6, f_gu / t_gu / 1e9, t_dn,
              b_dn / t_dn / 1e6, f_dn / t_dn / 1e9, t_comb, t_gu + t_dn, (b_gu + b_dn) / (t_gu + t_dn) / 1e6);
  for (void* pp : std::initializer_list<void*>{d_ids, d_w, x, gu, dn, act, y, out, g.expert_end, g.pos_row, g.pos_weight,
                                               g.assign_pos, g.tiles, g.num_tiles, g.expert_counts})
    CK(cudaFree(pp));
}

// FP8 experts (128 x 128 scale blocks; every code 0x34, so the times do not depend on the values) at decode sizes:
// the grouped kernels' shared-memory conversion (moe_gemm_*) against moe_fp8_decode; GB/s of the codes of the
// experts used.
void bench_moe_fp8(int T, int E, int k, int H, int I) {
  int n_touched = 0;
  const std::vector<int32_t> ids = random_ids(T, E, k, 19, n_touched);
  int32_t* d_ids = upload(ids);
  float* d_w = upload(std::vector<float>(ids.size(), 0.1f));
  bf16* x = dev<bf16>(static_cast<size_t>(T) * H);
  CK(fill_random(x, true, T, H, 4, 0.0f, 1.0f, H, 0, 0, nullptr));
  const size_t n_gu = static_cast<size_t>(E) * 2 * I * H, n_dn = static_cast<size_t>(E) * H * I;
  uint8_t* gu = dev<uint8_t>(n_gu);
  uint8_t* dn = dev<uint8_t>(n_dn);
  CK(cudaMemset(gu, 0x34, n_gu));
  CK(cudaMemset(dn, 0x34, n_dn));
  const int bs = 128;
  const size_t sb_gu = static_cast<size_t>(E) * ((2 * I + bs - 1) / bs) * ((H + bs - 1) / bs);
  float* s_gu = upload(std::vector<float>(sb_gu, 0.01f));
  float* s_dn = upload(std::vector<float>(static_cast<size_t>(E) * ((H + bs - 1) / bs) * ((I + bs - 1) / bs), 0.01f));
  const int64_t P = static_cast<int64_t>(T) * k;
  const auto [bm, max_tiles, g] = group_buffers(T, E, k);
  bf16* act = dev<bf16>(static_cast<size_t>(P) * I);
  float* y = dev<float>(static_cast<size_t>(P) * H);
  CK(moe_group(d_ids, d_w, T, k, E, 0, bm, g, nullptr));
  auto [gp, dp] = moe_params(x, g, gu, dn, max_tiles, H, I, act, y);
  gp.w_scale = s_gu;
  dp.w_scale = s_dn;
  gp.block_rows = gp.block_cols = dp.block_rows = dp.block_cols = bs;
  const double o_gu = time_ms([&] { CK(moe_gemm_gate_up(gp, bm, nullptr)); });
  const double o_dn = time_ms([&] { CK(moe_gemm_down(dp, bm, nullptr)); });
  const int sms = num_sms();
  const double n_gu_ms = time_ms([&] { CK(moe_fp8_decode(gp, true, E, P, sms, nullptr)); });
  const double n_dn_ms = time_ms([&] { CK(moe_fp8_decode(dp, false, E, P, sms, nullptr)); });
  const double b_gu = static_cast<double>(n_touched) * 2 * I * H, b_dn = static_cast<double>(n_touched) * H * I;
  std::printf("moe fp8 T %5d E %3d k %d H %4d I %4d (%3d experts used, %5.1f rows each): grouped gate_up %7.3f down "
              "%7.3f ms %5.0f GB/s | moe_fp8_decode gate_up %7.3f (%5.0f GB/s) down %7.3f (%5.0f GB/s) ms %5.0f GB/s\n",
              T, E, k, H, I, n_touched, static_cast<double>(P) / n_touched, o_gu, o_dn,
              (b_gu + b_dn) / (o_gu + o_dn) / 1e6, n_gu_ms, b_gu / n_gu_ms / 1e6, n_dn_ms, b_dn / n_dn_ms / 1e6,
              (b_gu + b_dn) / (n_gu_ms + n_dn_ms) / 1e6);
  for (void* pp : std::initializer_list<void*>{d_ids, d_w, x, gu, dn, s_gu, s_dn, act, y, g.expert_end, g.pos_row,
                                               g.pos_weight, g.assign_pos, g.tiles, g.num_tiles, g.expert_counts})
    CK(cudaFree(pp));
}

void bench_copy() {
  const size_t n = 2ull << 30;
  char* a = dev<char>(n);
  char* b = dev<char>(n);
  CK(cudaMemset(a, 1, n));
  const double t = time_ms([&] { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); });
  std::printf("device copy 2 GiB: %.3f ms -> %.2f TB/s (read + write)\n", t, 2.0 * n / t / 1e9);
  CK(cudaFree(a));
  CK(cudaFree(b));
}

}  // namespace

void bench_sync();  // sync_bench.cu
void bench_layer(int ctx);  // layer_stream_bench.cu
void bench_fp8_stream();  // fp8_stream_bench.cu

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "all";
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  CK(cudaSetDevice(0));
  if (what == "all" || what == "copy") bench_copy();
  if (what == "mla" && argc > 2) {
    // One variant only: cuda_kernel_bench mla V
    const int v = std::atoi(argv[2]);
    bench_mla(128, 4096, 16, 64, v);
    bench_mla(256, 1024, 16, 16, v);
    bench_mla(128, 4096, 16, 16, v);
    return 0;
  }
  if (what == "mla128") {  // 128 heads (V2 / V3 unsplit: one rank's heads under DP attention); 9: an FP8 cache
    bench_mla(128, 4096, 128, 64, 1);
    bench_mla(128, 4096, 128, 64, 1, true);
    bench_mla(128, 4096, 128, 16, 1, true);
    bench_mla(128, 4096, 128, 16, 1, true, true);
    bench_mla(128, 4096, 128, 64, kMlaDecodeFp8Variant);
    bench_mla(32, 4096, 128, 64, 1);
    bench_mla(32, 4096, 128, 64, 1, true);
    bench_mla(256, 1024, 128, 16, 1);
    bench_mla(256, 1024, 128, 16, 1, true);
    bench_mla(256, 1024, 128, 16, 1, true, true);
    bench_mla(32, 4096, 128, 64, kMlaDecodeFp8Variant);
    bench_mla(128, 4096, 128, 64, kMlaDecodeFp8Variant, true);
    bench_mla(128, 4096, 128, 16, kMlaDecodeFp8Variant, true);
    bench_mla(32, 4096, 128, 64, kMlaDecodeFp8Variant, true);
    bench_mla(256, 1024, 128, 16, kMlaDecodeFp8Variant, true);
    return 0;
  }
  if (what == "all" || what == "mla") {
    int best = 0;
    double best_bw = 0;
    for (int v = 0; v < kMlaDecodeVariants; ++v) {
      const double bw = bench_mla(128, 4096, 16, 64, v) + bench_mla(256, 1024, 16, 16, v);
      if (bw > best_bw) {
        best_bw = bw;
        best = v;
      }
    }
    bench_mla(128, 4096, 16, 16, best);
    std::printf("best_mla_variant %d\n", best);
    bench_mla(128, 4096, 128, 64, 0);
    bench_mla(128, 4096, 128, 64, 1);
  }
  if (what == "all" || what == "sync") bench_sync();
  if (what == "all" || what == "layer") bench_layer(argc > 2 && what == "layer" ? std::atoi(argv[2]) : 192);
  if (what == "all" || what == "fp8stream") bench_fp8_stream();
  if (what == "all" || what == "moefp8") {
    for (int T : {17, 32, 64, 128, 256, 384, 512}) bench_moe_fp8(T, 64, 6, 2048, 1408);  // V2-Lite
    for (int T : {64, 256, 1024, 1280, 1536}) bench_moe_fp8(T, 256, 8, 7168, 256);  // V3 at --tp 8, a rank's slice
  }
  if (what == "all" || what == "moe") {
    bench_moe(256, 64, 6, 2048, 1408);
    bench_moe(64, 64, 6, 2048, 1408);
    bench_moe(16384, 64, 6, 2048, 1408);
  }
  return 0;
}
