// The paged latent KV cache: per layer (ModelConfig::num_cache_layers) one device tensor
// [num_pages * page_size, kv_lora_rank + qk_rope_head_dim]
// holding, for every token slot, the normalised c_kv followed by the rotated shared k_pe. Which slots belong to
// which sequence is the page table's business (engine/page_pool.h hands out pages).
// Its element type is the backend's activation type, or FP8 (--kv-cache-dtype fp8_e4m3 / fp8_e5m2: half of bf16's
// bytes, so twice the tokens): each value the E4M3 / E5M2 code nearest to it (ties to even, saturated to +-448 /
// +-57344, no scale, as SGLang's and vLLM's MLA caches hold it without a checkpoint scale); every backend op that
// writes a row writes its codes and every read of the cache reads their values. E4M3 keeps one more mantissa bit,
// E5M2 a wider range.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace mlaserve {

class KvCache {
 public:
  // fp8: the FP8 code type (F8_E4M3 or F8_E5M2), none for the backend's activation type.
  KvCache(Backend& backend, const ModelConfig& config, int64_t num_pages, int32_t page_size,
          std::optional<DType> fp8 = std::nullopt);
  int64_t num_pages() const { return num_pages_; }
  int32_t page_size() const { return page_size_; }
  int64_t num_slots() const { return num_pages_ * page_size_; }
  DType dtype() const { return dtype_; }
  Tensor& layer(int64_t i) { return layers_[static_cast<size_t>(i)]; }
  // The model's layers, then the MTP layer's when the run uses it (ModelConfig::num_cache_layers).
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // Bytes of cache per token (all layers).
  static int64_t bytes_per_token(const ModelConfig& c, DType dtype);
  // The hierarchical cache's host tier: `slots` host blocks, each one page of every layer
  // (num_layers() * page_bytes() bytes).
  void enable_host(int64_t slots);
  int64_t host_slots() const { return host_slots_; }
  // Bytes of one page of one layer (every layer's rows are alike).
  int64_t page_bytes() const { return num_layers() > 0 ? static_cast<int64_t>(layers_[0].nbytes()) / num_pages_ : 0; }
  // A step's copies (ForwardBatch::kv_saves, kv_loads: RadixCache::Copies) between pages and host slots, before its
  // forward; each page and slot checked against the cache's.
  void copy_pages(std::span<const int32_t> saves, std::span<const int32_t> loads);
  // Prefill / decode disaggregation: rows in token order, each token's rows of every layer together
  // ([tokens][layers][row] bytes, whatever the page size), through a staging buffer of Backend::alloc_host (made on
  // first use, kept, at most 64 MiB: longer reads and writes take several trips), waiting for the device.
  // read_rows: tokens [skip, skip + n) of the pages' slots (in order, page_size each) into `out`.
  void read_rows(std::span<const int32_t> pages, int64_t skip, int64_t n, char* out);
  // write_rows: every slot of the pages; token(i) is the [layers][row] bytes of the pages' i-th slot (from 0).
  void write_rows(std::span<const int32_t> pages, const std::function<const char*(int64_t)>& token);
  // Bytes of one token's row in one layer.
  int64_t row_bytes() const { return page_bytes() / page_size_; }
  // The staging buffer's largest size (tests: small, so that reads and writes take several trips).
  void set_staging_limit(size_t bytes) { staging_limit_ = bytes; }
  // The cache's element type on a backend: the FP8 type when given, else the backend's activation type.
  static DType dtype_on(const Backend& backend, std::optional<DType> fp8) { return fp8.value_or(backend.act_dtype()); }

 private:
  int64_t num_pages_;
  int32_t page_size_;
  DType dtype_;
  std::vector<Tensor> layers_;
  Backend* backend_;
  std::unique_ptr<char, std::function<void(char*)>> host_;  // host_slots_ * page_bytes()
  size_t staging_limit_ = size_t{64} << 20;
  char* staging(size_t bytes);  // the staging buffer, grown to `bytes` (<= staging_limit_, or one page of all layers)
  std::unique_ptr<char, std::function<void(char*)>> staging_;
  size_t staging_bytes_ = 0;
  int64_t host_slots_ = 0;
};

// --kv-cache-dtype (SGLang's and vLLM's values): F8_E4M3 for "fp8" / "fp8_e4m3", F8_E5M2 for "fp8_e5m2", none for
// the activation type ("auto", "bf16", "bfloat16"); anything else fails with a message naming the flag.
std::optional<DType> parse_kv_cache_dtype(const std::string& s);
// The flag's help text (every command that takes it).
inline constexpr const char* kKvCacheDtypeHelp =
    "latent KV cache: auto (the activation type) | bf16 | fp8_e4m3 (fp8) | fp8_e5m2 (FP8: half the bytes per token)";

}  // namespace mlaserve
