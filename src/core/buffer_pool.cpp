#include "core/buffer_pool.h"

namespace mlaserve {

std::string BufferPool::take(size_t bytes) {
  std::string s = take_sized(bytes);
  s.clear();  // (the capacity stays)
  return s;
}

std::string BufferPool::take_sized(size_t bytes) {
  std::string s;
  {
    std::lock_guard lk(mu_);
    size_t best = kept_.size();
    for (size_t i = 0; i < kept_.size(); ++i)
      if (kept_[i].capacity() >= bytes && (best == kept_.size() || kept_[i].capacity() < kept_[best].capacity()))
        best = i;
    if (best < kept_.size()) {
      s = std::move(kept_[best]);
      kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(best));
      kept_bytes_ -= s.capacity();
    }
  }
  if (s.capacity() < bytes) s.reserve(bytes);  // (none kept fits: a new one)
  s.resize(bytes);  // (a kept one shrinks without touching its bytes, or grows filling only the new ones)
  return s;
}

void BufferPool::give(std::string&& s) {
  const size_t cap = s.capacity();
  if (cap < min_bytes_) return;
  std::string keep = std::move(s);  // (its size stays too: take_sized reuses its bytes unfilled)
  std::lock_guard lk(mu_);
  if (kept_bytes_ + cap > max_bytes_) return;  // (freed on leaving)
  kept_bytes_ += cap;
  kept_.push_back(std::move(keep));
}

size_t BufferPool::kept_bytes() const {
  std::lock_guard lk(mu_);
  return kept_bytes_;
}

BufferPool& BufferPool::global() {
  static BufferPool pool(size_t{16} << 20, size_t{1} << 30);
  return pool;
}

}  // namespace mlaserve
