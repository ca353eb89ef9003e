// A worker's popped requests turned into posts: puts and signals are collected per endpoint
// (in FIFO order) and each endpoint's run goes out as one Endpoint::post_batch, so that a
// transport can serve many small requests with one operation (nvlink: one kernel). Order
// only matters per endpoint (a channel's signal follows its puts, and a channel has one
// endpoint), so grouping by endpoint keeps every guarantee of posting one at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "sluice/endpoint.hpp"

namespace sluice::detail {

struct PortChannelRecord;

// The proxy's counters the batcher updates.
struct BatchCounters {
  std::atomic<uint64_t>* puts;
  std::atomic<uint64_t>* signals;
  std::atomic<uint64_t>* dropped;
  std::atomic<uint64_t>* batches;
};

class PostBatcher {
 public:
  explicit PostBatcher(BatchCounters counters) : counters_(counters) {}

  // Appends a post of channel `c`. `first`: the first post of its FIFO request (a request
  // dropped after its channel failed counts once in ProxyStats::dropped).
  void add(PortChannelRecord& c, const PostRequest& r, bool first);
  size_t size() const { return size_; }

  // Posts everything collected, one post_batch per endpoint (re-posting after a failure: a
  // request that fails fails its channel only, with the message the single call would have
  // given, and the channel's later requests are dropped; other channels' requests go on).
  void post_all();

 private:
  struct Group {
    Endpoint ep;
    std::vector<PostRequest> reqs;
    std::vector<PortChannelRecord*> owners;  // the channel of each request
    std::vector<uint8_t> first;
  };
  void post_group(Group& g);

  BatchCounters counters_;
  std::vector<Group> groups_;  // reused: cleared, never shrunk, so no allocation per batch
  size_t used_ = 0;            // groups_[0, used_) hold requests
  size_t size_ = 0;
};

}  // namespace sluice::detail
