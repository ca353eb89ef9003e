#include "port_channel/post_batcher.hpp"

#include <string>

#include "port_channel/proxy_core.hpp"

namespace sluice::detail {

void PostBatcher::add(PortChannelRecord& c, const PostRequest& r, bool first) {
  Group* g = nullptr;
  // A worker serves few endpoints: a linear search beats a map here.
  for (size_t i = 0; i < used_ && !g; ++i)
    if (groups_[i].ep.impl() == c.ep.impl()) g = &groups_[i];
  if (!g) {
    if (used_ == groups_.size()) groups_.emplace_back();
    g = &groups_[used_++];
    g->ep = c.ep;
  }
  g->reqs.push_back(r);
  g->owners.push_back(&c);
  g->first.push_back(first ? 1 : 0);
  ++size_;
}

void PostBatcher::post_all() {
  for (size_t i = 0; i < used_; ++i) {
    post_group(groups_[i]);
    groups_[i].reqs.clear();
    groups_[i].owners.clear();
    groups_[i].first.clear();
    groups_[i].ep = Endpoint();  // the record holds the endpoint; the batcher keeps nothing alive
  }
  used_ = 0;
  size_ = 0;
}

void PostBatcher::post_group(Group& g) {
  size_t start = 0;
  while (start < g.reqs.size()) {
    PostBatchResult res;
    try {
      res = g.ep.post_batch(std::span<const PostRequest>(g.reqs).subspan(start));
    } catch (const Error& e) {  // the endpoint itself is unusable: the first request fails
      res.error = e.status();
    }
    counters_.batches->fetch_add(1, std::memory_order_relaxed);
    for (size_t i = start; i < start + res.posted; ++i)
      (g.reqs[i].kind == PostRequest::Kind::kSignal ? counters_.signals : counters_.puts)
          ->fetch_add(1, std::memory_order_relaxed);
    if (res.error.ok()) return;
    const size_t bad = start + res.posted;
    PortChannelRecord& c = *g.owners[bad];
    c.fail({res.error.code, "channel " + std::to_string(c.id) + ": " + res.error.message});
    // The failed channel's later requests are dropped; the others close up and go out next.
    size_t w = bad;
    for (size_t i = bad + 1; i < g.reqs.size(); ++i) {
      if (g.owners[i]->failed.load(std::memory_order_acquire)) {
        if (g.first[i]) counters_.dropped->fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      g.reqs[w] = g.reqs[i];
      g.owners[w] = g.owners[i];
      g.first[w] = g.first[i];
      ++w;
    }
    g.reqs.resize(w);
    g.owners.resize(w);
    g.first.resize(w);
    start = bad;
  }
}

}  // namespace sluice::detail
