// Expert distribution recording (SGLang's --expert-distribution-recorder-mode stat and its /start_, /stop_ and
// /dump_expert_distribution_record): the CPU reference of Backend::count_experts, the model counting the routed
// experts of real rows only (a graph batch's padding and DP attention's gathered rows of other groups' padding are
// not counted), and the engine recording between start and stop in every layout, across a release of the memory,
// and behind the DP replicas' controller.
#include <gtest/gtest.h>

#include <future>
#include <numeric>

#include "backend/backend_factory.h"
#include "backend/cpu/cpu_kernels.h"
#include "backend/forwarding_backend.h"
#include "core/error.h"
#include "engine/engine.h"
#include "model/deepseek_model.h"
#include "model/forward_batch.h"
#include "model/kv_cache.h"
#include "test_util.h"

using namespace mlaserve;

namespace {

// The ids every moe_route call wrote, in call order (one entry per MoE layer per forward): [rows * k].
class RouteLog final : public ForwardingBackend {
 public:
  explicit RouteLog(Backend& inner) : ForwardingBackend(inner) {}
  void moe_route(const Tensor& l, const Tensor* bias, const RouterParams& p, Tensor& ids, Tensor& w) override {
    ForwardingBackend::moe_route(l, bias, p, ids, w);
    const int32_t* d = ids.data_as<int32_t>();  // (CPU memory)
    calls.emplace_back(d, d + ids.numel());
  }
  std::vector<std::vector<int32_t>> calls;
};

std::vector<int64_t> host_counts(Backend& be, const Tensor& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  be.download(t, v.data());
  return v;
}

// The (row, expert) pairs of each MoE layer over every row: the sums a dump must hold.
int64_t layer_sum(const std::vector<int64_t>& counts, int64_t layer, int64_t experts) {
  const auto first = counts.begin() + layer * experts;
  return std::accumulate(first, first + experts, int64_t{0});
}

ExpertRecord record(EngineClient& e, ExpertRecordOp op) {
  return test::callback_result<ExpertRecord>([&](auto cb) { e.expert_record(op, std::move(cb)); });
}

using test::memory_op;

// CPU ranks of a golden family that count the routed experts.
std::unique_ptr<RankSet> counting_ranks(const std::string& family, int32_t tp, int32_t dp, int32_t graph_max_bs,
                                        bool count = true) {
  return test::cpu_ranks_at(test::golden_dir(family), tp, dp, graph_max_bs, false, false,
                            [count](ParallelConfig& pc) { pc.count_experts = count; });
}

// Runs the prompts (max_new tokens each, greedy, EOS ignored) to the end; the tokens they forwarded (a prompt and
// every new token but the last, with the prefix cache off).
int64_t run_requests(EngineClient& e, const std::string& tag, const std::vector<std::vector<int32_t>>& prompts,
                     int32_t max_new) {
  std::vector<std::future<std::vector<int32_t>>> fs;
  int64_t tokens = 0;
  for (size_t j = 0; j < prompts.size(); ++j) {
    fs.push_back(test::submit_ids(e, tag + std::to_string(j), prompts[j], max_new));
    tokens += static_cast<int64_t>(prompts[j].size()) + max_new - 1;
  }
  for (auto& f : fs) EXPECT_EQ(test::wait_ids(f).size(), static_cast<size_t>(max_new));
  return tokens;
}

// Every MoE layer of a dump routed `tokens` tokens to k experts each; dense layers none.
void expect_layer_sums(const ExpertRecord& r, const ModelConfig& c, int64_t tokens) {
  ASSERT_TRUE(r.ok) << r.message;
  ASSERT_EQ(r.num_layers, c.num_hidden_layers);
  ASSERT_EQ(r.num_experts, c.n_routed_experts);
  ASSERT_EQ(static_cast<int64_t>(r.counts.size()), r.num_layers * r.num_experts);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    EXPECT_EQ(layer_sum(r.counts, l, r.num_experts), c.is_moe_layer(l) ? tokens * c.num_experts_per_tok : 0)
        << "layer " << l;
}

const std::vector<std::vector<int32_t>> kPrompts{
    {5, 17, 300, 2, 99, 41, 7, 12, 250}, {3, 14, 15, 92, 65}, {8, 1, 44, 200, 13, 77, 6}};

}  // namespace

TEST(ExpertCounts, CpuReference) {
  // 5 rows of 2 ids over 4 experts; -1 and 4 are outside and never counted.
  const std::vector<int32_t> ids{0, 1, 1, 2, 3, -1, 4, 0, 2, 2};
  std::vector<int64_t> all(4, 0);
  cpu::count_experts(ids.data(), 5, 2, nullptr, 0, 4, all.data());
  EXPECT_EQ(all, (std::vector<int64_t>{2, 2, 3, 1}));
  // Rows [1, 3) and [4, 9) (clipped to the 5 rows): rows 1, 2 and 4.
  const std::vector<int32_t> pairs{1, 2, 4, 5};
  std::vector<int64_t> some(4, 10);
  cpu::count_experts(ids.data(), 5, 2, pairs.data(), 2, 4, some.data());
  EXPECT_EQ(some, (std::vector<int64_t>{10, 11, 13, 11}));
  // An empty pair and one past the rows count nothing.
  const std::vector<int32_t> none{2, 0, 7, 3};
  cpu::count_experts(ids.data(), 5, 2, none.data(), 2, 4, some.data());
  EXPECT_EQ(some, (std::vector<int64_t>{10, 11, 13, 11}));
}

// The model counts what the router chose, per layer, for the real rows only: a prompt's every row, then a decode
// token padded to a graph's size (ForwardBatch::moe_rows {0, 1}); the MTP layer's routing is not counted.
TEST(ExpertCounts, ModelCountsTheRoutedExpertsOfRealRows) {
  const std::string dir = test::golden_dir("v3mtp");
  ModelConfig c = ModelConfig::from_file(dir);
  c.mtp_layers = 1;
  auto cpu = make_cpu_backend();
  RouteLog log(*cpu);
  DeepseekModel m(c, log);
  m.load(dir, {});
  m.enable_expert_counts();
  const int64_t L = c.num_hidden_layers, E = c.n_routed_experts, k = c.num_experts_per_tok;
  std::vector<int64_t> moe_layers;
  for (int64_t l = 0; l < L; ++l)
    if (c.is_moe_layer(l)) moe_layers.push_back(l);
  ASSERT_GE(moe_layers.size(), 2u);
  ASSERT_LT(moe_layers.front(), L - 1);  // (a dense first layer: its row stays 0)
  const int32_t page = 8;
  KvCache kv(*cpu, c, 8, page);
  const std::vector<int32_t> pages{0, 1};
  ForwardBatchBuilder bb(page);
  const std::vector<int32_t>& prompt = kPrompts[0];
  bb.add(prompt, 0, pages, ForwardBatchBuilder::Logits::Last);
  const ForwardBatch prefill = bb.finish();
  m.forward(prefill, kv);
  ASSERT_EQ(log.calls.size(), moe_layers.size());
  std::vector<int64_t> expected(static_cast<size_t>(L * E), 0);
  auto add_rows = [&](size_t call, int64_t rows, int64_t layer) {
    for (int64_t i = 0; i < rows * k; ++i) ++expected[static_cast<size_t>(layer * E + log.calls[call][i])];
  };
  for (size_t i = 0; i < moe_layers.size(); ++i) add_rows(i, static_cast<int64_t>(prompt.size()), moe_layers[i]);
  EXPECT_EQ(host_counts(*cpu, m.expert_counts()), expected);

  // One decode token padded to 4 rows (3 dummy rows on page 7): only row 0 counts.
  ForwardBatchBuilder db(page);
  const int32_t next = 42;
  db.add(std::span<const int32_t>(&next, 1), static_cast<int32_t>(prompt.size()), pages,
         ForwardBatchBuilder::Logits::Last);
  const ForwardBatch padded = pad_decode_batch(db.finish(), 4, 7, page);
  ASSERT_EQ(padded.moe_rows, (std::vector<int32_t>{0, 1}));
  log.calls.clear();
  m.forward(padded, kv);
  ASSERT_EQ(log.calls.size(), moe_layers.size());
  for (size_t i = 0; i < moe_layers.size(); ++i) {
    ASSERT_EQ(log.calls[i].size(), static_cast<size_t>(4 * k));
    add_rows(i, 1, moe_layers[i]);
  }
  EXPECT_EQ(host_counts(*cpu, m.expert_counts()), expected);

  // The MTP layer over the same rows routes too (one more call) but adds nothing.
  log.calls.clear();
  m.forward_draft(padded, padded.next_ids.empty() ? std::vector<int32_t>(4, 1) : padded.next_ids, kv);
  EXPECT_EQ(log.calls.size(), 1u);
  EXPECT_EQ(host_counts(*cpu, m.expert_counts()), expected);
  // Enabling again zeroes them.
  m.enable_expert_counts();
  EXPECT_EQ(host_counts(*cpu, m.expert_counts()), std::vector<int64_t>(static_cast<size_t>(L * E), 0));
}

// Through the engine in every layout (graphs pad decode steps; DP attention gathers every group's rows): only the
// steps between start and stop count, each token once per MoE layer; a dump resets; a dump while recording goes on
// recording.
TEST(ExpertRecord, EngineCountsTheTokensBetweenStartAndStop) {
  struct Layout {
    int32_t tp, dp, graphs;
  };
  for (const Layout& lay : {Layout{1, 1, 0}, Layout{1, 1, 8}, Layout{2, 1, 8}, Layout{2, 2, 8}}) {
    SCOPED_TRACE("tp " + std::to_string(lay.tp) + " dp " + std::to_string(lay.dp) + " graphs " +
                 std::to_string(lay.graphs));
    auto ranks = counting_ranks("v3", lay.tp, lay.dp, lay.graphs);
    const ModelConfig c = ranks->config();
    const RankSet* rs = ranks.get();
    EngineOptions o = test::small_engine_options(/*overlap=*/false);
    o.enable_radix_cache = false;  // (every prompt token forwarded)
    Engine e(std::move(ranks), o);
    run_requests(e, "before", kPrompts, 4);  // not recorded
    ASSERT_TRUE(record(e, ExpertRecordOp::Start).ok);
    const int64_t recorded = run_requests(e, "during", kPrompts, 6);
    const ExpertRecord stopped = record(e, ExpertRecordOp::Stop);
    ASSERT_TRUE(stopped.ok) << stopped.message;
    EXPECT_FALSE(stopped.recording);
    run_requests(e, "after", {kPrompts[1]}, 5);  // not recorded
    expect_layer_sums(record(e, ExpertRecordOp::Dump), c, recorded);
    expect_layer_sums(record(e, ExpertRecordOp::Dump), c, 0);  // the dump reset them
    if (lay.graphs > 0) {
      EXPECT_GT(rs->graph_steps(), 5);
    }
    // Recording on: a dump hands the counts so far and goes on from zero.
    ASSERT_TRUE(record(e, ExpertRecordOp::Start).ok);
    const int64_t first = run_requests(e, "one", {kPrompts[2]}, 3);
    const ExpertRecord d1 = record(e, ExpertRecordOp::Dump);
    EXPECT_TRUE(d1.recording);
    expect_layer_sums(d1, c, first);
    const int64_t second = run_requests(e, "two", {kPrompts[0], kPrompts[1]}, 2);
    expect_layer_sums(record(e, ExpertRecordOp::Dump), c, second);
    test::expect_engine_idle_and_clean(e);
  }
}

// The memory given back and taken again (SGLang's /release_memory_occupation) keeps the recording: the counts
// before the release and after the resumption add up.
TEST(ExpertRecord, CountsSurviveTheMemoryReleased) {
  auto ranks = counting_ranks("v2lite", 1, 1, 0);
  const ModelConfig c = ranks->config();
  EngineOptions o = test::small_engine_options(/*overlap=*/false);
  o.enable_radix_cache = false;
  o.record_experts = true;  // (--enable-expert-distribution-metrics: from the start)
  Engine e(std::move(ranks), o);
  const int64_t a = run_requests(e, "a", {kPrompts[0]}, 3);
  ASSERT_TRUE(memory_op(e, true).ok);
  // Stopped and dumped while released: what came before.
  ASSERT_TRUE(record(e, ExpertRecordOp::Stop).ok);
  expect_layer_sums(record(e, ExpertRecordOp::Dump), c, a);
  ASSERT_TRUE(record(e, ExpertRecordOp::Start).ok);  // and again from zero
  ASSERT_TRUE(memory_op(e, false).ok);
  const int64_t b = run_requests(e, "b", {kPrompts[1]}, 2);
  expect_layer_sums(record(e, ExpertRecordOp::Dump), c, b);
  // Recording across the release: both parts.
  const int64_t b2 = run_requests(e, "c", {kPrompts[2]}, 4);
  ASSERT_TRUE(memory_op(e, true).ok);
  ASSERT_TRUE(memory_op(e, false).ok);
  const int64_t b3 = run_requests(e, "d", {kPrompts[0]}, 2);
  expect_layer_sums(record(e, ExpertRecordOp::Dump), c, b2 + b3);
}

// Without --expert-distribution-recorder-mode every operation is refused, naming the flag; --dp replicas (the
// controller) sum their counts.
TEST(ExpertRecord, OffIsRefusedAndReplicasAddUp) {
  {
    Engine e(counting_ranks("v2lite", 1, 1, 0, /*count=*/false), test::small_engine_options(false));
    const ExpertRecord r = record(e, ExpertRecordOp::Start);
    EXPECT_FALSE(r.ok);
    EXPECT_NE(r.message.find("--expert-distribution-recorder-mode"), std::string::npos) << r.message;
  }
  EngineArgs a;
  a.model_path = test::golden_dir("v2lite");
  a.device = "cpu";
  a.dp_size = 2;
  a.max_total_tokens = 512;
  a.disable_radix_cache = true;
  a.disable_overlap_schedule = true;
  a.expert_distribution_recorder_mode = "stat";
  auto e = make_engine(a);
  const ModelConfig c = ModelConfig::from_file(a.model_path);
  ASSERT_TRUE(record(*e, ExpertRecordOp::Start).ok);
  int64_t tokens = 0;
  std::vector<std::future<std::vector<int32_t>>> fs;
  for (int32_t r = 0; r < 2; ++r)  // one request on each replica
    for (size_t j = 0; j < kPrompts.size(); ++j) {
      fs.push_back(test::submit_ids(*e, "r" + std::to_string(r) + "_" + std::to_string(j), kPrompts[j], 3, r));
      tokens += static_cast<int64_t>(kPrompts[j].size()) + 2;
    }
  for (auto& f : fs) EXPECT_EQ(test::wait_ids(f).size(), 3u);
  expect_layer_sums(record(*e, ExpertRecordOp::Dump), c, tokens);
  a.expert_distribution_recorder_mode = "per_token";
  try {
    make_engine(a);
    ADD_FAILURE() << "per_token accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("--expert-distribution-recorder-mode"), std::string::npos) << err.what();
  }
  e->shutdown();
}
