// The mailbox's progress work, run one task at a time by whichever thread is at hand.
//
// The mailbox's state is touched only by its tasks, one at a time. They used to run on a
// thread of their own, so every message cost a chain of wake-ups: the engine's progress
// thread finished an engine op and woke the mailbox thread, which matched it and woke the
// caller waiting for its Work (issue 12 counted 41.6 context switches per 256 KiB ping-pong
// against gloo's 7.2; gloo's waiter reads its socket itself). Now the threads that wait for
// the mailbox run its tasks themselves:
//  - submit(): a caller's own request (send, recv) runs on the calling thread when no task is
//    running, so posting a message costs no wake-up;
//  - drive_until(): a thread that waits for mailbox work (a send/recv Work's wait(), a
//    collective step) runs the tasks that engine completions post, so a completion wakes the
//    waiter directly instead of a thread that then wakes it;
//  - post(): an engine completion queues its task and wakes one driving thread, or the
//    queue's own thread when nobody drives (an isend nobody waits for yet still progresses).
// The queue's thread also runs `tick` (the mailbox's timeouts) about every `period`; any
// runner runs it when it is due, so drivers that keep the queue busy do not starve it.
//
// Tasks never run on the engine's threads: a task may drop the last reference to a tensor
// made in Python (which takes the GIL) or run a future's callbacks, and the engine's
// progress must not wait for either.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace sluice::torch_backend {

class ProgressQueue {
 public:
  using Clock = std::chrono::steady_clock;

  // Starts the queue's thread (named `thread_name`); `tick` runs about every `period`.
  // `callers_run` false: every task runs on the queue's thread (submit() queues, drivers
  // only wait), as before this queue existed (SLUICE_TORCH_CALLER_RUNS=0, for comparisons).
  // `spin`: how long a driver with nothing to run polls for a task or a change before it sleeps
  // on its condition variable (0: it sleeps at once). Each sleep costs a wake-up when the
  // completion comes (10-20 us on the GPU hosts, where a message's control trip took two);
  // polling costs the waiting thread's core meanwhile (SLUICE_TORCH_SPIN_US).
  ProgressQueue(std::function<void()> tick, std::chrono::milliseconds period, const char* thread_name,
                bool callers_run = true, std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~ProgressQueue();
  ProgressQueue(const ProgressQueue&) = delete;
  ProgressQueue& operator=(const ProgressQueue&) = delete;

  // From completion callbacks (any thread): queue `task` and wake a runner. `wake` false:
  // bookkeeping nobody waits for (a header slot to free, the first of an op's two
  // completions): queued only, it runs with whatever runs next (a caller's request, a
  // driver's wake-up, or at the latest the next tick), so it costs no wake-up of its own.
  void post(std::function<void()> task, bool wake = true);
  // From a caller's own request: run `task` (and whatever else is queued) here if no task is
  // running; else queue it for the running thread. Once closed: queued for drain().
  void submit(std::function<void()> task);
  // Runs queued tasks on the calling thread until `ready()` (evaluated under the queue's lock:
  // it may take other locks, never this queue's) or `deadline`. Returns ready(). Once the
  // queue is closed it only waits (close() completes everything and wakes it).
  bool drive_until(const std::function<bool()>& ready, Clock::time_point deadline);
  // Something a driver may wait for changed outside a task: drivers check their `ready()`.
  void wake();

  // Stops running tasks anywhere: waits for a running task to finish, stops the thread.
  // Queued and later tasks stay queued until drain(). Idempotent; not from a task.
  void close();
  // After close(): runs every queued task on the calling thread (until none is queued).
  void drain();
  // After close() and the last drain(): later tasks are dropped.
  void seal();

 private:
  void thread_main();
  // With `lk` held and running_ set by the caller: runs tasks (and the tick when due) until
  // none is queued; clears running_ and wakes drivers. Returns with `lk` held.
  void run_locked(std::unique_lock<std::mutex>& lk);
  // With `lk` held: schedules the next tick and runs this one without the lock.
  void tick_locked(std::unique_lock<std::mutex>& lk);
  static void run_task(const std::function<void()>& task);

  const std::function<void()> tick_;
  const std::chrono::milliseconds period_;
  const bool callers_run_;
  const std::chrono::microseconds spin_;
  Clock::time_point next_tick_;
  // Raised (under mu_) whenever a driver may have something new to see: a task queued, tasks
  // run, wake(), close. A polling driver watches it without the lock.
  std::atomic<uint64_t> changes_{0};

  std::mutex mu_;
  std::condition_variable thread_cv_;  // the queue's thread
  std::condition_variable driver_cv_;  // threads in drive_until()
  std::condition_variable idle_cv_;    // close() waiting for the running task
  std::deque<std::function<void()>> tasks_;
  size_t loud_ = 0;       // queued tasks whose poster asked for a runner (not quiet ones)
  bool running_ = false;  // a thread is running tasks now
  int drivers_ = 0;       // threads in drive_until()
  bool closing_ = false;
  bool sealed_ = false;
  std::mutex join_mu_;  // close() from two threads joins once
  std::thread thread_;
};

}  // namespace sluice::torch_backend
