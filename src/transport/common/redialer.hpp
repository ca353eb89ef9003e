// One thread per transport (per engine) that dials replacement channels (tcp channel and rdma
// queue-pair failover, docs/cluster.md): a dial blocks for up to the connect timeout while a link is
// down, so it runs neither on a channel's fiber, nor on the watchdog that notices the stall,
// nor on a submitting thread; and not on a thread per connection. Jobs run one at a time in
// the order they were queued; the thread starts with the first job.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace sluice::detail {

class Redialer {
 public:
  Redialer() = default;
  ~Redialer();
  Redialer(const Redialer&) = delete;
  Redialer& operator=(const Redialer&) = delete;

  // Queue a job (it must hold what it uses: it may run after its endpoint was closed).
  // Ignored once the redialer is stopping.
  void post(std::function<void()> job);

 private:
  // Shared with the thread: when the last owner is a job itself (it dropped the last endpoint
  // of a closed engine), the thread is detached and finishes on this state.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> jobs;
    bool stop = false;
  };
  static void loop(std::shared_ptr<State> st);

  std::shared_ptr<State> st_ = std::make_shared<State>();
  std::unique_ptr<std::thread> thread_;  // under st_->mu
  int pid_ = 0;                          // the process that started it (fork: see ~Redialer)
};

}  // namespace sluice::detail
