#include "parallel/communicator.h"

#include <cstring>

namespace mlaserve {

void SingleRankCommunicator::all_gather(const Tensor& in, Tensor& out) {
  MLA_CHECK(in.nbytes() == out.nbytes(), "all_gather: sizes differ ({} vs {} bytes)", in.nbytes(), out.nbytes());
  MLA_CHECK(in.device() == Device::CPU, "SingleRankCommunicator::all_gather on a device tensor needs the backend copy");
  if (in.data() != out.data()) std::memcpy(out.data(), in.data(), in.nbytes());
}

void SingleRankCommunicator::all_gather_v(const Tensor& in, Tensor& out, const std::vector<int64_t>&) {
  all_gather(in, out);
}

void SingleRankCommunicator::reduce_scatter_sum(const Tensor& in, Tensor& out) { all_gather(in, out); }

}  // namespace mlaserve
