// The atomics behind EndpointMetrics (sluice/metrics.hpp). One per endpoint, shared with the
// FutureStates of its operations: a Future may end after its endpoint was closed and freed.
// Relaxed atomics on counters the op's own thread owns the cache line of: a few ns per op.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>

#include "sluice/error.hpp"
#include "sluice/metrics.hpp"

namespace sluice::detail {

class EndpointCounters {
 public:
  void started(OpKind kind) { slot(kind).started.fetch_add(1, std::memory_order_relaxed); }
  void ended(OpKind kind, uint64_t bytes, const Status& status, std::chrono::nanoseconds took);
  void posted(uint64_t bytes) {
    posts_.fetch_add(1, std::memory_order_relaxed);
    post_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void signalled() { post_signals_.fetch_add(1, std::memory_order_relaxed); }
  void reconnected() { reconnects_.fetch_add(1, std::memory_order_relaxed); }
  // Everything but the endpoint's identity (peer, transport, channels, connected).
  void snapshot(EndpointMetrics& out) const;

  static int bucket_of(std::chrono::nanoseconds took);

 private:
  struct Slot {
    std::atomic<uint64_t> started{0}, completed{0}, failed{0}, bytes{0};
  };
  Slot& slot(OpKind kind) { return ops_[std::min<size_t>(static_cast<size_t>(kind), ops_.size() - 1)]; }

  std::array<Slot, 5> ops_;  // by OpKind, imm_recv excluded (EndpointMetrics::ops)
  std::atomic<uint64_t> timeouts_{0}, peer_lost_{0}, reconnects_{0};
  std::atomic<uint64_t> posts_{0}, post_bytes_{0}, post_signals_{0};
  std::array<std::atomic<uint64_t>, LatencyHistogram::kBuckets> latency_{};
  std::atomic<uint64_t> latency_sum_ns_{0};
};

}  // namespace sluice::detail
