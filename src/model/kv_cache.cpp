#include "model/kv_cache.h"

namespace mlaserve {

KvCache::KvCache(Backend& backend, const ModelConfig& config, int64_t num_pages, int32_t page_size)
    : num_pages_(num_pages), page_size_(page_size) {
  MLA_CHECK(num_pages > 0 && page_size > 0, "kv cache needs pages (got {} pages of {})", num_pages, page_size);
  for (int64_t l = 0; l < config.num_hidden_layers; ++l)
    layers_.push_back(backend.alloc({num_pages * page_size, config.kv_cache_dim()}, backend.act_dtype()));
}

int64_t KvCache::bytes_per_token(const ModelConfig& c, DType dtype) {
  return c.num_hidden_layers * c.kv_cache_dim() * static_cast<int64_t>(dtype_size(dtype));
}

}  // namespace mlaserve
