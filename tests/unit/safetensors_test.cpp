#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/safetensors.h"
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
