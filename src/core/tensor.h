// Tensor: a typed, shaped, contiguous (row-major) view of memory on one device, optionally owning it.
// Kernels receive raw pointers from it; the model never touches elements of a device tensor directly.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace mlaserve {

enum class Device : uint8_t { CPU, CUDA };
struct BlockScales;

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Tensor {
 public:
  Tensor() = default;

  // A new zero-initialised host tensor (64-byte aligned).
  static Tensor empty_host(Shape shape, DType dtype);
  // A view of foreign memory; `keepalive` (may be null) keeps the memory alive as long as the view.
  static Tensor view(void* data, Shape shape, DType dtype, Device device = Device::CPU,
                     std::shared_ptr<void> keepalive = nullptr);

  bool defined() const { return data_ != nullptr || !shape_.empty(); }
  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t i) const {
    if (i < 0) i += dim();
    MLA_CHECK(i >= 0 && i < dim(), "tensor dim {} out of range for shape {}", i, shape_str(shape_));
    return shape_[static_cast<size_t>(i)];
  }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  const std::shared_ptr<void>& storage() const { return storage_; }

  // Same memory, new shape (numel must match).
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along dim 0 (contiguous, no copy).
  Tensor rows(int64_t begin, int64_t end) const;
  // Weights kept quantized (F8_E4M3, or INT4 pairs in U8): the scales of their blocks (BlockScales), null otherwise.
  // reshape and rows views drop them (the blocks are of the whole tensor's last two dims).
  const BlockScales* block_scales() const { return scales_.get(); }
  void set_block_scales(std::shared_ptr<const BlockScales> s) { scales_ = std::move(s); }

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
  std::shared_ptr<const BlockScales> scales_;
};

// The F32 scale of each block_rows x block_cols block of an F8_E4M3 tensor [..., R, C]: scale [..., ceil(R /
// block_rows), ceil(C / block_cols)]; element (.., r, c) is f8 * scale[.., r / block_rows, c / block_cols].
// INT4 weights: a U8 tensor [..., R, C / 2] holds two 4-bit codes per byte (column 2 j in the low nibble), `zero`
// (F32, scale's shape) each block's zero point; element (.., r, c) is (code - zero) * scale of its block.
struct BlockScales {
  Tensor scale;
  int64_t block_rows = 0, block_cols = 0;
  Tensor zero;  // INT4 only

  bool int4() const { return zero.defined(); }
};

}  // namespace mlaserve
