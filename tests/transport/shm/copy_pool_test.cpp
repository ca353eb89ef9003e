// The shm copy pool (src/transport/shm/copy_pool.hpp): one small pool per engine runs the
// copies of every shm endpoint, so endpoints cost no threads; a lane that waits for a peer's
// region description is parked off the pool, so a stalled peer never holds up another peer's
// copies, and closing an endpoint completes its parked lanes at once. Engines of one process
// (runs under TSan).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdlib>
#include <thread>
#include <vector>

#include "../harness.hpp"
#include "../raw_peer.hpp"
#include "../test_util.hpp"
#include "sluice/sluice.hpp"
#include "transport/shm/shm_test_describe.hpp"

using namespace std::chrono_literals;
using namespace sluice_test;

namespace {

sluice::EngineConfig pool_config(int copy_threads) {
  sluice::EngineConfig c = engine_config("shm", 2, 60s);
  c.connect_timeout = 30s;  // also the describe deadline: longer than any hold below
  c.options["shm.copy_threads"] = std::to_string(copy_threads);
  c.options["shm.inline_max"] = "0";  // every copy on the pool: these tests are about the pool
  return c;
}

// Lets go of held describes however the test ends.
struct HoldDescribes {
  HoldDescribes() { sluice::detail::shm::hold_test_describes(true); }
  ~HoldDescribes() { release(); }
  void release() { sluice::detail::shm::hold_test_describes(false); }
};

}  // namespace

TEST(ShmCopyPool, ThirtyTwoEndpointsShareOnePool) {
  constexpr int kPeers = 32;
  constexpr uint64_t kChunk = 128 << 10;  // above the inline PULL_WRITE size: served on b's pool
  sluice::Engine a(pool_config(2)), b(pool_config(2));
  std::vector<uint8_t> src(kPeers * kChunk), back(kPeers * kChunk, 0), dst(kPeers * kChunk, 0);
  fill_pattern(src.data(), src.size(), 5);
  auto hs = a.register_memory(src.data(), src.size());
  auto hb = a.register_memory(back.data(), back.size());
  b.register_memory(dst.data(), dst.size(), sluice::Location::host(), "dst");
  const int before = thread_count();
  std::vector<sluice::Endpoint> eps, accepted;
  for (int i = 0; i < kPeers; ++i) {
    eps.push_back(a.connect(b.local_info()));
    auto acc = b.accept(5s);
    ASSERT_TRUE(acc.has_value()) << "endpoint " << i << " was not accepted";
    accepted.push_back(*acc);
  }
  // Every endpoint copies at once: writes (b's pool serves them), then reads back (a's pool).
  std::vector<sluice::Future> fs;
  for (int i = 0; i < kPeers; ++i) {
    auto rh = eps[i].remote_region("dst");
    ASSERT_TRUE(rh.has_value());
    fs.push_back(eps[i].write({{hs, i * kChunk, *rh, i * kChunk, kChunk}}));
  }
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok()) << f.status().message;
  fs.clear();
  for (int i = 0; i < kPeers; ++i) {
    auto rh = eps[i].remote_region("dst");
    fs.push_back(eps[i].read({{hb, i * kChunk, *rh, i * kChunk, kChunk}}));
  }
  const int during = thread_count();
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok()) << f.status().message;
  const int after = thread_count();
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), dst.size()), 0);
  EXPECT_EQ(std::memcmp(src.data(), back.data(), back.size()), 0);
  // Two pools of 2 copy threads (a's, b's), plus slack for threads that are not per
  // endpoint (reactors, listeners). Per-endpoint copy workers would add 2 x 2 x 32 = 128.
  EXPECT_LE(std::max(during, after) - before, 2 * 2 + 6)
      << kPeers << " shm endpoints (both ends in this process) added " << std::max(during, after) - before
      << " threads";
}

// b's describe questions go unanswered; a (one copy thread) reads from b's region (the lane
// parks) and then from c's, which it knows already: c's read completes while b's is still
// pending, and b's completes once b answers.
TEST(ShmCopyPool, StalledDescriptionDoesNotHoldOtherPeers) {
  sluice::Engine a(pool_config(1)), b(pool_config(1)), c(pool_config(1));
  std::vector<uint8_t> mb(1 << 16), mc(1 << 16), la(1 << 16, 0), lc(1 << 16, 0);
  fill_pattern(mb.data(), mb.size(), 1);
  fill_pattern(mc.data(), mc.size(), 2);
  auto ha = a.register_memory(la.data(), la.size());
  auto hc = a.register_memory(lc.data(), lc.size());
  b.register_memory(mb.data(), mb.size(), sluice::Location::host(), "b");
  c.register_memory(mc.data(), mc.size(), sluice::Location::host(), "c");
  sluice::Endpoint eb = a.connect(b.local_info());
  auto accb = b.accept(5s);
  sluice::Endpoint ec = a.connect(c.local_info());
  auto accc = c.accept(5s);
  ASSERT_TRUE(accb && accc);
  ASSERT_EQ(eb.transport(), "shm");
  auto rb = eb.remote_region("b");
  auto rc = ec.remote_region("c");
  ASSERT_TRUE(rb && rc);
  // c's region is described before the hold (the hold covers every engine of the process).
  ASSERT_TRUE(ec.read({{hc, 0, *rc, 0, 4096}}).wait().ok());

  HoldDescribes hold;
  sluice::Future fb = eb.read({{ha, 0, *rb, 0, mb.size()}});
  sluice::Future fc = ec.read({{hc, 0, *rc, 0, mc.size()}});
  ASSERT_TRUE(fc.wait_for(20s)) << "a read from c waited behind a read whose peer (b) does not answer";
  EXPECT_TRUE(fc.status().ok()) << fc.status().message;
  EXPECT_FALSE(fb.test()) << "b's read completed although b never described its region";
  EXPECT_EQ(std::memcmp(mc.data(), lc.data(), mc.size()), 0);
  hold.release();
  ASSERT_TRUE(fb.wait_for(20s));
  EXPECT_TRUE(fb.status().ok()) << fb.status().message;
  EXPECT_EQ(std::memcmp(mb.data(), la.data(), mb.size()), 0);
}

// Reads parked on a description that does not come, and more queued behind them: close()
// returns and completes them all with an error while the peer still does not answer.
TEST(ShmCopyPool, CloseCompletesParkedLanes) {
  sluice::Engine a(pool_config(1)), b(pool_config(1));
  std::vector<uint8_t> mb(1 << 16), la(1 << 16, 0);
  auto ha = a.register_memory(la.data(), la.size());
  b.register_memory(mb.data(), mb.size(), sluice::Location::host(), "b");
  sluice::Endpoint eb = a.connect(b.local_info());
  auto accb = b.accept(5s);
  ASSERT_TRUE(accb);
  auto rb = eb.remote_region("b");
  ASSERT_TRUE(rb);
  HoldDescribes hold;
  std::vector<sluice::Future> fs;
  for (int i = 0; i < 8; ++i) fs.push_back(eb.read({{ha, i * 4096ull, *rb, i * 4096ull, 4096}}));
  std::this_thread::sleep_for(50ms);  // let the pool reach them (the test holds either way)
  std::atomic<bool> closed{false};
  std::thread closer([&] {
    eb.close();
    closed = true;
  });
  for (auto& f : fs) {
    ASSERT_TRUE(f.wait_for(20s)) << "a read parked on a region description outlived close()";
    EXPECT_FALSE(f.status().ok());
  }
  auto until = std::chrono::steady_clock::now() + 20s;
  while (!closed && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(closed.load()) << "close() waited for a peer that does not answer";
  hold.release();
  closer.join();
}

// Fairness: x has a deep queue of slow reads (every copy of its endpoint waits 20 ms first, the
// test knob); a read on y submitted after all of them runs after a few of x's, not after the
// whole queue (endpoints take turns on the pool, one copy thread here).
TEST(ShmCopyPool, DeepQueueDoesNotStarveAnotherEndpoint) {
  constexpr int kDeep = 50;
  sluice::Engine a(pool_config(1)), x(pool_config(1)), y(pool_config(1));
  std::vector<uint8_t> mx(kDeep * 1024), my(4096), la(kDeep * 1024, 0), ly(4096, 0);
  fill_pattern(my.data(), my.size(), 3);
  auto ha = a.register_memory(la.data(), la.size());
  auto hy = a.register_memory(ly.data(), ly.size());
  x.register_memory(mx.data(), mx.size(), sluice::Location::host(), "x");
  y.register_memory(my.data(), my.size(), sluice::Location::host(), "y");
  ::setenv("SLUICE_SHM_TEST_COPY_DELAY_MS", "20", 1);
  sluice::Endpoint ex = a.connect(x.local_info());
  ::unsetenv("SLUICE_SHM_TEST_COPY_DELAY_MS");  // read as the endpoint was made: x's only
  auto accx = x.accept(5s);
  sluice::Endpoint ey = a.connect(y.local_info());
  auto accy = y.accept(5s);
  ASSERT_TRUE(accx && accy);
  auto rx = ex.remote_region("x");
  auto ry = ey.remote_region("y");
  ASSERT_TRUE(rx && ry);
  // Both regions described first, so every lane below only copies.
  ASSERT_TRUE(ex.read({{ha, 0, *rx, 0, 1024}}).wait().ok());
  ASSERT_TRUE(ey.read({{hy, 0, *ry, 0, 1024}}).wait().ok());
  std::vector<sluice::Future> fx;
  for (int i = 0; i < kDeep; ++i) fx.push_back(ex.read({{ha, i * 1024ull, *rx, i * 1024ull, 1024}}));
  sluice::Future fy = ey.read({{hy, 0, *ry, 0, my.size()}});
  ASSERT_TRUE(fy.wait_for(30s));
  EXPECT_TRUE(fy.status().ok()) << fy.status().message;
  int pending = 0;
  for (auto& f : fx) pending += !f.test();
  EXPECT_GE(pending, kDeep / 2) << "y's read waited for " << kDeep - pending << " of x's " << kDeep
                                << " queued reads (endpoints must take turns on the pool)";
  for (auto& f : fx) EXPECT_TRUE(f.wait().ok());
  EXPECT_EQ(std::memcmp(my.data(), ly.data(), my.size()), 0);
}

// shm.inline_max: a small operation is copied on the submitting thread, so its future is done
// when read() returns; a larger one (or any, with inline_max 0) goes to the pool, whose copy
// the test knob holds for 1 s, so it is not done yet. No timing is asserted: only which
// thread copied.
TEST(ShmCopyPool, SmallOperationsAreCopiedOnTheSubmittingThread) {
  for (const char* inline_max : {"65536", "0"}) {
    SCOPED_TRACE(std::string("shm.inline_max ") + inline_max);
    sluice::EngineConfig c = pool_config(1);
    c.options["shm.inline_max"] = inline_max;
    sluice::Engine a(c), b(c);
    std::vector<uint8_t> remote(256 << 10), local(256 << 10, 0);
    fill_pattern(remote.data(), remote.size(), 5);
    auto h = a.register_memory(local.data(), local.size());
    b.register_memory(remote.data(), remote.size(), sluice::Location::host(), "r");
    ::setenv("SLUICE_SHM_TEST_COPY_DELAY_MS", "1000", 1);
    sluice::Endpoint ep = a.connect(b.local_info());
    ::unsetenv("SLUICE_SHM_TEST_COPY_DELAY_MS");
    auto acc = b.accept(5s);
    ASSERT_TRUE(acc);
    auto r = ep.remote_region("r");
    ASSERT_TRUE(r);
    ASSERT_TRUE(ep.read({{h, 0, *r, 0, 4096}}).wait().ok());  // described: copies only from here
    sluice::Future small = ep.read({{h, 0, *r, 0, 64 << 10}});
    const bool small_done = small.test();
    sluice::Future big = ep.read({{h, 64 << 10, *r, 64 << 10, 128 << 10}});
    const bool big_done = big.test();
    EXPECT_EQ(small_done, std::string(inline_max) != "0") << "64 KiB read done when read() returned";
    EXPECT_FALSE(big_done) << "a 128 KiB read was copied on the submitting thread";
    ASSERT_TRUE(small.wait().ok());
    ASSERT_TRUE(big.wait().ok());
    EXPECT_EQ(std::memcmp(local.data(), remote.data(), 192 << 10), 0);
  }
}

// A large SEND landing in a posted recv is copied in parts (shm.send_split_min) by the
// receiving thread and the pool together: every byte lands once, in place, and nothing past
// the recv's capacity is written (a truncated message included); a message that comes before
// its recv (stashed) is copied as before.
TEST(ShmCopyPool, LargeSendsAreCopiedInParts) {
  sluice::EngineConfig c = pool_config(2);
  c.options["shm.send_split_min"] = "64K";  // parts of 32 KiB and up: many parts per message
  sluice::Engine a(c), b(c);
  constexpr uint64_t kMax = (8 << 20) + 4096;
  std::vector<uint8_t> src(kMax), dst(kMax + 4096);
  auto hs = a.register_memory(src.data(), src.size());
  auto hd = b.register_memory(dst.data(), dst.size());
  sluice::Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  ASSERT_EQ(ep.transport(), "shm");
  sluice::Endpoint peer = *acc;
  int seed = 1;
  for (uint64_t n : {uint64_t(64 << 10), uint64_t((64 << 10) + 1), uint64_t((1 << 20) + 77), uint64_t((8 << 20) + 4095)}) {
    for (uint64_t cap : {n, n + 1000, n / 2 + 3}) {  // exact, larger, truncated
      fill_pattern(src.data(), n, ++seed);
      std::fill(dst.begin(), dst.end(), 0xEE);
      auto r = peer.recv(hd, 0, cap);
      auto s = ep.send(hs, 0, n);
      ASSERT_TRUE(r.wait_for(30s) && s.wait_for(30s)) << n << " into " << cap;
      const uint64_t got = std::min(n, cap);
      if (cap >= n) {
        EXPECT_TRUE(r.status().ok()) << r.status().to_string();
        EXPECT_TRUE(s.status().ok()) << s.status().to_string();
      } else {
        EXPECT_FALSE(r.status().ok()) << "a " << n << "-byte message into a " << cap << "-byte recv";
      }
      EXPECT_EQ(0, std::memcmp(dst.data(), src.data(), got)) << n << " into " << cap;
      EXPECT_TRUE(std::all_of(dst.begin() + got, dst.end(), [](uint8_t v) { return v == 0xEE; }))
          << "bytes written past " << got << " (" << n << " into " << cap << ")";
    }
  }
  // Before its recv: stashed whole, then copied into the recv.
  const uint64_t n = (4 << 20) + 5;
  fill_pattern(src.data(), n, 99);
  auto s = ep.send(hs, 0, n);
  ASSERT_TRUE(s.wait_for(30s) && s.status().ok()) << s.status().to_string();
  auto r = peer.recv(hd, 0, n);
  ASSERT_TRUE(r.wait_for(30s) && r.status().ok()) << r.status().to_string();
  EXPECT_EQ(0, std::memcmp(dst.data(), src.data(), n));
}

// Many large SENDs in flight at once, from plain (process_vm_readv) and engine-allocated
// (mapped memfd) memory: the receiving thread hands each message's parts to the pool and goes
// on to the next message without waiting, so parts of many messages are copied at once and
// their recvs complete out of order. Every message lands whole in its own recv (a truncated
// one up to its recv's capacity), nothing is written past a recv, small eager messages
// between them keep their places, and messages that came before their recvs are stashed.
TEST(ShmCopyPool, ManyLargeSendsInFlightLandWholeInTheirRecvs) {
  sluice::EngineConfig c = pool_config(2);
  c.options["shm.send_split_min"] = "64K";
  sluice::Engine a(c), b(c);
  sluice::Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  ASSERT_EQ(ep.transport(), "shm");
  sluice::Endpoint peer = *acc;
  const std::vector<uint64_t> sizes = {(1 << 20) + 77, 300 << 10, 4096, 2 << 20, (64 << 10) + 1, 130 << 10, 1};
  constexpr int kMessages = 42;
  constexpr uint64_t kGap = 4096;  // untouched bytes after every recv's capacity
  uint64_t total = 0;
  for (int i = 0; i < kMessages; ++i) total += sizes[i % sizes.size()] + kGap;
  for (bool memfd : {false, true}) {
    SCOPED_TRACE(memfd ? "memfd" : "plain");
    sluice::Allocation sa, da;
    std::vector<uint8_t> sv, dv;
    uint8_t *src, *dst;
    sluice::MemoryHandle hs, hd;
    if (memfd) {
      sa = a.allocate(total, sluice::Location::host(), "src");
      da = b.allocate(total, sluice::Location::host(), "dst");
      src = static_cast<uint8_t*>(sa.ptr), dst = static_cast<uint8_t*>(da.ptr);
      hs = sa.handle, hd = da.handle;
    } else {
      sv.resize(total), dv.resize(total);
      src = sv.data(), dst = dv.data();
      hs = a.register_memory(src, total), hd = b.register_memory(dst, total);
    }
    fill_pattern(src, total, memfd ? 7 : 8);
    std::memset(dst, 0xEE, total);
    std::vector<uint64_t> off(kMessages), cap(kMessages);
    for (uint64_t i = 0, o = 0; i < kMessages; ++i) {
      const uint64_t n = sizes[i % sizes.size()];
      off[i] = o;
      cap[i] = i % 9 == 4 ? n / 2 + 1 : n;  // some truncated
      o += n + kGap;
    }
    // The first few messages go before their recvs (stashed), the rest into posted recvs.
    constexpr int kEarly = 3;
    std::vector<sluice::Future> sends, recvs;
    for (int i = 0; i < kEarly; ++i) sends.push_back(ep.send(hs, off[i], sizes[i % sizes.size()]));
    ASSERT_TRUE(sends.back().wait_for(30s));
    for (int i = 0; i < kMessages; ++i) recvs.push_back(peer.recv(hd, off[i], cap[i]));
    for (int i = kEarly; i < kMessages; ++i) sends.push_back(ep.send(hs, off[i], sizes[i % sizes.size()]));
    for (int i = 0; i < kMessages; ++i) {
      const uint64_t n = sizes[i % sizes.size()];
      ASSERT_TRUE(recvs[i].wait_for(30s) && sends[i].wait_for(30s)) << "message " << i;
      if (cap[i] >= n) {
        EXPECT_TRUE(recvs[i].status().ok()) << i << ": " << recvs[i].status().to_string();
        EXPECT_TRUE(sends[i].status().ok()) << i << ": " << sends[i].status().to_string();
      } else {
        EXPECT_EQ(recvs[i].status().code, sluice::ErrorCode::kTruncated) << i << ": " << recvs[i].status().to_string();
      }
      const uint64_t got = std::min(n, cap[i]);
      EXPECT_EQ(0, std::memcmp(dst + off[i], src + off[i], got)) << "message " << i << " (" << n << " bytes)";
      const uint64_t end = i + 1 < kMessages ? off[i + 1] : total;
      EXPECT_TRUE(std::all_of(dst + off[i] + got, dst + end, [](uint8_t v) { return v == 0xEE; }))
          << "bytes written past the " << got << " bytes of message " << i;
    }
  }
}

// The receiving endpoint closes while a large SEND's copy is about to be cut into parts (a
// test-only delay holds it there): the recv fails, nothing waits for parts that never run,
// and nothing lands in the recv's buffer afterwards.
TEST(ShmCopyPool, CloseDuringASplitSendFailsItWithoutAHang) {
  EnvScope delay("SLUICE_SHM_TEST_COPY_DELAY_MS", "400");
  sluice::EngineConfig c = pool_config(2);
  c.options["shm.send_split_min"] = "64K";
  sluice::Engine a(c), b(c);
  constexpr uint64_t kBytes = 4 << 20;
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0);
  fill_pattern(src.data(), src.size(), 4);
  auto hs = a.register_memory(src.data(), src.size());
  auto hd = b.register_memory(dst.data(), dst.size());
  sluice::Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  sluice::Endpoint peer = *acc;
  auto r = peer.recv(hd, 0, kBytes);
  auto s = ep.send(hs, 0, kBytes);
  std::this_thread::sleep_for(150ms);  // the copy has begun (counted) and sleeps
  peer.close();
  ASSERT_TRUE(r.wait_for(20s)) << "the recv never completed after its endpoint closed";
  EXPECT_FALSE(r.status().ok());
  std::vector<uint8_t> at_failure = dst;
  ASSERT_TRUE(s.wait_for(20s)) << "the send never completed";
  EXPECT_FALSE(s.status().ok());
  std::this_thread::sleep_for(600ms);
  EXPECT_EQ(0, std::memcmp(at_failure.data(), dst.data(), kBytes)) << "a part landed after the recv failed";
}
