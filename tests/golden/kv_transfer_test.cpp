// Prefill / decode disaggregation at the engine: a prompt's latent rows read out of one engine's prefix cache
// (EngineClient::export_kv) and handed to another with the request (GenerateRequest::kv_prefix), which caches them
// and computes only the rest of the prompt: same greedy tokens as computing it all, in every layout on either side;
// the rows are really used (wrong rows change the tokens); rows of another layout are not.
#include <gtest/gtest.h>

#include <future>

#include "engine/dp_controller.h"
#include "engine/engine.h"
#include "test_util.h"

using namespace mlaserve;

namespace {

KvRows export_rows(EngineClient& e, const std::vector<int32_t>& tokens, int32_t begin = 0,
                   int32_t max_tokens = 1 << 20, const std::string& salt = "", int32_t rank = -1) {
  return test::callback_result<KvRows>(
      [&](auto cb) { e.export_kv(tokens, salt, begin, max_tokens, [cb](KvRows r) { cb(r); }, rank); });
}

std::shared_ptr<const KvPrefix> parts(std::initializer_list<KvRows> rows) {
  return std::make_shared<const KvPrefix>(rows);
}

struct Result {
  std::vector<int32_t> ids;
  int32_t cached = 0;
};

// Greedy tokens of `ids` (max_new of them), with rows handed over when given; and the prompt tokens served cached.
Result generate(EngineClient& e, const std::string& rid, const std::vector<int32_t>& ids, int32_t max_new,
                std::shared_ptr<const KvPrefix> rows = nullptr, const std::string& salt = "") {
  auto prom = std::make_shared<std::promise<Result>>();
  auto acc = std::make_shared<Result>();
  GenerateRequest g = test::ids_request(rid, ids, max_new);
  g.kv_prefix = std::move(rows);
  g.cache_salt = salt;
  g.on_output = [prom, acc](const GenerateOutput& o) {
    acc->ids.insert(acc->ids.end(), o.new_tokens.begin(), o.new_tokens.end());
    acc->cached = o.cached_tokens;
    if (o.finished) prom->set_value(*acc);
  };
  auto f = prom->get_future();
  e.submit(std::move(g));
  EXPECT_EQ(f.wait_for(std::chrono::seconds(120)), std::future_status::ready) << "hang?";
  return f.get();
}

std::vector<int32_t> prompt_of(int32_t n, int32_t salt) {
  std::vector<int32_t> p;
  for (int32_t i = 0; i < n; ++i) p.push_back((i * 37 + salt * 11 + 5) % 600 + 3);
  return p;
}

}  // namespace

// The prefill side (tp 1, or DP attention with the prompt on its second group) hands its rows to a decode side of
// every layout: the decode side serves the prompt's whole pages from them and draws the same tokens as an engine
// that computed everything; chunked reads (begin, max_tokens) give the same bytes as one read, and serve as parts.
TEST(KvTransfer, HandedOverRowsGiveTheSameTokens) {
  const std::vector<int32_t> prompt = prompt_of(45, 1);  // pages of 8: 40 tokens of whole pages (the 45th computed)
  Engine ref(test::cpu_ranks("v2lite"), test::small_engine_options(true));
  const std::vector<int32_t> want = generate(ref, "ref", prompt, 6).ids;
  ASSERT_EQ(want.size(), 6u);

  struct Side {
    const char* name;
    int32_t tp, dp;
    bool overlap;
  };
  for (const Side& pre : {Side{"tp1", 1, 1, true}, Side{"dpa 2/2 (group 1)", 2, 2, false}}) {
    SCOPED_TRACE(pre.name);
    Engine prefill(test::cpu_ranks("v2lite", pre.tp, pre.dp), test::small_engine_options(pre.overlap));
    if (pre.dp > 1) generate(prefill, "other", prompt_of(20, 9), 1);  // (round robin: the prompt goes to group 1)
    EXPECT_EQ(generate(prefill, "p", prompt, 1).ids[0], want[0]);
    const KvRows all = export_rows(prefill, prompt);
    ASSERT_TRUE(all.error.empty()) << all.error;
    EXPECT_EQ(all.cached, 40);
    EXPECT_EQ(all.begin, 0);
    EXPECT_EQ(all.end, 40);
    ASSERT_GT(all.layers, 0);
    ASSERT_GT(all.row_bytes, 0);
    ASSERT_EQ(all.rows_size(), static_cast<size_t>(all.layers * 40 * all.row_bytes));
    // The same rows in two reads.
    const KvRows a = export_rows(prefill, prompt, 0, 13), b = export_rows(prefill, prompt, 13, 100);
    ASSERT_EQ(a.end, 13);
    ASSERT_EQ(b.begin, 13);
    ASSERT_EQ(b.end, 40);
    const auto tb = static_cast<size_t>(all.token_bytes());  // (token order: each token's rows of every layer)
    ASSERT_EQ(a.rows_size(), 13 * tb);
    ASSERT_EQ(b.rows_size(), 27 * tb);
    EXPECT_EQ(0, std::memcmp(all.rows(), a.rows(), 13 * tb));
    EXPECT_EQ(0, std::memcmp(all.rows() + 13 * tb, b.rows(), 27 * tb));
    // A prompt the cache does not hold, and a begin past what it holds: no rows.
    EXPECT_EQ(export_rows(prefill, prompt_of(30, 4)).cached, 0);
    // One DP rank's cache alone: the group holding the prompt, another, one out of range.
    const int32_t holder = pre.dp > 1 ? 1 : 0;
    EXPECT_EQ(export_rows(prefill, prompt, 0, 0, "", holder).cached, 40);
    if (pre.dp > 1) {
      EXPECT_EQ(export_rows(prefill, prompt, 0, 0, "", 0).cached, 0);
      EXPECT_EQ(export_rows(prefill, prompt, 0, 40, "", 0).end, 0);
    }
    EXPECT_NE(export_rows(prefill, prompt, 0, 0, "", pre.dp).error.find("out of range"), std::string::npos);
    const KvRows past = export_rows(prefill, prompt, 60, 10);
    EXPECT_EQ(past.cached, 40);
    EXPECT_EQ(past.end - past.begin, 0);
    EXPECT_EQ(past.rows_size(), 0u);

    for (const Side& dec : {Side{"tp1", 1, 1, true}, Side{"tp1 no overlap", 1, 1, false}, Side{"tp2", 2, 1, true},
                            Side{"dpa 2/2", 2, 2, true}}) {
      SCOPED_TRACE(dec.name);
      Engine decode(test::cpu_ranks("v2lite", dec.tp, dec.dp), test::small_engine_options(dec.overlap));
      const bool two = dec.tp == 2;  // (the two reads as two parts; a page spans both)
      const Result got = generate(decode, "d", prompt, 6, two ? parts({a, b}) : parts({all}));
      EXPECT_EQ(got.ids, want);
      EXPECT_EQ(got.cached, 40);  // served from the rows handed over
      test::expect_engine_idle_and_clean(decode);
    }
  }
}

// Rows are what the decode side uses: zeroed rows change its tokens; rows of another layout, or none, leave the prompt
// computed in full (nothing cached).
TEST(KvTransfer, RowsAreUsedAndForeignOnesAreNot) {
  const std::vector<int32_t> prompt = prompt_of(45, 2);
  Engine prefill(test::cpu_ranks("v2lite"), test::small_engine_options(true));
  const std::vector<int32_t> want = generate(prefill, "p", prompt, 6).ids;
  const KvRows all = export_rows(prefill, prompt);
  ASSERT_EQ(all.cached, 40);

  Engine decode(test::cpu_ranks("v2lite"), test::small_engine_options(true));
  KvRows zero = all;
  std::fill(zero.bytes.begin() + static_cast<std::ptrdiff_t>(zero.offset), zero.bytes.end(), char{0});
  const Result z = generate(decode, "zero", prompt, 6, parts({zero}));
  EXPECT_EQ(z.cached, 40);
  EXPECT_NE(z.ids, want);
  ASSERT_TRUE(decode.flush_cache());

  KvRows other = all;
  other.row_bytes /= 2;
  other.layers *= 2;  // (the same bytes, another layout)
  Result r = generate(decode, "other", prompt, 6, parts({other}));
  EXPECT_EQ(r.cached, 0);
  EXPECT_EQ(r.ids, want);
  ASSERT_TRUE(decode.flush_cache());
  KvRows dtype = all;
  dtype.dtype = "bf16_other";
  r = generate(decode, "dtype", prompt, 6, parts({dtype}));
  EXPECT_EQ(r.cached, 0);
  EXPECT_EQ(r.ids, want);
  ASSERT_TRUE(decode.flush_cache());
  KvRows cut = all;
  cut.bytes.resize(cut.bytes.size() - 1);
  r = generate(decode, "cut", prompt, 6, parts({cut}));
  EXPECT_EQ(r.cached, 0);
  EXPECT_EQ(r.ids, want);
  // Parts that do not follow each other from token 0 (out of order; a gap) are not used.
  const KvRows a = export_rows(prefill, prompt, 0, 16), b = export_rows(prefill, prompt, 16, 100);
  const KvRows c = export_rows(prefill, prompt, 24, 100);
  for (const auto& [name, bad] : {std::pair{"order", parts({b, a})}, std::pair{"gap", parts({a, c})}}) {
    ASSERT_TRUE(decode.flush_cache());
    r = generate(decode, name, prompt, 6, bad);
    EXPECT_EQ(r.cached, 0) << name;
    EXPECT_EQ(r.ids, want) << name;
  }
  // A part of the rows (the first 20 tokens: two whole pages) serves those pages.
  ASSERT_TRUE(decode.flush_cache());
  const KvRows part = export_rows(prefill, prompt, 0, 20);
  r = generate(decode, "part", prompt, 6, parts({part}));
  EXPECT_EQ(r.cached, 16);
  EXPECT_EQ(r.ids, want);
  test::expect_engine_idle_and_clean(decode);
}

// Rows from a token past the start (the reader had the tokens before cached, e.g. an earlier turn it generated): used
// while those are cached here, not once they are not; a length-only export (max_tokens 0) says what is cached.
TEST(KvTransfer, RowsPastTheStartNeedTheStartCachedHere) {
  const std::vector<int32_t> prompt = prompt_of(45, 5);
  Engine prefill(test::cpu_ranks("v2lite"), test::small_engine_options(true));
  const std::vector<int32_t> want = generate(prefill, "p", prompt, 6).ids;
  const KvRows rest = export_rows(prefill, prompt, 16, 100);
  ASSERT_EQ(rest.begin, 16);
  ASSERT_EQ(rest.end, 40);

  Engine decode(test::cpu_ranks("v2lite"), test::small_engine_options(true));
  Result r = generate(decode, "cold", prompt, 6, parts({rest}));
  EXPECT_EQ(r.cached, 0);  // nothing of [0, 16) here: the rows are not used
  EXPECT_EQ(r.ids, want);
  ASSERT_TRUE(decode.flush_cache());
  generate(decode, "start", std::vector<int32_t>(prompt.begin(), prompt.begin() + 20), 1);  // caches [0, 16)
  const KvRows len = export_rows(decode, prompt, 0, 0);
  EXPECT_EQ(len.cached, 16);
  EXPECT_EQ(len.rows_size(), 0u);
  r = generate(decode, "warm", prompt, 6, parts({rest}));
  EXPECT_EQ(r.cached, 40);
  EXPECT_EQ(r.ids, want);
  test::expect_engine_idle_and_clean(decode);
}

// Cache salts: rows are read under the request's salt only, and cached under the salt of the request they come with
// (a request without it does not share them).
TEST(KvTransfer, SaltsKeepTheirRows) {
  const std::vector<int32_t> prompt = prompt_of(45, 3);
  Engine prefill(test::cpu_ranks("v2lite"), test::small_engine_options(true));
  const std::vector<int32_t> want = generate(prefill, "p", prompt, 4, nullptr, "s1").ids;
  EXPECT_EQ(export_rows(prefill, prompt).cached, 0);
  EXPECT_EQ(export_rows(prefill, prompt, 0, 1 << 20, "s2").cached, 0);
  const KvRows rows = export_rows(prefill, prompt, 0, 1 << 20, "s1");
  ASSERT_EQ(rows.cached, 40);

  Engine decode(test::cpu_ranks("v2lite"), test::small_engine_options(false));
  const Result got = generate(decode, "d", prompt, 4, parts({rows}), "s1");
  EXPECT_EQ(got.ids, want);
  EXPECT_EQ(got.cached, 40);
  EXPECT_EQ(generate(decode, "unsalted", prompt, 4).cached, 0);
  EXPECT_EQ(generate(decode, "again", prompt, 4, nullptr, "s1").cached, 40);
  test::expect_engine_idle_and_clean(decode);
}

// DP replicas (--dp 2 without DP attention): the replica holding the prompt is the one read, whichever it is.
TEST(KvTransfer, DataParallelReplicasReadTheOneHoldingThePrompt) {
  const std::vector<int32_t> prompt = prompt_of(45, 4);
  std::vector<std::unique_ptr<EngineClient>> replicas;
  for (int i = 0; i < 2; ++i)
    replicas.push_back(std::make_unique<Engine>(test::cpu_ranks("v2lite"), test::small_engine_options(true)));
  DpController dp(std::move(replicas), "round_robin");
  generate(dp, "first", prompt_of(20, 8), 1);  // replica 0
  const std::vector<int32_t> want = generate(dp, "p", prompt, 4).ids;  // replica 1
  EXPECT_EQ(dp.stats()[1].prompt_tokens_total, 45);
  const KvRows rows = export_rows(dp, prompt);
  ASSERT_TRUE(rows.error.empty()) << rows.error;
  EXPECT_EQ(rows.cached, 40);
  EXPECT_EQ(rows.end, 40);
  // One replica's cache alone (what a decode server with replicas asks of the one it sends a request to).
  EXPECT_EQ(export_rows(dp, prompt, 0, 0, "", 1).cached, 40);
  EXPECT_EQ(export_rows(dp, prompt, 0, 0, "", 0).cached, 0);
  EXPECT_NE(export_rows(dp, prompt, 0, 0, "", 2).error.find("out of range"), std::string::npos);
  Engine decode(test::cpu_ranks("v2lite"), test::small_engine_options(true));
  const Result got = generate(decode, "d", prompt, 4, parts({rows}));
  EXPECT_EQ(got.ids, want);
  EXPECT_EQ(got.cached, 40);
}
