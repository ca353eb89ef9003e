// Bookkeeping of the thin post path (TransportEndpoint::post_write / post_signal / flush) that
// is the same for every transport: the depth limit, the first error since the last flush, the
// endpoint's failure, and, for transports whose writes can finish out of order (several copy
// workers, several channels), the sequencing that keeps a signal behind the writes before it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "sluice/config.hpp"
#include "sluice/error.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {

// post.depth and post.flush_spin_us for `config` (the parameters are declared with the tracker).
size_t post_depth(const EngineConfig& config);
std::chrono::microseconds post_flush_spin(const EngineConfig& config);

class PostTracker {
 public:
  // `flush_spin`: how long flush() polls for the last completion before it sleeps on the
  // condition variable (a sleeping flusher wakes some microseconds after the completion).
  explicit PostTracker(size_t depth, std::chrono::microseconds flush_spin = std::chrono::microseconds(0))
      : depth_(depth ? depth : 1), flush_spin_(flush_spin) {}

  // Room for one more post: waits while `depth` posts are outstanding, at most `timeout`.
  // Returns the endpoint's failure, kTimeout, or Ok (the post is then counted: call done()
  // exactly once for it, or cancel() if it was not posted after all).
  Status admit(std::chrono::milliseconds timeout);
  void cancel();
  // `n` admitted posts finished (an error is kept for the next flush()).
  void done(const Status& st, size_t n = 1);
  // Every post admitted so far finished: the first error since the last flush (then
  // forgotten); kTimeout after `timeout`; the endpoint's failure once fail() ran.
  Status flush(std::chrono::milliseconds timeout);
  // The endpoint failed: wake every waiter; every later call returns `why`. Posts still
  // counted are the transport's to finish (done()) or forget with the endpoint.
  void fail(const Status& why);
  bool failed() const;
  size_t outstanding() const;

 private:
  const size_t depth_;
  const std::chrono::microseconds flush_spin_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Changed under mu_; atomic so that flush() can poll it without the lock.
  std::atomic<size_t> outstanding_{0};
  std::atomic<bool> has_failed_{false};
  Status first_error_;
  Status failed_;
};

// Keeps each signal behind every write posted before it, for transports whose writes finish
// out of order. Writes are counted per epoch; a signal closes the current epoch and is due
// once its epoch and every earlier one have no write outstanding. Thread-safe.
class SignalSequencer {
 public:
  // `n` writes are being posted: count them; tag them with the returned epoch.
  uint64_t write_posted(uint64_t n = 1);
  // The `n` writes were not posted after all (their post failed before they left).
  void write_dropped(uint64_t epoch, uint64_t n = 1) { write_done(epoch, nullptr, n); }
  // A signal after every write so far: true when it may be issued now (then issue it
  // yourself); false when it was queued (a later write_done() hands it out).
  bool signal(const PostSignal& s);
  // `n` writes of `epoch` finished (ok or not): the signals now due, in order, are appended to
  // *ready (issue them in that order).
  void write_done(uint64_t epoch, std::vector<PostSignal>* ready, uint64_t n = 1);
  // Nothing outstanding and nothing queued: a signal now would be due at once.
  bool idle();
  // Forget everything queued (the endpoint failed); returns how many signals were dropped.
  size_t clear();

 private:
  struct Epoch {
    uint64_t writes = 0;      // outstanding writes of this epoch
    bool closed = false;      // a signal ended it
    PostSignal signal;
  };
  void drain_locked(std::vector<PostSignal>* ready);

  std::mutex mu_;
  std::deque<Epoch> epochs_{Epoch{}};  // front: the oldest epoch with work left
  uint64_t first_ = 0;                 // epoch number of epochs_.front()
};

}  // namespace sluice::detail
