#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include "pyspec/thread_pool.h"

namespace pyspec {
namespace {

TEST(ThreadPool, CoversEveryIndexOnce) {
  ThreadPool pool(3);
  for (int64_t n : {0, 1, 7, 1000, 12345}) {
    std::vector<std::atomic<int>> hits(n);
    pool.ParallelFor(n, 5, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << n << " " << i;
  }
}

TEST(ThreadPool, RethrowsFirstError) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.ParallelFor(100, 1,
                                [](int64_t b, int64_t) {
                                  if (b >= 50) throw std::runtime_error("boom");
                                }),
               std::runtime_error);
  // Still usable afterwards.
  std::atomic<int64_t> sum{0};
  pool.ParallelFor(100, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) sum += i;
  });
  EXPECT_EQ(sum.load(), 4950);
}

TEST(ThreadPool, NestedCallsRunSerially) {
  ThreadPool pool(2);
  std::atomic<int> count{0};
  pool.ParallelFor(8, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      pool.ParallelFor(4, 1, [&](int64_t b2, int64_t e2) { count += static_cast<int>(e2 - b2); });
    }
  });
  EXPECT_EQ(count.load(), 32);
}

TEST(ThreadPool, PollingAndSleepingPoolsAgree) {
  // Jobs in quick succession (workers polling) and spaced out (workers asleep), with polling on
  // and off: every index exactly once, the same sums.
  for (int spin : {0, 50, 2000}) {
    ThreadPool pool(3, spin);
    EXPECT_EQ(pool.spin_us(), spin);
    for (int round = 0; round < 200; ++round) {
      if (round % 50 == 49) std::this_thread::sleep_for(std::chrono::milliseconds(3));
      const int64_t n = 1 + round % 37;
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[i]++;
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << spin << " " << round;
    }
  }
}

TEST(ThreadPool, SpinWindowIsClampedAndChangeable) {
  ThreadPool pool(2, 300);
  EXPECT_EQ(pool.set_spin_us(-5), 300);
  EXPECT_EQ(pool.spin_us(), 0);
  EXPECT_EQ(pool.set_spin_us(1 << 30), 0);
  EXPECT_EQ(pool.spin_us(), 100000);
  EXPECT_EQ(ThreadPool(2, 1 << 30).spin_us(), 100000);
}

TEST(ThreadPool, PollingWorkersStopPromptly) {
  // Destroying a pool whose workers are polling (a 100 ms window, the most set_spin_us allows)
  // must not wait out the window. A pool that does takes >= 100 ms every time; a loaded machine
  // may delay one teardown that long, not three in a row: the best of three must be under it.
  auto best = std::chrono::steady_clock::duration::max();
  for (int attempt = 0; attempt < 3; ++attempt) {
    const auto t0 = std::chrono::steady_clock::now();
    {
      ThreadPool pool(3, 100000);
      ASSERT_EQ(pool.spin_us(), 100000);
      std::atomic<int64_t> sum{0};
      pool.ParallelFor(64, 1, [&](int64_t b, int64_t e) { sum += e - b; });
      EXPECT_EQ(sum.load(), 64);
    }
    best = std::min(best, std::chrono::steady_clock::now() - t0);
  }
  EXPECT_LT(best, std::chrono::milliseconds(100));
}

}  // namespace
}  // namespace pyspec
