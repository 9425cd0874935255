// A small fixed-size worker pool for the CPU ops (attention, acceptance).
//
// Why not OpenMP: the core must embed into C++ servers and into a Python process that already carries
// torch's OpenMP runtime; a private pool avoids runtime clashes and lets each engine own its threads.
//
// A decode step calls the pool a few hundred times (every dense layer and attention call of every
// layer), tens of microseconds apart. Waking a worker blocked on a condition variable costs about as
// much as a small layer's whole work, so an idle worker first polls for the next job for a short
// while (spin_us, default 500 us, PYSPEC_SPIN_US in the environment; 0 disables) and only then
// sleeps; a caller waiting for the workers' last chunks polls the same way. After the first 20 us a
// poller yields its core between polls, so a runnable thread (torch's own OpenMP workers) is not
// held off for a scheduler time slice. A worker polls only
// while jobs have been coming within that window: after a longer wait it sleeps at once, so it
// does not compete with the caller's own multithreaded work (torch's GEMMs in a prefill) between
// sparse jobs, and an idle pool stops using CPU within spin_us.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pyspec {

class ThreadPool {
 public:
  // num_threads <= 0 picks PYSPEC_NUM_THREADS from the environment, else hardware concurrency
  // (at most 1024). spin_us < 0 picks PYSPEC_SPIN_US from the environment, else 500 (at most
  // 100000); 0 makes idle workers sleep at once.
  explicit ThreadPool(int num_threads = 0, int spin_us = -1);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  int spin_us() const { return spin_us_.load(std::memory_order_relaxed); }
  // Changes the polling window for the jobs that follow (clamped to [0, 100000]); returns the
  // previous value.
  int set_spin_us(int us);
  // True in a child process forked after this pool started; the child then runs jobs serially.
  bool InForkedChild() const;

  // Runs fn(begin, end) over [0, n) split into contiguous chunks of at least `grain` items, on the
  // pool's workers and the calling thread. Blocks until all chunks are done. The first exception
  // thrown by any chunk is rethrown on the caller. Calls from inside a running task run serially.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // The process-wide pool the Python bindings use. Stateless with respect to results: any pool
  // gives identical outputs; embedders may pass their own.
  static ThreadPool& Default();

 private:
  void WorkerLoop();
  // Polls `ready` (lock-free reads only) for up to spin_us_; true once it held.
  template <class Pred>
  bool Spin(Pred ready) const;

  int64_t owner_pid_;
  std::atomic<int> spin_us_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int64_t job_chunk_ = 0;
  int64_t next_chunk_ = 0;
  int64_t num_chunks_ = 0;
  int64_t chunks_done_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  // Copies of generation_, chunks_done_ and stop_ (written under mu_) for polling without it.
  std::atomic<uint64_t> posted_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> stopping_{false};
  bool busy_ = false;
  std::exception_ptr error_;
};

}  // namespace pyspec
