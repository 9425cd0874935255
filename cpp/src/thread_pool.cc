#include "pyspec/thread_pool.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <exception>

namespace pyspec {
namespace {

thread_local bool t_inside_task = false;

int ResolveThreads(int requested) {
  if (requested > 0) return requested;
  if (const char* env = std::getenv("PYSPEC_NUM_THREADS")) {
    int v = std::atoi(env);
    if (v > 0) return v;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

constexpr int kMaxThreads = 1024;

}  // namespace

ThreadPool::ThreadPool(int num_threads) : owner_pid_(static_cast<int64_t>(getpid())) {
  int n = std::min(ResolveThreads(num_threads), kMaxThreads);
  workers_.reserve(n - 1);
  try {
    for (int i = 0; i + 1 < n; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  } catch (...) {
    // Could not start them all (resource limits): run with the ones that started.
  }
}

bool ThreadPool::InForkedChild() const { return static_cast<int64_t>(getpid()) != owner_pid_; }

ThreadPool::~ThreadPool() {
  if (InForkedChild()) {
    // After fork() the workers exist only in the parent; joining them here would hang. Their
    // std::thread objects are released without joining (a deliberate, bounded leak).
    new std::vector<std::thread>(std::move(workers_));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& w : workers_) w.join();
}

ThreadPool& ThreadPool::Default() {
  // Function-local static: created on first use, thread-safe, destroyed at exit.
  static ThreadPool pool;
  return pool;
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_work_.wait(lock, [&] { return stop_ || (generation_ != seen && next_chunk_ < num_chunks_); });
    if (stop_) return;
    seen = generation_;
    while (next_chunk_ < num_chunks_) {
      int64_t c = next_chunk_++;
      const auto* job = job_;
      int64_t begin = c * job_chunk_, end = std::min(job_n_, begin + job_chunk_);
      lock.unlock();
      std::exception_ptr err;
      t_inside_task = true;
      try {
        (*job)(begin, end);
      } catch (...) {
        err = std::current_exception();
      }
      t_inside_task = false;
      lock.lock();
      if (err && !error_) error_ = err;
      if (++chunks_done_ == num_chunks_) cv_done_.notify_all();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t max_chunks = (n + grain - 1) / grain;
  int64_t chunks = std::min<int64_t>(max_chunks, static_cast<int64_t>(num_threads()) * 4);
  if (chunks <= 1 || workers_.empty() || t_inside_task || InForkedChild()) {
    fn(0, n);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  // One job at a time: a second caller waits for the first to finish.
  cv_done_.wait(lock, [&] { return !busy_; });
  busy_ = true;
  job_ = &fn;
  job_n_ = n;
  job_chunk_ = (n + chunks - 1) / chunks;
  num_chunks_ = (n + job_chunk_ - 1) / job_chunk_;
  next_chunk_ = 0;
  chunks_done_ = 0;
  error_ = nullptr;
  ++generation_;
  cv_work_.notify_all();
  // The caller works too.
  while (next_chunk_ < num_chunks_) {
    int64_t c = next_chunk_++;
    int64_t begin = c * job_chunk_, end = std::min(job_n_, begin + job_chunk_);
    lock.unlock();
    std::exception_ptr err;
    t_inside_task = true;
    try {
      fn(begin, end);
    } catch (...) {
      err = std::current_exception();
    }
    t_inside_task = false;
    lock.lock();
    if (err && !error_) error_ = err;
    ++chunks_done_;
  }
  cv_done_.wait(lock, [&] { return chunks_done_ == num_chunks_; });
  std::exception_ptr err = error_;
  job_ = nullptr;
  num_chunks_ = 0;
  busy_ = false;
  lock.unlock();
  cv_done_.notify_all();
  if (err) std::rethrow_exception(err);
}

}  // namespace pyspec
