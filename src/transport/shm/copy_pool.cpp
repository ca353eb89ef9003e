#include "transport/shm/copy_pool.hpp"

namespace sluice::detail::shm {

CopyPool::~CopyPool() {
  std::vector<std::shared_ptr<void>> drops;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    ready_.clear();
    drops.swap(drops_);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void CopyPool::schedule(std::weak_ptr<CopyClient> client) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    start_locked();
    ready_.push_back(std::move(client));
  }
  cv_.notify_one();
}

void CopyPool::drop(std::shared_ptr<void> last) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;  // released here after all: the pool is going away
    start_locked();
    drops_.push_back(std::move(last));
  }
  cv_.notify_one();
}

void CopyPool::start_locked() {
  if (threads_.empty())
    for (int i = 0; i < nthreads_; ++i) threads_.emplace_back([this] { work(); });
}

void CopyPool::work() {
  for (;;) {
    std::weak_ptr<CopyClient> next;
    std::vector<std::shared_ptr<void>> drops;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !ready_.empty() || !drops_.empty(); });
      if (stop_) return;
      drops.swap(drops_);
      if (!ready_.empty()) {
        next = std::move(ready_.front());
        ready_.pop_front();
      }
    }
    drops.clear();
    // The client may have gone since it was scheduled (its endpoint closed and released).
    if (auto c = next.lock()) c->run_one();
  }
}

}  // namespace sluice::detail::shm
