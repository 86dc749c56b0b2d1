// The in-process communicator: every collective against its definition, on threads; failures never hang.
#include <gtest/gtest.h>

#include <thread>

#include "core/error.h"
#include "parallel/inprocess_communicator.h"

using namespace mlaserve;

namespace {
void on_ranks(int n, const std::function<void(InProcessCommunicator&)>& fn,
              std::vector<std::unique_ptr<InProcessCommunicator>>* keep = nullptr) {
  auto comms = make_inprocess_communicators(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back([&, r] { fn(*comms[r]); });
  for (auto& t : ts) t.join();
  if (keep) *keep = std::move(comms);
}
Tensor filled(Shape s, float base) {
  Tensor t = Tensor::empty_host(s, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = base + i;
  return t;
}
}  // namespace

TEST(InProcessCommunicator, Collectives) {
  const int n = 4;
  on_ranks(n, [&](InProcessCommunicator& c) {
    const int r = c.rank();
    for (int iter = 0; iter < 50; ++iter) {  // repeated: the barrier generations must not mix
      Tensor t = filled({3}, float(r));
      c.all_reduce_sum(t);
      for (int i = 0; i < 3; ++i) ASSERT_EQ(t.data_as<float>()[i], 0 + 1 + 2 + 3 + 4.0f * i);

      Tensor in = filled({2, 2}, 10.0f * r), out = Tensor::empty_host({2 * n, 2}, DType::F32);
      c.all_gather(in, out);
      for (int k = 0; k < n; ++k) ASSERT_EQ(out.data_as<float>()[k * 4], 10.0f * k);

      std::vector<int64_t> counts{0, 1, 3, 2};  // unequal, one empty
      Tensor vin = filled({counts[r], 2}, 100.0f * r), vout = Tensor::empty_host({6, 2}, DType::F32);
      c.all_gather_v(vin, vout, counts);
      ASSERT_EQ(vout.data_as<float>()[0], 100.0f);      // rank 1's row
      ASSERT_EQ(vout.data_as<float>()[2], 200.0f);      // rank 2's first row
      ASSERT_EQ(vout.data_as<float>()[8], 300.0f);      // rank 3's first row

      Tensor rin = filled({n * 2}, float(r)), rout = Tensor::empty_host({2}, DType::F32);
      c.reduce_scatter_sum(rin, rout);
      ASSERT_EQ(rout.data_as<float>()[0], 6.0f + 4.0f * 2 * r);

      Tensor b = filled({2}, float(r));
      c.broadcast(b, 2);
      ASSERT_EQ(b.data_as<float>()[0], 2.0f);
      c.barrier();
    }
  });
}

TEST(InProcessCommunicator, MissingRankTimesOutWithAClearError) {
  auto g = std::make_shared<InProcessGroup>(3, std::chrono::milliseconds(200));
  InProcessCommunicator c0(g, 0), c1(g, 1);
  std::string e0, e1;
  std::thread t([&] {
    try {
      c1.barrier();
    } catch (const Error& e) {
      e1 = e.what();
    }
  });
  try {
    c0.barrier();
  } catch (const Error& e) {
    e0 = e.what();
  }
  t.join();
  EXPECT_NE(e0.find("timed out"), std::string::npos) << e0;
  EXPECT_NE((e0 + e1).find("ranks 2"), std::string::npos) << e0 << " / " << e1;
  EXPECT_FALSE(e1.empty());
}

TEST(InProcessCommunicator, AbortWakesEveryWaiter) {
  auto g = std::make_shared<InProcessGroup>(2);
  InProcessCommunicator c0(g, 0);
  std::string err;
  std::thread t([&] {
    try {
      Tensor x = filled({1}, 0);
      c0.all_reduce_sum(x);
    } catch (const Error& e) {
      err = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  g->abort("rank 1 failed");
  t.join();
  EXPECT_NE(err.find("rank 1 failed"), std::string::npos) << err;
}
