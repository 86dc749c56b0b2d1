// Speculative decoding with the checkpoint's MTP layer (SGLang's EAGLE / NEXTN, vLLM's deepseek_mtp).
//
// The v3mtp family (tools/golden/make_mtp_golden.py) is a tiny V3-like checkpoint with one MTP layer laid out as
// DeepSeek-V3's; its reference MTP logits come from Hugging Face parts (the MTP's decoder layer run as a one-layer
// DeepseekV3 model on eh_proj's output, Hugging Face having no MTP module). The engine tests check that drafts never
// change what is generated, and, on a checkpoint made so that the MTP layer predicts the model exactly, that its
// drafts are kept.
#include <gtest/gtest.h>

#include <filesystem>
#include <tuple>

#include <fmt/format.h>

#include "core/dtype.h"
#include "engine/engine.h"
#include "io/safetensors.h"
#include "model/deepseek_model.h"
#include "model/forward_batch.h"
#include "test_util.h"

using namespace mlaserve;
namespace fs = std::filesystem;

namespace {

constexpr double kRelTol = 1e-3;  // as the golden model tests: fp32 on the same bf16 weights

std::string family_dir() { return test::golden_dir("v3mtp"); }

ModelConfig mtp_config(const std::string& dir) {
  ModelConfig c = ModelConfig::from_file(dir);
  c.mtp_layers = 1;
  return c;
}

struct Reference {
  std::vector<std::vector<int32_t>> prompts, next;
  std::vector<Tensor> logits, mtp_logits;
  std::vector<std::vector<int32_t>> greedy;  // up to the first near tie
  // Chained drafts after the prompt's last position: the drafts fed and the MTP logits of each chained step.
  std::vector<std::vector<int32_t>> chain_ids;
  std::vector<Tensor> chain_logits;
};

Reference read_reference() {
  SafetensorsFile f(family_dir() + "/reference.safetensors");
  Reference r;
  auto ids = [&](const std::string& name) {
    Tensor t = f.tensor(name);
    return std::vector<int32_t>(t.data_as<int32_t>(), t.data_as<int32_t>() + t.numel());
  };
  for (int j = 0; f.has("prompt_" + std::to_string(j)); ++j) {
    const std::string s = std::to_string(j);
    r.prompts.push_back(ids("prompt_" + s));
    r.next.push_back(ids("mtp_next_" + s));
    r.logits.push_back(f.tensor("logits_" + s));
    r.mtp_logits.push_back(f.tensor("mtp_logits_" + s));
    const std::vector<int32_t> g = ids("greedy_" + s);
    Tensor m = f.tensor("margin_" + s);
    std::vector<int32_t> kept;
    for (size_t i = 0; i < g.size() && m.data_as<float>()[i] >= 0.02f; ++i) kept.push_back(g[i]);
    r.greedy.push_back(kept);
    r.chain_ids.push_back(ids("mtp_chain_ids_" + s));
    r.chain_logits.push_back(f.tensor("mtp_chain_logits_" + s));
  }
  return r;
}

std::vector<int32_t> page_run(int32_t first, int32_t tokens, int32_t page_size) {
  std::vector<int32_t> p;
  for (int32_t i = 0; i < (tokens + page_size - 1) / page_size; ++i) p.push_back(first + i);
  return p;
}

// The v3mtp model with its MTP layer on the CPU, and a latent cache of 64 pages of P tokens.
struct CpuMtpModel {
  static constexpr int32_t P = 8;
  std::unique_ptr<Backend> be = make_cpu_backend();
  DeepseekModel m{mtp_config(family_dir()), *be};
  KvCache cache{*be, m.config(), 64, P};
  explicit CpuMtpModel(const LoadOptions& lo = {}) { m.load(family_dir(), lo); }
};

// The model's logits and the MTP layer's over prompt j as one batch of its chunks [cuts[k], cuts[k + 1]), each
// chunk a step of its own after the ones before it in the cache: both match Hugging Face row by row (`lo`: the
// shared experts fused into the routed ones or not, the MTP layer's too).
void expect_draft_logits_match(const LoadOptions& lo) {
  const Reference ref = read_reference();
  CpuMtpModel cm(lo);
  auto& [be, m, cache] = cm;
  constexpr int32_t P = CpuMtpModel::P;
  ASSERT_EQ(cache.num_layers(), m.config().num_hidden_layers + 1);
  for (size_t j = 0; j < ref.prompts.size(); ++j) {
    const auto& prompt = ref.prompts[j];
    const int32_t n = static_cast<int32_t>(prompt.size());
    std::vector<std::vector<int32_t>> splits{{0, n}};
    if (n >= 7) splits.push_back({0, n / 3, n / 2 + 1, n});
    for (const auto& cuts : splits) {
      SCOPED_TRACE("prompt " + std::to_string(j) + " in " + std::to_string(cuts.size() - 1) + " chunks");
      for (size_t k = 0; k + 1 < cuts.size(); ++k) {
        const int32_t a = cuts[k], b = cuts[k + 1];
        ForwardBatchBuilder bb(P);
        bb.add(std::span<const int32_t>(prompt).subspan(a, b - a), a, page_run(0, b, P),
               ForwardBatchBuilder::Logits::All);
        const ForwardBatch fb = bb.finish();
        const Tensor logits = be->to_host_f32(m.forward(fb, cache));
        EXPECT_LT(test::rel_err(logits, ref.logits[j].rows(a, b)), kRelTol) << "the model, chunk " << k;
        const Tensor draft = be->to_host_f32(
            m.forward_draft(fb, std::span<const int32_t>(ref.next[j]).subspan(a, b - a), cache));
        EXPECT_LT(test::rel_err(draft, ref.mtp_logits[j].rows(a, b)), kRelTol) << "the MTP layer, chunk " << k;
      }
    }
  }
  // All prompts in one ragged batch: each one's MTP rows as alone.
  ForwardBatchBuilder bb(P);
  std::vector<int32_t> next;
  int32_t page = 0;
  for (size_t j = 0; j < ref.prompts.size(); ++j) {
    const int32_t n = static_cast<int32_t>(ref.prompts[j].size());
    bb.add(ref.prompts[j], 0, page_run(page, n, P), ForwardBatchBuilder::Logits::All);
    page += (n + P - 1) / P;
    next.insert(next.end(), ref.next[j].begin(), ref.next[j].end());
  }
  const ForwardBatch fb = bb.finish();
  m.forward(fb, cache);
  const Tensor draft = be->to_host_f32(m.forward_draft(fb, next, cache));
  int64_t row = 0;
  for (size_t j = 0; j < ref.prompts.size(); ++j) {
    const int64_t n = static_cast<int64_t>(ref.prompts[j].size());
    EXPECT_LT(test::rel_err(draft.rows(row, row + n), ref.mtp_logits[j]), kRelTol) << "prompt " << j << " batched";
    row += n;
  }
}

TEST(Mtp, DraftLogitsMatchHuggingFaceParts) { expect_draft_logits_match({}); }

TEST(Mtp, DraftLogitsMatchHuggingFaceWithSharedExpertsFused) {
  LoadOptions lo;
  lo.shared_experts_fusion = LoadOptions::KeepQuantized::On;
  expect_draft_logits_match(lo);
}

// Chained drafts (forward_draft_chain): after the MTP rows of every prompt (one ragged batch), three chained steps,
// each one position on, fed the reference's draft and the MTP layer's previous output at that row: each step's logits
// match Hugging Face's for every prompt.
TEST(Mtp, ChainedDraftLogitsMatchHuggingFaceParts) {
  const Reference ref = read_reference();
  CpuMtpModel cm;
  auto& [be, m, cache] = cm;
  constexpr int32_t P = CpuMtpModel::P;
  const int32_t steps = static_cast<int32_t>(ref.chain_ids[0].size());
  ASSERT_EQ(steps, 3);
  ForwardBatchBuilder bb(P);
  std::vector<int32_t> next, hidden_rows;
  std::vector<std::vector<int32_t>> pages;
  int32_t page = 0, token = 0;
  for (size_t j = 0; j < ref.prompts.size(); ++j) {
    const int32_t n = static_cast<int32_t>(ref.prompts[j].size());
    pages.push_back(page_run(page, n + steps, P));
    page += static_cast<int32_t>(pages.back().size());
    bb.add(ref.prompts[j], 0, pages.back(), ForwardBatchBuilder::Logits::Last);
    next.insert(next.end(), ref.next[j].begin(), ref.next[j].end());
    token += n;
    hidden_rows.push_back(token - 1);
  }
  const ForwardBatch fb = bb.finish();
  m.forward(fb, cache);
  const Tensor first = be->to_host_f32(m.forward_draft(fb, next, cache));
  for (size_t j = 0; j < ref.prompts.size(); ++j) {
    const int64_t n = static_cast<int64_t>(ref.prompts[j].size());
    EXPECT_LT(test::rel_err(first.rows(static_cast<int64_t>(j), static_cast<int64_t>(j) + 1),
                            ref.mtp_logits[j].rows(n - 1, n)), kRelTol) << "prompt " << j;
  }
  for (int32_t c = 0; c < steps; ++c) {
    ForwardBatchBuilder cb(P);
    Tensor drafts = Tensor::empty_host({static_cast<int64_t>(ref.prompts.size())}, DType::I32);
    for (size_t j = 0; j < ref.prompts.size(); ++j) {
      const int32_t n = static_cast<int32_t>(ref.prompts[j].size());
      const std::vector<int32_t> id{-static_cast<int32_t>(j) - 1};
      cb.add(id, n + c, pages[j], ForwardBatchBuilder::Logits::Last);
      drafts.data_as<int32_t>()[j] = ref.chain_ids[j][static_cast<size_t>(c)];
    }
    const Tensor got = be->to_host_f32(
        m.forward_draft_chain(cb.finish(), hidden_rows, be->upload(drafts, DType::I32), cache));
    for (size_t j = 0; j < ref.prompts.size(); ++j)
      EXPECT_LT(test::rel_err(got.rows(static_cast<int64_t>(j), static_cast<int64_t>(j) + 1),
                              ref.chain_logits[j].rows(c, c + 1)), kRelTol) << "prompt " << j << ", chained step " << c;
    for (size_t j = 0; j < ref.prompts.size(); ++j) hidden_rows[j] = static_cast<int32_t>(j);
  }
}

TEST(Mtp, BadUseGivesClearErrors) {
  auto be = make_cpu_backend();
  {  // a checkpoint without an MTP layer
    DeepseekModel m(mtp_config(test::golden_dir("v3")), *be);
    const std::string e = test::error_text([&] { m.load(test::golden_dir("v3"), {}); });
    EXPECT_NE(e.find("num_nextn_predict_layers"), std::string::npos) << "loaded an MTP layer v3 lacks: " << e;
  }
  DeepseekModel plain(ModelConfig::from_file(family_dir()), *be);
  plain.load(family_dir(), {});
  KvCache cache(*be, plain.config(), 4, 8);
  ForwardBatchBuilder bb(8);
  const std::vector<int32_t> ids{5, 6, 7};
  bb.add(ids, 0, std::vector<int32_t>{0}, ForwardBatchBuilder::Logits::Last);
  const ForwardBatch fb = bb.finish();
  plain.forward(fb, cache);
  EXPECT_THROW(plain.forward_draft(fb, ids, cache), std::exception) << "loaded without its MTP layer";
  DeepseekModel m(mtp_config(family_dir()), *be);
  m.load(family_dir(), {});
  KvCache mcache(*be, m.config(), 4, 8);
  EXPECT_THROW(m.forward_draft(fb, ids, mcache), std::exception) << "no forward of the step first";
  m.forward(fb, mcache);
  EXPECT_THROW(m.forward_draft(fb, std::vector<int32_t>{5, 6}, mcache), std::exception) << "one next id per token";
  EXPECT_THROW(m.forward_draft(fb, std::vector<int32_t>{5, 6, 100000}, mcache), std::exception) << "out of range";
  EXPECT_THROW(m.forward_draft(fb, ids, cache), std::exception) << "a cache without the MTP layer's";
  // Chained drafts: one hidden row per token, input ids naming drafts.
  m.forward_draft(fb, ids, mcache);
  ForwardBatchBuilder cb(8);
  cb.add(std::vector<int32_t>{-1}, 3, std::vector<int32_t>{0}, ForwardBatchBuilder::Logits::Last);
  const ForwardBatch chain = cb.finish();
  Tensor draft = Tensor::empty_host({1}, DType::I32);
  draft.data_as<int32_t>()[0] = 9;
  EXPECT_THROW(m.forward_draft_chain(chain, std::vector<int32_t>{}, draft, mcache), std::exception) << "no hidden row";
  EXPECT_THROW(m.forward_draft_chain(chain, std::vector<int32_t>{7}, draft, mcache), std::exception)
      << "a hidden row past the previous output";
  ForwardBatchBuilder cb2(8);
  cb2.add(std::vector<int32_t>{-2}, 3, std::vector<int32_t>{0}, ForwardBatchBuilder::Logits::Last);
  EXPECT_THROW(m.forward_draft_chain(cb2.finish(), std::vector<int32_t>{2}, draft, mcache), std::exception)
      << "an id past the drafts";
  EXPECT_EQ(m.forward_draft_chain(chain, std::vector<int32_t>{2}, draft, mcache).size(0), 1);
}

// Engines over the MTP checkpoint, with and without its drafts, overlap scheduling on and off.
class MtpEngine : public ::testing::TestWithParam<bool> {
 protected:
  // drafts: the MTP drafts per step (0: none; 2 or more chain them). graph_max_bs > 0: decode steps replay graphs
  // (GraphRecorder), the MTP layer eager after them.
  std::unique_ptr<Engine> make(const std::string& dir, int32_t drafts, int32_t tp = 1, int32_t dp = 1,
                               int32_t spec_max_batch = 0, int32_t graph_max_bs = 0) {
    EngineOptions o = test::small_engine_options(GetParam(), 400);
    o.spec_draft_tokens = drafts;
    o.spec_max_batch = spec_max_batch;
    return std::make_unique<Engine>(test::cpu_ranks_at(dir, tp, dp, graph_max_bs, drafts > 0), o);
  }
  // A checkpoint whose layers add nothing (o_proj and every down projection zero, norms one): the model's next token
  // is a function f of the current one, and an MTP layer that passes the next token's embedding through (eh_proj
  // [I | 0]) predicts f(next), the model's token after next; chained on its own draft, f(f(next)) and so on.
  static void write_exact_checkpoint(const fs::path& dir) {
    fs::create_directories(dir);
    test::rewrite_checkpoint("v3mtp", dir, [](std::map<std::string, Tensor>& ts) {
      auto fill = [](Tensor& t, float v) {
        for (int64_t i = 0; i < t.numel(); ++i) t.data_as<uint16_t>()[i] = f32_to_bf16(v);
      };
      for (auto& [name, t] : ts) {
        ASSERT_EQ(t.dtype(), DType::BF16) << name;
        if (name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight")) fill(t, 0.0f);
        if (name == "model.norm.weight" || name.ends_with(".enorm.weight") || name.ends_with("shared_head.norm.weight"))
          fill(t, 1.0f);
      }
      Tensor& eh = ts.at("model.layers.4.eh_proj.weight");
      const int64_t H = eh.size(0);
      fill(eh, 0.0f);
      for (int64_t i = 0; i < H; ++i) eh.data_as<uint16_t>()[i * 2 * H + i] = f32_to_bf16(1.0f);
    });
  }
  static int64_t total(EngineClient& e, int64_t RankStats::*field) {
    int64_t n = 0;
    for (const RankStats& s : e.stats()) n += s.*field;
    return n;
  }
  // With `drafts` MTP drafts a step the outputs are the model's: greedy = Hugging Face for every prompt, seeded
  // sampling draws what it draws without drafts (draw k of a seed is draw k), and with tensor parallelism and DP
  // attention, decode steps through graphs (under DP attention too), the same tokens. Every check has one draft, or
  // with chains more than drafts - 1 on average.
  void expect_outputs_kept(int32_t drafts) {
    const Reference ref = read_reference();
    auto e = make(family_dir(), drafts);
    std::vector<std::future<std::vector<int32_t>>> fs;
    for (size_t j = 0; j < ref.prompts.size(); ++j)
      fs.push_back(test::submit_ids(*e, "g" + std::to_string(j), ref.prompts[j], 24));
    for (size_t j = 0; j < ref.prompts.size(); ++j) {
      const std::vector<int32_t> got = test::wait_ids(fs[j]);
      ASSERT_EQ(got.size(), 24u);
      for (size_t i = 0; i < ref.greedy[j].size(); ++i)
        EXPECT_EQ(got[i], ref.greedy[j][i]) << "prompt " << j << " step " << i;
    }
    auto drafts_per_check = [drafts](EngineClient& engine, int64_t min_checks, const std::string& where) {
      const int64_t checks = total(engine, &RankStats::spec_checks);
      const int64_t checked = total(engine, &RankStats::spec_draft_tokens);
      EXPECT_GT(checks, min_checks) << "decode steps check the MTP layer's drafts, " << where;
      if (drafts == 1) {
        EXPECT_EQ(checked, checks) << "one draft per check, " << where;
      } else {
        EXPECT_GT(checked, checks * (drafts - 1)) << "chains of up to " << drafts << " drafts, " << where;
      }
      EXPECT_LE(checked, checks * drafts) << where;
      EXPECT_LE(total(engine, &RankStats::spec_accepted_tokens), checked) << where;
    };
    drafts_per_check(*e, drafts == 1 ? 40 : 20, "alone");
    SamplingParams seeded;
    seeded.temperature = 0.8f;
    seeded.top_k = 30;
    seeded.seed = 11;
    auto plain = make(family_dir(), 0);
    for (size_t j : {size_t{1}, size_t{3}}) {
      auto a = test::submit_ids(*plain, "p", ref.prompts[j], 32, -1, &seeded);
      auto b = test::submit_ids(*e, "s", ref.prompts[j], 32, -1, &seeded);
      EXPECT_EQ(test::wait_ids(b), test::wait_ids(a)) << "prompt " << j;
    }
    test::expect_engine_idle_and_clean(*e);
    for (const auto& [tp, dp, graphs] : {std::tuple{2, 2, 0}, std::tuple{1, 1, 8}, std::tuple{2, 2, 8}}) {
      auto par = make(family_dir(), drafts, tp, dp, 0, graphs);
      auto a = test::submit_ids(*par, "a", ref.prompts[2], 24);
      auto b = test::submit_ids(*par, "b", ref.prompts[3], 24);
      const std::vector<int32_t> ra = test::wait_ids(a), rb = test::wait_ids(b);
      const std::string where = fmt::format("tp {} dp {} graphs {}", tp, dp, graphs);
      for (size_t i = 0; i < ref.greedy[2].size(); ++i) EXPECT_EQ(ra[i], ref.greedy[2][i]) << where << ", step " << i;
      for (size_t i = 0; i < ref.greedy[3].size(); ++i) EXPECT_EQ(rb[i], ref.greedy[3][i]) << where << ", step " << i;
      drafts_per_check(*par, drafts == 1 ? 20 : 8, where);
      test::expect_engine_idle_and_clean(*par);
    }
  }
  // On the exact checkpoint in `dir` (write_exact_checkpoint), greedy, eagerly and through graphs, with `drafts` MTP
  // drafts a step: the outputs are `plain`'s (no drafts), more than min_drafts drafts are checked and >= 90% of them
  // kept (but for near ties), and the steps are fewer than max_tenths tenths of plain's.
  void expect_exact_drafts_kept(const fs::path& dir, int32_t drafts, EngineClient& plain, int64_t min_drafts,
                                int64_t max_tenths) {
    const Reference ref = read_reference();
    for (int32_t graphs : {0, 8}) {
      auto e = make(dir.string(), drafts, 1, 1, 0, graphs);
      const int64_t plain_before = total(plain, &RankStats::forward_steps);
      for (size_t j = 0; j < ref.prompts.size(); ++j) {
        auto a = test::submit_ids(plain, "p", ref.prompts[j], 30);
        auto b = test::submit_ids(*e, "s", ref.prompts[j], 30);
        EXPECT_EQ(test::wait_ids(b), test::wait_ids(a)) << "prompt " << j << " graphs " << graphs;
      }
      const int64_t checked = total(*e, &RankStats::spec_draft_tokens);
      const int64_t kept = total(*e, &RankStats::spec_accepted_tokens);
      EXPECT_GT(checked, min_drafts);
      EXPECT_GE(kept, checked * 9 / 10) << kept << " of " << checked << " drafts kept, graphs " << graphs;
      EXPECT_LT(total(*e, &RankStats::forward_steps), (total(plain, &RankStats::forward_steps) - plain_before) *
                                                           max_tenths / 10)
          << drafts + 1 << " tokens a step, graphs " << graphs;
      test::expect_engine_idle_and_clean(*e);
    }
  }
};

TEST_P(MtpEngine, DraftsKeepTheOutputs) { expect_outputs_kept(1); }

// On the exact checkpoint (write_exact_checkpoint) the drafts are kept (but for near ties), every step takes two
// tokens, and the output is the model's without drafts (expect_exact_drafts_kept).
TEST_P(MtpEngine, AnExactDraftLayerIsKept) {
  const fs::path dir = test::temp_dir("mtp_exact");
  write_exact_checkpoint(dir);
  auto plain = make(dir.string(), 0);
  expect_exact_drafts_kept(dir, 1, *plain, 40, 6);
  fs::remove_all(dir);
}

// Chains of MTP drafts (SGLang's --speculative-num-steps 3, vLLM's num_speculative_tokens 3): every check has up to
// three drafts, and the outputs stay the model's.
TEST_P(MtpEngine, ChainedDraftsKeepTheOutputs) { expect_outputs_kept(3); }

// On the exact checkpoint a chain of three drafts is the model's next three tokens: greedy steps take four tokens
// each. Sampled (seeded) steps reject drafts where the draw is not the greedy token; the chain then starts from the
// row whose draw the step keeps last, so the next check has three drafts again (the first after a prompt and the
// last ones before the length limit may have fewer), and the outputs are the model's without drafts.
TEST_P(MtpEngine, AnExactDraftLayerChainsFromTheLastKeptRow) {
  const fs::path dir = test::temp_dir("mtp_exact_chain");
  write_exact_checkpoint(dir);
  const Reference ref = read_reference();
  auto plain = make(dir.string(), 0);
  expect_exact_drafts_kept(dir, 3, *plain, 60, 4);
  auto e = make(dir.string(), 3);
  SamplingParams seeded;
  seeded.temperature = 1.0f;
  seeded.top_k = 2;
  int64_t requests = 0;
  for (uint64_t seed : {3u, 5u}) {
    seeded.seed = seed;
    for (size_t j = 0; j < ref.prompts.size(); ++j, ++requests) {
      auto a = test::submit_ids(*plain, "p", ref.prompts[j], 40, -1, &seeded);
      auto b = test::submit_ids(*e, "s", ref.prompts[j], 40, -1, &seeded);
      EXPECT_EQ(test::wait_ids(b), test::wait_ids(a)) << "prompt " << j << " seed " << seed;
    }
  }
  const int64_t checks = total(*e, &RankStats::spec_checks), drafts = total(*e, &RankStats::spec_draft_tokens);
  const int64_t kept = total(*e, &RankStats::spec_accepted_tokens);
  EXPECT_LT(kept, drafts * 8 / 10) << "sampling rejects drafts";
  EXPECT_GT(kept, drafts / 10);
  EXPECT_GE(drafts, checks * 3 - requests * 6) << drafts << " drafts in " << checks << " checks";
  test::expect_engine_idle_and_clean(*e);
  fs::remove_all(dir);
}

// Under overlap scheduling a request that drafts waits for its step in flight (its draft comes from it): one request
// alone never has a step launched behind its own. With --speculative-disable-by-batch-size 1 and two decoding requests
// no step checks drafts, and none waits: their steps overlap. (Two drafting requests may still overlap each other's
// steps, alternating, which is why the first case has one request.)
TEST_P(MtpEngine, StepsThatCheckNoDraftsOverlap) {
  if (!GetParam()) GTEST_SKIP() << "overlap scheduling only";
  const Reference ref = read_reference();
  {
    auto e = make(family_dir(), 1);
    auto a = test::submit_ids(*e, "a", ref.prompts[2], 24);
    const std::vector<int32_t> ra = test::wait_ids(a);
    for (size_t i = 0; i < ref.greedy[2].size(); ++i) EXPECT_EQ(ra[i], ref.greedy[2][i]) << "alone, step " << i;
    EXPECT_GE(total(*e, &RankStats::spec_checks), 15) << "a draft checked every decode step";
    EXPECT_EQ(total(*e, &RankStats::overlapped_steps), 0) << "it waits for its own steps";
  }
  auto e = make(family_dir(), 1, 1, 1, /*spec_max_batch=*/1);
  auto a = test::submit_ids(*e, "a", ref.prompts[2], 24);
  auto b = test::submit_ids(*e, "b", ref.prompts[3], 24);
  const std::vector<int32_t> ra = test::wait_ids(a), rb = test::wait_ids(b);
  for (size_t i = 0; i < ref.greedy[2].size(); ++i) EXPECT_EQ(ra[i], ref.greedy[2][i]) << "limit 1, step " << i;
  for (size_t i = 0; i < ref.greedy[3].size(); ++i) EXPECT_EQ(rb[i], ref.greedy[3][i]) << "limit 1, step " << i;
  EXPECT_LE(total(*e, &RankStats::spec_checks), 4) << "two decoding requests, a limit of one: no drafts";
  EXPECT_GE(total(*e, &RankStats::overlapped_steps), 15) << "and no waiting";
}

INSTANTIATE_TEST_SUITE_P(Overlap, MtpEngine, ::testing::Bool(),
                         [](const auto& i) { return i.param ? std::string("On") : std::string("Off"); });

}  // namespace
