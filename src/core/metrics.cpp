// Endpoint metrics: the engine's snapshot of its endpoints and the Prometheus text format.
#include <cstdio>
#include <sstream>

#include "core/endpoint_impl.hpp"
#include "core/engine_impl.hpp"

namespace sluice {
namespace {

// Label values escape backslash, double quote and newline (exposition format 0.0.4).
std::string escaped(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

constexpr OpKind kKinds[] = {OpKind::kRead, OpKind::kWrite, OpKind::kWriteImm, OpKind::kSend, OpKind::kRecv};

class Writer {
 public:
  explicit Writer(const std::string& engine) : engine_(escaped(engine)) {}

  // A metric family: one HELP and TYPE line, then its samples.
  void family(const char* name, const char* type, const char* help) {
    out_ << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  }
  void sample(const std::string& name, const EndpointMetrics& e, const std::string& extra, uint64_t value) {
    labels(name, e, extra);
    out_ << value << '\n';
  }
  void sample(const std::string& name, const EndpointMetrics& e, const std::string& extra, double value) {
    labels(name, e, extra);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", value);
    out_ << buf << '\n';
  }
  std::string text() const { return out_.str(); }
  std::ostringstream& raw() { return out_; }
  const std::string& engine() const { return engine_; }

 private:
  void labels(const std::string& name, const EndpointMetrics& e, const std::string& extra) {
    out_ << name << "{engine=\"" << engine_ << "\",endpoint=\"" << e.endpoint << "\",peer=\"" << escaped(e.peer_engine_id)
         << "\",transport=\"" << escaped(e.transport) << '"' << extra << "} ";
  }
  std::string engine_;
  std::ostringstream out_;
};

std::string kind_label(OpKind k) { return ",kind=\"" + std::string(to_string(k)) + "\""; }

}  // namespace

std::string prometheus_text(const std::string& engine, const std::vector<EndpointMetrics>& endpoints) {
  Writer w(engine);
  w.family("sluice_endpoints", "gauge", "Open endpoints of the engine.");
  w.raw() << "sluice_endpoints{engine=\"" << w.engine() << "\"} " << endpoints.size() << '\n';
  w.family("sluice_endpoint_connected", "gauge", "1 while the endpoint is usable, 0 once it failed.");
  for (const auto& e : endpoints) w.sample("sluice_endpoint_connected", e, "", uint64_t(e.connected ? 1 : 0));
  w.family("sluice_endpoint_channels", "gauge", "Channels (connections or queue pairs) of the endpoint.");
  for (const auto& e : endpoints) w.sample("sluice_endpoint_channels", e, "", uint64_t(e.channels));
  struct Counter {
    const char* name;
    const char* help;
    uint64_t OpCounters::*field;
  };
  for (const Counter& c : {Counter{"sluice_endpoint_ops_started_total", "Operations submitted.", &OpCounters::started},
                           Counter{"sluice_endpoint_ops_completed_total", "Operations that ended successfully.",
                                   &OpCounters::completed},
                           Counter{"sluice_endpoint_ops_failed_total", "Operations that ended with an error.",
                                   &OpCounters::failed},
                           Counter{"sluice_endpoint_bytes_total", "Bytes moved by successful operations.",
                                   &OpCounters::bytes}}) {
    w.family(c.name, "counter", c.help);
    for (const auto& e : endpoints)
      for (OpKind k : kKinds) w.sample(c.name, e, kind_label(k), e.of(k).*c.field);
  }
  struct Plain {
    const char* name;
    const char* type;
    const char* help;
    uint64_t EndpointMetrics::*field;
  };
  for (const Plain& p :
       {Plain{"sluice_endpoint_in_flight", "gauge", "Operations submitted and not yet ended (queue depth).",
              &EndpointMetrics::in_flight},
        Plain{"sluice_endpoint_timeouts_total", "counter", "Operations that ended with a timeout.",
              &EndpointMetrics::timeouts},
        Plain{"sluice_endpoint_peer_lost_total", "counter", "Operations that ended because the peer was lost.",
              &EndpointMetrics::peer_lost},
        Plain{"sluice_endpoint_reconnects_total", "counter",
              "Times the endpoint connected again after its peer was lost (ConnectOptions::reconnect).",
              &EndpointMetrics::reconnects},
        Plain{"sluice_endpoint_posts_total", "counter", "Thin-path writes posted (port channels).",
              &EndpointMetrics::posts},
        Plain{"sluice_endpoint_post_bytes_total", "counter", "Bytes of thin-path writes posted.",
              &EndpointMetrics::post_bytes},
        Plain{"sluice_endpoint_post_signals_total", "counter", "Thin-path signals posted.",
              &EndpointMetrics::post_signals},
        Plain{"sluice_endpoint_channels_replaced_total", "counter",
              "Channels moved to a fresh connection after they stalled (tcp failover).",
              &EndpointMetrics::channels_replaced},
        Plain{"sluice_endpoint_retries_total", "counter",
              "Operations sent again on a replacement channel (tcp.retry_rma).", &EndpointMetrics::retries}}) {
    w.family(p.name, p.type, p.help);
    for (const auto& e : endpoints) w.sample(p.name, e, "", e.*p.field);
  }
  const char* h = "sluice_endpoint_op_latency_seconds";
  w.family(h, "histogram", "Time from submission to the end of each operation.");
  for (const auto& e : endpoints) {
    uint64_t cumulative = 0;
    for (int i = 0; i < LatencyHistogram::kBuckets; ++i) {
      cumulative += e.latency.counts[i];
      const uint64_t bound = LatencyHistogram::bound_ns(i);
      std::string le = bound == UINT64_MAX ? "+Inf" : [&] {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.6g", double(bound) / 1e9);
        return std::string(buf);
      }();
      w.sample(std::string(h) + "_bucket", e, ",le=\"" + le + "\"", cumulative);
    }
    w.sample(std::string(h) + "_sum", e, "", double(e.latency.sum_ns) / 1e9);
    w.sample(std::string(h) + "_count", e, "", e.latency.count);
  }
  return w.text();
}

std::vector<EndpointMetrics> Engine::metrics() const { return impl_->endpoint_metrics(); }

std::string Engine::metrics_text() const {
  const std::string& name = impl_->config().name;
  return prometheus_text(name.empty() ? impl_->engine_id() : name, impl_->endpoint_metrics());
}

}  // namespace sluice

namespace sluice::detail {

std::vector<EndpointMetrics> EngineImpl::endpoint_metrics() {
  std::vector<std::shared_ptr<EndpointImpl>> eps;
  {
    std::lock_guard<std::mutex> lk(mu_);
    eps = endpoints_;
  }
  std::vector<EndpointMetrics> out;
  out.reserve(eps.size());
  for (const auto& ep : eps) out.push_back(ep->metrics());
  return out;
}

}  // namespace sluice::detail
