#include "backend/forwarding_backend.h"

#include "core/error.h"

namespace mlaserve {

void GraphRecorder::run(std::function<void()> op) {
  if (recording_) current_.push_back(std::move(op));
  else op();
}

void GraphRecorder::begin_step(const ForwardBatch& b) {
  MLA_CHECK(!recording_, "begin_step while a graph is being recorded");
  graph_step_ = false;
  b_.begin_step(b);
}

void GraphRecorder::begin_substep(const ForwardBatch& b) {
  MLA_CHECK(!recording_, "begin_substep while a graph is being recorded");
  graph_step_ = false;
  b_.begin_substep(b);
}

void GraphRecorder::begin_graph_step(const ForwardBatch& b) {
  MLA_CHECK(!recording_, "begin_graph_step while a graph is being recorded");
  MLA_CHECK(is_graph_batch(b),
            "a graph step is a decode batch: every sequence in the absorbed form, every token a logit row "
            "({} tokens, {} sequences)", b.num_tokens(), b.num_seqs());
  graph_step_ = true;
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
  MLA_CHECK(!recording_, "sampling is not recorded in graphs (it runs after the replay)");
  b_.sample(l, p, i, lp);
}

}  // namespace mlaserve
