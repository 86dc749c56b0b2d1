// Large byte buffers kept for reuse. A fresh buffer of tens of MiB costs a page fault per 4 KiB page on its first
// writes (on some machines more than the copy itself); the prefill / decode KV transfer moves 64 MiB pieces through
// such buffers (an export's answer, a decode server's received rows), so they are given back here once sent or used
// and taken again by the next piece.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

namespace mlaserve {

class BufferPool {
 public:
  // Keeps buffers of at least `min_bytes` capacity, `max_bytes` of them in all.
  BufferPool(size_t min_bytes, size_t max_bytes) : min_bytes_(min_bytes), max_bytes_(max_bytes) {}
  // An empty string whose capacity is at least `bytes`: the smallest kept one that fits, else a new one.
  std::string take(size_t bytes);
  // The same string resized to `bytes`, its contents unspecified (a kept one's old bytes: only what it grows past
  // them is filled), for a caller that writes all of it.
  std::string take_sized(size_t bytes);
  // Keeps `s`'s memory for a later take (nothing when it is small, or the pool is full).
  void give(std::string&& s);
  size_t kept_bytes() const;
  // The process's pool (buffers of 16 MiB and more, 1 GiB in all).
  static BufferPool& global();

 private:
  const size_t min_bytes_, max_bytes_;
  mutable std::mutex mu_;
  std::vector<std::string> kept_;
  size_t kept_bytes_ = 0;
};

}  // namespace mlaserve
