// BufferPool: large buffers given back are taken again (the same memory), the smallest that fits first; small ones
// and those past the pool's size are not kept; taken at a size, a kept buffer's bytes are not filled again.
#include <gtest/gtest.h>

#include "core/buffer_pool.h"

namespace mlaserve {
namespace {

TEST(BufferPool, GivenBuffersAreTakenAgain) {
  BufferPool pool(1000, 10000);
  std::string a = pool.take(3000);
  EXPECT_TRUE(a.empty());
  EXPECT_GE(a.capacity(), 3000u);
  a.assign(2500, 'a');
  const char* mem = a.data();
  pool.give(std::move(a));
  EXPECT_GE(pool.kept_bytes(), 3000u);
  std::string b = pool.take(2000);  // the same memory, emptied
  EXPECT_EQ(b.data(), mem);
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(pool.kept_bytes(), 0u);
  std::string c = pool.take(2000);  // none kept now: a new one
  EXPECT_NE(c.data(), mem);
  EXPECT_GE(c.capacity(), 2000u);
}

TEST(BufferPool, SmallestFitFirstAndLimits) {
  BufferPool pool(1000, 10000);
  std::string big = pool.take(6000), mid = pool.take(3000), small = pool.take(500);
  const char *big_mem = big.data(), *mid_mem = mid.data();
  pool.give(std::move(small));  // under min_bytes: not kept
  EXPECT_EQ(pool.kept_bytes(), 0u);
  pool.give(std::move(big));
  pool.give(std::move(mid));
  EXPECT_GE(pool.kept_bytes(), 9000u);
  std::string extra = pool.take(4000);
  pool.give(std::move(extra));  // past max_bytes: not kept
  EXPECT_LE(pool.kept_bytes(), 10000u);
  EXPECT_EQ(pool.take(2500).data(), mid_mem);  // the smallest that fits
  EXPECT_EQ(pool.take(2500).data(), big_mem);
  EXPECT_EQ(pool.kept_bytes(), 0u);
}

TEST(BufferPool, TakenAtASizeWithoutFillingAgain) {
  BufferPool pool(1000, 10000);
  std::string a = pool.take_sized(3000);
  EXPECT_EQ(a.size(), 3000u);
  a.assign(3000, 'x');
  const char* mem = a.data();
  pool.give(std::move(a));
  std::string b = pool.take_sized(2000);  // the same memory, its bytes as they were
  EXPECT_EQ(b.data(), mem);
  EXPECT_EQ(b, std::string(2000, 'x'));
  pool.give(std::move(b));
  std::string c = pool.take_sized(2500);  // grown back within its capacity: only the new bytes are filled
  EXPECT_EQ(c.data(), mem);
  EXPECT_EQ(c.size(), 2500u);
  EXPECT_EQ(c.substr(0, 2000), std::string(2000, 'x'));
  EXPECT_TRUE(pool.take(10).empty());  // (nothing kept now: a new, empty one)
}

}  // namespace
}  // namespace mlaserve
