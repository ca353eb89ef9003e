// The hierarchical AllGather's network side (issue 14): this rank's engine, its rail region and
// the two port channels per remote rail peer (data: put + signal; credit: signal). No CUDA here:
// HierAllGather (src/cuda/hier_allgather.cu) runs it with GPU producers, and the CPU tests
// (tests/collective/hier_rail_test.cpp) run the same protocol with host producers over tcp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "collective/hier_allgather_wiring.hpp"
#include "sluice/engine.hpp"
#include "sluice/port_channel.hpp"

namespace sluice::detail {

inline constexpr const char* kHierRailRegion = "sluice.hier.rail";

struct HierRailOptions {
  std::string transport;  // "tcp", "rdma" or "" (rdma if this engine runs it, else tcp)
  ProducerKind producers = ProducerKind::kHost;
  int cuda_device = 0;
  int workers = 1;
  // ProxyOptions::idle_spin; negative: the parameter hier.proxy_idle_spin_us (default 20 ms).
  std::chrono::microseconds idle_spin{-1};
  uint64_t push_spin_ns = port::kDefaultSpinNs;
  std::chrono::milliseconds accept_timeout{60000};
};

class HierRail {
 public:
  // `rail` (w.rail.bytes, zeroed, owned by the caller and alive until this is destroyed) is
  // registered with a new engine that runs only the network transports.
  HierRail(const HierWiring& w, uint8_t* rail, HierRailOptions options);
  ~HierRail();
  HierRail(const HierRail&) = delete;
  HierRail& operator=(const HierRail&) = delete;

  std::string engine_info() const;       // for this rank's handle
  const std::string& transport() const;  // the one connect() uses
  // Collective among the rail peers: handles already checked (check_hier_handles). Connects to
  // every remote rail peer, checks that its rail region has this layout's size, builds the
  // channels, takes the peers' own connections off the accept queue, starts the proxy.
  void connect(const std::vector<HierHandle>& handles);

  // By peer, in HierWiring::peers order.
  const std::vector<PortChannel>& data() const { return data_; }
  const std::vector<PortChannel>& credit() const { return credit_; }
  // Ok, or the first failed channel's status, naming the peer.
  Status status() const;
  // What a timeout reports (the wait never came): this rank's semaphores as the peers' signals
  // left them, and what its proxy consumed and posted, e.g. "rail: node 1 data 12 credit 11;
  // proxy: 60 requests, 30 puts, 60 signals, 0 dropped".
  std::string counters() const;

 private:
  HierWiring w_;
  uint8_t* rail_ = nullptr;
  HierRailOptions opt_;
  std::string transport_;
  std::unique_ptr<Engine> engine_;
  MemoryHandle rail_h_{};
  std::unique_ptr<ProxyService> proxy_;
  std::vector<Endpoint> eps_, accepted_;
  std::vector<PortChannel> data_, credit_;
};

}  // namespace sluice::detail
