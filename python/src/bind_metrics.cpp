// Endpoint metrics for Python as plain dicts (sluice/metrics.hpp); _sluice.cpp binds
// Endpoint.metrics(), Engine.metrics() and Engine.metrics_text() with it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "sluice/sluice.hpp"

namespace py = pybind11;

py::dict metrics_dict(const sluice::EndpointMetrics& m) {
  py::dict d;
  d["endpoint"] = m.endpoint;
  d["peer_engine_id"] = m.peer_engine_id;
  d["transport"] = m.transport;
  d["channels"] = m.channels;
  d["connected"] = m.connected;
  py::dict ops;
  for (auto k : {sluice::OpKind::kRead, sluice::OpKind::kWrite, sluice::OpKind::kWriteImm, sluice::OpKind::kSend,
                 sluice::OpKind::kRecv}) {
    const sluice::OpCounters& o = m.of(k);
    py::dict c;
    c["started"] = o.started;
    c["completed"] = o.completed;
    c["failed"] = o.failed;
    c["bytes"] = o.bytes;
    ops[py::str(std::string(sluice::to_string(k)))] = c;
  }
  d["ops"] = ops;
  d["in_flight"] = m.in_flight;
  d["timeouts"] = m.timeouts;
  d["peer_lost"] = m.peer_lost;
  d["reconnects"] = m.reconnects;
  d["posts"] = m.posts;
  d["post_bytes"] = m.post_bytes;
  d["post_signals"] = m.post_signals;
  d["channels_replaced"] = m.channels_replaced;
  d["retries"] = m.retries;
  py::list bounds, counts;
  for (int i = 0; i < sluice::LatencyHistogram::kBuckets; ++i) {
    const uint64_t b = sluice::LatencyHistogram::bound_ns(i);
    bounds.append(b == UINT64_MAX ? py::float_(INFINITY) : py::float_(double(b) / 1e9));
    counts.append(m.latency.counts[i]);
  }
  py::dict lat;
  lat["bounds_s"] = bounds;
  lat["counts"] = counts;
  lat["count"] = m.latency.count;
  lat["sum_s"] = double(m.latency.sum_ns) / 1e9;
  d["latency"] = lat;
  return d;
}
