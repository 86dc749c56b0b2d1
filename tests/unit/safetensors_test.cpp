#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "json_mutation.h"
#include "test_util.h"

using namespace mlaserve;
namespace fs = std::filesystem;

namespace {

Tensor f32_tensor(Shape s, float start) {
  Tensor t = Tensor::empty_host(s, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = start + static_cast<float>(i);
  return t;
}

// Writes a raw file: 8-byte header length, header text, then `data_bytes` bytes.
void write_raw(const fs::path& p, const std::string& header, size_t data_bytes, uint64_t claimed_len = 0) {
  std::ofstream o(p, std::ios::binary);
  uint64_t n = claimed_len ? claimed_len : header.size();
  o.write(reinterpret_cast<const char*>(&n), 8);
  o << header;
  std::string zeros(data_bytes, '\0');
  o << zeros;
}

}  // namespace

TEST(Safetensors, WriteReadRoundTrip) {
  auto dir = test::temp_dir("st");
  std::map<std::string, Tensor> ts{{"a", f32_tensor({2, 3}, 1)}, {"b", f32_tensor({4}, 10)}};
  Tensor ids = Tensor::empty_host({3}, DType::I32);
  ids.data_as<int32_t>()[2] = 77;
  ts["ids"] = ids;
  write_safetensors((dir / "x.safetensors").string(), ts, {{"format", "pt"}});
  SafetensorsFile f((dir / "x.safetensors").string());
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const TensorInfo& a = f.get("a");
  EXPECT_EQ(a.dtype, DType::F32);
  EXPECT_EQ(a.shape, (Shape{2, 3}));
  EXPECT_EQ(reinterpret_cast<const float*>(a.data)[5], 6.0f);
  EXPECT_EQ(f.tensor("ids").data_as<int32_t>()[2], 77);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data) % 8, 0u) << "data section should be 8-byte aligned";
}

TEST(Safetensors, ErrorsNameFileAndTensor) {
  auto dir = test::temp_dir("st");
  const std::string p = (dir / "bad.safetensors").string();

  write_raw(p, "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}", 8);
  EXPECT_NE(test::error_text([&] { SafetensorsFile f(p); }).find("corrupt header"), std::string::npos);

  write_raw(p, "{\"w\": {\"dtype\": \"Q3\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 8);
  auto e = test::error_text([&] { SafetensorsFile f(p); });
  EXPECT_NE(e.find("unknown dtype 'Q3'"), std::string::npos) << e;
  EXPECT_NE(e.find("'w'"), std::string::npos) << e;
  EXPECT_NE(e.find(p), std::string::npos) << e;

  write_raw(p, "{\"w\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 8);
  e = test::error_text([&] { SafetensorsFile f(p); });
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  EXPECT_NE(e.find("'w'"), std::string::npos) << e;

  write_raw(p, "{\"w\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}", 8);
  e = test::error_text([&] { SafetensorsFile f(p); });
  EXPECT_NE(e.find("needs 12 bytes"), std::string::npos) << e;

  // A shape whose byte count wraps around 2^64 (to 0 here) is corrupt, not an empty tensor.
  write_raw(p, "{\"w\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, 0]}}", 8);
  e = test::error_text([&] { SafetensorsFile f(p); });
  EXPECT_NE(e.find("more bytes than any file holds"), std::string::npos) << e;
  write_raw(p, "{\"w\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296, 0], \"data_offsets\": [0, 0]}}",
            8);
  EXPECT_EQ(SafetensorsFile(p).get("w").nbytes, 0u);

  write_raw(p, "{}", 0, /*claimed_len=*/1000);
  e = test::error_text([&] { SafetensorsFile f(p); });
  EXPECT_NE(e.find("exceeds the file size"), std::string::npos) << e;

  test::write_text(p, "abc");
  e = test::error_text([&] { SafetensorsFile f(p); });
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;

  e = test::error_text([&] { SafetensorsFile f((dir / "nope.safetensors").string()); });
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
}

// Safetensors files with corrupt headers (random edits of the JSON, bytes overwritten, wrong header lengths) or cut
// short: each is either read, every tensor's bytes then lying in the file and matching its dtype and shape, or
// refused with an Error naming the file; never another exception, never a read outside the file.
TEST(Safetensors, CorruptFilesAreReadOrRefusedClearly) {
  using json = nlohmann::json;
  auto dir = test::temp_dir("st_fuzz");
  const std::string good = (dir / "good.safetensors").string(), p = (dir / "bad.safetensors").string();
  std::map<std::string, Tensor> ts;
  ts.emplace("a.weight", f32_tensor({3, 5}, 1.0f));
  ts.emplace("b", Tensor::empty_host({7}, DType::BF16));
  ts.emplace("c", Tensor::empty_host({3, 3}, DType::F8_E4M3));
  ts.emplace("d", Tensor::empty_host({2}, DType::I64));
  ts.emplace("e", Tensor::empty_host({0, 4}, DType::F32));
  int k = 0;  // the data section's bytes: (131 k + 7) mod 251, so two in a row tell where they are
  for (auto& [name, t] : ts)
    for (size_t i = 0; i < t.nbytes(); ++i, ++k)
      static_cast<uint8_t*>(t.data())[i] = static_cast<uint8_t>((131 * k + 7) % 251);
  write_safetensors(good, ts, {{"format", "pt"}});
  std::string file;
  {
    std::ifstream in(good, std::ios::binary);
    file.assign(std::istreambuf_iterator<char>(in), {});
  }
  uint64_t hlen = 0;
  std::memcpy(&hlen, file.data(), 8);
  const json header = json::parse(file.substr(8, hlen));
  const std::string data = file.substr(8 + hlen);
  const std::vector<json> values =
      test::edge_values({"F32", "BF16", "F8_E4M3", "I64", "U8", "BOOL", "F64", json::array({0, 60}),
                         json::array({60, 0}), json::array({0, 1, 2}), static_cast<int64_t>(data.size()),
                         static_cast<int64_t>(data.size()) + 1});
  auto with_header = [&](const std::string& h, uint64_t claimed) {
    std::string out(8, '\0');
    std::memcpy(out.data(), &claimed, 8);
    return out + h + data;
  };
  std::mt19937_64 rng(20261207);
  int64_t read = 0, refused = 0;
  for (int it = 0; it < 3000; ++it) {
    std::string bytes;
    switch (rng() % 4) {
      case 0:
      case 1: {  // the header's JSON edited, its length right (padded as writers pad it) or not
        json h = header;
        const int edits = 1 + static_cast<int>(rng() % 3);
        for (int e = 0; e < edits; ++e) test::mutate_json(h, rng, values);
        std::string text = h.dump();
        while (text.size() % 8 != 0) text.push_back(' ');
        const int64_t skew = rng() % 4 == 0 ? static_cast<int64_t>(rng() % 17) - 8 : 0;
        bytes = with_header(text, static_cast<uint64_t>(static_cast<int64_t>(text.size()) + skew));
        break;
      }
      case 2: {  // header bytes overwritten
        bytes = file;
        const std::string alphabet = "0123456789\"[]{},:-.eE \\\x00\xff";
        const int n = 1 + static_cast<int>(rng() % 4);
        for (int k = 0; k < n; ++k) bytes[8 + rng() % hlen] = alphabet[rng() % alphabet.size()];
        break;
      }
      default: {  // cut short, or a header length from anywhere
        bytes = file;
        if (rng() % 2 == 0) {
          bytes.resize(rng() % file.size());
        } else {
          const uint64_t claimed = rng() % 3 == 0 ? rng() : rng() % (file.size() + 16);
          std::memcpy(bytes.data(), &claimed, 8);
        }
        break;
      }
    }
    {
      std::ofstream out(p, std::ios::binary | std::ios::trunc);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    try {
      SafetensorsFile f(p);
      ++read;
      for (const auto& [name, info] : f.tensors()) {
        int64_t numel = 1;
        for (const int64_t d : info.shape) numel *= d;
        ASSERT_EQ(info.nbytes, static_cast<size_t>(numel) * dtype_size(info.dtype)) << name << " in " << bytes;
        // The tensor's bytes are bytes of the file (the data section's pattern places any two of them): a read
        // past the mapping would not come back equal, or at all.
        const std::string in_file(reinterpret_cast<const char*>(f.tensor(name).data()), info.nbytes);
        ASSERT_NE(bytes.find(in_file), std::string::npos) << name;
      }
    } catch (const Error& e) {
      ++refused;
      ASSERT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      FAIL() << "not a clear error: " << e.what() << "\n" << bytes;
    }
  }
  EXPECT_GT(read, 100);
  EXPECT_GT(refused, 1000);
}

TEST(Checkpoint, ShardedIndexAndErrors) {
  auto dir = test::temp_dir("ckpt");
  write_safetensors((dir / "s1.safetensors").string(), {{"a", f32_tensor({2}, 0)}});
  write_safetensors((dir / "s2.safetensors").string(), {{"b", f32_tensor({3}, 0)}, {"extra", f32_tensor({1}, 0)}});
  test::write_text(dir / "model.safetensors.index.json",
                   R"({"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  Checkpoint c(dir.string());
  EXPECT_EQ(c.num_files(), 2u);
  EXPECT_TRUE(c.has("a"));
  EXPECT_TRUE(c.has("extra"));
  EXPECT_EQ(c.get("b").shape, (Shape{3}));
  auto e = test::error_text([&] { c.get("zzz"); });
  EXPECT_NE(e.find("missing tensor 'zzz'"), std::string::npos) << e;

  // The index names a tensor its shard does not hold.
  test::write_text(dir / "model.safetensors.index.json",
                   R"({"weight_map": {"a": "s1.safetensors", "q": "s1.safetensors"}})");
  e = test::error_text([&] { Checkpoint c2(dir.string()); });
  EXPECT_NE(e.find("missing tensor 'q'"), std::string::npos) << e;
  EXPECT_NE(e.find("s1.safetensors"), std::string::npos) << e;

  // The index names a shard that does not exist.
  test::write_text(dir / "model.safetensors.index.json", R"({"weight_map": {"a": "s9.safetensors"}})");
  e = test::error_text([&] { Checkpoint c3(dir.string()); });
  EXPECT_NE(e.find("s9.safetensors"), std::string::npos) << e;

  test::write_text(dir / "model.safetensors.index.json", "{not json");
  e = test::error_text([&] { Checkpoint c4(dir.string()); });
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
}

TEST(Checkpoint, SingleFileAndEmptyDir) {
  auto dir = test::temp_dir("ckpt1");
  auto e = test::error_text([&] { Checkpoint c(dir.string()); });
  EXPECT_NE(e.find("holds no weights"), std::string::npos) << e;
  write_safetensors((dir / "model.safetensors").string(), {{"a", f32_tensor({2}, 0)}});
  Checkpoint c(dir.string());
  EXPECT_TRUE(c.has("a"));
  e = test::error_text([&] { Checkpoint c2((dir / "missing").string()); });
  EXPECT_NE(e.find("not a directory"), std::string::npos) << e;
}
