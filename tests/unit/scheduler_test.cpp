// Table-driven scheduler tests: a real PagePool and RadixCache, no model. Each step we check what was
// scheduled and the state after it, and run the integrity checks.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "engine/scheduler.h"

using namespace mlaserve;

namespace {

struct Collected {
  std::vector<int32_t> tokens;
  bool finished = false;
  FinishReason finish;
  int32_t cached = -1;
  int calls = 0;
};

class SchedulerTest : public ::testing::Test {
 protected:
  void make(int32_t pages, int32_t chunk = 8, int32_t max_running = 64, bool radix = true) {
    SchedulerConfig c;
    c.page_size = 4;
    c.num_pages = pages;
    c.chunked_prefill_size = chunk;
    c.max_running_requests = max_running;
    c.context_len = 1000;
    c.enable_radix_cache = radix;
    c.eos_token_ids = {2};
    s = std::make_unique<Scheduler>(c);
  }
  void add(const std::string& rid, std::vector<int32_t> prompt, int32_t max_new, SamplingParams sp = {}) {
    GenerateRequest g;
    g.rid = rid;
    g.input_ids = std::move(prompt);
    sp.max_new_tokens = max_new;
    g.sampling = sp;
    g.on_output = [this, rid](const GenerateOutput& o) {
      auto& c = out[rid];
      c.tokens.insert(c.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
      c.finished = o.finished;
      c.finish = o.finish;
      c.cached = o.cached_tokens;
      ++c.calls;
    };
    s->add(std::move(g));
  }
  // One step: the fake model "samples" token = 100 + position of the sampled token (deterministic).
  StepPlan step(std::function<int32_t(const Req&)> next = nullptr) {
    StepPlan p = s->schedule();
    std::vector<SampleResult> sampled;
    for (auto& q : p.seqs)
      if (q.wants_logits) {
        SampleResult r;
        r.token = next ? next(*q.req) : 100 + static_cast<int32_t>(q.req->fill.size());
        sampled.push_back(r);
      }
    EXPECT_EQ(static_cast<int>(p.batch.logit_rows.size()), static_cast<int>(sampled.size()));
    s->commit(p, sampled);
    s->check_integrity();
    return p;
  }
  std::vector<int32_t> range(int32_t a, int32_t n) {
    std::vector<int32_t> v;
    for (int32_t i = 0; i < n; ++i) v.push_back(a + i);
    return v;
  }
  void expect_all_pages_back() {
    auto st = s->stats();
    EXPECT_EQ(st.kv_tokens_free + st.kv_tokens_cached, st.kv_tokens_total);
    EXPECT_TRUE(s->flush_cache());
    EXPECT_EQ(s->stats().kv_tokens_free, s->stats().kv_tokens_total);
  }

  std::unique_ptr<Scheduler> s;
  std::map<std::string, Collected> out;
};

TEST_F(SchedulerTest, ChunkedPrefillThenDecodeToLength) {
  make(16, /*chunk=*/8);
  add("a", range(10, 10), 3);
  // step: (tokens scheduled, mode, running, waiting, output tokens so far)
  struct Row { int tokens; ForwardMode mode; int running, waiting, emitted; };
  std::vector<Row> table{
      {8, ForwardMode::Extend, 1, 0, 0},  // first chunk, no logits
      {2, ForwardMode::Extend, 1, 0, 1},  // rest of the prompt -> first token
      {1, ForwardMode::Decode, 1, 0, 2},
      {1, ForwardMode::Decode, 0, 0, 3},  // max_new_tokens reached
  };
  for (size_t i = 0; i < table.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    StepPlan p = step();
    EXPECT_EQ(p.batch.num_tokens(), table[i].tokens);
    EXPECT_EQ(p.batch.mode, table[i].mode);
    EXPECT_EQ(s->num_running(), table[i].running);
    EXPECT_EQ(s->num_waiting(), table[i].waiting);
    EXPECT_EQ(static_cast<int>(out["a"].tokens.size()), table[i].emitted);
  }
  EXPECT_TRUE(out["a"].finished);
  EXPECT_EQ(out["a"].finish.kind, FinishKind::Length);
  EXPECT_EQ(out["a"].tokens, (std::vector<int32_t>{110, 111, 112}));
  EXPECT_FALSE(s->has_work());
  expect_all_pages_back();
}

TEST_F(SchedulerTest, MixedPrefillAndDecodeAndPrefixReuse) {
  make(32, /*chunk=*/16);
  add("a", range(10, 9), 4);
  step();  // a prefills (9 tokens)
  add("b", range(10, 9), 2);  // same prompt: 8 tokens (two pages) come from the cache once a finishes
  StepPlan p = step();        // a decodes, b prefills: a mixed batch; a's pages are not cached yet
  EXPECT_EQ(p.batch.mode, ForwardMode::Mixed);
  EXPECT_EQ(out["b"].cached, 0);
  while (s->has_work()) step();
  add("c", range(10, 9), 1);
  p = step();
  EXPECT_EQ(p.batch.num_tokens(), 1);  // only the last prompt token is computed
  EXPECT_EQ(p.batch.seq_prefix_lens[0], 8);
  EXPECT_EQ(out["c"].cached, 8);
  EXPECT_EQ(out["c"].tokens, (std::vector<int32_t>{109}));
  EXPECT_GT(s->stats().cached_prompt_tokens_total, 0);
  expect_all_pages_back();
}

TEST_F(SchedulerTest, StopTokensEosAndIgnoreEos) {
  make(32);
  SamplingParams sp;
  sp.stop_token_ids = {7};
  add("stop", range(10, 3), 10, sp);
  add("eos", range(20, 3), 10);
  SamplingParams ig;
  ig.ignore_eos = true;
  add("ignore", range(30, 3), 3, ig);
  auto next = [](const Req& r) {
    if (r.rid == "stop") return r.output.size() == 1 ? 7 : 5;
    return 2;  // eos
  };
  while (s->has_work()) step(next);
  EXPECT_EQ(out["stop"].finish.kind, FinishKind::Stop);
  EXPECT_EQ(out["stop"].finish.matched_token, 7);
  EXPECT_EQ(out["stop"].tokens, (std::vector<int32_t>{5, 7}));
  EXPECT_EQ(out["eos"].finish.kind, FinishKind::Stop);
  EXPECT_EQ(out["eos"].tokens.size(), 1u);
  EXPECT_EQ(out["ignore"].finish.kind, FinishKind::Length);
  EXPECT_EQ(out["ignore"].tokens.size(), 3u);
  expect_all_pages_back();
}

TEST_F(SchedulerTest, AdmissionWaitsAndDecodeRetractsWhenPagesRunOut) {
  // 8 pages of 4 = 32 token slots; three requests of 8 prompt + 12 new tokens cannot all fit.
  make(8, /*chunk=*/64);
  for (int i = 0; i < 3; ++i) add("r" + std::to_string(i), range(10 * i, 8), 12);
  int steps = 0;
  int max_waiting_while_running = 0;
  while (s->has_work() && steps < 500) {
    step();
    ++steps;
    if (s->num_running() > 0) max_waiting_while_running = std::max(max_waiting_while_running, s->num_waiting());
  }
  ASSERT_FALSE(s->has_work());
  EXPECT_GT(s->stats().num_retractions, 0);
  for (int i = 0; i < 3; ++i) {
    auto& c = out["r" + std::to_string(i)];
    EXPECT_TRUE(c.finished);
    EXPECT_EQ(c.finish.kind, FinishKind::Length);
    ASSERT_EQ(c.tokens.size(), 12u);
    // The fake model's token depends only on the position: recomputation after retraction must continue the
    // same sequence, with nothing lost or repeated.
    for (int32_t k = 0; k < 12; ++k) EXPECT_EQ(c.tokens[k], 108 + k);
  }
  expect_all_pages_back();
}

TEST_F(SchedulerTest, MaxRunningRequestsBoundsTheBatch) {
  make(64, 64, /*max_running=*/2);
  for (int i = 0; i < 5; ++i) add("r" + std::to_string(i), range(i, 3), 4);
  step();
  EXPECT_EQ(s->num_running(), 2);
  EXPECT_EQ(s->num_waiting(), 3);
  while (s->has_work()) {
    step();
    EXPECT_LE(s->num_running(), 2);
  }
  for (int i = 0; i < 5; ++i) EXPECT_EQ(out["r" + std::to_string(i)].tokens.size(), 4u);
  expect_all_pages_back();
}

TEST_F(SchedulerTest, AbortFreesPagesAtOnce) {
  make(16, 64);
  add("run", range(0, 9), 50);
  add("wait", range(50, 9), 50);
  step();
  step();
  FinishReason f;
  f.kind = FinishKind::Abort;
  f.message = "client disconnected";
  EXPECT_TRUE(s->abort("run", f));
  EXPECT_TRUE(s->abort("wait", f));
  EXPECT_FALSE(s->abort("nobody", f));
  s->check_integrity();
  EXPECT_EQ(out["run"].finish.kind, FinishKind::Abort);
  EXPECT_TRUE(out["wait"].finished);
  EXPECT_FALSE(s->has_work());
  expect_all_pages_back();
}

TEST_F(SchedulerTest, RejectsRequestsThatCanNeverRun) {
  make(4);  // 16 token slots
  GenerateRequest g;
  g.rid = "x";
  EXPECT_THROW(s->validate(g), Error);  // empty
  g.input_ids = range(0, 20);
  try {
    s->validate(g);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KV cache holds only 16 tokens"), std::string::npos);
  }
  g.input_ids = range(0, 3);
  g.sampling.top_p = 0.0f;
  EXPECT_THROW(s->validate(g), Error);
  g.sampling = {};
  g.sampling.temperature = -1;
  EXPECT_THROW(s->validate(g), Error);
  make(1000);
  g.sampling = {};
  g.input_ids = range(0, 1000);
  try {
    s->validate(g);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context length is 1000"), std::string::npos);
  }
}

TEST_F(SchedulerTest, NoRadixCacheMeansNoReuse) {
  make(32, 64, 64, /*radix=*/false);
  add("a", range(10, 9), 2);
  while (s->has_work()) step();
  add("b", range(10, 9), 2);
  step();
  EXPECT_EQ(out["b"].cached, 0);
  while (s->has_work()) step();
  EXPECT_EQ(s->stats().kv_tokens_free, s->stats().kv_tokens_total);
}

}  // namespace
