#include "model/kv_cache.h"

namespace mlaserve {

KvCache::KvCache(Backend& backend, const ModelConfig& config, int64_t num_pages, int32_t page_size, bool fp8)
    : num_pages_(num_pages), page_size_(page_size), dtype_(dtype_on(backend, fp8)) {
  MLA_CHECK(num_pages > 0 && page_size > 0, "kv cache needs pages (got {} pages of {})", num_pages, page_size);
  for (int64_t l = 0; l < config.num_hidden_layers; ++l)
    layers_.push_back(backend.alloc({num_pages * page_size, config.kv_cache_dim()}, dtype_));
}

int64_t KvCache::bytes_per_token(const ModelConfig& c, DType dtype) {
  return c.num_hidden_layers * c.kv_cache_dim() * static_cast<int64_t>(dtype_size(dtype));
}

bool parse_kv_cache_dtype(const std::string& s) {
  if (s == "auto" || s == "bf16" || s == "bfloat16") return false;
  if (s == "fp8" || s == "fp8_e4m3") return true;
  MLA_CHECK(s != "fp8_e5m2", "--kv-cache-dtype fp8_e5m2 is not supported: the FP8 latent cache is E4M3 "
            "(--kv-cache-dtype fp8_e4m3)");
  fail("--kv-cache-dtype: expected auto, bf16, fp8 or fp8_e4m3, got '{}'", s);
}

}  // namespace mlaserve
