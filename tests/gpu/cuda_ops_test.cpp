// Every CUDA backend op against the CPU reference backend on the same (bf16-exact) inputs, with hostile data:
// NaN in every cache slot no sequence owns, shuffled page tables, contexts of 1 and on page boundaries, splits of
// long contexts, experts that receive no tokens, batches of zero tokens.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <random>

#include <fmt/format.h>

#include "backend/cpu/cpu_kernels.h"
#include "backend/cuda/kernels.h"
#include "gpu_test_util.h"
#include "model/forward_batch.h"
#include "test_util.h"

namespace mlaserve::test {
namespace {

// A batch of sequences (prefix, new tokens) with pages taken from a shuffled pool of `num_pages`, or (runs) in
// order as a fresh PagePool hands them out, except that each sequence of more than 8 pages has its middle page
// swapped with a spare one far away (so its tiles are consecutive pages but one or two).
struct Scenario {
  ForwardBatch batch;
  int64_t num_pages = 0;
  std::vector<std::vector<int32_t>> pages;
};

Scenario make_scenario(const std::vector<std::pair<int32_t, int32_t>>& seqs, int32_t page_size, uint64_t seed,
                       int32_t vocab = 100, bool runs = false) {
  Scenario s;
  int64_t need = 0;
  for (auto [prefix, q] : seqs) need += (prefix + q + page_size - 1) / page_size;
  s.num_pages = need + 7 + (runs ? static_cast<int64_t>(seqs.size()) : 0);  // spare pages nobody owns
  std::vector<int32_t> pool(static_cast<size_t>(s.num_pages));
  std::iota(pool.begin(), pool.end(), 0);
  std::mt19937_64 rng(seed);
  if (!runs) std::shuffle(pool.begin(), pool.end(), rng);
  ForwardBatchBuilder bb(page_size);
  size_t next = 0;
  for (auto [prefix, q] : seqs) {
    const int32_t n = (prefix + q + page_size - 1) / page_size;
    std::vector<int32_t> pages(pool.begin() + static_cast<int64_t>(next), pool.begin() + static_cast<int64_t>(next + n));
    next += n;
    if (runs && n > 8) pages[static_cast<size_t>(n / 2)] = static_cast<int32_t>(s.num_pages - s.pages.size() - 1);
    std::vector<int32_t> toks(static_cast<size_t>(q));
    for (auto& t : toks) t = static_cast<int32_t>(rng() % vocab);
    bb.add(toks, prefix, pages, true);
    s.pages.push_back(pages);
  }
  s.batch = bb.finish();
  return s;
}

void begin(const ForwardBatch& b) {
  cpu().begin_step(b);
  gpu().begin_step(b);
}

// Embeds the current step's T ids on both backends from one random table [40, 64] (vocabulary shard from vocab_begin)
// and expects the same rows exactly.
void expect_same_embedding(int64_t T, int64_t vocab_begin, uint64_t seed, const std::string& what) {
  Tensor table = rand_host({40, 64}, seed);
  Tensor tc = cpu().upload(table, DType::BF16), tg = gpu().upload(table, DType::BF16);
  Tensor oc = cpu().scratch({T, 64}, DType::F32), og = gpu().scratch({T, 64}, DType::BF16);
  cpu().embedding(tc, vocab_begin, oc);
  gpu().embedding(tg, vocab_begin, og);
  expect_close(cpu().to_host_f32(oc), gpu().to_host_f32(og), 0.0, 0.0, what);
}

TEST(CudaOps, FillRandomIsBitIdentical) {
  REQUIRE_GPU();
  for (DType dt : {DType::BF16, DType::F32}) {
    Tensor c = cpu().alloc({37, 100}, dt), g = gpu().alloc({37, 100}, dt);
    cpu().fill_random(c, 12345, 0.5f, 0.02f, 1000, 11, 300);
    gpu().fill_random(g, 12345, 0.5f, 0.02f, 1000, 11, 300);
    Tensor ch = cpu().to_host_f32(c), gh = gpu().to_host_f32(g);
    int64_t diffs = 0;
    for (int64_t i = 0; i < ch.numel(); ++i) diffs += ch.data_as<float>()[i] != gh.data_as<float>()[i];
    EXPECT_EQ(diffs, 0) << dtype_name(dt);
  }
}

TEST(CudaOps, EmbeddingShard) {
  REQUIRE_GPU();
  Scenario s = make_scenario({{0, 5}, {3, 4}}, 4, 1, 60);
  s.batch.input_ids[0] = 5;   // below the shard
  s.batch.input_ids[1] = 59;  // above it
  begin(s.batch);
  expect_same_embedding(s.batch.num_tokens(), 10, 2, "embedding (exact)");
}

TEST(CudaOps, PrevIdsFeedTheEmbedding) {
  REQUIRE_GPU();
  // Ids -(k + 1) read the previous step's samples kept on the device (k past them: id 0), others stay.
  Scenario s = make_scenario({{0, 5}, {3, 1}, {9, 1}}, 4, 3, 40);
  const int32_t n_prev = 3;
  s.batch.input_ids[0] = -1;
  s.batch.input_ids[2] = -3;
  s.batch.input_ids[5] = -2;
  s.batch.input_ids[6] = -(n_prev + 2);  // out of range
  begin(s.batch);
  Tensor prev_h = Tensor::empty_host({n_prev}, DType::I32);
  const int32_t prev_ids[n_prev] = {17, 33, 4};
  std::copy(prev_ids, prev_ids + n_prev, prev_h.data_as<int32_t>());
  Tensor pc = cpu().alloc({n_prev}, DType::I32), pg = gpu().alloc({n_prev}, DType::I32);
  cpu().upload_into(prev_h, pc);
  gpu().upload_into(prev_h, pg);
  cpu().resolve_prev_ids(pc);
  gpu().resolve_prev_ids(pg);
  const int64_t T = s.batch.num_tokens();
  expect_same_embedding(T, 0, 5, "embedding of resolved ids (exact)");
  // The CPU reference itself: row 0 is table[17], row 6 table[0].
  std::vector<int32_t> ids(s.batch.input_ids);
  cpu::resolve_prev_ids(ids.data(), T, prev_ids, n_prev);
  EXPECT_EQ(ids[0], 17);
  EXPECT_EQ(ids[2], 4);
  EXPECT_EQ(ids[5], 33);
  EXPECT_EQ(ids[6], 0);
  EXPECT_EQ(ids[1], s.batch.input_ids[1]);
}

TEST(CudaOps, AsyncDownloadsFinishInOrder) {
  REQUIRE_GPU();
  Tensor h = rand_host({3000}, 9);
  Tensor a = gpu().alloc({3000}, DType::F32), b = gpu().alloc({1000}, DType::F32);
  gpu().upload_into(h, a);
  gpu().upload_into(Tensor::view(h.data_as<float>() + 7, {1000}, DType::F32, h.device()), b);
  const uint64_t ta = gpu().download_start(a);
  const uint64_t tb = gpu().download_start(b);
  gpu().zero(a);  // issued after the copy: the copy still sees the old values
  std::vector<float> ra(3000), rb(1000);
  EXPECT_THROW(gpu().download_finish(tb, rb.data()), Error);  // out of order
  gpu().download_finish(ta, ra.data());
  gpu().download_finish(tb, rb.data());
  for (int i = 0; i < 3000; ++i) ASSERT_EQ(ra[static_cast<size_t>(i)], h.data_as<float>()[i]) << i;
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(rb[static_cast<size_t>(i)], h.data_as<float>()[i + 7]) << i;
}

// The hierarchical cache's page copies (saves, then loads: one load reads a slot a save of the same call writes) on
// the GPU's mapped host memory against the reference (Backend::copy_kv_pages' memcpy) on copies of the same bytes: a
// bf16 cache (16-byte copies) and an FP8 one of odd rows (byte copies).
TEST(CudaOps, KvPagesToTheHostAndBack) {
  REQUIRE_GPU();
  struct Case {
    int64_t dim;
    DType dtype;
    int32_t ps;
  };
  for (const Case c : {Case{576, DType::BF16, 16}, Case{40, DType::F8_E4M3, 3}}) {
    const int64_t pages = 9, slots = 6, rows = pages * c.ps;
    std::vector<Tensor> g;
    std::vector<std::vector<char>> h;
    for (int l = 0; l < 3; ++l) {
      g.push_back(gpu().alloc({rows, c.dim}, c.dtype));
      gpu().upload_into(rand_host({rows, c.dim}, 40 + l), g.back());
      h.emplace_back(g.back().nbytes());
      gpu().download(g.back(), h.back().data());
    }
    std::vector<Tensor> hc;
    std::vector<Tensor*> gp, cp;
    for (int l = 0; l < 3; ++l) hc.push_back(Tensor::view(h[static_cast<size_t>(l)].data(), {rows, c.dim}, c.dtype));
    for (int l = 0; l < 3; ++l) {
      gp.push_back(&g[static_cast<size_t>(l)]);
      cp.push_back(&hc[static_cast<size_t>(l)]);
    }
    const size_t pb = g[0].nbytes() / static_cast<size_t>(pages), block = 3 * pb;  // a page of a layer; of all
    char* host_g = static_cast<char*>(gpu().alloc_host(slots * block));
    std::vector<char> host_c(slots * block, 0);
    std::memset(host_g, 0, slots * block);
    const std::vector<int32_t> saves{2, 0, 5, 3, 0, 5}, loads{0, 8, 3, 1, 5, 2};  // slot 0 / 3 / 5 saved, then loaded
    const std::vector<std::vector<char>> before = h;
    Scenario sc = make_scenario({{0, 3}}, 4, 1);
    gpu().begin_step(sc.batch);
    gpu().copy_kv_pages(gp, static_cast<int64_t>(pb), host_g, saves, loads);
    cpu().copy_kv_pages(cp, static_cast<int64_t>(pb), host_c.data(), saves, loads);
    gpu().synchronize();
    EXPECT_EQ(std::memcmp(host_g, host_c.data(), slots * block), 0) << dtype_name(c.dtype);
    for (int l = 0; l < 3; ++l) {
      std::vector<char> got(g[static_cast<size_t>(l)].nbytes());
      gpu().download(g[static_cast<size_t>(l)], got.data());
      EXPECT_EQ(got, h[static_cast<size_t>(l)]) << dtype_name(c.dtype) << " layer " << l;
    }
    // The reference itself: page 8 of layer 1 now holds what page 2 held (saved to slot 0, loaded from it).
    EXPECT_EQ(std::memcmp(h[1].data() + 8 * pb, before[1].data() + 2 * pb, pb), 0);
    EXPECT_NE(std::memcmp(h[1].data() + 8 * pb, before[1].data() + 8 * pb, pb), 0);
    gpu().free_host(host_g);
  }
}

TEST(CudaOps, RmsNormAndResidual) {
  REQUIRE_GPU();
  for (int64_t N : {0, 1, 7, 300})
    for (int64_t D : {100, 512, 2048, 7168}) {
      Tensor x = rand_host({N, D}, 3 + N + D), r = rand_host({N, D}, 4 + N), w = rand_host({D}, 5, 0.2f);
      for (int64_t i = 0; i < D; ++i) w.data_as<float>()[i] += 1.0f;
      Tensor xc = cpu().upload(x, DType::F32), xg = gpu().upload(x, DType::BF16);
      Tensor wc = cpu().upload(w, DType::F32), wg = gpu().upload(w, DType::F32);
      Tensor oc = cpu().alloc({N, D}, DType::F32), og = gpu().alloc({N, D}, DType::BF16);
      cpu().rmsnorm(xc, wc, 1e-6f, oc);
      gpu().rmsnorm(xg, wg, 1e-6f, og);
      expect_close(cpu().to_host_f32(oc), gpu().to_host_f32(og), 5e-3, 1e-2, "rmsnorm N" + std::to_string(N) + " D" + std::to_string(D));
      Tensor rc = cpu().upload(r, DType::F32), rg = gpu().upload(r, DType::BF16);
      cpu().add_rmsnorm(xc, rc, wc, 1e-6f, oc);
      gpu().add_rmsnorm(xg, rg, wg, 1e-6f, og);
      expect_close(cpu().to_host_f32(rc), gpu().to_host_f32(rg), 5e-3, 1e-2, "add_rmsnorm residual");
      expect_close(cpu().to_host_f32(oc), gpu().to_host_f32(og), 8e-3, 2e-2, "add_rmsnorm out");
    }
}

TEST(CudaOps, LinearShapes) {
  REQUIRE_GPU();
  struct Case { int64_t N, K, M; DType out; };
  // Up to 8 rows: the small-batch kernels (K split over warps for the narrow outputs); K % 8 != 0: cuBLAS.
  for (const Case c : {Case{0, 64, 32, DType::BF16}, Case{1, 2048, 3072, DType::BF16}, Case{37, 512, 576, DType::BF16},
                       Case{256, 2048, 64, DType::F32}, Case{5, 2048, 1000, DType::F32}, Case{1, 2048, 576, DType::BF16},
                       Case{3, 1408, 2048, DType::BF16}, Case{8, 2048, 64, DType::F32}, Case{2, 24, 130, DType::BF16},
                       Case{7, 10944, 300, DType::BF16}, Case{4, 520, 77, DType::F32}, Case{2, 20, 33, DType::BF16},
                       Case{9, 2048, 576, DType::BF16},
                       // golden v2 widths at 6 rows (several 16-row groups per block: K split over fewer warps)
                       Case{6, 128, 48, DType::BF16}, Case{6, 48, 384, DType::BF16}, Case{6, 128, 80, DType::BF16},
                       Case{6, 192, 128, DType::BF16}, Case{6, 128, 512, DType::BF16}, Case{6, 256, 128, DType::BF16},
                       Case{6, 96, 128, DType::BF16}, Case{6, 128, 16, DType::F32}, Case{1, 128, 640, DType::F32},
                       // one row and more blocks than fit at once: an lm_head, the dense MLP's gate/up and down (K
                       // split over two warps); two rows with K % 32 != 0 (the lane kernel) over many blocks
                       Case{1, 2048, 40000, DType::F32}, Case{1, 2048, 21888, DType::BF16},
                       Case{1, 10944, 2048, DType::BF16}, Case{2, 1000, 9000, DType::F32}}) {
    Tensor x = rand_host({c.N, c.K}, 7 + c.N), w = rand_host({c.M, c.K}, 8 + c.M, 1.0f / std::sqrt(static_cast<float>(c.K)));
    Tensor xc = cpu().upload(x, DType::F32), xg = gpu().upload(x, DType::BF16);
    Tensor wc = cpu().upload(w, DType::BF16), wg = gpu().upload(w, DType::BF16);
    Tensor yc = cpu().alloc({c.N, c.M}, DType::F32), yg = gpu().alloc({c.N, c.M}, c.out);
    cpu().linear(xc, wc, yc);
    gpu().linear(xg, wg, yg);
    expect_close(cpu().to_host_f32(yc), gpu().to_host_f32(yg), 8e-3, 2e-2,
                 "linear " + std::to_string(c.N) + "x" + std::to_string(c.K) + "x" + std::to_string(c.M));
  }
}

// linear_pair runs both products in one launch where they take the matrix-vector kernels: each output must be what
// linear alone gives, bit for bit at 2-8 rows (the tensor-core kernel, same K split per problem) and with cuBLAS (9
// rows), within the last bf16 bit at one row (the lane kernel, whose K splits the pair may narrow), with bf16 and f32
// outputs and narrow second problems.
TEST(CudaOps, LinearPairIsTwoLinears) {
  REQUIRE_GPU();
  struct Case { int64_t T, K, M1, M2; DType out2; };
  for (const Case c : {Case{1, 2048, 3072, 576, DType::BF16}, Case{2, 2048, 3072, 576, DType::BF16},
                       Case{8, 2048, 1536, 576, DType::BF16}, Case{3, 520, 300, 77, DType::F32},
                       Case{1, 128, 640, 16, DType::F32}, Case{5, 7168, 1536, 576, DType::BF16},
                       Case{9, 2048, 3072, 576, DType::BF16}, Case{1, 2048, 8, 2000, DType::BF16},
                       Case{1, 1024, 9000, 576, DType::BF16}}) {
    const std::string what = "pair T " + std::to_string(c.T) + " K " + std::to_string(c.K) + " M " +
                             std::to_string(c.M1) + "+" + std::to_string(c.M2);
    Tensor x = rand_host({c.T, c.K}, 31 + c.T), w1 = rand_host({c.M1, c.K}, 32 + c.M1, 0.05f),
           w2 = rand_host({c.M2, c.K}, 33 + c.M2, 0.05f);
    Tensor xg = gpu().upload(x, DType::BF16), w1g = gpu().upload(w1, DType::BF16), w2g = gpu().upload(w2, DType::BF16);
    Tensor a1 = gpu().alloc({c.T, c.M1}, DType::BF16), a2 = gpu().alloc({c.T, c.M2}, c.out2);
    Tensor b1 = gpu().alloc({c.T, c.M1}, DType::BF16), b2 = gpu().alloc({c.T, c.M2}, c.out2);
    gpu().linear_pair(xg, w1g, a1, w2g, a2);
    gpu().linear(xg, w1g, b1);
    gpu().linear(xg, w2g, b2);
    // Bit for bit at 2-8 rows; at one row the pair may split K more narrowly than a linear alone (its grid fits the
    // GPU at once): the same sums in another order, within the last bf16 bit.
    const double rel = c.T == 1 ? 4e-3 : 0.0, top = c.T == 1 ? 1e-2 : 0.0;
    expect_close(gpu().to_host_f32(b1), gpu().to_host_f32(a1), rel, top, what + " (first)");
    expect_close(gpu().to_host_f32(b2), gpu().to_host_f32(a2), rel, top, what + " (second)");
    // and both against the CPU reference, so a pair that wrote nothing (both zero) cannot pass
    Tensor xc = cpu().upload(x, DType::F32);
    const Tensor* ws[2] = {&w1, &w2};
    const Tensor* got[2] = {&a1, &a2};
    for (int i = 0; i < 2; ++i) {
      Tensor wc = cpu().upload(*ws[i], DType::BF16), yc = cpu().alloc({c.T, ws[i]->size(0)}, DType::F32);
      cpu().linear(xc, wc, yc);
      expect_close(cpu().to_host_f32(yc), gpu().to_host_f32(*got[i]), 8e-3, 2e-2,
                   what + (i == 0 ? " (first) vs cpu" : " (second) vs cpu"));
    }
  }
  Tensor x = gpu().alloc({2, 64}, DType::BF16), w = gpu().alloc({8, 64}, DType::BF16), bad = gpu().alloc({8, 32}, DType::BF16);
  Tensor y = gpu().alloc({2, 8}, DType::BF16);
  EXPECT_THROW(gpu().linear_pair(x, w, y, bad, y), std::exception);
}

TEST(CudaOps, ElementwiseOps) {
  REQUIRE_GPU();
  Scenario s = make_scenario({{0, 3}, {10, 1}, {0, 6}}, 16, 9);
  begin(s.batch);
  const int64_t T = s.batch.num_tokens(), I = 200;
  Tensor gu = rand_host({T, 2 * I}, 10, 2.0f);
  Tensor gc = cpu().upload(gu, DType::F32), gg = gpu().upload(gu, DType::BF16);
  Tensor oc = cpu().alloc({T, I}, DType::F32), og = gpu().alloc({T, I}, DType::BF16);
  cpu().silu_mul(gc, oc);
  gpu().silu_mul(gg, og);
  expect_close(cpu().to_host_f32(oc), gpu().to_host_f32(og), 5e-3, 1e-2, "silu_mul");
  Tensor b = rand_host({T, I}, 11);
  Tensor bc = cpu().upload(b, DType::F32), bg = gpu().upload(b, DType::BF16);
  cpu().add(oc, bc);
  gpu().add(og, bg);
  expect_close(cpu().to_host_f32(oc), gpu().to_host_f32(og), 5e-3, 1e-2, "add");
  Tensor cc = cpu().alloc({T, I}, DType::F32), cg = gpu().alloc({T, I}, DType::BF16);
  cpu().copy(oc, cc);
  gpu().copy(og, cg);
  expect_close(cpu().to_host_f32(oc), gpu().to_host_f32(cg), 5e-3, 1e-2, "copy");
  const int64_t R = static_cast<int64_t>(s.batch.logit_rows.size());
  Tensor rc = cpu().alloc({R, I}, DType::F32), rg = gpu().alloc({R, I}, DType::BF16);
  cpu().gather_logit_rows(cc, rc);
  gpu().gather_logit_rows(cg, rg);
  expect_close(cpu().to_host_f32(rc), gpu().to_host_f32(rg), 5e-3, 1e-2, "gather_logit_rows");
  // Rows named on the host, repeated and out of order (the chained MTP drafts' hidden rows), after a substep whose
  // metadata replaced the step's: the earlier copy's rows stay.
  const std::vector<int32_t> some{static_cast<int32_t>(T) - 1, 0, static_cast<int32_t>(T) - 1};
  cpu().begin_substep(s.batch);
  gpu().begin_substep(s.batch);
  Tensor sc = cpu().alloc({3, I}, DType::F32), sg = gpu().alloc({3, I}, DType::BF16);
  cpu().gather_rows(cc, some, sc);
  gpu().gather_rows(cg, some, sg);
  expect_close(cpu().to_host_f32(sc), gpu().to_host_f32(sg), 5e-3, 1e-2, "gather_rows");
  EXPECT_EQ(gpu().to_host_f32(sg).rows(1, 2).data_as<float>()[0], gpu().to_host_f32(cg).data_as<float>()[0]);
  // Vocabulary slices of 3 ranks, R rows each, interleaved into full rows (exact: a copy).
  Tensor parts = rand_host({3 * R, 40}, 12);
  Tensor pc = cpu().upload(parts, DType::F32), pg = gpu().upload(parts, DType::F32);
  Tensor ic = cpu().alloc({R, 120}, DType::F32), ig = gpu().alloc({R, 120}, DType::F32);
  cpu().interleave_blocks(pc, 3, ic);
  gpu().interleave_blocks(pg, 3, ig);
  expect_close(cpu().to_host_f32(ic), gpu().to_host_f32(ig), 0.0, 0.0, "interleave_blocks");
  EXPECT_EQ(cpu().to_host_f32(ic).data_as<float>()[40], parts.data_as<float>()[R * 40]);  // row 0, rank 1's slice
}

// silu_mul and add at widths of the 16-byte path (I % 8 == 0) and not, against the CPU; the 16-byte path gives what
// the element path gives bit for bit (the same rows one element off 16-byte alignment take the element path).
TEST(CudaOps, SiluMulAndAddWidths) {
  REQUIRE_GPU();
  const auto stream = static_cast<cudaStream_t>(gpu().native_stream());
  for (int64_t T : {3, 700}) {
    for (int64_t I : {13, 200, 1408}) {
      const std::string what = "T " + std::to_string(T) + " I " + std::to_string(I);
      Tensor gu = rand_host({T, 2 * I}, static_cast<uint64_t>(T + I), 2.0f), b = rand_host({T, I}, 5);
      Tensor gc = cpu().upload(gu, DType::F32), gg = gpu().upload(gu, DType::BF16);
      Tensor oc = cpu().alloc({T, I}, DType::F32), og = gpu().alloc({T, I}, DType::BF16);
      cpu().silu_mul(gc, oc);
      gpu().silu_mul(gg, og);
      expect_close(cpu().to_host_f32(oc), gpu().to_host_f32(og), 5e-3, 1e-2, "silu_mul " + what);
      // The same rows shifted one element: the element path.
      Tensor gs = gpu().alloc({T * 2 * I + 1}, DType::BF16), os = gpu().alloc({T * I + 1}, DType::BF16);
      ASSERT_EQ(cudaMemcpyAsync(gs.data_as<cuda::bf16>() + 1, gg.data(), T * 2 * I * 2, cudaMemcpyDeviceToDevice,
                                stream),
                cudaSuccess);
      ASSERT_EQ(cuda::silu_mul(gs.data_as<cuda::bf16>() + 1, T, I, os.data_as<cuda::bf16>() + 1, stream), cudaSuccess);
      const Tensor shifted = gpu().to_host_f32(os), direct = gpu().to_host_f32(og);
      EXPECT_EQ(std::memcmp(shifted.data_as<float>() + 1, direct.data(), T * I * sizeof(float)), 0) << what;
      Tensor bc = cpu().upload(b, DType::F32), bg = gpu().upload(b, DType::BF16);
      ASSERT_EQ(cudaMemcpyAsync(os.data_as<cuda::bf16>() + 1, og.data(), T * I * 2, cudaMemcpyDeviceToDevice, stream),
                cudaSuccess);
      cpu().add(oc, bc);
      gpu().add(og, bg);
      expect_close(cpu().to_host_f32(oc), gpu().to_host_f32(og), 5e-3, 1e-2, "add " + what);
      Tensor bs = gpu().alloc({T * I + 1}, DType::BF16);
      ASSERT_EQ(cudaMemcpyAsync(bs.data_as<cuda::bf16>() + 1, bg.data(), T * I * 2, cudaMemcpyDeviceToDevice, stream),
                cudaSuccess);
      ASSERT_EQ(cuda::add_inplace(os.data_as<cuda::bf16>() + 1, bs.data_as<cuda::bf16>() + 1, T * I, stream),
                cudaSuccess);
      const Tensor added = gpu().to_host_f32(os), added_direct = gpu().to_host_f32(og);
      EXPECT_EQ(std::memcmp(added.data_as<float>() + 1, added_direct.data(), T * I * sizeof(float)), 0) << what;
    }
  }
}

// Exact equality of two device tensors' values (NaN matches NaN).
int64_t count_diff(const Tensor& a, const Tensor& b) {
  Tensor ha = gpu().to_host_f32(a), hb = gpu().to_host_f32(b);
  if (ha.numel() != hb.numel()) return -1;
  int64_t d = 0;
  for (int64_t i = 0; i < ha.numel(); ++i) {
    const float x = ha.data_as<float>()[i], y = hb.data_as<float>()[i];
    d += !(x == y || (std::isnan(x) && std::isnan(y)));
  }
  return d;
}

// add_rmsnorm_linear_pair (at one token one launch: every block of the pair normalises the row itself) gives what
// add_rmsnorm then linear_pair give: the residual sums bit for bit; the products bit for bit where the norm kernel
// also uses 256 threads (1024 <= K < 4096), else within the last bf16 bit; and close to the CPU's ops.
TEST(CudaOps, AddRmsnormLinearPairIsTheOps) {
  REQUIRE_GPU();
  struct Case { int64_t T, K, M1, M2; };
  for (const Case c : {Case{1, 2048, 3072, 576}, Case{1, 1024, 1536, 576}, Case{1, 7168, 1536, 576},
                       Case{1, 128, 640, 16}, Case{1, 520, 300, 77}, Case{2, 2048, 3072, 576},
                       Case{3, 7168, 512, 64}}) {
    const std::string what = "norm+pair T " + std::to_string(c.T) + " K " + std::to_string(c.K);
    Tensor x = rand_host({c.T, c.K}, 41 + c.K), r = rand_host({c.T, c.K}, 42 + c.K), nw = rand_host({c.K}, 43, 0.2f);
    for (int64_t i = 0; i < c.K; ++i) nw.data_as<float>()[i] += 1.0f;
    Tensor w1 = rand_host({c.M1, c.K}, 44 + c.M1, 0.05f), w2 = rand_host({c.M2, c.K}, 45 + c.M2, 0.05f);
    Tensor xg = gpu().upload(x, DType::BF16), rg = gpu().upload(r, DType::BF16), nwg = gpu().upload(nw, DType::F32);
    Tensor w1g = gpu().upload(w1, DType::BF16), w2g = gpu().upload(w2, DType::BF16);
    Tensor ro = gpu().alloc({c.T, c.K}, DType::BF16), normed = gpu().alloc({c.T, c.K}, DType::BF16);
    Tensor a1 = gpu().alloc({c.T, c.M1}, DType::BF16), a2 = gpu().alloc({c.T, c.M2}, DType::F32);
    gpu().add_rmsnorm_linear_pair(xg, rg, ro, nwg, 1e-6f, normed, w1g, a1, w2g, a2);
    // the ops, on a copy of the residual
    Tensor r2 = gpu().upload(r, DType::BF16), n2 = gpu().alloc({c.T, c.K}, DType::BF16);
    Tensor b1 = gpu().alloc({c.T, c.M1}, DType::BF16), b2 = gpu().alloc({c.T, c.M2}, DType::F32);
    gpu().add_rmsnorm(xg, r2, nwg, 1e-6f, n2);
    gpu().linear_pair(n2, w1g, b1, w2g, b2);
    EXPECT_EQ(count_diff(r2, ro), 0) << what << ": residual sums";
    EXPECT_EQ(count_diff(rg, gpu().upload(r, DType::BF16)), 0) << what << ": the residual input was written";
    const bool exact = c.T > 1 || (c.K >= 1024 && c.K < 4096);
    const double rel = exact ? 0.0 : 4e-3, top = exact ? 0.0 : 1e-2;
    expect_close(gpu().to_host_f32(b1), gpu().to_host_f32(a1), rel, top, what + " (first)");
    expect_close(gpu().to_host_f32(b2), gpu().to_host_f32(a2), rel, top, what + " (second)");
    Tensor xc = cpu().upload(x, DType::F32), rc = cpu().upload(r, DType::F32), nwc = cpu().upload(nw, DType::F32);
    Tensor roc = cpu().alloc({c.T, c.K}, DType::F32), nc = cpu().alloc({c.T, c.K}, DType::F32);
    Tensor w1c = cpu().upload(w1, DType::BF16), w2c = cpu().upload(w2, DType::BF16);
    Tensor y1c = cpu().alloc({c.T, c.M1}, DType::F32), y2c = cpu().alloc({c.T, c.M2}, DType::F32);
    cpu().add_rmsnorm_linear_pair(xc, rc, roc, nwc, 1e-6f, nc, w1c, y1c, w2c, y2c);
    expect_close(cpu().to_host_f32(roc), gpu().to_host_f32(ro), 5e-3, 1e-2, what + " residual vs cpu");
    expect_close(cpu().to_host_f32(y1c), gpu().to_host_f32(a1), 1e-2, 3e-2, what + " (first) vs cpu");
    expect_close(cpu().to_host_f32(y2c), gpu().to_host_f32(a2), 1e-2, 3e-2, what + " (second) vs cpu");
  }
  Tensor x = gpu().alloc({1, 64}, DType::BF16), r = gpu().alloc({1, 64}, DType::BF16);
  Tensor n = gpu().alloc({1, 64}, DType::BF16), nw = gpu().alloc({64}, DType::F32);
  Tensor w = gpu().alloc({8, 64}, DType::BF16), y = gpu().alloc({1, 8}, DType::BF16);
  EXPECT_THROW(gpu().add_rmsnorm_linear_pair(x, r, r, nw, 1e-6f, n, w, y, w, y), std::exception);  // in place
}

std::vector<float> yarn_freqs(int64_t rope) {
  std::vector<float> f(static_cast<size_t>(rope / 2));
  for (size_t i = 0; i < f.size(); ++i) f[i] = std::pow(10000.0f, -2.0f * static_cast<float>(i) / static_cast<float>(rope)) / (i > 8 ? 40.0f : 1.0f);
  return f;
}

TEST(CudaOps, RopeAndLatentWrite) {
  REQUIRE_GPU();
  const int64_t kvr = 512, rope = 64, nh = 16, nope = 128;
  Scenario s = make_scenario({{0, 1}, {15, 1}, {16, 33}, {100000, 2}}, 16, 12);
  begin(s.batch);
  cpu().set_rope(yarn_freqs(rope), 1.2f);
  gpu().set_rope(yarn_freqs(rope), 1.2f);
  const int64_t T = s.batch.num_tokens(), slots = s.num_pages * 16;
  Tensor q = rand_host({T, nh * (nope + rope)}, 13);
  Tensor qc = cpu().upload(q, DType::F32), qg = gpu().upload(q, DType::BF16);
  cpu().mla_rope_q(qc, nh, nope, rope);
  gpu().mla_rope_q(qg, nh, nope, rope);
  expect_close(cpu().to_host_f32(qc), gpu().to_host_f32(qg), 5e-3, 1e-2, "mla_rope_q");

  Tensor lat = rand_host({T, kvr + rope}, 14, 3.0f), w = rand_host({kvr}, 15, 0.1f);
  for (int64_t i = 0; i < kvr; ++i) w.data_as<float>()[i] += 1.0f;
  Tensor cache = Tensor::empty_host({slots, kvr + rope}, DType::F32);
  std::fill(cache.data_as<float>(), cache.data_as<float>() + cache.numel(), std::nanf(""));
  Tensor cc = cpu().upload(cache, DType::F32), cg = gpu().upload(cache, DType::BF16);
  Tensor lc = cpu().upload(lat, DType::F32), lg = gpu().upload(lat, DType::BF16);
  Tensor wc = cpu().upload(w, DType::F32), wg = gpu().upload(w, DType::F32);
  cpu().mla_write_latent(lc, wc, 1e-6f, cc);
  gpu().mla_write_latent(lg, wg, 1e-6f, cg);
  expect_close(cpu().to_host_f32(lc), gpu().to_host_f32(lg), 5e-3, 1e-2, "mla_write_latent (latent)");
  Tensor ch = cpu().to_host_f32(cc), gh = gpu().to_host_f32(cg);
  int64_t untouched_bad = 0;
  std::vector<char> written(static_cast<size_t>(slots), 0);
  for (int32_t sl : s.batch.out_slots) written[sl] = 1;
  Tensor rows_c = Tensor::empty_host({T, kvr + rope}, DType::F32), rows_g = Tensor::empty_host({T, kvr + rope}, DType::F32);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t sl = s.batch.out_slots[t];
    std::copy_n(ch.data_as<float>() + sl * (kvr + rope), kvr + rope, rows_c.data_as<float>() + t * (kvr + rope));
    std::copy_n(gh.data_as<float>() + sl * (kvr + rope), kvr + rope, rows_g.data_as<float>() + t * (kvr + rope));
  }
  for (int64_t sl = 0; sl < slots; ++sl)
    if (!written[sl] && !std::isnan(gh.data_as<float>()[sl * (kvr + rope)])) ++untouched_bad;
  EXPECT_EQ(untouched_bad, 0) << "slots no token owns were written";
  expect_close(rows_c, rows_g, 5e-3, 1e-2, "mla_write_latent (cache rows)");

  // mla_prepare (one launch on the GPU) gives exactly what the two ops give, q, latent and cache alike.
  Tensor q2 = gpu().upload(q, DType::BF16), l2 = gpu().upload(lat, DType::BF16), c2 = gpu().upload(cache, DType::BF16);
  gpu().mla_prepare(q2, nh, nope, rope, l2, wg, 1e-6f, c2);
  expect_close(gpu().to_host_f32(qg), gpu().to_host_f32(q2), 0.0, 0.0, "mla_prepare (q)");
  expect_close(gpu().to_host_f32(lg), gpu().to_host_f32(l2), 0.0, 0.0, "mla_prepare (latent)");
  EXPECT_EQ(count_diff(cg, c2), 0) << "mla_prepare wrote a different cache";
}

// MLA attention in every form over a NaN-poisoned, shuffled paged cache.
// decode_only: one new token per sequence, planned in fixed parts per token (as CUDA graph steps are), many of them
// empty for the short contexts.
// few_tokens > 0 (with decode_only): only that many decode tokens, every one long enough to be split.
// fp8: the cache in that FP8 type on both backends (the same codes).
// prefill (non-empty): these (cached, new) sequences instead of the default mix.
void mla_case(int64_t nh, int64_t kvr, int64_t rope, int64_t nope, int64_t vh, int32_t page_size, bool long_ctx,
              int kind, bool decode_only = false, int few_tokens = 0, std::optional<DType> fp8 = std::nullopt,
              const std::vector<std::pair<int32_t, int32_t>>& prefill = {}, bool page_runs = false) {
  // (prefill items hold up to 128 new tokens: {5, 300} takes three, the last of 44; {0, 100} and {63, 65} one with
  // warps past its tokens)
  std::vector<std::pair<int32_t, int32_t>> seqs = {{0, 1},  {15, 1}, {16, 1},  {299, 1},
                                                   {0, 100}, {40, 30}, {63, 65}, {5, 300}};
  if (decode_only) seqs = {{0, 1}, {15, 1}, {16, 1}, {299, 1}, {63, 1}, {1000, 1}};
  if (!prefill.empty()) seqs = prefill;
  if (few_tokens > 0) seqs = {{299, 1}, {16, 1}};
  seqs.resize(few_tokens > 0 ? static_cast<size_t>(few_tokens - 1) : seqs.size());
  seqs.push_back({long_ctx ? 2499 : 700, 1});
  Scenario s = make_scenario(seqs, page_size, 100 + nh + kind, 100, page_runs);
  const int64_t T = s.batch.num_tokens(), W = kvr + rope, slots = s.num_pages * page_size;
  Tensor cache = Tensor::empty_host({slots, W}, DType::F32);
  std::fill(cache.data_as<float>(), cache.data_as<float>() + cache.numel(), std::nanf(""));
  std::mt19937_64 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int32_t q = 0; q < s.batch.num_seqs(); ++q)
    for (int32_t pos = 0; pos < s.batch.seq_lens[q]; ++pos) {
      const int64_t slot = static_cast<int64_t>(s.pages[q][pos / page_size]) * page_size + pos % page_size;
      for (int64_t d = 0; d < W; ++d)
        cache.data_as<float>()[slot * W + d] = !fp8                        ? bf16_to_f32(f32_to_bf16(nd(rng)))
                                               : *fp8 == DType::F8_E5M2 ? f8e5m2_to_f32(f32_to_e5m2(nd(rng)))
                                                                        : f8e4m3_to_f32(f32_to_e4m3(nd(rng)));
    }
  Tensor q = rand_host({T, nh * (nope + rope)}, 21);
  Tensor kvb = rand_host({nh * (nope + vh), kvr}, 22, 1.0f / std::sqrt(static_cast<float>(kvr)));
  Backend& g = gpu(kind);
  cpu().begin_step(s.batch);
  g.begin_step(s.batch);
  Tensor cc = cpu().upload(cache, fp8.value_or(DType::F32));
  Tensor cg = g.upload(cache, fp8.value_or(DType::BF16));
  Tensor qc = cpu().upload(q, DType::F32), qg = g.upload(q, DType::BF16);
  Tensor bc = cpu().upload(kvb, DType::BF16), bg = g.upload(kvb, DType::BF16);
  MlaParams p;
  p.num_heads = static_cast<int32_t>(nh);
  p.qk_nope = static_cast<int32_t>(nope);
  p.qk_rope = static_cast<int32_t>(rope);
  p.v_head = static_cast<int32_t>(vh);
  p.kv_lora = static_cast<int32_t>(kvr);
  p.softmax_scale = 0.1f;
  for (MlaForm form : {MlaForm::Auto, MlaForm::Absorbed, MlaForm::Expanded}) {
    p.form = form;
    Tensor oc = cpu().alloc({T, nh * vh}, DType::F32), og = g.alloc({T, nh * vh}, DType::BF16);
    cpu().mla_attention(qc, cc, bc, p, oc);
    g.mla_attention(qg, cg, bg, p, og);
    const char* fn = form == MlaForm::Auto ? "auto" : form == MlaForm::Absorbed ? "absorbed" : "expanded";
    expect_close(cpu().to_host_f32(oc), g.to_host_f32(og), 2e-2, 5e-2,
                 "mla " + std::string(fn) + " nh" + std::to_string(nh) + " kvr" + std::to_string(kvr) + " ps" +
                     std::to_string(page_size) + (kind == 1 ? " simple" : "") + (page_runs ? " runs" : "") +
                     (fp8 ? std::string(" ") + dtype_name(*fp8) + " cache" : ""));
  }
}

// An FP8 cache (E4M3 and E5M2 codes): the FP8 decode kernel (16-head groups), the warpgroup-MMA kernel (128 heads:
// pages of 16, 64 and 1 rows, split and unsplit), the simple kernel (other dims, or no fast paths), the prefill's
// gather; eager splits and fixed ones (graph steps), one or two split tokens.
TEST(CudaOps, MlaAttentionFp8Cache) {
  REQUIRE_GPU();
  for (DType t : {DType::F8_E4M3, DType::F8_E5M2}) {
    mla_case(16, 512, 64, 128, 128, 16, true, 0, false, 0, t);
    mla_case(16, 512, 64, 128, 128, 64, true, 0, false, 0, t);
    mla_case(128, 512, 64, 128, 128, 16, false, 0, false, 0, t);
    mla_case(128, 512, 64, 128, 128, 64, true, 0, true, 0, t);
    mla_case(128, 512, 64, 128, 128, 1, true, 0, true, 2, t);
    mla_case(24, 512, 64, 128, 128, 16, false, 0, false, 0, t);
    mla_case(16, 512, 64, 128, 128, 16, true, 1, false, 0, t);
    mla_case(4, 64, 16, 32, 32, 16, true, 0, false, 0, t);
    mla_case(16, 512, 64, 128, 128, 16, true, 0, true, 0, t);
    mla_case(4, 64, 16, 32, 32, 16, true, 0, true, 0, t);
    for (int few : {1, 2}) mla_case(16, 512, 64, 128, 128, 16, true, 0, true, few, t);
  }
}

TEST(CudaOps, MlaAttention16Heads) {
  REQUIRE_GPU();
  mla_case(16, 512, 64, 128, 128, 16, true, 0);
  mla_case(16, 512, 64, 128, 128, 64, true, 0);
  mla_case(16, 512, 64, 128, 128, 16, true, 1);
}

// Prefills of many 128-key tiles: whole and partial items, prefixes on and off the tile bounds, items whose first
// warpgroup's queries end before their last tile, items of at most 64 queries (the second warpgroup has none).
TEST(CudaOps, MlaAttentionLongPrefills) {
  REQUIRE_GPU();
  const std::vector<std::pair<int32_t, int32_t>> seqs = {{0, 700}, {300, 400}, {129, 257}, {1000, 30}, {64, 64}};
  mla_case(16, 512, 64, 128, 128, 16, false, 0, false, 0, std::nullopt, seqs);
  mla_case(16, 512, 64, 128, 128, 64, false, 0, false, 0, DType::F8_E4M3, seqs);
}

// 128 heads (two 64-head groups): the warpgroup-MMA decode kernel over pages of 16, 64 and 8 rows (tiles of one
// page, of four, of eight; the last tile cut short), split and unsplit tokens; pages of one row take the mma.sync
// kernel.
TEST(CudaOps, MlaAttention128Heads) {
  REQUIRE_GPU();
  mla_case(128, 512, 64, 128, 128, 16, false, 0);
  mla_case(128, 512, 64, 128, 128, 64, true, 0);
  mla_case(128, 512, 64, 128, 128, 8, false, 0, true);
  mla_case(128, 512, 64, 128, 128, 1, false, 0, true);
  for (int few : {1, 2}) mla_case(128, 512, 64, 128, 128, 64, true, 0, true, few);
  // Pages in order (as the page pool hands them out) but one per long sequence: a tile over consecutive pages is one
  // copy of 64 rows, the others a copy per page; pages of 48 rows take boxes of 16 rows.
  for (int32_t ps : {16, 8, 32, 48}) mla_case(128, 512, 64, 128, 128, ps, true, 0, true, 0, std::nullopt, {}, true);
  mla_case(128, 512, 64, 128, 128, 16, false, 0, false, 0, std::nullopt, {}, true);
  for (int few : {1, 2}) mla_case(128, 512, 64, 128, 128, 16, true, 0, true, few, std::nullopt, {}, true);
}

TEST(CudaOps, MlaAttentionOddDims) {
  REQUIRE_GPU();
  mla_case(4, 64, 16, 32, 32, 16, true, 0);   // golden-model dims: simple kernels
  mla_case(24, 512, 64, 128, 128, 16, false, 0);  // heads not a multiple of 16: padded head group
}

TEST(CudaOps, MlaDecodeFixedSplits) {
  REQUIRE_GPU();
  mla_case(16, 512, 64, 128, 128, 16, true, 0, true);
  mla_case(128, 512, 64, 128, 128, 16, true, 0, true);
  mla_case(4, 64, 16, 32, 32, 16, true, 0, true);  // simple kernels
  for (int few : {1, 2}) {  // one or two decode tokens (the small-batch sizes), each combining its splits
    mla_case(16, 512, 64, 128, 128, 16, true, 0, true, few);
    mla_case(16, 512, 64, 128, 128, 16, false, 0, true, few);
    mla_case(4, 64, 16, 32, 32, 16, true, 0, true, few);
  }
}

TEST(CudaOps, MlaEmptyBatch) {
  REQUIRE_GPU();
  ForwardBatchBuilder bb(16);
  ForwardBatch b = bb.finish();
  gpu().begin_step(b);
  Tensor q = gpu().scratch({0, 16 * 192}, DType::BF16), out = gpu().scratch({0, 16 * 128}, DType::BF16);
  Tensor cache = gpu().alloc({64, 576}, DType::BF16), kvb = gpu().alloc({16 * 256, 512}, DType::BF16);
  MlaParams p{16, 128, 64, 128, 512, 0.1f, MlaForm::Auto};
  gpu().mla_attention(q, cache, kvb, p, out);
  gpu().synchronize();
}

// mla_prepare_attention (at 1-2 decode tokens one launch for the preparation and the q_lat product) gives exactly
// what mla_prepare then mla_attention give: q, latent, cache and output. Also for a step with prefill tokens, where
// the preparation runs on its own.
// kind: the gpu() backend (4: without the one-launch attention of one decode token).
// fp8: an FP8 cache of that type (the new rows written as codes, the latent keeping their values).
void prepare_attention_case(const std::vector<std::pair<int32_t, int32_t>>& seqs, int64_t nh, int64_t kvr,
                            int64_t rope, int64_t nope, int64_t vh, bool graph_plan, uint64_t seed, int kind,
                            std::optional<DType> fp8 = std::nullopt) {
  const DType cdt = fp8.value_or(DType::BF16);
  Backend& g = gpu(kind);
  Scenario s = make_scenario(seqs, 16, seed);
  const int64_t T = s.batch.num_tokens(), W = kvr + rope, slots = s.num_pages * 16;
  Tensor cache = Tensor::empty_host({slots, W}, DType::F32);
  std::fill(cache.data_as<float>(), cache.data_as<float>() + cache.numel(), std::nanf(""));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int32_t q = 0; q < s.batch.num_seqs(); ++q)
    for (int32_t pos = 0; pos < s.batch.seq_lens[q]; ++pos) {
      const int64_t slot = static_cast<int64_t>(s.pages[q][pos / 16]) * 16 + pos % 16;
      for (int64_t d = 0; d < W; ++d) cache.data_as<float>()[slot * W + d] = nd(rng);
    }
  Tensor q = rand_host({T, nh * (nope + rope)}, seed + 1), lat = rand_host({T, W}, seed + 2, 3.0f);
  Tensor kvb = rand_host({nh * (nope + vh), kvr}, seed + 3, 1.0f / std::sqrt(static_cast<float>(kvr)));
  Tensor nw = rand_host({kvr}, seed + 4, 0.1f);
  for (int64_t i = 0; i < kvr; ++i) nw.data_as<float>()[i] += 1.0f;
  if (graph_plan) g.begin_graph_step(s.batch);
  else g.begin_step(s.batch);
  g.set_rope(yarn_freqs(rope), 1.2f);
  MlaParams p{static_cast<int32_t>(nh), static_cast<int32_t>(nope), static_cast<int32_t>(rope),
              static_cast<int32_t>(vh), static_cast<int32_t>(kvr), 0.1f, MlaForm::Auto};
  Tensor bg = g.upload(kvb, DType::BF16), wg = g.upload(nw, DType::F32);
  Tensor q1 = g.upload(q, DType::BF16), l1 = g.upload(lat, DType::BF16), c1 = g.upload(cache, cdt);
  Tensor q2 = g.upload(q, DType::BF16), l2 = g.upload(lat, DType::BF16), c2 = g.upload(cache, cdt);
  Tensor o1 = g.alloc({T, nh * vh}, DType::BF16), o2 = g.alloc({T, nh * vh}, DType::BF16);
  g.mla_prepare(q1, p.num_heads, p.qk_nope, p.qk_rope, l1, wg, 1e-6f, c1);
  g.mla_attention(q1, c1, bg, p, o1);
  g.mla_prepare_attention(q2, l2, wg, 1e-6f, c2, bg, p, o2);
  // With it, one decode token of at most kOneTokenMaxCtx keys takes the one-launch kernel (cuda::mla_one_token): q
  // and latent are left as they were, the sums run in another order; everything else runs the two ops' kernels.
  int32_t clusters = 0;
  ASSERT_EQ(cuda::mla_one_token_max_clusters(&clusters), cudaSuccess);
  const bool one_token = kind != 4 && T == 1 && seqs.size() == 1 && seqs[0].second == 1 &&
                         seqs[0].first + 1 <= cuda::kOneTokenMaxCtx &&
                         cuda::mla_one_token_fits(p.num_heads, p.qk_nope, p.qk_rope, p.v_head, p.kv_lora, clusters);
  const std::string what = "prepare+attention T" + std::to_string(T) + " nh" + std::to_string(nh) + " kvr" +
                           std::to_string(kvr) + " ctx" + std::to_string(seqs[0].first + seqs[0].second) +
                           (graph_plan ? " graph plan" : "") + (one_token ? " (one launch)" : "") +
                           (fp8 ? std::string(" ") + dtype_name(*fp8) + " cache" : "");
  EXPECT_EQ(count_diff(c1, c2), 0) << what << ": cache";
  if (one_token) {
    expect_close(g.to_host_f32(o1), g.to_host_f32(o2), 1e-2, 3e-2, what + " vs the ops");
  } else {
    EXPECT_EQ(count_diff(q1, q2), 0) << what << ": q";
    EXPECT_EQ(count_diff(l1, l2), 0) << what << ": latent";
    EXPECT_EQ(count_diff(o1, o2), 0) << what << ": out";
  }
  // And both against the CPU's two ops.
  cpu().begin_step(s.batch);
  cpu().set_rope(yarn_freqs(rope), 1.2f);
  Tensor qc = cpu().upload(q, DType::F32), lc = cpu().upload(lat, DType::F32);
  Tensor cc = cpu().upload(cache, fp8.value_or(DType::F32));
  Tensor bc = cpu().upload(kvb, DType::BF16), wc = cpu().upload(nw, DType::F32);
  Tensor oc = cpu().alloc({T, nh * vh}, DType::F32);
  cpu().mla_prepare_attention(qc, lc, wc, 1e-6f, cc, bc, p, oc);
  if (!fp8) {
    expect_close(cpu().to_host_f32(oc), g.to_host_f32(o2), 2e-2, 5e-2, what + " vs CPU");
    return;
  }
  // The rows as codes: the GPU's latent rows are exactly their cache rows' values (the one-launch kernel leaves the
  // latent as it was: its cache rows alone); against the CPU's a code may round the other way where the two sums of
  // squares differ (one E4M3 step, 1/16 to 1/8 of a value; E5M2's are twice as coarse).
  const double coarse = *fp8 == DType::F8_E5M2 ? 2.0 : 1.0;
  const Tensor lg = g.to_host_f32(l2), cg = g.to_host_f32(c2);
  Tensor rows = Tensor::empty_host({T, W}, DType::F32);
  int64_t not_codes = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < W; ++d) {
      const float c = cg.data_as<float>()[s.batch.out_slots[t] * W + d];
      rows.data_as<float>()[t * W + d] = c;
      not_codes += lg.data_as<float>()[t * W + d] != c;
    }
  if (!one_token) {
    EXPECT_EQ(not_codes, 0) << what << ": the latent is not its cache rows' values";
  }
  expect_close(cpu().to_host_f32(lc), rows, 3e-2 * coarse, 0.15 * coarse, what + " cache rows vs CPU");
  expect_close(cpu().to_host_f32(oc), g.to_host_f32(o2), 3e-2 * coarse, 8e-2 * coarse, what + " vs CPU");
}

// Without the one-launch attention (kind 4): the q_lat launch with the preparation, bit for bit against the ops.
TEST(CudaOps, MlaPrepareAttentionIsPrepareThenAttention) {
  REQUIRE_GPU();
  for (bool graph_plan : {false, true}) {
    prepare_attention_case({{299, 1}}, 16, 512, 64, 128, 128, graph_plan, 80, 4);           // one token, folded
    // one token of 101 keys: one split in an eager step (W_UV reads o_lat), parts with a graph plan (W_UV combines)
    prepare_attention_case({{100, 1}}, 16, 512, 64, 128, 128, graph_plan, 84, 4);
    prepare_attention_case({{700, 1}, {16, 1}}, 16, 512, 64, 128, 128, graph_plan, 81, 4);  // two tokens, folded
    prepare_attention_case({{40, 1}}, 4, 64, 16, 32, 32, graph_plan, 82, 4);               // simple decode kernel
    prepare_attention_case({{5, 1}, {0, 1}, {30, 1}}, 16, 512, 64, 128, 128, graph_plan, 83, 4);  // 3 tokens
  }
  prepare_attention_case({{12, 1}, {0, 20}}, 16, 512, 64, 128, 128, false, 84, 4);  // prefill in the step: apart
}

// An FP8 cache (E4M3 and E5M2): one token in one launch, the preparation folded into the q_lat launch (1-2 tokens)
// or apart, bit for bit against the two ops; against the CPU's FP8 cache within the codes' steps.
TEST(CudaOps, MlaPrepareAttentionFp8Cache) {
  REQUIRE_GPU();
  for (DType t : {DType::F8_E4M3, DType::F8_E5M2})
    for (bool graph_plan : {false, true}) {
      prepare_attention_case({{100, 1}}, 16, 512, 64, 128, 128, graph_plan, 84, 0, t);
      prepare_attention_case({{700, 1}, {16, 1}}, 16, 512, 64, 128, 128, graph_plan, 81, 0, t);
      prepare_attention_case({{40, 1}}, 4, 64, 16, 32, 32, graph_plan, 82, 0, t);
      prepare_attention_case({{5, 1}, {0, 1}, {30, 1}}, 16, 512, 64, 128, 128, graph_plan, 83, 0, t);
      if (!graph_plan) prepare_attention_case({{12, 1}, {0, 20}}, 16, 512, 64, 128, 128, false, 84, 0, t);
    }
}

// The one-launch attention of one decode token (cuda::mla_one_token) against the ops' kernels and the CPU: blocks of
// a head without keys (1 and 6 keys), uneven counts (101), every block's tile full (256 keys), 8 and 16 heads (a
// cluster per head: 30 clusters of 8 blocks fit an H200 at once); past kOneTokenMaxCtx (257 keys), more heads than
// fit the GPU at once (64) or two tokens, the usual kernels (bit for bit).
TEST(CudaOps, MlaOneTokenIsPrepareThenAttention) {
  REQUIRE_GPU();
  int32_t clusters = 0;
  const cudaError_t e = cuda::mla_one_token_max_clusters(&clusters);
  ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
  std::printf("  one-token attention: %d clusters of %d blocks fit the GPU at once\n", clusters,
              cuda::kOneTokenCluster);
  ASSERT_TRUE(cuda::mla_one_token_fits(16, 128, 64, 128, 512, clusters))
      << "the 16 heads of these cases would not take the one-launch kernel";
  for (bool graph_plan : {false, true}) {
    for (int32_t cached : {0, 5, 100, 255, 256})
      prepare_attention_case({{cached, 1}}, 16, 512, 64, 128, 128, graph_plan, 90 + cached, 0);
    prepare_attention_case({{200, 1}}, 8, 512, 64, 128, 128, graph_plan, 93, 0);
    prepare_attention_case({{100, 1}}, 64, 512, 64, 128, 128, graph_plan, 91, 0);
    prepare_attention_case({{300, 1}, {16, 1}}, 16, 512, 64, 128, 128, graph_plan, 92, 0);
    // An FP8 cache: the keys' codes read as their values, the newest row written as codes (the same as the ops').
    for (DType t : {DType::F8_E4M3, DType::F8_E5M2})
      for (int32_t cached : {0, 5, 101, 255, 256})
        prepare_attention_case({{cached, 1}}, 16, 512, 64, 128, 128, graph_plan, 190 + cached, 0, t);
  }
}

void route_case(int64_t T, int64_t E, const RouterParams& rp, bool bias, uint64_t seed) {
  Tensor lg = rand_host({T, E}, seed, 2.0f), bs = rand_host({E}, seed + 1, 0.1f);
  Tensor lc = cpu().upload(lg, DType::F32), lgp = gpu().upload(lg, DType::F32);
  Tensor bc = cpu().upload(bs, DType::F32), bgp = gpu().upload(bs, DType::F32);
  const int64_t k = rp.ids_per_token();
  Tensor ic = cpu().alloc({T, k}, DType::I32), ig = gpu().alloc({T, k}, DType::I32);
  Tensor wc = cpu().alloc({T, k}, DType::F32), wg = gpu().alloc({T, k}, DType::F32);
  cpu().moe_route(lc, bias ? &bc : nullptr, rp, ic, wc);
  gpu().moe_route(lgp, bias ? &bgp : nullptr, rp, ig, wg);
  Tensor ich = cpu().to_host_f32(ic), igh = gpu().to_host_f32(ig);
  int64_t mismatch = 0;
  for (int64_t i = 0; i < ich.numel(); ++i) mismatch += ich.data_as<float>()[i] != igh.data_as<float>()[i];
  EXPECT_EQ(mismatch, 0) << "routing ids differ (T " << T << ", E " << E << ")";
  if (T > 0) expect_close(cpu().to_host_f32(wc), gpu().to_host_f32(wg), 1e-5, 1e-5, "route weights E" + std::to_string(E));
}

TEST(CudaOps, MoeRouteAllMethods) {
  REQUIRE_GPU();
  RouterParams greedy{TopkMethod::Greedy, ScoringFunc::Softmax, 6, 1, 1, false, 1.0f};
  RouterParams glg{TopkMethod::GroupLimitedGreedy, ScoringFunc::Softmax, 6, 8, 3, false, 16.0f};
  RouterParams noaux{TopkMethod::NoauxTc, ScoringFunc::Sigmoid, 8, 8, 4, true, 2.5f};
  // Fused shared experts: 2 (1) fixed ids after the picks, weight 1.
  RouterParams greedy_fixed = greedy, noaux_fixed = noaux;
  greedy_fixed.n_fixed = 2;
  greedy_fixed.fixed_base = 64;
  noaux_fixed.n_fixed = 1;
  noaux_fixed.fixed_base = 256;
  for (int64_t T : {0, 1, 333}) {
    route_case(T, 64, greedy, false, 30 + T);
    route_case(T, 160, glg, false, 31 + T);
    route_case(T, 256, noaux, true, 32 + T);
    route_case(T, 64, greedy_fixed, false, 33 + T);
    route_case(T, 256, noaux_fixed, true, 34 + T);
  }
}

// count_experts against the CPU reference: ids in and outside [0, E) over every row, then over the rows a batch's
// moe_rows pairs name (a padded graph batch's real rows, DP attention's groups); the counts accumulate.
TEST(CudaOps, CountExperts) {
  REQUIRE_GPU();
  const int64_t E = 64;
  for (int64_t R : {0, 1, 7, 700}) {
    for (int32_t k : {1, 6, 8}) {
      std::mt19937_64 rng(static_cast<uint64_t>(R * 31 + k));
      Tensor ids = Tensor::empty_host({R, k}, DType::I32);
      for (int64_t i = 0; i < ids.numel(); ++i) ids.data_as<int32_t>()[i] = static_cast<int32_t>(rng() % (E + 6)) - 3;
      Tensor ic = cpu().upload(ids, DType::I32), ig = gpu().upload(ids, DType::I32);
      Tensor cc = cpu().alloc({E}, DType::I64), cg = gpu().alloc({E}, DType::I64);
      cpu().zero(cc);
      gpu().zero(cg);
      const int32_t r = static_cast<int32_t>(R);
      for (const std::vector<int32_t>& pairs :
           {std::vector<int32_t>{}, std::vector<int32_t>{0, r / 2}, std::vector<int32_t>{1, r / 3, r / 2, r, r, 4}}) {
        ForwardBatch b;
        b.moe_rows = pairs;
        begin(b);
        cpu().count_experts(ic, cc);
        gpu().count_experts(ig, cg);
        std::vector<int64_t> want(static_cast<size_t>(E)), got(static_cast<size_t>(E));
        cpu().download(cc, want.data());
        gpu().download(cg, got.data());
        ASSERT_EQ(got, want) << "R " << R << " k " << k << " pairs " << pairs.size();
      }
    }
  }
}

// moe_gate (router product + routing) against the CPU's linear + moe_route. Integer-valued inputs (x in [-2, 2],
// router weights in 256ths of [-4, 4]) make every logit exact in fp32 whatever the summation order, so the ids
// must match exactly (ties included: both rank them by index). Each case runs twice on the GPU: the fused kernel's
// arrival counter must be left ready for the next launch.
void gate_case(int64_t T, int64_t E, int64_t H, const RouterParams& rp, bool bias, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Tensor x = Tensor::empty_host({T, H}, DType::F32), w = Tensor::empty_host({E, H}, DType::F32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data_as<float>()[i] = static_cast<float>(static_cast<int>(rng() % 5) - 2);
  for (int64_t i = 0; i < w.numel(); ++i)
    w.data_as<float>()[i] = static_cast<float>(static_cast<int>(rng() % 9) - 4) / 256.0f;
  Tensor bs = rand_host({E}, seed + 1, 0.1f);
  Tensor xc = cpu().upload(x, DType::F32), xg = gpu().upload(x, DType::BF16);
  Tensor wc = cpu().upload(w, DType::BF16), wg = gpu().upload(w, DType::BF16);
  Tensor bc = cpu().upload(bs, DType::F32), bg = gpu().upload(bs, DType::F32);
  const int64_t k = rp.ids_per_token();
  Tensor ic = cpu().alloc({T, k}, DType::I32), vc = cpu().alloc({T, k}, DType::F32);
  cpu().moe_gate(xc, wc, bias ? &bc : nullptr, rp, ic, vc);
  const std::string what = "gate T" + std::to_string(T) + " E" + std::to_string(E) + " H" + std::to_string(H);
  for (int run = 0; run < 2; ++run) {
    Tensor ig = gpu().alloc({T, k}, DType::I32), vg = gpu().alloc({T, k}, DType::F32);
    gpu().moe_gate(xg, wg, bias ? &bg : nullptr, rp, ig, vg);
    Tensor ich = cpu().to_host_f32(ic), igh = gpu().to_host_f32(ig);
    int64_t mismatch = 0;
    for (int64_t i = 0; i < ich.numel(); ++i) mismatch += ich.data_as<float>()[i] != igh.data_as<float>()[i];
    EXPECT_EQ(mismatch, 0) << what << " run " << run;
    expect_close(cpu().to_host_f32(vc), gpu().to_host_f32(vg), 1e-5, 1e-5, what + " weights");
  }
}

TEST(CudaOps, MoeGateMatchesLinearAndRoute) {
  REQUIRE_GPU();
  RouterParams greedy{TopkMethod::Greedy, ScoringFunc::Softmax, 6, 1, 1, false, 1.0f};
  RouterParams glg{TopkMethod::GroupLimitedGreedy, ScoringFunc::Softmax, 6, 8, 3, false, 16.0f};
  RouterParams noaux{TopkMethod::NoauxTc, ScoringFunc::Sigmoid, 8, 8, 4, true, 2.5f};
  RouterParams greedy_fixed = greedy, noaux_fixed = noaux;  // fused shared experts after the picks
  greedy_fixed.n_fixed = 2;
  greedy_fixed.fixed_base = 64;
  noaux_fixed.n_fixed = 1;
  noaux_fixed.fixed_base = 256;
  // The fused kernel takes one row, or two (a block routing each) where the experts fit one cluster (<= 64); the rest
  // go through linear + moe_route.
  for (int64_t T : {1, 2, 3, 8, 9}) {
    gate_case(T, 64, 2048, greedy_fixed, false, 65 + T);
    gate_case(T, 256, 7168, noaux_fixed, true, 66 + T);
    gate_case(T, 64, 2048, greedy, false, 60 + T);
    gate_case(T, 160, 5120, glg, false, 61 + T);
    gate_case(T, 256, 7168, noaux, true, 62 + T);
    gate_case(T, 20, 40, greedy, false, 63 + T);  // K % 32 != 0, fewer experts than a block's warps
    gate_case(T, 384, 256, greedy, false, 64 + T);  // more experts than the fused kernel takes
  }
}

// add_rmsnorm_moe_gate (at one row the norm runs inside the router's launch) gives what add_rmsnorm then moe_gate
// give: residual sums bit for bit; the normalised rows, ids and weights bit for bit where the norm kernel also uses
// 256 threads (1024 <= H < 4096) or the ops run apart (2 rows), the rows within the last bf16 bit otherwise.
TEST(CudaOps, AddRmsnormMoeGateIsTheOps) {
  REQUIRE_GPU();
  RouterParams greedy{TopkMethod::Greedy, ScoringFunc::Softmax, 6, 1, 1, false, 1.0f};
  RouterParams noaux{TopkMethod::NoauxTc, ScoringFunc::Sigmoid, 8, 8, 4, true, 2.5f};
  RouterParams greedy_fixed = greedy;  // two fused shared experts after the picks
  greedy_fixed.n_fixed = 2;
  greedy_fixed.fixed_base = 64;
  struct Case { int64_t T, E, H; const RouterParams* rp; bool bias; };
  for (const Case c : {Case{1, 64, 2048, &greedy, false}, Case{1, 256, 7168, &noaux, true},
                       Case{1, 64, 2048, &greedy_fixed, false},
                       Case{1, 20, 40, &greedy, false}, Case{2, 64, 2048, &greedy, false}}) {
    const std::string what =
        "norm+gate T" + std::to_string(c.T) + " E" + std::to_string(c.E) + " H" + std::to_string(c.H);
    Tensor x = rand_host({c.T, c.H}, 71 + c.H), r = rand_host({c.T, c.H}, 72 + c.H), nw = rand_host({c.H}, 73, 0.2f);
    for (int64_t i = 0; i < c.H; ++i) nw.data_as<float>()[i] += 1.0f;
    Tensor w = rand_host({c.E, c.H}, 74 + c.E, 0.05f), bs = rand_host({c.E}, 75, 0.1f);
    Tensor xg = gpu().upload(x, DType::BF16), rg = gpu().upload(r, DType::BF16), nwg = gpu().upload(nw, DType::F32);
    Tensor wg = gpu().upload(w, DType::BF16), bg = gpu().upload(bs, DType::F32);
    const Tensor* bias = c.bias ? &bg : nullptr;
    Tensor ro = gpu().alloc({c.T, c.H}, DType::BF16), n1 = gpu().alloc({c.T, c.H}, DType::BF16);
    const int64_t k = c.rp->ids_per_token();
    Tensor i1 = gpu().alloc({c.T, k}, DType::I32), v1 = gpu().alloc({c.T, k}, DType::F32);
    gpu().add_rmsnorm_moe_gate(xg, rg, ro, nwg, 1e-6f, n1, wg, bias, *c.rp, i1, v1);
    Tensor r2 = gpu().upload(r, DType::BF16), n2 = gpu().alloc({c.T, c.H}, DType::BF16);
    Tensor i2 = gpu().alloc({c.T, k}, DType::I32), v2 = gpu().alloc({c.T, k}, DType::F32);
    gpu().add_rmsnorm(xg, r2, nwg, 1e-6f, n2);
    gpu().moe_gate(n2, wg, bias, *c.rp, i2, v2);
    EXPECT_EQ(count_diff(r2, ro), 0) << what << ": residual sums";
    EXPECT_EQ(count_diff(rg, gpu().upload(r, DType::BF16)), 0) << what << ": the residual input was written";
    if (c.T > 1 || (c.H >= 1024 && c.H < 4096)) {
      EXPECT_EQ(count_diff(n1, n2), 0) << what << ": normalised rows";
      EXPECT_EQ(count_diff(i1, i2), 0) << what << ": ids";
      EXPECT_EQ(count_diff(v1, v2), 0) << what << ": weights";
    } else {
      expect_close(gpu().to_host_f32(n2), gpu().to_host_f32(n1), 4e-3, 1e-2, what + " normalised rows");
    }
    Tensor nc = cpu().alloc({c.T, c.H}, DType::F32), rc = cpu().upload(r, DType::F32);
    Tensor roc = cpu().alloc({c.T, c.H}, DType::F32), ic = cpu().alloc({c.T, k}, DType::I32);
    Tensor vc = cpu().alloc({c.T, k}, DType::F32), bc = cpu().upload(bs, DType::F32);
    cpu().add_rmsnorm_moe_gate(cpu().upload(x, DType::F32), rc, roc, cpu().upload(nw, DType::F32), 1e-6f, nc,
                               cpu().upload(w, DType::BF16), c.bias ? &bc : nullptr, *c.rp, ic, vc);
    expect_close(cpu().to_host_f32(nc), gpu().to_host_f32(n1), 8e-3, 2e-2, what + " normalised rows vs cpu");
  }
}

// Routing ids [T, k] (host I32): k distinct experts per token drawn from all `experts` (shuffled by an RNG of `seed`).
Tensor distinct_routing(int64_t T, int64_t k, int64_t experts, uint64_t seed) {
  Tensor ids = Tensor::empty_host({T, k}, DType::I32);
  std::mt19937_64 rng(seed);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> all(static_cast<size_t>(experts));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t j = 0; j < k; ++j) ids.data_as<int32_t>()[t * k + j] = all[static_cast<size_t>(j)];
  }
  return ids;
}

// kind: gpu(kind); Is > 0: shared experts of that width too.
void moe_case(int64_t T, int64_t E, int64_t k, int64_t H, int64_t I, int32_t expert_begin, int64_t e_total,
              int64_t active, int kind, uint64_t seed, int64_t Is = 0) {
  // ids only from the first `active` global experts (the rest receive nothing), distinct per token.
  Tensor ids = distinct_routing(T, k, active, seed);
  (void)e_total;
  Tensor w = rand_host({T, k}, seed + 1, 0.3f), x = rand_host({T, H}, seed + 2);
  Tensor gu = rand_host({E, 2 * I, H}, seed + 3, 1.0f / std::sqrt(static_cast<float>(H)));
  Tensor dn = rand_host({E, H, I}, seed + 4, 1.0f / std::sqrt(static_cast<float>(I)));
  Backend& g = gpu(kind);
  Tensor xc = cpu().upload(x, DType::F32), xg = g.upload(x, DType::BF16);
  Tensor idc = cpu().upload(ids, DType::I32), idg = g.upload(ids, DType::I32);
  Tensor wc = cpu().upload(w, DType::F32), wg = g.upload(w, DType::F32);
  Tensor guc = cpu().upload(gu, DType::BF16), gug = g.upload(gu, DType::BF16);
  Tensor dnc = cpu().upload(dn, DType::BF16), dng = g.upload(dn, DType::BF16);
  Tensor oc = cpu().alloc({T, H}, DType::F32), og = g.alloc({T, H}, DType::BF16);
  Tensor sgc, sgg, sdc, sdg;
  if (Is > 0) {
    Tensor sgu = rand_host({2 * Is, H}, seed + 5, 1.0f / std::sqrt(static_cast<float>(H)));
    Tensor sdn = rand_host({H, Is}, seed + 6, 1.0f / std::sqrt(static_cast<float>(Is)));
    sgc = cpu().upload(sgu, DType::BF16);
    sgg = g.upload(sgu, DType::BF16);
    sdc = cpu().upload(sdn, DType::BF16);
    sdg = g.upload(sdn, DType::BF16);
  }
  cpu().moe_experts(xc, idc, wc, guc, dnc, expert_begin, Is ? &sgc : nullptr, Is ? &sdc : nullptr, 0, oc);
  g.moe_experts(xg, idg, wg, gug, dng, expert_begin, Is ? &sgg : nullptr, Is ? &sdg : nullptr, 0, og);
  expect_close(cpu().to_host_f32(oc), g.to_host_f32(og), 1e-2, 3e-2,
               "moe T" + std::to_string(T) + " E" + std::to_string(E) + " H" + std::to_string(H) + " I" +
                   std::to_string(I) + " shared " + std::to_string(Is) + " kind " + std::to_string(kind));
}

TEST(CudaOps, MoeExpertsSmall) {
  REQUIRE_GPU();
  // Up to 2 tokens: the small-batch MoE (kind 0), with and without shared experts; kind 3 the grouped kernels at the
  // same sizes, kind 2 cuBLAS.
  for (int kind : {0, 3}) {
    moe_case(1, 8, 6, 2048, 1408, 0, 8, 8, kind, 46, 2816);  // V2-Lite widths, 2 shared experts (two slices)
    moe_case(2, 16, 6, 256, 96, 0, 16, 16, kind, 47, 192);
    moe_case(2, 32, 16, 256, 64, 0, 32, 32, kind, 48, 64);   // 32 (token, slot) pairs: the plan's limit
    moe_case(2, 8, 6, 256, 104, 4, 16, 10, kind, 49, 104);   // local experts 4..11 of 16, shared experts
    moe_case(2, 16, 3, 256, 64, 0, 16, 3, kind, 50, 1024);   // both tokens on the same 3 experts; 8 shared slices
    moe_case(3, 8, 6, 256, 104, 4, 16, 10, kind, 51, 104);   // 3 tokens: the grouped kernels + shared MLP
    moe_case(2, 4, 2, 64, 2560, 0, 4, 4, kind, 52, 2560);    // rows of two load chunks (routed and shared)
    moe_case(2, 8, 6, 2048, 1408, 0, 8, 8, kind, 53, 2816);  // V2-Lite widths at 2 tokens
    moe_case(4, 8, 6, 2048, 1408, 0, 8, 8, kind, 54, 2816);  // V2-Lite widths at 4 tokens
    moe_case(4, 64, 16, 256, 64, 0, 64, 64, kind, 55, 64);   // 64 (token, slot) pairs
  }
  for (int kind : {0, 2, 3}) {
    moe_case(1, 16, 4, 256, 96, 0, 16, 16, kind, 40);
    moe_case(5, 16, 4, 256, 96, 0, 16, 6, kind, 41);      // 10 experts with no tokens
    moe_case(8, 8, 6, 256, 104, 4, 16, 7, kind, 45);      // local experts 4..11 of 16, ~7 rows each from 8 tokens
    moe_case(300, 8, 4, 256, 48, 4, 16, 16, kind, 42);    // local experts 4..11 of 16
    moe_case(600, 16, 4, 128, 48, 0, 16, 16, kind, 43);   // > 96 rows per expert: the 128-row tiles
  }
  moe_case(0, 16, 4, 256, 96, 0, 16, 16, 0, 44);
}

// Prefill-sized MoE steps (>= 8192 assignments: the grouping over many blocks), with shared experts (their output
// added by the routed combine): the grouped kernels (12,000 rows < 384 per expert) and per-expert cuBLAS (local
// experts 4..11 of 16); smaller steps with shared experts through forced cuBLAS and the grouped kernels.
TEST(CudaOps, MoeExpertsManyAssignmentsAndSharedExperts) {
  REQUIRE_GPU();
  moe_case(3000, 64, 4, 256, 64, 0, 64, 64, 0, 56, 96);
  moe_case(2100, 8, 4, 256, 48, 4, 16, 16, 0, 57, 64);
  moe_case(300, 8, 4, 256, 48, 4, 16, 16, 2, 58, 96);
  moe_case(5, 16, 4, 256, 96, 0, 16, 6, 3, 59, 64);
}

// The grouping of many assignments over many blocks (cuda::moe_group with its hist scratch) against one block's:
// the same expert ranges, counts and tiles; every local assignment at a position of its expert's range holding its
// token row and weight, each position once; -1 for the others.
TEST(CudaOps, MoeGroupManyBlocksIsOneBlocks) {
  REQUIRE_GPU();
  struct Case {
    int64_t T;
    int32_t k, E, expert_begin, e_total, block_m;
  };
  // (50,000 x 6: more than 256 blocks of 1,024, so blocks of more)
  for (const Case c : {Case{2048, 4, 64, 0, 64, 128}, Case{3001, 6, 16, 8, 40, 64}, Case{16384, 6, 64, 0, 64, 128},
                       Case{1500, 8, 256, 0, 256, 128}, Case{50000, 6, 64, 0, 64, 128}}) {
    const int64_t n = c.T * c.k;
    ASSERT_GT(cuda::moe_group_hist_ints(c.T, c.k, c.E), 0) << n;
    std::mt19937_64 rng(static_cast<uint64_t>(n));
    std::vector<int32_t> ids(static_cast<size_t>(n));
    std::vector<float> w(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      ids[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % static_cast<uint64_t>(c.e_total));
      w[static_cast<size_t>(i)] = static_cast<float>(i) * 0.5f;
    }
    const int32_t max_tiles = cuda::moe_max_tiles(c.T, c.k, c.E, c.block_m);
    Tensor idg = gpu().upload(Tensor::view(ids.data(), {n}, DType::I32), DType::I32);
    Tensor wg = gpu().upload(Tensor::view(w.data(), {n}, DType::F32), DType::F32);
    struct Out {
      Tensor end, row, weight, assign, tiles, num_tiles, counts, hist;
    };
    auto group = [&](bool many) {
      Out o{gpu().alloc({c.E}, DType::I32), gpu().alloc({n}, DType::I32), gpu().alloc({n}, DType::F32),
            gpu().alloc({n}, DType::I32), gpu().alloc({max_tiles}, DType::I32), gpu().alloc({1}, DType::I32),
            gpu().alloc({c.E}, DType::I32), gpu().alloc({cuda::moe_group_hist_ints(c.T, c.k, c.E)}, DType::I32)};
      cuda::MoeGroupOut g{o.end.data_as<int32_t>(),    o.row.data_as<int32_t>(),   o.weight.data_as<float>(),
                          o.assign.data_as<int32_t>(), o.tiles.data_as<int32_t>(), o.num_tiles.data_as<int32_t>(),
                          o.counts.data_as<int32_t>(), many ? o.hist.data_as<int32_t>() : nullptr};
      EXPECT_EQ(cuda::moe_group(idg.data_as<const int32_t>(), wg.data_as<const float>(), c.T, c.k, c.E,
                                c.expert_begin, c.block_m, g, static_cast<cudaStream_t>(gpu().native_stream())),
                cudaSuccess);
      return o;
    };
    auto host = [&](const Tensor& t) {
      std::vector<int32_t> v(static_cast<size_t>(t.numel()));
      gpu().download(t, v.data());
      return v;
    };
    const Out one = group(false), many = group(true);
    const std::string what = "T " + std::to_string(c.T) + " E " + std::to_string(c.E);
    const std::vector<int32_t> end = host(one.end), num_tiles = host(one.num_tiles);
    ASSERT_EQ(host(many.end), end) << what;
    ASSERT_EQ(host(many.counts), host(one.counts)) << what;
    ASSERT_EQ(host(many.num_tiles), num_tiles) << what;
    std::vector<int32_t> tiles_one = host(one.tiles), tiles_many = host(many.tiles);
    tiles_one.resize(static_cast<size_t>(num_tiles[0]));
    tiles_many.resize(static_cast<size_t>(num_tiles[0]));
    EXPECT_EQ(tiles_many, tiles_one) << what;
    const std::vector<int32_t> assign = host(many.assign), row = host(many.row);
    std::vector<float> weight(static_cast<size_t>(n));
    gpu().download(many.weight, weight.data());
    std::vector<int> seen(static_cast<size_t>(n), 0);
    int64_t bad = 0, local = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t e = ids[static_cast<size_t>(i)] - c.expert_begin, pos = assign[static_cast<size_t>(i)];
      if (e < 0 || e >= c.E) {
        bad += pos != -1;
        continue;
      }
      ++local;
      const int32_t lo = e == 0 ? 0 : end[static_cast<size_t>(e - 1)], hi = end[static_cast<size_t>(e)];
      if (pos < lo || pos >= hi) {
        ++bad;
        continue;
      }
      const size_t at = static_cast<size_t>(pos);
      bad += row[at] != i / c.k || weight[at] != w[static_cast<size_t>(i)] || seen[at]++ != 0;
    }
    EXPECT_EQ(bad, 0) << what;
    EXPECT_EQ(local, end[static_cast<size_t>(c.E - 1)]) << what;
  }
}

// FP8 weights kept quantized: random E4M3 codes (every byte but the two NaNs) and block scales; B matrices.
struct Fp8Weights {
  Tensor codes, scales, bf16_ref;  // host: F8 [B, R, C], F32 scales, and the CPU reference's bf16 as F32
};
// Random codes (no NaN; only subnormal ones, exponent 0, with `subnormal`) and scales in [1e-3, 2e-2].
Fp8Weights fp8_weights(int64_t B, int64_t R, int64_t C, int64_t br, int64_t bc, uint64_t seed, bool subnormal = false) {
  Fp8Weights w;
  const int64_t sr = (R + br - 1) / br, sc = (C + bc - 1) / bc;
  w.codes = Tensor::empty_host({B, R, C}, DType::F8_E4M3);
  w.scales = Tensor::empty_host({B, sr, sc}, DType::F32);
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < w.codes.numel(); ++i) {
    uint8_t c = static_cast<uint8_t>(rng());
    if ((c & 0x7f) == 0x7f) c ^= 1;  // not a NaN
    if (subnormal) c &= 0x87;
    w.codes.data_as<uint8_t>()[i] = c;
  }
  std::uniform_real_distribution<float> u(1e-3f, 2e-2f);
  for (int64_t i = 0; i < w.scales.numel(); ++i) w.scales.data_as<float>()[i] = u(rng);
  w.bf16_ref = Tensor::empty_host({B, R, C}, DType::F32);
  cpu::dequant_fp8(w.codes.data_as<uint8_t>(), w.scales.data_as<float>(), B, R, C, br, bc, w.bf16_ref.data_as<float>());
  for (int64_t i = 0; i < w.bf16_ref.numel(); ++i) {
    float& v = w.bf16_ref.data_as<float>()[i];
    v = bf16_to_f32(f32_to_bf16(v));
  }
  return w;
}

// cuda::dequant_experts of the matrices in `a` (B matrices of R x C) against its CPU reference `ref` (bf16 values as
// F32): over every matrix (no ids) and over routing ids naming matrices 0 and 2 (and experts that are not local), it
// writes exactly the reference into the matrices it dequantizes and nothing else.
void expect_dequant(cuda::DequantArgs a, const Tensor& ref, const std::string& what) {
  const int64_t B = a.B, R = a.R, C = a.C;
  for (bool routed : {false, true}) {
    Tensor fill = Tensor::empty_host({B, R, C}, DType::F32);
    std::fill(fill.data_as<float>(), fill.data_as<float>() + fill.numel(), 7.0f);
    Tensor out = gpu().upload(fill, DType::BF16);
    const int32_t eb = 5;
    const std::vector<int32_t> ids{eb + 0, eb + 2, eb + 2, 1, eb + 100};  // matrices 0 and 2; others not local
    Tensor idg = gpu().upload(Tensor::view(const_cast<int32_t*>(ids.data()), {5}, DType::I32), DType::I32);
    a.ids = routed ? idg.data_as<const int32_t>() : nullptr;
    a.num_ids = 5;
    a.expert_begin = eb;
    a.out = static_cast<cuda::bf16*>(out.data());
    ASSERT_EQ(cuda::dequant_experts(a, static_cast<cudaStream_t>(gpu().native_stream())), cudaSuccess);
    const Tensor got = gpu().to_host_f32(out);
    const int64_t n = R * C;
    int64_t bad = 0;
    for (int64_t b = 0; b < B; ++b) {
      const bool named = !routed || b == 0 || b == 2;
      for (int64_t i = b * n; i < (b + 1) * n; ++i)
        bad += got.data_as<float>()[i] != (named ? ref.data_as<float>()[i] : 7.0f);
    }
    EXPECT_EQ(bad, 0) << what << (routed ? " routed" : " all");
  }
}

// cuda::dequant_experts of FP8 codes is the CPU reference rounded to bf16, bit for bit (edge blocks cut short
// included), and with routing ids it writes only the matrices they name.
TEST(CudaOps, DequantFp8IsTheCpuReference) {
  REQUIRE_GPU();
  struct Case {
    int64_t B, R, C, br, bc;
  };
  for (const Case& c : {Case{3, 40, 48, 16, 16}, Case{2, 200, 264, 128, 128}, Case{4, 24, 64, 8, 8}}) {
    Fp8Weights w = fp8_weights(c.B, c.R, c.C, c.br, c.bc, 61);
    Tensor codes = gpu().upload(w.codes, DType::F8_E4M3), scales = gpu().upload(w.scales, DType::F32);
    cuda::DequantArgs a{};
    a.w = codes.data_as<const uint8_t>();
    a.scale = scales.data_as<const float>();
    a.B = c.B;
    a.R = c.R;
    a.C = c.C;
    a.block_rows = c.br;
    a.block_cols = c.bc;
    expect_dequant(a, w.bf16_ref, fmt::format("{}x{}x{} in {}x{}", c.B, c.R, c.C, c.br, c.bc));
  }
}


// moe_experts on FP8 experts (F8 codes with BlockScales) against moe_experts on their dequantized bf16 weights:
// bit for bit where the FP8 codes are made into the same bf16 values (dequantized first for cuBLAS, converted tile by
// tile in the grouped kernels, read by the small-batch kernels one bf16 vector at a time at 1-4 tokens when the scale
// blocks are not whole 64-column chunks, or the shared experts' width is not a multiple of 64); within the
// rounding of code * scale to bf16 where the small-batch kernels take them to the tensor cores (1-4 tokens, blocks
// of whole chunks: code . x scaled per chunk, the weights never rounded). With and without shared experts (bf16
// beside the FP8 routed ones), V2-Lite widths in 128 x 128 blocks; `subnormal`: codes with exponent 0 only (their
// values are below E4M3's normal range; a path that flushed them would give zeros).
void moe_fp8_case(int64_t E, int64_t k, int64_t H, int64_t I, int64_t Is, int64_t br, int64_t bc,
                  std::initializer_list<int64_t> Ts, uint64_t seed, bool subnormal = false,
                  int32_t expert_begin = 0) {
  Fp8Weights gu = fp8_weights(E, 2 * I, H, br, bc, seed, subnormal);
  Fp8Weights dn = fp8_weights(E, H, I, br, bc, seed + 1, subnormal);
  const bool whole_chunks =
      bc % 64 == 0 && ((bc / 64) & (bc / 64 - 1)) == 0 && H % 64 == 0 && I % 64 == 0 && Is % 64 == 0;
  for (int kind : {0, 2, 3}) {
    Backend& g = gpu(kind);
    Tensor gu8 = g.upload(gu.codes, DType::F8_E4M3), dn8 = g.upload(dn.codes, DType::F8_E4M3);
    gu8.set_block_scales(
        std::make_shared<const BlockScales>(BlockScales{g.upload(gu.scales, DType::F32), br, bc, {}}));
    dn8.set_block_scales(
        std::make_shared<const BlockScales>(BlockScales{g.upload(dn.scales, DType::F32), br, bc, {}}));
    Tensor gub = g.upload(gu.bf16_ref, DType::BF16), dnb = g.upload(dn.bf16_ref, DType::BF16);
    Tensor sg, sd;
    if (Is) {
      sg = g.upload(rand_host({2 * Is, H}, seed + 2, 1.0f / std::sqrt(static_cast<float>(H))), DType::BF16);
      sd = g.upload(rand_host({H, Is}, seed + 3, 1.0f / std::sqrt(static_cast<float>(Is))), DType::BF16);
    }
    for (int64_t T : Ts) {
      Tensor x = g.upload(rand_host({T, H}, seed + 4 + static_cast<uint64_t>(T)), DType::BF16);
      const Tensor ids_h = distinct_routing(T, k, E + expert_begin, seed + static_cast<uint64_t>(T));
      const Tensor w_h = rand_host({T, k}, seed + 5, 0.5f);
      Tensor ids = g.upload(ids_h, DType::I32), wts = g.upload(w_h, DType::F32);
      Tensor o8 = g.alloc({T, H}, DType::BF16), ob = g.alloc({T, H}, DType::BF16);
      g.moe_experts(x, ids, wts, gu8, dn8, expert_begin, Is ? &sg : nullptr, Is ? &sd : nullptr, 0, o8);
      g.moe_experts(x, ids, wts, gub, dnb, expert_begin, Is ? &sg : nullptr, Is ? &sd : nullptr, 0, ob);
      // kind 0: tensor cores with exact codes (small batches, scaled products: within the bf16 rounding of the
      // dequantized weights), moe_fp8_decode (the dequantized weights, another summation order: an act rounded to
      // the other neighbouring bf16 at most), else the exact grouped kernels.
      const bool tensor_cores = kind == 0 && T <= mlaserve::cuda::kMoeSmallTcRows && whole_chunks;
      const bool small = tensor_cores || T <= mlaserve::cuda::kMoeSmallRows;
      const bool decode = kind == 0 && !small && T * k <= mlaserve::cuda::kMoeFp8DecodeRowsPerExpert * E &&
                          mlaserve::cuda::moe_fp8_decode_fits(H, I, br, bc);
      const double tol = tensor_cores ? 1e-2 : decode ? 2e-3 : 0.0;
      expect_close(g.to_host_f32(ob), g.to_host_f32(o8), tol, 5 * tol,
                   "fp8 experts T" + std::to_string(T) + " I" + std::to_string(I) + " shared " + std::to_string(Is) +
                       " kind " + std::to_string(kind) + (subnormal ? " subnormal" : "") + " experts from " +
                   std::to_string(expert_begin));
    }
  }
}

TEST(CudaOps, MoeExpertsFp8IsItsDequantizedModel) {
  REQUIRE_GPU();
  // Tensor cores up to kMoeSmallTcRows tokens where the scale blocks are whole 64-column chunks (5+ tokens: the
  // shared experts' gate/up on them too; 9+ tokens in the mma's rows 8-15 too), the exact conversions elsewhere.
  // moe_fp8_decode past them up to kMoeFp8DecodeRowsPerExpert rows per expert (8, 16 or 32 of an expert's rows a
  // pass, experts with none, with more than one pass), the exact grouped kernels past that.
  moe_fp8_case(8, 2, 256, 128, 0, 64, 64, {1, 2, 3, 4, 6, 8, 12, 20, 60, 300}, 62);
  moe_fp8_case(16, 6, 2048, 1408, 2816, 128, 128, {1, 2, 4, 5, 8, 9, 16, 17, 40, 80}, 70);  // V2-Lite, 2 shared
  moe_fp8_case(8, 2, 256, 96, 96, 16, 48, {1, 3, 7, 16, 40}, 80);                   // blocks of 16 x 48 rows / cols
  moe_fp8_case(8, 3, 512, 256, 0, 128, 128, {1, 4, 8, 13, 30}, 90, true);           // subnormal codes only
  moe_fp8_case(8, 2, 512, 192, 64, 64, 256, {1, 2, 3, 7, 10, 24, 50}, 100);         // 4 chunks a scale block
  moe_fp8_case(8, 2, 256, 128, 96, 64, 64, {1, 4, 8, 16}, 110);                     // shared not in 64-col chunks
  moe_fp8_case(64, 2, 256, 128, 0, 128, 128, {17, 33}, 120);                        // most experts without rows
  // Expert parallelism: this rank's experts are the second half of the routed ones (the other ids are skipped).
  moe_fp8_case(8, 2, 256, 128, 0, 64, 64, {1, 2, 4, 8, 20, 60, 300}, 130, false, 8);
  moe_fp8_case(16, 6, 2048, 1408, 2816, 128, 128, {1, 4, 9, 40, 80}, 140, false, 16);
}

// INT4 weights kept quantized: random code pairs, each row's groups' scales in [1e-3, 2e-2] and zero points 0-16.
struct Int4Weights {
  Tensor codes, scales, zeros, bf16_ref;  // host: U8 [B, R, C / 2], F32 [B, R, G] twice, the CPU reference's bf16
};
Int4Weights int4_weights(int64_t B, int64_t R, int64_t C, int64_t group, uint64_t seed) {
  Int4Weights w;
  const int64_t G = (C + group - 1) / group;
  w.codes = Tensor::empty_host({B, R, C / 2}, DType::U8);
  w.scales = Tensor::empty_host({B, R, G}, DType::F32);
  w.zeros = Tensor::empty_host({B, R, G}, DType::F32);
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < w.codes.numel(); ++i) w.codes.data_as<uint8_t>()[i] = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> u(1e-3f, 2e-2f);
  for (int64_t i = 0; i < w.scales.numel(); ++i) {
    w.scales.data_as<float>()[i] = u(rng);
    w.zeros.data_as<float>()[i] = static_cast<float>(rng() % 17);
  }
  w.bf16_ref = Tensor::empty_host({B, R, C}, DType::F32);
  cpu::dequant_int4(w.codes.data_as<uint8_t>(), w.scales.data_as<float>(), w.zeros.data_as<float>(), B, R, C, group,
                    w.bf16_ref.data_as<float>());
  for (int64_t i = 0; i < w.bf16_ref.numel(); ++i) {
    float& v = w.bf16_ref.data_as<float>()[i];
    v = bf16_to_f32(f32_to_bf16(v));
  }
  return w;
}

// cuda::dequant_experts of INT4 codes is the CPU reference rounded to bf16, bit for bit (a last group cut short, one
// group per row included), and with routing ids it writes only the matrices they name.
TEST(CudaOps, DequantInt4IsTheCpuReference) {
  REQUIRE_GPU();
  struct Case {
    int64_t B, R, C, group;
  };
  for (const Case& c : {Case{3, 40, 48, 16}, Case{2, 200, 264, 128}, Case{4, 24, 64, 64}, Case{2, 16, 40, 1000}}) {
    Int4Weights w = int4_weights(c.B, c.R, c.C, c.group, 63);
    Tensor codes = gpu().upload(w.codes, DType::U8), scales = gpu().upload(w.scales, DType::F32);
    Tensor zeros = gpu().upload(w.zeros, DType::F32);
    cuda::DequantArgs a{};
    a.w = codes.data_as<const uint8_t>();
    a.scale = scales.data_as<const float>();
    a.zero = zeros.data_as<const float>();
    a.B = c.B;
    a.R = c.R;
    a.C = c.C;
    a.block_rows = 1;
    a.block_cols = c.group;
    expect_dequant(a, w.bf16_ref, fmt::format("{}x{}x{} in groups of {}", c.B, c.R, c.C, c.group));
  }
}

// moe_experts on INT4 experts (code pairs with BlockScales holding scales and zeros) is moe_experts on their
// dequantized bf16 weights: bit for bit where the grouped kernels make each tile bf16((code - zero) * scale) as
// dequant_experts does, or where the named experts are dequantized first (cuBLAS; widths off 32-column chunks); within
// the rounding of (code - zero) * scale to bf16 where the small-batch kernels read the codes on tensor cores (up to
// kMoeSmallTcRows tokens, groups of a power-of-two multiple of 64 columns). With shared experts; under expert
// parallelism (ids of other ranks skipped).
void moe_int4_case(int64_t E, int64_t k, int64_t H, int64_t I, int64_t Is, int64_t group,
                   std::initializer_list<int64_t> Ts, uint64_t seed, int32_t expert_begin = 0) {
  Int4Weights gu = int4_weights(E, 2 * I, H, group, seed), dn = int4_weights(E, H, I, group, seed + 1);
  for (int kind : {0, 2, 3}) {
    Backend& g = gpu(kind);
    Tensor gu4 = g.upload(gu.codes, DType::U8), dn4 = g.upload(dn.codes, DType::U8);
    gu4.set_block_scales(std::make_shared<const BlockScales>(
        BlockScales{g.upload(gu.scales, DType::F32), 1, group, g.upload(gu.zeros, DType::F32)}));
    dn4.set_block_scales(std::make_shared<const BlockScales>(
        BlockScales{g.upload(dn.scales, DType::F32), 1, group, g.upload(dn.zeros, DType::F32)}));
    Tensor gub = g.upload(gu.bf16_ref, DType::BF16), dnb = g.upload(dn.bf16_ref, DType::BF16);
    Tensor sg, sd;
    if (Is) {
      sg = g.upload(rand_host({2 * Is, H}, seed + 2, 1.0f / std::sqrt(static_cast<float>(H))), DType::BF16);
      sd = g.upload(rand_host({H, Is}, seed + 3, 1.0f / std::sqrt(static_cast<float>(Is))), DType::BF16);
    }
    for (int64_t T : Ts) {
      const size_t mark = g.scratch_mark();  // the dequantized experts' scratch, handed out again next size
      Tensor x = g.upload(rand_host({T, H}, seed + 4 + static_cast<uint64_t>(T)), DType::BF16);
      const Tensor ids_h = distinct_routing(T, k, E + expert_begin, seed + static_cast<uint64_t>(T));
      const Tensor w_h = rand_host({T, k}, seed + 5, 0.5f);
      Tensor ids = g.upload(ids_h, DType::I32), wts = g.upload(w_h, DType::F32);
      Tensor o4 = g.alloc({T, H}, DType::BF16), ob = g.alloc({T, H}, DType::BF16);
      g.moe_experts(x, ids, wts, gu4, dn4, expert_begin, Is ? &sg : nullptr, Is ? &sd : nullptr, 0, o4);
      g.moe_experts(x, ids, wts, gub, dnb, expert_begin, Is ? &sg : nullptr, Is ? &sd : nullptr, 0, ob);
      const bool tensor_cores = kind == 0 && T <= mlaserve::cuda::kMoeSmallTcRows &&
                                mlaserve::cuda::moe_small_tc_fits(H, I, Is, group);
      const double tol = tensor_cores ? 1e-2 : 0.0;
      expect_close(g.to_host_f32(ob), g.to_host_f32(o4), tol, 5 * tol,
                   fmt::format("int4 experts T{} I{} shared {} kind {} experts from {}", T, I, Is, kind,
                               expert_begin));
      g.scratch_release(mark);
    }
  }
}

TEST(CudaOps, MoeExpertsInt4IsItsDequantizedModel) {
  REQUIRE_GPU();
  moe_int4_case(8, 2, 256, 128, 0, 64, {1, 2, 3, 4, 5, 8, 12, 16, 17, 20, 300}, 150);
  moe_int4_case(16, 6, 2048, 1408, 2816, 128, {1, 2, 4, 9, 16, 40, 80}, 160);  // V2-Lite, groups of 128, 2 shared
  moe_int4_case(8, 2, 256, 96, 96, 32, {1, 3, 16, 40}, 170);                   // groups of 32: grouped kernels
  moe_int4_case(8, 2, 256, 48, 0, 8, {1, 5, 40}, 172);                         // I off 32-col chunks: dequantized
  moe_int4_case(8, 2, 512, 192, 64, 256, {1, 2, 7, 10, 24}, 175);              // 4 chunks a group
  moe_int4_case(8, 2, 256, 128, 96, 64, {1, 4, 8}, 178);                       // shared not in 64-col chunks
  moe_int4_case(8, 2, 256, 128, 0, 64, {1, 4, 9, 20, 300}, 180, 8);            // expert parallelism: the second half
}

// Routing whose last nf ids per token are the last nf of E experts with weight 1 (shared experts fused into the
// routed ones), the first k - nf distinct among the others.
std::pair<Tensor, Tensor> fixed_routing(int64_t T, int64_t k, int64_t nf, int64_t E, uint64_t seed) {
  const Tensor picks = distinct_routing(T, k - nf, E - nf, seed);
  Tensor ids = Tensor::empty_host({T, k}, DType::I32), w = rand_host({T, k}, seed + 1, 0.5f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      int32_t& id = ids.data_as<int32_t>()[t * k + j];
      if (j < k - nf) {
        id = picks.data_as<int32_t>()[t * (k - nf) + j];
      } else {
        id = static_cast<int32_t>(E - nf + j - (k - nf));
        w.data_as<float>()[t * k + j] = 1.0f;
      }
    }
  return {ids, w};
}

// moe_experts told that the last n_fixed ids are fixed experts (on tensor cores up to kMoeSmallRows tokens their
// tiles come first, loaded before the wait, and the plan leaves them out) gives the same bits as untold, for INT4 and
// FP8 experts (more fixed tiles than warps at one token included, shared experts alongside), and stays the
// dequantized model's (within the tensor cores' tolerance).
TEST(CudaOps, MoeFixedExpertsFirstAreTheRoutedOnes) {
  REQUIRE_GPU();
  Backend& g = gpu(0);
  struct Case {
    bool int4;
    int64_t E, k, nf, H, I, Is, group;
    uint64_t seed;
  };
  const std::initializer_list<int64_t> Ts = {1, 2, 3, 4, 5, 9, 16};
  for (const Case& c : {Case{true, 10, 8, 2, 2048, 1408, 0, 128, 190},  // V2-Lite fused: 6 routed + 2 fixed
                        Case{true, 9, 8, 7, 256, 1408, 0, 64, 192},     // 2,464 fixed tiles at one token
                        Case{true, 8, 3, 1, 256, 128, 64, 64, 194},     // shared experts too
                        Case{false, 10, 8, 2, 2048, 1408, 0, 128, 196}, Case{false, 8, 3, 2, 512, 192, 64, 64, 198}}) {
    const std::string what = fmt::format("{} E{} k{} fixed {} H{} I{} shared {}", c.int4 ? "int4" : "fp8", c.E, c.k,
                                         c.nf, c.H, c.I, c.Is);
    Tensor gq, dq, gub, dnb;
    if (c.int4) {
      Int4Weights gu = int4_weights(c.E, 2 * c.I, c.H, c.group, c.seed), dn = int4_weights(c.E, c.H, c.I, c.group,
                                                                                         c.seed + 1);
      gq = g.upload(gu.codes, DType::U8);
      dq = g.upload(dn.codes, DType::U8);
      gq.set_block_scales(std::make_shared<const BlockScales>(
          BlockScales{g.upload(gu.scales, DType::F32), 1, c.group, g.upload(gu.zeros, DType::F32)}));
      dq.set_block_scales(std::make_shared<const BlockScales>(
          BlockScales{g.upload(dn.scales, DType::F32), 1, c.group, g.upload(dn.zeros, DType::F32)}));
      gub = g.upload(gu.bf16_ref, DType::BF16);
      dnb = g.upload(dn.bf16_ref, DType::BF16);
    } else {
      Fp8Weights gu = fp8_weights(c.E, 2 * c.I, c.H, c.group, c.group, c.seed);
      Fp8Weights dn = fp8_weights(c.E, c.H, c.I, c.group, c.group, c.seed + 1);
      gq = g.upload(gu.codes, DType::F8_E4M3);
      dq = g.upload(dn.codes, DType::F8_E4M3);
      gq.set_block_scales(
          std::make_shared<const BlockScales>(BlockScales{g.upload(gu.scales, DType::F32), c.group, c.group, {}}));
      dq.set_block_scales(
          std::make_shared<const BlockScales>(BlockScales{g.upload(dn.scales, DType::F32), c.group, c.group, {}}));
      gub = g.upload(gu.bf16_ref, DType::BF16);
      dnb = g.upload(dn.bf16_ref, DType::BF16);
    }
    Tensor sg, sd;
    if (c.Is) {
      sg = g.upload(rand_host({2 * c.Is, c.H}, c.seed + 2, 1.0f / std::sqrt(static_cast<float>(c.H))), DType::BF16);
      sd = g.upload(rand_host({c.H, c.Is}, c.seed + 3, 1.0f / std::sqrt(static_cast<float>(c.Is))), DType::BF16);
    }
    const Tensor* sgp = c.Is ? &sg : nullptr;
    const Tensor* sdp = c.Is ? &sd : nullptr;
    for (int64_t T : Ts) {
      const size_t mark = g.scratch_mark();
      Tensor x = g.upload(rand_host({T, c.H}, c.seed + 4 + static_cast<uint64_t>(T)), DType::BF16);
      const auto [ids_h, w_h] = fixed_routing(T, c.k, c.nf, c.E, c.seed + static_cast<uint64_t>(T));
      Tensor ids = g.upload(ids_h, DType::I32), wts = g.upload(w_h, DType::F32);
      Tensor told = g.alloc({T, c.H}, DType::BF16), untold = g.alloc({T, c.H}, DType::BF16);
      Tensor ref = g.alloc({T, c.H}, DType::BF16);
      const int32_t nf = static_cast<int32_t>(c.nf);
      g.moe_experts(x, ids, wts, gq, dq, 0, sgp, sdp, nf, told);
      g.moe_experts(x, ids, wts, gq, dq, 0, sgp, sdp, 0, untold);
      g.moe_experts(x, ids, wts, gub, dnb, 0, sgp, sdp, nf, ref);
      const Tensor t_h = g.to_host_f32(told);
      expect_close(g.to_host_f32(untold), t_h, 0.0, 0.0, fmt::format("{} T{}: told vs untold", what, T));
      expect_close(g.to_host_f32(ref), t_h, 1e-2, 5e-2, fmt::format("{} T{}: vs the dequantized model", what, T));
      g.scratch_release(mark);
    }
  }
}

TEST(CudaOps, MoeExpertsV2LiteShape) {
  REQUIRE_GPU();
  moe_case(256, 64, 6, 2048, 1408, 0, 64, 64, 0, 50);
}

// Samples the rows of host logits lg [R, V] on the CPU and the GPU: equal ids, logprobs within 1e-4; the GPU's ids.
std::vector<int32_t> sample_both(const Tensor& lg, const std::vector<RowSampling>& ps, const std::string& what) {
  const int64_t R = lg.size(0);
  Tensor lc = cpu().upload(lg, DType::F32), lgg = gpu().upload(lg, DType::F32);
  Tensor ic = cpu().alloc({R}, DType::I32), ig = gpu().alloc({R}, DType::I32);
  Tensor pc = cpu().alloc({R}, DType::F32), pg = gpu().alloc({R}, DType::F32);
  cpu().sample(lc, ps, ic, &pc);
  gpu().sample(lgg, ps, ig, &pg);
  std::vector<int32_t> a(static_cast<size_t>(R)), b(static_cast<size_t>(R));
  cpu().download(ic, a.data());
  gpu().download(ig, b.data());
  EXPECT_EQ(a, b) << what;
  expect_close(cpu().to_host_f32(pc), gpu().to_host_f32(pg), 1e-4, 1e-4, what + " logprobs");
  return b;
}

TEST(CudaOps, SampleMatchesCpu) {
  REQUIRE_GPU();
  for (int64_t V : {1000, 102400}) {
    const int64_t R = V > 5000 ? 6 : 48;
    Tensor lg = rand_host({R, V}, 60 + V, 3.0f);
    std::vector<RowSampling> ps(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) {
      RowSampling& sp = ps[static_cast<size_t>(r)];
      sp.seed = 1000 + r;
      sp.step = 7 * r;
      switch (r % 6) {
        case 0: break;  // greedy
        case 1: sp.temperature = 0.7f; sp.top_k = 50; break;
        case 2: sp.temperature = 1.0f; sp.top_p = 0.9f; break;
        case 3: sp.temperature = 1.3f; sp.min_p = 0.05f; sp.top_k = 200; sp.top_p = 0.8f; break;
        case 4: sp.temperature = 1.0f; sp.repetition_penalty = 1.3f; sp.frequency_penalty = 0.5f; sp.presence_penalty = 0.2f;
                sp.penalty_counts = {{3, 2}, {17, 1}, {static_cast<int32_t>(V - 1), 5}}; break;
        case 5: sp.temperature = 2.0f; break;
      }
    }
    sample_both(lg, ps, "V " + std::to_string(V));
    // The same rows with logit biases (before the penalties): a greedy row (off the split path) pushed to a biased
    // token, sampled rows with banned tokens (-inf) and the penalised row biased on its penalised ids.
    for (int64_t r = 0; r < R; ++r) {
      RowSampling& sp = ps[static_cast<size_t>(r)];
      const int32_t t = static_cast<int32_t>((r * 37 + 11) % V);
      sp.logit_bias = {{t, r % 2 ? 4.0f : 40.0f}, {static_cast<int32_t>(V - 1 - r), -2.5f}};
      if (r % 6 == 4) sp.logit_bias.emplace_back(3, 1.5f);
      if (r % 6 == 1 || r % 6 == 5) {  // ban this row's greedy choice and a few more
        const float* l = lg.data_as<float>() + r * V;
        const int32_t best = static_cast<int32_t>(std::max_element(l, l + V) - l);
        sp.logit_bias = {{best, -std::numeric_limits<float>::infinity()},
                         {static_cast<int32_t>((best + 1) % V), -std::numeric_limits<float>::infinity()}};
      }
    }
    const std::vector<int32_t> ids = sample_both(lg, ps, "V " + std::to_string(V) + " biased");
    for (int64_t r = 0; r < R; r += 6) EXPECT_EQ(ids[static_cast<size_t>(r)], (r * 37 + 11) % V) << "row " << r;
    // Constrained decoding: rows with an allowed-token mask (every 3rd token of a window, the rest never drawn; a mask
    // shorter than the vocabulary leaves the ids past it out) beside rows without one; the draws stay in the masks.
    for (int64_t r = 0; r < R; ++r) {
      RowSampling& sp = ps[static_cast<size_t>(r)];
      if (r % 3 == 2) continue;
      const int64_t lo = (r * 101) % (V / 2), words = r % 3 == 1 ? (V / 2 + 31) / 32 : (V + 31) / 32;
      auto m = std::make_shared<std::vector<uint32_t>>(static_cast<size_t>(words), 0u);
      for (int64_t t = lo; t < std::min(V, lo + 300); t += 3)
        if (t / 32 < words) (*m)[static_cast<size_t>(t / 32)] |= 1u << (t % 32);
      sp.allowed = m;
    }
    const std::vector<int32_t> masked = sample_both(lg, ps, "V " + std::to_string(V) + " masked");
    for (int64_t r = 0; r < R; ++r) {
      const auto& m = ps[static_cast<size_t>(r)].allowed;
      const int32_t t = masked[static_cast<size_t>(r)];
      const size_t w = static_cast<size_t>(t / 32);
      if (m) {
        EXPECT_TRUE(w < m->size() && ((*m)[w] >> (t % 32) & 1u)) << "row " << r << " drew " << t;
      }
    }
    for (RowSampling& sp : ps) sp.allowed.reset();
  }
  // Greedy rows split over many blocks (1 and 3 rows): the row maximum appears twice, in different parts, and the
  // lower index wins, as on the CPU.
  for (int64_t R : {1, 3}) {
    const int64_t V = 102400;
    Tensor lg = rand_host({R, V}, 70 + R, 3.0f);
    float* l = lg.data_as<float>();
    for (int64_t r = 0; r < R; ++r) l[r * V + 70000 - 5000 * r] = l[r * V + 90001 - 3 * r] = 50.0f;
    const std::vector<int32_t> ids = sample_both(lg, std::vector<RowSampling>(static_cast<size_t>(R)),
                                                 "greedy rows " + std::to_string(R));
    for (int64_t r = 0; r < R; ++r) EXPECT_EQ(ids[static_cast<size_t>(r)], 70000 - 5000 * r) << "row " << r;
  }
}

// A token still in flight (RowSampling::pending_input: this step's input id, resolved from the previous step's samples
// on the device) counts as one more generated token: on the GPU as on the CPU, and on the CPU exactly as the list with
// that token counted (cpu::count_token): in an entry of its own, or added to the entry of its id.
TEST(CudaOps, SamplePendingTokenMatchesCpu) {
  REQUIRE_GPU();
  const int64_t V = 5000, R = 8;
  Tensor lg = rand_host({R, V}, 90, 3.0f);
  // Pending ids: each row's own maximum (so a penalty on it changes the greedy pick) or its runner-up.
  std::vector<int32_t> prev(static_cast<size_t>(R)), inputs(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const float* l = lg.data_as<float>() + r * V;
    prev[static_cast<size_t>(r)] = static_cast<int32_t>(std::max_element(l, l + V) - l);
    inputs[static_cast<size_t>(r)] = r % 3 == 2 ? static_cast<int32_t>(r) : -static_cast<int32_t>(r + 1);
  }
  ForwardBatch b;
  b.input_ids = inputs;
  Tensor prev_h = Tensor::empty_host({R}, DType::I32);
  std::copy(prev.begin(), prev.end(), prev_h.data_as<int32_t>());
  for (Backend* be : {&cpu(), &gpu()}) {
    be->begin_step(b);
    be->resolve_prev_ids(be->upload(prev_h, DType::I32));
  }
  std::vector<RowSampling> ps(static_cast<size_t>(R)), counted;
  for (int64_t r = 0; r < R; ++r) {
    RowSampling& sp = ps[static_cast<size_t>(r)];
    const size_t i = static_cast<size_t>(r);
    const int32_t tok = inputs[i] < 0 ? prev[i] : inputs[i];
    sp.seed = 500 + r;
    sp.pending_input = static_cast<int32_t>(r);
    switch (r % 4) {
      case 0: sp.repetition_penalty = 1.5f; sp.presence_penalty = 2.0f; break;  // greedy, empty list
      case 1: sp.frequency_penalty = 0.8f; sp.penalty_counts = {{tok, 2}, {11, 1}}; break;  // its entry + 1
      case 2: sp.temperature = 0.8f; sp.top_k = 20; sp.frequency_penalty = 1.5f; sp.penalty_counts = {{3, 1}}; break;
      case 3: sp.temperature = 1.0f; sp.presence_penalty = 3.0f; sp.penalty_counts = {{tok, 1}}; break;
    }
    RowSampling c = sp;
    c.pending_input = -1;
    cpu::count_token(c.penalty_counts, tok);
    counted.push_back(c);
  }
  const std::vector<int32_t> pending_ids = sample_both(lg, ps, "pending tokens");
  EXPECT_EQ(pending_ids, sample_both(lg, counted, "the same tokens counted on the host"));
  for (int64_t r = 0; r < R; r += 4)  // the greedy rows' maximum is penalised away
    EXPECT_NE(pending_ids[static_cast<size_t>(r)], prev[static_cast<size_t>(r)]) << "row " << r;
}

// Sampling staged for a graph (Backend::stage_sample + sample_staged, the launch a decode graph records): R rows of
// a launch of n padded rows give exactly the ids and logprobs of the eager launch of those R rows (the greedy rows'
// parts depend on R only: a launch of 64 or 256 rows takes 1 or 3 rows' 64 parts in fewer blocks), rows past R are
// not written, and the same launch samples whatever is staged next (other rows, other parameters).
TEST(CudaOps, StagedSampleOfPaddedRowsEqualsEager) {
  REQUIRE_GPU();
  const int64_t V = 102400;
  for (const auto& [R, n] : {std::pair<int64_t, int64_t>{1, 64}, {3, 256}, {6, 8}, {0, 8}}) {
    const std::string what = "R " + std::to_string(R) + " of " + std::to_string(n);
    Tensor lg = rand_host({n, V}, 80 + R, 3.0f);
    const std::vector<RowSampling> ps = mixed_sampling(R, 40, 3);
    ForwardBatch b;
    b.input_ids.assign(static_cast<size_t>(n), 1);
    gpu().begin_step(b);
    Tensor lgg = gpu().upload(lg, DType::F32);
    Tensor ids = gpu().alloc({n}, DType::I32), lps = gpu().alloc({std::max<int64_t>(R, 1)}, DType::F32);
    std::vector<int32_t> sentinel(static_cast<size_t>(n), -7);
    Tensor sentinel_h = Tensor::empty_host({n}, DType::I32);
    std::copy(sentinel.begin(), sentinel.end(), sentinel_h.data_as<int32_t>());
    gpu().upload_into(sentinel_h, ids);
    Tensor lp = lps.rows(0, R);
    gpu().stage_sample(ps, &lp);
    gpu().sample_staged(lgg, ids);
    std::vector<int32_t> got(static_cast<size_t>(n));
    gpu().download(ids, got.data());
    const Tensor got_lp = gpu().to_host_f32(lp);
    // The eager launch of the R rows alone.
    Tensor ie = gpu().alloc({std::max<int64_t>(R, 1)}, DType::I32), pe = gpu().alloc({std::max<int64_t>(R, 1)},
                                                                                       DType::F32);
    Tensor ier = ie.rows(0, R), per = pe.rows(0, R);
    gpu().sample(lgg.rows(0, R), ps, ier, &per);
    std::vector<int32_t> want(static_cast<size_t>(R));
    if (R > 0) gpu().download(ier, want.data());
    EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + R), want) << what;
    if (R > 0) expect_close(gpu().to_host_f32(per), got_lp, 0.0, 0.0, what + " logprobs");
    for (int64_t r = R; r < n; ++r) EXPECT_EQ(got[static_cast<size_t>(r)], -7) << what << " row " << r;
    if (R > 0) {
      std::vector<int32_t> on_cpu(static_cast<size_t>(R));
      Tensor lc = cpu().upload(lg, DType::F32), ic = cpu().alloc({R}, DType::I32);
      cpu().begin_step(b);
      cpu().sample(lc.rows(0, R), ps, ic, nullptr);
      cpu().download(ic, on_cpu.data());
      EXPECT_EQ(want, on_cpu) << what << " (CPU)";
    }
    // Staged again with other rows: all greedy, one more row; the same launch follows them.
    if (R > 0 && R + 1 <= n) {
      const std::vector<RowSampling> greedy(static_cast<size_t>(R + 1));
      gpu().stage_sample(greedy, nullptr);
      gpu().sample_staged(lgg, ids);
      gpu().download(ids, got.data());
      const float* l = lg.data_as<float>();
      for (int64_t r = 0; r <= R; ++r)
        EXPECT_EQ(got[static_cast<size_t>(r)], std::max_element(l + r * V, l + (r + 1) * V) - (l + r * V))
            << what << " restaged row " << r;
    }
  }
  EXPECT_NE(test::error_text([] {
              Tensor lg = gpu().alloc({4, 16}, DType::F32), ids = gpu().alloc({4}, DType::I32);
              ForwardBatch b;
              b.input_ids.assign(4, 1);
              gpu().begin_step(b);
              gpu().sample_staged(lg, ids);
            }).find("no rows were staged"),
            std::string::npos);
}

}  // namespace
}  // namespace mlaserve::test
