// Endpoint metrics (sluice/metrics.hpp) over the fake transport: the test decides when each
// op ends and how, so every counter is checked against a known history, and the Prometheus
// text is checked line by line.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "core/endpoint_counters.hpp"
#include "core_with_fake.hpp"

namespace sluice::detail::fake {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kRegionLen = kLen;

// The core-over-fake fixture with one channel, and b named (the Prometheus label).
class Metrics : public CoreWithFake {
 protected:
  void start(std::chrono::milliseconds op_timeout = 30s) {
    CoreWithFake::start(1, op_timeout, /*reconnect=*/true, "engine-b");
  }
};

TEST(LatencyBuckets, UpperBoundsDoubleFromOneMicrosecond) {
  using C = EndpointCounters;
  EXPECT_EQ(C::bucket_of(0ns), 0);
  EXPECT_EQ(C::bucket_of(1000ns), 0);
  EXPECT_EQ(C::bucket_of(1001ns), 1);
  EXPECT_EQ(C::bucket_of(2000ns), 1);
  EXPECT_EQ(C::bucket_of(2001ns), 2);
  EXPECT_EQ(C::bucket_of(1ms), 10);  // 1000 us <= 1024 us
  EXPECT_EQ(C::bucket_of(3600s), LatencyHistogram::kBuckets - 1);
  EXPECT_EQ(LatencyHistogram::bound_ns(0), 1000u);
  EXPECT_EQ(LatencyHistogram::bound_ns(10), 1024000u);
  EXPECT_EQ(LatencyHistogram::bound_ns(LatencyHistogram::kBuckets - 1), UINT64_MAX);
}

// Every op is counted once when it starts and once when it ends, by how it ended; caller
// errors that threw at submit and imm_recv are not operations of this endpoint.
TEST_F(Metrics, CountsFollowEveryOpFromSubmitToItsEnd) {
  start();
  Future w1 = write(4096);
  ASSERT_TRUE(net().wait_queued(1));
  EndpointMetrics m = ep_.metrics();
  EXPECT_EQ(m.of(OpKind::kWrite).started, 1u);
  EXPECT_EQ(m.of(OpKind::kWrite).completed, 0u);
  EXPECT_EQ(m.in_flight, 1u);
  EXPECT_EQ(m.latency.count, 0u);
  EXPECT_EQ(m.transport, "fake");
  EXPECT_EQ(m.peer_engine_id, ep_.peer_engine_id());
  EXPECT_TRUE(m.connected);
  EXPECT_NE(m.endpoint, 0u);
  EXPECT_EQ(m.endpoint, peer_.metrics().endpoint) << "both sides name the connection alike";
  ASSERT_EQ(a_->metrics().size(), 1u);
  EXPECT_EQ(a_->metrics()[0].endpoint, m.endpoint);
  ASSERT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(w1.wait_for(5s));
  m = ep_.metrics();  // counted before the future read as done
  EXPECT_EQ(m.of(OpKind::kWrite).completed, 1u);
  EXPECT_EQ(m.of(OpKind::kWrite).bytes, 4096u);
  EXPECT_EQ(m.in_flight, 0u);
  EXPECT_EQ(m.latency.count, 1u);

  Future w2 = write(1024);
  ASSERT_TRUE(net().wait_queued(1));
  net().fail(0, {ErrorCode::kRemoteError, "refused by the test"});
  ASSERT_TRUE(w2.wait_for(5s));
  Future r = ep_.read({{ha_, 0, rb_, 0, kRegionLen}});
  ASSERT_TRUE(net().wait_queued(1));
  ASSERT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(r.wait_for(5s));
  EXPECT_THROW(write(0), Error);               // zero length: refused at submit
  EXPECT_THROW(write(8, kRegionLen), Error);         // out of range: refused at submit
  Future im = ep_.imm_recv();                  // not counted
  m = ep_.metrics();
  EXPECT_EQ(m.of(OpKind::kWrite).started, 2u);
  EXPECT_EQ(m.of(OpKind::kWrite).completed, 1u);
  EXPECT_EQ(m.of(OpKind::kWrite).failed, 1u);
  EXPECT_EQ(m.of(OpKind::kWrite).bytes, 4096u) << "a failed op's bytes are not counted";
  EXPECT_EQ(m.of(OpKind::kRead).completed, 1u);
  EXPECT_EQ(m.of(OpKind::kRead).bytes, kRegionLen);
  EXPECT_EQ(m.in_flight, 0u);
  EXPECT_EQ(m.latency.count, 3u);
  EXPECT_EQ(m.timeouts, 0u);

  // The peer is lost with a write and a recv pending: both fail as peer_lost.
  Future w3 = write(64);
  Future rv = ep_.recv(ha_, 0, 64);
  ASSERT_TRUE(net().wait_queued(1));
  EXPECT_EQ(ep_.metrics().in_flight, 2u);
  net().lose(0, {ErrorCode::kPeerLost, "lost by the test"});
  ASSERT_TRUE(w3.wait_for(5s));
  ASSERT_TRUE(rv.wait_for(5s));
  m = ep_.metrics();
  EXPECT_EQ(m.peer_lost, 2u);
  EXPECT_EQ(m.of(OpKind::kRecv).failed, 1u);
  EXPECT_EQ(m.of(OpKind::kWrite).failed, 2u);
  EXPECT_EQ(m.in_flight, 0u);
  EXPECT_FALSE(m.connected);
  uint64_t sum = 0;
  for (uint64_t c : m.latency.counts) sum += c;
  EXPECT_EQ(sum, m.latency.count);
  EXPECT_EQ(m.latency.count, 5u);
}

TEST_F(Metrics, AWatchdogTimeoutIsCountedAsOne) {
  start(200ms);
  Future f = write(4096);
  ASSERT_TRUE(net().wait_queued(1));
  ASSERT_TRUE(f.wait_for(5s));
  ASSERT_EQ(f.status().code, ErrorCode::kTimeout);
  EndpointMetrics m = ep_.metrics();
  EXPECT_EQ(m.timeouts, 1u);
  EXPECT_EQ(m.of(OpKind::kWrite).failed, 1u);
  // The op took at least op_timeout: it sits in a bucket whose bound is at least 200 ms.
  int i = 0;
  while (m.latency.counts[i] == 0) ++i;
  EXPECT_GE(LatencyHistogram::bound_ns(i), 200'000'000u);
}

// The exposition format: HELP and TYPE once per family, every sample "name{labels} value",
// the histogram's buckets cumulative and ending at +Inf with the count.
TEST_F(Metrics, PrometheusTextIsWellFormedAndAgreesWithTheCounters) {
  start();
  for (int i = 0; i < 3; ++i) {
    Future f = write(100);
    ASSERT_TRUE(net().wait_queued(1));
    ASSERT_TRUE(net().deliver(0).ok());
    ASSERT_TRUE(f.wait_for(5s));
  }
  const std::string text = a_->metrics_text();
  const std::regex sample(R"(^([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+|\+Inf)$)");
  const std::regex comment(R"(^# (HELP|TYPE) ([a-z_]+) .+$)");
  std::map<std::string, int> types;
  std::map<std::string, std::string> values;  // "name{labels}" -> value
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (line.rfind("#", 0) == 0) {
      ASSERT_TRUE(std::regex_match(line, m, comment)) << line;
      if (m[1] == "TYPE") EXPECT_EQ(++types[m[2]], 1) << "TYPE twice for " << m[2];
      continue;
    }
    ASSERT_TRUE(std::regex_match(line, m, sample)) << "not a sample line: " << line;
    values[m[1].str() + m[2].str()] = m[3];
  }
  const std::string id = ep_.metrics().peer_engine_id;
  auto find = [&](const std::string& prefix, const std::string& must) -> std::string {
    for (const auto& [k, v] : values)
      if (k.rfind(prefix + "{", 0) == 0 && k.find(must) != std::string::npos) return v;
    return "";
  };
  EXPECT_EQ(find("sluice_endpoints", ""), "1");
  EXPECT_EQ(find("sluice_endpoint_ops_completed_total", "kind=\"write\""), "3");
  EXPECT_EQ(find("sluice_endpoint_bytes_total", "kind=\"write\""), "300");
  EXPECT_EQ(find("sluice_endpoint_ops_completed_total", "kind=\"read\""), "0");
  EXPECT_EQ(find("sluice_endpoint_op_latency_seconds_bucket", "le=\"+Inf\""), "3");
  EXPECT_EQ(find("sluice_endpoint_op_latency_seconds_count", ""), "3");
  EXPECT_NE(find("sluice_endpoint_connected", "peer=\"" + id + "\""), "") << "the peer label names the peer engine";
  EXPECT_EQ(types["sluice_endpoint_op_latency_seconds"], 1);
  // Buckets never decrease.
  std::vector<double> buckets;
  std::istringstream again(text);
  for (std::string line; std::getline(again, line);)
    if (line.rfind("sluice_endpoint_op_latency_seconds_bucket", 0) == 0)
      buckets.push_back(std::stod(line.substr(line.rfind(' ') + 1)));
  ASSERT_EQ(buckets.size(), size_t(LatencyHistogram::kBuckets));
  for (size_t i = 1; i < buckets.size(); ++i) EXPECT_LE(buckets[i - 1], buckets[i]);
  // The engine's name, when it has one, is the engine label.
  EXPECT_NE(b_->metrics_text().find("engine=\"engine-b\""), std::string::npos);
}

TEST(PrometheusText, LabelValuesAreEscaped) {
  EndpointMetrics e;
  e.peer_engine_id = "a\"b\\c\nd";
  e.transport = "tcp";
  const std::string text = prometheus_text("eng", {e});
  EXPECT_NE(text.find(R"(peer="a\"b\\c\nd")"), std::string::npos) << text.substr(0, 400);
}

}  // namespace
}  // namespace sluice::detail::fake
