// ModelConfig: every config.json field the DeepSeek V2 / V3 forward pass uses, validated, plus the values
// derived from them (YaRN frequencies, softmax scale, which layers are MoE).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace mlaserve {

enum class Architecture { DeepseekV2, DeepseekV3 };
enum class TopkMethod { Greedy, GroupLimitedGreedy, NoauxTc };
enum class ScoringFunc { Softmax, Sigmoid };
// Weights stored quantized in the checkpoint (config.json's quantization_config); they are dequantized to bf16 when
// loaded (the model computes in bf16 either way). Fp8Block: F8_E4M3 weights with `weight_scale_inv` per block of
// quant_block rows x cols (DeepSeek-V3's format); Fp8Tensor: F8_E4M3 weights with one `weight_scale` each (AutoFP8),
// or one per output channel; Awq: AutoAWQ's 4-bit "gemm" layout (`qweight` / `qzeros` / `scales` in groups of
// quant_group input channels). llm-compressor's compressed-tensors FP8 checkpoints are Fp8Tensor (tensor or channel
// strategy) or Fp8Block (block strategy, its scales named `weight_scale`), with quant_compressed_tensors set.
// Gptq: AutoGPTQ / GPTQModel's layout (`qweight` packed along the input channels, `qzeros`, `scales`, `g_idx`) of
// quant_bits-bit weights in groups of quant_group input channels (0: one group).
// CtInt: compressed-tensors' integer weights (pack-quantized / int-quantized), dequantized at load.
enum class QuantMethod { None, Fp8Block, Fp8Tensor, Awq, Gptq, CtInt };
struct ModelConfig;
// Whether --quantization `flag` names a checkpoint's own method (it then loads from its quantization_config): fp8 for
// an FP8 checkpoint (compressed-tensors too for one of llm-compressor's); awq, or the names SGLang and vLLM give their
// kernels for AWQ MoE checkpoints (awq_marlin, moe_wna16), for an AWQ one; gptq, gptq_marlin or moe_wna16 for a GPTQ
// one.
bool quantization_names(const std::string& flag, const ModelConfig& checkpoint);

struct RopeConfig {
  bool yarn = false;  // false: plain RoPE
  double theta = 10000.0;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;          // 0 = absent
  double mscale_all_dim = 0.0;  // 0 = absent
  double attention_factor = 0.0;  // 0 = derive
};

struct ModelConfig {
  Architecture arch = Architecture::DeepseekV2;
  std::string arch_name;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t moe_intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t q_lora_rank = 0;  // 0: plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_routed_experts = 0;  // 0: every layer dense
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  TopkMethod topk_method = TopkMethod::Greedy;
  ScoringFunc scoring_func = ScoringFunc::Softmax;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  std::vector<int64_t> eos_token_ids;
  int64_t bos_token_id = -1;
  int64_t num_nextn_predict_layers = 0;
  // Not from config.json: how many of the checkpoint's MTP (next-n prediction) layers this run loads and caches (0,
  // or 1 for speculative decoding with MTP drafts). The MTP layer is model.layers.{num_hidden_layers}: a decoder
  // layer behind enorm / hnorm / eh_proj, with its own latent cache layer after the model's.
  int64_t mtp_layers = 0;
  // Layers of the latent cache: the model's and the MTP layers used.
  int64_t num_cache_layers() const { return num_hidden_layers + mtp_layers; }
  QuantMethod quant = QuantMethod::None;
  int64_t quant_block_rows = 0, quant_block_cols = 0;  // Fp8Block
  bool quant_compressed_tensors = false;               // quant_method compressed-tensors (FP8 scales `weight_scale`)
  int64_t quant_group = 0;                             // Awq, Gptq
  int64_t quant_bits = 4;                              // Gptq: 2, 4 or 8
  int64_t quant_zero_offset = 1;                       // Gptq: 1 for "gptq" checkpoints (zeros stored - 1), 0 for v2

  // Parses DIR/config.json (or a file path). Throws naming the file and the field.
  static ModelConfig from_file(const std::string& path);
  // The same with config.json's top-level keys replaced by `overrides`' (an object; vLLM's --hf-overrides, SGLang's
  // --json-model-override-args: a shallow update, as both apply them).
  static ModelConfig from_file(const std::string& path, const nlohmann::json& overrides);
  static ModelConfig from_json(const nlohmann::json& j, const std::string& source);

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Values per token per layer in the latent KV cache: c_kv and the shared rotated k_pe.
  int64_t kv_cache_dim() const { return kv_lora_rank + qk_rope_head_dim; }
  // The MoE layers among the main model's, and layer `layer`'s place among them (-1: a dense layer).
  int64_t num_moe_layers() const { return moe_index(num_hidden_layers); }
  int64_t moe_index(int64_t layer) const {
    if (layer < num_hidden_layers && !is_moe_layer(layer)) return -1;
    int64_t m = 0;
    for (int64_t l = 0; l < layer && l < num_hidden_layers; ++l) m += is_moe_layer(l) ? 1 : 0;
    return m;
  }
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  // RoPE inverse frequencies [qk_rope_head_dim / 2] (YaRN-blended when rope.yarn).
  std::vector<float> rope_inv_freq() const;
  // Multiplier applied to cos/sin (YaRN attention factor; 1 for plain RoPE).
  double rope_attention_factor() const;
  // Attention softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN.
  double softmax_scale() const;
  std::string summary() const;
  // The first field (config.json's name and both values) in which `other` describes a different forward pass than
  // this config: what a checkpoint loaded into this model's weights in place must agree on. Empty when none does.
  // The context length, the special tokens and how the weights are stored (quantization) may differ.
  std::string forward_difference(const ModelConfig& other) const;
};

}  // namespace mlaserve
