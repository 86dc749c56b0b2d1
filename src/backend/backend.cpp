#include "backend/backend.h"

#include <cstring>

namespace mlaserve {

uint64_t Backend::download_start(const Tensor& t) {
  MLA_CHECK(done_downloads_.size() < static_cast<size_t>(kMaxDownloads), "more than {} downloads in flight",
            kMaxDownloads);
  std::vector<char> bytes(t.nbytes());
  download(t, bytes.data());
  done_downloads_.emplace_back(next_download_, std::move(bytes));
  return next_download_++;
}

void Backend::download_finish(uint64_t ticket, void* dst) {
  MLA_CHECK(!done_downloads_.empty() && done_downloads_.front().first == ticket,
            "download {} finished out of order or twice", ticket);
  const std::vector<char>& b = done_downloads_.front().second;
  if (!b.empty()) std::memcpy(dst, b.data(), b.size());
  done_downloads_.pop_front();
}

}  // namespace mlaserve
