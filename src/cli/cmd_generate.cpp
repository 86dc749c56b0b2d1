// mlaserve generate: greedy continuation of one prompt of token ids, printed as comma-separated ids.
#include <iostream>
#include <sstream>

#include "cli/command.h"
#include "cli/model_args.h"
#include "core/error.h"
#include "engine/offline.h"

namespace mlaserve::cli {
namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    MLA_CHECK(b != std::string::npos, "--input-ids: empty entry in '{}'", s);
    item = item.substr(b, e - b + 1);
    size_t pos = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    MLA_CHECK(pos == item.size() && v >= 0 && v <= INT32_MAX, "--input-ids: '{}' is not a token id", item);
    ids.push_back(static_cast<int32_t>(v));
  }
  MLA_CHECK(!ids.empty(), "--input-ids: no token ids given");
  return ids;
}

const RegisterCommand reg("generate", "greedy-decode token ids from a prompt of token ids", [](CLI::App& app) {
  auto args = std::make_shared<ModelArgs>();
  auto ids = std::make_shared<std::string>();
  auto n = std::make_shared<int32_t>(16);
  auto stop_at_eos = std::make_shared<bool>(false);
  args->add_to(app);
  app.add_option("--input-ids", *ids, "prompt token ids, comma-separated")->required();
  app.add_option("--max-new-tokens", *n, "tokens to generate")->capture_default_str();
  app.add_flag("--stop-at-eos", *stop_at_eos, "stop when the model's eos token is generated");
  return [=]() -> int {
    MLA_CHECK(*n >= 0, "--max-new-tokens must be >= 0, got {}", *n);
    std::vector<int32_t> prompt = parse_ids(*ids);
    OfflineOptions o;
    o.max_new_tokens = *n;
    o.prompt_logits = false;
    o.form = args->form();
    o.page_size = args->page_size;
    if (*stop_at_eos) o.stop_ids = ModelConfig::from_file(args->model_path).eos_token_ids;
    OfflineResult r = run_offline_layout(*args, {prompt}, o);
    if (args->node_rank > 0) return 0;  // node 0 prints the ids
    std::string out;
    for (size_t i = 0; i < r.greedy[0].size(); ++i) out += (i ? "," : "") + std::to_string(r.greedy[0][i]);
    std::cout << out << std::endl;
    return 0;
  };
});

}  // namespace
}  // namespace mlaserve::cli
