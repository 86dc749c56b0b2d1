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

void KvCache::read_rows(std::span<const int32_t> pages, int64_t skip, int64_t n, char* out) {
  const auto L = static_cast<size_t>(num_layers()), pb = static_cast<size_t>(page_bytes()),
             row = static_cast<size_t>(row_bytes()), P = static_cast<size_t>(page_size_);
  MLA_CHECK(skip >= 0 && n >= 0 && static_cast<size_t>(skip + n) <= pages.size() * P,
            "kv cache: reading tokens [{}, {}) of {} pages of {}", skip, skip + n, pages.size(), P);
  for (int32_t p : pages) MLA_CHECK(p >= 0 && p < num_pages_, "kv cache: reading page {} of {}", p, num_pages_);
  if (n == 0) return;
  // Only the pages holding [skip, skip + n), a group of them per trip through the staging buffer.
  const auto first = static_cast<size_t>(skip) / P, last = (static_cast<size_t>(skip + n) + P - 1) / P;
  std::vector<Tensor*> layers;
  for (Tensor& t : layers_) layers.push_back(&t);
  const size_t group = std::max<size_t>(1, staging_limit_ / (L * pb));
  for (size_t a = first; a < last; a += group) {
    const size_t b = std::min(last, a + group);
    char* host = staging((b - a) * L * pb);
    std::vector<int32_t> pairs;
    for (size_t i = a; i < b; ++i) {
      pairs.push_back(pages[i]);
      pairs.push_back(static_cast<int32_t>(i - a));
    }
    backend_->copy_kv_pages(layers, page_bytes(), host, pairs, {});
    backend_->synchronize();
    // Block i - a holds page i of every layer ([layers][page_size][row]); slot i * P + k is token i * P + k - skip.
    const size_t t0 = std::max(a * P, static_cast<size_t>(skip)), t1 = std::min(b * P, static_cast<size_t>(skip + n));
    for (size_t t = t0; t < t1; ++t) {
      const char* src = host + ((t / P - a) * L) * pb + (t % P) * row;
      char* dst = out + (t - static_cast<size_t>(skip)) * L * row;
      for (size_t l = 0; l < L; ++l) std::memcpy(dst + l * row, src + l * pb, row);
    }
  }
}

void KvCache::write_rows(std::span<const int32_t> pages, const std::function<const char*(int64_t)>& token) {
  const auto n = pages.size(), L = static_cast<size_t>(num_layers()), pb = static_cast<size_t>(page_bytes()),
             row = static_cast<size_t>(row_bytes()), P = static_cast<size_t>(page_size_);
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
    }
    for (size_t t = a * P; t < b * P; ++t) {
      const char* src = token(static_cast<int64_t>(t));
      char* dst = host + ((t / P - a) * L) * pb + (t % P) * row;
      for (size_t l = 0; l < L; ++l) std::memcpy(dst + l * pb, src + l * row, row);
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
