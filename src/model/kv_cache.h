// The paged latent KV cache: per layer one device tensor [num_pages * page_size, kv_lora_rank + qk_rope_head_dim]
// holding, for every token slot, the normalised c_kv followed by the rotated shared k_pe. Which slots belong to
// which sequence is the page table's business (engine/page_pool.h hands out pages).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace mlaserve {

class KvCache {
 public:
  KvCache(Backend& backend, const ModelConfig& config, int64_t num_pages, int32_t page_size);
  int64_t num_pages() const { return num_pages_; }
  int32_t page_size() const { return page_size_; }
  int64_t num_slots() const { return num_pages_ * page_size_; }
  Tensor& layer(int64_t i) { return layers_[static_cast<size_t>(i)]; }
  // Bytes of cache per token (all layers).
  static int64_t bytes_per_token(const ModelConfig& c, DType dtype);

 private:
  int64_t num_pages_;
  int32_t page_size_;
  std::vector<Tensor> layers_;
};

}  // namespace mlaserve
