// The engine end to end on the CPU backend with a golden model: greedy outputs equal the Hugging Face
// reference alone, in a full batch, with prefix-cache hits, with small prefill chunks and under retraction;
// aborts free pages; nothing leaks.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <mutex>
#include <set>
#include <tuple>

#include "backend/forwarding_backend.h"
#include "engine/engine.h"
#include "io/safetensors.h"
#include "structured/token_constraint.h"
#include "test_util.h"

using namespace mlaserve;

namespace {

struct Result {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;  // with return_logprob
  std::vector<TokenLogprob> prompt_logprobs;  // with logprob_start_len >= 0
  std::vector<float> hidden;                  // with return_hidden_states
  int32_t hidden_size = 0;
  FinishReason finish;
  int32_t cached = 0;
  int32_t prompt_tokens = 0, completion_tokens = 0;
};

// Every test runs with overlap scheduling on and off: outputs must not differ.
class EngineTest : public ::testing::TestWithParam<bool> {
 protected:
  static void SetUpTestSuite() {
    SafetensorsFile f(test::golden_dir("v2") + "/reference.safetensors");
    for (int j = 0; j < 5; ++j) {
      Tensor p = f.tensor("prompt_" + std::to_string(j)), g = f.tensor("greedy_" + std::to_string(j)),
             m = f.tensor("margin_" + std::to_string(j)), l = f.tensor("logits_" + std::to_string(j));
      prompts_.emplace_back(p.data_as<int32_t>(), p.data_as<int32_t>() + p.numel());
      // Hugging Face's log-softmax at every prompt position.
      const int64_t V = l.size(1);
      std::vector<std::vector<float>> lps;
      for (int64_t t = 0; t < l.size(0); ++t) {
        const float* x = l.data_as<float>() + t * V;
        const float m0 = *std::max_element(x, x + V);
        double sum = 0;
        for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(x[v] - m0));
        std::vector<float> row(static_cast<size_t>(V));
        for (int64_t v = 0; v < V; ++v) row[static_cast<size_t>(v)] = x[v] - m0 - static_cast<float>(std::log(sum));
        lps.push_back(std::move(row));
      }
      hf_logprobs_.push_back(std::move(lps));
      // Reference greedy up to the first near tie.
      std::vector<int32_t> ref;
      for (int64_t i = 0; i < g.numel() && m.data_as<float>()[i] >= 0.02f; ++i) ref.push_back(g.data_as<int32_t>()[i]);
      greedy_.push_back(ref);
    }
    // Hugging Face's final hidden states over each prompt and its greedy tokens but the last
    // (tools/golden/make_hidden_golden.py).
    SafetensorsFile h(test::golden_dir("v2") + "/hidden.safetensors");
    for (int j = 0; j < 5; ++j) {
      Tensor t = h.tensor("hidden_" + std::to_string(j));
      hf_hidden_.emplace_back(t.data_as<float>(), t.data_as<float>() + t.numel());
      hidden_size_ = t.size(1);
    }
  }

  std::unique_ptr<Engine> make(int32_t pages, int32_t page_size = 8, int32_t chunk = 8192, bool radix = true,
                               int32_t tp = 1, int32_t dp = 1, std::vector<int32_t> eos = {}, int32_t drafts = 0) {
    auto ranks = test::cpu_ranks("v2", tp, dp);
    EngineOptions o;
    o.spec_draft_tokens = drafts;
    o.page_size = page_size;
    o.num_pages = pages;
    o.chunked_prefill_size = chunk;
    o.enable_radix_cache = radix;
    o.host_pages = host_pages_;
    o.check_integrity = true;
    o.overlap = GetParam();
    o.eos_token_ids = std::move(eos);
    return std::make_unique<Engine>(std::move(ranks), o);
  }

  // Submits and returns a future of the whole result (EOS ignored, greedy unless the sampling says otherwise).
  std::future<Result> submit(EngineClient& e, const std::string& rid, std::vector<int32_t> ids, int32_t max_new,
                             SamplingParams sp = {}) {
    GenerateRequest g;
    g.rid = rid;
    g.input_ids = std::move(ids);
    sp.max_new_tokens = max_new;
    sp.ignore_eos = true;
    if (sp.temperature == 1.0f) sp.temperature = 0.0f;  // greedy unless the test says otherwise
    g.sampling = sp;
    return submit_request(e, std::move(g));
  }
  // Submits g as it is and returns a future of the whole result.
  static std::future<Result> submit_request(EngineClient& e, GenerateRequest g) {
    auto prom = std::make_shared<std::promise<Result>>();
    auto acc = std::make_shared<Result>();
    g.on_output = [prom, acc](const GenerateOutput& o) {
      acc->tokens.insert(acc->tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
      acc->logprobs.insert(acc->logprobs.end(), o.new_logprobs.begin(), o.new_logprobs.end());
      acc->prompt_logprobs.insert(acc->prompt_logprobs.end(), o.prompt_logprobs.begin(), o.prompt_logprobs.end());
      acc->hidden.insert(acc->hidden.end(), o.hidden_states.begin(), o.hidden_states.end());
      if (o.hidden_size > 0) acc->hidden_size = o.hidden_size;
      acc->cached = o.cached_tokens;
      acc->prompt_tokens = o.prompt_tokens;
      acc->completion_tokens = o.completion_tokens;
      if (o.finished) {
        acc->finish = o.finish;
        prom->set_value(*acc);
      }
    };
    e.submit(std::move(g));
    return prom->get_future();
  }

  static Result wait(std::future<Result>& f) {
    EXPECT_EQ(f.wait_for(std::chrono::seconds(120)), std::future_status::ready);
    return f.get();
  }

  void expect_prefix(const std::vector<int32_t>& got, size_t j) {
    const auto& ref = greedy_[j];
    ASSERT_GE(got.size(), std::min(ref.size(), got.size()));
    for (size_t i = 0; i < std::min(ref.size(), got.size()); ++i) EXPECT_EQ(got[i], ref[i]) << "prompt " << j << " step " << i;
  }

  static void expect_no_leak(EngineClient& e) {
    // Stats are published after each step: wait until the engine is idle.
    for (int i = 0; i < 200; ++i) {
      auto s = e.stats()[0];
      if (s.num_running_reqs == 0 && s.num_queue_reqs == 0 && s.kv_tokens_free + s.kv_tokens_cached == s.kv_tokens_total)
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    auto s = e.stats()[0];
    EXPECT_EQ(s.kv_tokens_free + s.kv_tokens_cached, s.kv_tokens_total);
    EXPECT_TRUE(e.flush_cache());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    s = e.stats()[0];
    EXPECT_EQ(s.kv_tokens_free, s.kv_tokens_total);
  }

  int32_t host_pages_ = 0;  // make(): the hierarchical cache's host tier
  static inline std::vector<std::vector<int32_t>> prompts_, greedy_;
  static inline std::vector<std::vector<std::vector<float>>> hf_logprobs_;  // [prompt][position][token]
  static inline std::vector<std::vector<float>> hf_hidden_;  // [prompt][position * hidden_size_ + i]
  static inline int64_t hidden_size_ = 0;
};

TEST_P(EngineTest, GreedyEqualsReferenceAloneAndInAFullBatch) {
  auto e = make(512);
  auto f = submit(*e, "alone", prompts_[3], 12);
  Result alone = wait(f);
  EXPECT_EQ(alone.finish.kind, FinishKind::Length);
  EXPECT_EQ(alone.tokens.size(), 12u);
  EXPECT_EQ(alone.prompt_tokens, 100);
  expect_prefix(alone.tokens, 3);
  // All five prompts (and the same one twice) at once.
  std::vector<std::future<Result>> fs;
  for (int j = 0; j < 5; ++j) fs.push_back(submit(*e, fmt::format("b{}", j), prompts_[j], 12));
  fs.push_back(submit(*e, "again", prompts_[3], 12));
  for (int j = 0; j < 5; ++j) expect_prefix(wait(fs[j]).tokens, j);
  Result again = wait(fs[5]);
  EXPECT_EQ(again.tokens, alone.tokens);
  EXPECT_GT(again.cached, 0);  // served from the prefix cache the first request left
  expect_no_leak(*e);
}

// Requests sharing a prompt's start, all waiting at once (sent while paused): the first computes it, the others wait
// a step and find its pages cached (Scheduler::kShareDefer), with the reference's tokens.
TEST_P(EngineTest, ABurstSharingAPromptComputesItOnce) {
  auto e = make(512);
  std::promise<bool> paused;
  e->pause_generation(PauseMode::InPlace, [&paused](bool ok) { paused.set_value(ok); });
  ASSERT_TRUE(paused.get_future().get());
  std::vector<int32_t> longer = prompts_[3];
  longer.insert(longer.end(), prompts_[0].begin(), prompts_[0].end());
  std::vector<std::future<Result>> fs;
  for (int k = 0; k < 4; ++k) fs.push_back(submit(*e, fmt::format("same{}", k), k < 2 ? prompts_[3] : longer, 8));
  ASSERT_TRUE(e->continue_generation());
  int computed = 0;
  for (int k = 0; k < 4; ++k) {
    const Result r = wait(fs[static_cast<size_t>(k)]);
    if (k < 2) expect_prefix(r.tokens, 3);
    if (r.cached == 0) ++computed;
    else EXPECT_GE(r.cached, 96) << k;  // the shared 100 tokens' whole pages (99 of them cacheable, 8 a page)
  }
  EXPECT_EQ(computed, 1);
  EXPECT_EQ(e->stats()[0].cached_prompt_tokens_total, 3 * 96);
  expect_no_leak(*e);
}

TEST_P(EngineTest, SmallChunksAndNoCacheGiveTheSameTokens) {
  auto e = make(512, /*page_size=*/4, /*chunk=*/16, /*radix=*/false);
  std::vector<std::future<Result>> fs;
  for (int j : {4, 2, 3}) fs.push_back(submit(*e, fmt::format("c{}", j), prompts_[j], 10));
  int k = 0;
  for (int j : {4, 2, 3}) {
    Result r = wait(fs[k++]);
    EXPECT_EQ(r.cached, 0);
    expect_prefix(r.tokens, j);
  }
  expect_no_leak(*e);
}

TEST_P(EngineTest, RetractionUnderMemoryPressureKeepsOutputsExact) {
  // 50 pages of 8 tokens: the five prompts (~400 tokens) + 64 new tokens each do not fit together (three requests
  // running at once already need more). The requests are submitted while the engine runs: on a loaded machine the
  // submitting thread can be descheduled while the first requests run alone, so a run may see no retraction; 64 new
  // tokens (not 16, which a loaded CI machine once saw finish alone three times) keep every request running long
  // enough for the others to arrive. Each run must be exact; up to three runs, one must have retracted. Again with a
  // host tier (retracted requests' pages saved and loaded back as they come back).
  for (const int32_t host : {0, 64}) {
    host_pages_ = host;
    int64_t retractions = 0;
    for (int attempt = 0; attempt < 3 && retractions == 0; ++attempt) {
      auto e = make(50, 8, 64);
      std::vector<std::future<Result>> fs;
      for (int j = 0; j < 5; ++j) fs.push_back(submit(*e, fmt::format("m{}", j), prompts_[j], 64));
      for (int j = 0; j < 5; ++j) {
        Result r = wait(fs[j]);
        EXPECT_EQ(r.tokens.size(), 64u);
        expect_prefix(r.tokens, j);
      }
      retractions = e->stats()[0].num_retractions;
      expect_no_leak(*e);
    }
    EXPECT_GT(retractions, 0) << "host pages " << host;
  }
  host_pages_ = 0;
}

// The hierarchical cache: a device pool that holds one long prompt's pages at a time. The prompt, then three other
// long prompts (each evicting what the group holds), then the prompt again: with a host tier its pages come back
// from the host (cached tokens, the host tier's counter) and the greedy tokens are Hugging Face's again; without one
// nothing of it is left. In tp 2 (each rank copies its own pages) and with DP attention (the requests alternate
// between the two groups, so each group evicts its own).
TEST_P(EngineTest, HierarchicalCacheBringsEvictedPrefixesBack) {
  const auto& a = prompts_[4];  // the longest prompt
  std::vector<std::vector<int32_t>> others;
  for (int32_t k = 1; k <= 3; ++k) {
    others.push_back(a);
    others.back()[0] = (a[0] + 7 * k) % 700;  // nothing in common with a or each other
  }
  for (const auto& [tp, dp] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{2, 2}}) {
    for (const int32_t host : {0, 128}) {
      host_pages_ = host;
      auto e = make(/*pages=*/40, /*page_size=*/8, 8192, true, tp, dp);
      auto f = submit(*e, "a", a, 8);
      const Result first = wait(f);
      expect_prefix(first.tokens, 4);
      for (size_t k = 0; k < others.size(); ++k) {
        auto o = submit(*e, "o" + std::to_string(k), others[k], 4);
        wait(o);
      }
      f = submit(*e, "a2", a, 8);
      const Result again = wait(f);
      EXPECT_EQ(again.tokens, first.tokens) << tp << "/" << dp << " host " << host;
      expect_prefix(again.tokens, 4);
      int64_t loaded = 0, host_total = 0;
      for (const RankStats& st : e->stats()) {
        loaded += st.host_loaded_tokens_total;
        host_total += st.kv_host_tokens_total;
      }
      if (host > 0) {
        EXPECT_EQ(again.cached, static_cast<int32_t>(a.size() - 1) / 8 * 8) << tp << "/" << dp;  // the whole pages
        EXPECT_EQ(loaded, again.cached) << tp << "/" << dp;
        EXPECT_EQ(host_total, int64_t{host} * 8 * dp);
      } else {
        EXPECT_EQ(again.cached, 0) << tp << "/" << dp;
        EXPECT_EQ(loaded, 0);
      }
      expect_no_leak(*e);
    }
  }
  host_pages_ = 0;
}

TEST_P(EngineTest, AbortAndBadRequests) {
  auto e = make(512);
  auto f = submit(*e, "long", prompts_[4], 3000);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  FinishReason why;
  why.kind = FinishKind::Abort;
  why.message = "client disconnected";
  e->abort("long", why);
  Result r = wait(f);
  EXPECT_EQ(r.finish.kind, FinishKind::Abort);
  EXPECT_LT(r.tokens.size(), 3000u);
  GenerateRequest bad;
  bad.rid = "bad";
  bad.input_ids = {1, 2, 100000};
  EXPECT_THROW(e->submit(bad), Error);
  bad.input_ids.assign(6000, 3);  // longer than the 5120-token context
  EXPECT_THROW(e->submit(bad), Error);
  expect_no_leak(*e);
}

TEST_P(EngineTest, StopTokenEndsTheRequestAtThatToken) {
  // With overlap the stop is seen one step late: the output must still end exactly at the stop token.
  auto e = make(512);
  ASSERT_GE(greedy_[3].size(), 4u);
  SamplingParams sp;
  sp.stop_token_ids = {greedy_[3][3]};
  std::vector<std::future<Result>> fs;
  fs.push_back(submit(*e, "stop", prompts_[3], 20, sp));
  fs.push_back(submit(*e, "other", prompts_[1], 12));  // keeps the batch going past the stop
  Result r = wait(fs[0]);
  EXPECT_EQ(r.finish.kind, FinishKind::Stop);
  EXPECT_EQ(r.finish.matched_token, greedy_[3][3]);
  size_t first = 0;
  while (greedy_[3][first] != greedy_[3][3]) ++first;
  EXPECT_EQ(r.tokens, std::vector<int32_t>(greedy_[3].begin(), greedy_[3].begin() + first + 1));
  expect_prefix(wait(fs[1]).tokens, 1);
  expect_no_leak(*e);
}

// logit_bias moves the greedy choice (+100 on one token makes it every token; -100 on the greedy first token replaces
// it); min_new_tokens keeps a stop token out of the first tokens (with overlap the draw index counts the token in
// flight) and ends the request at its first appearance after them. Bad values are refused at submit.
TEST_P(EngineTest, LogitBiasAndMinNewTokens) {
  auto e = make(512);
  const int32_t first = greedy_[3][0], forced = first == 7 ? 8 : 7;
  SamplingParams up;
  up.logit_bias = {{forced, 100.0f}};
  SamplingParams ban;
  ban.logit_bias = {{first, -100.0f}};
  SamplingParams early;  // stops at the first token without min_new_tokens
  early.stop_token_ids = {first};
  SamplingParams late = early;
  late.min_new_tokens = 3;
  late.logit_bias = {{first, 30.0f}};  // without the ban every token would be `first`
  auto fu = submit(*e, "up", prompts_[3], 6, up);
  auto fb = submit(*e, "ban", prompts_[3], 2, ban);
  auto fe = submit(*e, "early", prompts_[3], 6, early);
  auto fl = submit(*e, "late", prompts_[3], 8, late);
  EXPECT_EQ(wait(fu).tokens, std::vector<int32_t>(6, forced));
  const Result b = wait(fb);
  ASSERT_FALSE(b.tokens.empty());
  EXPECT_NE(b.tokens[0], first);
  const Result re = wait(fe);
  EXPECT_EQ(re.tokens, std::vector<int32_t>{first});
  EXPECT_EQ(re.finish.kind, FinishKind::Stop);
  const Result rl = wait(fl);
  ASSERT_EQ(rl.tokens.size(), 4u);  // three tokens that are not `first`, then `first` (biased to win) stops it
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(rl.tokens[i], first) << i;
  EXPECT_EQ(rl.tokens[3], first);
  EXPECT_EQ(rl.finish.kind, FinishKind::Stop);
  EXPECT_EQ(rl.finish.matched_token, first);

  GenerateRequest bad;
  bad.rid = "bad";
  bad.input_ids = {1, 2};
  bad.sampling.logit_bias = {{100000, 1.0f}};  // outside the vocabulary
  EXPECT_THROW(e->submit(bad), Error);
  bad.sampling.logit_bias = {{3, 1.0f}, {3, 2.0f}};
  EXPECT_THROW(e->submit(bad), Error);
  bad.sampling.logit_bias.clear();
  bad.sampling.max_new_tokens = 4;
  bad.sampling.min_new_tokens = 5;
  EXPECT_THROW(e->submit(bad), Error);
  expect_no_leak(*e);
}

// vLLM's allowed_token_ids: every token (greedy or sampled) from the set, the greedy answer unchanged where it stays
// in the set; when every allowed token is banned (only a stop token allowed, under min_new_tokens) the request stops
// with no token rather than output one outside the set. bad_words: a two-token word's second token is banned only
// right after its first (with overlap the step waits for that token), a one-token word everywhere; bad ids refused.
TEST_P(EngineTest, AllowedTokenIdsAndBadWords) {
  auto e = make(512);
  const std::vector<int32_t>& g = greedy_[3];
  ASSERT_GE(g.size(), 6u);
  const std::set<int32_t> few{3, 17, 40, 41, 99};
  SamplingParams only;
  only.allowed_token_ids.assign(few.begin(), few.end());
  SamplingParams sampled = only;
  sampled.temperature = 0.9f;
  sampled.seed = 5;
  SamplingParams wide;  // the greedy tokens and others
  wide.allowed_token_ids = {1, 2, 3};
  wide.allowed_token_ids.insert(wide.allowed_token_ids.end(), g.begin(), g.begin() + 6);
  std::sort(wide.allowed_token_ids.begin(), wide.allowed_token_ids.end());
  wide.allowed_token_ids.erase(std::unique(wide.allowed_token_ids.begin(), wide.allowed_token_ids.end()),
                               wide.allowed_token_ids.end());
  SamplingParams stuck;
  stuck.allowed_token_ids = {g[0]};
  stuck.stop_token_ids = {g[0]};
  stuck.min_new_tokens = 2;
  SamplingParams pair;
  pair.bad_words_ids = {{g[1], g[2]}};
  SamplingParams single;
  single.bad_words_ids = {{g[0]}};
  auto fo = submit(*e, "only", prompts_[3], 10, only);
  auto fs = submit(*e, "sampled", prompts_[3], 10, sampled);
  auto fw = submit(*e, "wide", prompts_[3], 6, wide);
  auto fk = submit(*e, "stuck", prompts_[3], 4, stuck);
  auto fp = submit(*e, "pair", prompts_[3], 12, pair);
  auto f1 = submit(*e, "single", prompts_[3], 12, single);
  for (auto* f : {&fo, &fs}) {
    const Result r = wait(*f);
    EXPECT_EQ(r.tokens.size(), 10u);
    for (int32_t t : r.tokens) EXPECT_TRUE(few.count(t)) << t;
  }
  EXPECT_EQ(wait(fw).tokens, std::vector<int32_t>(g.begin(), g.begin() + 6));
  const Result rk = wait(fk);
  EXPECT_TRUE(rk.tokens.empty());
  EXPECT_EQ(rk.finish.kind, FinishKind::Stop);
  EXPECT_EQ(rk.finish.matched_token, -1);
  const Result rp = wait(fp);
  ASSERT_GE(rp.tokens.size(), 3u);
  EXPECT_EQ(rp.tokens[0], g[0]);
  EXPECT_EQ(rp.tokens[1], g[1]);
  EXPECT_NE(rp.tokens[2], g[2]);
  for (size_t i = 1; i < rp.tokens.size(); ++i) EXPECT_FALSE(rp.tokens[i - 1] == g[1] && rp.tokens[i] == g[2]) << i;
  const Result r1 = wait(f1);
  EXPECT_EQ(r1.tokens.size(), 12u);
  for (int32_t t : r1.tokens) EXPECT_NE(t, g[0]);

  GenerateRequest bad;
  bad.rid = "bad";
  bad.input_ids = {1, 2};
  bad.sampling.allowed_token_ids = {4, 100000};  // outside the vocabulary
  EXPECT_THROW(e->submit(bad), Error);
  bad.sampling.allowed_token_ids.clear();
  bad.sampling.bad_words_ids = {{4, 100000}};
  EXPECT_THROW(e->submit(bad), Error);
  bad.sampling.bad_words_ids = {{}};
  EXPECT_THROW(e->submit(bad), Error);
  expect_no_leak(*e);
}

// A thinking budget: with the prompt ending in the start marker, the first `budget` tokens are the model's and then
// the end marker's tokens are forced one by one, after which the model goes on freely; a prompt that closed its
// thinking is not touched; a budget of 0 forces the end at once; thinking the model opens itself (its greedy token
// taken as the start marker) is cut `budget` tokens later. With overlap scheduling the forced draws wait for their
// previous token.
TEST_P(EngineTest, ThinkingBudgetForcesTheEndMarker) {
  auto e = make(512);
  const std::vector<int32_t>& prompt = prompts_[3];
  auto plain = [&](std::vector<int32_t> p, int32_t n) {
    auto f = submit(*e, "plain" + std::to_string(p.size()), std::move(p), n);
    return wait(f).tokens;
  };
  const std::vector<int32_t> start{11}, end{12, 13};
  std::vector<int32_t> open = prompt, closed = prompt;
  open.insert(open.end(), start.begin(), start.end());
  closed.insert(closed.end(), start.begin(), start.end());
  closed.insert(closed.end(), end.begin(), end.end());
  SamplingParams sp;
  sp.think_start_ids = start;
  sp.think_end_ids = end;
  sp.thinking_budget = 3;
  const std::vector<int32_t> free_open = plain(open, 3);
  for (int32_t t : free_open) ASSERT_TRUE(t != start[0] && t != end[0] && t != end[1]) << "a marker id generated";
  auto fo = submit(*e, "open", open, 10, sp);
  auto fc = submit(*e, "closed", closed, 8, sp);
  SamplingParams zero = sp;
  zero.thinking_budget = 0;
  auto fz = submit(*e, "zero", open, 4, zero);
  const Result ro = wait(fo);
  ASSERT_EQ(ro.tokens.size(), 10u);
  EXPECT_EQ(std::vector<int32_t>(ro.tokens.begin(), ro.tokens.begin() + 3), free_open);
  EXPECT_EQ(ro.tokens[3], end[0]);
  EXPECT_EQ(ro.tokens[4], end[1]);
  std::vector<int32_t> after = open;  // past the end marker the model goes on as without a budget
  after.insert(after.end(), ro.tokens.begin(), ro.tokens.begin() + 5);
  EXPECT_EQ(std::vector<int32_t>(ro.tokens.begin() + 5, ro.tokens.end()), plain(after, 5));
  EXPECT_EQ(wait(fc).tokens, plain(closed, 8));
  const Result rz = wait(fz);
  ASSERT_EQ(rz.tokens.size(), 4u);
  EXPECT_EQ(rz.tokens[0], end[0]);
  EXPECT_EQ(rz.tokens[1], end[1]);

  // The model opens thinking: its own second greedy token (not in the prompt) taken as the start marker.
  const std::vector<int32_t> g = plain(prompt, 8);
  size_t k = 1;
  while (k + 3 < g.size() && (std::count(g.begin(), g.begin() + static_cast<int64_t>(k) + 3, g[k]) != 1 ||
                              std::find(prompt.begin(), prompt.end(), g[k]) != prompt.end() || g[k + 1] == end[0] ||
                              g[k + 2] == end[0]))
    ++k;
  ASSERT_LT(k + 3, g.size()) << "no greedy token usable as a start marker";
  SamplingParams own = sp;
  own.think_start_ids = {g[k]};
  own.think_end_ids = {end[0]};
  own.thinking_budget = 2;
  auto fw = submit(*e, "own", prompt, static_cast<int32_t>(k) + 4, own);
  const Result rw = wait(fw);
  ASSERT_EQ(rw.tokens.size(), k + 4);
  EXPECT_EQ(std::vector<int32_t>(rw.tokens.begin(), rw.tokens.begin() + static_cast<int64_t>(k) + 3),
            std::vector<int32_t>(g.begin(), g.begin() + static_cast<int64_t>(k) + 3));
  EXPECT_EQ(rw.tokens[k + 3], end[0]);

  GenerateRequest bad;
  bad.rid = "bad";
  bad.input_ids = {1, 2};
  bad.sampling.thinking_budget = 4;  // no markers
  EXPECT_THROW(e->submit(bad), Error);
  expect_no_leak(*e);
}

// Constrained decoding: a vocabulary of runs of one character (token i: 1 + i / 22 copies of the i % 22-th, token
// 5 special as the EOS) and a regex. Greedy and seeded draws alike give outputs whose bytes match it; a request that
// ignores EOS ends (a stop without a token) once its text is complete and nothing more is allowed; with EOS allowed
// (where the text may end) and biased to win, the request ends at the first place it may, on the EOS; a constraint
// whose automaton outgrows its cap aborts its own request only.
TEST_P(EngineTest, ConstrainedDecodingFollowsTheRegex) {
  const std::string chars = "{}\"a5b0123456789:tru e";  // token 5 (a b) is the EOS instead
  std::vector<std::string> bytes(640);
  for (size_t i = 0; i < bytes.size(); ++i)
    if (i != 5) bytes[i] = std::string(1 + i / chars.size(), chars[i % chars.size()]);
  auto vocab = std::make_shared<const structured::TokenVocab>(bytes);
  auto text = [&](const std::vector<int32_t>& ids) {
    std::string t;
    for (int32_t id : ids) t += bytes[static_cast<size_t>(id)];
    return t;
  };
  const std::string re = R"(\{"a{1,40}b?": ([0-9]{1,3}|true)\})";  // at most 52 bytes: done in 60 tokens
  auto e = make(512, 8, 8192, true, 1, 1, {5});
  std::vector<std::future<Result>> fs;
  for (int k = 0; k < 6; ++k) {
    SamplingParams sp;
    sp.temperature = k == 0 ? 0.0f : 0.9f;
    sp.seed = 100 + k;
    sp.constraint = std::make_shared<structured::RegexConstraint>(vocab, re);
    fs.push_back(submit(*e, "c" + std::to_string(k), prompts_[k % 5], 60, sp));
  }
  SamplingParams boom;  // an automaton that outgrows its cap (4 states): that request alone ends, aborted
  boom.constraint = std::make_shared<structured::RegexConstraint>(vocab, "(a|b)*a(a|b){6}", 4);
  auto fb = submit(*e, "boom", prompts_[0], 30, boom);
  auto other = submit(*e, "plain", prompts_[1], 12);  // an unconstrained request in the same batches
  structured::Dfa dfa(structured::compile_regex(re));
  std::set<std::string> distinct;
  for (auto& f : fs) {
    const Result r = wait(f);
    EXPECT_TRUE(dfa.matches(text(r.tokens))) << text(r.tokens);
    EXPECT_EQ(r.finish.kind, FinishKind::Stop);
    EXPECT_EQ(r.finish.matched_token, -1);
    distinct.insert(text(r.tokens));
  }
  EXPECT_GT(distinct.size(), 2u);  // the draws differ
  expect_prefix(wait(other).tokens, 1);
  const Result rb = wait(fb);
  EXPECT_EQ(rb.finish.kind, FinishKind::Abort);
  EXPECT_NE(rb.finish.message.find("structured output: the regex's automaton needs more than 4 states"),
            std::string::npos)
      << rb.finish.message;

  // A constraint whose only text is the empty one, EOS ignored: no token may be drawn, so the request stops with none
  // (also after prompt logprobs); an automaton that outgrows its cap in its very first state aborts before any work.
  SamplingParams empty;
  empty.constraint = std::make_shared<structured::RegexConstraint>(vocab, "");
  auto fz = submit(*e, "empty", prompts_[3], 10, empty);
  empty.logprob_start_len = 0;
  auto fzl = submit(*e, "empty-lps", prompts_[3], 10, empty);
  SamplingParams big;
  big.constraint = std::make_shared<structured::RegexConstraint>(vocab, "(a|b)*a(a|b){6}", 1);
  auto fbig = submit(*e, "boom-first", prompts_[0], 10, big);
  const Result rz = wait(fz), rzl = wait(fzl);
  for (const Result* r : {&rz, &rzl}) {
    EXPECT_TRUE(r->tokens.empty()) << text(r->tokens);
    EXPECT_EQ(r->completion_tokens, 0);
    EXPECT_EQ(r->finish.kind, FinishKind::Stop);
    EXPECT_EQ(r->finish.matched_token, -1);
  }
  EXPECT_EQ(rzl.prompt_logprobs.size(), prompts_[3].size());
  const Result rbig = wait(fbig);
  EXPECT_EQ(rbig.finish.kind, FinishKind::Abort);
  EXPECT_TRUE(rbig.tokens.empty());
  {  // "a": only token 3 is allowed, a stop token that min_new_tokens bans, so the draw falls outside the constraint
     // (greedy over all -inf: token 0, "{"); that token is not output and the request ends
    GenerateRequest g;
    g.rid = "banned";
    g.input_ids = prompts_[1];
    g.sampling.temperature = 0.0f;
    g.sampling.max_new_tokens = 6;
    g.sampling.min_new_tokens = 1;
    g.sampling.stop_token_ids = {3};
    g.sampling.ignore_eos = true;
    g.sampling.return_logprob = true;
    g.sampling.constraint = std::make_shared<structured::RegexConstraint>(vocab, "a");
    auto f = submit_request(*e, std::move(g));
    const Result r = wait(f);
    EXPECT_TRUE(r.tokens.empty()) << text(r.tokens);
    EXPECT_TRUE(r.logprobs.empty());
    EXPECT_EQ(r.completion_tokens, 0);
    EXPECT_EQ(r.finish.kind, FinishKind::Stop);
    EXPECT_EQ(r.finish.matched_token, -1);
  }

  GenerateRequest g;  // EOS not ignored: [0-9]+ may end after its first token, where the biased EOS wins
  g.rid = "eos";
  g.input_ids = prompts_[2];
  g.sampling.temperature = 0.0f;
  g.sampling.max_new_tokens = 20;
  g.sampling.logit_bias = {{5, 100.0f}};
  g.sampling.constraint = std::make_shared<structured::RegexConstraint>(vocab, "[0-9]+");
  auto fe = submit_request(*e, std::move(g));
  const Result r = wait(fe);
  ASSERT_EQ(r.tokens.size(), 2u);
  EXPECT_TRUE(structured::Dfa(structured::compile_regex("[0-9]+")).matches(bytes[static_cast<size_t>(r.tokens[0])]));
  EXPECT_EQ(r.tokens[1], 5);
  EXPECT_EQ(r.finish.kind, FinishKind::Stop);
  EXPECT_EQ(r.finish.matched_token, 5);
  expect_no_leak(*e);
}

TEST_P(EngineTest, SeededSamplingIsReproducible) {
  auto e = make(512);
  SamplingParams sp;
  sp.temperature = 0.8f;
  sp.top_p = 0.9f;
  sp.seed = 1234;
  auto a = submit(*e, "s1", prompts_[2], 10, sp);
  auto b = submit(*e, "s2", prompts_[2], 10, sp);
  EXPECT_EQ(wait(a).tokens, wait(b).tokens);
  expect_no_leak(*e);
}

// N-gram speculative decoding: drafts from earlier occurrences of a request's last tokens, checked in one step, keep
// the outputs of plain decoding: greedy equal to Hugging Face's up to its first near tie (prompts repeated so that
// drafts exist; the model's own loops give more), seeded sampling and logprobs equal to decoding without drafts (the
// draft rows are drawn as their positions' draws), a stop token or the length limit inside a run of kept drafts ends
// the request exactly there; some drafts are kept; nothing leaks (pages of rejected drafts go back).
TEST_P(EngineTest, NgramSpeculativeDecodingKeepsTheOutputs) {
  auto plain = make(1024, 8);
  auto spec = make(1024, 8, 8192, true, 1, 1, {}, /*drafts=*/4);
  for (int j = 0; j < 5; ++j) {
    auto f = submit(*spec, "g" + std::to_string(j), prompts_[j], 24);
    expect_prefix(wait(f).tokens, static_cast<size_t>(j));
  }
  auto doubled = [&](int j) {
    std::vector<int32_t> p = prompts_[j];
    p.insert(p.end(), prompts_[j].begin(), prompts_[j].begin() + std::min<int64_t>(40, std::ssize(prompts_[j])));
    return p;
  };
  SamplingParams lp;
  lp.return_logprob = true;
  SamplingParams seeded;
  seeded.temperature = 0.7f;
  seeded.top_k = 20;
  seeded.seed = 77;
  seeded.return_logprob = true;
  for (int j : {1, 3}) {
    for (const SamplingParams& sp : {lp, seeded}) {
      auto a = submit(*plain, "p", doubled(j), 48, sp);
      auto b = submit(*spec, "s", doubled(j), 48, sp);
      const Result ra = wait(a), rb = wait(b);
      ASSERT_EQ(rb.tokens.size(), 48u);
      size_t same = 0;  // greedy: up to a near tie of the two computations (a prefill-shaped step vs decode)
      while (same < ra.tokens.size() && ra.tokens[same] == rb.tokens[same]) ++same;
      EXPECT_GE(same, sp.seed ? 48u : 24u) << "prompt " << j;
      ASSERT_EQ(rb.logprobs.size(), 48u);
      for (size_t i = 0; i < same; ++i) EXPECT_NEAR(ra.logprobs[i].logprob, rb.logprobs[i].logprob, 2e-3) << i;
    }
  }
  // A stop token met inside a run of kept drafts, and the length limit: the output ends exactly there. Three allowed
  // tokens make the greedy output loop, so most drafts are kept.
  SamplingParams few;
  few.allowed_token_ids = {prompts_[3][0], prompts_[3][1], prompts_[3][2]};
  const int64_t kept_before = spec->stats()[0].spec_accepted_tokens;
  auto base = submit(*plain, "base", doubled(3), 40, few);
  const Result br = wait(base);
  auto loop = submit(*spec, "loop", doubled(3), 40, few);
  EXPECT_EQ(wait(loop).tokens, br.tokens);
  EXPECT_GE(spec->stats()[0].spec_accepted_tokens - kept_before, 10) << "the loop's drafts are kept";
  for (size_t at : {size_t{9}, size_t{14}, size_t{22}, size_t{31}}) {
    SamplingParams st = few;
    st.stop_token_ids = {br.tokens[at]};
    auto f = submit(*spec, "stop", doubled(3), 40, st);
    const Result r = wait(f);
    size_t first = 0;
    while (br.tokens[first] != br.tokens[at]) ++first;
    EXPECT_EQ(r.finish.kind, FinishKind::Stop);
    EXPECT_EQ(r.tokens, std::vector<int32_t>(br.tokens.begin(), br.tokens.begin() + static_cast<int64_t>(first) + 1));
  }
  for (int32_t n : {1, 2, 7, 13, 22}) {
    auto f = submit(*spec, "len", doubled(3), n, few);
    const Result r = wait(f);
    EXPECT_EQ(r.finish.kind, FinishKind::Length);
    EXPECT_EQ(r.tokens, std::vector<int32_t>(br.tokens.begin(), br.tokens.begin() + n));
  }
  // Tensor parallel and DP attention: the same tokens (two requests at once, each on a DP group of its own).
  for (const auto& [tp, dp] : {std::pair{2, 1}, std::pair{2, 2}}) {
    auto e = make(1024, 8, 8192, true, tp, dp, {}, /*drafts=*/4);
    auto a = submit(*e, "a", doubled(3), 40, few);
    auto b = submit(*e, "b", doubled(3), 40, few);
    EXPECT_EQ(wait(a).tokens, br.tokens) << "tp " << tp << " dp " << dp;
    EXPECT_EQ(wait(b).tokens, br.tokens) << "tp " << tp << " dp " << dp;
    int64_t kept = 0;
    for (const RankStats& st : e->stats()) kept += st.spec_accepted_tokens;
    EXPECT_GE(kept, 20) << "tp " << tp << " dp " << dp;
  }
  const RankStats st = spec->stats()[0];
  EXPECT_GT(st.spec_draft_tokens, 0);
  EXPECT_GT(st.spec_accepted_tokens, 0);
  EXPECT_LE(st.spec_accepted_tokens, st.spec_draft_tokens);
  EXPECT_LT(st.forward_steps, st.generation_tokens_total) << "drafts kept: fewer steps than tokens";
  EXPECT_EQ(plain->stats()[0].spec_draft_tokens, 0);
  expect_no_leak(*spec);
}

// Steps checking drafts replay the decode graphs (a decode token and its drafts are several tokens of one sequence,
// padded with one-token sequences to the graph's size): tokens and logprobs equal those of eager steps, and every step
// after the prompts' replays a graph; on one rank and under DP attention 2/2 (each group padded to the larger one).
TEST_P(EngineTest, DraftCheckingStepsReplayGraphs) {
  SamplingParams few;  // three allowed tokens: the greedy output loops, so most steps check kept drafts
  few.allowed_token_ids = {prompts_[3][0], prompts_[3][1], prompts_[3][2]};
  few.return_logprob = true;
  for (const auto& [tp, dp] : {std::pair{1, 1}, std::pair{2, 2}}) {
    std::vector<std::vector<Result>> runs;
    int64_t graph_steps = 0, steps = 0, drafts = 0, kept = 0, overlapped = 0;
    for (int32_t graph_max_bs : {0, 8}) {
      auto ranks = test::cpu_ranks("v2", tp, dp, graph_max_bs);
      const RankSet* rs = ranks.get();
      EngineOptions o = test::small_engine_options(GetParam(), 1024);
      o.spec_draft_tokens = 4;
      Engine e(std::move(ranks), o);
      std::vector<std::future<Result>> fs;
      for (int r = 0; r < dp; ++r) {
        std::vector<int32_t> p = prompts_[static_cast<size_t>(3 - r)];  // the prompt twice: drafts from the start
        p.insert(p.end(), p.begin(), p.end());
        fs.push_back(submit(e, fmt::format("r{}", r), p, 40, few));
      }
      runs.emplace_back();
      for (auto& f : fs) runs.back().push_back(wait(f));
      if (graph_max_bs > 0) {
        graph_steps = rs->graph_steps();
        for (const RankStats& st : e.stats()) {
          steps = std::max(steps, st.forward_steps);
          drafts += st.spec_draft_tokens;
          kept += st.spec_accepted_tokens;
          overlapped = std::max(overlapped, st.overlapped_steps);
        }
      }
      expect_no_leak(e);
    }
    for (size_t r = 0; r < runs[0].size(); ++r) {
      const Result &eager = runs[0][r], &graph = runs[1][r];
      ASSERT_EQ(graph.tokens, eager.tokens) << "tp " << tp << " dp " << dp << " request " << r;
      ASSERT_EQ(graph.logprobs.size(), eager.logprobs.size());
      for (size_t i = 0; i < eager.logprobs.size(); ++i) {
        EXPECT_NEAR(graph.logprobs[i].logprob, eager.logprobs[i].logprob, 1e-5) << "request " << r << " token " << i;
      }
    }
    EXPECT_GE(kept, 10 * dp) << "tp " << tp << " dp " << dp;
    // The prompts' steps run eagerly (one each, or one for both groups), every other step replays a graph.
    EXPECT_GE(graph_steps, steps - dp) << "tp " << tp << " dp " << dp;
    EXPECT_LT(steps, 40) << "drafts kept: fewer steps than tokens";
    EXPECT_EQ(overlapped > 0, GetParam()) << "drafts and overlap scheduling together";
  }
}

// Counts on one rank the sampling run eagerly (Backend::sample of some rows) and the graph steps' staged sampling.
class SampleCounter final : public ForwardingBackend {
 public:
  SampleCounter(std::unique_ptr<Backend> inner, std::atomic<int64_t>* eager, std::atomic<int64_t>* staged)
      : ForwardingBackend(*inner), owned_(std::move(inner)), eager_(eager), staged_(staged) {}
  void sample(const Tensor& l, std::span<const RowSampling> p, Tensor& i, Tensor* lp) override {
    if (!p.empty()) ++*eager_;
    ForwardingBackend::sample(l, p, i, lp);
  }
  void stage_sample(std::span<const RowSampling> p, const Tensor* lp) override {
    ++*staged_;
    ForwardingBackend::stage_sample(p, lp);
  }

 private:
  std::unique_ptr<Backend> owned_;
  std::atomic<int64_t>*eager_, *staged_;
};

// Decode steps replaying graphs sample inside them, each replay the rows staged before it (seeds' steps and penalty
// counts change every step): seeded draws with temperature, top-k / top-p / min-p, the three penalties, a logit bias
// and an allowed-token mask, beside a greedy request, all with logprobs, give the tokens and logprobs of eager steps;
// only the steps of the prompts sample eagerly. On one rank, at tp 2 (the ids broadcast inside the graph) and under
// DP attention 2/2 and 4/2 (groups of two ranks: the broadcast within the group).
TEST_P(EngineTest, GraphStepsSampleInsideTheirGraphs) {
  std::vector<SamplingParams> sps(4);
  for (SamplingParams& sp : sps) sp.return_logprob = true;
  sps[0].temperature = 0.9f;
  sps[0].top_k = 40;
  sps[0].top_p = 0.95f;
  sps[0].frequency_penalty = 0.3f;
  sps[0].presence_penalty = 0.2f;
  sps[0].repetition_penalty = 1.1f;
  sps[0].seed = 7;
  sps[1].temperature = 1.3f;
  sps[1].min_p = 0.05f;
  sps[1].logit_bias = {{prompts_[1][0], 3.0f}, {prompts_[1][1], -2.0f}};
  sps[1].seed = 8;
  sps[2].temperature = 0.7f;
  for (int32_t t = 0; t < 60; ++t) sps[2].allowed_token_ids.push_back(3 * t + 1);
  sps[2].seed = 9;
  sps[3].temperature = 0.0f;  // greedy
  for (const auto& [tp, dp] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{2, 2}, std::pair{4, 2}}) {
    SCOPED_TRACE(fmt::format("tp {} dp {}", tp, dp));
    std::vector<std::vector<Result>> runs;
    for (int32_t graph_max_bs : {0, 8}) {
      std::array<std::atomic<int64_t>, 4> eager{}, staged{};
      auto ranks = test::cpu_ranks_at(test::golden_dir("v2"), tp, dp, graph_max_bs, false, false,
                                      [&](ParallelConfig& pc) {
                                        pc.wrap_backend = [&](std::unique_ptr<Backend> made, int32_t rank) {
                                          return std::make_unique<SampleCounter>(std::move(made), &eager[rank],
                                                                                 &staged[rank]);
                                        };
                                      });
      const RankSet* rs = ranks.get();
      Engine e(std::move(ranks), test::small_engine_options(GetParam(), 512));
      std::vector<std::future<Result>> fs;
      for (size_t r = 0; r < sps.size(); ++r) fs.push_back(submit(e, fmt::format("r{}", r), prompts_[r], 16, sps[r]));
      runs.emplace_back();
      for (auto& f : fs) runs.back().push_back(wait(f));
      int64_t steps = 0;
      for (const RankStats& st : e.stats()) steps = std::max(steps, st.forward_steps);
      const int64_t graph_steps = rs->graph_steps();
      if (graph_max_bs == 0) {
        EXPECT_EQ(graph_steps, 0);
        for (int rank = 0; rank < tp; ++rank) EXPECT_EQ(staged[rank], 0);
      } else {
        EXPECT_GE(graph_steps, 10);
        // Every group's leading rank samples eagerly in eager steps only; the group's other ranks never sample.
        for (int rank = 0; rank < tp; ++rank) {
          if (rank % (tp / dp) == 0) {
            EXPECT_LE(eager[rank], steps - graph_steps) << "rank " << rank;
            EXPECT_GE(staged[rank], graph_steps) << "rank " << rank;
          } else {
            EXPECT_EQ(eager[rank] + staged[rank], 0) << "rank " << rank;
          }
        }
      }
      expect_no_leak(e);
    }
    for (size_t r = 0; r < sps.size(); ++r) {
      const Result &eager = runs[0][r], &graph = runs[1][r];
      ASSERT_EQ(graph.tokens, eager.tokens) << "request " << r;
      ASSERT_EQ(graph.logprobs.size(), eager.logprobs.size());
      for (size_t i = 0; i < eager.logprobs.size(); ++i)
        EXPECT_NEAR(graph.logprobs[i].logprob, eager.logprobs[i].logprob, 1e-5) << "request " << r << " token " << i;
    }
    for (int32_t id : runs[1][2].tokens) EXPECT_EQ(id % 3, 1) << "the allowed tokens only";
  }
}

// Compares overlap on and off itself (not a parameter), so no EngineTest::make here.
// Only the rows that ask for top-N logprobs bring their logits to the host, packed in row order: each request's
// lists equal those it gets alone, with other requests (asking or not) before, between and after it in the batch.
TEST_P(EngineTest, TopLogprobsOfSomeRowsEqualThoseAlone) {
  SamplingParams top3, top2;
  top3.return_logprob = top2.return_logprob = true;
  top3.top_logprobs_num = 3;
  top2.top_logprobs_num = 2;
  auto alone = [&](int j, const SamplingParams& sp) {
    auto e = make(256);
    auto f = submit(*e, "alone", prompts_[static_cast<size_t>(j)], 6, sp);
    return wait(f);
  };
  const Result a3 = alone(4, top3), a2 = alone(2, top2);
  auto e = make(256);
  std::vector<std::future<Result>> fs;
  fs.push_back(submit(*e, "g0", prompts_[0], 6));
  fs.push_back(submit(*e, "t3", prompts_[4], 6, top3));
  fs.push_back(submit(*e, "g1", prompts_[1], 6));
  fs.push_back(submit(*e, "t2", prompts_[2], 6, top2));
  fs.push_back(submit(*e, "g3", prompts_[3], 6));
  std::vector<Result> out;
  for (auto& f : fs) out.push_back(wait(f));
  for (const auto& [got, ref, what] : {std::tuple{&out[1], &a3, "top-3"}, std::tuple{&out[3], &a2, "top-2"}}) {
    ASSERT_EQ(got->tokens, ref->tokens) << what;
    ASSERT_EQ(got->logprobs.size(), ref->logprobs.size()) << what;
    for (size_t i = 0; i < got->logprobs.size(); ++i) {
      const auto &g = got->logprobs[i].top, &r = ref->logprobs[i].top;
      ASSERT_EQ(g.size(), r.size()) << what << " token " << i;
      for (size_t k = 0; k < g.size(); ++k) {
        EXPECT_EQ(g[k].first, r[k].first) << what << " token " << i << " rank " << k;
        EXPECT_NEAR(g[k].second, r[k].second, 1e-4) << what << " token " << i << " rank " << k;
      }
    }
  }
  EXPECT_TRUE(out[0].logprobs.empty() && out[2].logprobs.empty() && out[4].logprobs.empty());
  expect_no_leak(*e);
}

// Prompt logprobs (logprob_start_len) against Hugging Face's log-softmax at each prompt position: in chunks, after
// another request cached the prompt, next to requests that ask for none, with top-N alternatives, with a request
// that generates nothing; on one rank and on two TP ranks.
// SGLang's token_ids_logprob: the listed ids' logprobs at every prompt position asked for equal Hugging Face's
// log-softmax, and at every generated position they agree with the token's own logprob and its top-N alternatives
// (the same log-softmax); a request with return_logprob alone reports them too; ids outside the vocabulary refused.
TEST_P(EngineTest, TokenIdsLogprobsAreOfTheModelDistribution) {
  auto e = make(256);
  const size_t j = 1;
  const std::vector<int32_t> asked{greedy_[j][0], 0, 7, greedy_[j][1], 300};
  SamplingParams sp;
  sp.logprob_start_len = 0;
  sp.return_logprob = true;
  sp.top_logprobs_num = 3;
  sp.token_ids_logprob = asked;
  SamplingParams plain;  // no top-N: the rows still reach the host for the ids
  plain.return_logprob = true;
  plain.token_ids_logprob = {greedy_[j][1], 5};
  auto fa = submit(*e, "a", prompts_[j], 4, sp);
  auto fb = submit(*e, "b", prompts_[j], 2, plain);
  const Result a = wait(fa), b = wait(fb);
  const auto& prompt = prompts_[j];
  ASSERT_EQ(a.prompt_logprobs.size(), prompt.size());
  EXPECT_TRUE(a.prompt_logprobs[0].ids.empty());  // no logprob at position 0
  for (size_t pos = 1; pos < prompt.size(); ++pos) {
    const auto& ids = a.prompt_logprobs[pos].ids;
    ASSERT_EQ(ids.size(), asked.size()) << pos;
    for (size_t k = 0; k < asked.size(); ++k) {
      EXPECT_EQ(ids[k].first, asked[k]);
      EXPECT_NEAR(ids[k].second, hf_logprobs_[j][pos - 1][static_cast<size_t>(asked[k])], 2e-3) << pos << " " << k;
    }
  }
  ASSERT_EQ(a.logprobs.size(), 4u);
  for (size_t t = 0; t < a.logprobs.size(); ++t) {
    const TokenLogprob& lp = a.logprobs[t];
    ASSERT_EQ(lp.ids.size(), asked.size());
    for (size_t k = 0; k < asked.size(); ++k) {
      EXPECT_EQ(lp.ids[k].first, asked[k]);
      EXPECT_LE(lp.ids[k].second, 0.0f);
      if (asked[k] == lp.token) {
        EXPECT_FLOAT_EQ(lp.ids[k].second, lp.logprob) << t;
      }
      for (const auto& [id, v] : lp.top) {
        if (id == asked[k]) {
          EXPECT_FLOAT_EQ(lp.ids[k].second, v) << t;
        }
      }
    }
  }
  EXPECT_EQ(a.logprobs[0].ids[0].second, a.logprobs[0].logprob);  // the greedy token is the first id asked for
  ASSERT_EQ(b.logprobs.size(), 2u);
  ASSERT_EQ(b.logprobs[1].ids.size(), 2u);
  EXPECT_NEAR(b.logprobs[1].ids[0].second, a.logprobs[1].ids[3].second, 1e-6);  // the same token at the same place
  GenerateRequest bad;
  bad.rid = "bad";
  bad.input_ids = {1, 2};
  bad.sampling.token_ids_logprob = {3, 100000};
  EXPECT_THROW(e->submit(bad), Error);
  expect_no_leak(*e);
}

TEST_P(EngineTest, PromptLogprobsEqualHuggingFace) {
  auto check = [&](const Result& r, size_t j, int32_t start, int32_t top, const std::string& what) {
    const auto& prompt = prompts_[j];
    ASSERT_EQ(r.prompt_logprobs.size(), prompt.size() - static_cast<size_t>(start)) << what;
    for (size_t i = 0; i < r.prompt_logprobs.size(); ++i) {
      const size_t pos = static_cast<size_t>(start) + i;
      const TokenLogprob& lp = r.prompt_logprobs[i];
      EXPECT_EQ(lp.token, prompt[pos]) << what << " position " << pos;
      if (pos == 0) {
        EXPECT_TRUE(std::isnan(lp.logprob)) << what;
        EXPECT_TRUE(lp.top.empty()) << what;
        continue;
      }
      const std::vector<float>& hf = hf_logprobs_[j][pos - 1];
      EXPECT_NEAR(lp.logprob, hf[static_cast<size_t>(prompt[pos])], 2e-3) << what << " position " << pos;
      ASSERT_EQ(lp.top.size(), static_cast<size_t>(top)) << what << " position " << pos;
      for (int32_t k = 0; k < top; ++k) {
        const auto& [id, v] = lp.top[static_cast<size_t>(k)];
        EXPECT_NEAR(v, hf[static_cast<size_t>(id)], 2e-3) << what << " position " << pos << " rank " << k;
      }
      if (top > 0) {
        EXPECT_NEAR(lp.top[0].second, *std::max_element(hf.begin(), hf.end()), 2e-3) << what;
      }
    }
  };
  SamplingParams from0, from40;
  from0.logprob_start_len = 0;
  from0.top_logprobs_num = 2;
  from40.logprob_start_len = 40;
  for (const auto& [tp, dp] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{2, 2}}) {  // (DP attention: two groups)
    auto e = make(256, /*page_size=*/8, /*chunk=*/48, /*radix=*/true, tp, dp);
    const std::string t = fmt::format(" tp {} dp {}", tp, dp);
    auto warm = submit(*e, "warm", prompts_[4], 2);
    wait(warm);
    auto a = submit(*e, "a", prompts_[4], 3, from0);  // chunks of 48 over the cached prompt
    auto b = submit(*e, "b", prompts_[3], 3);
    auto c = submit(*e, "c", prompts_[3], 0, from40);  // nothing generated
    auto d = submit(*e, "d", prompts_[1], 2, from0);
    const Result ra = wait(a), rb = wait(b), rc = wait(c), rd = wait(d);
    check(ra, 4, 0, 2, "a" + t);
    expect_prefix(ra.tokens, 4);
    EXPECT_EQ(ra.tokens.size(), 3u);
    EXPECT_TRUE(rb.prompt_logprobs.empty());
    expect_prefix(rb.tokens, 3);
    check(rc, 3, 40, 0, "c" + t);
    EXPECT_TRUE(rc.tokens.empty());
    EXPECT_EQ(rc.finish.kind, FinishKind::Length);
    check(rd, 1, 0, 2, "d" + t);
    expect_no_leak(*e);
  }
}

// SGLang's return_hidden_states: a row per prompt position and per generated token but the last, equal to Hugging
// Face's final hidden states, with prompt logprobs' care for the prefix cache (the prompt is computed again), in
// prefill chunks, beside other requests, at tp 2 and with DP attention, in graph steps, under retraction (no row
// twice) and with n-gram drafts (the rows of the drafts kept).
TEST_P(EngineTest, HiddenStatesEqualHuggingFace) {
  SamplingParams hs;
  hs.return_hidden_states = true;
  const size_t H = static_cast<size_t>(hidden_size_);
  // r's rows against Hugging Face's for prompt j (its greedy tokens checked first).
  auto check = [&](const Result& r, size_t j, const std::string& what) {
    expect_prefix(r.tokens, j);
    ASSERT_EQ(r.hidden_size, hidden_size_) << what;
    const size_t rows = prompts_[j].size() + r.tokens.size() - 1;
    ASSERT_EQ(r.hidden.size(), rows * H) << what;
    ASSERT_LE(rows * H, hf_hidden_[j].size()) << what;
    float worst = 0.0f;
    for (size_t k = 0; k < rows * H; ++k) worst = std::max(worst, std::abs(r.hidden[k] - hf_hidden_[j][k]));
    EXPECT_LT(worst, 2e-4f) << what << ": the largest difference from Hugging Face over " << rows << " rows";
  };
  for (int32_t tp : {1, 2}) {
    auto e = make(256, /*page_size=*/8, /*chunk=*/48, /*radix=*/true, tp);
    const std::string t = " tp " + std::to_string(tp);
    auto warm = submit(*e, "warm", prompts_[4], 2);
    wait(warm);
    auto a = submit(*e, "a", prompts_[4], 6, hs);  // cached, computed again in chunks of 48
    auto b = submit(*e, "b", prompts_[3], 5);
    auto c = submit(*e, "c", prompts_[1], 1, hs);  // the prompt's rows only
    auto z = submit(*e, "z", prompts_[3], 0, hs);  // nothing generated: the prompt's rows still (an embedding)
    auto d = submit(*e, "d", prompts_[2], static_cast<int32_t>(greedy_[2].size()), hs);
    const Result ra = wait(a), rb = wait(b), rc = wait(c), rd = wait(d), rz = wait(z);
    ASSERT_TRUE(rz.tokens.empty()) << t;
    ASSERT_EQ(rz.hidden.size(), prompts_[3].size() * static_cast<size_t>(hidden_size_)) << t;
    for (size_t k = 0; k < rz.hidden.size(); ++k) ASSERT_NEAR(rz.hidden[k], hf_hidden_[3][k], 2e-4f) << t << " " << k;
    check(ra, 4, "a" + t);
    EXPECT_EQ(ra.cached, 0) << t;
    EXPECT_TRUE(rb.hidden.empty()) << t;
    expect_prefix(rb.tokens, 3);
    check(rc, 1, "c" + t);
    check(rd, 2, "d" + t);
    expect_no_leak(*e);
  }
  // Decode steps replaying graphs (CPU graphs; each DP group pads to the graph's size): the rows of their real tokens.
  for (const auto& [tp, dp] : {std::pair{1, 1}, std::pair{2, 2}}) {
    auto ranks = test::cpu_ranks("v2", tp, dp, /*graph_max_bs=*/8);
    const RankSet* rs = ranks.get();
    Engine e(std::move(ranks), test::small_engine_options(GetParam(), 1024));
    std::vector<std::future<Result>> fs;
    for (size_t j : {1, 2, 3}) fs.push_back(submit(e, fmt::format("g{}", j), prompts_[j], 12, hs));
    for (size_t j : {1, 2, 3}) check(wait(fs[j - 1]), j, fmt::format("graphs tp {} dp {} prompt {}", tp, dp, j));
    EXPECT_GT(rs->graph_steps(), 0);
    expect_no_leak(e);
  }
  // `n` tokens for each request of `which` (the prompt `prompt` for all when given).
  auto run = [&](int32_t pages, int32_t chunk, int32_t drafts, const std::vector<int>& which,
                 const std::vector<int32_t>& prompt = {}, SamplingParams sp = {}, int32_t n = 64) {
    sp.return_hidden_states = true;
    auto e = make(pages, 8, chunk, true, 1, 1, {}, drafts);
    std::vector<std::future<Result>> fs;
    for (int j : which)
      fs.push_back(submit(*e, fmt::format("m{}", j), prompt.empty() ? prompts_[static_cast<size_t>(j)] : prompt, n,
                          sp));
    std::vector<Result> out;
    for (auto& f : fs) out.push_back(wait(f));
    const RankStats st = e->stats()[0];
    expect_no_leak(*e);
    return std::make_pair(out, st);
  };
  const auto roomy = run(1024, 8192, 0, {0, 1, 2, 3, 4}).first;
  for (size_t j = 0; j < 5; ++j) {
    ASSERT_EQ(roomy[j].tokens.size(), 64u);
    ASSERT_EQ(roomy[j].hidden.size(), (prompts_[j].size() + 63) * H) << j;
    Result first = roomy[j];  // as far as Hugging Face's rows go
    first.tokens.resize(std::min<size_t>(greedy_[j].size(), 24));
    first.hidden.resize((prompts_[j].size() + first.tokens.size() - 1) * H);
    check(first, j, fmt::format("64 tokens, prompt {}", j));
  }
  // Retraction (as RetractionUnderMemoryPressureKeepsOutputsExact): every row once, as without it.
  int64_t retractions = 0;
  for (int attempt = 0; attempt < 3 && retractions == 0; ++attempt) {
    const auto [tight, tight_stats] = run(50, 64, 0, {0, 1, 2, 3, 4});
    for (size_t j = 0; j < 5; ++j) {
      EXPECT_EQ(tight[j].tokens, roomy[j].tokens) << j;
      ASSERT_EQ(tight[j].hidden.size(), roomy[j].hidden.size()) << j;
      for (size_t k = 0; k < tight[j].hidden.size(); ++k)
        ASSERT_NEAR(tight[j].hidden[k], roomy[j].hidden[k], 1e-4f) << "request " << j << " row " << k / H;
    }
    retractions = tight_stats.num_retractions;
  }
  EXPECT_GT(retractions, 0);
  // N-gram drafts (as NgramSpeculativeDecodingKeepsTheOutputs: three allowed tokens make the output loop, so drafts
  // are kept): the kept drafts' rows come as one token a step gives them, also where a stop token ends a run of them.
  std::vector<int32_t> doubled = prompts_[3];
  doubled.insert(doubled.end(), prompts_[3].begin(), prompts_[3].begin() + 40);
  SamplingParams few;
  few.allowed_token_ids = {prompts_[3][0], prompts_[3][1], prompts_[3][2]};
  const Result one = run(1024, 8192, 0, {3}, doubled, few, 40).first[0];
  auto expect_rows = [&](const Result& got, size_t tokens, const std::string& what) {
    ASSERT_EQ(got.tokens, std::vector<int32_t>(one.tokens.begin(), one.tokens.begin() + static_cast<int64_t>(tokens)))
        << what;
    const size_t rows = doubled.size() + tokens - 1;
    ASSERT_EQ(got.hidden.size(), rows * H) << what;
    for (size_t k = 0; k < rows * H; ++k)  // (a draft-checking step against a decode step: within rounding)
      ASSERT_NEAR(got.hidden[k], one.hidden[k], 2e-3f) << what << " row " << k / H;
  };
  const auto [drafted, drafted_stats] = run(1024, 8192, 4, {3}, doubled, few, 40);
  EXPECT_GE(drafted_stats.spec_accepted_tokens, 10);
  expect_rows(drafted[0], 40, "drafts");
  SamplingParams stop = few;
  stop.stop_token_ids = {one.tokens[22]};
  size_t first_stop = 0;
  while (one.tokens[first_stop] != one.tokens[22]) ++first_stop;
  expect_rows(run(1024, 8192, 4, {3}, doubled, stop, 40).first[0], first_stop + 1, "a stop among drafts");
}

class OverlapIds : public EngineTest {};

TEST_F(OverlapIds, TakesIdsFromTheDeviceWithTheSameOutputs) {
  // Seeded sampling (each token's draw must keep its own step even when the previous token is still in flight),
  // a stop token (seen one step late, while the next step already runs) and a length limit, next to a greedy
  // request, and one asking for its top-3 logprobs (computed on the host from logits copied without waiting for them):
  // the same tokens and logprobs with overlap on and off. Then penalised requests (seeded, and greedy ones whose
  // penalties change their tokens): also launched early, the token in flight counted by the sampler on the device.
  SamplingParams seeded;
  seeded.temperature = 0.9f;
  seeded.top_k = 40;
  seeded.seed = 77;
  SamplingParams stop;
  stop.stop_token_ids = {greedy_[3][3]};
  auto run = [&](bool overlap, bool penalties) {
    EngineOptions o;
    o.page_size = 8;
    o.num_pages = 512;
    o.check_integrity = true;
    o.overlap = overlap;
    Engine eng(test::cpu_ranks("v2"), o);
    std::vector<std::future<Result>> fs;
    SamplingParams pen = seeded;
    pen.frequency_penalty = 0.7f;
    pen.repetition_penalty = 1.3f;
    SamplingParams pen_greedy;  // negative penalties favour the tokens already generated, the newest included
    pen_greedy.frequency_penalty = -1.0f;
    pen_greedy.presence_penalty = -1.0f;
    if (penalties) {
      fs.push_back(submit(eng, "pen", prompts_[2], 12, pen));
      fs.push_back(submit(eng, "pen_greedy", prompts_[1], 9, pen_greedy));
      fs.push_back(submit(eng, "pen_greedy_long", prompts_[3], 24, pen_greedy));
    } else {
      fs.push_back(submit(eng, "seeded", prompts_[2], 12, seeded));
      fs.push_back(submit(eng, "stop", prompts_[3], 20, stop));
      fs.push_back(submit(eng, "greedy", prompts_[1], 9));
      SamplingParams top;
      top.return_logprob = true;
      top.top_logprobs_num = 3;
      fs.push_back(submit(eng, "top", prompts_[4], 10, top));
    }
    std::vector<Result> out;
    for (auto& f : fs) out.push_back(wait(f));
    expect_no_leak(eng);
    return std::make_pair(out, eng.stats()[0].overlapped_steps);
  };
  const auto [off, off_steps] = run(false, false);
  const auto [on, on_steps] = run(true, false);
  ASSERT_EQ(on.size(), off.size());
  for (size_t i = 0; i < on.size(); ++i) {
    EXPECT_EQ(on[i].tokens, off[i].tokens) << "request " << i;
    EXPECT_EQ(on[i].finish.kind, off[i].finish.kind) << "request " << i;
  }
  ASSERT_EQ(on[3].logprobs.size(), 10u);
  ASSERT_EQ(off[3].logprobs.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(on[3].logprobs[i].token, on[3].tokens[i]);
    EXPECT_EQ(on[3].logprobs[i].logprob, off[3].logprobs[i].logprob) << "token " << i;
    ASSERT_EQ(on[3].logprobs[i].top.size(), 3u);
    EXPECT_EQ(on[3].logprobs[i].top, off[3].logprobs[i].top) << "token " << i;
    EXPECT_EQ(on[3].logprobs[i].top[0].first, on[3].tokens[i]) << "greedy: the best alternative is the token";
  }
  EXPECT_EQ(off[0].tokens.size(), 12u);
  EXPECT_EQ(on[1].finish.kind, FinishKind::Stop);
  EXPECT_EQ(on[1].tokens.back(), greedy_[3][3]);
  EXPECT_EQ(off_steps, 0);
  EXPECT_GT(on_steps, 8);
  const auto [pen_off, pen_off_steps] = run(false, true);
  const auto [pen_on, pen_on_steps] = run(true, true);
  ASSERT_EQ(pen_on.size(), 3u);
  for (size_t i = 0; i < pen_on.size(); ++i) EXPECT_EQ(pen_on[i].tokens, pen_off[i].tokens) << "penalised " << i;
  EXPECT_NE(pen_off[1].tokens, off[2].tokens) << "the penalties change the greedy tokens";
  EXPECT_EQ(pen_off_steps, 0);
  EXPECT_GT(pen_on_steps, 8);
}

INSTANTIATE_TEST_SUITE_P(Overlap, EngineTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "overlap" : "no_overlap"; });

}  // namespace
