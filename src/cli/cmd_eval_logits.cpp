// mlaserve eval-logits: the correctness contract. Reads int32 tensors prompt_0, prompt_1, ... and writes
// logits_j (F32 [len_j, vocab], every prompt position) and greedy_j (I32 [N], greedy continuation decoded one
// token at a time through the KV cache). All prompts run together as one ragged batch.
#include <filesystem>

#include "cli/command.h"
#include "cli/model_args.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/offline.h"
#include "io/safetensors.h"

namespace mlaserve::cli {
namespace {

std::vector<std::vector<int32_t>> read_prompts(const std::string& path) {
  SafetensorsFile f(path);
  std::vector<std::vector<int32_t>> prompts;
  for (int j = 0;; ++j) {
    const std::string name = "prompt_" + std::to_string(j);
    if (!f.has(name)) break;
    const TensorInfo& t = f.get(name);
    MLA_CHECK(t.shape.size() == 1 || (t.shape.size() == 2 && t.shape[0] == 1),
              "{}: tensor '{}' must be 1-D token ids, has shape {}", path, name, shape_str(t.shape));
    const int64_t n = shape_numel(t.shape);
    MLA_CHECK(n > 0, "{}: tensor '{}' is empty", path, name);
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      int64_t v;
      if (t.dtype == DType::I32) v = reinterpret_cast<const int32_t*>(t.data)[i];
      else if (t.dtype == DType::I64) v = reinterpret_cast<const int64_t*>(t.data)[i];
      else fail("{}: tensor '{}' must be I32 (or I64), has {}", path, name, dtype_name(t.dtype));
      MLA_CHECK(v >= 0 && v <= INT32_MAX, "{}: tensor '{}' holds an invalid token id {}", path, name, v);
      ids[static_cast<size_t>(i)] = static_cast<int32_t>(v);
    }
    prompts.push_back(std::move(ids));
  }
  MLA_CHECK(!prompts.empty(), "{}: no tensor 'prompt_0' found", path);
  return prompts;
}

const RegisterCommand reg("eval-logits",
                          "prompt logits and greedy continuations for a file of prompts (prompts spread over DP ranks)",
                          [](CLI::App& app) {
  auto args = std::make_shared<ModelArgs>();
  auto in = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto n = std::make_shared<int32_t>(0);
  auto chunk = std::make_shared<int32_t>(0);
  args->add_to(app);
  app.add_option("--prompts", *in, "safetensors file with int32 prompt_0, prompt_1, ...")->required();
  app.add_option("--out", *out, "output safetensors file")->required();
  app.add_option("--max-new-tokens", *n, "greedy tokens per prompt")->capture_default_str();
  app.add_option("--prefill-chunk", *chunk, "prefill in chunks of this many tokens (0: whole prompts)");
  return [=]() -> int {
    MLA_CHECK(*n >= 0, "--max-new-tokens must be >= 0, got {}", *n);
    MLA_CHECK(*chunk >= 0, "--prefill-chunk must be >= 0, got {}", *chunk);
    auto prompts = read_prompts(*in);
    OfflineOptions o;
    o.max_new_tokens = *n;
    o.prompt_logits = true;
    o.prefill_chunk = *chunk;
    o.form = args->form();
    o.page_size = args->page_size;
    OfflineResult r = run_offline_layout(*args, prompts, o);
    if (args->node_rank > 0) return 0;  // node 0 writes the output
    std::map<std::string, Tensor> outs;
    for (size_t j = 0; j < prompts.size(); ++j) {
      outs["logits_" + std::to_string(j)] = r.prompt_logits[j];
      Tensor g = Tensor::empty_host({static_cast<int64_t>(r.greedy[j].size())}, DType::I32);
      std::copy(r.greedy[j].begin(), r.greedy[j].end(), g.data_as<int32_t>());
      outs["greedy_" + std::to_string(j)] = g;
    }
    write_safetensors(*out, outs);
    MLA_LOG_INFO("wrote {} prompts to {}", prompts.size(), *out);
    return 0;
  };
});

}  // namespace
}  // namespace mlaserve::cli
