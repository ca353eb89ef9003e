// Engine-wide progress: a small pool of epoll reactors that serve every stream channel of
// every endpoint (tcp data channels, the shm and nvlink control channels), instead of a
// reader and a writer thread per channel. A peer count of hundreds then costs descriptors
// and a little memory, not threads.
//
// A channel's receive side runs as a Fiber on one reactor: the frame handlers keep their
// pull style (read the payload straight into its destination), but a read that would block
// yields back to the reactor instead, so one stalled peer never stalls the other peers that
// share the reactor thread. Send backlogs are drained by the reactor on EPOLLOUT with
// non-blocking writes.
//
// Size: SLUICE_PROGRESS_THREADS (default min(4, cores)), read when the pool is first used
// (the first channel that starts), never at static initialisation. The pool is per process
// and is rebuilt in a forked child (whose copy has no threads).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace sluice::detail {

class Reactor;

// A stackful coroutine bound to one reactor thread. run() executes on its own stack; wait()
// (called on that stack) returns to the reactor until resume() or the deadline.
//
// On x86-64 a switch is a few register moves (progress_pool.cpp, fiber_switch): glibc's
// swapcontext saves and restores the signal mask with an rt_sigprocmask syscall, two per
// resume/yield pair, which a small message pays on every hop through a reactor. Elsewhere,
// and where the CPU enforces a shadow stack (a return-based switch would fault), the fiber
// falls back to ucontext.
class Fiber {
 public:
  explicit Fiber(std::function<void()> body, size_t stack_bytes = 1 << 20);
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // Reactor side: run the fiber until it waits or finishes.
  void resume();
  bool finished() const { return finished_; }
  // Fiber side: give the thread back to the reactor.
  void yield();
  // The fiber running on this thread now, or null.
  static Fiber* current();

 private:
  static void trampoline(unsigned lo, unsigned hi);  // ucontext entry
  static void asm_main(Fiber* self);                  // fiber_switch entry
  void run_body();
  struct Context;
  std::unique_ptr<Context> ctx_;
  std::function<void()> body_;
  void* stack_ = nullptr;
  size_t stack_bytes_ = 0;
  bool finished_ = false;
  void* san_fiber_ = nullptr;   // TSan's fiber handle
  void* san_caller_ = nullptr;  // TSan's handle of the thread that resumed us
  void* asan_fake_ = nullptr;
  const void* caller_stack_ = nullptr;
  size_t caller_stack_size_ = 0;
};

// Something a reactor dispatches events to. Every callback runs on the reactor's thread.
class ReactorSource {
 public:
  virtual ~ReactorSource() = default;
  virtual void on_events(uint32_t events) = 0;
  // A deadline set with Reactor::wake_at passed.
  virtual void on_deadline() {}
};

class Reactor {
 public:
  // `spin`: after handling events the reactor keeps polling (epoll_wait with no timeout)
  // this long before it blocks again, so that a message arriving meanwhile costs no wake-up
  // (progress.spin_us; a core while it polls).
  explicit Reactor(std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~Reactor();
  // fd is watched edge-triggered for input (urgent data included), hang-up and errors, not
  // for output: a unix socket reports room on every read its peer makes, which would wake the
  // reactor once per message sent. Ask for output with watch() while a write waits.
  void add(int fd, ReactorSource* src);
  // Which readiness fd reports: input (off while a waiting thread receives on the socket
  // itself, see StreamChannel::lend) and output. Hang-up and errors are always reported.
  // Arming reports the state at once if it holds already (a write that found the socket full
  // and then arms cannot miss the edge; nor can input that arrived while input was off).
  // Callable from any thread; an fd that is no longer watched is ignored.
  void watch(int fd, ReactorSource* src, bool input, bool output);
  // Remove fd; `done` then runs on the reactor thread once no event for `src` can follow.
  // Callable from any thread.
  void remove(int fd, ReactorSource* src, std::function<void()> done);
  // Run `fn` on the reactor thread soon (after the current batch of events).
  void post(std::function<void()> fn);
  // Call src->on_deadline() on the reactor thread at (or shortly after) `when`. One pending
  // deadline per source; a later call replaces it. Reactor thread only.
  void wake_at(ReactorSource* src, std::chrono::steady_clock::time_point when);
  void cancel_wake(ReactorSource* src);
  bool on_thread() const { return std::this_thread::get_id() == thread_id_; }
  size_t sources() const { return sources_.load(std::memory_order_relaxed); }

 private:
  void loop();
  int epfd_ = -1;
  const std::chrono::microseconds spin_;
  int wakefd_ = -1;
  std::thread thread_;
  std::thread::id thread_id_;
  std::mutex mu_;
  std::vector<std::function<void()>> tasks_;
  std::atomic<bool> stop_{false};
  std::atomic<size_t> sources_{0};
  // Reactor thread only: pending deadlines (few: only sources that sleep).
  std::vector<std::pair<std::chrono::steady_clock::time_point, ReactorSource*>> deadlines_;
};

class ProgressPool {
 public:
  // The process's pool, created on first use (and again in a forked child).
  static std::shared_ptr<ProgressPool> shared();
  explicit ProgressPool(int threads, std::chrono::microseconds spin = std::chrono::microseconds(0));
  // The least loaded reactor.
  Reactor& pick();
  int size() const { return static_cast<int>(reactors_.size()); }
  // Whether the calling thread is one of this process's reactor threads.
  static bool on_reactor_thread();

 private:
  std::vector<std::unique_ptr<Reactor>> reactors_;
};

// SLUICE_PROGRESS_THREADS, parsed strictly (1..64); default min(4, hardware threads).
int progress_threads_from_env();

}  // namespace sluice::detail
