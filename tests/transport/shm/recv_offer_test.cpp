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
#include <thread>
#include <vector>

#include "../harness.hpp"
#include "../test_util.hpp"
#include "sluice/sluice.hpp"
#include "transport/shm/shm_ring.hpp"
#include "transport/shm/shm_test_ring.hpp"

using namespace std::chrono_literals;
using namespace sluice_test;

namespace {

using sluice::detail::shm::RecvOfferSlot;
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
// both sides hear of the truncation; and one larger than shm.recv_offer_max goes as SEND_RTS.
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
  const uint64_t sizes[] = {(4 << 10) + 1, 65536, 300001, (1 << 20) - 1, 1 << 20, (1 << 20) + 7, (3 << 20) + 3};
  for (uint64_t off = 0, i = 0; i < 70; ++i) {
    const uint64_t n = sizes[i % 7], cap = n + (i % 3 == 0 ? 4096 + 5 : 0);
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
  // Larger than shm.recv_offer_max (2 MiB): the sending thread would copy it alone, where
  // SEND_RTS splits it over the receiver's copy pool; it goes as SEND_RTS, whole.
  const uint64_t big = (2 << 20) + 1;
  auto rb = peer->recv(mb.handle, 4096, 3 << 20);
  ASSERT_TRUE(ep.send(ma.handle, 7, big).wait().ok());
  ASSERT_TRUE(rb.wait_for(10s));
  ASSERT_TRUE(rb.status().ok()) << rb.status().to_string();
  EXPECT_EQ(rb.bytes(), big);
  EXPECT_EQ(0, std::memcmp(dst + 4096, src + 7, big));
  EXPECT_EQ(test_offered_sends(), taken) << "a SEND larger than shm.recv_offer_max took its offer";
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

// A hostile receiver (played by the test seam, which rewrites each offer slot as the receiver
// writes it): the sender copies only inside the receiver's region as it mapped it, with the
// bounds of its own description, and only for the message the word names. Every bad slot
// below leaves the message to SEND_RTS, which lands it in its real recv; the receiver's region
// outside the recv is untouched.
std::atomic<int> g_bad_offer{-1};
std::atomic<uint64_t> g_bad_region{0}, g_bad_length{0};
void bad_offer(RecvOfferSlot& s, uint64_t seq) {
  namespace shm = sluice::detail::shm;
  switch (g_bad_offer.load()) {
    case 0: s.offset = g_bad_length.load() - 100; break;   // runs past the region's end
    case 1: s.offset = ~uint64_t{0} - 1000; break;         // offset + length wraps around
    case 2: s.capacity = ~uint64_t{0}; s.offset = g_bad_length.load(); break;  // at the end, any size
    case 3: s.region = ~uint64_t{0}; break;                // the eager ring's own id
    case 4: s.region = g_bad_region.load() + 1000; break;  // no such region
    case 5: s.word = shm::offer_word(seq + 64, shm::kOffered); break;  // the slot's next message
    case 6: s.word = shm::offer_word(seq + 1, shm::kOffered); break;   // another message
    case 7: s.word = shm::offer_word(seq, shm::kTaken); break;         // already taken
    case 8: s.word = shm::offer_word(seq, shm::kRevoked); break;
    default: break;
  }
}

TEST(RecvOffers, ASenderCopiesOnlyInsideTheReceiversRegionAsItMappedIt) {
  constexpr int kCases = 9;
  sluice::Engine a(offer_config()), b(offer_config());
  constexpr uint64_t kLen = 1 << 20, kMsg = 300000, kAt = 4096;
  auto ma = a.allocate(kLen);
  auto mb = b.allocate(kLen, sluice::Location::host(), "recvs");
  auto* dst = static_cast<uint8_t*>(mb.ptr);
  fill_pattern(static_cast<uint8_t*>(ma.ptr), kLen, 17);
  sluice::Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  ASSERT_NO_FATAL_FAILURE(wait_for_offers(ep, *peer, ma.handle, mb.handle));
  g_bad_region = mb.handle.id;
  g_bad_length = kLen;
  sluice::detail::shm::set_test_offer_tamper(bad_offer);
  struct Off {
    ~Off() { sluice::detail::shm::set_test_offer_tamper(nullptr); }
  } off;
  for (int c = 0; c < kCases; ++c) {
    SCOPED_TRACE("bad offer " + std::to_string(c));
    g_bad_offer = c;
    std::memset(dst, 0x5a, kLen);
    const uint64_t before = test_offered_sends();
    auto r = peer->recv(mb.handle, kAt, kMsg);
    sluice::Status sent = ep.send(ma.handle, 64, kMsg).wait();
    ASSERT_TRUE(sent.ok()) << sent.to_string();
    ASSERT_TRUE(r.wait_for(10s));
    ASSERT_TRUE(r.status().ok()) << r.status().to_string();
    EXPECT_EQ(test_offered_sends(), before) << "the sender took an offer it must refuse";
    ASSERT_EQ(0, std::memcmp(dst + kAt, static_cast<uint8_t*>(ma.ptr) + 64, kMsg));
    for (uint64_t i = 0; i < kLen; ++i)
      if (i < kAt || i >= kAt + kMsg) ASSERT_EQ(dst[i], 0x5a) << "byte " << i << " outside the recv";
  }
  // The seam off: the very next message takes its offer again.
  g_bad_offer = -1;
  const uint64_t before = test_offered_sends();
  auto r = peer->recv(mb.handle, kAt, kMsg);
  ASSERT_TRUE(ep.send(ma.handle, 64, kMsg).wait().ok());
  ASSERT_TRUE(r.wait_for(10s));
  EXPECT_TRUE(r.status().ok()) << r.status().to_string();
  EXPECT_EQ(test_offered_sends(), before + 1);
}

// recv_timeout racing the sender: recvs that give up around the time their message is sent
// (100 ms timeout, sends 0 to 250 ms after the recv). Whoever turns the word first decides:
// a SEND that succeeded landed whole in a recv that succeeded; a recv that timed out plainly
// (its offer revoked) is never written, and its sender hears that the receiver gave up.
TEST(RecvOffers, RecvTimeoutRacingTheSenderNeverWritesAFailedRecv) {
  sluice::EngineConfig c = offer_config();
  c.recv_timeout = 100ms;
  sluice::Engine a(c), b(c);
  constexpr int kRounds = 40;
  constexpr uint64_t kMsg = 200000, kStride = 204800;
  auto ma = a.allocate(kMsg);
  auto mb = b.allocate(kRounds * kStride, sluice::Location::host(), "recvs");
  auto* dst = static_cast<uint8_t*>(mb.ptr);
  fill_pattern(static_cast<uint8_t*>(ma.ptr), kMsg, 23);
  sluice::Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  ASSERT_NO_FATAL_FAILURE(wait_for_offers(ep, *peer, ma.handle, mb.handle));
  std::memset(dst, 0, kRounds * kStride);
  std::mt19937_64 rng(5);
  int landed = 0, gave_up = 0;
  const uint64_t before = test_offered_sends();
  for (int i = 0; i < kRounds; ++i) {
    SCOPED_TRACE("round " + std::to_string(i));
    auto r = peer->recv(mb.handle, i * kStride, kMsg);
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 250));
    sluice::Status sent = ep.send(ma.handle, 0, kMsg).wait();
    ASSERT_TRUE(r.wait_for(10s));
    const sluice::Status got = r.status();
    if (sent.ok()) {
      ++landed;
      ASSERT_TRUE(got.ok()) << got.to_string();
      ASSERT_EQ(0, std::memcmp(dst + i * kStride, ma.ptr, kMsg));
    } else {
      ++gave_up;
      EXPECT_EQ(sent.code, sluice::ErrorCode::kRemoteError) << sent.to_string();
      ASSERT_EQ(got.code, sluice::ErrorCode::kTimeout) << got.to_string();
      EXPECT_EQ(got.message.find("may still be written"), std::string::npos) << got.message;
      for (uint64_t k = 0; k < kStride; ++k) ASSERT_EQ(dst[i * kStride + k], 0) << "byte " << k << " of a recv that timed out";
    }
  }
  std::printf("[ info ] %d landed (%llu through offers), %d timed out\n", landed,
              static_cast<unsigned long long>(test_offered_sends() - before), gave_up);
  EXPECT_GT(test_offered_sends(), before) << "no SEND took its offer: the race was not run";
  EXPECT_TRUE(peer->connected());
}

// Closing while offers stand. (1) A receiver that closes with recvs offered and untaken
// withdraws them: a sender still running copies into none (they fail with kCancelled, their
// buffers untouched) and its SENDs complete instead of hanging. (2) A receiver that closes while
// its sender holds a taken offer (its copy held 1 s by the test knob) returns at once, and its
// recv's failure says that the buffer may still be written. (3) Engines destroyed with offers
// standing go away (the test would hang otherwise).
TEST(RecvOffers, CloseWhileOffersStandLeavesNothingPending) {
  {
    sluice::Engine a(offer_config()), b(offer_config());
    auto ma = a.allocate(1 << 20);
    auto mb = b.allocate(1 << 20, sluice::Location::host(), "recvs");
    sluice::Endpoint ep = a.connect(b.local_info());
    auto peer = b.accept(5s);
    ASSERT_TRUE(peer.has_value());
    ASSERT_NO_FATAL_FAILURE(wait_for_offers(ep, *peer, ma.handle, mb.handle));
    std::memset(mb.ptr, 0, 1 << 20);
    std::vector<sluice::Future> rs;
    for (int i = 0; i < 3; ++i) rs.push_back(peer->recv(mb.handle, i * 300000, 300000));
    const uint64_t before = test_offered_sends();
    peer->close();
    for (auto& r : rs) {
      ASSERT_TRUE(r.wait_for(5s));
      EXPECT_EQ(r.status().code, sluice::ErrorCode::kCancelled) << r.status().to_string();
      EXPECT_EQ(r.status().message.find("may still write"), std::string::npos) << r.status().message;
    }
    for (int i = 0; i < 3; ++i) {
      auto s = ep.send(ma.handle, 0, 300000);
      // It fails, or goes to the endpoint the sender connects again (the receiving engine
      // lives on and holds it unmatched): either way not into the closed endpoint's recvs.
      ASSERT_TRUE(s.wait_for(15s)) << "a SEND to a closed receiver hangs";
    }
    EXPECT_EQ(test_offered_sends(), before) << "a SEND took an offer its receiver withdrew";
    const auto* p = static_cast<const uint8_t*>(mb.ptr);
    for (uint64_t i = 0; i < (1 << 20); ++i) ASSERT_EQ(p[i], 0) << "byte " << i << " of a closed receiver's recvs";
  }
  {
    sluice::Engine a(offer_config()), b(offer_config());
    auto ma = a.allocate(1 << 20);
    auto mb = b.allocate(1 << 20, sluice::Location::host(), "recvs");
    const auto info = b.local_info();
    ::setenv("SLUICE_SHM_TEST_PUT_DELAY_MS", "1000", 1);
    sluice::Endpoint ep = a.connect(info);
    ::unsetenv("SLUICE_SHM_TEST_PUT_DELAY_MS");
    auto peer = b.accept(5s);
    ASSERT_TRUE(peer.has_value());
    ASSERT_NO_FATAL_FAILURE(wait_for_offers(ep, *peer, ma.handle, mb.handle));  // one held copy
    const uint64_t before = test_offered_sends();
    auto r = peer->recv(mb.handle, 0, 300000);
    sluice::Future s;
    std::thread sender([&] { s = ep.send(ma.handle, 0, 300000); });  // copies on this thread
    std::this_thread::sleep_for(300ms);
    const auto t0 = std::chrono::steady_clock::now();
    peer->close();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 900ms) << "the close waited for the peer's copy";
    ASSERT_TRUE(r.wait_for(5s));
    EXPECT_EQ(r.status().code, sluice::ErrorCode::kCancelled) << r.status().to_string();
    EXPECT_NE(r.status().message.find("may still write"), std::string::npos) << r.status().message;
    sender.join();
    ASSERT_TRUE(s.wait_for(10s));
    EXPECT_EQ(test_offered_sends(), before + 1) << "the SEND did not take its offer";
  }
  {
    sluice::Engine a(offer_config()), b(offer_config());
    auto ma = a.allocate(1 << 20);
    auto mb = b.allocate(1 << 20, sluice::Location::host(), "recvs");
    sluice::Endpoint ep = a.connect(b.local_info());
    auto peer = b.accept(5s);
    ASSERT_TRUE(peer.has_value());
    ASSERT_NO_FATAL_FAILURE(wait_for_offers(ep, *peer, ma.handle, mb.handle));
    for (int i = 0; i < 3; ++i) (void)peer->recv(mb.handle, i * 300000, 300000);
  }
}

}  // namespace
