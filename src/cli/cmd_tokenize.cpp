// mlaserve tokenize: the tokenizer as a JSON-lines filter (stdin -> stdout, one output line per input line).
//   {"text": "..."}                               -> {"ids": [...]}           (no special tokens)
//   {"text": "...", "add_special_tokens": true}    -> {"ids": [...]}           (bos/eos as servers add them)
//   {"ids": [...]}                                -> {"text": "..."}          (special tokens kept;
//                                                     "skip_special_tokens": true drops them)
//   {"ids": [...], "stream": true}                -> {"pieces": [...], "text": "..."}  (incremental detokenizer)
//   {"messages": [...], "add_generation_prompt": true, ...}
//                                                 -> {"text": rendered, "ids": [...]}  (ids without special tokens
//                                                     added: the template wrote them). Other keys are template
//                                                     variables (tools, documents, ...); "chat_template" names
//                                                     one of several named templates.
// A bad line answers {"error": "..."} and processing continues.
// --benchmark FILE encodes each line of FILE (single thread) and prints one JSON line of timings.
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "cli/command.h"
#include "core/error.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer_config.h"

namespace mlaserve::cli {
namespace {

using ojson = nlohmann::ordered_json;

std::vector<int32_t> parse_ids(const ojson& j, const tok::Tokenizer& t) {
  MLA_CHECK(j.is_array(), "\"ids\" must be a list of token ids");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < j.size(); ++i) {
    MLA_CHECK(j[i].is_number_integer() && j[i].get<int64_t>() >= 0 && j[i].get<int64_t>() < INT32_MAX,
              "\"ids\"[{}] is not a token id: {}", i, j[i].dump());
    ids.push_back(j[i].get<int32_t>());
  }
  (void)t;
  return ids;
}

bool get_flag(const ojson& req, const char* key, bool dflt) {
  auto it = req.find(key);
  if (it == req.end() || it->is_null()) return dflt;
  MLA_CHECK(it->is_boolean(), "\"{}\" must be true or false", key);
  return it->get<bool>();
}

ojson handle(const tok::PretrainedTokenizer& pt, const std::string& line) {
  ojson req;
  try {
    req = ojson::parse(line);
  } catch (const nlohmann::json::exception& e) {
    fail("invalid JSON: {}", e.what());
  }
  MLA_CHECK(req.is_object(), "expected a JSON object with \"text\", \"ids\" or \"messages\"");
  ojson out = ojson::object();
  if (req.contains("messages")) {
    bool agp = get_flag(req, "add_generation_prompt", false);
    std::string name;
    ojson vars = ojson::object();
    for (auto it = req.begin(); it != req.end(); ++it) {
      if (it.key() == "messages" || it.key() == "add_generation_prompt") continue;
      if (it.key() == "chat_template") {
        MLA_CHECK(it->is_string(), "\"chat_template\" must be a template name");
        name = it->get<std::string>();
        continue;
      }
      vars[it.key()] = it.value();
    }
    std::string text = pt.apply_chat_template(req["messages"], agp, vars, name);
    out["text"] = text;
    out["ids"] = pt.encode(text, false);
    return out;
  }
  if (req.contains("text")) {
    MLA_CHECK(req["text"].is_string(), "\"text\" must be a string");
    out["ids"] = pt.encode(req["text"].get_ref<const std::string&>(), get_flag(req, "add_special_tokens", false));
    return out;
  }
  if (req.contains("ids")) {
    std::vector<int32_t> ids = parse_ids(req["ids"], pt.tokenizer());
    bool skip = get_flag(req, "skip_special_tokens", false);
    if (get_flag(req, "stream", false)) {
      tok::IncrementalDetokenizer d(pt.tokenizer(), skip);
      ojson pieces = ojson::array();
      std::string all;
      for (int32_t id : ids) {
        std::string p = d.push(id);
        if (!p.empty()) pieces.push_back(p);
        all += p;
      }
      std::string rest = d.finish();
      if (!rest.empty()) pieces.push_back(rest);
      out["pieces"] = pieces;
      out["text"] = all + rest;
      return out;
    }
    out["text"] = pt.decode(ids, skip);
    return out;
  }
  fail("expected \"text\", \"ids\" or \"messages\"");
}

int benchmark(const tok::PretrainedTokenizer& pt, const std::string& path, int repeat) {
  std::ifstream f(path, std::ios::binary);
  MLA_CHECK(f.good(), "--benchmark: cannot open '{}'", path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string all = ss.str();
  std::vector<std::string_view> lines;
  for (size_t b = 0; b <= all.size();) {
    size_t e = all.find('\n', b);
    if (e == std::string::npos) e = all.size();
    lines.push_back(std::string_view(all).substr(b, e - b));
    b = e + 1;
  }
  size_t bytes = 0;
  for (auto l : lines) bytes += l.size();
  double best = 1e30;
  size_t tokens = 0;
  int64_t id_sum = 0;
  for (int r = 0; r < repeat; ++r) {
    tokens = 0;
    id_sum = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (auto l : lines) {
      std::vector<int32_t> ids = pt.encode(l, false);
      tokens += ids.size();
      for (int32_t id : ids) id_sum += id;
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
  }
  ojson out{{"bytes", bytes}, {"lines", lines.size()}, {"tokens", tokens}, {"id_sum", id_sum},
            {"repeat", repeat}, {"best_s", best}, {"MBps", bytes / best / 1e6}};
  std::cout << out.dump() << std::endl;
  return 0;
}

const RegisterCommand reg("tokenize", "tokenize / detokenize / render chat templates as JSON lines (stdin -> stdout)",
                          [](CLI::App& app) {
  auto path = std::make_shared<std::string>();
  auto bench = std::make_shared<std::string>();
  auto repeat = std::make_shared<int>(3);
  app.add_option("--tokenizer-path", *path,
                 "folder with tokenizer.json or tiktoken.model (+ tokenizer_config.json, ...)")
      ->required();
  app.add_option("--benchmark", *bench, "encode each line of this file and print the speed (single thread)");
  app.add_option("--repeat", *repeat, "benchmark repetitions (the best is reported)")->capture_default_str();
  return [=]() -> int {
    auto pt = tok::PretrainedTokenizer::load(*path);
    if (!bench->empty()) return benchmark(*pt, *bench, std::max(1, *repeat));
    std::ios::sync_with_stdio(false);
    std::string line;
    while (std::getline(std::cin, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      ojson out;
      try {
        out = handle(*pt, line);
      } catch (const std::exception& e) {
        out = ojson{{"error", e.what()}};
      }
      std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n' << std::flush;
    }
    return 0;
  };
});

}  // namespace
}  // namespace mlaserve::cli
