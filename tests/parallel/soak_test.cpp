// Mixed traffic for a while on CPU ranks with DP attention and overlap scheduling: groups alternate prefill and
// decode, some sit idle, requests are aborted at random; some requests have penalties (their token in flight counted
// on the device) or ask for top logprobs. Nothing may hang (every request finishes within the deadline), nothing may
// leak, and greedy requests, penalised or not, still match the single-request output.
// MLASERVE_SOAK_SECONDS sets the duration (default 15).
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "engine/engine.h"
#include "sanitizer_build.h"
#include "test_util.h"

using namespace mlaserve;

// tp 4 / dp 4: attention groups of one rank; tp 4 / dp 2: groups of two, whose leading rank's samples reach the
// other rank on the device (overlap launches steps that read them there). drafts > 0: n-gram speculative decoding
// (drafted under overlap too), some requests with three allowed tokens so that their drafts are kept. preempt: priority
// scheduling with priority preemption, the other requests of random priorities (some far below others, so running
// ones are retracted for waiting ones); the probes above them all (never preempted). mtp: the drafts (`drafts` a
// step, chained from the last kept row when more than one) come from the v3mtp checkpoint's MTP layer instead.
void soak(int32_t tp, int32_t groups, int32_t drafts = 0, bool preempt = false, bool mtp = false) {
  double seconds = 15.0;
  if (const char* e = std::getenv("MLASERVE_SOAK_SECONDS")) seconds = std::atof(e);
  // The penalised probe's reference: alone, with overlap off (every step sees its previous token on the host).
  SamplingParams favour;  // greedy with negative penalties: the tokens generated, the newest included, are favoured
  favour.temperature = 0.0f;
  favour.frequency_penalty = -1.0f;
  favour.presence_penalty = -1.0f;
  std::vector<int32_t> probe;
  for (int i = 0; i < 40; ++i) probe.push_back(3 + (i * 37) % 600);
  std::vector<int32_t> ref_pen;
  {
    Engine off(test::cpu_ranks(mtp ? "v3mtp" : "v3", tp, groups), test::small_engine_options(false));
    auto f = test::submit_ids(off, "ref_pen", probe, 12, 0, &favour);
    ref_pen = test::wait_ids(f);
  }
  auto ranks = test::cpu_ranks(mtp ? "v3mtp" : "v3", tp, groups, 0, mtp);
  EngineOptions o;
  o.page_size = 8;
  o.num_pages = 96;  // small: admission waits and retraction happen
  o.chunked_prefill_size = 48;
  o.max_running_requests = 6;
  o.check_integrity = true;
  o.overlap = true;
  o.spec_draft_tokens = drafts;
  o.priority_scheduling = o.priority_preemption = preempt;
  Engine e(std::move(ranks), o);

  // The reference: one greedy request alone.
  auto run_one = [&](const std::string& rid, std::vector<int32_t> ids, int32_t n, int32_t dp, float temp,
                     const SamplingParams* sp = nullptr, int32_t priority = 0) {
    auto prom = std::make_shared<std::promise<std::pair<std::vector<int32_t>, FinishKind>>>();
    auto acc = std::make_shared<std::vector<int32_t>>();
    GenerateRequest g = test::ids_request(rid, std::move(ids), n, dp, sp);
    g.priority = preempt ? priority : 0;
    if (!sp) g.sampling.temperature = temp;
    g.on_output = [prom, acc](const GenerateOutput& out) {
      acc->insert(acc->end(), out.new_tokens.begin(), out.new_tokens.end());
      if (out.finished) prom->set_value({*acc, out.finish.kind});
    };
    e.submit(std::move(g));
    return prom->get_future();
  };
  auto ref_f = run_one("ref", probe, 12, 0, 0.0f);
  ASSERT_EQ(ref_f.wait_for(std::chrono::duration<double>(60 * test::time_scale())), std::future_status::ready);
  const std::vector<int32_t> ref = ref_f.get().first;
  ASSERT_NE(ref_pen, ref) << "the penalties change the probe's tokens";

  std::mt19937 rng(7);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::future<std::pair<std::vector<int32_t>, FinishKind>>> probes, pen_probes, others;
  int n = 0;
  while (std::chrono::steady_clock::now() < end) {
    // Bursts pinned to one or two groups, so the others idle, then move on.
    const int busy = static_cast<int>(rng() % static_cast<uint64_t>(groups));
    for (int k = 0; k < 3; ++k) {
      const std::string rid = std::string("r").append(std::to_string(n++));
      const uint32_t kind = rng() % 10;
      if (kind < 2) {
        probes.push_back(run_one(rid, probe, 12, busy, 0.0f, nullptr, -50));
      } else if (kind == 2) {
        pen_probes.push_back(run_one(rid, probe, 12, busy, 0.0f, &favour, -50));
      } else {
        std::vector<int32_t> ids(1 + rng() % 120);
        for (auto& t : ids) t = 2 + static_cast<int32_t>(rng() % 600);
        SamplingParams sp;
        sp.temperature = 0.7f;
        sp.seed = rng();
        if (kind == 3) {
          sp.repetition_penalty = 1.3f;
          sp.frequency_penalty = 0.5f;
        } else if (kind == 4) {
          sp.return_logprob = true;
          sp.top_logprobs_num = 4;
        } else if (kind == 5) {
          sp.allowed_token_ids = {ids[0], 7, 8};
          sp.return_logprob = true;
        }
        const int32_t priority = std::array<int32_t, 3>{-20, 0, 20}[rng() % 3];
        others.push_back(
            run_one(rid, ids, 1 + static_cast<int32_t>(rng() % 24), rng() % 3 ? busy : -1, 0.7f, &sp, priority));
        if (rng() % 4 == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 20));
          FinishReason f;
          f.kind = FinishKind::Abort;
          e.abort(rid, f);
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 40));
  }
  const std::chrono::duration<double> hung(120 * test::time_scale());  // (after the last request was sent)
  for (auto& f : others) ASSERT_EQ(f.wait_for(hung), std::future_status::ready) << "a request hung";
  for (auto& f : probes) {
    ASSERT_EQ(f.wait_for(hung), std::future_status::ready) << "a request hung";
    EXPECT_EQ(f.get().first, ref);
  }
  for (auto& f : pen_probes) {
    ASSERT_EQ(f.wait_for(hung), std::future_status::ready) << "a request hung";
    EXPECT_EQ(f.get().first, ref_pen);  // never aborted (only the other requests are)
  }
  EXPECT_GT(n, 20);
  EXPECT_FALSE(pen_probes.empty());
  if (drafts > 0) {
    int64_t kept = 0, checks = 0;
    for (const RankStats& st : e.stats()) {
      kept += st.spec_accepted_tokens;
      checks += st.spec_checks;
    }
    if (mtp) EXPECT_GT(checks, 20);  // (the random MTP layer's drafts are seldom kept)
    else EXPECT_GT(kept, 0);
  }
  if (preempt) {
    int64_t retractions = 0;
    for (const RankStats& st : e.stats()) retractions += st.num_retractions;
    EXPECT_GT(retractions, 0);
  }
  test::expect_engine_idle_and_clean(e);
}

TEST(Soak, DpAttentionMixedTrafficWithAbortsNeverHangsOrLeaks) { soak(4, 4); }
TEST(Soak, DpAttentionGroupsOfTwoRanksNeverHangOrLeak) { soak(4, 2); }
TEST(Soak, NgramDraftsWithDpAttentionNeverHangOrLeak) { soak(4, 2, /*drafts=*/4); }
TEST(Soak, PriorityPreemptionWithDpAttentionNeverHangsOrLeaks) { soak(4, 2, 0, /*preempt=*/true); }
TEST(Soak, MtpDraftsWithPreemptionAndDpAttentionNeverHangOrLeak) { soak(4, 2, 1, /*preempt=*/true, /*mtp=*/true); }
TEST(Soak, MtpDraftChainsWithDpAttentionNeverHangOrLeak) { soak(4, 4, 3, /*preempt=*/false, /*mtp=*/true); }
