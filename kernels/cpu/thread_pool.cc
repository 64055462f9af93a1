#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>

namespace attn::cpu {

struct ThreadPool::Job {
  const std::function<void(int64_t)>* fn;
  int64_t n;
  std::atomic<int64_t> next{0};  // next unclaimed index; claims past n mean "exhausted"
  int active = 0;                // workers currently running indices of this job; guarded by mu_
  std::condition_variable done_cv;

  bool Exhausted() const { return next.load(std::memory_order_relaxed) >= n; }

  // Claims and runs indices until none are left.
  void Run() {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      (*fn)(i);
    }
  }
};

ThreadPool::ThreadPool(int num_workers) {
  workers_.reserve(std::max(num_workers, 0));
  for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int ThreadPool::DefaultNumWorkers() {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(hw - 1, 0);
}

ThreadPool::Job* ThreadPool::FindJobLocked() {
  for (Job* job : jobs_) {
    if (!job->Exhausted()) return job;
  }
  return nullptr;
}

void ThreadPool::RemoveJobLocked(Job* job) {
  const auto it = std::find(jobs_.begin(), jobs_.end(), job);
  if (it != jobs_.end()) jobs_.erase(it);
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Job job;
  job.fn = &fn;
  job.n = n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(&job);
  }
  // The caller takes indices too, so at most n - 1 workers can find something to do.
  if (n - 1 >= NumWorkers()) {
    work_cv_.notify_all();
  } else {
    for (int64_t i = 0; i < n - 1; ++i) work_cv_.notify_one();
  }
  job.Run();
  // Every index is claimed now; wait for the workers still running theirs. Removing the job under
  // the lock guarantees no worker attaches to it after active reaches zero.
  std::unique_lock<std::mutex> lock(mu_);
  RemoveJobLocked(&job);
  job.done_cv.wait(lock, [&job] { return job.active == 0; });
}

void ThreadPool::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    Job* job = nullptr;
    work_cv_.wait(lock, [this, &job] {
      job = FindJobLocked();
      return job != nullptr || stop_;
    });
    if (job == nullptr) return;  // stop_ and nothing left to help with
    ++job->active;
    lock.unlock();
    job->Run();
    lock.lock();
    --job->active;
    RemoveJobLocked(job);  // exhausted: no point in other workers looking at it
    // Notify while holding mu_: once the caller sees active == 0 it destroys the job.
    if (job->active == 0) job->done_cv.notify_all();
  }
}

}  // namespace attn::cpu
