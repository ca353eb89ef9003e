#include "transport/common/post_tracker.hpp"

#include <algorithm>

#include "core/params.hpp"

namespace sluice::detail {
namespace {

const Param<uint64_t> kPostDepth{"post.depth", "SLUICE_POST_DEPTH", 1024, size_in(1, 1 << 20),
                                 "thin post path: posts outstanding per endpoint before post_write waits"};
const Param<int> kFlushSpinUs{"post.flush_spin_us", "SLUICE_POST_FLUSH_SPIN_US", -1, int_in(-1, 1000000),
                              "thin post path: flush() polls this long for the last completion before it sleeps "
                              "(the port channel's flush requests); -1 = busy_wait_us as resolved (0 on a host of "
                              "at most 2 hardware threads, else 20 us), 0 = sleep at once"};

}  // namespace

size_t post_depth(const EngineConfig& config) { return static_cast<size_t>(kPostDepth.get(config)); }
std::chrono::microseconds post_flush_spin(const EngineConfig& config) {
  const int us = kFlushSpinUs.get(config);
  return us < 0 ? busy_wait_of(config) : std::chrono::microseconds(us);
}

Status PostTracker::admit(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (outstanding_ >= depth_ && failed_.ok())
    cv_.wait_for(lk, timeout, [&] { return outstanding_ < depth_ || !failed_.ok(); });
  if (!failed_.ok()) return failed_;
  if (outstanding_ >= depth_)
    return {ErrorCode::kTimeout, "post: " + std::to_string(outstanding_) + " posts (post.depth) still outstanding after " +
                                     std::to_string(timeout.count()) + " ms"};
  ++outstanding_;
  return Status::Ok();
}

void PostTracker::cancel() { done(Status::Ok()); }

void PostTracker::done(const Status& st, size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  const size_t before = outstanding_;
  outstanding_ = before - std::min(before, n);
  if (!st.ok() && first_error_.ok()) first_error_ = st;
  // Waiters are a poster held by the depth limit and flush(); both re-check their condition.
  if ((before >= depth_ && outstanding_ < depth_) || outstanding_ == 0 || !st.ok()) cv_.notify_all();
}

Status PostTracker::flush(std::chrono::milliseconds timeout) {
  // Poll first, bounded: completions come from another thread (a poller, a CQ), and waking a
  // sleeping flusher costs more than the last few posts take.
  if (flush_spin_.count() > 0 && outstanding_.load(std::memory_order_acquire) != 0) {
    const auto until = std::chrono::steady_clock::now() + std::min<std::chrono::microseconds>(flush_spin_, timeout);
    while (outstanding_.load(std::memory_order_acquire) != 0 && !has_failed_.load(std::memory_order_acquire) &&
           std::chrono::steady_clock::now() < until) {
    }
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return outstanding_ == 0 || !failed_.ok(); });
  if (!failed_.ok()) return failed_;
  if (outstanding_ != 0)
    return {ErrorCode::kTimeout, "flush: " + std::to_string(outstanding_) + " posts still outstanding after " +
                                     std::to_string(timeout.count()) + " ms"};
  Status st = first_error_;
  first_error_ = Status::Ok();
  return st;
}

void PostTracker::fail(const Status& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (failed_.ok()) failed_ = why.ok() ? Status{ErrorCode::kPeerLost, "endpoint failed"} : why;
  has_failed_.store(true, std::memory_order_release);
  cv_.notify_all();
}

bool PostTracker::failed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !failed_.ok();
}

size_t PostTracker::outstanding() const {
  std::lock_guard<std::mutex> lk(mu_);
  return outstanding_;
}

uint64_t SignalSequencer::write_posted(uint64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  epochs_.back().writes += n;
  return first_ + epochs_.size() - 1;
}

bool SignalSequencer::signal(const PostSignal& s) {
  std::lock_guard<std::mutex> lk(mu_);
  // Nothing outstanding anywhere: the signal is due now and opens no epoch.
  if (epochs_.size() == 1 && epochs_.front().writes == 0) return true;
  Epoch& cur = epochs_.back();
  cur.closed = true;
  cur.signal = s;
  epochs_.push_back(Epoch{});
  return false;
}

void SignalSequencer::write_done(uint64_t epoch, std::vector<PostSignal>* ready, uint64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  if (epoch < first_ || epoch >= first_ + epochs_.size()) return;  // cleared meanwhile
  Epoch& e = epochs_[epoch - first_];
  e.writes -= std::min(e.writes, n);
  drain_locked(ready);
}

void SignalSequencer::drain_locked(std::vector<PostSignal>* ready) {
  while (epochs_.size() > 1 && epochs_.front().writes == 0) {
    if (ready && epochs_.front().closed) ready->push_back(epochs_.front().signal);
    epochs_.pop_front();
    ++first_;
  }
}

bool SignalSequencer::idle() {
  std::lock_guard<std::mutex> lk(mu_);
  return epochs_.size() == 1 && epochs_.front().writes == 0;
}

size_t SignalSequencer::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const Epoch& e : epochs_) n += e.closed ? 1 : 0;
  first_ += epochs_.size();
  epochs_.clear();
  epochs_.push_back(Epoch{});
  return n;
}

}  // namespace sluice::detail
