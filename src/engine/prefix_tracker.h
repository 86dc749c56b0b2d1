// PrefixTracker: what one DP rank's prefix cache probably holds, for routing (--load-balance-method cache_aware).
// A radix tree of the token sequences sent to the rank (prompts when they are placed there, prompt + output once they
// finish), a tree per cache salt, holding at most `capacity` tokens: past it, the least recently used leaves go first.
// It mirrors the rank's RadixCache only roughly (that one evicts on its own schedule, in whole pages), which is enough
// to send a request where its prefix most likely is. Not thread-safe (LoadBalancer locks around it).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mlaserve {

class PrefixTracker {
 public:
  explicit PrefixTracker(int64_t capacity) : capacity_(capacity) {}
  PrefixTracker(PrefixTracker&&) noexcept = default;
  PrefixTracker& operator=(PrefixTracker&&) noexcept = default;
  ~PrefixTracker();

  // The length of the longest tracked prefix of `tokens` (in `salt`'s tree). Reads only.
  int32_t match(std::string_view salt, std::span<const int32_t> tokens) const;
  // Tracks `tokens` (marks its path used now), then evicts past the capacity.
  void insert(std::string_view salt, std::span<const int32_t> tokens);
  void clear();
  int64_t size() const { return size_; }  // tokens tracked

 private:
  struct Node {
    std::vector<int32_t> key;  // the edge's tokens (empty only at a root)
    Node* parent = nullptr;
    std::unordered_map<int32_t, std::unique_ptr<Node>> kids;  // by their key's first token
    uint64_t used = 0;
  };
  void evict();

  int64_t capacity_;
  int64_t size_ = 0;
  uint64_t clock_ = 0;
  std::unordered_map<std::string, std::unique_ptr<Node>> roots_;  // per salt
};

}  // namespace mlaserve
