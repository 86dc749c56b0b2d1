#include "model/kv_cache.h"

namespace mlaserve {

KvCache::KvCache(Backend& backend, const ModelConfig& config, int64_t num_pages, int32_t page_size,
                 std::optional<DType> fp8)
    : num_pages_(num_pages), page_size_(page_size), dtype_(dtype_on(backend, fp8)) {
  MLA_CHECK(!fp8 || *fp8 == DType::F8_E4M3 || *fp8 == DType::F8_E5M2, "kv cache: {} is not an FP8 type",
            dtype_name(*fp8));
  MLA_CHECK(num_pages > 0 && page_size > 0, "kv cache needs pages (got {} pages of {})", num_pages, page_size);
  for (int64_t l = 0; l < config.num_cache_layers(); ++l)
    layers_.push_back(backend.alloc({num_pages * page_size, config.kv_cache_dim()}, dtype_));
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
