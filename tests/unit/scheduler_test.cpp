// Table-driven scheduler tests: a real PagePool and RadixCache, no model. Each step we check what was
// scheduled and the state after it, and run the integrity checks.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <random>

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
  std::vector<TokenLogprob> prompt_lps;
  int prompt_lp_outputs = 0;  // outputs that brought prompt logprobs
};

class SchedulerTest : public ::testing::Test {
 protected:
  void make(int32_t pages, int32_t chunk = 8, int32_t max_running = 64, bool radix = true, bool priority = false,
            int32_t drafts = 0, int32_t draft_max_batch = 0, int32_t preemption_threshold = -1) {
    SchedulerConfig c;
    c.priority_preemption = preemption_threshold >= 0;
    c.priority_preemption_threshold = std::max(preemption_threshold, 0);
    c.spec_draft_tokens = drafts;
    c.spec_max_batch = draft_max_batch;
    c.priority_scheduling = priority;
    c.page_size = 4;
    c.num_pages = pages;
    c.chunked_prefill_size = chunk;
    c.max_running_requests = max_running;
    c.context_len = 1000;
    c.enable_radix_cache = radix;
    c.eos_token_ids = {2};
    c.host_pages = host_pages_;
    c.longest_prefix_first = lpm_;
    s = std::make_unique<Scheduler>(c);
  }
  void add(const std::string& rid, std::vector<int32_t> prompt, int32_t max_new, SamplingParams sp = {},
           int32_t priority = 0) {
    GenerateRequest g;
    g.rid = rid;
    g.priority = priority;
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
      if (!o.prompt_logprobs.empty()) ++c.prompt_lp_outputs;
      c.prompt_lps.insert(c.prompt_lps.end(), o.prompt_logprobs.begin(), o.prompt_logprobs.end());
    };
    s->add(std::move(g));
  }
  // One step: the fake model "samples" token = 100 + position of the sampled token (deterministic); a prompt-logprob
  // row says which prompt token it is for: logprob -(its position), token the prompt's there.
  StepPlan step(std::function<int32_t(const Req&)> next = nullptr) {
    StepPlan p = s->schedule();
    std::vector<SampleResult> sampled;
    for (auto& q : p.seqs) {
      for (int32_t k = 0; k < q.lp_rows; ++k) {
        const int32_t pos = q.lp_first_pos + k + 1;
        SampleResult r;
        r.logprob.token = q.req->prompt[static_cast<size_t>(pos)];
        r.logprob.logprob = -static_cast<float>(pos);
        sampled.push_back(r);
      }
      if (q.wants_logits) {
        SampleResult r;
        r.token = next ? next(*q.req) : 100 + static_cast<int32_t>(q.req->fill.size());
        sampled.push_back(r);
      }
    }
    EXPECT_EQ(static_cast<int>(p.batch.logit_rows.size()), static_cast<int>(sampled.size()));
    s->commit(p, sampled);
    s->check_integrity();
    return p;
  }
  // The draws of a plan's sampled rows under `model` (token, position) -> next token; an input read on the device
  // (-(k + 1): the sample of row k of the step before) takes its token from `prev`.
  std::vector<SampleResult> model_samples(const StepPlan& p, const std::function<int32_t(int32_t, int32_t)>& model,
                                          const std::vector<SampleResult>* prev = nullptr) {
    std::vector<SampleResult> sampled;
    for (size_t i = 0; i < p.seqs.size(); ++i) {
      const int32_t first = p.batch.seq_q_start[i], n = p.batch.seq_q_start[i + 1] - first;
      for (int32_t row = n - p.seqs[i].sampled_rows(); row < n; ++row) {
        int32_t in = p.batch.input_ids[static_cast<size_t>(first + row)];
        if (in < 0) {
          EXPECT_TRUE(prev != nullptr);
          if (!prev) return sampled;
          in = (*prev)[static_cast<size_t>(-(in + 1))].token;
        }
        SampleResult r;
        r.token = model(in, p.batch.positions[static_cast<size_t>(first + row)]);
        sampled.push_back(r);
      }
    }
    return sampled;
  }
  // Drafts of 3, and request "a" of the cycle prompt 5 6 7 5 6 7 5 6 (40 tokens). The model it returns: agree, it
  // continues the cycle 5 -> 6 -> 7 -> 5, as the drafts do; else after every 5 it says a token never seen (100 + the
  // position), after anything else 5: each draft after a 5 (what followed the last 5) is wrong.
  std::function<int32_t(int32_t, int32_t)> start_cycle(bool agree) {
    make(64, /*chunk=*/64, 64, /*radix=*/true, false, /*drafts=*/3);
    out.clear();
    add("a", {5, 6, 7, 5, 6, 7, 5, 6}, 40);
    return [agree](int32_t t, int32_t pos) { return agree ? (t == 7 ? 5 : t + 1) : (t == 5 ? 100 + pos : 5); };
  }
  // Steps until no work is left (at most 500): the requests' ids in the order they finished.
  std::vector<std::string> run_to_end() {
    std::vector<std::string> finished;
    for (int steps = 0; s->has_work() && steps < 500; ++steps) {
      step();
      for (auto& [rid, c] : out)
        if (c.finished && std::find(finished.begin(), finished.end(), rid) == finished.end()) finished.push_back(rid);
    }
    return finished;
  }
  std::vector<int32_t> range(int32_t a, int32_t n) {
    std::vector<int32_t> v;
    for (int32_t i = 0; i < n; ++i) v.push_back(a + i);
    return v;
  }
  // The cycle prompt's request "a" (its last prompt token 6, at position 7) finished with 40 tokens, each the model's
  // next token after the one before it.
  void expect_model_output(const std::function<int32_t(int32_t, int32_t)>& model) {
    const Collected& c = out["a"];
    ASSERT_TRUE(c.finished);
    ASSERT_EQ(c.tokens.size(), 40u);
    int32_t t = 6;
    for (size_t i = 0; i < c.tokens.size(); ++i) {
      t = model(t, 7 + static_cast<int32_t>(i));
      ASSERT_EQ(c.tokens[i], t) << i;
    }
  }
  void expect_all_pages_back() {
    auto st = s->stats();
    EXPECT_EQ(st.kv_tokens_free + st.kv_tokens_cached, st.kv_tokens_total);
    EXPECT_TRUE(s->flush_cache());
    EXPECT_EQ(s->stats().kv_tokens_free, s->stats().kv_tokens_total);
  }

  std::unique_ptr<Scheduler> s;
  std::map<std::string, Collected> out;
  int32_t host_pages_ = 0;  // make(): the prefix cache's host tier
  bool lpm_ = false;        // make(): SchedulerConfig::longest_prefix_first
};

// Drafts checked in one step: each row's sample is the model's next token after that row's input; the drafts the
// samples agree with are kept with the sample after them, the rest roll back (kv length, pages). A request whose drafts
// are never kept backs off (1, 2, 4, ... decode steps without drafts, up to kMaxDraftBackoff).
TEST_F(SchedulerTest, DraftsAreKeptOrRolledBackAndBackOff) {
  for (const bool agree : {true, false}) {
    const auto model = start_cycle(agree);
    std::vector<int> draft_steps;
    int steps = 0;
    for (; steps < 100 && !out["a"].finished; ++steps) {
      StepPlan p = s->schedule();
      for (auto& q : p.seqs) {
        ASSERT_TRUE(q.wants_logits);
        const auto& b = p.batch;
        const int32_t n = b.seq_q_start[1] - b.seq_q_start[0];
        EXPECT_EQ(q.sampled_rows(), q.prefill ? 1 : n);
        if (!q.drafts.empty()) draft_steps.push_back(steps);
        EXPECT_EQ(b.seq_absorbed.empty(), q.drafts.empty());
      }
      const std::vector<SampleResult> sampled = model_samples(p, model);
      ASSERT_EQ(p.batch.logit_rows.size(), sampled.size());
      s->commit(p, sampled);
      s->check_integrity();
    }
    expect_model_output(model);
    const RankStats st = s->stats();
    if (agree) {
      // Every check keeps its 3 drafts: 4 tokens a step after the prompt's (the length limit cuts the last).
      EXPECT_EQ(st.spec_accepted_tokens, st.spec_draft_tokens);
      EXPECT_EQ(steps, 1 + 10);
      EXPECT_EQ(draft_steps.size(), 10u);
    } else {
      EXPECT_EQ(st.spec_accepted_tokens, 0);
      EXPECT_EQ(steps, 1 + 39);
      // Each check that keeps nothing doubles the wait before the next one.
      ASSERT_GE(draft_steps.size(), 3u);
      for (size_t i = 1; i < draft_steps.size(); ++i)
        EXPECT_GT(draft_steps[i] - draft_steps[i - 1], std::min(1 << (i - 1), kMaxDraftBackoff)) << i;
      EXPECT_LE(draft_steps.size(), 6u);
    }
    expect_all_pages_back();
  }
}

// Overlap scheduling with drafts: each step is planned while the one before it runs (as Engine::overlap_step does),
// so a request's decode token is usually in flight when its next step is planned. It drafts anyway: the match ends at
// the token before the one in flight, its next token guesses that one, and the drafts follow the guess; the step's
// input is the real token (read on the device), so its draws check the drafts as usual. When the model continues the
// prompt's cycle the guesses are right and most drafts are kept; when it says a token never seen after every 5, the
// guesses after a 5 are wrong. Either way the output is the model's, and a step after one checking drafts waits.
TEST_F(SchedulerTest, DraftsFollowAGuessOfTheTokenInFlight) {
  for (const bool agree : {true, false}) {
    const auto model = start_cycle(agree);
    // A launched step: its plan and its samples (known on the "device" at once; the scheduler sees them at resolve).
    struct Launched {
      StepPlan plan;
      std::vector<SampleResult> sampled;
    };
    std::optional<Launched> running;
    int steps = 0, guessed = 0, overlapped = 0, after_check = 0;
    for (; steps < 100 && !out["a"].finished; ++steps) {
      StepPlan next = s->schedule(/*allow_retract=*/!running);
      for (const ScheduledSeq& q : next.seqs) guessed += !q.drafts.empty() && next.batch.input_ids[0] < 0;
      if (running && !next.empty()) {  // launched behind the running step, which then resolves
        ++overlapped;
        s->advance(next);
        Launched l{std::move(next), {}};
        l.sampled = model_samples(l.plan, model, &running->sampled);
        s->resolve(running->plan, running->sampled);
        running = std::move(l);
      } else {
        if (running) {
          after_check += !running->plan.seqs.empty() && !running->plan.seqs[0].drafts.empty();
          s->resolve(running->plan, running->sampled);
          s->refresh(next);
          running.reset();
        }
        if (next.empty()) next = s->schedule();
        if (next.empty()) continue;
        s->advance(next);
        Launched l{std::move(next), {}};
        l.sampled = model_samples(l.plan, model);
        running = std::move(l);
      }
      s->erase_finished();
      s->check_integrity();
    }
    if (running) {
      s->resolve(running->plan, running->sampled);
      s->erase_finished();
    }
    expect_model_output(model);
    const RankStats st = s->stats();
    EXPECT_GT(guessed, 0);
    EXPECT_GT(overlapped, 0);
    EXPECT_GT(after_check, 0) << "a step after a check waited for it";
    if (agree) {
      EXPECT_GE(st.spec_accepted_tokens, 25) << "right guesses: drafts kept";
    }
    expect_all_pages_back();
  }
}

// spec_max_batch (vLLM's disable_by_batch_size): no drafts while more requests than that decode.
TEST_F(SchedulerTest, NoDraftsPastTheBatchLimit) {
  make(64, /*chunk=*/64, 64, true, false, /*drafts=*/3, /*draft_max_batch=*/1);
  add("a", {5, 6, 7, 5, 6, 7, 5, 6}, 6);
  add("b", {5, 6, 7, 5, 6, 7, 5, 6}, 30);
  auto model = [](int32_t t) { return t == 7 ? 5 : t + 1; };  // continues the prompt's cycle: drafts are kept
  int drafting_steps = 0, steps = 0;
  for (; steps < 100 && !out["b"].finished; ++steps) {
    StepPlan p = s->schedule();
    std::vector<SampleResult> sampled;
    int decoding = 0;
    bool drafted = false;
    for (auto& q : p.seqs) {
      decoding += !q.prefill;
      drafted |= !q.drafts.empty();
      const int32_t at = static_cast<int32_t>(&q - p.seqs.data());
      const int32_t first = p.batch.seq_q_start[at], n = p.batch.seq_q_start[at + 1] - first;
      for (int32_t row = n - q.sampled_rows(); row < n; ++row) {
        SampleResult r;
        r.token = model(p.batch.input_ids[static_cast<size_t>(first + row)]);
        sampled.push_back(r);
      }
    }
    if (drafted) {
      ++drafting_steps;
      EXPECT_LE(decoding, 1) << "step " << steps;
    }
    s->commit(p, sampled);
    s->check_integrity();
  }
  ASSERT_TRUE(out["a"].finished && out["b"].finished);
  EXPECT_EQ(out["a"].tokens.size(), 6u);
  EXPECT_EQ(out["b"].tokens.size(), 30u);
  EXPECT_GT(drafting_steps, 3);  // b alone after a ended
  EXPECT_EQ(s->stats().spec_accepted_tokens, s->stats().spec_draft_tokens);
  expect_all_pages_back();
}

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

// Rows from elsewhere (prefill / decode disaggregation): the prompt's whole pages not cached yet are taken and
// written, then served from the cache; when the pool cannot give them all, the rows' first pages (what it has).
TEST_F(SchedulerTest, ImportedPrefixesAreCachedAsFarAsPagesGo) {
  make(12, /*chunk=*/16);
  std::vector<std::pair<size_t, int32_t>> writes;  // (pages, first token) of each write
  auto write = [&](std::span<const int32_t> pages, int32_t first) { writes.emplace_back(pages.size(), first); };
  EXPECT_EQ(s->import_prefix(range(10, 11), "", write), 8);  // two whole pages of 11 tokens
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0], (std::pair<size_t, int32_t>{2, 0}));
  EXPECT_EQ(s->import_prefix(range(10, 16), "", write), 16);  // the first two cached: the other two written
  ASSERT_EQ(writes.size(), 2u);
  EXPECT_EQ(writes[1], (std::pair<size_t, int32_t>{2, 8}));
  // Rows from token 20 on need [0, 20) cached: 16 are, so nothing is written.
  EXPECT_EQ(s->import_prefix(range(10, 32), "", write, /*from=*/20), 16);
  EXPECT_EQ(writes.size(), 2u);
  add("a", range(10, 17), 1);
  step();
  EXPECT_EQ(out["a"].cached, 16);  // only the 17th token computed
  // A running request holds four pages (13 tokens): of 40 tokens' ten pages, the pool has the other eight (the cached
  // ones evicted).
  add("b", range(200, 13), 2);
  step();
  writes.clear();
  EXPECT_EQ(s->import_prefix(range(500, 40), "", write), 32);
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0], (std::pair<size_t, int32_t>{8, 0}));
  while (s->has_work()) step();
  add("c", range(500, 40), 1);
  while (s->has_work()) step();
  EXPECT_EQ(out["c"].cached, 32);
  expect_all_pages_back();
}

TEST_F(SchedulerTest, MixedPrefillAndDecodeAndPrefixReuse) {
  make(32, /*chunk=*/16);
  add("a", range(10, 9), 4);
  step();  // a prefills (9 tokens)
  add("b", range(10, 9), 2);  // same prompt: its 8 tokens of whole pages were cached when a's prefill ran
  StepPlan p = step();        // a decodes, b computes only its last prompt token
  EXPECT_EQ(p.batch.num_tokens(), 2);
  EXPECT_EQ(out["b"].cached, 8);
  add("d", range(50, 9), 1);  // another prompt with a decode: a mixed batch
  p = step();
  EXPECT_EQ(p.batch.mode, ForwardMode::Mixed);
  EXPECT_EQ(out["d"].cached, 0);
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

// A prompt's whole pages are cached as its prefill chunks run: a request with the same prompt admitted after a
// chunk reuses what is done so far; two admitted in the same step both compute it, and the second one's pages give
// way to the first one's (its duplicates go back to the pool) with the same tokens out.
TEST_F(SchedulerTest, PrefillChunksAreCachedAsTheyRun) {
  make(64, /*chunk=*/8);
  add("a", range(100, 30), 3);
  step();  // a's first chunk: tokens 0-7 (two pages)
  add("b", range(100, 30), 3);
  step();  // a's second chunk; b waits behind the open chunk
  while (out["b"].cached < 0 && s->has_work()) step();
  EXPECT_GE(out["b"].cached, 8);  // at least the chunks done when b was admitted
  while (s->has_work()) step();
  EXPECT_EQ(out["a"].tokens, out["b"].tokens);

  out.clear();
  make(64, /*chunk=*/64);
  add("x", range(300, 13), 2);
  add("y", range(300, 13), 2);
  step();  // both prefill all 13 tokens in one step: y's 3 whole pages duplicate x's
  EXPECT_EQ(out["y"].cached, 0);
  while (s->has_work()) step();
  EXPECT_EQ(out["x"].tokens, out["y"].tokens);
  add("z", range(300, 13), 1);
  step();
  EXPECT_EQ(out["z"].cached, 12);
  expect_all_pages_back();
}

// A burst of prompts with one long start (a system prompt) computes it once: a waiting request sharing at least
// kShareDefer uncached tokens with one in prefill waits a step and finds them cached, while the requests after it
// (another start, another cache salt) are admitted at once.
TEST_F(SchedulerTest, ABurstWithOneSystemPromptComputesItOnce) {
  make(256, /*chunk=*/256);
  const std::vector<int32_t> sys = range(1000, Scheduler::kShareDefer + 32);  // 64 tokens, 16 pages
  auto with = [&](int32_t from) {
    std::vector<int32_t> p = sys;
    for (int32_t t : range(from, 8)) p.push_back(t);
    return p;
  };
  add("x", with(2000), 2);
  add("y", with(3000), 2);
  add("z", range(5000, 20), 2);
  GenerateRequest salted;  // the same start under another cache salt: nothing to share
  salted.rid = "w";
  salted.input_ids = with(4000);
  salted.cache_salt = "tenant";
  salted.sampling.max_new_tokens = 2;
  salted.on_output = [this](const GenerateOutput& o) {
    out["w"].cached = o.cached_tokens;
    out["w"].finished = o.finished;
  };
  s->add(std::move(salted));
  StepPlan p = step();  // x, z and w; y waits
  EXPECT_EQ(p.batch.num_tokens(), 72 + 20 + 72);
  EXPECT_EQ(out["y"].cached, -1);
  EXPECT_EQ(out["w"].cached, 0);
  step();
  EXPECT_EQ(out["y"].cached, 64);  // the start, cached by x's prefill
  while (s->has_work()) step();
  EXPECT_EQ(out["x"].tokens, out["y"].tokens);
  EXPECT_TRUE(out["w"].finished);
  expect_all_pages_back();

  // What a running request has cached already is no reason to wait, even for a request that cannot use it (prompt
  // logprobs from position 0 compute the whole prompt): it is admitted while the first still decodes.
  out.clear();
  add("long", with(6000), 30);
  step();
  step();  // long decodes, its prompt cached
  SamplingParams from0;
  from0.logprob_start_len = 0;
  add("lp", with(6000), 2, from0);
  p = step();
  EXPECT_EQ(out["lp"].cached, 0);
  EXPECT_EQ(p.batch.num_tokens(), 1 + 72);
  EXPECT_FALSE(out["long"].finished);
  while (s->has_work()) step();
  expect_all_pages_back();
}

// SGLang's lpm: the waiting request with the longest cached prefix is tried first (fcfs: in arrival order). The step's
// budget (16 tokens) takes x's whole prompt under fcfs, so y waits; under lpm y (16 of its 24 tokens cached) goes
// first and x gets what is left.
TEST_F(SchedulerTest, LongestPrefixFirstOrdersTheWaitingQueue) {
  for (bool lpm : {false, true}) {
    SCOPED_TRACE(lpm ? "lpm" : "fcfs");
    lpm_ = lpm;
    make(64, /*chunk=*/16);
    out.clear();
    add("a", range(100, 20), 1);
    while (s->has_work()) step();
    std::vector<int32_t> y = range(100, 20);
    for (int32_t t : range(700, 4)) y.push_back(t);
    add("x", range(500, 16), 2);
    add("y", y, 2);
    const StepPlan p = step();
    EXPECT_EQ(p.batch.num_tokens(), 16);
    if (lpm) {
      ASSERT_EQ(p.seqs.size(), 2u);
      EXPECT_EQ(p.seqs[0].req->rid, "y");
      EXPECT_EQ(out["y"].cached, 20);  // (a's prompt and output: 21 tokens, 5 whole pages)
      EXPECT_EQ(p.seqs[1].num_tokens, 12);  // x: a chunk of what was left
    } else {
      ASSERT_EQ(p.seqs.size(), 1u);
      EXPECT_EQ(p.seqs[0].req->rid, "x");
      EXPECT_EQ(out["y"].cached, -1);  // still waiting
    }
    while (s->has_work()) step();
    EXPECT_TRUE(out["x"].finished && out["y"].finished);
    expect_all_pages_back();
  }
  lpm_ = false;
}

// Random arrivals of prompts with a few shared starts, small pools (retractions), small chunks and batch limits, fcfs
// or lpm: every request finishes with all its tokens, no request waits for ever on one computing a start they share,
// the integrity checks hold at every step, and every page comes back.
TEST_F(SchedulerTest, RandomArrivalsWithSharedStartsAllFinish) {
  for (uint32_t seed = 0; seed < 24; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    const auto pick = [&](int32_t lo, int32_t hi) { return lo + static_cast<int32_t>(rng() % (hi - lo + 1)); };
    lpm_ = seed % 2 == 1;
    make(pick(32, 96), /*chunk=*/pick(16, 160), /*max_running=*/pick(2, 8));
    out.clear();
    std::vector<std::vector<int32_t>> starts;
    for (int k = 0; k < 3; ++k) starts.push_back(range(1000 * (k + 1), pick(20, 60)));
    std::map<std::string, int32_t> want;  // rid -> max_new
    int added = 0, steps = 0;
    while ((added < 30 || s->has_work()) && steps < 3000) {
      for (int n = pick(0, 3); n > 0 && added < 30; --n, ++added) {
        std::vector<int32_t> prompt = starts[static_cast<size_t>(pick(0, 2))];
        for (int32_t t : range(5000 + 100 * added, pick(0, 10))) prompt.push_back(t);
        const std::string rid = "r" + std::to_string(added);
        want[rid] = pick(1, 6);
        add(rid, prompt, want[rid]);
      }
      if (s->has_work()) step();
      ++steps;
    }
    for (const auto& [rid, n] : want) {
      EXPECT_TRUE(out[rid].finished) << rid;
      EXPECT_EQ(static_cast<int32_t>(out[rid].tokens.size()), n) << rid;
    }
    expect_all_pages_back();
  }
  lpm_ = false;
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
  for (int i = 0; i < 5; ++i) add(fmt::format("r{}", i), range(i, 3), 4);
  step();
  EXPECT_EQ(s->num_running(), 2);
  EXPECT_EQ(s->num_waiting(), 3);
  while (s->has_work()) {
    step();
    EXPECT_LE(s->num_running(), 2);
  }
  for (int i = 0; i < 5; ++i) EXPECT_EQ(out[fmt::format("r{}", i)].tokens.size(), 4u);
  expect_all_pages_back();
}

// Priority scheduling: waiting requests are admitted by (priority, arrival), lower values first; without it a
// non-zero priority is refused and the queue is first come, first served.
TEST_F(SchedulerTest, PriorityOrdersTheWaitingQueue) {
  for (bool priority : {true, false}) {
    out.clear();
    make(64, 64, /*max_running=*/1, true, priority);
    add("first", range(0, 3), 2);
    step();  // running: the rest wait behind it
    const std::vector<std::pair<std::string, int32_t>> later{{"low", 5}, {"high", -3}, {"mid", 0}, {"high2", -3}};
    for (const auto& [rid, prio] : later) {
      if (priority) {
        add(rid, range(10, 3), 2, {}, prio);
      } else {
        if (prio != 0) {
          EXPECT_THROW(add(rid + "!", range(10, 3), 2, {}, prio), Error);
        }
        add(rid, range(10, 3), 2);
      }
    }
    std::vector<std::string> order;  // by first token
    while (s->has_work()) {
      step();
      for (auto& [rid, c] : out)
        if (!c.tokens.empty() && std::find(order.begin(), order.end(), rid) == order.end()) order.push_back(rid);
    }
    const std::vector<std::string> want = priority ? std::vector<std::string>{"first", "high", "high2", "mid", "low"}
                                                   : std::vector<std::string>{"first", "low", "high", "mid", "high2"};
    EXPECT_EQ(order, want) << (priority ? "priority" : "fcfs");
    expect_all_pages_back();
  }
}

// When decode runs out of pages, priority scheduling retracts the lowest priority (largest value) first, not the
// newest request: the high-priority request added last then finishes first.
TEST_F(SchedulerTest, PriorityRetractsTheLowestFirst) {
  for (bool priority : {true, false}) {
    out.clear();
    make(8, /*chunk=*/64, 64, true, priority);  // 32 token slots; two requests of 8 + 12 tokens need 40
    add("low", range(0, 8), 12, {}, priority ? 9 : 0);
    add("high", range(20, 8), 12, {}, priority ? 1 : 0);
    const std::vector<std::string> finished = run_to_end();
    EXPECT_GT(s->stats().num_retractions, 0);
    const std::vector<std::string> want = priority ? std::vector<std::string>{"high", "low"}
                                                   : std::vector<std::string>{"low", "high"};
    EXPECT_EQ(finished, want);
    for (const char* rid : {"low", "high"}) EXPECT_EQ(out[rid].tokens.size(), 12u) << rid;
    expect_all_pages_back();
  }
}

// Priority preemption (SGLang's): a waiting request that does not fit retracts running requests whose priority value
// exceeds its own by more than the threshold, the lowest first (the same priority: the later one), and runs at once;
// the retracted ones resume later (their prompts and outputs computed again) and end with the outputs they would have
// had. A smaller difference, or preemption off, leaves it waiting. Two limits: pages (44 token slots: the two running
// requests grow to 40, so the third's 12-token prompt fits only once they end) and max_running_requests (1).
TEST_F(SchedulerTest, PriorityPreemptionRetractsFarLowerRequests) {
  struct Case {
    int32_t pages, max_running, low_priority, threshold;
    bool preempts;
  };
  for (const Case c : {Case{11, 64, 20, 10, true}, Case{11, 64, 10, 10, false}, Case{11, 64, 20, -1, false},
                       Case{64, 1, 20, 10, true}, Case{64, 1, 5, 10, false}}) {
    out.clear();
    make(c.pages, /*chunk=*/64, c.max_running, true, /*priority=*/true, 0, 0, c.threshold);
    add("low", range(0, 12), 8, {}, c.low_priority);
    add("mid", range(40, 12), 8, {}, c.low_priority);
    for (int i = 0; i < 3; ++i) step();  // both running (or "low" alone with max_running 1), a few tokens out
    add("high", range(20, 12), 4, {}, 0);
    const std::vector<std::string> finished = run_to_end();
    const std::string what = fmt::format("pages {} max_running {} low {} threshold {}", c.pages, c.max_running,
                                         c.low_priority, c.threshold);
    ASSERT_EQ(finished.size(), 3u) << what;
    if (c.preempts) {
      EXPECT_EQ(finished[0], "high") << what;
      EXPECT_GT(s->stats().num_retractions, 0) << what;
    } else {
      EXPECT_NE(finished[0], "high") << what;
      EXPECT_EQ(s->stats().num_retractions, 0) << what;
    }
    // Each output is what the fake model says for its positions, retracted or not.
    for (const auto& [rid, n] : {std::pair{"low", 8}, std::pair{"mid", 8}, std::pair{"high", 4}}) {
      ASSERT_EQ(out[rid].tokens.size(), static_cast<size_t>(n)) << rid << " " << what;
      for (int i = 0; i < n; ++i) EXPECT_EQ(out[rid].tokens[static_cast<size_t>(i)], 100 + 12 + i) << rid << " " << i;
    }
    expect_all_pages_back();
  }
}

// Priority preemption counts only the pages a retraction would free: a far-lower request whose prompt shares its
// cached prefix with a request that stays frees only its own pages (and its page of decode headroom), so it is
// retracted only when that makes room: the head then runs in the same step; otherwise nothing is retracted for it
// (with 10-12 pages the old count, every page the victim held, retracted it and the head still did not fit).
TEST_F(SchedulerTest, PriorityPreemptionCountsOnlyThePagesARetractionFrees) {
  for (int32_t pages = 10; pages <= 16; ++pages) {
    out.clear();
    make(pages, /*chunk=*/64, 64, true, /*priority=*/true, 0, 0, /*preemption_threshold=*/10);
    std::vector<int32_t> shared = range(0, 24);  // 6 whole pages
    auto with = [&](int32_t tail) {
      std::vector<int32_t> p = shared;
      for (int32_t i = 0; i < 4; ++i) p.push_back(tail + i);
      return p;
    };
    add("keep", with(50), 8, {}, 0);
    step();  // its prompt's whole pages enter the cache
    add("low", with(60), 8, {}, 50);  // reuses them
    for (int i = 0; i < 3; ++i) step();
    add("high", range(200, 16), 4, {}, 0);
    const int64_t before = s->stats().num_retractions;
    const StepPlan p = step();
    bool ran = false;
    for (const ScheduledSeq& q : p.seqs) ran |= q.req->rid == "high";
    const int64_t retracted = s->stats().num_retractions - before;
    EXPECT_TRUE(retracted == 0 || ran) << pages << " pages: retracted without making room";
    if (pages == 12) {
      EXPECT_EQ(retracted, 0) << "the shared prefix counted as freed";
    }
    if (pages == 14) {
      EXPECT_TRUE(ran && retracted == 1) << "preempted";
    }
    for (int steps = 0; s->has_work() && steps < 500; ++steps) step();
    for (const auto& [rid, n] : {std::pair{"keep", 8}, std::pair{"low", 8}, std::pair{"high", 4}}) {
      EXPECT_TRUE(out[rid].finished) << rid << " " << pages;
      EXPECT_EQ(out[rid].tokens.size(), static_cast<size_t>(n)) << rid << " " << pages;
    }
    expect_all_pages_back();
  }
}

// With a step in flight (overlap scheduling plans without retracting) a wanted preemption blocks the plan; planned
// again with retraction allowed it retracts, and nothing is retracted while the head fits.
TEST_F(SchedulerTest, PriorityPreemptionWaitsForTheStepInFlight) {
  make(11, /*chunk=*/64, 64, true, /*priority=*/true, 0, 0, /*preemption_threshold=*/10);
  add("low", range(0, 12), 8, {}, 50);
  add("mid", range(40, 12), 8, {}, 50);
  for (int i = 0; i < 3; ++i) step();
  add("high", range(20, 12), 4, {}, 0);
  StepPlan p = s->schedule(/*allow_retract=*/false);
  EXPECT_TRUE(p.blocked);
  EXPECT_TRUE(p.empty());
  EXPECT_EQ(s->stats().num_retractions, 0);
  p = s->schedule(/*allow_retract=*/true);
  EXPECT_FALSE(p.blocked);
  EXPECT_GT(s->stats().num_retractions, 0);
  bool high = false;
  for (const ScheduledSeq& q : p.seqs) high |= q.req->rid == "high";
  EXPECT_TRUE(high) << "the high-priority request runs in the very step that made room for it";
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

// Prompt logprobs: the logit rows from position logprob_start_len - 1 on come back in order, chunk after chunk, and
// the prompt's list goes out once, with the first token: position start's on (position 0 as NaN).
TEST_F(SchedulerTest, PromptLogprobRowsFollowTheChunks) {
  make(64, /*chunk=*/4);
  SamplingParams sp;
  sp.logprob_start_len = 3;
  add("a", range(10, 10), 2, sp);
  std::vector<std::vector<int32_t>> rows;  // per step: the logit rows (token indices of the batch)
  std::vector<std::pair<int32_t, int32_t>> lp;  // per step: (lp_first_pos, lp_rows)
  while (s->has_work()) {
    StepPlan p = step();
    rows.push_back(p.batch.logit_rows);
    lp.emplace_back(p.seqs[0].lp_first_pos, p.seqs[0].lp_rows);
  }
  // Chunks [0, 4) [4, 8) [8, 10): rows of positions 2, 3 (predicting 3, 4), 4-7, then 8 and the sampled 9.
  ASSERT_GE(rows.size(), 3u);
  EXPECT_EQ(rows[0], (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(rows[1], (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(rows[2], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(lp[0], std::make_pair(2, 2));
  EXPECT_EQ(lp[1], std::make_pair(4, 4));
  EXPECT_EQ(lp[2], std::make_pair(8, 1));
  EXPECT_EQ(lp[3], std::make_pair(0, 0));  // decode
  const Collected& c = out["a"];
  EXPECT_EQ(c.tokens.size(), 2u);
  EXPECT_EQ(c.prompt_lp_outputs, 1);
  ASSERT_EQ(c.prompt_lps.size(), 7u);  // positions 3..9
  for (size_t i = 0; i < c.prompt_lps.size(); ++i) {
    EXPECT_EQ(c.prompt_lps[i].token, 13 + static_cast<int32_t>(i));
    EXPECT_EQ(c.prompt_lps[i].logprob, -static_cast<float>(3 + i));
  }
  expect_all_pages_back();
}

// Cached prefixes stop where the prompt logprobs need rows; max_new_tokens 0 computes them and generates nothing; a
// step's prompt-logprob rows are bounded.
TEST_F(SchedulerTest, PromptLogprobsLimitThePrefixAndTheRowsPerStep) {
  SchedulerConfig c;
  c.page_size = 4;
  c.num_pages = 64;
  c.chunked_prefill_size = 100;
  c.context_len = 1000;
  c.max_prompt_logprob_rows = 3;
  s = std::make_unique<Scheduler>(c);
  add("warm", range(10, 13), 1);
  while (s->has_work()) step();
  SamplingParams from0, from10;
  from0.logprob_start_len = 0;
  from10.logprob_start_len = 10;
  add("zero", range(10, 13), 0, from0);  // only the prompt's logprobs
  int32_t most = 0, steps = 0;
  while (s->has_work()) {
    StepPlan p = step();
    ++steps;
    for (const auto& q : p.seqs) most = std::max(most, q.lp_rows);
  }
  EXPECT_EQ(most, 3);
  EXPECT_EQ(steps, 4);  // rows 0-2, 3-5, 6-8, then 9-11 and the dropped draw at 12
  const Collected& z = out["zero"];
  EXPECT_TRUE(z.finished);
  EXPECT_EQ(z.finish.kind, FinishKind::Length);
  EXPECT_TRUE(z.tokens.empty());
  EXPECT_EQ(z.cached, 0);  // the cached prompt is computed again from position 0
  ASSERT_EQ(z.prompt_lps.size(), 13u);
  EXPECT_TRUE(std::isnan(z.prompt_lps[0].logprob));
  EXPECT_EQ(z.prompt_lps[0].token, 10);
  for (size_t i = 1; i < 13; ++i) EXPECT_EQ(z.prompt_lps[i].logprob, -static_cast<float>(i));
  add("ten", range(10, 13), 1, from10);  // rows from position 9: the cached pages [0, 8) serve
  while (s->has_work()) step();
  EXPECT_EQ(out["ten"].cached, 8);
  ASSERT_EQ(out["ten"].prompt_lps.size(), 3u);
  EXPECT_EQ(out["ten"].prompt_lps[0].logprob, -10.0f);
  EXPECT_EQ(out["ten"].tokens.size(), 1u);
  GenerateRequest g;
  g.input_ids = range(0, 5);
  g.sampling.logprob_start_len = 5;
  EXPECT_THROW(s->validate(g), Error);
  g.sampling.logprob_start_len = -2;
  EXPECT_THROW(s->validate(g), Error);
  expect_all_pages_back();
}

// A request retracted mid-prefill (its pages taken for another's decode) computes its prompt logprobs again from the
// start when it comes back: the list it reports has each position once, in order.
TEST_F(SchedulerTest, PromptLogprobsSurviveRetractionMidPrefill) {
  make(8, /*chunk=*/4);  // 32 token slots, prefill 4 tokens a step
  add("d", range(10, 8), 20);  // grows to 28 tokens while decoding
  step();
  step();
  SamplingParams sp;
  sp.logprob_start_len = 0;
  add("p", range(50, 22), 2, sp);  // its 6 pages and d's 4 do not fit: p is retracted mid-prefill
  int steps = 0;
  while (s->has_work() && steps < 500) {
    step();
    ++steps;
  }
  ASSERT_FALSE(s->has_work());
  EXPECT_GT(s->stats().num_retractions, 0);
  const Collected& c = out["p"];
  EXPECT_EQ(c.tokens.size(), 2u);
  EXPECT_EQ(c.prompt_lp_outputs, 1);
  ASSERT_EQ(c.prompt_lps.size(), 22u);
  EXPECT_TRUE(std::isnan(c.prompt_lps[0].logprob));
  for (size_t i = 1; i < 22; ++i) {
    EXPECT_EQ(c.prompt_lps[i].logprob, -static_cast<float>(i)) << i;
    EXPECT_EQ(c.prompt_lps[i].token, 50 + static_cast<int32_t>(i));
  }
  expect_all_pages_back();
}

}  // namespace

namespace mlaserve {
namespace {

// N-gram drafts: the tokens after the most recent earlier occurrence of the longest matching suffix.
TEST(NgramDraft, LongestRecentMatchFirst) {
  using V = std::vector<int32_t>;
  // Suffix [1 2 3]: occurs at 0 (followed by 9 9) and, as [2 3] only, at 5 (followed by 7).
  const V seq = {1, 2, 3, 9, 9, 2, 3, 7, 1, 2, 3};
  EXPECT_EQ(ngram_draft(seq, 1, 3, 4), (V{9, 9, 2, 3}));
  EXPECT_EQ(ngram_draft(seq, 1, 3, 2), (V{9, 9}));
  EXPECT_EQ(ngram_draft(seq, 1, 2, 4), (V{7, 1, 2, 3}));  // [2 3]: the most recent earlier one, at 5
  EXPECT_EQ(ngram_draft(seq, 1, 1, 3), (V{7, 1, 2}));     // [3] at 6
  // Past the sequence's end the continuation repeats with the match's period.
  EXPECT_EQ(ngram_draft(V{5, 6, 5}, 1, 3, 4), (V{6, 5, 6, 5}));  // [5] at 0: period 2
  EXPECT_EQ(ngram_draft(V{4, 4, 4, 4}, 2, 2, 3), (V{4, 4, 4}));  // [4 4] at 1: period 1
  EXPECT_EQ(ngram_draft(V{1, 2, 3, 9, 1, 2}, 1, 3, 5), (V{3, 9, 1, 2, 3}));  // [1 2] at 0: period 4
  // No earlier occurrence, too short, or nothing asked.
  EXPECT_TRUE(ngram_draft(V{1, 2, 3, 4}, 1, 3, 4).empty());
  EXPECT_TRUE(ngram_draft(V{1, 2, 3, 1, 2}, 3, 3, 4).empty());
  EXPECT_TRUE(ngram_draft(V{7}, 1, 3, 4).empty());
  EXPECT_TRUE(ngram_draft(V{1, 1}, 1, 3, 0).empty());
  // Only the last kNgramWindow tokens are searched.
  V far(kNgramWindow + 10, 0);
  for (size_t i = 0; i < far.size(); ++i) far[i] = static_cast<int32_t>(i + 100);
  far[0] = 42;
  far[1] = 43;
  far.push_back(42);
  EXPECT_TRUE(ngram_draft(far, 1, 1, 2).empty());
  far[far.size() - 20] = 42;
  EXPECT_EQ(ngram_draft(far, 1, 1, 2).size(), 2u);
}

// Against the definition, on random sequences of a small alphabet: for n from the longest down, the most recent earlier
// occurrence of the last n tokens, and the k tokens after it (where they pass the end, the tokens one period back:
// a sequence extended by its own continuation).
TEST(NgramDraft, EqualsTheDefinition) {
  auto reference = [](const std::vector<int32_t>& seq, int32_t min_n, int32_t max_n, int32_t k) {
    const int64_t len = std::ssize(seq);
    for (int64_t n = std::min<int64_t>(max_n, len - 1); n >= min_n && k > 0; --n)
      for (int64_t i = len - n - 1; i >= 0; --i)
        if (std::equal(seq.end() - n, seq.end(), seq.begin() + i)) {
          std::vector<int32_t> ext = seq;
          for (int64_t t = 0; t < k; ++t) ext.push_back(ext[static_cast<size_t>(i + n + t)]);
          return std::vector<int32_t>(ext.begin() + len, ext.end());
        }
    return std::vector<int32_t>{};
  };
  std::mt19937 rng(3);
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<int32_t> seq(1 + rng() % 40);
    const uint32_t alphabet = 2 + rng() % 5;
    for (auto& t : seq) t = static_cast<int32_t>(rng() % alphabet);
    const int32_t min_n = 1 + static_cast<int32_t>(rng() % 3), max_n = min_n + static_cast<int32_t>(rng() % 4);
    const int32_t k = static_cast<int32_t>(rng() % 6);
    ASSERT_EQ(ngram_draft(seq, min_n, max_n, k), reference(seq, min_n, max_n, k))
        << "trial " << trial << " n " << min_n << ".." << max_n << " k " << k;
  }
}

}  // namespace
}  // namespace mlaserve

// A failed step (Engine: an exception before or after its launch) ends its requests with the reason and caches none
// of their KV, even when the step had already advanced them (overlap scheduling: the step wrote what it could). A
// failed step that carried the prefix cache's copies (hierarchical cache) sets the cache aside: its loaded edge and
// saved slots may hold anything, so nothing matches or is cached until no request holds a lock; then the cache is
// emptied and used again.
TEST_F(SchedulerTest, FailedStepsCacheNothingTheyMayHaveWritten) {
  FinishReason why;
  why.kind = FinishKind::Abort;
  why.message = "internal error: test";
  const auto samples = [](const StepPlan& p) {
    std::vector<SampleResult> v(p.batch.logit_rows.size());
    for (auto& r : v) r.token = 100;
    return v;
  };
  // Without copies: the launched prefill of 13 tokens (three whole pages) fails.
  make(16, /*chunk=*/64);
  add("a", range(10, 13), 4);
  StepPlan p = s->schedule();
  s->advance(p);
  s->fail(p, why);
  s->drop(p);
  s->erase_finished();
  s->check_integrity();
  EXPECT_TRUE(out["a"].finished);
  EXPECT_EQ(out["a"].finish.kind, FinishKind::Abort);
  EXPECT_EQ(out["a"].finish.message, why.message);
  EXPECT_EQ(s->stats().kv_tokens_cached, 0);
  add("b", range(10, 13), 1);
  run_to_end();
  EXPECT_EQ(out["b"].cached, 0);
  add("c", range(10, 13), 1);
  run_to_end();
  EXPECT_EQ(out["c"].cached, 12) << "the cache works as before";
  expect_all_pages_back();

  // With copies: a's pages go to the host when o needs the device; a again loads them in step p1, which is launched;
  // n is admitted behind it (p2, overlap), matching o's prefix; then p1 fails.
  host_pages_ = 32;
  make(16, /*chunk=*/64);
  out.clear();
  add("a", range(10, 13), 1);
  run_to_end();
  add("o", range(200, 53), 1);  // 14 pages: a's 3 must leave the device
  run_to_end();
  add("a2", range(10, 13), 1);
  StepPlan p1 = s->schedule();
  s->take_copies(p1);
  ASSERT_FALSE(p1.batch.kv_loads.empty()) << "a's edge comes back from the host";
  s->advance(p1);
  std::vector<int32_t> n_prompt = range(200, 20);
  n_prompt.push_back(900);
  add("n", n_prompt, 8);
  StepPlan p2 = s->schedule(/*allow_retract=*/false);
  ASSERT_FALSE(p2.empty());
  s->take_copies(p2);
  s->advance(p2);
  s->fail(p1, why);
  s->drop(p1);
  s->resolve(p2, samples(p2));
  s->erase_finished();
  s->check_integrity();
  EXPECT_EQ(out["a2"].finish.kind, FinishKind::Abort);
  ASSERT_FALSE(out["n"].finished);
  EXPECT_EQ(out["n"].cached, 20) << "n matched o's prefix before the failure";
  // n holds its lock: a's edge (loaded, maybe with other data) is not matched; nothing new is cached.
  add("a3", range(10, 13), 1);
  for (int k = 0; k < 3 && !out["a3"].finished; ++k) step();
  ASSERT_TRUE(out["a3"].finished);
  EXPECT_EQ(out["a3"].cached, 0);
  EXPECT_FALSE(out["n"].finished);
  run_to_end();
  EXPECT_TRUE(out["n"].finished);
  // Nothing locked: emptied at the next step, then used again.
  add("a4", range(10, 13), 1);
  run_to_end();
  EXPECT_EQ(out["a4"].cached, 0);
  add("a5", range(10, 13), 1);
  run_to_end();
  EXPECT_EQ(out["a5"].cached, 12);
  expect_all_pages_back();
  host_pages_ = 0;
}

// The pages a request takes while it decodes lie in consecutive ids a 64-key tile at a time (pages of 4 tokens: 16
// pages, PagePool's placement), whatever the other requests take in between: every tile of a request's pages made
// only of pages taken while decoding is one run.
TEST_F(SchedulerTest, DecodePagesStayConsecutiveWithinTiles) {
  make(4096, /*chunk=*/64);
  const std::vector<int32_t> lens = {5, 37, 64, 90, 130, 3, 250, 61};
  for (size_t i = 0; i < lens.size(); ++i) add("r" + std::to_string(i), range(10, lens[i]), 300);
  std::map<std::string, std::vector<int32_t>> held;
  for (int steps = 0; s->has_work() && steps < 1000; ++steps) {
    StepPlan p = s->schedule();
    std::vector<SampleResult> sampled;
    for (auto& q : p.seqs) {
      held[q.req->rid] = q.req->pages;
      if (!q.wants_logits) continue;
      SampleResult r;
      r.token = 100 + static_cast<int32_t>(q.req->fill.size());
      sampled.push_back(r);
    }
    s->commit(p, sampled);
    s->check_integrity();
  }
  int tiles = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    const auto& pages = held["r" + std::to_string(i)];
    EXPECT_EQ(static_cast<int32_t>(pages.size()), (lens[i] + 300 - 1 + 3) / 4);  // (the last token has no KV)
    const size_t first = ((static_cast<size_t>(lens[i]) + 3) / 4 + 15) / 16 * 16;  // the first decode-only tile
    for (size_t t = first; t + 16 <= pages.size(); t += 16, ++tiles)
      for (size_t k = 1; k < 16; ++k)
        EXPECT_EQ(pages[t + k], pages[t] + static_cast<int32_t>(k)) << "r" << i << " tile at page " << t;
  }
  EXPECT_GE(tiles, 24);
  expect_all_pages_back();
}
