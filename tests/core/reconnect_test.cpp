// Reconnection (ConnectOptions::reconnect, src/core/endpoint_reconnect.cpp) over the fake
// transport: the test decides when the peer is lost, so each rule is checked without racing a
// real one. A real-transport restart is in tests/transport/reconnect_test.cpp.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core_with_fake.hpp"

namespace sluice::detail::fake {
namespace {

using namespace std::chrono_literals;

class Reconnect : public CoreWithFake {
 protected:
  // Loses the connection under ep_ with `why` while one write is pending; that write must fail.
  void lose_with_pending(const Status& why) {
    Future f = write();
    ASSERT_TRUE(net().wait_queued(1));
    net().lose(0, why);
    ASSERT_TRUE(f.wait_for(5s));
    EXPECT_EQ(f.status().code, why.code) << f.status().to_string();
    EXPECT_FALSE(ep_.connected());
  }
  // A write on ep_ that must be queued (on whichever connection) and land.
  void write_lands() {
    Future f = write(kLen);
    ASSERT_TRUE(net().wait_queued(1));
    EXPECT_TRUE(net().deliver(0).ok());
    ASSERT_TRUE(f.wait_for(5s));
    EXPECT_TRUE(f.status().ok()) << f.status().to_string();
    EXPECT_TRUE(landed(0, kLen));
  }
  std::string message_of_write() {
    try {
      write();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
};

// The pending op fails with the loss (never retried); the next op connects again and lands;
// the peer sees a second endpoint; the counters go on across the two connections.
TEST_F(Reconnect, LostPeerFailsPendingThenNextOpConnectsAgain) {
  start(1);
  const std::string peer_id = ep_.peer_engine_id();
  const uint64_t first_token = ep_.metrics().endpoint;
  lose_with_pending({ErrorCode::kPeerLost, "lost by the test"});
  EXPECT_EQ(net().queued(), 0u) << "the lost write was queued again (retried)";
  write_lands();
  EXPECT_TRUE(ep_.connected());
  EXPECT_EQ(ep_.peer_engine_id(), peer_id) << "same peer, same engine";
  auto again = b_->accept(5s);
  EXPECT_TRUE(again.has_value()) << "the peer never saw the new connection";
  EndpointMetrics m = ep_.metrics();
  EXPECT_EQ(m.reconnects, 1u);
  EXPECT_NE(m.endpoint, first_token) << "a new connection has a new token";
  EXPECT_EQ(m.of(OpKind::kWrite).failed, 1u) << "the failed write of the first connection is still counted";
  EXPECT_EQ(m.of(OpKind::kWrite).completed, 1u);
  EXPECT_NE(a_->metrics_text().find("sluice_endpoint_reconnects_total"), std::string::npos);
}

// A timeout (a peer that stopped answering) is reconnectable too.
TEST_F(Reconnect, TimedOutEndpointConnectsAgain) {
  start(1, 200ms);
  Future f = write();
  ASSERT_TRUE(net().wait_queued(1));
  ASSERT_TRUE(f.wait_for(5s));
  EXPECT_EQ(f.status().code, ErrorCode::kTimeout);
  EXPECT_EQ(net().queued(), 0u) << "the timed-out write was queued again (retried)";
  write_lands();
  EXPECT_EQ(ep_.metrics().reconnects, 1u);
}

// Opted out: the failed endpoint stays failed.
TEST_F(Reconnect, OptedOutEndpointStaysFailed) {
  start(1, 30s, /*reconnect=*/false);
  lose_with_pending({ErrorCode::kPeerLost, "lost by the test"});
  EXPECT_EQ(code_of_write(ep_, ha_, rb_), ErrorCode::kPeerLost);
  EXPECT_EQ(net().queued(), 0u);
  EXPECT_EQ(ep_.metrics().reconnects, 0u);
  EXPECT_FALSE(b_->accept(200ms).has_value()) << "an opted-out endpoint dialed its peer again";
}

// A peer that broke the protocol is not dialed again: that failure is not a lost link.
TEST_F(Reconnect, ProtocolFailureIsNotReconnected) {
  start(1);
  lose_with_pending({ErrorCode::kProtocol, "garbage from the peer (test)"});
  EXPECT_EQ(code_of_write(ep_, ha_, rb_), ErrorCode::kProtocol);
  EXPECT_EQ(ep_.metrics().reconnects, 0u);
}

// close() ends the endpoint for good.
TEST_F(Reconnect, ClosedEndpointDoesNotReconnect) {
  start(1);
  lose_with_pending({ErrorCode::kPeerLost, "lost by the test"});
  ep_.close();
  EXPECT_NE(code_of_write(ep_, ha_, rb_), ErrorCode::kOk);
  EXPECT_EQ(ep_.metrics().reconnects, 0u);
}

// After a reconnection, close() closes the new connection, and for good.
TEST_F(Reconnect, CloseAfterReconnectionClosesTheNewConnection) {
  start(1);
  lose_with_pending({ErrorCode::kPeerLost, "lost by the test"});
  write_lands();
  ep_.close();
  EXPECT_FALSE(ep_.connected());
  EXPECT_NE(code_of_write(ep_, ha_, rb_), ErrorCode::kOk);
  EXPECT_EQ(ep_.metrics().reconnects, 1u);
}

// The peer is gone for good: the op throws the loss and the failed attempt, naming the
// target; a call right after does not dial again but repeats the attempt's error.
TEST_F(Reconnect, PeerGoneReportsBothFailuresAndDoesNotDialInALoop) {
  start(1);
  const std::string target = b_->listen_address();
  lose_with_pending({ErrorCode::kPeerLost, "lost by the test"});
  peer_ = Endpoint();
  b_.reset();  // nothing listens there any more
  std::string first = message_of_write();
  EXPECT_NE(first.find("lost by the test"), std::string::npos) << first;
  EXPECT_NE(first.find("connecting again to '" + target + "' failed"), std::string::npos) << first;
  EXPECT_EQ(code_of_write(ep_, ha_, rb_), ErrorCode::kPeerLost);
  std::string second = message_of_write();
  EXPECT_NE(second.find("ms ago"), std::string::npos) << "dialed again at once: " << second;
  EXPECT_EQ(ep_.metrics().reconnects, 0u);
}

// A peer that restarted under the same address is a new engine: the old engine's handle is
// refused, never mapped onto a region of the new one, and the new region is found by name.
TEST_F(Reconnect, RestartedPeerIsANewEngineAndOldHandlesAreRefused) {
  start(1);
  const std::string old_id = ep_.peer_engine_id();
  const std::string addr = b_->listen_address();
  const uint16_t port = static_cast<uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1)));
  lose_with_pending({ErrorCode::kPeerLost, "lost by the test"});
  peer_ = Endpoint();
  b_.reset();
  EngineConfig c = cfg_;
  c.listen_port = port;
  b_ = std::make_unique<Engine>(c);
  std::vector<uint8_t> fresh(kLen, 0);
  MemoryHandle hf = b_->register_memory(fresh.data(), fresh.size(), Location::host(), "b");
  // The old handle: the write connects again, then finds that the peer no longer has it.
  EXPECT_EQ(code_of_write(ep_, ha_, rb_), ErrorCode::kUnknownHandle);
  EXPECT_NE(ep_.peer_engine_id(), old_id) << "reached the old incarnation?";
  EXPECT_EQ(ep_.metrics().reconnects, 1u);
  auto r = ep_.remote_region("b");
  ASSERT_TRUE(r.has_value());
  EXPECT_NE(r->id, rb_.id) << "the new engine reused the old one's region id";
  (void)hf;
  Future f = ep_.write({{ha_, 0, *r, 0, kLen}});
  ASSERT_TRUE(net().wait_queued(1));
  EXPECT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(f.wait_for(5s));
  EXPECT_TRUE(f.status().ok()) << f.status().to_string();
  for (uint64_t i = 0; i < kLen; ++i) ASSERT_EQ(fresh[i], la_[i]) << "byte " << i;
}

// Several threads submit on the failed endpoint at once: one connection is made, and every
// op goes to it.
TEST_F(Reconnect, ConcurrentOpsMakeOneConnection) {
  start(1);
  lose_with_pending({ErrorCode::kPeerLost, "lost by the test"});
  constexpr int kThreads = 4;
  std::vector<Future> fs(kThreads);
  std::vector<std::thread> ts;
  std::atomic<int> errors{0};
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      try {
        fs[t] = ep_.write({{ha_, 4096u * t, rb_, 4096u * t, 4096}});
      } catch (const Error&) {
        errors.fetch_add(1);
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(errors.load(), 0);
  ASSERT_TRUE(net().wait_queued(kThreads));
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(net().deliver(0).ok());
  for (auto& f : fs) {
    ASSERT_TRUE(f.wait_for(5s));
    EXPECT_TRUE(f.status().ok()) << f.status().to_string();
  }
  EXPECT_TRUE(landed(0, kLen));
  EXPECT_EQ(ep_.metrics().reconnects, 1u);
  EXPECT_TRUE(b_->accept(5s).has_value());
  EXPECT_FALSE(b_->accept(100ms).has_value()) << "more than one new connection";
}

}  // namespace
}  // namespace sluice::detail::fake
