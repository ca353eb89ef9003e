// Per-endpoint counters: what an operator scrapes (Engine::metrics_text(), Prometheus text
// format) and what a program reads (Endpoint::metrics()). Counted where every operation
// starts and ends, so they agree with what the Futures reported.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "sluice/export.hpp"
#include "sluice/types.hpp"

namespace sluice {

// Operations of one kind (OpKind) on one endpoint.
struct OpCounters {
  uint64_t started = 0;    // submitted (caller errors that threw at once are not counted)
  uint64_t completed = 0;  // ended successfully
  uint64_t failed = 0;     // ended with an error (timeouts, a lost peer, cancelled by close)
  uint64_t bytes = 0;      // bytes of the successful ones
};

// Time from submission to completion of every operation that ended (successful or not), in
// buckets whose upper bounds double from 1 us: counts[i] holds ops that took at most
// bound_ns(i) and more than bound_ns(i - 1); the last bucket has no upper bound.
struct LatencyHistogram {
  static constexpr int kBuckets = 25;
  static constexpr uint64_t bound_ns(int i) { return i + 1 >= kBuckets ? UINT64_MAX : 1000ull << i; }
  std::array<uint64_t, kBuckets> counts{};
  uint64_t count = 0;
  uint64_t sum_ns = 0;
};

struct EndpointMetrics {
  uint64_t endpoint = 0;  // the endpoint's token (both sides of a connection share it; tells two to one peer apart)
  std::string peer_engine_id;
  std::string transport;
  int channels = 0;
  bool connected = false;
  // Indexed by OpKind: read, write, write_imm, send, recv. imm_recv() is not counted: it waits
  // for the peer's notification, it moves nothing of its own.
  std::array<OpCounters, 5> ops{};
  uint64_t in_flight = 0;           // started and not yet ended: the endpoint's queue depth
  uint64_t timeouts = 0;            // ended with kTimeout
  uint64_t peer_lost = 0;           // ended with kPeerLost
  uint64_t reconnects = 0;          // times the endpoint connected again (ConnectOptions::reconnect)
  uint64_t posts = 0, post_bytes = 0, post_signals = 0;  // the thin post path (port channels)
  // Channel failover (tcp, docs/cluster.md): channels moved to a fresh connection, and
  // operations sent again on one (tcp.retry_rma).
  uint64_t channels_replaced = 0, retries = 0;
  LatencyHistogram latency;

  const OpCounters& of(OpKind k) const { return ops.at(static_cast<size_t>(k)); }
};

// Prometheus text exposition format (version 0.0.4) of `endpoints`, labelled with `engine`
// (what Engine::metrics_text() serves; exposed here so a program can merge several engines).
SLUICE_API std::string prometheus_text(const std::string& engine, const std::vector<EndpointMetrics>& endpoints);

}  // namespace sluice
