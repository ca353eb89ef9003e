#include "progress_queue.hpp"

#include <exception>

#include "core/log.hpp"
#include "core/thread_name.hpp"

namespace sluice::torch_backend {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}
}  // namespace

ProgressQueue::ProgressQueue(std::function<void()> tick, std::chrono::milliseconds period, const char* thread_name,
                             bool callers_run, std::chrono::microseconds spin)
    : tick_(std::move(tick)),
      period_(period),
      callers_run_(callers_run),
      spin_(callers_run ? spin : std::chrono::microseconds(0)),
      next_tick_(Clock::now() + period) {
  thread_ = std::thread([this, thread_name] {
    ::sluice::detail::name_this_thread(thread_name);
    thread_main();
  });
}

ProgressQueue::~ProgressQueue() {
  close();
  // Dropped by its own thread (a task held the last reference): that thread ends right after.
  if (thread_.joinable()) thread_.detach();
  std::deque<std::function<void()>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sealed_ = true;
    left.swap(tasks_);
  }
}

void ProgressQueue::run_task(const std::function<void()>& task) {
  try {
    task();
  } catch (const std::exception& e) {
    // Every task reports its own failures through its callback; an escape here is a bug, but
    // it must not take the process down (std::terminate on whichever thread ran it).
    SLUICE_LOG(kError, "sluice torch mailbox: a progress task threw: " << e.what());
  }
}

void ProgressQueue::tick_locked(std::unique_lock<std::mutex>& lk) {
  next_tick_ = Clock::now() + period_;
  lk.unlock();
  run_task(tick_);
  lk.lock();
}

void ProgressQueue::run_locked(std::unique_lock<std::mutex>& lk) {
  while (!closing_) {
    // The tick first when due: under a steady stream of tasks the queue is never empty, and
    // the mailbox's timeouts must still expire.
    if (Clock::now() >= next_tick_) {
      tick_locked(lk);
      continue;
    }
    if (tasks_.empty()) break;
    std::deque<std::function<void()>> batch;
    batch.swap(tasks_);
    loud_ = 0;
    auto tick_at = next_tick_;
    lk.unlock();
    size_t i = 0;
    for (auto& t : batch) {
      run_task(t);
      // A long batch (many tasks queued while the last one ran) must not hold the tick off
      // either: look at the clock every few tasks.
      if (++i % 32 == 0 && Clock::now() >= tick_at) {
        lk.lock();
        tick_locked(lk);
        tick_at = next_tick_;
        lk.unlock();
      }
    }
    // The tasks hold tensors (their callbacks capture them); dropping the last reference to a
    // tensor made in Python takes the GIL. Never under mu_: a Python thread that holds the GIL
    // while it posts or submits waits for mu_.
    batch.clear();
    lk.lock();
  }
  running_ = false;
  if (closing_) idle_cv_.notify_all();
  // What the tasks completed may be what a driver waits for.
  changes_.fetch_add(1, std::memory_order_release);
  if (drivers_ > 0) driver_cv_.notify_all();
}

void ProgressQueue::thread_main() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!closing_) {
    // Quiet tasks (post(..., false)) do not call for a runner: they wait for the next one or
    // the tick.
    const bool work = !running_ && (drivers_ == 0 || !callers_run_) && loud_ > 0;
    const bool due = !running_ && Clock::now() >= next_tick_;
    if (work || due) {
      running_ = true;
      run_locked(lk);
      continue;
    }
    // While another thread runs tasks it also runs the tick when due; look again later.
    thread_cv_.wait_until(lk, running_ ? Clock::now() + period_ : next_tick_);
  }
}

void ProgressQueue::post(std::function<void()> task, bool wake) {
  std::unique_lock<std::mutex> lk(mu_);
  if (sealed_) {
    lk.unlock();  // `task` is destroyed outside the lock
    return;
  }
  tasks_.push_back(std::move(task));
  if (wake) ++loud_;
  if (closing_ || running_ || !wake) return;  // drain(), the running thread or the next runner takes it
  changes_.fetch_add(1, std::memory_order_release);
  if (drivers_ > 0 && callers_run_)
    driver_cv_.notify_one();
  else
    thread_cv_.notify_one();
}

void ProgressQueue::submit(std::function<void()> task) {
  std::unique_lock<std::mutex> lk(mu_);
  if (sealed_) {
    lk.unlock();
    return;
  }
  tasks_.push_back(std::move(task));
  ++loud_;
  if (closing_ || running_) return;
  if (!callers_run_) {
    thread_cv_.notify_one();
    return;
  }
  running_ = true;
  run_locked(lk);
}

bool ProgressQueue::drive_until(const std::function<bool()>& ready, Clock::time_point deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  ++drivers_;
  Clock::time_point spin_until{};  // set when this driver first finds nothing to do
  bool ok;
  while (!(ok = ready())) {
    if (callers_run_ && !closing_ && !running_ && !tasks_.empty()) {
      running_ = true;
      run_locked(lk);
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    if (spin_.count() > 0) {
      // Poll before sleeping: a post() seen here costs no wake-up.
      if (spin_until == Clock::time_point()) spin_until = now + spin_;
      if (now < spin_until) {
        const uint64_t seen = changes_.load(std::memory_order_acquire);
        lk.unlock();
        const auto stop = std::min(spin_until, deadline);
        for (unsigned i = 1; changes_.load(std::memory_order_acquire) == seen; ++i) {
          if (i % 64 == 0 && Clock::now() >= stop) break;
          cpu_relax();
        }
        lk.lock();
        continue;
      }
    }
    driver_cv_.wait_until(lk, deadline);
  }
  --drivers_;
  // A task that woke us but that we leave behind (our own op completed meanwhile, on another
  // thread) goes to another driver, or to the queue's thread. Quiet tasks wait for the next
  // runner as they would have anyway: waking a thread for them is the cost they exist to save.
  if (!closing_ && !running_ && loud_ > 0) {
    if (drivers_ > 0 && callers_run_)
      driver_cv_.notify_one();
    else
      thread_cv_.notify_one();
  }
  return ok;
}

void ProgressQueue::wake() {
  std::lock_guard<std::mutex> lk(mu_);
  changes_.fetch_add(1, std::memory_order_release);
  if (drivers_ > 0) driver_cv_.notify_all();
}

void ProgressQueue::close() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (!closing_) {
      closing_ = true;
      changes_.fetch_add(1, std::memory_order_release);
      thread_cv_.notify_all();
      driver_cv_.notify_all();
    }
    idle_cv_.wait(lk, [&] { return !running_; });
  }
  std::lock_guard<std::mutex> g(join_mu_);
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void ProgressQueue::drain() {
  while (true) {
    std::deque<std::function<void()>> batch;
    {
      std::lock_guard<std::mutex> lk(mu_);
      batch.swap(tasks_);
      loud_ = 0;
      if (batch.empty()) {
        changes_.fetch_add(1, std::memory_order_release);
        if (drivers_ > 0) driver_cv_.notify_all();
        return;
      }
    }
    for (auto& t : batch) run_task(t);
    batch.clear();
    std::lock_guard<std::mutex> lk(mu_);
    changes_.fetch_add(1, std::memory_order_release);
    if (drivers_ > 0) driver_cv_.notify_all();
  }
}

void ProgressQueue::seal() {
  std::deque<std::function<void()>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sealed_ = true;
    left.swap(tasks_);
    loud_ = 0;
    changes_.fetch_add(1, std::memory_order_release);
    if (drivers_ > 0) driver_cv_.notify_all();
  }
}

}  // namespace sluice::torch_backend
