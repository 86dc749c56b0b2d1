// The FP8 (E4M3 and E5M2) latent cache on the CPU reference backend: rows written as the codes nearest to their
// values, every form of attention reading exactly those codes' values, and the --kv-cache-dtype values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <cstring>
#include <random>

#include "backend/backend.h"
#include "core/dtype.h"
#include "core/error.h"
#include "model/forward_batch.h"
#include "model/kv_cache.h"
#include "test_util.h"

namespace mlaserve {
namespace {

// A model of three layers whose cache rows are kv_lora + rope wide (all a KvCache reads of it).
ModelConfig cache_config(int64_t kv_lora, int64_t rope) {
  ModelConfig c;
  c.num_hidden_layers = 3;
  c.kv_lora_rank = kv_lora;
  c.qk_rope_head_dim = rope;
  return c;
}

// Rows out of pages and into others (prefill / decode disaggregation): in token order ([tokens][layers][row], each
// token's rows of every layer together), any token range of the pages, the same bytes back, whatever the staging
// buffer's size (several trips through it when small).
TEST(KvCacheRows, ReadAndWrittenInTokenOrder) {
  auto cpu = make_cpu_backend();
  const ModelConfig c = cache_config(8, 4);
  for (size_t limit : {size_t{64} << 20, size_t{1}, size_t{3} * 4 * 48 * 2}) {  // (one trip; a page a trip; two pages)
    SCOPED_TRACE(limit);
    KvCache a(*cpu, c, 9, 4), b(*cpu, c, 9, 4);
    a.set_staging_limit(limit);
    b.set_staging_limit(limit);
    const auto row = static_cast<size_t>(a.row_bytes()), L = size_t{3};
    ASSERT_EQ(row, 12u * 4);
    std::mt19937 rng(5);
    for (int64_t l = 0; l < a.num_layers(); ++l) {
      auto* p = static_cast<uint8_t*>(a.layer(l).data());
      for (size_t i = 0; i < a.layer(l).nbytes(); ++i) p[i] = static_cast<uint8_t>(rng());
    }
    auto slot = [&](KvCache& k, int64_t l, int32_t page, size_t t) {  // token t of a page in layer l
      return static_cast<const char*>(k.layer(l).data()) + (static_cast<size_t>(page) * 4 + t) * row;
    };
    const std::vector<int32_t> from{7, 2, 5}, to{0, 8, 3};
    std::vector<char> rows(12 * L * row);
    a.read_rows(from, 0, 12, rows.data());
    for (size_t t = 0; t < 12; ++t)
      for (int64_t l = 0; l < 3; ++l)  // token t (page from[t / 4]), layer l
        EXPECT_EQ(0, std::memcmp(rows.data() + (t * L + static_cast<size_t>(l)) * row, slot(a, l, from[t / 4], t % 4),
                                 row))
            << t << " " << l;
    // A range starting and ending inside pages: the same rows.
    std::vector<char> mid(7 * L * row);
    a.read_rows(from, 3, 7, mid.data());
    EXPECT_EQ(0, std::memcmp(mid.data(), rows.data() + 3 * L * row, mid.size()));
    b.write_rows(to, [&](int64_t t) { return rows.data() + static_cast<size_t>(t) * L * row; });
    std::vector<char> back(rows.size());
    b.read_rows(to, 0, 12, back.data());
    EXPECT_EQ(back, rows);
    for (int64_t l = 0; l < 3; ++l)
      EXPECT_EQ(0, std::memcmp(slot(b, l, 8, 0), slot(a, l, 2, 0), 4 * row));
    EXPECT_THROW(a.read_rows(std::vector<int32_t>{9}, 0, 1, back.data()), Error);
    EXPECT_THROW(a.read_rows(from, 5, 8, back.data()), Error);  // past the pages' 12 slots
  }
}

TEST(KvCacheFp8, FlagValues) {
  for (const char* s : {"auto", "bf16", "bfloat16"}) EXPECT_FALSE(parse_kv_cache_dtype(s).has_value()) << s;
  for (const char* s : {"fp8", "fp8_e4m3"}) EXPECT_EQ(parse_kv_cache_dtype(s), DType::F8_E4M3) << s;
  EXPECT_EQ(parse_kv_cache_dtype("fp8_e5m2"), DType::F8_E5M2);
  const std::string err = test::error_text([] { parse_kv_cache_dtype("int8"); });
  EXPECT_NE(err.find("--kv-cache-dtype"), std::string::npos) << "int8: " << err;
  EXPECT_NE(err.find("fp8_e5m2"), std::string::npos) << err;
}

TEST(KvCacheFp8, HoldsOneByteCodesPerValue) {
  auto cpu = make_cpu_backend();
  const ModelConfig c = cache_config(64, 16);
  KvCache f32(*cpu, c, 5, 16);
  EXPECT_EQ(f32.dtype(), DType::F32);
  for (DType t : {DType::F8_E4M3, DType::F8_E5M2}) {
    KvCache f8(*cpu, c, 5, 16, t);
    EXPECT_EQ(f8.dtype(), t);
    for (int64_t l = 0; l < 3; ++l) {
      EXPECT_EQ(f8.layer(l).dtype(), t);
      EXPECT_EQ(f8.layer(l).nbytes() * 4, f32.layer(l).nbytes());
    }
    EXPECT_EQ(KvCache::bytes_per_token(c, f8.dtype()), 3 * 80);
  }
  EXPECT_THROW(KvCache(*cpu, c, 5, 16, DType::BF16), std::exception) << "not an FP8 type";
}

// An FP8 code type's conversions (core/dtype.h).
struct Codes {
  DType dtype;
  float (*value)(uint8_t);
  uint8_t (*code)(float);
  bool (*special)(uint8_t);  // NaN (and E5M2's infinities)
};
const Codes kE4M3{DType::F8_E4M3, f8e4m3_to_f32, f32_to_e4m3, [](uint8_t v) { return (v & 0x7f) == 0x7f; }};
const Codes kE5M2{DType::F8_E5M2, f8e5m2_to_f32, f32_to_e5m2, [](uint8_t v) { return (v & 0x7c) == 0x7c; }};
void writes_codes_and_attends_over_their_values(const Codes& k);

// Sequences (cached prefix, new tokens) over shuffled pages; the prefixes' rows hold random codes (the F32 cache
// their values), the new tokens' rows are written by mla_write_latent into both caches.
TEST(KvCacheFp8, CpuWritesCodesAndAttendsOverTheirValues) { writes_codes_and_attends_over_their_values(kE4M3); }
TEST(KvCacheFp8, CpuWritesE5M2CodesAndAttendsOverTheirValues) { writes_codes_and_attends_over_their_values(kE5M2); }

void writes_codes_and_attends_over_their_values(const Codes& k) {
  const int64_t nh = 4, kvr = 64, rope = 16, nope = 32, vh = 32, W = kvr + rope;
  const int32_t ps = 8;
  const std::vector<std::pair<int32_t, int32_t>> seqs = {{0, 5}, {13, 1}, {8, 9}, {40, 1}};
  int32_t need = 0;
  for (auto [prefix, q] : seqs) need += (prefix + q + ps - 1) / ps;
  std::vector<int32_t> pool(static_cast<size_t>(need + 3));
  std::iota(pool.begin(), pool.end(), 0);
  std::mt19937_64 rng(5);
  std::shuffle(pool.begin(), pool.end(), rng);
  ForwardBatchBuilder bb(ps);
  std::vector<std::vector<int32_t>> pages;
  size_t next = 0;
  for (auto [prefix, q] : seqs) {
    const int32_t n = (prefix + q + ps - 1) / ps;
    pages.emplace_back(pool.begin() + static_cast<int64_t>(next), pool.begin() + static_cast<int64_t>(next + n));
    next += static_cast<size_t>(n);
    bb.add(std::vector<int32_t>(static_cast<size_t>(q), 1), prefix, pages.back(), true);
  }
  const ForwardBatch b = bb.finish();
  const int64_t T = b.num_tokens(), slots = static_cast<int64_t>(pool.size()) * ps;

  auto cpu = make_cpu_backend();
  cpu->begin_step(b);
  std::vector<float> freqs(static_cast<size_t>(rope / 2));
  for (size_t i = 0; i < freqs.size(); ++i) freqs[i] = std::pow(10000.0f, -2.0f * i / static_cast<float>(rope));
  cpu->set_rope(freqs, 1.0f);

  Tensor c8 = Tensor::empty_host({slots, W}, k.dtype), c32 = Tensor::empty_host({slots, W}, DType::F32);
  std::uniform_int_distribution<int> code(0, 255);
  for (int64_t i = 0; i < slots * W; ++i) {
    uint8_t v = static_cast<uint8_t>(code(rng));
    if (k.special(v)) v = 0x3c;  // no NaN (or infinite) codes in the rows
    c8.data_as<uint8_t>()[i] = v;
    c32.data_as<float>()[i] = k.value(v);
  }
  std::normal_distribution<float> nd(0.0f, 2.0f);
  Tensor lat = Tensor::empty_host({T, W}, DType::F32), norm = Tensor::empty_host({kvr}, DType::F32);
  for (int64_t i = 0; i < T * W; ++i) lat.data_as<float>()[i] = nd(rng);
  for (int64_t i = 0; i < kvr; ++i) norm.data_as<float>()[i] = 1.0f + 0.1f * nd(rng);
  Tensor lat8 = Tensor::empty_host({T, W}, DType::F32);
  std::copy_n(lat.data_as<float>(), T * W, lat8.data_as<float>());
  cpu->mla_write_latent(lat, norm, 1e-6f, c32);
  cpu->mla_write_latent(lat8, norm, 1e-6f, c8);
  int64_t wrong_codes = 0, wrong_latent = 0, rounded = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = b.out_slots[static_cast<size_t>(t)];
    for (int64_t d = 0; d < W; ++d) {
      const float v = c32.data_as<float>()[slot * W + d];  // the F32 cache's row: the value before rounding
      const uint8_t got = c8.data_as<uint8_t>()[slot * W + d];
      wrong_codes += got != k.code(v);
      wrong_latent += lat8.data_as<float>()[t * W + d] != k.value(got);
      rounded += k.value(got) != v;
      c32.data_as<float>()[slot * W + d] = k.value(got);  // from here on the F32 cache holds the codes' values
    }
  }
  EXPECT_EQ(wrong_codes, 0);
  EXPECT_EQ(wrong_latent, 0) << "the latent keeps the values its cache row holds";
  EXPECT_GT(rounded, T * W / 2) << "values were not rounded to " << dtype_name(k.dtype);

  Tensor q = Tensor::empty_host({T, nh * (nope + rope)}, DType::F32);
  Tensor kvb = Tensor::empty_host({nh * (nope + vh), kvr}, DType::F32);
  for (int64_t i = 0; i < q.numel(); ++i) q.data_as<float>()[i] = nd(rng) * 0.2f;
  for (int64_t i = 0; i < kvb.numel(); ++i) kvb.data_as<float>()[i] = nd(rng) * 0.05f;
  MlaParams p{static_cast<int32_t>(nh), static_cast<int32_t>(nope), static_cast<int32_t>(rope),
              static_cast<int32_t>(vh), static_cast<int32_t>(kvr), 0.1f, MlaForm::Auto};
  for (MlaForm form : {MlaForm::Auto, MlaForm::Absorbed, MlaForm::Expanded}) {
    p.form = form;
    Tensor o8 = Tensor::empty_host({T, nh * vh}, DType::F32), o32 = Tensor::empty_host({T, nh * vh}, DType::F32);
    cpu->mla_attention(q, c8, kvb, p, o8);
    cpu->mla_attention(q, c32, kvb, p, o32);
    int64_t diff = 0;
    for (int64_t i = 0; i < o8.numel(); ++i) diff += o8.data_as<float>()[i] != o32.data_as<float>()[i];
    EXPECT_EQ(diff, 0) << "form " << static_cast<int>(form);
  }
}

}  // namespace
}  // namespace mlaserve
