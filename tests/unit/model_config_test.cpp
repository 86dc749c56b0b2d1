#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <nlohmann/json.hpp>

#include "io/model_config.h"
#include "json_mutation.h"
#include "test_util.h"

using namespace mlaserve;
using json = nlohmann::json;

namespace {

// DeepSeek-V2-Lite's config.json values (the fields the forward pass reads).
json v2_lite() {
  return json::parse(R"({
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": null, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "norm_topk_prob": false, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
    "scoring_func": "softmax", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "tie_word_embeddings": false, "bos_token_id": 100000, "eos_token_id": 100001})");
}

json v3() {
  json j = v2_lite();
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j["hidden_size"] = 7168;
  j["num_attention_heads"] = 128;
  j["q_lora_rank"] = 1536;
  j["n_routed_experts"] = 256;
  j["n_shared_experts"] = 1;
  j["num_experts_per_tok"] = 8;
  j["n_group"] = 8;
  j["topk_group"] = 4;
  j["topk_method"] = "noaux_tc";
  j["scoring_func"] = "sigmoid";
  j["norm_topk_prob"] = true;
  j["routed_scaling_factor"] = 2.5;
  j["first_k_dense_replace"] = 3;
  j["rope_scaling"]["mscale"] = 1.0;
  j["rope_scaling"]["mscale_all_dim"] = 1.0;
  return j;
}

std::string error_of(const json& j) {
  try {
    ModelConfig::from_json(j, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ModelConfig, V2LiteDerivedValues) {
  ModelConfig c = ModelConfig::from_json(v2_lite(), "config.json");
  EXPECT_EQ(c.arch, Architecture::DeepseekV2);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.kv_cache_dim(), 576);
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_EQ(c.topk_method, TopkMethod::Greedy);
  // Softmax scale from the notes: 192^-0.5 * mscale(40, 0.707)^2.
  EXPECT_NEAR(c.softmax_scale(), 0.114721, 1e-6);
  EXPECT_NEAR(c.rope_attention_factor(), 1.0, 1e-12);  // mscale == mscale_all_dim
  auto f = c.rope_inv_freq();
  ASSERT_EQ(f.size(), 32u);
  EXPECT_FLOAT_EQ(f[0], 1.0f);                                // fastest pair extrapolates
  EXPECT_NEAR(f[31], std::pow(10000.0, -62.0 / 64) / 40, 1e-12);  // slowest pair fully interpolated
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{100001}));
}

TEST(ModelConfig, V3Values) {
  ModelConfig c = ModelConfig::from_json(v3(), "config.json");
  EXPECT_EQ(c.arch, Architecture::DeepseekV3);
  EXPECT_EQ(c.topk_method, TopkMethod::NoauxTc);
  EXPECT_EQ(c.scoring_func, ScoringFunc::Sigmoid);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_NEAR(c.softmax_scale(), 0.135234, 1e-6);
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
}

// Kimi-K2's config.json (model_type kimi_k2, DeepseekV3ForCausalLM): 64 heads, 384 experts in one group, FP8 blocks.
TEST(ModelConfig, KimiK2Values) {
  ModelConfig c = ModelConfig::from_json(json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": false,
    "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384,
    "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_group": 1,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 163840})"),
                                         "config.json");
  EXPECT_EQ(c.arch, Architecture::DeepseekV3);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.n_routed_experts, 384);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.827);
  EXPECT_EQ(c.topk_method, TopkMethod::NoauxTc);
  EXPECT_EQ(c.scoring_func, ScoringFunc::Sigmoid);
  EXPECT_EQ(c.quant, QuantMethod::Fp8Block);
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_DOUBLE_EQ(c.rope.factor, 32.0);
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{163585}));
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
}

TEST(ModelConfig, MoeLayerFrequency) {
  json j = v2_lite();
  j["moe_layer_freq"] = 2;
  ModelConfig c = ModelConfig::from_json(j, "config.json");
  EXPECT_FALSE(c.is_moe_layer(1));
  EXPECT_TRUE(c.is_moe_layer(2));
  EXPECT_FALSE(c.is_moe_layer(3));
}

TEST(ModelConfig, RopeVariants) {
  json j = v2_lite();
  j["rope_scaling"] = nullptr;
  ModelConfig c = ModelConfig::from_json(j, "config.json");
  EXPECT_FALSE(c.rope.yarn);
  EXPECT_NEAR(c.softmax_scale(), 1.0 / std::sqrt(192.0), 1e-9);
  EXPECT_FLOAT_EQ(c.rope_inv_freq()[1], static_cast<float>(std::pow(10000.0, -2.0 / 64)));
  // transformers 5 spelling.
  j = v2_lite();
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 40}, {"original_max_position_embeddings", 4096},
                          {"mscale", 0.707}, {"mscale_all_dim", 0.707}, {"rope_theta", 10000}};
  c = ModelConfig::from_json(j, "config.json");
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_NEAR(c.softmax_scale(), 0.114721, 1e-6);
  // Without mscale / mscale_all_dim, cos/sin are scaled by mscale(factor) as transformers does.
  j["rope_parameters"].erase("mscale");
  j["rope_parameters"].erase("mscale_all_dim");
  c = ModelConfig::from_json(j, "config.json");
  EXPECT_NEAR(c.rope_attention_factor(), 0.1 * std::log(40.0) + 1.0, 1e-9);
  j["rope_parameters"]["rope_type"] = "linear";
  EXPECT_NE(error_of(j).find("'linear' is not supported"), std::string::npos);
}

TEST(ModelConfig, QuantizationConfigs) {
  json j = v3();
  EXPECT_EQ(ModelConfig::from_json(j, "config.json").quant, QuantMethod::None);
  j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                              {"weight_block_size", {128, 64}}};
  ModelConfig c = ModelConfig::from_json(j, "config.json");
  EXPECT_EQ(c.quant, QuantMethod::Fp8Block);
  EXPECT_EQ(c.quant_block_rows, 128);
  EXPECT_EQ(c.quant_block_cols, 64);
  EXPECT_NE(c.summary().find("FP8 weights in 128x64 blocks"), std::string::npos) << c.summary();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "static"},
                              {"ignored_layers", {"lm_head"}}};
  EXPECT_EQ(ModelConfig::from_json(j, "config.json").quant, QuantMethod::Fp8Tensor);
  j["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}, {"group_size", 64}, {"zero_point", true},
                              {"version", "gemm"}, {"modules_to_not_convert", nullptr}};
  c = ModelConfig::from_json(j, "config.json");
  EXPECT_EQ(c.quant, QuantMethod::Awq);
  EXPECT_EQ(c.quant_group, 64);
  j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128}, {"desc_act", true},
                              {"sym", true}};
  c = ModelConfig::from_json(j, "config.json");
  EXPECT_EQ(c.quant, QuantMethod::Gptq);
  EXPECT_EQ(c.quant_group, 128);
  EXPECT_EQ(c.quant_bits, 4);
  EXPECT_EQ(c.quant_zero_offset, 1);
  EXPECT_NE(c.summary().find("GPTQ 4-bit weights in groups of 128"), std::string::npos) << c.summary();
  j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 8}, {"group_size", -1},
                              {"checkpoint_format", "gptq_v2"}};
  c = ModelConfig::from_json(j, "config.json");
  EXPECT_EQ(c.quant_group, 0);
  EXPECT_EQ(c.quant_bits, 8);
  EXPECT_EQ(c.quant_zero_offset, 0);
}

// --quantization values that name a checkpoint's own method (serve accepts them and loads the checkpoint as it is).
TEST(ModelConfig, QuantizationFlagNamesTheCheckpointsMethod) {
  auto ckpt = [](QuantMethod q, bool compressed_tensors = false) {
    ModelConfig c;
    c.quant = q;
    c.quant_compressed_tensors = compressed_tensors;
    return c;
  };
  for (QuantMethod q : {QuantMethod::Fp8Block, QuantMethod::Fp8Tensor}) {
    EXPECT_TRUE(quantization_names("fp8", ckpt(q)));
    EXPECT_FALSE(quantization_names("awq", ckpt(q)));
    EXPECT_FALSE(quantization_names("compressed-tensors", ckpt(q)));
    EXPECT_TRUE(quantization_names("compressed-tensors", ckpt(q, true)));  // vLLM's name for llm-compressor's
    EXPECT_TRUE(quantization_names("fp8", ckpt(q, true)));
  }
  for (const char* f : {"awq", "awq_marlin", "moe_wna16"}) {
    EXPECT_TRUE(quantization_names(f, ckpt(QuantMethod::Awq))) << f;
    EXPECT_FALSE(quantization_names(f, ckpt(QuantMethod::None))) << f;
    EXPECT_FALSE(quantization_names(f, ckpt(QuantMethod::Fp8Block))) << f;
  }
  for (const char* f : {"gptq", "gptq_marlin", "moe_wna16"}) {
    EXPECT_TRUE(quantization_names(f, ckpt(QuantMethod::Gptq))) << f;
    EXPECT_FALSE(quantization_names(f, ckpt(QuantMethod::Fp8Tensor))) << f;
  }
  EXPECT_FALSE(quantization_names("awq", ckpt(QuantMethod::Gptq)));
  for (const char* f : {"fp8", "gptq", "gptq_marlin", "w8a8_int8", "compressed-tensors", ""}) {
    EXPECT_FALSE(quantization_names(f, ckpt(QuantMethod::Awq))) << f;
    EXPECT_FALSE(quantization_names(f, ckpt(QuantMethod::None))) << f;
  }
}

// llm-compressor's compressed-tensors FP8 checkpoints: the weights' strategy picks the scales' reading; other schemes
// (integer or group-wise weights, zero points, packed formats, groups that disagree) are refused naming the field.
TEST(ModelConfig, CompressedTensorsFp8) {
  json j = v3();
  auto with = [](json base, const json& more) {  // base's keys replaced by more's
    base.update(more);
    return base;
  };
  auto ct = [](json weights) {
    const json input{{"num_bits", 8}, {"type", "float"}, {"strategy", "tensor"}, {"dynamic", false}};
    return json{{"quant_method", "compressed-tensors"}, {"format", "float-quantized"}, {"ignore", {"lm_head"}},
                {"config_groups",
                 {{"group_0", {{"targets", {"Linear"}}, {"weights", weights}, {"input_activations", input}}}}}};
  };
  const json fp8 = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true}, {"dynamic", false}};
  for (const char* strategy : {"tensor", "channel"}) {
    j["quantization_config"] = ct(with(fp8, {{"strategy", strategy}}));
    const ModelConfig c = ModelConfig::from_json(j, "config.json");
    EXPECT_EQ(c.quant, QuantMethod::Fp8Tensor) << strategy;
    EXPECT_TRUE(c.quant_compressed_tensors);
  }
  j["quantization_config"] = ct(with(fp8, {{"strategy", "block"}, {"block_structure", {128, 64}}}));
  ModelConfig c = ModelConfig::from_json(j, "config.json");
  EXPECT_EQ(c.quant, QuantMethod::Fp8Block);
  EXPECT_EQ(c.quant_block_rows, 128);
  EXPECT_EQ(c.quant_block_cols, 64);
  EXPECT_TRUE(c.quant_compressed_tensors);
  // Errors, each naming what is not supported.
  const std::pair<json, const char*> bad[] = {
      {ct(with(fp8, {{"strategy", "group"}, {"group_size", 128}})), "strategy 'group' is not supported"},
      {ct(with(fp8, {{"strategy", "channel"}, {"type", "int"}, {"num_bits", 4}})),
       "format 'float-quantized' is not supported for integer weights"},
      {ct(with(fp8, {{"strategy", "channel"}, {"symmetric", false}})), "symmetric false"},
      {ct(with(fp8, {{"strategy", "channel"}, {"dynamic", true}})), "dynamic true"},
      {ct(with(fp8, {{"strategy", "block"}, {"block_structure", {128}}})), "block_structure must be"},
      {with(ct(with(fp8, {{"strategy", "channel"}})), {{"format", "pack-quantized"}}),
       "format 'pack-quantized' is not supported"},
      {json{{"quant_method", "compressed-tensors"}, {"format", "float-quantized"}}, "config_groups must name"},
  };
  for (const auto& [q, want] : bad) {
    j["quantization_config"] = q;
    EXPECT_NE(error_of(j).find(want), std::string::npos) << error_of(j);
  }
  json two = ct(with(fp8, {{"strategy", "channel"}}));
  two["config_groups"]["group_1"] = two["config_groups"]["group_0"];
  two["config_groups"]["group_1"]["weights"].update({{"strategy", "block"}, {"block_structure", {128, 128}}});
  j["quantization_config"] = two;
  EXPECT_NE(error_of(j).find("groups with different weight scales"), std::string::npos) << error_of(j);
  two["config_groups"]["group_1"]["weights"] = with(fp8, {{"strategy", "tensor"}});  // tensor + channel: fine
  j["quantization_config"] = two;
  EXPECT_EQ(ModelConfig::from_json(j, "config.json").quant, QuantMethod::Fp8Tensor);
}

// compressed-tensors integer weights (llm-compressor's W4A16 / W8A16 / W8A8): pack-quantized 2 / 4 / 8 bits or
// int-quantized 8 bits, groups / channels / tensor, symmetric or not; mixed bits or float groups are refused.
TEST(ModelConfig, CompressedTensorsIntegers) {
  json j = v2_lite();
  auto ct = [](const std::string& format, json weights) {
    return json{{"quant_method", "compressed-tensors"}, {"format", format}, {"ignore", {"lm_head"}},
                {"config_groups", {{"group_0", {{"targets", {"Linear"}}, {"weights", weights}}}}}};
  };
  const json w4 = {{"num_bits", 4}, {"type", "int"}, {"symmetric", true}, {"strategy", "group"}, {"group_size", 128},
                   {"dynamic", false}, {"actorder", nullptr}};
  j["quantization_config"] = ct("pack-quantized", w4);
  ModelConfig c = ModelConfig::from_json(j, "config.json");
  EXPECT_EQ(c.quant, QuantMethod::CtInt);
  EXPECT_EQ(c.quant_bits, 4);
  EXPECT_TRUE(c.quant_compressed_tensors);
  EXPECT_TRUE(quantization_names("compressed-tensors", c));
  EXPECT_TRUE(quantization_names("moe_wna16", c));
  EXPECT_FALSE(quantization_names("fp8", c));
  json w8 = w4;
  w8.update({{"num_bits", 8}, {"strategy", "channel"}, {"symmetric", false}});
  w8.erase("group_size");
  j["quantization_config"] = ct("int-quantized", w8);
  EXPECT_EQ(ModelConfig::from_json(j, "config.json").quant_bits, 8);
  json two = ct("pack-quantized", w4);
  two["config_groups"]["group_1"] = {{"targets", {"Linear"}}, {"weights", w8}};
  j["quantization_config"] = two;
  EXPECT_NE(error_of(j).find("4 and 8 bits in one checkpoint"), std::string::npos) << error_of(j);
  json w3 = w4;
  w3["num_bits"] = 3;
  j["quantization_config"] = ct("pack-quantized", w3);
  EXPECT_NE(error_of(j).find("3-bit integer weights are not supported (pack-quantized: 2, 4 or 8 bits)"),
            std::string::npos) << error_of(j);
  j["quantization_config"] = ct("int-quantized", w4);
  EXPECT_NE(error_of(j).find("4-bit integer weights are not supported (int-quantized: 8 bits)"), std::string::npos)
      << error_of(j);
  json nogroup = w4;
  nogroup.erase("group_size");
  j["quantization_config"] = ct("pack-quantized", nogroup);
  EXPECT_NE(error_of(j).find("group_size must be a positive integer"), std::string::npos) << error_of(j);
  json block = w4;
  block["strategy"] = "block";
  j["quantization_config"] = ct("pack-quantized", block);
  EXPECT_NE(error_of(j).find("strategy 'block' is not supported for integer weights"), std::string::npos)
      << error_of(j);
  json mixed = ct("pack-quantized", w4);
  mixed["config_groups"]["group_1"] = {{"weights", {{"num_bits", 8}, {"type", "float"}, {"strategy", "tensor"}}}};
  j["quantization_config"] = mixed;
  EXPECT_NE(error_of(j).find("float weights beside integer ones"), std::string::npos) << error_of(j);
}

TEST(ModelConfig, ClearErrors) {
  json j = v2_lite();
  j["architectures"] = {"LlamaForCausalLM"};
  EXPECT_NE(error_of(j).find("unsupported architecture 'LlamaForCausalLM'"), std::string::npos);

  j = v2_lite();
  j["quantization_config"] = {{"quant_method", "gptq-marlin"}, {"bits", 4}};
  auto e = error_of(j);
  EXPECT_NE(e.find("quant_method 'gptq-marlin' is not supported"), std::string::npos) << e;
  j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 3}};
  EXPECT_NE(error_of(j).find("GPTQ with 3 bits is not supported"), std::string::npos);
  j["quantization_config"] = {{"quant_method", "gptq"}, {"group_size", 0}};
  EXPECT_NE(error_of(j).find("group_size must be positive or -1"), std::string::npos);
  j["quantization_config"] = {{"quant_method", "gptq"}, {"checkpoint_format", "marlin"}};
  EXPECT_NE(error_of(j).find("checkpoint_format 'marlin' is not supported"), std::string::npos);
  j["quantization_config"] = {{"quant_method", "awq"}, {"bits", 8}};
  EXPECT_NE(error_of(j).find("AWQ with 8 bits is not supported"), std::string::npos);
  j["quantization_config"] = {{"quant_method", "awq"}, {"version", "gemv"}};
  EXPECT_NE(error_of(j).find("AWQ version 'gemv' is not supported"), std::string::npos);
  j["quantization_config"] = {{"quant_method", "awq"}, {"zero_point", false}};
  EXPECT_NE(error_of(j).find("without zero points"), std::string::npos);
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 0}}};
  EXPECT_NE(error_of(j).find("weight_block_size must be two positive integers"), std::string::npos);
  j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e5m2"}};
  EXPECT_NE(error_of(j).find("fmt 'e5m2' is not supported"), std::string::npos);

  j = v2_lite();
  j.erase("kv_lora_rank");
  EXPECT_NE(error_of(j).find("missing required field 'kv_lora_rank'"), std::string::npos);
  j = v2_lite();
  j["hidden_size"] = "big";
  EXPECT_NE(error_of(j).find("'hidden_size' must be an integer"), std::string::npos);
  j = v2_lite();
  j["topk_method"] = "magic";
  EXPECT_NE(error_of(j).find("unknown topk_method 'magic'"), std::string::npos);
  j = v3();
  j["n_group"] = 7;
  EXPECT_NE(error_of(j).find("divisible by n_group"), std::string::npos);
  j = v2_lite();
  j["num_experts_per_tok"] = 65;
  EXPECT_NE(error_of(j).find("num_experts_per_tok"), std::string::npos);
  // Sizes past any model are refused by name (a vocabulary of 2^62 made byte counts wrap and the server start).
  j = v2_lite();
  j["vocab_size"] = int64_t{1} << 62;
  e = error_of(j);
  EXPECT_NE(e.find("field 'vocab_size' is 4611686018427387904, more than mlaserve supports"), std::string::npos) << e;
  j = v2_lite();
  j["num_hidden_layers"] = 100000000;
  EXPECT_NE(error_of(j).find("field 'num_hidden_layers' is 100000000, more than"), std::string::npos);
  j = v2_lite();
  j["hidden_size"] = 1e30;
  EXPECT_NE(error_of(j).find("field 'hidden_size' is 1e+30, out of range"), std::string::npos) << error_of(j);
  // Real values out of range are refused by name (they made every logit NaN).
  j = v2_lite();
  j["rope_theta"] = -1e300;
  EXPECT_NE(error_of(j).find("field 'rope_theta' is -1e+300, expected a positive number"), std::string::npos)
      << error_of(j);
  j = v2_lite();
  j["rope_scaling"]["beta_slow"] = -1;
  EXPECT_NE(error_of(j).find("field 'rope_scaling.beta_slow' is -1"), std::string::npos) << error_of(j);
  j = v2_lite();
  j["rms_norm_eps"] = -1e-6;
  EXPECT_NE(error_of(j).find("field 'rms_norm_eps' is -1e-06, expected a number >= 0"), std::string::npos)
      << error_of(j);
  j = v2_lite();
  j["kv_lora_rank"] = uint64_t{18446744073709551615u};
  EXPECT_NE(error_of(j).find("field 'kv_lora_rank' is 18446744073709551615, out of range"), std::string::npos);
}

TEST(ModelConfig, FromFileNamesThePath) {
  auto dir = test::temp_dir("cfg");
  try {
    ModelConfig::from_file(dir.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json not found"), std::string::npos);
  }
  test::write_text(dir / "config.json", "{oops");
  try {
    ModelConfig::from_file(dir.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos);
  }
  ModelConfig c = ModelConfig::from_file(test::golden_dir("v3"));
  EXPECT_EQ(c.arch, Architecture::DeepseekV3);
}

// config.json files with random fields replaced by values of other types and ranges, removed, or added: each is either
// read or refused with an Error (what the server prints naming the file), never another exception (a JSON library
// type error, a bad_alloc, ...) and never a crash; what is read is a forward pass the model can be built for.
TEST(ModelConfig, MutatedConfigsAreReadOrRefusedClearly) {
  std::vector<json> bases = {v2_lite(), v3()};
  json q = v3();
  q["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                              {"weight_block_size", {128, 128}}};
  bases.push_back(q);
  q["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}, {"group_size", 64}, {"zero_point", true},
                              {"version", "gemm"}};
  bases.push_back(q);
  q["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128}, {"desc_act", false},
                              {"sym", true}};
  bases.push_back(q);
  q["quantization_config"] = {
      {"quant_method", "compressed-tensors"}, {"format", "pack-quantized"}, {"ignore", {"lm_head"}},
      {"config_groups",
       {{"group_0",
         {{"targets", {"Linear"}},
          {"weights", {{"num_bits", 4}, {"type", "int"}, {"symmetric", true}, {"strategy", "group"},
                       {"group_size", 128}, {"dynamic", false}}}}}}}};
  bases.push_back(q);
  q = v2_lite();
  q["eos_token_id"] = {100001, 100002};
  q["rope_scaling"] = nullptr;
  bases.push_back(q);
  const std::vector<json> values = test::edge_values({"yarn", "fp8", "128", json{{"type", "yarn"}}});
  std::mt19937_64 rng(20261207);
  int64_t read = 0, refused = 0;
  for (int it = 0; it < 4000; ++it) {
    json j = bases[rng() % bases.size()];
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) test::mutate_json(j, rng, values);
    try {
      const ModelConfig c = ModelConfig::from_json(j, "config.json");
      ++read;
      // What the model's shapes are made of is positive and consistent.
      EXPECT_GT(c.hidden_size, 0) << j.dump();
      EXPECT_GT(c.num_hidden_layers, 0) << j.dump();
      EXPECT_GT(c.num_attention_heads, 0) << j.dump();
      EXPECT_GT(c.vocab_size, 0) << j.dump();
      EXPECT_GT(c.kv_lora_rank, 0) << j.dump();
      EXPECT_GT(c.qk_rope_head_dim, 0) << j.dump();
      EXPECT_EQ(c.qk_rope_head_dim % 2, 0) << j.dump();
      EXPECT_GT(c.v_head_dim, 0) << j.dump();
      EXPECT_GE(c.moe_layer_freq, 1) << j.dump();
      if (c.num_moe_layers() > 0) {
        EXPECT_GE(c.num_experts_per_tok, 1) << j.dump();
        EXPECT_LE(c.num_experts_per_tok, c.n_routed_experts) << j.dump();
        EXPECT_GT(c.moe_intermediate_size, 0) << j.dump();
      }
      EXPECT_TRUE(std::isfinite(c.softmax_scale()) && c.softmax_scale() > 0) << j.dump();
      for (float f : c.rope_inv_freq()) ASSERT_TRUE(std::isfinite(f)) << j.dump();
      EXPECT_FALSE(c.summary().empty());
    } catch (const Error& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what() << "\n" << j.dump();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a clear error: " << e.what() << "\n" << j.dump();
    }
    if (::testing::Test::HasFailure()) break;  // the first bad config, not thousands of lines
  }
  EXPECT_GT(read, 100);
  EXPECT_GT(refused, 100);
}
