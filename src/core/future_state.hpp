// Shared completion state behind a Future. Completed exactly once; parts let one operation
// that runs on several channels complete when its last part does (with the first error).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "sluice/error.hpp"
#include "sluice/types.hpp"

namespace sluice::detail {

class EndpointCounters;

// Something a waiter can drive itself instead of sleeping until another thread completes its
// future: a transport whose completions are polled (an RDMA CQ). Saves the hand-off from the
// transport's progress thread to the waiter, the largest cost of a small operation.
class ProgressSource {
 public:
  virtual ~ProgressSource() = default;
  // Poll once without blocking; true if anything completed.
  virtual bool progress() = 0;
  // A waiter starts / stops driving (the transport's own thread may step aside meanwhile).
  virtual void begin_polling() {}
  // `satisfied`: the waiter's future completed (otherwise it gave up and now sleeps, so the
  // transport's own thread must take over at once).
  virtual void end_polling(bool satisfied) {}
  // How long a waiter keeps polling without any completion before it sleeps.
  virtual std::chrono::microseconds poll_budget() const = 0;
};

class FutureState {
 public:
  using Clock = std::chrono::steady_clock;
  using Callback = std::function<void(const Status&)>;

  explicit FutureState(OpKind kind, int parts = 1);

  OpKind kind() const { return kind_; }
  Clock::time_point started() const { return start_; }
  // Complete one part; the future completes when every part has (with the first error seen).
  // Returns true if this call completed the future.
  bool part_done(const Status& status);
  // Complete now, whatever parts remain. Returns false if it was already complete.
  bool complete(const Status& status);
  // Remember an error for part_done() without completing a part.
  void note_error(const Status& status);
  void add_parts(int n) { parts_.fetch_add(n, std::memory_order_relaxed); }

  bool done() const { return done_.load(std::memory_order_acquire); }
  Status wait();
  bool wait_for(std::chrono::nanoseconds timeout);
  Status status() const;
  std::chrono::nanoseconds elapsed() const;
  void on_complete(Callback cb);

  // How long wait() polls before sleeping (set by the endpoint from EngineConfig).
  void set_busy_wait(std::chrono::microseconds us) { spin_ = us; }
  // Waiters drive `source` (if it still exists) before sleeping. Set before the future is
  // handed out.
  void set_progress(std::weak_ptr<ProgressSource> source) { progress_ = std::move(source); }
  // The endpoint's counters: the op is counted as started now and as ended when it completes.
  void set_counters(std::shared_ptr<EndpointCounters> counters);
  void set_bytes(uint64_t n) { bytes_.store(n, std::memory_order_relaxed); }
  uint64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }
  void set_imm(uint32_t v) { imm_.store(v, std::memory_order_relaxed); }
  uint32_t imm() const { return imm_.load(std::memory_order_relaxed); }

 private:
  bool finish(const Status& status);
  // Drive progress_ until done, the deadline, or poll_budget() without any completion.
  void drive(Clock::time_point deadline);

  const OpKind kind_;
  const Clock::time_point start_;
  std::chrono::microseconds spin_{0};
  std::weak_ptr<ProgressSource> progress_;
  std::shared_ptr<EndpointCounters> counters_;
  std::atomic<int> parts_;
  std::atomic<bool> done_{false};
  std::atomic<int> waiters_{0};
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint32_t> imm_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Status status_;
  Status first_error_;
  Clock::time_point end_{};
  std::vector<Callback> callbacks_;
};

}  // namespace sluice::detail
