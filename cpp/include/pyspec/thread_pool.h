// A small fixed-size worker pool for the CPU ops (attention, acceptance).
//
// Why not OpenMP: the core must embed into C++ servers and into a Python process that already carries
// torch's OpenMP runtime; a private pool avoids runtime clashes and lets each engine own its threads.
#pragma once

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
  // (at most 1024).
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
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

  int64_t owner_pid_;
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
  bool busy_ = false;
  std::exception_ptr error_;
};

}  // namespace pyspec
