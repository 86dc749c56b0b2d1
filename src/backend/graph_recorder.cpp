#include "backend/forwarding_backend.h"

#include "core/error.h"

namespace mlaserve {

void GraphRecorder::run(std::function<void()> op) {
  if (recording_) current_.push_back(std::move(op));
  else op();
}

void GraphRecorder::new_step(const char* what, const ForwardBatch& b, bool graph) {
  MLA_CHECK(!recording_, "{} while a graph is being recorded", what);
  graph_step_ = graph;
  staged_rows_ = -1;
  step_tokens_ = b.num_tokens();
}

void GraphRecorder::begin_step(const ForwardBatch& b) {
  new_step("begin_step", b, false);
  b_.begin_step(b);
}

void GraphRecorder::begin_substep(const ForwardBatch& b) {
  new_step("begin_substep", b, false);
  b_.begin_substep(b);
}

void GraphRecorder::begin_graph_step(const ForwardBatch& b) {
  new_step("begin_graph_step", b, true);
  MLA_CHECK(is_graph_batch(b),
            "a graph step is a decode batch: every sequence in the absorbed form, every token a logit row "
            "({} tokens, {} sequences)", b.num_tokens(), b.num_seqs());
  b_.begin_step(b);
}

void GraphRecorder::graph_capture_begin() {
  MLA_CHECK(graph_step_ && !recording_, "graph_capture_begin outside a graph step");
  recording_ = true;
  current_.clear();
}

int32_t GraphRecorder::graph_capture_end() {
  MLA_CHECK(recording_, "graph_capture_end without graph_capture_begin");
  recording_ = false;
  graphs_.push_back(std::move(current_));
  current_.clear();
  return static_cast<int32_t>(graphs_.size()) - 1;
}

void GraphRecorder::graph_replay(int32_t g) {
  MLA_CHECK(graph_step_ && !recording_, "graph_replay outside a graph step");
  MLA_CHECK(g >= 0 && g < static_cast<int32_t>(graphs_.size()), "graph {} does not exist", g);
  for (auto& op : graphs_[static_cast<size_t>(g)]) op();
}

void GraphRecorder::sample(const Tensor& l, std::span<const RowSampling> p, Tensor& i, Tensor* lp) {
  MLA_CHECK(!recording_, "sample while a graph is being recorded (a graph samples with stage_sample + sample_staged)");
  b_.sample(l, p, i, lp);
}

void GraphRecorder::stage_sample(std::span<const RowSampling> p, const Tensor* lp) {
  MLA_CHECK(!recording_, "stage_sample while a graph is being recorded (stage before graph_capture_begin)");
  staged_rows_ = check_staged_sample(p, lp, step_tokens_);
  staged_.assign(p.begin(), p.end());
  staged_logprobs_ = lp ? *lp : Tensor();
}

void GraphRecorder::sample_staged(const Tensor& l, Tensor& i) {
  check_sample_staged(l, i, staged_rows_);
  run([this, l, i]() mutable {  // (the rows staged before this run: a replay's own)
    const int64_t R = static_cast<int64_t>(staged_.size());
    MLA_CHECK(R <= l.size(0), "sample_staged: {} rows staged for a graph of {} logit rows", R, l.size(0));
    Tensor ids = i.rows(0, R);
    b_.sample(l.rows(0, R), staged_, ids, staged_logprobs_.defined() ? &staged_logprobs_ : nullptr);
  });
}

}  // namespace mlaserve
