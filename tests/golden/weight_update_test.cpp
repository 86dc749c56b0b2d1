// Weights updated in place (SGLang's /update_weights_from_disk): DeepseekModel::reload writes another checkpoint of
// the same model into the tensors it holds, RankSet::reload_weights does it on every rank and loads the previous
// checkpoint again when any rank fails, and the engine runs an update once no request runs (requests submitted
// meanwhile wait for it; abort_all_requests ends the running ones first), with and without overlap scheduling,
// graphs, tensor and DP-attention layouts, and DP replicas.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/dp_controller.h"
#include "engine/engine.h"
#include "engine/offline.h"
#include "engine/rank_set.h"
#include "io/safetensors.h"
#include "model/deepseek_model.h"
#include "test_util.h"

using namespace mlaserve;
namespace fs = std::filesystem;

namespace {

const std::vector<int32_t> kPrompt{5, 17, 300, 2, 99, 41, 7, 12, 250};

// Another training step's weights of the v2lite golden model (its projections scaled), in a new folder.
fs::path new_v2lite_weights(const std::string& tag) {
  const fs::path dir = test::temp_dir(tag);
  test::write_scaled_checkpoint("v2lite", dir, 1.25f);
  return dir;
}

// The prompt's logits (every position) on the ranks.
std::vector<float> ranks_logits(RankSet& ranks) {
  OfflineOptions o;
  o.prompt_logits = true;
  const Tensor t = run_offline(ranks, {kPrompt}, o).prompt_logits[0];
  return std::vector<float>(t.data_as<float>(), t.data_as<float>() + t.numel());
}

std::vector<float> model_logits(DeepseekModel& m) {
  OfflineOptions o;
  o.prompt_logits = true;
  const Tensor t = run_offline(m, {kPrompt}, o).prompt_logits[0];
  return std::vector<float>(t.data_as<float>(), t.data_as<float>() + t.numel());
}

// A copy of a golden family's folder (config.json and shards), to edit or delete.
fs::path copy_family(const std::string& family, const std::string& tag) {
  const fs::path dir = test::temp_dir(tag);
  for (const auto& e : fs::directory_iterator(test::golden_dir(family)))
    if (e.path().filename() != "reference.safetensors")
      fs::copy_file(e.path(), dir / e.path().filename(), fs::copy_options::overwrite_existing);
  return dir;
}

void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(test::read_text(dir / "config.json"));
  edit(j);
  test::write_text(dir / "config.json", j.dump(2));
}

}  // namespace

// A reload writes the new checkpoint into the tensors the model holds (the same memory, so recorded graphs see the
// new weights): its logits are those of a model loaded from that checkpoint, bit for bit, and loading the first
// checkpoint again gives the first logits back.
TEST(WeightUpdate, ModelReloadIsTheNewCheckpointInTheSameMemory) {
  for (const std::string family : {"v2lite", "v3"}) {
    SCOPED_TRACE(family);
    const fs::path b = test::temp_dir("wu-b");
    test::write_scaled_checkpoint(family, b, 1.25f);
    const std::string a = test::golden_dir(family);
    auto be = make_cpu_backend();
    DeepseekModel m(ModelConfig::from_file(a), *be);
    m.load(a, {});
    const std::vector<float> la = model_logits(m);
    const void* q = m.layer_weights(1).kv_b_proj.data();
    const void* experts = m.layer_weights(1).experts_gate_up.data();
    const int64_t bytes = m.weight_bytes();

    m.reload(b.string());
    auto be2 = make_cpu_backend();
    DeepseekModel fresh(ModelConfig::from_file(b.string()), *be2);
    fresh.load(b.string(), {});
    const std::vector<float> lb = model_logits(m), want = model_logits(fresh);
    ASSERT_EQ(lb.size(), want.size());
    for (size_t i = 0; i < lb.size(); ++i) ASSERT_EQ(lb[i], want[i]) << "logit " << i;
    double moved = 0.0;
    for (size_t i = 0; i < lb.size(); ++i) moved = std::max(moved, static_cast<double>(std::fabs(lb[i] - la[i])));
    EXPECT_GT(moved, 1e-3) << "the new weights changed nothing";
    EXPECT_EQ(m.layer_weights(1).kv_b_proj.data(), q);
    EXPECT_EQ(m.layer_weights(1).experts_gate_up.data(), experts);
    EXPECT_EQ(m.weight_bytes(), bytes);

    m.reload(a);
    const std::vector<float> back = model_logits(m);
    for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], la[i]) << "logit " << i;
  }
}

// A checkpoint of another model (config.json differs in what the forward pass computes) is refused before any weight
// is written, naming the field; one whose tensors take other shapes names the tensor.
TEST(WeightUpdate, AnotherModelIsRefusedNamingTheDifference) {
  const std::string a = test::golden_dir("v2lite");
  auto be = make_cpu_backend();
  DeepseekModel m(ModelConfig::from_file(a), *be);
  m.load(a, {});
  const std::vector<float> la = model_logits(m);

  const fs::path scaled = copy_family("v2lite", "wu-cfg");
  edit_config(scaled, [](nlohmann::json& j) { j["routed_scaling_factor"] = 2.5; });
  std::string e = test::error_text([&] { m.reload(scaled.string()); });
  EXPECT_NE(e.find("describes another model"), std::string::npos) << e;
  EXPECT_NE(e.find("routed_scaling_factor: 1 vs 2.5"), std::string::npos) << e;

  e = test::error_text([&] { m.reload(test::golden_dir("v2")); });  // another family altogether
  EXPECT_NE(e.find("describes another model"), std::string::npos) << e;

  e = test::error_text([&] { m.reload((scaled / "nowhere").string()); });
  EXPECT_NE(e.find("nowhere"), std::string::npos) << e;

  const std::vector<float> after = model_logits(m);
  for (size_t i = 0; i < after.size(); ++i) ASSERT_EQ(after[i], la[i]) << "logit " << i;

  // The context length, the special tokens and the storage may differ.
  const fs::path longer = copy_family("v2lite", "wu-ctx");
  edit_config(longer, [](nlohmann::json& j) {
    j["max_position_embeddings"] = 12345;
    j["eos_token_id"] = 3;
  });
  m.reload(longer.string());
  const std::vector<float> same = model_logits(m);
  for (size_t i = 0; i < same.size(); ++i) ASSERT_EQ(same[i], la[i]) << "logit " << i;
}

// A failure part way (a tensor missing from a late layer, so earlier layers were written) makes every rank load the
// previous checkpoint again: the error names the tensor, the logits are the old ones, and a good update still works.
// If the previous checkpoint is gone too, every later step fails, saying why.
TEST(WeightUpdate, AFailurePartWayLoadsThePreviousWeightsAgain) {
  const fs::path a = copy_family("v2lite", "wu-a"), bad = test::temp_dir("wu-bad"), b = new_v2lite_weights("wu-good");
  test::rewrite_checkpoint("v2lite", bad, [](std::map<std::string, Tensor>& ts) {
    test::scale_projections(ts, 0.5f);  // new weights up to the last layer, then one missing
    ts.erase("model.layers.1.mlp.experts.5.down_proj.weight");
  });
  auto ranks = test::cpu_ranks_at(a.string(), /*tp=*/2);
  const std::vector<float> la = ranks_logits(*ranks);

  const std::string e = test::error_text([&] { ranks->reload_weights(bad.string()); });
  EXPECT_NE(e.find("missing tensor 'model.layers.1.mlp.experts.5.down_proj.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("loaded again"), std::string::npos) << e;
  EXPECT_EQ(ranks->model_dir(), a.string());
  const std::vector<float> after = ranks_logits(*ranks);
  for (size_t i = 0; i < after.size(); ++i) ASSERT_EQ(after[i], la[i]) << "logit " << i;

  ranks->reload_weights(b.string());
  EXPECT_EQ(ranks->model_dir(), b.string());
  auto fresh = test::cpu_ranks_at(b.string(), 2);
  const std::vector<float> lb = ranks_logits(*ranks), want = ranks_logits(*fresh);
  for (size_t i = 0; i < lb.size(); ++i) ASSERT_EQ(lb[i], want[i]) << "logit " << i;

  // Neither the new checkpoint nor the previous one loads: the ranks hold no model any more.
  fs::remove_all(b);
  const std::string lost = test::error_text([&] { ranks->reload_weights(bad.string()); });
  EXPECT_NE(lost.find("loading " + b.string() + " again failed too"), std::string::npos) << lost;
  const std::string step = test::error_text([&] { ranks_logits(*ranks); });
  EXPECT_NE(step.find("the model has no weights"), std::string::npos) << step;
}

namespace {

// The greedy tokens of `prompt` on an engine over `dir` (tp ranks, dp attention-DP groups).
std::vector<int32_t> reference_tokens(const std::string& dir, const std::vector<int32_t>& prompt, int32_t max_new,
                                      int32_t tp = 1, int32_t dp = 1) {
  Engine e(test::cpu_ranks_at(dir, tp, dp), test::small_engine_options(false));
  auto f = test::submit_ids(e, "ref", prompt, max_new);
  return test::wait_ids(f);
}

// The result an engine call (update_weights, release_memory, resume_memory) hands its callback.
WeightUpdateResult result_of(const std::function<void(std::function<void(const WeightUpdateResult&)>)>& call) {
  return test::callback_result<WeightUpdateResult>(call);
}

WeightUpdateResult update(EngineClient& e, const WeightUpdate& u) {
  return result_of([&](auto cb) { e.update_weights(u, std::move(cb)); });
}

}  // namespace

// Through the engine: a request running when the update is asked finishes on the old weights, one submitted after it
// waits and runs on the new ones (the same prompt: the prefix cache was flushed, so none of the old KV is reused), in
// every layout, with overlap scheduling on and off and decode graphs.
TEST(WeightUpdate, EngineFinishesRunningRequestsThenServesTheNewWeights) {
  const std::string a = test::golden_dir("v2lite");
  const fs::path b = new_v2lite_weights("wu-eng");
  const std::vector<int32_t> prompt{3, 14, 15, 92, 65, 35, 89, 79};
  struct Layout {
    int32_t tp, dp, graphs;
  };
  for (const Layout l : {Layout{1, 1, 0}, Layout{1, 1, 8}, Layout{2, 1, 0}, Layout{2, 2, 8}}) {
    const auto old_tokens = reference_tokens(a, prompt, 12, l.tp, l.dp);
    const auto new_tokens = reference_tokens(b.string(), prompt, 12, l.tp, l.dp);
    ASSERT_NE(old_tokens, new_tokens) << "the new weights must change the output";
    for (bool overlap : {false, true}) {
      SCOPED_TRACE(fmt::format("tp {} dp {} graphs {} overlap {}", l.tp, l.dp, l.graphs, overlap));
      Engine e(test::cpu_ranks_at(a, l.tp, l.dp, l.graphs), test::small_engine_options(overlap));
      auto running = test::submit_ids(e, "old", prompt, 12);
      auto done = std::make_shared<std::promise<WeightUpdateResult>>();
      auto fut = done->get_future();
      WeightUpdate u;
      u.model_path = b.string();
      e.update_weights(u, [done](const WeightUpdateResult& r) { done->set_value(r); });
      auto after = test::submit_ids(e, "new", prompt, 12);
      EXPECT_EQ(test::wait_ids(running), old_tokens);
      EXPECT_EQ(test::wait_ids(after), new_tokens);
      ASSERT_EQ(fut.wait_for(std::chrono::seconds(60)), std::future_status::ready);
      const WeightUpdateResult r = fut.get();
      EXPECT_TRUE(r.ok) << r.message;
      EXPECT_EQ(r.previous_model_path, a);
      // A failing update keeps serving the weights it had.
      WeightUpdate bad;
      bad.model_path = (b / "missing").string();
      const WeightUpdateResult rb = update(e, bad);
      EXPECT_FALSE(rb.ok);
      EXPECT_NE(rb.message.find("missing"), std::string::npos) << rb.message;
      auto again = test::submit_ids(e, "again", prompt, 12);
      EXPECT_EQ(test::wait_ids(again), new_tokens);
      test::expect_engine_idle_and_clean(e);
    }
  }
}

// abort_all_requests: the running request ends at once (aborted, saying why) instead of finishing first.
TEST(WeightUpdate, AbortAllRequestsEndsTheRunningOnesFirst) {
  const std::string a = test::golden_dir("v2lite");
  const fs::path b = new_v2lite_weights("wu-abort");
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap);
    Engine e(test::cpu_ranks_at(a), test::small_engine_options(overlap));
    auto finish = std::make_shared<std::promise<GenerateOutput>>();
    auto fut = finish->get_future();
    GenerateRequest g = test::ids_request("long", {1, 2, 3, 4}, 100000);
    g.on_output = [finish](const GenerateOutput& o) {
      if (o.finished) finish->set_value(o);
    };
    e.submit(std::move(g));
    while (e.stats()[0].num_running_reqs == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    WeightUpdate u;
    u.model_path = b.string();
    u.abort_all_requests = true;
    const WeightUpdateResult r = update(e, u);
    EXPECT_TRUE(r.ok) << r.message;
    ASSERT_EQ(fut.wait_for(std::chrono::seconds(60)), std::future_status::ready);
    const GenerateOutput o = fut.get();
    EXPECT_EQ(o.finish.kind, FinishKind::Abort);
    EXPECT_NE(o.finish.message.find("weight update"), std::string::npos) << o.finish.message;
    test::expect_engine_idle_and_clean(e);
  }
}

namespace {

// A replica that refuses every weight update (and serves nothing).
class RefusingReplica final : public EngineClient {
 public:
  void submit(GenerateRequest) override { throw Error("this replica serves nothing"); }
  void abort(const std::string&, FinishReason) override {}
  std::vector<RankStats> stats() const override { return {RankStats{}}; }
  bool flush_cache() override { return true; }
  void update_weights(WeightUpdate, std::function<void(const WeightUpdateResult&)> done) override {
    done(WeightUpdateResult{false, "this replica refuses", {}});
  }
  int64_t max_context_len() const override { return 4096; }
  std::vector<int32_t> eos_token_ids() const override { return {}; }
  void shutdown() override {}
};

}  // namespace

// --dp replicas: every replica takes the new weights; when one cannot, those updated before it load their previous
// weights again, so the replicas keep serving one model.
TEST(WeightUpdate, DpReplicasUpdateTogetherOrNotAtAll) {
  const std::string a = test::golden_dir("v2lite");
  const fs::path b = new_v2lite_weights("wu-dpb");
  const std::vector<int32_t> prompt{3, 14, 15, 92, 65, 35};
  const auto old_tokens = reference_tokens(a, prompt, 8);
  const auto new_tokens = reference_tokens(b.string(), prompt, 8);
  ASSERT_NE(old_tokens, new_tokens);
  EngineArgs args;
  args.model_path = a;
  args.device = "cpu";
  args.dp_size = 2;
  args.page_size = 8;
  args.max_total_tokens = 2048;
  auto e = make_engine(args);
  auto tokens_on = [](EngineClient& c, int32_t replica) {
    auto f = test::submit_ids(c, fmt::format("r{}", replica), {3, 14, 15, 92, 65, 35}, 8, replica);
    return test::wait_ids(f);
  };
  WeightUpdate u;
  u.model_path = b.string();
  WeightUpdateResult r = update(*e, u);
  ASSERT_TRUE(r.ok) << r.message;
  EXPECT_EQ(r.previous_model_path, a);
  EXPECT_EQ(tokens_on(*e, 0), new_tokens);
  EXPECT_EQ(tokens_on(*e, 1), new_tokens);
  e->shutdown();

  // Replica 1 refuses: replica 0, updated first, loads its previous weights again.
  std::vector<std::unique_ptr<EngineClient>> replicas;
  replicas.push_back(std::make_unique<Engine>(test::cpu_ranks_at(a), test::small_engine_options(true)));
  replicas.push_back(std::make_unique<RefusingReplica>());
  DpController dp(std::move(replicas), "round_robin");
  r = update(dp, u);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("replica 1: this replica refuses"), std::string::npos) << r.message;
  EXPECT_EQ(tokens_on(dp, 0), old_tokens);
  dp.shutdown();
}

namespace {

// Pauses the engine (SGLang's /pause_generation) and waits until it has; returns the tokens generated so far.
int64_t pause(EngineClient& e, PauseMode mode) {
  auto done = std::make_shared<std::promise<int64_t>>();
  auto fut = done->get_future();
  e.pause_generation(mode, [done, &e](bool ok) {
    EXPECT_TRUE(ok);
    int64_t n = 0;
    for (const RankStats& s : e.stats()) n += s.generation_tokens_total;
    done->set_value(n);
  });
  EXPECT_EQ(fut.wait_for(std::chrono::seconds(120)), std::future_status::ready) << "hang?";
  return fut.get();
}

int64_t total_steps(EngineClient& e) {
  int64_t n = 0;
  for (const RankStats& s : e.stats()) n = std::max(n, s.forward_steps);
  return n;
}

// A request's output, collected.
struct Collected {
  std::mutex mu;
  std::vector<int32_t> tokens;
  std::promise<GenerateOutput> finished;
};
std::shared_ptr<Collected> submit_collected(EngineClient& e, const std::string& rid, const std::vector<int32_t>& ids,
                                            int32_t max_new) {
  auto c = std::make_shared<Collected>();
  GenerateRequest g = test::ids_request(rid, ids, max_new);
  g.on_output = [c](const GenerateOutput& o) {
    std::lock_guard<std::mutex> lk(c->mu);
    c->tokens.insert(c->tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
    if (o.finished) c->finished.set_value(o);
  };
  e.submit(std::move(g));
  return c;
}
GenerateOutput wait_finished(Collected& c) {
  auto f = c.finished.get_future();
  EXPECT_EQ(f.wait_for(std::chrono::seconds(120)), std::future_status::ready) << "hang?";
  return f.get();
}

void wait_generating(EngineClient& e, int64_t tokens) {
  for (int i = 0; i < 20000; ++i) {
    int64_t n = 0;
    for (const RankStats& s : e.stats()) n += s.generation_tokens_total;
    if (n >= tokens) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ADD_FAILURE() << "never generated " << tokens << " tokens";
}

}  // namespace

// SGLang's /pause_generation: in place, no step runs (a request submitted meanwhile waits) and the requests go on
// after /continue_generation with the outputs they would have had; retracted, they are computed again (the same
// outputs); aborted, they end; vLLM's drain waits for them to finish. With and without overlap scheduling.
TEST(PauseGeneration, ModesKeepOrEndTheRequests) {
  const std::string a = test::golden_dir("v2lite");
  const std::vector<int32_t> prompt{3, 14, 15, 92, 65, 35, 89, 79};
  const auto want = reference_tokens(a, prompt, 40);
  const auto want_other = reference_tokens(a, {7, 7, 8}, 6);
  for (bool overlap : {false, true})
    for (PauseMode mode : {PauseMode::InPlace, PauseMode::Retract, PauseMode::Abort, PauseMode::Drain}) {
      SCOPED_TRACE(fmt::format("overlap {} mode {}", overlap, static_cast<int>(mode)));
      Engine e(test::cpu_ranks_at(a, 1, 1, 8), test::small_engine_options(overlap));
      auto running = submit_collected(e, "running", prompt, 40);
      wait_generating(e, 5);
      EXPECT_FALSE(e.is_paused());
      const int64_t at_pause = pause(e, mode);
      EXPECT_TRUE(e.is_paused());
      if (mode == PauseMode::Drain) {
        EXPECT_EQ(at_pause, 40);
      } else {
        EXPECT_LT(at_pause, 40) << "paused before the request's end";
      }
      const int64_t steps = total_steps(e);
      auto later = submit_collected(e, "later", {7, 7, 8}, 6);
      auto gone = submit_collected(e, "gone", {7, 7, 9}, 6);  // aborted while it waits: ends at once
      FinishReason bye;
      bye.kind = FinishKind::Abort;
      bye.message = "client left";
      e.abort("gone", bye);
      EXPECT_EQ(wait_finished(*gone).finish.message, "client left");
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      EXPECT_EQ(total_steps(e), steps) << "a step ran while paused";
      EXPECT_EQ(e.stats()[0].num_queue_reqs + e.stats()[0].num_running_reqs,
                mode == PauseMode::InPlace || mode == PauseMode::Retract ? 1 : 0);
      EXPECT_TRUE(e.continue_generation());
      EXPECT_FALSE(e.is_paused());
      const GenerateOutput last = wait_finished(*running);
      if (mode == PauseMode::Abort) {
        EXPECT_EQ(last.finish.kind, FinishKind::Abort);
        EXPECT_NE(last.finish.message.find("pause"), std::string::npos) << last.finish.message;
        std::lock_guard<std::mutex> lk(running->mu);
        EXPECT_EQ(running->tokens, std::vector<int32_t>(want.begin(), want.begin() + static_cast<long>(at_pause)));
      } else {
        std::lock_guard<std::mutex> lk(running->mu);
        EXPECT_EQ(running->tokens, want);
      }
      wait_finished(*later);
      {
        std::lock_guard<std::mutex> lk(later->mu);
        EXPECT_EQ(later->tokens, want_other);
      }
      if (mode == PauseMode::Retract) {
        EXPECT_GE(e.stats()[0].num_retractions, 1);
      }
      test::expect_engine_idle_and_clean(e);
    }
}

// The RL trainer's loop: pause (retract, or in place), update the weights (at once: the paused requests do not have to
// finish), continue. A retracted request is computed again on the new weights: its tokens up to the pause are the
// old model's, the rest the new model's continuation of them.
TEST(PauseGeneration, WeightsUpdatedWhilePaused) {
  const std::string a = test::golden_dir("v2lite");
  const fs::path b = new_v2lite_weights("wu-pause");
  const std::vector<int32_t> prompt{3, 14, 15, 92, 65, 35, 89, 79};
  const auto old_tokens = reference_tokens(a, prompt, 30);
  for (PauseMode mode : {PauseMode::Retract, PauseMode::InPlace})
    for (bool overlap : {false, true}) {
      SCOPED_TRACE(fmt::format("overlap {} mode {}", overlap, static_cast<int>(mode)));
      Engine e(test::cpu_ranks_at(a, 1, 1, 8), test::small_engine_options(overlap));
      auto running = submit_collected(e, "running", prompt, 30);
      wait_generating(e, 4);
      const int64_t k = pause(e, mode);
      ASSERT_LT(k, 30);
      // Waits in the inbox, behind the update (another prompt: requests paused in place keep their old KV, and their
      // prefix in the cache, as SGLang's in_place mode does).
      const std::vector<int32_t> other{9, 8, 7, 6, 5, 4, 3, 2, 1};
      auto later = submit_collected(e, "later", other, 6);
      WeightUpdate u;
      u.model_path = b.string();
      const WeightUpdateResult r = update(e, u);
      EXPECT_TRUE(r.ok) << r.message;
      EXPECT_TRUE(e.is_paused()) << "an update leaves the pause";
      e.continue_generation();
      wait_finished(*running);
      wait_finished(*later);
      {
        std::lock_guard<std::mutex> lk(later->mu);
        EXPECT_EQ(later->tokens, reference_tokens(b.string(), other, 6));
      }
      std::vector<int32_t> got;
      {
        std::lock_guard<std::mutex> lk(running->mu);
        got = running->tokens;
      }
      ASSERT_EQ(got.size(), 30u);
      EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + k),
                std::vector<int32_t>(old_tokens.begin(), old_tokens.begin() + k));
      if (mode == PauseMode::Retract) {
        std::vector<int32_t> resumed = prompt;
        resumed.insert(resumed.end(), old_tokens.begin(), old_tokens.begin() + k);
        EXPECT_EQ(std::vector<int32_t>(got.begin() + k, got.end()),
                  reference_tokens(b.string(), resumed, static_cast<int32_t>(30 - k)));
      } else {
        EXPECT_NE(got, old_tokens) << "the paused request went on with the new weights";
      }
      test::expect_engine_idle_and_clean(e);
    }
}

namespace {

using test::memory_op;

}  // namespace

// SGLang's /release_memory_occupation and /resume_memory_occupation (an RL trainer taking the GPU between rollouts):
// released, the weights' and KV cache's memory is gone (the CPU backend zeroes it), no step runs and requests wait,
// a weight update is refused; resumed, the weights are loaded again (the last checkpoint's) and the waiting request
// gets the answers of before, through graphs and with overlap scheduling too. Requests paused in place hold KV:
// releasing then is refused.
TEST(MemoryOccupation, ReleasedMemoryIsTakenAgainWithTheWeights) {
  const std::string a = test::golden_dir("v2lite");
  const fs::path b = new_v2lite_weights("wu-mem");
  const std::vector<int32_t> prompt{3, 14, 15, 92, 65, 35, 89, 79};
  const auto want_b = reference_tokens(b.string(), prompt, 10);
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap);
    Engine e(test::cpu_ranks_at(a, 2, 2, 8), test::small_engine_options(overlap));
    WeightUpdate u;
    u.model_path = b.string();
    ASSERT_TRUE(update(e, u).ok);
    auto first = test::submit_ids(e, "first", prompt, 10);
    EXPECT_EQ(test::wait_ids(first), want_b);

    WeightUpdateResult r = memory_op(e, true);
    ASSERT_TRUE(r.ok) << r.message;
    const int64_t steps = total_steps(e);
    auto waiting = submit_collected(e, "waiting", prompt, 10);
    r = update(e, u);
    EXPECT_FALSE(r.ok);
    EXPECT_NE(r.message.find("released"), std::string::npos) << r.message;
    EXPECT_EQ(total_steps(e), steps) << "a step ran on released memory";
    r = memory_op(e, false);
    ASSERT_TRUE(r.ok) << r.message;
    wait_finished(*waiting);
    {
      std::lock_guard<std::mutex> lk(waiting->mu);
      EXPECT_EQ(waiting->tokens, want_b);
    }
    EXPECT_FALSE(memory_op(e, false).ok) << "resumed twice";

    auto held = submit_collected(e, "held", prompt, 200);
    wait_generating(e, 30);
    pause(e, PauseMode::InPlace);
    r = memory_op(e, true);
    EXPECT_FALSE(r.ok);
    EXPECT_NE(r.message.find("paused in place"), std::string::npos) << r.message;
    e.continue_generation();
    EXPECT_EQ(wait_finished(*held).finish.kind, FinishKind::Length);
    test::expect_engine_idle_and_clean(e);
  }
}

// Dummy weights come back as they were (the same seed), and on two ranks.
TEST(MemoryOccupation, DummyWeightsComeBackTheSame) {
  const std::string a = test::golden_dir("v3");
  ParallelConfig pc;
  pc.tp_size = 2;
  pc.device = "cpu";
  LoadOptions lo;
  lo.dummy = true;
  lo.seed = 7;
  RankSet ranks(ModelConfig::from_file(a), pc, a, lo);
  const std::vector<float> before = ranks_logits(ranks);
  ranks.release_memory();
  EXPECT_TRUE(ranks.memory_released());
  const std::string step = test::error_text([&] { ranks_logits(ranks); });
  EXPECT_NE(step.find("released"), std::string::npos) << step;
  ranks.resume_memory();
  const std::vector<float> after = ranks_logits(ranks);
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) ASSERT_EQ(after[i], before[i]) << "logit " << i;
}

namespace {

std::vector<WeightValues> weights_of(EngineClient& e, const std::string& name, int64_t rows) {
  return test::callback_result<std::vector<WeightValues>>([&](auto cb) { e.get_weights(name, rows, std::move(cb)); });
}

}  // namespace

// SGLang's /get_weights_by_name underneath: every tensor of the checkpoint reads back as the checkpoint holds it, put
// together from the ranks of every layout (attention shards by rows or by columns, experts by width or whole under
// expert parallelism, attention-DP groups), and so do its first rows alone; a name the model does not hold is none.
TEST(GetWeights, EveryLayoutReadsTheCheckpointsTensors) {
  struct Layout {
    int32_t tp, dp;
    bool ep;
  };
  for (const std::string family : {"v3", "v2lite"}) {
    const std::string dir = test::golden_dir(family);
    const std::vector<std::string> names = Checkpoint(dir).names();
    for (const Layout& L : {Layout{1, 1, false}, Layout{2, 1, false}, Layout{2, 1, true}, Layout{2, 2, false}}) {
      SCOPED_TRACE(fmt::format("{} tp {} dp {}{}", family, L.tp, L.dp, L.ep ? " expert parallel" : ""));
      auto ranks = test::cpu_ranks_at(dir, L.tp, L.dp, 0, false, L.ep);
      for (const std::string& n : names) {
        const auto w = ranks->read_weight(n, 1 << 20);
        ASSERT_TRUE(w) << n;
        const std::vector<float> want = test::checkpoint_values(dir, n);
        ASSERT_EQ(w->values.size(), want.size()) << n;
        for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(w->values[i], want[i]) << n << ", value " << i;
      }
      const std::string o = "model.layers.1.self_attn.o_proj.weight";  // (columns: a shard of each rank)
      const auto w = ranks->read_weight(o, 3);
      ASSERT_TRUE(w);
      EXPECT_EQ(w->rows, 3);
      EXPECT_EQ(w->cols, w->full[1]);
      const std::vector<float> all = test::checkpoint_values(dir, o);
      EXPECT_EQ(w->values, std::vector<float>(all.begin(), all.begin() + 3 * w->cols));
      const auto norm = ranks->read_weight("model.norm.weight", 5);
      ASSERT_TRUE(norm);
      EXPECT_EQ(norm->rows, 1);
      const std::vector<float> norm_all = test::checkpoint_values(dir, "model.norm.weight");
      EXPECT_EQ(norm->values, std::vector<float>(norm_all.begin(), norm_all.begin() + 5));
      EXPECT_FALSE(ranks->read_weight("model.layers.1.self_attn.o_proj.weight_scale_inv", 3));
      EXPECT_FALSE(ranks->read_weight("lm_head.bias", 3));
    }
  }
}

// A read of more values than read_weight takes at once (a dummy model with a vocabulary that large) is refused naming
// the limit; fewer rows of the same tensor are read.
TEST(GetWeights, TooManyValuesAtOnceAreRefused) {
  const fs::path dir = test::temp_dir("gw-big");
  nlohmann::json j = nlohmann::json::parse(test::read_text(fs::path(test::golden_dir("v2lite")) / "config.json"));
  j["vocab_size"] = DeepseekModel::kMaxReadValues / j["hidden_size"].get<int64_t>() + 64;
  test::write_text(dir / "config.json", j.dump(2));
  ParallelConfig pc;
  pc.device = "cpu";
  LoadOptions lo;
  lo.dummy = true;
  RankSet ranks(ModelConfig::from_file(dir.string()), pc, dir.string(), lo);
  const std::string err = test::error_text([&] { ranks.read_weight("model.embed_tokens.weight", 1 << 30); });
  EXPECT_NE(err.find("at most 8388608"), std::string::npos) << err;
  const auto w = ranks.read_weight("model.embed_tokens.weight", 10);
  ASSERT_TRUE(w);
  EXPECT_EQ(w->rows, 10);
  EXPECT_EQ(w->values.size(), static_cast<size_t>(10 * j["hidden_size"].get<int64_t>()));
}

// Through the engine: one entry per DP rank (attention-DP groups, --dp replicas), each the checkpoint's rows; a name
// the model does not hold is refused naming it.
TEST(GetWeights, EveryDpRankAnswers) {
  const std::string a = test::golden_dir("v2lite");
  const std::string name = "model.layers.1.self_attn.kv_b_proj.weight";
  const std::vector<float> all = test::checkpoint_values(a, name);
  for (bool dpa : {true, false}) {
    SCOPED_TRACE(dpa ? "DP attention" : "DP replicas");
    EngineArgs args;
    args.model_path = a;
    args.device = "cpu";
    args.tp_size = dpa ? 2 : 1;
    args.dp_size = 2;
    args.enable_dp_attention = dpa;
    args.page_size = 8;
    args.max_total_tokens = 2048;
    auto e = make_engine(args);
    const std::vector<WeightValues> got = weights_of(*e, name, 4);
    ASSERT_EQ(got.size(), 2u);
    for (const WeightValues& v : got) {
      ASSERT_TRUE(v.ok) << v.message;
      EXPECT_EQ(v.rows, 4);
      ASSERT_EQ(v.shape.size(), 2u);
      EXPECT_EQ(v.values, std::vector<float>(all.begin(), all.begin() + 4 * v.shape[1]));
    }
    const std::vector<WeightValues> none = weights_of(*e, "model.layers.1.nothing.weight", 4);
    ASSERT_FALSE(none.empty());
    EXPECT_FALSE(none[0].ok);
    EXPECT_NE(none[0].message.find("no weight named 'model.layers.1.nothing.weight'"), std::string::npos)
        << none[0].message;
    e->shutdown();
  }
}
