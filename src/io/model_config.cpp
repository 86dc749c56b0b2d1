#include "io/model_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"

namespace mlaserve {

using json = nlohmann::json;

namespace {

struct Reader {
  const json& j;
  const std::string& src;

  bool present(const char* k) const { return j.contains(k) && !j[k].is_null(); }
  int64_t int_or(const char* k, int64_t def) const {
    if (!present(k)) return def;
    const json& v = j[k];
    MLA_CHECK(v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()),
              "{}: field '{}' must be an integer, got {}", src, k, v.dump());
    const bool fits = v.is_number_unsigned()  ? v.get<uint64_t>() <= uint64_t{1} << 62
                      : v.is_number_integer() ? v.get<int64_t>() >= -(int64_t{1} << 62) &&
                                                    v.get<int64_t>() <= int64_t{1} << 62
                                              : std::fabs(v.get<double>()) <= 0x1p62;
    MLA_CHECK(fits, "{}: field '{}' is {}, out of range", src, k, v.dump());
    return v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>());
  }
  int64_t req_int(const char* k) const {
    MLA_CHECK(present(k), "{}: missing required field '{}'", src, k);
    return int_or(k, 0);
  }
  double num_or(const char* k, double def) const {
    if (!present(k)) return def;
    MLA_CHECK(j[k].is_number(), "{}: field '{}' must be a number, got {}", src, k, j[k].dump());
    return j[k].get<double>();
  }
  bool bool_or(const char* k, bool def) const {
    if (!present(k)) return def;
    MLA_CHECK(j[k].is_boolean(), "{}: field '{}' must be true or false, got {}", src, k, j[k].dump());
    return j[k].get<bool>();
  }
  std::string str_or(const char* k, const std::string& def) const {
    if (!present(k)) return def;
    MLA_CHECK(j[k].is_string(), "{}: field '{}' must be a string, got {}", src, k, j[k].dump());
    return j[k].get<std::string>();
  }
};

double yarn_mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

}  // namespace

ModelConfig ModelConfig::from_file(const std::string& path_in) { return from_file(path_in, json::object()); }

ModelConfig ModelConfig::from_file(const std::string& path_in, const json& overrides) {
  MLA_CHECK(overrides.is_object(), "model config overrides must be a JSON object, got {}", overrides.dump());
  std::filesystem::path p(path_in);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  MLA_CHECK(std::filesystem::exists(p), "{}: config.json not found", p.string());
  std::ifstream in(p);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON ({})", p.string(), e.what());
  }
  if (overrides.empty()) return from_json(j, p.string());
  MLA_CHECK(j.is_object(), "{}: expected a JSON object", p.string());
  for (const auto& [key, value] : overrides.items()) j[key] = value;
  return from_json(j, p.string() + " with the overrides " + overrides.dump());
}

ModelConfig ModelConfig::from_json(const json& j, const std::string& src) {
  MLA_CHECK(j.is_object(), "{}: expected a JSON object", src);
  Reader r{j, src};
  ModelConfig c;

  std::string arch;
  if (r.present("architectures")) {
    MLA_CHECK(j["architectures"].is_array() && !j["architectures"].empty() && j["architectures"][0].is_string(),
              "{}: field 'architectures' must be a non-empty list of strings", src);
    arch = j["architectures"][0].get<std::string>();
  } else {
    std::string mt = r.str_or("model_type", "");
    if (mt == "deepseek_v2") arch = "DeepseekV2ForCausalLM";
    if (mt == "deepseek_v3") arch = "DeepseekV3ForCausalLM";
  }
  if (arch == "DeepseekV2ForCausalLM") {
    c.arch = Architecture::DeepseekV2;
  } else if (arch == "DeepseekV3ForCausalLM") {
    c.arch = Architecture::DeepseekV3;
  } else {
    fail("{}: unsupported architecture '{}': mlaserve serves DeepseekV2ForCausalLM and DeepseekV3ForCausalLM",
         src, arch.empty() ? std::string("(none given)") : arch);
  }
  c.arch_name = arch;

  if (r.present("quantization_config")) {
    const json& q = j["quantization_config"];
    std::string method = q.is_object() && q.contains("quant_method") && q["quant_method"].is_string()
                             ? q["quant_method"].get<std::string>()
                             : std::string("unknown");
    if (method == "fp8") {
      const std::string fmt = q.contains("fmt") && q["fmt"].is_string() ? q["fmt"].get<std::string>() : "e4m3";
      MLA_CHECK(fmt == "e4m3", "{}: quantization_config fmt '{}' is not supported (FP8 checkpoints: e4m3)", src, fmt);
      if (q.contains("weight_block_size") && !q["weight_block_size"].is_null()) {
        const json& b = q["weight_block_size"];
        MLA_CHECK(b.is_array() && b.size() == 2 && b[0].is_number_integer() && b[1].is_number_integer() &&
                      b[0].get<int64_t>() > 0 && b[1].get<int64_t>() > 0,
                  "{}: quantization_config.weight_block_size must be two positive integers, got {}", src, b.dump());
        c.quant = QuantMethod::Fp8Block;
        c.quant_block_rows = b[0].get<int64_t>();
        c.quant_block_cols = b[1].get<int64_t>();
      } else {
        c.quant = QuantMethod::Fp8Tensor;
      }
    } else if (method == "compressed-tensors") {
      // llm-compressor's checkpoints (vLLM's usual FP8 format): F8_E4M3 weights times their `weight_scale` per
      // tensor, per output channel or per block; activations stay bf16 here whatever input_activations says.
      auto str_of = [&](const json& o, const char* key) {
        return o.is_object() && o.contains(key) && o[key].is_string() ? o[key].get<std::string>() : std::string();
      };
      const std::string format = str_of(q, "format");
      MLA_CHECK(format == "float-quantized" || format == "naive-quantized" || format == "pack-quantized" ||
                    format == "int-quantized",
                "{}: quantization_config.format '{}' is not supported (compressed-tensors: float-quantized FP8 "
                "weights, pack-quantized or int-quantized integer weights)", src, format);
      MLA_CHECK(q.contains("config_groups") && q["config_groups"].is_object() && !q["config_groups"].empty(),
                "{}: quantization_config.config_groups must name the weights' scheme", src);
      bool any_int = false;
      for (const auto& [group, g] : q["config_groups"].items())
        any_int = any_int || (g.is_object() && g.contains("weights") && str_of(g["weights"], "type") == "int");
      MLA_CHECK(any_int ? format != "float-quantized" : format == "float-quantized" || format == "naive-quantized",
                "{}: quantization_config.format '{}' is not supported for {} weights ({})", src, format,
                any_int ? "integer" : "8-bit float", any_int ? "pack-quantized or int-quantized" : "float-quantized");
      if (any_int) {
        // Integer weights (W4A16 / W8A16 / W8A8 checkpoints): dequantized at load. pack-quantized: `weight_packed`
        // (int32 words of 32 / num_bits values along the input channels), `weight_scale` per group, channel or
        // tensor, `weight_zero_point` when asymmetric, `weight_g_idx` for act order; int-quantized: an I8 `weight`.
        // Each tensor's groups follow from its scales' shape; the bits must be one number.
        int64_t bits = 0;
        for (const auto& [group, g] : q["config_groups"].items()) {
          const std::string at = "quantization_config.config_groups." + group + ".weights";
          MLA_CHECK(g.is_object() && g.contains("weights") && g["weights"].is_object(), "{}: {} must be an object",
                    src, at);
          const json& w = g["weights"];
          const int64_t b = w.contains("num_bits") && w["num_bits"].is_number_integer() ? w["num_bits"].get<int64_t>()
                                                                                         : 0;
          MLA_CHECK(str_of(w, "type") == "int", "{}: {}: {} weights beside integer ones are not supported", src, at,
                    str_of(w, "type").empty() ? std::string("untyped") : str_of(w, "type"));
          MLA_CHECK(format == "pack-quantized" ? (b == 2 || b == 4 || b == 8) : b == 8,
                    "{}: {}: {}-bit integer weights are not supported ({})", src, at, b,
                    format == "pack-quantized" ? "pack-quantized: 2, 4 or 8 bits" : "int-quantized: 8 bits");
          MLA_CHECK(bits == 0 || bits == b, "{}: quantization_config.config_groups: {} and {} bits in one checkpoint "
                    "are not supported", src, bits, b);
          bits = b;
          MLA_CHECK(!w.contains("dynamic") || !w["dynamic"].is_boolean() || !w["dynamic"].get<bool>(),
                    "{}: {}.dynamic true is not supported (the weights' scales are stored)", src, at);
          const std::string st = str_of(w, "strategy");
          MLA_CHECK(st == "group" || st == "channel" || st == "tensor",
                    "{}: {}.strategy '{}' is not supported for integer weights (group, channel or tensor)", src, at,
                    st);
          if (st == "group")
            MLA_CHECK(w.contains("group_size") && w["group_size"].is_number_integer() &&
                          w["group_size"].get<int64_t>() > 0,
                      "{}: {}.group_size must be a positive integer for strategy group", src, at);
        }
        c.quant = QuantMethod::CtInt;
        c.quant_bits = bits;
        c.quant_compressed_tensors = true;
      }
      std::string strategy;
      std::vector<int64_t> block;
      static const json kNoGroups = json::object();
      const json& float_groups = any_int ? kNoGroups : q["config_groups"];  // integer weights: read above
      for (const auto& [group, g] : float_groups.items()) {
        const std::string at = "quantization_config.config_groups." + group + ".weights";
        MLA_CHECK(g.is_object() && g.contains("weights") && g["weights"].is_object(), "{}: {} must be an object", src,
                  at);
        const json& w = g["weights"];
        const int64_t bits = w.contains("num_bits") && w["num_bits"].is_number_integer() ? w["num_bits"].get<int64_t>()
                                                                                        : 0;
        const std::string type = str_of(w, "type").empty() ? std::string("(no type)") : str_of(w, "type");
        MLA_CHECK(type == "float" && bits == 8,
                  "{}: {}: {}-bit {} weights are not supported (compressed-tensors: 8-bit float weights)", src, at,
                  bits, type);
        MLA_CHECK(!w.contains("symmetric") || !w["symmetric"].is_boolean() || w["symmetric"].get<bool>(),
                  "{}: {}.symmetric false (zero points) is not supported", src, at);
        MLA_CHECK(!w.contains("dynamic") || !w["dynamic"].is_boolean() || !w["dynamic"].get<bool>(),
                  "{}: {}.dynamic true is not supported (the weights' scales are stored)", src, at);
        const std::string st = str_of(w, "strategy");
        MLA_CHECK(st == "tensor" || st == "channel" || st == "block",
                  "{}: {}.strategy '{}' is not supported (tensor, channel or block)", src, at, st);
        std::vector<int64_t> b;
        if (st == "block") {
          const json& bs = w.contains("block_structure") ? w["block_structure"] : json();
          MLA_CHECK(bs.is_array() && bs.size() == 2 && bs[0].is_number_integer() && bs[1].is_number_integer() &&
                        bs[0].get<int64_t>() > 0 && bs[1].get<int64_t>() > 0,
                    "{}: {}.block_structure must be two positive integers, got {}", src, at, bs.dump());
          b = {bs[0].get<int64_t>(), bs[1].get<int64_t>()};
        }
        MLA_CHECK(strategy.empty() || ((st == "block") == (strategy == "block") && b == block),
                  "{}: quantization_config.config_groups: groups with different weight scales ({} and {}) are not "
                  "supported", src, strategy, st);
        if (strategy.empty() || st == "channel") strategy = st;  // tensor and channel scales are read alike
        block = b;
      }
      if (any_int) {
        // (set above)
      } else if (strategy == "block") {
        c.quant = QuantMethod::Fp8Block;
        c.quant_block_rows = block[0];
        c.quant_block_cols = block[1];
      } else {
        c.quant = QuantMethod::Fp8Tensor;
      }
      c.quant_compressed_tensors = true;
    } else if (method == "gptq") {
      // AutoGPTQ / GPTQModel: `bits` (2, 4, 8) in groups of `group_size` input channels (-1: one group), act order
      // through g_idx; checkpoint_format "gptq" stores the zeros less one, GPTQModel's "gptq_v2" as they are.
      auto int_of = [&](const char* key, int64_t dflt) {
        if (!q.contains(key) || q[key].is_null()) return dflt;
        MLA_CHECK(q[key].is_number_integer(), "{}: quantization_config.{} must be an integer", src, key);
        return q[key].get<int64_t>();
      };
      const int64_t bits = int_of("bits", 4), group = int_of("group_size", 128);
      MLA_CHECK(bits == 2 || bits == 4 || bits == 8, "{}: GPTQ with {} bits is not supported (2, 4 or 8)", src, bits);
      MLA_CHECK(group > 0 || group == -1, "{}: quantization_config.group_size must be positive or -1, got {}", src,
                group);
      const std::string format = q.contains("checkpoint_format") && q["checkpoint_format"].is_string()
                                     ? q["checkpoint_format"].get<std::string>()
                                     : "gptq";
      MLA_CHECK(format == "gptq" || format == "gptq_v2",
                "{}: GPTQ checkpoint_format '{}' is not supported (gptq or gptq_v2)", src, format);
      c.quant = QuantMethod::Gptq;
      c.quant_group = group == -1 ? 0 : group;
      c.quant_bits = bits;
      c.quant_zero_offset = format == "gptq" ? 1 : 0;
    } else if (method == "awq") {
      auto int_of = [&](const char* key, int64_t dflt) {
        if (!q.contains(key) || q[key].is_null()) return dflt;
        MLA_CHECK(q[key].is_number_integer(), "{}: quantization_config.{} must be an integer", src, key);
        return q[key].get<int64_t>();
      };
      const int64_t bits = int_of("bits", int_of("w_bit", 4));
      const int64_t group = int_of("group_size", int_of("q_group_size", 128));
      const std::string version = q.contains("version") && q["version"].is_string() ? q["version"].get<std::string>()
                                                                                      : "gemm";
      const bool zero = !q.contains("zero_point") || !q["zero_point"].is_boolean() || q["zero_point"].get<bool>();
      MLA_CHECK(bits == 4, "{}: AWQ with {} bits is not supported (4-bit only)", src, bits);
      MLA_CHECK(group > 0, "{}: quantization_config.group_size must be positive, got {}", src, group);
      MLA_CHECK(version == "gemm" || version == "GEMM",
                "{}: AWQ version '{}' is not supported (AutoAWQ's \"gemm\" layout only)", src, version);
      MLA_CHECK(zero, "{}: AWQ without zero points is not supported", src);
      c.quant = QuantMethod::Awq;
      c.quant_group = group;
    } else {
      fail("{}: quantization_config with quant_method '{}' is not supported; use a bf16, FP8 or AWQ checkpoint", src,
           method);
    }
  }

  std::string act = r.str_or("hidden_act", "silu");
  MLA_CHECK(act == "silu", "{}: hidden_act '{}' is not supported (DeepSeek uses silu)", src, act);
  MLA_CHECK(!r.bool_or("attention_bias", false), "{}: attention_bias true is not supported", src);

  c.vocab_size = r.req_int("vocab_size");
  c.hidden_size = r.req_int("hidden_size");
  c.intermediate_size = r.req_int("intermediate_size");
  c.num_hidden_layers = r.req_int("num_hidden_layers");
  c.num_attention_heads = r.req_int("num_attention_heads");
  c.q_lora_rank = r.int_or("q_lora_rank", 0);
  c.kv_lora_rank = r.req_int("kv_lora_rank");
  c.qk_nope_head_dim = r.req_int("qk_nope_head_dim");
  c.qk_rope_head_dim = r.req_int("qk_rope_head_dim");
  c.v_head_dim = r.req_int("v_head_dim");
  c.n_routed_experts = r.int_or("n_routed_experts", 0);
  c.moe_intermediate_size = r.int_or("moe_intermediate_size", 0);
  c.n_shared_experts = r.int_or("n_shared_experts", 0);
  c.num_experts_per_tok = r.int_or("num_experts_per_tok", 0);
  c.first_k_dense_replace = r.int_or("first_k_dense_replace", 0);
  c.moe_layer_freq = r.int_or("moe_layer_freq", 1);
  c.norm_topk_prob = r.bool_or("norm_topk_prob", c.arch == Architecture::DeepseekV3);
  c.routed_scaling_factor = r.num_or("routed_scaling_factor", 1.0);
  c.n_group = r.int_or("n_group", 1);
  c.topk_group = r.int_or("topk_group", 1);
  c.max_position_embeddings = r.int_or("max_position_embeddings", 4096);
  c.rms_norm_eps = r.num_or("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.bool_or("tie_word_embeddings", false);
  c.bos_token_id = r.int_or("bos_token_id", -1);
  c.num_nextn_predict_layers = r.int_or("num_nextn_predict_layers", 0);
  if (r.present("eos_token_id")) {
    const json& e = j["eos_token_id"];
    if (e.is_array()) {
      for (const auto& v : e) {
        MLA_CHECK(v.is_number_integer(), "{}: eos_token_id entries must be integers", src);
        c.eos_token_ids.push_back(v.get<int64_t>());
      }
    } else {
      c.eos_token_ids.push_back(r.int_or("eos_token_id", -1));
    }
  }

  const std::string default_method = c.arch == Architecture::DeepseekV3 ? "noaux_tc" : "greedy";
  const std::string method = r.str_or("topk_method", default_method);
  if (method == "greedy") c.topk_method = TopkMethod::Greedy;
  else if (method == "group_limited_greedy") c.topk_method = TopkMethod::GroupLimitedGreedy;
  else if (method == "noaux_tc") c.topk_method = TopkMethod::NoauxTc;
  else fail("{}: unknown topk_method '{}' (expected greedy, group_limited_greedy or noaux_tc)", src, method);
  const std::string scoring = r.str_or("scoring_func", c.arch == Architecture::DeepseekV3 ? "sigmoid" : "softmax");
  if (scoring == "softmax") c.scoring_func = ScoringFunc::Softmax;
  else if (scoring == "sigmoid") c.scoring_func = ScoringFunc::Sigmoid;
  else fail("{}: unknown scoring_func '{}' (expected softmax or sigmoid)", src, scoring);

  // RoPE: the original checkpoints write "rope_scaling" {"type": ...}; transformers 5 writes "rope_parameters".
  c.rope.theta = r.num_or("rope_theta", 10000.0);
  const char* rope_key = r.present("rope_scaling") ? "rope_scaling" : (r.present("rope_parameters") ? "rope_parameters" : nullptr);
  if (rope_key) {
    const json& rs = j[rope_key];
    MLA_CHECK(rs.is_object(), "{}: field '{}' must be an object", src, rope_key);
    Reader rr{rs, src};
    std::string type = rr.str_or("type", rr.str_or("rope_type", "default"));
    if (rs.contains("rope_theta")) c.rope.theta = rr.num_or("rope_theta", c.rope.theta);
    if (type == "yarn") {
      c.rope.yarn = true;
      c.rope.factor = rr.num_or("factor", 0.0);
      if (c.rope.factor <= 0.0) {
        int64_t orig = rr.int_or("original_max_position_embeddings", 0);
        MLA_CHECK(orig > 0, "{}: {} yarn needs 'factor' or 'original_max_position_embeddings'", src, rope_key);
        c.rope.factor = static_cast<double>(c.max_position_embeddings) / static_cast<double>(orig);
      }
      c.rope.original_max_position_embeddings =
          rr.int_or("original_max_position_embeddings", c.max_position_embeddings);
      // transformers treats 0 / null like "absent" for these (`x or default`).
      c.rope.beta_fast = rr.num_or("beta_fast", 0.0);
      if (c.rope.beta_fast == 0.0) c.rope.beta_fast = 32.0;
      c.rope.beta_slow = rr.num_or("beta_slow", 0.0);
      if (c.rope.beta_slow == 0.0) c.rope.beta_slow = 1.0;
      c.rope.mscale = rr.num_or("mscale", 0.0);
      c.rope.mscale_all_dim = rr.num_or("mscale_all_dim", 0.0);
      c.rope.attention_factor = rr.num_or("attention_factor", 0.0);
    } else if (type != "default" && type != "none") {
      fail("{}: {} type '{}' is not supported (expected yarn or none)", src, rope_key, type);
    }
  }

  // Shape sanity: everything the forward pass divides or indexes by.
  auto positive = [&](int64_t v, const char* k) { MLA_CHECK(v > 0, "{}: field '{}' must be positive, got {}", src, k, v); };
  positive(c.vocab_size, "vocab_size");
  positive(c.hidden_size, "hidden_size");
  positive(c.intermediate_size, "intermediate_size");
  positive(c.num_hidden_layers, "num_hidden_layers");
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.kv_lora_rank, "kv_lora_rank");
  positive(c.qk_nope_head_dim, "qk_nope_head_dim");
  positive(c.v_head_dim, "v_head_dim");
  positive(c.moe_layer_freq, "moe_layer_freq");
  // Upper bounds far past every released model (DeepSeek-V3: hidden 7168, vocab 129280, 256 experts, 61 layers), so
  // that no product of sizes below overflows and a corrupt config is refused here, not by an allocator.
  auto at_most = [&](int64_t v, int64_t max, const char* k) {
    MLA_CHECK(v <= max, "{}: field '{}' is {}, more than mlaserve supports ({})", src, k, v, max);
  };
  at_most(c.vocab_size, int64_t{1} << 24, "vocab_size");
  at_most(c.hidden_size, int64_t{1} << 20, "hidden_size");
  at_most(c.intermediate_size, int64_t{1} << 20, "intermediate_size");
  at_most(c.moe_intermediate_size, int64_t{1} << 20, "moe_intermediate_size");
  at_most(c.num_hidden_layers, 4096, "num_hidden_layers");
  at_most(c.num_attention_heads, 4096, "num_attention_heads");
  at_most(c.q_lora_rank, int64_t{1} << 16, "q_lora_rank");
  at_most(c.kv_lora_rank, int64_t{1} << 16, "kv_lora_rank");
  at_most(c.qk_nope_head_dim, 4096, "qk_nope_head_dim");
  at_most(c.qk_rope_head_dim, 4096, "qk_rope_head_dim");
  at_most(c.v_head_dim, 4096, "v_head_dim");
  at_most(c.n_routed_experts, int64_t{1} << 16, "n_routed_experts");
  at_most(c.n_shared_experts, 1024, "n_shared_experts");
  at_most(c.max_position_embeddings, int64_t{1} << 40, "max_position_embeddings");
  MLA_CHECK(c.q_lora_rank >= 0, "{}: q_lora_rank must be null or positive", src);
  MLA_CHECK(c.qk_rope_head_dim > 0 && c.qk_rope_head_dim % 2 == 0, "{}: qk_rope_head_dim must be positive and even, got {}",
            src, c.qk_rope_head_dim);
  if (c.n_routed_experts > 0) {
    positive(c.moe_intermediate_size, "moe_intermediate_size");
    MLA_CHECK(c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.n_routed_experts,
              "{}: num_experts_per_tok must be in [1, n_routed_experts={}], got {}", src, c.n_routed_experts,
              c.num_experts_per_tok);
    MLA_CHECK(c.n_shared_experts >= 0, "{}: n_shared_experts must be >= 0", src);
    if (c.topk_method != TopkMethod::Greedy) {
      MLA_CHECK(c.n_group > 0 && c.n_routed_experts % c.n_group == 0,
                "{}: n_routed_experts ({}) must be divisible by n_group ({})", src, c.n_routed_experts, c.n_group);
      MLA_CHECK(c.topk_group > 0 && c.topk_group <= c.n_group, "{}: topk_group must be in [1, n_group]", src);
      MLA_CHECK(c.topk_group * (c.n_routed_experts / c.n_group) >= c.num_experts_per_tok,
                "{}: topk_group * experts per group is smaller than num_experts_per_tok", src);
    }
  }
  // The real-valued fields, and what the attention derives from them, are finite numbers in range (a corrupt value
  // such as a negative rope_theta or a zero yarn mscale would make every logit NaN, silently).
  auto number = [&](double v, bool ok, const char* k, const char* want) {
    MLA_CHECK(std::isfinite(v) && ok, "{}: field '{}' is {}, expected {}", src, k, v, want);
  };
  number(c.rope.theta, c.rope.theta > 0.0, "rope_theta", "a positive number");
  number(c.rms_norm_eps, c.rms_norm_eps >= 0.0, "rms_norm_eps", "a number >= 0");
  number(c.routed_scaling_factor, c.routed_scaling_factor > 0.0, "routed_scaling_factor", "a positive number");
  if (c.rope.yarn) {
    number(c.rope.factor, c.rope.factor > 0.0, "rope_scaling.factor", "a positive number");
    number(c.rope.beta_fast, c.rope.beta_fast > 0.0, "rope_scaling.beta_fast", "a positive number");
    number(c.rope.beta_slow, c.rope.beta_slow > 0.0, "rope_scaling.beta_slow", "a positive number");
    number(c.rope.mscale, true, "rope_scaling.mscale", "a finite number");
    number(c.rope.mscale_all_dim, true, "rope_scaling.mscale_all_dim", "a finite number");
    number(c.rope.attention_factor, c.rope.attention_factor >= 0.0, "rope_scaling.attention_factor",
           "a number >= 0");
    MLA_CHECK(c.rope.original_max_position_embeddings > 0,
              "{}: field 'rope_scaling.original_max_position_embeddings' must be positive, got {}", src,
              c.rope.original_max_position_embeddings);
  }
  const double attention = c.rope_attention_factor(), scale = c.softmax_scale();
  MLA_CHECK(std::isfinite(attention) && attention > 0.0 && std::isfinite(scale) && scale > 0.0,
            "{}: the rope settings give an attention factor of {} and a softmax scale of {} (both must be positive "
            "numbers): check rope_scaling's factor, mscale and mscale_all_dim",
            src, attention, scale);
  for (const float f : c.rope_inv_freq())
    MLA_CHECK(std::isfinite(f) && f > 0.0f, "{}: rope_theta {} and rope_scaling give a rotary frequency of {}", src,
              c.rope.theta, f);
  return c;
}

std::vector<float> ModelConfig::rope_inv_freq() const {
  const int64_t dim = qk_rope_head_dim;
  const int64_t half = dim / 2;
  std::vector<float> out(static_cast<size_t>(half));
  const double base = rope.theta;
  for (int64_t i = 0; i < half; ++i) {
    const float pos_freq = static_cast<float>(std::pow(base, static_cast<double>(2 * i) / static_cast<double>(dim)));
    const float extra = 1.0f / pos_freq;
    out[static_cast<size_t>(i)] = extra;
  }
  if (!rope.yarn) return out;
  // YaRN: blend interpolated (divided by factor) and extrapolated frequencies over a linear ramp.
  const double L = static_cast<double>(rope.original_max_position_embeddings);
  auto find_dim = [&](double rot) {
    return (static_cast<double>(dim) * std::log(L / (rot * 2.0 * M_PI))) / (2.0 * std::log(base));
  };
  double low = std::floor(find_dim(rope.beta_fast));
  double high = std::ceil(find_dim(rope.beta_slow));
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const float pos_freq = static_cast<float>(std::pow(base, static_cast<double>(2 * i) / static_cast<double>(dim)));
    const float extra = 1.0f / pos_freq;
    const float inter = 1.0f / (static_cast<float>(rope.factor) * pos_freq);
    float ramp = static_cast<float>((static_cast<double>(i) - low) / (high - low));
    ramp = std::min(1.0f, std::max(0.0f, ramp));
    const float extra_factor = 1.0f - ramp;
    out[static_cast<size_t>(i)] = inter * (1.0f - extra_factor) + extra * extra_factor;
  }
  return out;
}

double ModelConfig::rope_attention_factor() const {
  if (!rope.yarn) return 1.0;
  if (rope.attention_factor > 0.0) return rope.attention_factor;
  if (rope.mscale != 0.0 && rope.mscale_all_dim != 0.0)
    return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim);
  return yarn_mscale(rope.factor, 1.0);
}

double ModelConfig::softmax_scale() const {
  double s = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (rope.yarn && rope.mscale_all_dim != 0.0) {
    const double m = yarn_mscale(rope.factor, rope.mscale_all_dim);
    s *= m * m;
  }
  return s;
}

std::string ModelConfig::summary() const {
  return fmt::format(
      "{}: {} layers, hidden {}, heads {}, q_lora {}, kv_lora {}, nope/rope/v {}/{}/{}, experts {} routed + {} shared "
      "(top-{}), vocab {}{}",
      arch_name, num_hidden_layers, hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
      qk_rope_head_dim, v_head_dim, n_routed_experts, n_shared_experts, num_experts_per_tok, vocab_size,
      quant == QuantMethod::Fp8Block
          ? fmt::format(", FP8 weights in {}x{} blocks (dequantized to bf16 at load)", quant_block_rows,
                        quant_block_cols)
      : quant == QuantMethod::Fp8Tensor
          ? std::string(", FP8 weights with per-tensor or per-channel scales (dequantized to bf16 at load)")
      : quant == QuantMethod::Awq
          ? fmt::format(", AWQ 4-bit weights in groups of {} (dequantized to bf16 at load)", quant_group)
      : quant == QuantMethod::Gptq
          ? fmt::format(", GPTQ {}-bit weights in groups of {} (dequantized to bf16 at load)", quant_bits,
                        quant_group > 0 ? std::to_string(quant_group) : std::string("all input channels"))
      : quant == QuantMethod::CtInt
          ? fmt::format(", compressed-tensors {}-bit integer weights (dequantized to bf16 at load)", quant_bits)
          : std::string());
}

std::string ModelConfig::forward_difference(const ModelConfig& o) const {
  auto name_of = [](Architecture a) { return a == Architecture::DeepseekV3 ? "DeepseekV3" : "DeepseekV2"; };
  if (arch != o.arch) return fmt::format("architectures: {} vs {}", name_of(arch), name_of(o.arch));
  const std::pair<const char*, std::pair<double, double>> fields[] = {
      {"vocab_size", {vocab_size, o.vocab_size}},
      {"hidden_size", {hidden_size, o.hidden_size}},
      {"intermediate_size", {intermediate_size, o.intermediate_size}},
      {"moe_intermediate_size", {moe_intermediate_size, o.moe_intermediate_size}},
      {"num_hidden_layers", {num_hidden_layers, o.num_hidden_layers}},
      {"num_attention_heads", {num_attention_heads, o.num_attention_heads}},
      {"q_lora_rank", {q_lora_rank, o.q_lora_rank}},
      {"kv_lora_rank", {kv_lora_rank, o.kv_lora_rank}},
      {"qk_nope_head_dim", {qk_nope_head_dim, o.qk_nope_head_dim}},
      {"qk_rope_head_dim", {qk_rope_head_dim, o.qk_rope_head_dim}},
      {"v_head_dim", {v_head_dim, o.v_head_dim}},
      {"n_routed_experts", {n_routed_experts, o.n_routed_experts}},
      {"n_shared_experts", {n_shared_experts, o.n_shared_experts}},
      {"num_experts_per_tok", {num_experts_per_tok, o.num_experts_per_tok}},
      {"first_k_dense_replace", {first_k_dense_replace, o.first_k_dense_replace}},
      {"moe_layer_freq", {moe_layer_freq, o.moe_layer_freq}},
      {"norm_topk_prob", {norm_topk_prob, o.norm_topk_prob}},
      {"routed_scaling_factor", {routed_scaling_factor, o.routed_scaling_factor}},
      {"n_group", {n_group, o.n_group}},
      {"topk_group", {topk_group, o.topk_group}},
      {"topk_method", {static_cast<int>(topk_method), static_cast<int>(o.topk_method)}},
      {"scoring_func", {static_cast<int>(scoring_func), static_cast<int>(o.scoring_func)}},
      {"rms_norm_eps", {rms_norm_eps, o.rms_norm_eps}},
      {"tie_word_embeddings", {tie_word_embeddings, o.tie_word_embeddings}},
      {"rope_theta", {rope.theta, o.rope.theta}},
      {"rope_scaling (YaRN or none)", {rope.yarn, o.rope.yarn}},
      {"rope_scaling.factor", {rope.factor, o.rope.factor}},
      {"rope_scaling.original_max_position_embeddings",
       {rope.original_max_position_embeddings, o.rope.original_max_position_embeddings}},
      {"rope_scaling.beta_fast", {rope.beta_fast, o.rope.beta_fast}},
      {"rope_scaling.beta_slow", {rope.beta_slow, o.rope.beta_slow}},
      {"rope_scaling.mscale", {rope.mscale, o.rope.mscale}},
      {"rope_scaling.mscale_all_dim", {rope.mscale_all_dim, o.rope.mscale_all_dim}},
      {"rope_scaling.attention_factor", {rope.attention_factor, o.rope.attention_factor}},
  };
  for (const auto& [name, v] : fields)
    if (v.first != v.second) return fmt::format("{}: {} vs {}", name, v.first, v.second);
  // Only the MTP layers this run loads need to be there.
  if (mtp_layers > o.num_nextn_predict_layers)
    return fmt::format("num_nextn_predict_layers: {} vs {} (the MTP layer is in use)", num_nextn_predict_layers,
                       o.num_nextn_predict_layers);
  return {};
}

bool quantization_names(const std::string& flag, const ModelConfig& checkpoint) {
  if (checkpoint.quant == QuantMethod::CtInt) return flag == "compressed-tensors" || flag == "moe_wna16";
  if (checkpoint.quant_compressed_tensors) return flag == "compressed-tensors" || flag == "fp8";
  if (checkpoint.quant == QuantMethod::Fp8Block || checkpoint.quant == QuantMethod::Fp8Tensor) return flag == "fp8";
  if (checkpoint.quant == QuantMethod::Gptq) return flag == "gptq" || flag == "gptq_marlin" || flag == "moe_wna16";
  if (checkpoint.quant == QuantMethod::Awq) return flag == "awq" || flag == "awq_marlin" || flag == "moe_wna16";
  return false;
}

}  // namespace mlaserve
