#include "core/endpoint_counters.hpp"

#include <bit>

namespace sluice::detail {

int EndpointCounters::bucket_of(std::chrono::nanoseconds took) {
  const uint64_t ns = took.count() > 0 ? static_cast<uint64_t>(took.count()) : 0;
  const uint64_t us = (ns + 999) / 1000;  // bucket i holds (bound(i-1), bound(i)], bound(i) = 2^i us
  int i = us <= 1 ? 0 : static_cast<int>(std::bit_width(us - 1));
  return i < LatencyHistogram::kBuckets ? i : LatencyHistogram::kBuckets - 1;
}

void EndpointCounters::ended(OpKind kind, uint64_t bytes, const Status& status, std::chrono::nanoseconds took) {
  Slot& s = slot(kind);
  if (status.ok()) {
    s.completed.fetch_add(1, std::memory_order_relaxed);
    s.bytes.fetch_add(bytes, std::memory_order_relaxed);
  } else {
    s.failed.fetch_add(1, std::memory_order_relaxed);
    if (status.code == ErrorCode::kTimeout) timeouts_.fetch_add(1, std::memory_order_relaxed);
    if (status.code == ErrorCode::kPeerLost) peer_lost_.fetch_add(1, std::memory_order_relaxed);
  }
  latency_[bucket_of(took)].fetch_add(1, std::memory_order_relaxed);
  latency_sum_ns_.fetch_add(took.count() > 0 ? static_cast<uint64_t>(took.count()) : 0, std::memory_order_relaxed);
}

void EndpointCounters::snapshot(EndpointMetrics& out) const {
  out.in_flight = 0;
  for (size_t k = 0; k < ops_.size(); ++k) {
    OpCounters& o = out.ops[k];
    // Ends before starts: a concurrent op is then never seen ended but not started.
    o.completed = ops_[k].completed.load(std::memory_order_relaxed);
    o.failed = ops_[k].failed.load(std::memory_order_relaxed);
    o.bytes = ops_[k].bytes.load(std::memory_order_relaxed);
    o.started = ops_[k].started.load(std::memory_order_relaxed);
    const uint64_t ended = o.completed + o.failed;
    out.in_flight += o.started > ended ? o.started - ended : 0;
  }
  out.timeouts = timeouts_.load(std::memory_order_relaxed);
  out.peer_lost = peer_lost_.load(std::memory_order_relaxed);
  out.reconnects = reconnects_.load(std::memory_order_relaxed);
  out.posts = posts_.load(std::memory_order_relaxed);
  out.post_bytes = post_bytes_.load(std::memory_order_relaxed);
  out.post_signals = post_signals_.load(std::memory_order_relaxed);
  out.latency.count = 0;
  for (int i = 0; i < LatencyHistogram::kBuckets; ++i) {
    out.latency.counts[i] = latency_[i].load(std::memory_order_relaxed);
    out.latency.count += out.latency.counts[i];
  }
  out.latency.sum_ns = latency_sum_ns_.load(std::memory_order_relaxed);
}

}  // namespace sluice::detail
