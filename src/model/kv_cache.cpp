#include "model/kv_cache.h"

#include <algorithm>
#include <cstring>

namespace mlaserve {

KvCache::KvCache(Backend& backend, const ModelConfig& config, int64_t num_pages, int32_t page_size,
                 std::optional<DType> fp8)
    : num_pages_(num_pages), page_size_(page_size), dtype_(dtype_on(backend, fp8)), backend_(&backend) {
  MLA_CHECK(!fp8 || *fp8 == DType::F8_E4M3 || *fp8 == DType::F8_E5M2, "kv cache: {} is not an FP8 type",
            dtype_name(*fp8));
  MLA_CHECK(num_pages > 0 && page_size > 0, "kv cache needs pages (got {} pages of {})", num_pages, page_size);
  for (int64_t l = 0; l < config.num_cache_layers(); ++l)
    layers_.push_back(backend.alloc({num_pages * page_size, config.kv_cache_dim()}, dtype_));
}

void KvCache::enable_host(int64_t slots) {
  MLA_CHECK(slots > 0, "kv cache: a host tier needs slots, got {}", slots);
  const size_t bytes = static_cast<size_t>(slots * num_layers() * page_bytes());
  Backend* be = backend_;
  host_ = std::unique_ptr<char, std::function<void(char*)>>(static_cast<char*>(be->alloc_host(bytes)),
                                                            [be](char* p) { be->free_host(p); });
  host_slots_ = slots;
}

void KvCache::copy_pages(std::span<const int32_t> saves, std::span<const int32_t> loads) {
  if (saves.empty() && loads.empty()) return;
  MLA_CHECK(host_, "kv cache: a step copies pages to the host, but this cache has no host tier");
  MLA_CHECK(saves.size() % 2 == 0 && loads.size() % 2 == 0, "kv cache: page copies come in pairs");
  for (const bool save : {true, false}) {
    const std::span<const int32_t> pairs = save ? saves : loads;
    for (size_t i = 0; i < pairs.size(); i += 2) {
      const int32_t page = save ? pairs[i] : pairs[i + 1], slot = save ? pairs[i + 1] : pairs[i];
      MLA_CHECK(page >= 0 && page < num_pages_ && slot >= 0 && slot < host_slots_,
                "kv cache: copy between page {} (of {}) and host slot {} (of {})", page, num_pages_, slot, host_slots_);
    }
  }
  std::vector<Tensor*> layers;
  for (Tensor& t : layers_) layers.push_back(&t);
  backend_->copy_kv_pages(layers, page_bytes(), host_.get(), saves, loads);
}

char* KvCache::staging(size_t bytes) {
  if (staging_bytes_ < bytes) {
    Backend* be = backend_;
    staging_ = std::unique_ptr<char, std::function<void(char*)>>(static_cast<char*>(be->alloc_host(bytes)),
                                                                 [be](char* p) { be->free_host(p); });
    staging_bytes_ = bytes;
  }
  return staging_.get();
}

std::vector<char> KvCache::read_rows(std::span<const int32_t> pages) {
  const auto n = pages.size(), L = static_cast<size_t>(num_layers()), pb = static_cast<size_t>(page_bytes());
  for (int32_t p : pages) MLA_CHECK(p >= 0 && p < num_pages_, "kv cache: reading page {} of {}", p, num_pages_);
  std::vector<char> rows(n * L * pb);
  std::vector<Tensor*> layers;
  for (Tensor& t : layers_) layers.push_back(&t);
  const size_t group = std::max<size_t>(1, staging_limit_ / (L * pb));  // pages per trip through the staging buffer
  for (size_t a = 0; a < n; a += group) {
    const size_t b = std::min(n, a + group);
    char* host = staging((b - a) * L * pb);
    std::vector<int32_t> pairs;
    for (size_t i = a; i < b; ++i) {
      pairs.push_back(pages[i]);
      pairs.push_back(static_cast<int32_t>(i - a));
    }
    backend_->copy_kv_pages(layers, page_bytes(), host, pairs, {});
    backend_->synchronize();
    for (size_t i = a; i < b; ++i)  // block i - a = page i of every layer -> each layer's rows of page i
      for (size_t l = 0; l < L; ++l) std::memcpy(rows.data() + (l * n + i) * pb, host + ((i - a) * L + l) * pb, pb);
  }
  return rows;
}

void KvCache::write_rows(std::span<const int32_t> pages, std::span<const char> rows) {
  const auto n = pages.size(), L = static_cast<size_t>(num_layers()), pb = static_cast<size_t>(page_bytes());
  MLA_CHECK(rows.size() == n * L * pb, "kv cache: {} bytes of rows for {} pages of {} layers of {} bytes", rows.size(),
            n, L, pb);
  for (int32_t p : pages) MLA_CHECK(p >= 0 && p < num_pages_, "kv cache: writing page {} of {}", p, num_pages_);
  std::vector<Tensor*> layers;
  for (Tensor& t : layers_) layers.push_back(&t);
  const size_t group = std::max<size_t>(1, staging_limit_ / (L * pb));
  for (size_t a = 0; a < n; a += group) {
    const size_t b = std::min(n, a + group);
    char* host = staging((b - a) * L * pb);
    std::vector<int32_t> pairs;
    for (size_t i = a; i < b; ++i) {
      pairs.push_back(static_cast<int32_t>(i - a));
      pairs.push_back(pages[i]);
      for (size_t l = 0; l < L; ++l) std::memcpy(host + ((i - a) * L + l) * pb, rows.data() + (l * n + i) * pb, pb);
    }
    backend_->copy_kv_pages(layers, page_bytes(), host, {}, pairs);
    backend_->synchronize();  // (the staging buffer is filled again by the next trip)
  }
}

int64_t KvCache::bytes_per_token(const ModelConfig& c, DType dtype) {
  return c.num_cache_layers() * c.kv_cache_dim() * static_cast<int64_t>(dtype_size(dtype));
}

std::optional<DType> parse_kv_cache_dtype(const std::string& s) {
  if (s == "auto" || s == "bf16" || s == "bfloat16") return std::nullopt;
  if (s == "fp8" || s == "fp8_e4m3") return DType::F8_E4M3;
  if (s == "fp8_e5m2") return DType::F8_E5M2;
  fail("--kv-cache-dtype: expected auto, bf16, fp8, fp8_e4m3 or fp8_e5m2, got '{}'", s);
}

}  // namespace mlaserve
