// DeepseekModel: the DeepSeek V2 / V3 decoder (MLA attention + MoE / dense MLP) composed from backend ops.
// It owns this rank's weight shards; the latent KV cache is passed in per call.
//
// One forward over a ragged ForwardBatch (T tokens, B sequences):
//   hidden[T,H] = embed(ids)                                     (vocab-parallel: all-reduce over TP)
//   per layer:  normed = rmsnorm(residual += hidden)
//               q[T, nh*(nope+rope)] = q_proj | q_b(rmsnorm(q_a(normed)))
//               latent[T, kvr+rope] = kv_a(normed) -> norm c_kv, rotate k_pe, write to cache slots
//               attn[T, nh*v] = MLA over the paged cache (expanded or absorbed form)
//               hidden = o_proj(attn)                             (all-reduce over attention TP)
//               normed = rmsnorm(residual += hidden)
//               hidden = MoE(normed) + shared(normed) | dense MLP  (all-reduce over TP)
//   logits[R, V] = lm_head(rmsnorm(residual + hidden)[logit_rows])
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "io/model_config.h"
#include "model/kv_cache.h"
#include "model/parallel_plan.h"
#include "parallel/communicator.h"

namespace mlaserve {

class Checkpoint;

struct LayerWeights {
  Tensor input_norm, post_norm;         // [H] F32
  Tensor q_proj;                        // [nh*(nope+rope), H]      (no q LoRA)
  Tensor q_a_proj, q_a_norm, q_b_proj;  // [qr, H], [qr], [nh*(nope+rope), qr]
  Tensor kv_a_proj;                     // [kvr+rope, H]
  Tensor kv_a_norm;                     // [kvr] F32
  Tensor kv_b_proj;                     // [nh*(nope+v), kvr]: per head W_UK rows then W_UV rows
  Tensor o_proj;                        // [H, nh*v]
  bool is_moe = false;
  Tensor mlp_gate_up, mlp_down;             // dense: [2*I, H], [H, I]
  Tensor router, router_bias;               // [E, H], [E] F32 (noaux_tc only)
  Tensor experts_gate_up, experts_down;     // [E, 2*Im, H], [E, H, Im] (+ the fused shared experts: E + ns)
  Tensor shared_gate_up, shared_down;       // [2*Is, H], [H, Is] (not with them fused)
};

struct LoadOptions {
  bool dummy = false;       // --load-format dummy: random weights from config.json alone
  uint64_t seed = 0;        // dummy weights' seed
  // FP8 block checkpoints' routed experts on a backend that takes them FP8 (Backend::takes_fp8_experts): On keeps
  // them FP8 (half the memory; the MoE kernels read them as they are: about bf16's speed at 1-4 tokens, slower at
  // more, docs/perf.md), Off dequantizes them at load like every other FP8 weight, Auto keeps them only when their
  // bf16 form would take more than half of the backend's free weight memory (--fp8-experts).
  enum class KeepQuantized { Auto, On, Off };
  KeepQuantized fp8_experts = KeepQuantized::Auto;
  // 4-bit checkpoints' routed experts (AWQ, GPTQ, compressed-tensors pack-quantized; groups in runs of columns) on a
  // backend that takes them INT4 (Backend::takes_int4_experts): On / Auto keep them INT4 where a rank's slices allow
  // (about a quarter of bf16's memory; the CUDA MoE kernels read the codes, faster than bf16 at decode), Off
  // dequantizes them at load (--int4-experts).
  KeepQuantized int4_experts = KeepQuantized::Auto;
  // The shared experts fused into the routed ones (--shared-experts-fusion; SGLang's --disable-shared-experts-fusion
  // is Off): a rank's slice of the n_shared_experts shared experts, whose width is that many routed experts', loads
  // as that many more routed experts in the same format, which every token takes with weight 1 (RouterParams::
  // n_fixed), so the MoE kernels read them as they read the routed ones (kept INT4 / FP8 too). On fuses wherever the
  // format allows (bf16, kept INT4 or an FP8 checkpoint's kept FP8 experts, the shared ones in the same groups /
  // blocks; not experts quantized at load; never under expert parallelism or past 16 ids a token), Auto only where
  // the routed experts are kept INT4 (measured, docs/perf.md), Off never. Every MoE layer or none.
  KeepQuantized shared_experts_fusion = KeepQuantized::Auto;
  // --quantization fp8 on a checkpoint without quantization: its routed experts quantized to FP8 at load
  // (cpu::quantize_fp8, blocks of 128, or the largest power of two down to 8 dividing a rank's expert width), kept FP8
  // on a backend that takes them unless fp8_experts is Off, else dequantized again (the same model in bf16).
  bool quantize_fp8 = false;
  // vLLM's --hf-overrides / SGLang's --json-model-override-args (a JSON object, empty: none): applied to the
  // config.json of a checkpoint reload() brings, as to the first one.
  std::string config_overrides = {};
};
// --fp8-experts / --int4-experts (`flag`) auto|on|off.
LoadOptions::KeepQuantized parse_keep_quantized(const std::string& s, const char* flag);

// A decode graph's sampling (DeepseekModel::forward_graph): recorded after the forward, it samples the rows staged
// before each replay.
struct GraphSampling {
  bool sample = true;                 // this rank samples (a group's other ranks only run `after`)
  std::span<const RowSampling> rows;  // this step's rows (at most the batch's tokens; row r samples logit row r)
  Tensor ids;                         // I32 [batch tokens]: row r's id at r (rows past the step's are not written)
  Tensor logprobs;                    // F32 [rows] (undefined: none)
  std::function<void()> after;        // recorded after the sampling (null: nothing)
  int32_t kind() const { return 1 + (sample ? 2 : 0) + (after ? 4 : 0); }
};

class DeepseekModel {
 public:
  // world_comm: all tp_size ranks (MLP / MoE, DP-attention gather); attn_comm: the attention-TP group (heads,
  // vocabulary). Both may be null when their group has one rank.
  DeepseekModel(ModelConfig config, Backend& backend, ParallelPlan plan = {}, Communicator* world_comm = nullptr,
                Communicator* attn_comm = nullptr);
  ~DeepseekModel();

  // Loads from DIR (config already parsed) or makes dummy weights.
  void load(const std::string& model_dir, const LoadOptions& opts);
  // Loads the checkpoint in DIR into the loaded weights in place (SGLang's /update_weights_from_disk): the same
  // tensors, so graphs recorded over them replay the new weights. DIR's config.json (with the load's
  // config_overrides) must describe the same forward pass (ModelConfig::forward_difference) and its weights must take
  // the same shapes and element types on this rank (FP8 experts kept or not as at load); else this throws naming
  // the difference. Mismatches of the config are found before any weight is written; a failure part way (a missing
  // or misshapen tensor, an unreadable file) leaves the weights mixed: the caller loads the previous checkpoint again.
  void reload(const std::string& model_dir);
  // Loads the weights the model holds again (from the last checkpoint loaded, or the same dummy weights) into the same
  // tensors: after Backend::resume_persistent, which gives their memory back zeroed.
  void refill();

  // Runs one step; returns F32 logits [batch.logit_rows.size(), vocab] in backend scratch memory (valid until
  // the next step; backend().to_host_f32 copies them out).
  // With DP attention (plan.dp_size > 1) `dp` gives every group's token count for this step; a group with no
  // tokens runs an IDLE forward (it joins every collective).
  Tensor forward(const ForwardBatch& batch, KvCache& cache, MlaForm form = MlaForm::Auto, const DpStepInfo* dp = nullptr);
  // The same for a decode batch through a graph of the backend (CUDA graphs): the first call for a token count
  // records the forward, later calls replay it on the new step's metadata. The batch is padded to the graph's
  // token count by the caller (pad_decode_batch); with DP attention every group has that count. Needs an eager
  // forward of this model before the first call.
  // With `sampling`, the graph also samples the step after the forward (Backend::stage_sample, sample_staged) and
  // then runs sampling->after (e.g. the broadcast of the ids to the group's other ranks), all recorded: graphs with
  // and without sampling, or with other such work, are kept apart.
  Tensor forward_graph(const ForwardBatch& batch, KvCache& cache, const DpStepInfo* dp = nullptr,
                       const GraphSampling* sampling = nullptr);
  // Speculative decoding with the checkpoint's MTP layer (config().mtp_layers == 1; SGLang's EAGLE / NEXTN, vLLM's
  // deepseek_mtp): after forward / forward_graph of a step, the MTP layer over the same tokens (the same batch, or
  // the padded one a graph ran), still in that step: row t reads next_ids[t], the token after token t (a negative id
  // -(k + 1): the id this step sampled for logit row k, on the device), and the model's final hidden state of row t
  // (after its norm), and writes the MTP layer's latent cache at row t's slot:
  //   h = eh_proj([enorm(embed(next_ids[t])); hnorm(final hidden[t])]) -> decoder layer num_hidden_layers
  //   logits[R, V] = lm_head(shared_head.norm(h)[logit_rows])    (the model's embedding and lm_head, as SGLang shares)
  // Row r's greedy token is the draft of the token after next_ids[logit_rows[r]].
  Tensor forward_draft(const ForwardBatch& batch, std::span<const int32_t> next_ids, KvCache& cache,
                       const DpStepInfo* dp = nullptr);
  // A chained draft (SGLang's --speculative-num-steps, vLLM's num_speculative_tokens above 1), still in that step,
  // after forward_draft or an earlier forward_draft_chain: the MTP layer again over `batch` (Backend::begin_substep),
  // one token per sequence whose input id -(k + 1) is drafts[k] (the previous draft, on the device) and whose hidden
  // state is row hidden_rows[i] of the previous MTP forward's output (after shared_head.norm, as SGLang chains it).
  // Its token sits one position after the previous one and writes the MTP layer's cache there. Logits as
  // forward_draft's.
  Tensor forward_draft_chain(const ForwardBatch& batch, std::span<const int32_t> hidden_rows, const Tensor& drafts,
                             KvCache& cache, const DpStepInfo* dp = nullptr);
  // Expert distribution recording (SGLang's --expert-distribution-recorder-mode): from now on every forward adds its
  // routed (token, expert) pairs per layer to counts (I64 [num_hidden_layers, n_routed_experts], persistent, zeroed
  // here; dense layers' rows stay 0; the MTP layer is not counted). Only real tokens count (ForwardBatch::moe_rows);
  // with DP attention every group's, as this rank routes all of them. Graphs recorded afterwards count too.
  void enable_expert_counts();
  // The counts (undefined until enable_expert_counts); zeroing or reading them is the caller's (on its stream).
  Tensor& expert_counts() { return expert_counts_; }
  int32_t num_graphs() const { return static_cast<int32_t>(graphs_.size()); }
  // Forgets the recorded graphs (they hold the KV cache and scratch they were recorded with); the backend's own
  // graphs go with Backend::release_graphs.
  void clear_graphs() { graphs_.clear(); }
  const ParallelPlan& plan() const { return plan_; }
  // The ids this rank's group sampled in its previous step, on the device (I32 [n]): input ids -(k + 1) of a
  // later batch read prev[k] (ForwardBatch::input_ids). Set once (after allocate_kv); undefined: no such ids.
  void set_prev_ids(Tensor prev) { prev_ids_ = std::move(prev); }
  // The last forward's final hidden state [T, H] (after the final norm), valid until the next step begins.
  const Tensor& last_hidden() const { return last_hidden_; }
  // SGLang's return_routed_experts: every forward of the main model keeps each MoE layer's routed expert ids of its
  // own rows ([MoE layers, T, router_params().ids_per_token()] I32 in last_routes(): the picks, then the fused shared
  // experts, if any; valid until the next step begins; with DP attention this group's rows). Call before graphs are
  // recorded (they record the copies).
  void enable_route_capture();
  bool captures_routes() const { return capture_routes_; }
  const Tensor& last_routes() const { return last_routes_; }

  const ModelConfig& config() const { return config_; }
  Backend& backend() { return backend_; }
  int64_t num_local_heads() const { return local_heads_; }
  const LayerWeights& layer_weights(int64_t l) const { return layers_.at(static_cast<size_t>(l)); }
  // Bytes of weights held by this rank.
  int64_t weight_bytes() const { return weight_bytes_; }
  // SGLang's /get_weights_by_name: the first `rows` rows of the checkpoint tensor `name` (of a vector: its first
  // `rows` elements) as this rank holds them, in F32: the values the model computes with (an FP8 or AWQ / GPTQ
  // weight dequantized as loaded; FP8 experts kept quantized as bf16(code * block scale)). `held` marks the elements
  // this rank holds (a tensor-parallel shard holds some; a replicated one all). nullopt: the model holds no tensor of
  // that name (lm_head.weight of tied embeddings is model.embed_tokens.weight). Waits for the device.
  struct WeightRows {
    Shape full;                  // the checkpoint tensor's shape
    int64_t rows = 0, cols = 0;  // of values: a vector's are 1 x (its elements read)
    std::vector<float> values;   // [rows, cols]
    std::vector<uint8_t> held;   // [rows, cols]
  };
  std::optional<WeightRows> read_weight(const std::string& name, int64_t rows);
  static constexpr int64_t kMaxReadValues = int64_t{1} << 23;  // read_weight refuses more

 private:
  class Loader;
  // load() and reload(): `from` is DIR's config (how its weights are stored may differ from config_'s on a reload).
  void load_weights(const std::string& model_dir, const ModelConfig& from, const LoadOptions& opts, bool reload);
  // The input norm and the attention: residual_out = residual + x, out = attention(rmsnorm(residual_out)) (normed:
  // scratch for the normalised rows). out may be x.
  void attention(int64_t layer, const Tensor& x, const Tensor& residual, Tensor& residual_out, Tensor& normed,
                 KvCache& cache, MlaForm form, Tensor& out);
  // The MLP of normalised rows x (dense, or the router and the experts), all-reduced over tensor-parallel ranks.
  void mlp(int64_t layer, const Tensor& x, Tensor& out);
  // The post-attention norm and the MLP: residual += x, out = mlp(rmsnorm(residual)) (normed: the normalised rows).
  // A MoE layer writes the sums to `spare` (inside the router's launch where the backend fuses them) and swaps the two.
  void norm_mlp(int64_t layer, const Tensor& x, Tensor& residual, Tensor& spare, Tensor& normed, Tensor& out);
  // DP attention: this group's rows in the world's gathered rows, and the gather buffers (scratch).
  struct DpRows {
    bool on = false;
    int64_t offset = 0, total = 0;
    Tensor gathered, gathered_out;
  };
  DpRows dp_rows(int64_t T, const DpStepInfo* dp);
  // Layer l over hidden [T, H] in place (attention, then the MLP; with DP attention over every group's rows).
  void decoder_layer(int64_t l, Tensor& hidden, Tensor& residual, Tensor& residual_next, Tensor& normed, KvCache& cache,
                     MlaForm form, DpRows& d);
  // The embeddings of the step's input ids [T, H] (scratch; vocab-parallel: all-reduced over attention TP).
  Tensor embed_tokens(int64_t T);
  // lm_head over the logit rows of the normalised rows [T, H]: F32 [R, vocab] (vocab-parallel: gathered).
  Tensor logits_of(const ForwardBatch& batch, const Tensor& normed);
  // The experts of the routed rows x, then the tensor-parallel all-reduce.
  void experts(int64_t layer, const Tensor& x, const Tensor& ids, const Tensor& weights, Tensor& out);
  void reduce_mlp(int64_t layer, Tensor& out);
  // The router's outputs for T rows (scratch): ids [T, k] I32, weights [T, k] F32.
  // The routing of MoE layers (the fused shared experts after the picks) and its ids / weights scratch.
  RouterParams router_params() const;
  void routing_scratch(int64_t T, Tensor& ids, Tensor& weights);
  static const Tensor* router_bias(const LayerWeights& w) { return w.router_bias.defined() ? &w.router_bias : nullptr; }
  // Validates the ids; true when some come from the previous step's samples (negative).
  bool check_ids(const ForwardBatch& batch) const;
  // prev_ids: replace the negative ids from the device first (always in a graph: a later replay may have them).
  Tensor forward_body(const ForwardBatch& batch, KvCache& cache, MlaForm form, const DpStepInfo* dp, bool prev_ids);
  struct Graph {
    int32_t id = -1;
    Tensor logits;  // where the replay leaves them
    Tensor hidden;  // and the final hidden state (forward_draft's input)
    Tensor routes;  // and the routed experts (enable_route_capture)
    const void* ids = nullptr;  // where its sampling writes the ids (GraphSampling::ids)
  };
  // By token count, Backend::graph_variant and what follows the forward (GraphSampling::kind).
  std::map<std::tuple<int64_t, int32_t, int32_t>, Graph> graphs_;

  ModelConfig config_;
  Backend& backend_;
  ParallelPlan plan_;
  Communicator* world_comm_;
  Communicator* attn_comm_;
  int64_t local_heads_ = 0, local_inter_ = 0, local_moe_inter_ = 0, local_shared_inter_ = 0, local_vocab_ = 0;
  // The routed experts this rank holds: [expert_begin_, expert_begin_ + local_experts_) (all but with expert
  // parallelism), each local_moe_inter_ wide.
  int64_t local_experts_ = 0, expert_begin_ = 0;
  int64_t fused_shared_ = 0;  // shared experts loaded as routed experts local_experts_ + j (LoadOptions)
  Tensor embed_, final_norm_, lm_head_;
  // The MTP layer's own weights (config_.mtp_layers == 1): enorm, hnorm, eh_proj's two column halves (the embedding's,
  // the hidden state's), shared_head.norm. Its decoder layer is layers_[num_hidden_layers].
  Tensor mtp_enorm_, mtp_hnorm_, mtp_eh_embed_, mtp_eh_hidden_, mtp_norm_;
  Tensor last_hidden_;  // the last forward's final hidden state [T, H] (after the norm; scratch of that step)
  bool capture_routes_ = false;
  Tensor routes_;        // during a forward of the main model with capture_routes_: [MoE layers, T, k]
  Tensor last_routes_;   // the last such forward's
  int64_t routes_offset_ = 0;  // this group's first row among the MoE's rows (DP attention)
  Tensor draft_hidden_;  // the last MTP forward's output (after shared_head.norm; scratch of that step)
  // Both MTP forwards need the layer loaded and its latent cache layer (what: the caller, for the message).
  void check_draft_layer(const char* what, const KvCache& cache) const;
  // The MTP layer over the step's input ids (set) and its input hidden state [T, H].
  Tensor draft_layer(const ForwardBatch& batch, const Tensor& hidden_in, KvCache& cache, const DpStepInfo* dp);
  std::vector<LayerWeights> layers_;
  // Every persistent tensor load() allocated, in its order: reload() writes into them again.
  std::vector<Tensor> held_;
  // Where each checkpoint tensor's blocks went (read_weight), recorded by the first load: a block of `full` from
  // (r0, c0) held in `dst` [rows, cols]; FP8 codes with `scales` [ceil(rows / br), ceil(cols / bc)].
  struct Placement {
    Shape full;
    int64_t r0 = 0, c0 = 0;
    Tensor dst, scales;
    int64_t br = 0, bc = 0;
    Tensor zeros;  // INT4 (dst: code pairs in U8)
  };
  std::unordered_map<std::string, std::vector<Placement>> placements_;
  LoadOptions load_opts_;  // the first load's
  std::string weights_dir_;     // where the weights came from (the last load or reload)
  bool weights_dummy_ = false;  // and whether they are load_opts_'s dummy weights
  bool keep_fp8_ = false;  // FP8 block checkpoints' routed experts kept FP8 (decided at the first load)
  bool keep_int4_ = false;  // 4-bit checkpoints' routed experts kept INT4 (likewise)
  int64_t weight_bytes_ = 0;
  Tensor prev_ids_;
  Tensor expert_counts_;  // enable_expert_counts
};

}  // namespace mlaserve
