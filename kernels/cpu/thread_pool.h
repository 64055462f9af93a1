// A fixed-size pool of worker threads for the CPU attention backend.
//
// ParallelFor(n, fn) runs fn(0) .. fn(n - 1), each exactly once, on the calling thread and on the
// pool's workers, and returns when all of them have finished. Indices are handed out one at a time
// from a shared counter, so uneven work items balance themselves.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attn::cpu {

class ThreadPool {
 public:
  // Starts num_workers threads (0 is allowed: every ParallelFor then runs on its caller).
  explicit ThreadPool(int num_workers);
  // Joins the workers. No ParallelFor may be running or start during destruction.
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // One less than the number of hardware threads (the caller of ParallelFor is the last one),
  // at least 0.
  static int DefaultNumWorkers();

  int NumWorkers() const { return static_cast<int>(workers_.size()); }
  // Threads one ParallelFor can use at most: the workers plus its caller.
  int MaxParallelism() const { return NumWorkers() + 1; }

  // Calls fn(i) for every i in [0, n) and returns after the last call has returned; writes made by
  // fn on any thread are visible to the caller afterwards. n <= 0 is a no-op.
  //
  // Thread safety: may be called from several threads at once; concurrent calls share the workers
  // (each caller also works on its own range, so every call makes progress even when the workers
  // are busy with another call). fn may be called concurrently with itself and must not throw.
  // fn may itself call ParallelFor on the same pool.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  // One ParallelFor call in flight. Lives on the caller's stack; the caller removes it from jobs_
  // and waits until active == 0 before returning, so no worker touches it afterwards.
  struct Job;

  void WorkerLoop();
  // The first queued job that still has unclaimed indices, or nullptr. Requires mu_ held.
  Job* FindJobLocked();
  // Removes job from jobs_ if it is still queued. Requires mu_ held.
  void RemoveJobLocked(Job* job);

  std::mutex mu_;
  std::condition_variable work_cv_;  // signalled when a job is queued or on shutdown
  std::vector<Job*> jobs_;           // guarded by mu_; calls in arrival order
  bool stop_ = false;                // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace attn::cpu
