// The shm transport's copy pool: a few threads that run the copy jobs (lanes, served
// PULL_WRITEs, mapped post writes) of every shm endpoint of one engine, instead of copy
// workers per endpoint. A peer count of hundreds then costs no threads.
//
// Fairness: an endpoint with work is a client in one FIFO ready list. A pool thread takes the
// client at the front and lets it run ONE job; the client puts itself back at the end of the
// list before running it if it has more (CopyClient::run_one), so endpoints take turns job by
// job (round-robin) and a deep queue never starves the others, while one endpoint's jobs can
// still run on several pool threads at once.
//
// Waking: the most recently idle thread takes the next job (a stack of idle threads, each with
// its own condition variable). One condition variable for all would wake them in turn, so a
// lone stream of small copies would rotate through every pool thread, each time on a cold
// cache and from a deeper sleep: on a 16-core host that cost 0.5-0.8 us per 64 B mapped write.
//
// A job never waits for a peer on a pool thread: a lane that needs a region description it
// does not have is parked and re-queued when the description arrives, fails or times out
// (shm_describe.cpp).
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace sluice::detail::shm {

class CopyClient {
 public:
  virtual ~CopyClient() = default;
  // Pool thread: run one queued job, or nothing if the queue is empty or stopped. A client
  // that still has jobs schedules itself again (before running, so others can run them).
  virtual void run_one() = 0;
};

class CopyPool {
 public:
  // Threads are started on the first schedule(): an engine that never copies over shm
  // runs none.
  explicit CopyPool(int threads) : nthreads_(threads < 1 ? 1 : threads) {}
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // Appends the client to the ready list (the caller keeps it there at most once). A client
  // gone by the time its turn comes is skipped.
  void schedule(std::weak_ptr<CopyClient> client);
  // Releases `last` on a pool thread: an endpoint whose last reference a reactor thread holds
  // must not be destroyed (closed) there.
  void drop(std::shared_ptr<void> last);
  int size() const { return nthreads_; }

 private:
  struct Sleeper {
    std::condition_variable cv;
    bool woken = false;
  };
  void work(Sleeper& me);
  void start_locked();
  void wake_one_locked(std::unique_lock<std::mutex>& lk);

  const int nthreads_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Sleeper>> sleepers_;  // one per thread, alive as long as the pool
  std::vector<Sleeper*> idle_;                      // the most recently idle at the back
  std::deque<std::weak_ptr<CopyClient>> ready_;
  std::vector<std::shared_ptr<void>> drops_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};


}  // namespace sluice::detail::shm
