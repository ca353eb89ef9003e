#include "collective/hier_rail.hpp"

#include <algorithm>

#include "core/params.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

// A call waits for the proxy several times (put, data signal, credit). With the proxy's usual
// 200 us spin, a call that took longer found the worker napping at every request and took longer
// still; a collective's proxy polls through a run of calls, as MSCCL++'s proxy always does.
const Param<uint64_t> kIdleSpinUs{"hier.proxy_idle_spin_us", "SLUICE_HIER_PROXY_IDLE_SPIN_US", 20000,
                                  size_in(0, 60000000),
                                  "hierarchical AllGather: microseconds an idle proxy worker keeps polling its FIFO "
                                  "before it naps (a core while it polls; napping adds latency to the next call)"};

}  // namespace

HierRail::HierRail(const HierWiring& w, uint8_t* rail, HierRailOptions options) : w_(w), rail_(rail), opt_(std::move(options)) {
  if (opt_.transport != "" && opt_.transport != "tcp" && opt_.transport != "rdma")
    throw Error(ErrorCode::kInvalidArgument,
                "HierAllGather: transport '" + opt_.transport + "' (tcp, rdma or empty for automatic)");
  // Only the network transports: a forced inter-node run on one host must not pick nvlink or shm.
  EngineConfig cfg;
  cfg.transports = opt_.transport.empty() ? std::vector<std::string>{"rdma", "tcp"}
                                          : std::vector<std::string>{opt_.transport};
  engine_ = std::make_unique<Engine>(cfg);  // a transport that cannot run here is skipped
  auto ts = engine_->transports();
  auto has = [&](const char* t) { return std::find(ts.begin(), ts.end(), t) != ts.end(); };
  if (!opt_.transport.empty() && !has(opt_.transport.c_str()))
    throw Error(ErrorCode::kNoDevice, "HierAllGather: transport " + opt_.transport + " is not available here");
  transport_ = has("rdma") ? "rdma" : "tcp";
  if (opt_.idle_spin.count() < 0)
    opt_.idle_spin = std::chrono::microseconds(kIdleSpinUs.get(EngineConfig::from_env(cfg)));
  rail_h_ = engine_->register_memory(rail, w_.rail.bytes, Location::host(), kHierRailRegion);
}

HierRail::~HierRail() {
  if (proxy_) proxy_->stop();
  proxy_.reset();
  data_.clear();
  credit_.clear();
  for (auto& ep : eps_) ep.close();
  for (auto& ep : accepted_) ep.close();
  eps_.clear();
  accepted_.clear();
  if (engine_) {
    try {
      engine_->unregister_memory(rail_h_);
    } catch (const Error&) {
    }
    engine_->close();
  }
}

std::string HierRail::engine_info() const { return engine_->local_info(); }
const std::string& HierRail::transport() const { return transport_; }

void HierRail::connect(const std::vector<HierHandle>& hs) {
  if (proxy_) throw Error(ErrorCode::kInvalidArgument, "HierAllGather::connect: already connected");
  if (w_.peers.empty()) return;
  ProxyOptions po;
  po.workers = std::max(1, opt_.workers);
  po.producers = opt_.producers;
  po.cuda_device = opt_.cuda_device;
  po.push_spin_ns = opt_.push_spin_ns;
  po.idle_spin = opt_.idle_spin;
  proxy_ = std::make_unique<ProxyService>(*engine_, po);
  ConnectOptions co;
  co.transport = transport_;
  co.reconnect = false;  // a lost rail peer fails the collective; it is never silently redialled
  const MemoryId src = proxy_->add_memory(rail_h_);
  for (const auto& peer : w_.peers) {
    const HierHandle& h = hs.at(peer.rank);
    const std::string who = "HierAllGather::connect: rank " + std::to_string(peer.rank);
    Endpoint ep = engine_->connect(h.engine_info, co);
    std::optional<RemoteHandle> rr = ep.remote_region(kHierRailRegion);
    if (!rr) throw Error(ErrorCode::kProtocol, who + "'s engine has no region " + kHierRailRegion);
    // Our puts and signals land at offsets of our layout; the transport checks each against the
    // peer's registered region, and the region must be exactly the layout's size.
    for (const RegionInfo& ri : ep.remote_regions())
      if (ri.id == rr->id && ri.length != w_.rail.bytes)
        throw Error(ErrorCode::kProtocol, who + "'s rail region is " + std::to_string(ri.length) + " bytes, expected " +
                                              std::to_string(w_.rail.bytes));
    const MemoryId dst = proxy_->add_memory(ep, *rr);
    data_.push_back(proxy_->add_channel(ep, dst, src, {*rr, peer.remote_data_sem}, {rail_h_, peer.local_data_sem}));
    credit_.push_back(
        proxy_->add_channel(ep, dst, src, {*rr, peer.remote_credit_sem}, {rail_h_, peer.local_credit_sem}));
    eps_.push_back(std::move(ep));
  }
  // Every rail peer dialled us too: take those endpoints off the accept queue (whose length the
  // engine bounds) and keep them for our lifetime. Our puts use our own.
  for (size_t k = 0; k < w_.peers.size(); ++k) {
    std::optional<Endpoint> in = engine_->accept(opt_.accept_timeout);
    if (!in)
      throw Error(ErrorCode::kTimeout, "HierAllGather::connect: " + std::to_string(k) + " of " +
                                           std::to_string(w_.peers.size()) + " rail peers connected to this rank in time");
    accepted_.push_back(std::move(*in));
  }
  proxy_->start();
}

std::string HierRail::counters() const {
  std::string out = "rail:";
  for (const auto& peer : w_.peers) {
    auto sem = [&](uint64_t off) { return __atomic_load_n(reinterpret_cast<const uint64_t*>(rail_ + off), __ATOMIC_ACQUIRE); };
    out += " node " + std::to_string(peer.node) + " data " + std::to_string(sem(peer.local_data_sem)) + " credit " +
           std::to_string(sem(peer.local_credit_sem)) + ";";
  }
  if (!proxy_) return out + " proxy: not started";
  const ProxyStats st = proxy_->stats();
  return out + " proxy: " + std::to_string(st.requests) + " requests, " + std::to_string(st.puts) + " puts, " +
         std::to_string(st.signals) + " signals, " + std::to_string(st.dropped) + " dropped";
}

Status HierRail::status() const {
  for (size_t p = 0; p < data_.size(); ++p)
    for (const PortChannel* c : {&data_[p], &credit_[p]}) {
      Status s = c->status();
      if (!s.ok())
        return {s.code, "channel to rank " + std::to_string(w_.peers[p].rank) + " failed: " + s.to_string()};
    }
  return Status::Ok();
}

}  // namespace sluice::detail
