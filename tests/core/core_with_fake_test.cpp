// The core (EndpointImpl, the engine's watchdog, futures, message matching, close paths) over
// the fake transport (fake_transport.hpp): the test decides when each lane lands, fails or
// never answers, so timing and failure paths are checked without sockets on the data path
// and without racing a real peer. Two engines in this process; the handshake is real.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "core_with_fake.hpp"

namespace sluice::detail::fake {
namespace {

using namespace std::chrono_literals;

TEST_F(CoreWithFake, DeliveredWriteLandsThroughTheTargetRegistry) {
  start(1);
  Future f = write(kLen);
  ASSERT_TRUE(net().wait_queued(1));
  EXPECT_FALSE(f.test()) << "completed before the fake delivered it";
  EXPECT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(f.wait_for(5s));
  EXPECT_TRUE(f.status().ok()) << f.status().to_string();
  EXPECT_EQ(f.bytes(), kLen);
  EXPECT_TRUE(landed(0, kLen));
  // A read the other way round lands in a's memory.
  std::fill(la_.begin(), la_.end(), 0);
  Future r = ep_.read({{ha_, 0, rb_, 0, kLen}});
  ASSERT_TRUE(net().wait_queued(1));
  EXPECT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(r.wait_for(5s));
  EXPECT_TRUE(r.status().ok());
  for (uint64_t i = 0; i < kLen; ++i) ASSERT_EQ(la_[i], lb_[kGuard + i]) << "byte " << i;
}

// Watchdog: an op nobody answers fails with kTimeout once op_timeout passed without progress,
// and the endpoint is declared lost.
TEST_F(CoreWithFake, HeldOpTimesOutAndTheEndpointIsLost) {
  start(1, 200ms, /*reconnect=*/false);
  Future f = write();
  ASSERT_TRUE(net().wait_queued(1));
  ASSERT_TRUE(f.wait_for(5s)) << "the watchdog never timed the held op out";
  EXPECT_EQ(f.status().code, ErrorCode::kTimeout) << f.status().to_string();
  EXPECT_GE(f.elapsed(), 200ms) << "timed out before op_timeout";
  // Issue 19: a timeout names the operation and its channel (the peer: below, from the core).
  EXPECT_NE(f.status().message.find("write on channel 0 saw no progress"), std::string::npos) << f.status().to_string();
  EXPECT_FALSE(ep_.connected());
  EXPECT_EQ(code_of_write(ep_, ha_, rb_), ErrorCode::kTimeout) << "a new op on a timed-out endpoint must be refused";
  EXPECT_EQ(net().queued(), 0u) << "the transport was not closed";
  EXPECT_TRUE(untouched());
}

// Per-op deadlines count from the op's own last progress, not from its submission.
TEST_F(CoreWithFake, AnOpThatKeepsMakingProgressIsNotTimedOut) {
  start(1, 400ms);
  Future f = write();
  ASSERT_TRUE(net().wait_queued(1));
  const auto until = std::chrono::steady_clock::now() + 1600ms;  // 4 op_timeouts
  while (std::chrono::steady_clock::now() < until) {
    net().progress(0);
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_FALSE(f.test()) << "timed out although it kept making progress: " << f.status().to_string();
  EXPECT_TRUE(ep_.connected());
  EXPECT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(f.wait_for(5s));
  EXPECT_TRUE(f.status().ok()) << f.status().to_string();
  EXPECT_TRUE(landed(0, 4096));
}

// A refused op (a NACK) fails alone, with exactly the status given; the endpoint stays usable.
TEST_F(CoreWithFake, FailedOpCompletesWithItsStatusAndOthersAreUnaffected) {
  start(1);
  Future f1 = write(4096, 0);
  Future f2 = write(4096, 4096);
  ASSERT_TRUE(net().wait_queued(2));
  net().fail(0, {ErrorCode::kRemoteError, "refused by the test"});
  ASSERT_TRUE(f1.wait_for(5s));
  EXPECT_EQ(f1.status().code, ErrorCode::kRemoteError);
  EXPECT_EQ(f1.status().message, "refused by the test");
  EXPECT_FALSE(f2.test()) << "a NACK of one op completed another";
  EXPECT_TRUE(ep_.connected());
  EXPECT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(f2.wait_for(5s));
  EXPECT_TRUE(f2.status().ok()) << f2.status().to_string();
  EXPECT_TRUE(landed(4096, 4096));
  // New ops still go through.
  Future f3 = write(4096, 0);
  ASSERT_TRUE(net().wait_queued(1));
  EXPECT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(f3.wait_for(5s));
  EXPECT_TRUE(f3.status().ok());
}

// The transport lost its peer: every pending op and posted recv fails with its status, and
// new ops are refused at submit.
TEST_F(CoreWithFake, LostPeerFailsEverythingPendingAndRefusesNewOps) {
  start(1, 30s, /*reconnect=*/false);
  std::vector<Future> fs;
  for (int i = 0; i < 3; ++i) fs.push_back(write(4096, 4096u * i));
  Future rv = ep_.recv(ha_, 0, 64);
  Future im = ep_.imm_recv();
  ASSERT_TRUE(net().wait_queued(3));
  net().lose(0, {ErrorCode::kPeerLost, "lost by the test"});
  // At once, not later through the watchdog's sweep of failed endpoints: on_failure itself
  // fails the posted recv and imm_recv.
  for (auto* f : {&fs[0], &fs[1], &fs[2], &rv, &im}) {
    ASSERT_TRUE(f->test()) << "still pending after the transport reported the failure";
    EXPECT_EQ(f->status().code, ErrorCode::kPeerLost) << f->status().to_string();
  }
  EXPECT_FALSE(ep_.connected());
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(code_of_write(ep_, ha_, rb_), ErrorCode::kPeerLost);
  EXPECT_THROW(ep_.send(ha_, 0, 64), Error);
  EXPECT_THROW(ep_.recv(ha_, 0, 64), Error);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_EQ(net().queued(), 0u);
  EXPECT_TRUE(untouched());
}

// Lanes complete in any order; the future completes once, after the last, with all bytes.
TEST_F(CoreWithFake, OutOfOrderLanesCompleteTheFutureOnce) {
  start(4);
  Future f = write(kLen);
  std::atomic<int> callbacks{0};
  f.on_complete([&](const Status&) { callbacks.fetch_add(1); });
  ASSERT_TRUE(net().wait_queued(4));
  ASSERT_EQ(net().queued(), 4u) << "expected one item per lane";
  // Lanes 3, 1, 2, then 0 (indices shift as items leave the queue).
  for (size_t i : {3u, 1u, 1u}) {
    EXPECT_TRUE(net().deliver(i).ok());
    EXPECT_FALSE(f.test()) << "completed before its last lane";
  }
  EXPECT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(f.wait_for(5s));
  EXPECT_TRUE(f.status().ok()) << f.status().to_string();
  EXPECT_EQ(f.bytes(), kLen);
  EXPECT_EQ(callbacks.load(), 1);
  EXPECT_TRUE(landed(0, kLen));
}

// write_with_imm: the target sees the imm only after the last lane landed.
TEST_F(CoreWithFake, ImmIsDeliveredAfterTheLastLaneOnly) {
  start(4);
  Future imm = peer_.imm_recv();
  Future f = ep_.write_with_imm({{ha_, 0, rb_, 0, kLen}}, 0xC0FFEE);
  ASSERT_TRUE(net().wait_queued(4));
  ASSERT_EQ(net().queued(), 4u);
  for (size_t i : {2u, 0u, 1u}) {
    EXPECT_TRUE(net().deliver(i).ok());
    EXPECT_FALSE(imm.test()) << "imm delivered before the last lane";
  }
  EXPECT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(imm.wait_for(5s));
  EXPECT_TRUE(imm.status().ok()) << imm.status().to_string();
  EXPECT_EQ(imm.imm(), 0xC0FFEEu);
  ASSERT_TRUE(f.wait_for(5s));
  EXPECT_TRUE(f.status().ok());
  EXPECT_TRUE(landed(0, kLen));

  // A batch with a refused lane delivers no imm at all, and its future reports the refusal.
  Future imm2 = peer_.imm_recv();
  Future g = ep_.write_with_imm({{ha_, 0, rb_, 0, kLen}}, 7);
  ASSERT_TRUE(net().wait_queued(4));
  net().tamper(1, [](Piece& p) { p.remote_id += 1000; });  // a region the target never had
  for (int i = 0; i < 4; ++i) net().deliver(0);
  ASSERT_TRUE(g.wait_for(5s));
  EXPECT_EQ(g.status().code, ErrorCode::kUnknownHandle) << g.status().to_string();
  EXPECT_FALSE(imm2.wait_for(200ms)) << "imm delivered for a batch whose lane was refused";
}

TEST_F(CoreWithFake, EndpointCloseCancelsHeldOps) {
  start(2);
  Future w = write(kLen);
  Future s = ep_.send(ha_, 0, 64);
  Future r = ep_.recv(ha_, 0, 64);
  ASSERT_TRUE(net().wait_queued(3));
  const auto t0 = std::chrono::steady_clock::now();
  ep_.close();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  for (auto* f : {&w, &s, &r}) {
    ASSERT_TRUE(f->wait_for(5s)) << "close left an op pending";
    EXPECT_EQ(f->status().code, ErrorCode::kCancelled) << f->status().to_string();
  }
  EXPECT_EQ(net().queued(), 0u);
  EXPECT_THROW(write(), Error);
  EXPECT_TRUE(untouched());
}

TEST_F(CoreWithFake, EngineCloseCancelsHeldOps) {
  start(2);
  Future w = write(kLen);
  Future rd = ep_.read({{ha_, 0, rb_, 0, 4096}});
  Future im = ep_.imm_recv();
  ASSERT_TRUE(net().wait_queued(2));
  const auto t0 = std::chrono::steady_clock::now();
  a_->close();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  for (auto* f : {&w, &rd, &im}) {
    ASSERT_TRUE(f->wait_for(5s)) << "engine close left an op pending";
    EXPECT_EQ(f->status().code, ErrorCode::kCancelled) << f->status().to_string();
  }
  EXPECT_EQ(net().queued(), 0u);
}

// A request the core's own checks would have refused (a hostile or stale initiator): the
// target pins against its registry and moves nothing outside the region.
TEST_F(CoreWithFake, TargetRefusesAnOutOfRangeRemoteOffset) {
  start(1);
  Future f = write(4096, 0);
  ASSERT_TRUE(net().wait_queued(1));
  net().tamper(0, [](Piece& p) { p.remote_offset = kLen - 64; });  // 4032 bytes past the end
  Status st = net().deliver(0);
  EXPECT_EQ(st.code, ErrorCode::kOutOfRange) << st.to_string();
  ASSERT_TRUE(f.wait_for(5s));
  EXPECT_EQ(f.status().code, ErrorCode::kOutOfRange) << f.status().to_string();
  EXPECT_TRUE(untouched()) << "bytes were written outside (or inside) the region for a refused request";

  // An offset that wraps around, and a read past the end (nothing may leak into a's memory).
  Future g = write(4096, 0);
  ASSERT_TRUE(net().wait_queued(1));
  net().tamper(0, [](Piece& p) { p.remote_offset = UINT64_MAX - 100; });
  EXPECT_EQ(net().deliver(0).code, ErrorCode::kOutOfRange);
  ASSERT_TRUE(g.wait_for(5s));
  EXPECT_EQ(g.status().code, ErrorCode::kOutOfRange);
  const std::vector<uint8_t> before = la_;
  Future r = ep_.read({{ha_, 0, rb_, 0, 4096}});
  ASSERT_TRUE(net().wait_queued(1));
  net().tamper(0, [](Piece& p) { p.remote_offset = kLen; });
  EXPECT_EQ(net().deliver(0).code, ErrorCode::kOutOfRange);
  ASSERT_TRUE(r.wait_for(5s));
  EXPECT_EQ(r.status().code, ErrorCode::kOutOfRange);
  EXPECT_EQ(la_, before) << "a refused read wrote into the initiator's memory";
  EXPECT_TRUE(untouched());
  // A NACK is not a lost peer.
  EXPECT_TRUE(ep_.connected());
}

// Two-sided messages go through the target's matcher.
TEST_F(CoreWithFake, SendIsMatchedWithTheTargetsRecv) {
  start(1);
  Future rv = peer_.recv(hb_, 0, 64);
  Future s = ep_.send(ha_, 100, 64);
  ASSERT_TRUE(net().wait_queued(1));
  EXPECT_FALSE(rv.test());
  EXPECT_TRUE(net().deliver(0).ok());
  ASSERT_TRUE(s.wait_for(5s));
  ASSERT_TRUE(rv.wait_for(5s));
  EXPECT_TRUE(s.status().ok()) << s.status().to_string();
  EXPECT_TRUE(rv.status().ok()) << rv.status().to_string();
  EXPECT_EQ(rv.bytes(), 64u);
  for (int i = 0; i < 64; ++i) ASSERT_EQ(lb_[kGuard + i], la_[100 + i]);
}

}  // namespace
}  // namespace sluice::detail::fake
