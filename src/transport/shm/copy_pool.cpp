#include "transport/shm/copy_pool.hpp"
#include "core/thread_name.hpp"

namespace sluice::detail::shm {

CopyPool::~CopyPool() {
  std::vector<std::shared_ptr<void>> drops;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    ready_.clear();
    drops.swap(drops_);
    for (auto* s : idle_) s->woken = true;
    idle_.clear();
    for (auto& s : sleepers_) s->cv.notify_one();
  }
  for (auto& t : threads_) t.join();
}

// Pops the most recently idle thread and wakes it after unlocking (the Sleeper outlives every
// thread: the pool owns it). With none idle, a busy thread finds the work when it looks again.
void CopyPool::wake_one_locked(std::unique_lock<std::mutex>& lk) {
  Sleeper* s = nullptr;
  if (!idle_.empty()) {
    s = idle_.back();
    idle_.pop_back();
    s->woken = true;
  }
  lk.unlock();
  if (s) s->cv.notify_one();
}

void CopyPool::schedule(std::weak_ptr<CopyClient> client) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stop_) return;
  start_locked();
  ready_.push_back(std::move(client));
  wake_one_locked(lk);
}

void CopyPool::drop(std::shared_ptr<void> last) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stop_) return;  // released here after all: the pool is going away
  start_locked();
  drops_.push_back(std::move(last));
  wake_one_locked(lk);
}

void CopyPool::start_locked() {
  if (!threads_.empty()) return;
  for (int i = 0; i < nthreads_; ++i) sleepers_.push_back(std::make_unique<Sleeper>());
  for (int i = 0; i < nthreads_; ++i) threads_.emplace_back([this, s = sleepers_[i].get()] {
      ::sluice::detail::name_this_thread("sluice-shmcopy");
      work(*s);
    });
}

void CopyPool::work(Sleeper& me) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    while (!stop_ && ready_.empty() && drops_.empty()) {
      me.woken = false;
      idle_.push_back(&me);
      me.cv.wait(lk, [&] { return me.woken; });  // whoever pops us off idle_ sets woken
    }
    if (stop_) return;
    std::weak_ptr<CopyClient> next;
    std::vector<std::shared_ptr<void>> drops;
    drops.swap(drops_);
    if (!ready_.empty()) {
      next = std::move(ready_.front());
      ready_.pop_front();
    }
    lk.unlock();
    drops.clear();
    // The client may have gone since it was scheduled (its endpoint closed and released).
    if (auto c = next.lock()) c->run_one();
    next.reset();
    lk.lock();
  }
}

}  // namespace sluice::detail::shm
