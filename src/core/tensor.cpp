#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace mlaserve {

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Tensor Tensor::empty_host(Shape shape, DType dtype) {
  for (int64_t d : shape) MLA_CHECK(d >= 0, "negative dimension in shape {}", shape_str(shape));
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = Device::CPU;
  size_t bytes = t.nbytes();
  size_t alloc = (bytes + 63) / 64 * 64;
  if (alloc == 0) alloc = 64;
  void* p = std::aligned_alloc(64, alloc);
  MLA_CHECK(p != nullptr, "out of host memory allocating {} bytes", alloc);
  std::memset(p, 0, alloc);
  t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  t.data_ = p;
  return t;
}

Tensor Tensor::view(void* data, Shape shape, DType dtype, Device device, std::shared_ptr<void> keepalive) {
  Tensor t;
  t.data_ = data;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = std::move(keepalive);
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  MLA_CHECK(shape_numel(shape) == numel(), "cannot reshape {} to {}", shape_str(shape_), shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  t.scales_.reset();
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  MLA_CHECK(dim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0], "rows [{}, {}) out of range for {}",
            begin, end, shape_str(shape_));
  Tensor t = *this;
  int64_t row_elems = shape_numel(Shape(shape_.begin() + 1, shape_.end()));
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(begin * row_elems) * dtype_size(dtype_);
  t.shape_[0] = end - begin;
  t.scales_.reset();
  return t;
}

}  // namespace mlaserve
