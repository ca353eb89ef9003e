// Recv offers (src/transport/shm/shm_offer.cpp, shm.recv_offers): a recv in engine memory that
// waits for its message is offered to the sender in the receiver's eager ring, and a lone
// rendezvous SEND is copied by its sender straight into it. Engines of one process (runs under
// TSan); the test seam counts the SENDs that went this way, so a test of the offers cannot pass
// with every message gone as SEND_RTS. The raw-peer tests (a SEND_PUT not offered, too long)
// are in same_host_test.cpp.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <vector>

#include "../harness.hpp"
#include "../test_util.hpp"
#include "sluice/sluice.hpp"
#include "transport/shm/shm_test_ring.hpp"

using namespace std::chrono_literals;
using namespace sluice_test;

namespace {

using sluice::detail::shm::test_offered_sends;

sluice::EngineConfig offer_config() {
  sluice::EngineConfig c = engine_config("shm", 2, 10s);
  c.options["shm.eager_max"] = std::to_string(4 << 10);  // larger SENDs are rendezvous: the path under test
  return c;
}

// Sends 1 KiB messages (into recvs posted first) until one went through an offer: the sender
// maps the receiver's ring after the first CREDIT grant, and the recv region after the first
// offer that names it, both in the background.
void wait_for_offers(sluice::Endpoint& ep, sluice::Endpoint& peer, sluice::MemoryHandle hs, sluice::MemoryHandle hr) {
  const uint64_t before = test_offered_sends();
  for (auto until = std::chrono::steady_clock::now() + 5s;
       test_offered_sends() == before && std::chrono::steady_clock::now() < until;) {
    auto r = peer.recv(hr, 0, 8 << 10);
    ASSERT_TRUE(ep.send(hs, 0, 8 << 10).wait().ok());
    ASSERT_TRUE(r.wait().ok());
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_GT(test_offered_sends(), before) << "no SEND ever took the receiver's offer";
}

// Lone SENDs of many sizes (past shm.eager_max, below and above the copy split) at odd offsets,
// each into a recv posted two ahead, as a receiver that keeps a window does: every byte lands in
// its own recv and none beside it, a message shorter than its recv reports its own length, and
// most went through their offers. Then a message longer than its recv: it goes as SEND_RTS and
// both sides hear of the truncation.
TEST(RecvOffers, LoneSendsLandWholeInTheirOfferedRecvs) {
  sluice::Engine a(offer_config()), b(offer_config());
  constexpr uint64_t kLen = 16 << 20;
  auto ma = a.allocate(kLen);
  auto mb = b.allocate(kLen, sluice::Location::host(), "recvs");
  auto* src = static_cast<uint8_t*>(ma.ptr);
  auto* dst = static_cast<uint8_t*>(mb.ptr);
  std::mt19937_64 rng(71);
  fill_random(src, kLen, rng);
  sluice::Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  ASSERT_NO_FATAL_FAILURE(wait_for_offers(ep, *peer, ma.handle, mb.handle));
  std::memset(dst, 0x3c, kLen);
  struct Msg {
    uint64_t src, dst, n, cap;
  };
  std::vector<Msg> msgs;
  const uint64_t sizes[] = {(4 << 10) + 1, 65536, 300001, 1 << 20, (1 << 20) + 7, (3 << 20) + 3};
  for (uint64_t off = 0, i = 0; i < 60; ++i) {
    const uint64_t n = sizes[i % 6], cap = n + (i % 3 == 0 ? 4096 + 5 : 0);
    if (off + cap + 64 > kLen) off = 0;
    msgs.push_back({(rng() % (kLen - n)), off + 3, n, cap});
    off += cap + 64;
  }
  std::deque<sluice::Future> recvs;
  size_t posted = 0;
  const uint64_t before = test_offered_sends();
  for (size_t i = 0; i < msgs.size(); ++i) {
    // Each message's recv (and the next one's) posted before it is sent. Messages whose
    // buffers overlap a later one are checked before that one is posted.
    for (; posted < std::min(msgs.size(), i + 2); ++posted) recvs.push_back(peer->recv(mb.handle, msgs[posted].dst, msgs[posted].cap));
    sluice::Status st = ep.send(ma.handle, msgs[i].src, msgs[i].n).wait();
    ASSERT_TRUE(st.ok()) << "send " << i << ": " << st.to_string();
    ASSERT_TRUE(recvs.front().wait_for(10s)) << "recv " << i;
    ASSERT_TRUE(recvs.front().status().ok()) << "recv " << i << ": " << recvs.front().status().to_string();
    EXPECT_EQ(recvs.front().bytes(), msgs[i].n) << "recv " << i;
    recvs.pop_front();
    const Msg& m = msgs[i];
    ASSERT_EQ(0, std::memcmp(dst + m.dst, src + m.src, m.n)) << "message " << i << " (" << m.n << " bytes)";
    EXPECT_EQ(dst[m.dst - 1], 0x3c) << "the byte before message " << i;
    for (uint64_t k = m.n; k < m.cap + 8; ++k) ASSERT_EQ(dst[m.dst + k], 0x3c) << "byte " << k << " past message " << i;
    std::memset(dst + m.dst, 0x3c, m.n);  // for messages whose buffers overlap this one later
  }
  for (auto& r : recvs) ASSERT_TRUE(r.wait_for(10s));
  const uint64_t offered = test_offered_sends() - before;
  EXPECT_GE(offered, msgs.size() / 2) << "only " << offered << " of " << msgs.size() << " SENDs took their offers";
  // Longer than its recv: the offer is not for it.
  const uint64_t taken = test_offered_sends();
  auto r = peer->recv(mb.handle, 0, 100000);
  sluice::Status sent = ep.send(ma.handle, 0, 100001).wait();
  ASSERT_TRUE(r.wait_for(10s));
  EXPECT_EQ(r.status().code, sluice::ErrorCode::kTruncated) << r.status().to_string();
  EXPECT_EQ(sent.code, sluice::ErrorCode::kTruncated) << sent.to_string();
  EXPECT_EQ(test_offered_sends(), taken) << "a SEND longer than its recv went through the recv's offer";
  EXPECT_EQ(0, std::memcmp(dst, src, 100000));
  EXPECT_EQ(dst[100000], 0x3c);
}

// A recv that gives up (recv_timeout) withdraws its offer first: the late message must not be
// copied into its buffer (which its owner may use again as soon as the recv failed); it goes as
// SEND_RTS, is drained, and its sender hears that the receiver gave up. The next message
// reaches the next recv through its own offer.
TEST(RecvOffers, ARecvThatTimesOutWithdrawsItsOffer) {
  sluice::EngineConfig c = offer_config();
  c.recv_timeout = 500ms;
  sluice::Engine a(c), b(c);
  auto ma = a.allocate(1 << 20);
  auto mb = b.allocate(1 << 20, sluice::Location::host(), "recvs");
  fill_pattern(static_cast<uint8_t*>(ma.ptr), 1 << 20, 9);
  sluice::Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  ASSERT_NO_FATAL_FAILURE(wait_for_offers(ep, *peer, ma.handle, mb.handle));
  auto* dst = static_cast<uint8_t*>(mb.ptr);
  std::memset(dst, 0, 1 << 20);
  auto r0 = peer->recv(mb.handle, 4096, 200000);
  ASSERT_TRUE(r0.wait_for(5s));
  EXPECT_EQ(r0.status().code, sluice::ErrorCode::kTimeout) << r0.status().to_string();
  const uint64_t before = test_offered_sends();
  sluice::Status late = ep.send(ma.handle, 0, 200000).wait();
  EXPECT_EQ(late.code, sluice::ErrorCode::kRemoteError) << late.to_string();
  EXPECT_EQ(test_offered_sends(), before) << "the late message went through a withdrawn offer";
  for (uint64_t i = 0; i < (1 << 20); ++i) ASSERT_EQ(dst[i], 0) << "byte " << i << " of a recv that gave up";
  auto r1 = peer->recv(mb.handle, 8192, 200000);
  ASSERT_TRUE(ep.send(ma.handle, 100, 200000).wait().ok());
  ASSERT_TRUE(r1.wait_for(5s));
  ASSERT_TRUE(r1.status().ok()) << r1.status().to_string();
  EXPECT_EQ(0, std::memcmp(dst + 8192, static_cast<uint8_t*>(ma.ptr) + 100, 200000));
  EXPECT_EQ(test_offered_sends(), before + 1) << "the next message did not take its recv's offer";
}

// An offer the sender took is not expired under its copy: the sender holds the offer 1.5 s (the
// test knob, shm.test_put_delay_ms, read by both endpoints but used only by the sender) against
// a recv_timeout of 1 s, and the recv completes with the message. A sender held past twice the
// timeout (3 s) fails the recv then, saying that its buffer may still be written; the receiver
// goes on. The messages before the offers started went as SEND_RTS, undelayed.
TEST(RecvOffers, ATakenOfferIsNotExpiredUnderItsCopy) {
  for (const char* delay : {"1500", "3000"}) {
    SCOPED_TRACE(std::string("copy held ") + delay + " ms");
    sluice::EngineConfig c = offer_config();
    c.recv_timeout = 1000ms;
    sluice::Engine a(c), b(c);
    auto ma = a.allocate(1 << 20);
    auto mb = b.allocate(1 << 20, sluice::Location::host(), "recvs");
    fill_pattern(static_cast<uint8_t*>(ma.ptr), 1 << 20, 13);
    const auto peer_ready = b.local_info();
    ::setenv("SLUICE_SHM_TEST_PUT_DELAY_MS", delay, 1);
    sluice::Endpoint ep = a.connect(peer_ready);
    ::unsetenv("SLUICE_SHM_TEST_PUT_DELAY_MS");  // read as the endpoints are made
    auto peer = b.accept(5s);
    ASSERT_TRUE(peer.has_value());
    // Until a SEND takes its offer (that one is held).
    const uint64_t before = test_offered_sends();
    sluice::Future r, s;
    for (auto until = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < until;) {
      std::memset(mb.ptr, 0, 300000);
      r = peer->recv(mb.handle, 0, 300000);
      s = ep.send(ma.handle, 0, 300000);
      ASSERT_TRUE(r.wait_for(10s));
      ASSERT_TRUE(s.wait_for(10s));
      EXPECT_TRUE(s.status().ok()) << s.status().to_string();
      if (test_offered_sends() != before) break;
      ASSERT_TRUE(r.status().ok()) << r.status().to_string();  // a SEND_RTS, before the offers began
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_EQ(test_offered_sends(), before + 1) << "no SEND took its offer";
    if (std::string(delay) == "1500") {
      EXPECT_TRUE(r.status().ok()) << r.status().to_string();
      EXPECT_EQ(0, std::memcmp(mb.ptr, ma.ptr, 300000));
    } else {
      EXPECT_EQ(r.status().code, sluice::ErrorCode::kTimeout) << r.status().to_string();
      EXPECT_NE(r.status().message.find("may still be written"), std::string::npos) << r.status().message;
      EXPECT_TRUE(peer->connected());
      // The message still lands (late) in the buffer the receiver was told may be written.
      auto r2 = peer->recv(mb.handle, 400000, 1000);
      ASSERT_TRUE(ep.send(ma.handle, 0, 1000).wait().ok());
      ASSERT_TRUE(r2.wait_for(10s));
      EXPECT_TRUE(r2.status().ok()) << r2.status().to_string();
    }
  }
}

}  // namespace
