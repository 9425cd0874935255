#include "pyspec/thread_pool.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
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
constexpr int kDefaultSpinUs = 500;
constexpr int kMaxSpinUs = 100000;
constexpr int kBusySpinUs = 20;  // polled without yielding the core

int ResolveSpin(int requested) {
  if (requested < 0) {
    requested = kDefaultSpinUs;
    if (const char* env = std::getenv("PYSPEC_SPIN_US")) {
      char* end = nullptr;
      long v = std::strtol(env, &end, 10);
      if (end != env && *end == '\0' && v >= 0) {
        requested = static_cast<int>(std::min<long>(v, kMaxSpinUs));
      }
    }
  }
  return std::min(requested, kMaxSpinUs);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

}  // namespace

template <class Pred>
bool ThreadPool::Spin(Pred ready) const {
  const int us = spin_us();
  if (us <= 0) return ready();
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::microseconds(us);
  const auto busy_until = start + std::chrono::microseconds(std::min(us, kBusySpinUs));
  while (true) {
    for (int i = 0; i < 32; ++i) {
      if (ready()) return true;
      CpuRelax();
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return ready();
    // Past the first microseconds, give the core to any other runnable thread between polls
    // (torch's own OpenMP workers, when the caller runs a parallel torch op between our jobs):
    // a spinning worker that does not yield stalls them for a whole scheduler time slice.
    if (now >= busy_until) std::this_thread::yield();
  }
}

ThreadPool::ThreadPool(int num_threads, int spin_us)
    : owner_pid_(static_cast<int64_t>(getpid())), spin_us_(ResolveSpin(spin_us)) {
  int n = std::min(ResolveThreads(num_threads), kMaxThreads);
  workers_.reserve(n - 1);
  try {
    for (int i = 0; i + 1 < n; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  } catch (...) {
    // Could not start them all (resource limits): run with the ones that started.
  }
}

int ThreadPool::set_spin_us(int us) {
  return spin_us_.exchange(std::max(0, std::min(us, kMaxSpinUs)), std::memory_order_relaxed);
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
    stopping_.store(true, std::memory_order_release);
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
  uint64_t seen = 0;  // the last job this worker looked at (whether or not chunks were left)
  // Poll only while jobs come quickly: after a wait longer than the spin window (between decode
  // steps, or while the caller runs its own multithreaded work such as torch's matrix products
  // during a prefill) the next wait sleeps at once instead of taking a core from that work.
  bool poll = true;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (!stop_ && generation_ == seen) {
      const auto idle_from = std::chrono::steady_clock::now();
      if (poll) {
        lock.unlock();
        Spin([&] {
          return posted_.load(std::memory_order_acquire) != seen ||
                 stopping_.load(std::memory_order_acquire);
        });
        lock.lock();
      }
      cv_work_.wait(lock, [&] { return stop_ || generation_ != seen; });
      const int us = spin_us();
      poll = us > 0 && std::chrono::steady_clock::now() - idle_from < std::chrono::microseconds(us);
    }
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
      done_.store(++chunks_done_, std::memory_order_release);
      if (chunks_done_ == num_chunks_) cv_done_.notify_all();
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
  done_.store(0, std::memory_order_relaxed);
  error_ = nullptr;
  ++generation_;
  posted_.store(generation_, std::memory_order_release);
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
    done_.store(++chunks_done_, std::memory_order_release);
  }
  if (chunks_done_ != num_chunks_) {
    // The workers are finishing their last chunks: poll before sleeping, as they do.
    const int64_t total = num_chunks_;
    lock.unlock();
    Spin([&] { return done_.load(std::memory_order_acquire) == total; });
    lock.lock();
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
