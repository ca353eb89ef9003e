// In-process engine tests over tcp and shm: every operation, accept, threads, close.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <ctime>

#include "loopback.hpp"
#include "transport/shm/shm_test_ring.hpp"
#include "transports_under_test.hpp"

using namespace sluice;
using namespace sluice_test;

TEST_P(LoopbackTest, WriteThenReadBack) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 50; ++i) {
    uint64_t len = 1 + rng() % (kBytes / 4);
    uint64_t lo = rng() % (kBytes / 2 - len + 1);
    uint64_t ro = rng() % (kBytes - len + 1);
    fill_random(la_.data() + lo, len, rng);
    std::vector<uint8_t> before_b = lb_;
    ASSERT_TRUE(ep_.write({{ha_, lo, rb_, ro, len}}).wait().ok());
    ASSERT_EQ(0, std::memcmp(lb_.data() + ro, la_.data() + lo, len));
    // Nothing outside [ro, ro+len) changed.
    ASSERT_EQ(0, std::memcmp(lb_.data(), before_b.data(), ro));
    ASSERT_EQ(0, std::memcmp(lb_.data() + ro + len, before_b.data() + ro + len, kBytes - ro - len));
    // Read it back into the other half of the local buffer.
    uint64_t back = kBytes / 2;
    std::memset(la_.data() + back, 0xEE, kBytes / 2);
    auto f = ep_.read({{ha_, back, rb_, ro, len}});
    ASSERT_TRUE(f.wait().ok());
    EXPECT_EQ(f.bytes(), len);
    ASSERT_EQ(0, std::memcmp(la_.data() + back, lb_.data() + ro, len));
    if (back + len < kBytes) {
      ASSERT_EQ(la_[back + len], 0xEE);
    }
  }
}

TEST_P(LoopbackTest, WriteWithImmAndSendRecv) {
  fill_pattern(la_.data(), 4096, 5);
  auto imm = peer_.imm_recv();
  auto f = ep_.write_with_imm({{ha_, 0, rb_, 100, 4096}}, 0xC0FFEE);
  ASSERT_TRUE(f.wait().ok());
  ASSERT_TRUE(imm.wait_for(5s));
  EXPECT_TRUE(imm.status().ok());
  EXPECT_EQ(imm.imm(), 0xC0FFEEu);
  EXPECT_EQ(0, std::memcmp(lb_.data() + 100, la_.data(), 4096));

  // Two-sided, both directions, on the accepted endpoint too.
  auto r = peer_.recv(hb_, 0, 1000);
  auto s = ep_.send(ha_, 0, 777);
  ASSERT_TRUE(s.wait().ok());
  ASSERT_TRUE(r.wait().ok());
  EXPECT_EQ(r.bytes(), 777u);
  EXPECT_EQ(0, std::memcmp(lb_.data(), la_.data(), 777));
  auto r2 = ep_.recv(ha_, 5000, 64);
  ASSERT_TRUE(peer_.send(hb_, 64, 64).wait().ok());
  ASSERT_TRUE(r2.wait().ok());
  EXPECT_EQ(0, std::memcmp(la_.data() + 5000, lb_.data() + 64, 64));
}

TEST_P(LoopbackTest, ConcurrentThreadsOnTwoEndpoints) {
  auto ep2 = a_->connect(b_->listen_address());
  ASSERT_TRUE(b_->accept(5s).has_value());
  auto rb2 = ep2.remote_region("b");
  ASSERT_TRUE(rb2.has_value());
  constexpr int kThreads = 4;
  const uint64_t window = kBytes / kThreads;
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      try {
      Endpoint ep = t % 2 ? ep2 : ep_;
      RemoteHandle rh = t % 2 ? *rb2 : rb_;
      std::mt19937_64 rng(100 + t);
      std::vector<uint8_t> back(window);
      auto hback = a_->register_memory(back.data(), back.size());
      uint64_t base = t * window;
      for (int i = 0; i < 40; ++i) {
        uint64_t len = 1 + rng() % (window / 2);
        uint64_t off = rng() % (window - len + 1);
        fill_random(la_.data() + base + off, len, rng);
        if (!ep.write({{ha_, base + off, rh, base + off, len}}).wait().ok()) failures++;
        if (!ep.read({{hback, 0, rh, base + off, len}}).wait().ok()) failures++;
        if (std::memcmp(back.data(), la_.data() + base + off, len) != 0) failures++;
      }
      a_->unregister_memory(hback);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "thread " << t << ": " << e.what();
        failures++;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(LoopbackTest, ManyOutstandingSmallOps) {
  constexpr int kOps = 10000;
  constexpr uint64_t kSize = 64;  // 10000 * 64 = 640 KB < kBytes
  fill_pattern(la_.data(), kOps * kSize, 99);
  std::vector<Future> fs;
  fs.reserve(kOps);
  for (int i = 0; i < kOps; ++i) fs.push_back(ep_.write({{ha_, i * kSize, rb_, (kOps - 1 - i) * kSize, kSize}}));
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok());
  for (int i = 0; i < kOps; i += 997)
    ASSERT_EQ(0, std::memcmp(lb_.data() + (kOps - 1 - i) * kSize, la_.data() + i * kSize, kSize)) << i;
  for (int i = 0; i < kOps; ++i)
    ASSERT_EQ(0, std::memcmp(lb_.data() + (kOps - 1 - i) * kSize, la_.data() + i * kSize, kSize)) << i;
}

TEST_P(LoopbackTest, OnCompleteCallbacks) {
  std::atomic<int> called{0};
  std::vector<Future> fs;
  for (int i = 0; i < 100; ++i) {
    fs.push_back(ep_.write({{ha_, 0, rb_, 0, 512}}));
    fs.back().on_complete([&](const Status& st) {
      if (st.ok()) called++;
    });
  }
  for (auto& f : fs) f.wait();
  for (int i = 0; i < 100 && called.load() < 100; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(called.load(), 100);
  // Already complete: runs on this thread at once.
  int now = 0;
  fs[0].on_complete([&](const Status&) { now = 1; });
  EXPECT_EQ(now, 1);
}

TEST_P(LoopbackTest, EngineAllocatedMemoryBothSides) {
  auto aa = a_->allocate(3 << 20);
  auto ab = b_->allocate(3 << 20, Location::host(), "alloc");
  ASSERT_NE(aa.ptr, nullptr);
  ASSERT_GE(aa.length, 3u << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(aa.ptr) % 4096, 0u);
  for (uint64_t i = 0; i < ab.length; i += 4096) ASSERT_EQ(static_cast<uint8_t*>(ab.ptr)[i], 0) << "not zero filled";
  ep_.refresh_remote_regions();
  auto rh = ep_.remote_region("alloc");
  ASSERT_TRUE(rh.has_value());
  std::mt19937_64 rng(3);
  auto* pa = static_cast<uint8_t*>(aa.ptr);
  auto* pb = static_cast<uint8_t*>(ab.ptr);
  fill_random(pa, aa.length, rng);
  ASSERT_TRUE(ep_.write({{aa.handle, 12345, *rh, 777, 2 << 20}}).wait().ok());
  ASSERT_EQ(0, std::memcmp(pb + 777, pa + 12345, 2 << 20));
  fill_random(pb, 4096, rng);
  ASSERT_TRUE(ep_.read({{aa.handle, 1, *rh, 0, 4096}}).wait().ok());
  ASSERT_EQ(0, std::memcmp(pa + 1, pb, 4096));
  a_->free(aa);
}

TEST_P(LoopbackTest, CloseEngineCancelsPendingRecvAndImm) {
  auto r = ep_.recv(ha_, 0, 100);
  auto imm = ep_.imm_recv();
  a_->close();
  ASSERT_TRUE(r.wait_for(5s));
  ASSERT_TRUE(imm.wait_for(5s));
  EXPECT_EQ(r.status().code, ErrorCode::kCancelled);
  EXPECT_EQ(imm.status().code, ErrorCode::kCancelled);
  EXPECT_NE(code_of([&] { ep_.write({{ha_, 0, rb_, 0, 8}}); }), ErrorCode::kOk);
}

TEST_P(LoopbackTest, EndpointCloseCancelsAndPeerNotices) {
  auto r = ep_.recv(ha_, 0, 100);
  auto pr = peer_.recv(hb_, 0, 100);
  ep_.close();
  ASSERT_TRUE(r.wait_for(5s));
  EXPECT_EQ(r.status().code, ErrorCode::kCancelled);
  EXPECT_FALSE(ep_.connected());
  EXPECT_NE(code_of([&] { ep_.send(ha_, 0, 8); }), ErrorCode::kOk);
  // The peer's pending recv fails too (it never waits forever).
  ASSERT_TRUE(pr.wait_for(15s)) << "peer's recv still pending after the endpoint closed";
  EXPECT_FALSE(pr.status().ok());
  // The engines still work: a new endpoint.
  auto ep2 = a_->connect(b_->local_info());
  ASSERT_TRUE(ep2.write({{ha_, 0, rb_, 0, 4096}}).wait().ok());
}

TEST_P(LoopbackTest, UnregisterWaitsForInflightAndThenRejects) {
  std::vector<uint8_t> big(8 << 20);
  auto h = a_->register_memory(big.data(), big.size());
  (void)b_->allocate(8 << 20, Location::host(), "big");
  ep_.refresh_remote_regions();
  auto rh = ep_.remote_region("big");
  ASSERT_TRUE(rh.has_value());
  std::vector<Future> fs;
  // Disjoint 1 MiB pieces: overlapping concurrent writes would be a data race on the target
  // that TSan (rightly) reports, and its reporting alone then stalls the channel for seconds.
  for (uint64_t i = 0; i < 8; ++i) fs.push_back(ep_.write({{h, i << 20, *rh, i << 20, 1 << 20}}));
  a_->unregister_memory(h);
  // unregister returned: every op that used the region is finished.
  for (auto& f : fs) EXPECT_TRUE(f.test()) << "unregister_memory returned while an operation used the region";
  for (auto& f : fs) EXPECT_TRUE(f.status().ok()) << f.status().to_string();
  EXPECT_EQ(code_of([&] { ep_.write({{h, 0, *rh, 0, 8}}); }), ErrorCode::kUnknownHandle);
  EXPECT_EQ(code_of([&] { a_->unregister_memory(h); }), ErrorCode::kUnknownHandle);
}

TEST_P(LoopbackTest, AcceptTimesOutWithoutPeers) {
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(b_->accept(200ms).has_value());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 150ms);
}

TEST_P(LoopbackTest, ConcurrentSendersOnOneEndpoint) {
  // Several threads send on the same endpoint: every message arrives intact, each thread's
  // messages in its own order, and nothing is mistaken for a protocol error.
  constexpr int kThreads = 4, kPer = 150;
  constexpr uint64_t kMsg = 16;
  std::vector<Future> recvs;
  for (int i = 0; i < kThreads * kPer; ++i) recvs.push_back(peer_.recv(hb_, i * kMsg, kMsg));
  std::vector<std::thread> ts;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      try {
      std::vector<uint64_t> src(kPer * 2);
      auto h = a_->register_memory(src.data(), src.size() * 8);
      std::vector<Future> fs;
      for (int i = 0; i < kPer; ++i) {
        src[2 * i] = static_cast<uint64_t>(t);
        src[2 * i + 1] = static_cast<uint64_t>(i);
        try {
          fs.push_back(ep_.send(h, 16 * i, kMsg));
        } catch (const Error&) {
          failures++;
        }
      }
      for (auto& f : fs)
        if (!f.wait().ok()) failures++;
      a_->unregister_memory(h);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "thread " << t << ": " << e.what();
        failures++;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
  std::vector<int> next(kThreads, 0);
  for (int i = 0; i < kThreads * kPer; ++i) {
    ASSERT_TRUE(recvs[i].wait_for(5s)) << "recv " << i;
    ASSERT_TRUE(recvs[i].status().ok()) << recvs[i].status().to_string();
    uint64_t v[2];
    std::memcpy(v, lb_.data() + i * kMsg, 16);
    ASSERT_LT(v[0], static_cast<uint64_t>(kThreads));
    EXPECT_EQ(v[1], static_cast<uint64_t>(next[v[0]]++)) << "thread " << v[0] << "'s messages out of order";
  }
}

TEST_P(LoopbackTest, ConcurrentReadersOnOneEndpoint) {
  constexpr int kThreads = 4;
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      try {
      std::vector<uint8_t> dst(64 * 1024);
      auto h = a_->register_memory(dst.data(), dst.size());
      std::mt19937_64 rng(t);
      for (int i = 0; i < 100; ++i) {
        // Several multi-piece reads in flight per thread, so submissions interleave.
        constexpr int kInFlight = 8;
        const uint64_t slot = dst.size() / kInFlight;
        std::vector<Future> fs;
        std::vector<std::pair<uint64_t, uint64_t>> what;
        for (int k = 0; k < kInFlight; ++k) {
          uint64_t len = 2 + rng() % (slot - 1);
          uint64_t off = rng() % (kBytes - len + 1);
          fs.push_back(ep_.read({{h, k * slot, rb_, off, len / 2}, {h, k * slot + len / 2, rb_, off + len / 2, len - len / 2}}));
          what.push_back({off, len});
        }
        for (int k = 0; k < kInFlight; ++k) {
          Status st = fs[k].wait();
          if (!st.ok() || std::memcmp(dst.data() + k * slot, lb_.data() + what[k].first, what[k].second) != 0) failures++;
        }
      }
      a_->unregister_memory(h);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "thread " << t << ": " << e.what();
        failures++;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(ep_.connected());
}

// tcp validates on the target; shm never asks the owner, so the owner's lease table
// (transport/common/lease_table.hpp) is what keeps a stale handle out.
class PeerUnregister : public LoopbackTest {};

TEST_P(PeerUnregister, PeerUnregisteredRegionIsRefused) {
  // The peer stops exposing a region; our stale handle must not reach its memory any more.
  std::vector<uint8_t> victim(64 * 1024);
  fill_pattern(victim.data(), victim.size(), 3);
  auto snap = victim;
  auto hv = b_->register_memory(victim.data(), victim.size(), Location::host(), "victim");
  ep_.refresh_remote_regions();
  auto rv = ep_.remote_region("victim");
  ASSERT_TRUE(rv.has_value());
  ASSERT_TRUE(ep_.read({{ha_, 0, *rv, 0, 4096}}).wait().ok());
  b_->unregister_memory(hv);
  Status st;
  try {
    st = ep_.write({{ha_, 0, *rv, 0, 4096}}).wait();
  } catch (const Error& e) {
    st = e.status();
  }
  EXPECT_FALSE(st.ok()) << "a write to an unregistered peer region succeeded";
  EXPECT_EQ(victim, snap) << "a write reached a region its owner had unregistered";
  // After a refresh the handle is gone from our table and refused at once.
  ep_.refresh_remote_regions();
  EXPECT_FALSE(ep_.remote_region("victim").has_value());
  EXPECT_EQ(code_of([&] { ep_.write({{ha_, 0, *rv, 0, 16}}); }), ErrorCode::kUnknownHandle);
}

INSTANTIATE_TEST_SUITE_P(Conformance, PeerUnregister, ::testing::ValuesIn(transports_under_test()), transport_name);

class UnexpectedBound : public ::testing::TestWithParam<std::string> {};

TEST_P(UnexpectedBound, SendsBeyondTheBufferFailAndLaterMessagesStillMatch) {
  EngineConfig ca = engine_config(GetParam(), 2, 10s);
  EngineConfig cb = engine_config(GetParam(), 2, 10s);
  cb.max_unexpected_bytes = 64 * 1024;
  // Every SEND waits for the receiver here (an eager one completes once queued, within the
  // receiver's shm.eager_credit: ShmEager below).
  ca.options["shm.eager_max"] = "0";
  Engine a(ca);
  Engine b(cb);
  std::vector<uint8_t> la(256 * 1024), lb(256 * 1024, 0);
  std::mt19937_64 rng(9);
  fill_random(la.data(), la.size(), rng);
  auto ha = a.register_memory(la.data(), la.size());
  auto hb = b.register_memory(lb.data(), lb.size());
  Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  // No recv posted: two 32 KiB messages fit the 64 KiB buffer, the third does not.
  std::vector<Future> sends;
  for (int i = 0; i < 3; ++i) sends.push_back(ep.send(ha, i * 32768, 32768));
  EXPECT_TRUE(sends[0].wait().ok());
  EXPECT_TRUE(sends[1].wait().ok());
  Status third = sends[2].wait();
  EXPECT_FALSE(third.ok());
  EXPECT_EQ(third.code, ErrorCode::kRemoteError) << third.to_string();
  // The recvs match in order; the one matched with the refused message fails.
  std::vector<Future> recvs;
  for (int i = 0; i < 3; ++i) recvs.push_back(peer->recv(hb, i * 32768, 32768));
  EXPECT_TRUE(recvs[0].wait().ok());
  EXPECT_TRUE(recvs[1].wait().ok());
  EXPECT_FALSE(recvs[2].wait().ok());
  EXPECT_EQ(0, std::memcmp(lb.data(), la.data(), 65536));
  // The budget was returned: matching continues normally.
  auto r = peer->recv(hb, 100000, 50000);
  ASSERT_TRUE(ep.send(ha, 1000, 50000).wait().ok());
  ASSERT_TRUE(r.wait().ok());
  EXPECT_EQ(0, std::memcmp(lb.data() + 100000, la.data() + 1000, 50000));
  EXPECT_TRUE(ep.connected());
}

INSTANTIATE_TEST_SUITE_P(Conformance, UnexpectedBound, ::testing::ValuesIn(transports_under_test()), transport_name);

// shm's eager-SEND grant reaches the sender on the control channel, in order with the
// receiver's own messages: once an 8-byte message the receiver sent afterwards arrived (at
// `at` in both regions), the sender holds the grant (and any credit given back before it).
void wait_for_grant(Endpoint& sender, Endpoint& receiver, MemoryHandle hs, MemoryHandle hr, uint64_t at) {
  auto r = sender.recv(hs, at, 8);
  ASSERT_TRUE(receiver.send(hr, at, 8).wait().ok());
  ASSERT_TRUE(r.wait().ok());
}

// A SEND out of the sender's engine-allocated (memfd) memory: once the receiver has mapped
// that region (described in the background after the first such SEND) it copies with memcpy
// out of the mapping rather than process_vm_readv; into a posted recv (split across the copy
// pool from shm.send_split_min) or into the stash. Offsets and sizes that are not page
// multiples, up to the region's last byte: the mapping's offset must be the sender's.
TEST(ShmSend, FromEngineMemoryLandsWholeWhicheverWayItIsCopied) {
  EngineConfig cfg = engine_config("shm", 2, 10s);
  cfg.options["shm.eager_max"] = "0";  // every SEND a rendezvous, the path under test
  Engine a(cfg);
  Engine b(cfg);
  constexpr uint64_t kLen = 8 << 20;
  auto sa = a.allocate(kLen);
  auto sb = b.allocate(kLen);
  ASSERT_GE(sa.fd, 0);
  std::mt19937_64 rng(21);
  Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  struct Shape {
    uint64_t src_off, dst_off, len;
    bool recv_first;
  };
  const Shape shapes[] = {{7, 0, 3 * (1 << 20) + 5, true},    {4096, 13, (1 << 20) - 1, false},
                          {kLen - (2 << 20), 1, 2 << 20, true}, {kLen - 1, kLen - 1, 1, false},
                          {123, 4567, 5 << 20, false},        {0, 0, kLen, true}};
  for (int round = 0; round < 3; ++round) {  // round 0 may go by process_vm_readv, later ones by the mapping
    for (const Shape& s : shapes) {
      auto* src = static_cast<uint8_t*>(sa.ptr);
      auto* dst = static_cast<uint8_t*>(sb.ptr);
      fill_random(src, kLen, rng);
      std::memset(dst, 0, kLen);
      Future r;
      if (s.recv_first) r = peer->recv(sb.handle, s.dst_off, s.len);
      ASSERT_TRUE(ep.send(sa.handle, s.src_off, s.len).wait().ok()) << "round " << round << " len " << s.len;
      if (!s.recv_first) r = peer->recv(sb.handle, s.dst_off, s.len);
      ASSERT_TRUE(r.wait().ok()) << r.status().to_string();
      ASSERT_EQ(0, std::memcmp(dst + s.dst_off, src + s.src_off, s.len)) << "round " << round << " len " << s.len;
      EXPECT_TRUE(std::all_of(dst, dst + s.dst_off, [](uint8_t c) { return c == 0; })) << "bytes before the recv";
      EXPECT_TRUE(std::all_of(dst + s.dst_off + s.len, dst + kLen, [](uint8_t c) { return c == 0; })) << "bytes after";
    }
  }
}

// Operations between shm.inline_max and shm.inline_split_max, striped over two lanes: the
// submitting thread copies the first lane and the copy pool the other. Reads and writes, of
// engine memory (mapped: memcpy) and of registered memory (process_vm_readv, PULL_WRITE), at
// sizes on both sides of each threshold and at odd offsets: every byte lands, none outside.
TEST(ShmCopy, OperationsSplitBetweenTheSubmitterAndThePoolLandWhole) {
  EngineConfig cfg = engine_config("shm", 2, 10s);
  cfg.stripe_threshold = 64 << 10;  // two lanes from 64 KiB on
  Engine a(cfg);
  Engine b(cfg);
  constexpr uint64_t kLen = 4 << 20;
  auto ma = a.allocate(kLen);
  auto mb = b.allocate(kLen, Location::host(), "mapped");
  std::vector<uint8_t> ra(kLen), rb(kLen);
  auto ha = a.register_memory(ra.data(), kLen);
  b.register_memory(rb.data(), kLen, Location::host(), "plain");
  Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  std::mt19937_64 rng(33);
  struct Side {
    MemoryHandle local;
    uint8_t* lp;
    RemoteHandle remote;
    uint8_t* rp;
  };
  const Side sides[] = {{ma.handle, static_cast<uint8_t*>(ma.ptr), *ep.remote_region("mapped"), static_cast<uint8_t*>(mb.ptr)},
                        {ha, ra.data(), *ep.remote_region("plain"), rb.data()}};
  const uint64_t sizes[] = {(64 << 10) + 1, 300 << 10, (1 << 20) - 7, 1 << 20, (1 << 20) + 1, (3 << 20) + 3};
  for (int round = 0; round < 2; ++round)  // round 0 may find the peer's regions not yet described
    for (const Side& sd : sides)
      for (uint64_t n : sizes)
        for (bool rd : {true, false}) {
          fill_random(sd.lp, kLen, rng);
          fill_random(sd.rp, kLen, rng);
          std::vector<uint8_t> lbefore(sd.lp, sd.lp + kLen), rbefore(sd.rp, sd.rp + kLen);
          const uint64_t loff = 13, roff = 4096 + 5;
          Status st = rd ? ep.read({{sd.local, loff, sd.remote, roff, n}}).wait()
                         : ep.write({{sd.local, loff, sd.remote, roff, n}}).wait();
          ASSERT_TRUE(st.ok()) << st.to_string() << (rd ? " read " : " write ") << n;
          const uint8_t* dst = rd ? sd.lp : sd.rp;
          const std::vector<uint8_t>& dst_before = rd ? lbefore : rbefore;
          const uint8_t* src = rd ? rbefore.data() + roff : lbefore.data() + loff;
          const uint64_t doff = rd ? loff : roff;
          ASSERT_EQ(0, std::memcmp(dst + doff, src, n)) << (rd ? "read " : "write ") << n << " round " << round;
          EXPECT_EQ(0, std::memcmp(dst, dst_before.data(), doff)) << "bytes before the destination";
          EXPECT_EQ(0, std::memcmp(dst + doff + n, dst_before.data() + doff + n, kLen - doff - n)) << "bytes after it";
        }
}

// shm.take_back: after copying its first lane, the submitting thread copies the op's other
// lanes that no pool thread has started. The engine's one pool thread is held (0.5 s) in another
// endpoint's copy (shm.test_copy_delay_ms on that endpoint only), so a lone 1 MiB read's
// second lane can only be copied by the submitting thread before that: with take_back the read
// is complete when read() returns; without it, it is not (its lane waits for the pool), and it
// completes once the pool is free. Every byte lands either way.
TEST(ShmCopy, TheSubmitterTakesBackLanesThePoolHasNotStarted) {
  for (bool take_back : {true, false}) {
    EngineConfig cfg = engine_config("shm", 2, 10s);
    cfg.stripe_threshold = 64 << 10;         // two lanes
    cfg.options["shm.copy_threads"] = "1";   // one pool thread for both endpoints of `a`
    cfg.options["shm.take_back"] = take_back ? "1" : "0";
    Engine a(cfg), b(cfg), c(cfg);
    constexpr uint64_t kBusy = 2 << 20, kLone = 1 << 20;
    std::vector<uint8_t> la(kBusy), lb(kBusy), lc(kLone), rc(kLone);
    std::mt19937_64 rng(35);
    fill_random(lb.data(), lb.size(), rng);
    fill_random(rc.data(), rc.size(), rng);
    auto ha = a.register_memory(la.data(), la.size());
    auto hc = a.register_memory(lc.data(), lc.size());
    b.register_memory(lb.data(), lb.size(), Location::host(), "busy");
    c.register_memory(rc.data(), rc.size(), Location::host(), "lone");
    ::setenv("SLUICE_SHM_TEST_COPY_DELAY_MS", "500", 1);
    Endpoint slow = a.connect(b.local_info());
    ::unsetenv("SLUICE_SHM_TEST_COPY_DELAY_MS");  // read as the endpoints were made
    auto pb = b.accept(5s);
    Endpoint fast = a.connect(c.local_info());
    auto pc = c.accept(5s);
    ASSERT_TRUE(pb.has_value() && pc.has_value());
    // Each endpoint has its peer's region described before the test (a lane waiting for a
    // description would be parked, not copied).
    ASSERT_TRUE(slow.read({{ha, 0, *slow.remote_region("busy"), 0, 4096}}).wait().ok());
    ASSERT_TRUE(fast.read({{hc, 0, *fast.remote_region("lone"), 0, 4096}}).wait().ok());
    // Above shm.inline_split_max: every lane of it goes to the pool, whose thread sleeps in it.
    Future busy = slow.read({{ha, 0, *slow.remote_region("busy"), 0, kBusy}});
    Future lone = fast.read({{hc, 0, *fast.remote_region("lone"), 0, kLone}});
    EXPECT_EQ(lone.wait_for(0ns), take_back) << "take_back " << take_back;
    ASSERT_TRUE(lone.wait().ok()) << lone.status().to_string();
    EXPECT_EQ(0, std::memcmp(lc.data(), rc.data(), kLone));
    ASSERT_TRUE(busy.wait().ok()) << busy.status().to_string();
    EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), kBusy));
  }
}

// shm.pool_wait_us: the waiter of an operation the copy pool copies polls before it sleeps,
// but only about as long as the copy should take (-1: 20 us + the bytes at 4 GB/s, 85 us for
// 256 KiB). Here every copy of the endpoint first sleeps 300 ms (shm.test_copy_delay_ms), so
// a waiter that kept polling would burn about that much CPU; the bound keeps it to a sliver.
// The bytes land either way, with the poll on and off.
TEST(ShmCopy, AWaiterOfAPoolCopyPollsOnlyAboutAsLongAsTheCopyShouldTake) {
  for (const char* wait : {"-1", "0"}) {
    EngineConfig cfg = engine_config("shm", 2, 10s);
    cfg.options["shm.pool_wait_us"] = wait;
    Engine a(cfg), b(cfg);
    constexpr uint64_t kLen = 256 << 10;  // above shm.inline_max: the pool's
    std::vector<uint8_t> la(kLen), rb(kLen);
    std::mt19937_64 rng(36);
    fill_random(rb.data(), rb.size(), rng);
    auto ha = a.register_memory(la.data(), la.size());
    b.register_memory(rb.data(), rb.size(), Location::host(), "src");
    ::setenv("SLUICE_SHM_TEST_COPY_DELAY_MS", "300", 1);
    Endpoint ep = a.connect(b.local_info());
    ::unsetenv("SLUICE_SHM_TEST_COPY_DELAY_MS");  // read as the endpoint was made
    auto peer = b.accept(5s);
    ASSERT_TRUE(peer.has_value());
    auto src = *ep.remote_region("src");
    ASSERT_TRUE(ep.read({{ha, 0, src, 0, 4096}}).wait().ok());  // described, inline (no pool)
    Future f = ep.read({{ha, 0, src, 0, kLen}});
    timespec c0{}, c1{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(f.wait().ok()) << f.status().to_string();
    const auto waited = std::chrono::steady_clock::now() - t0;
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
    const double cpu_ms = (c1.tv_sec - c0.tv_sec) * 1e3 + (c1.tv_nsec - c0.tv_nsec) / 1e6;
    EXPECT_GE(waited, 250ms) << "the copy's delay did not apply; the test shows nothing";
    EXPECT_LT(cpu_ms, 100.0) << "pool_wait_us " << wait << ": the waiter spent " << cpu_ms << " ms of CPU in a "
                             << std::chrono::duration<double, std::milli>(waited).count() << " ms wait";
    EXPECT_EQ(0, std::memcmp(la.data(), rb.data(), kLen)) << "pool_wait_us " << wait;
  }
}

// The eager ring (shm_eager.cpp): messages of every size from 0 to shm.eager_max, into recvs
// posted before they arrive and into the stash, through a ring small enough (a 1 MiB grant:
// 1 MiB + 64 KiB) that they wrap around it about eight times. Every byte must land in its own
// recv, in order; a send that finds the ring full (or the grant spent) goes in its frame or as
// a rendezvous, and must land just the same. A chunk of 16 messages (512 KiB on average, and
// each chunk received in full, and the credit it gave back seen by the sender, before the
// next) fits the grant and the ring, less the eighth of the grant a receiver may still owe, so
// most must have gone through the ring (the test seam counts them). Without waiting for the
// CREDIT frame, a loaded host sent a chunk as rendezvous now and then (126 of 244 by the ring
// in one of twelve runs two at a time). Run with shm.stream_copy_min at its default (only the
// 64 KiB messages stream into and out of the ring, bulk_copy.hpp) and at 1 (every message
// does, at every offset the random layout gives it).
static void ring_carries_every_size(const char* stream_copy_min) {
  EngineConfig c = engine_config("shm", 2, 10s);
  c.options["shm.eager_credit"] = std::to_string(1 << 20);
  if (stream_copy_min) c.options["shm.stream_copy_min"] = stream_copy_min;
  Engine a(c);
  Engine b(c);
  constexpr uint64_t kLen = 8 << 20;
  std::vector<uint8_t> la(kLen), lb(kLen, 0);
  std::mt19937_64 rng(41);
  fill_random(la.data(), la.size(), rng);
  auto ha = a.register_memory(la.data(), la.size());
  auto hb = b.register_memory(lb.data(), lb.size());
  Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  wait_for_grant(ep, *peer, ha, hb, 0);
  // The sender maps the ring in the background after the grant: wait until one of its messages
  // went through it (only this direction moves meanwhile, so the count is b's ring serving a).
  const uint64_t before = detail::shm::test_ring_messages_served();
  for (auto until = std::chrono::steady_clock::now() + 5s;
       detail::shm::test_ring_messages_served() == before && std::chrono::steady_clock::now() < until;) {
    auto r = peer->recv(hb, 0, 8);
    ASSERT_TRUE(ep.send(ha, 0, 8).wait().ok());
    ASSERT_TRUE(r.wait().ok());
  }
  ASSERT_GT(detail::shm::test_ring_messages_served(), before) << "the sender never used the receiver's eager ring";
  const uint64_t start = detail::shm::test_ring_messages_served();
  const uint64_t held_before = detail::shm::test_ring_messages_held();
  std::vector<std::pair<uint64_t, uint64_t>> msgs;  // offset, length
  for (uint64_t off = 64, i = 0; off < kLen - 65536 * 2; ++i) {
    uint64_t n = i % 97 == 0 ? 0 : i % 13 == 0 ? 65536 : 1 + rng() % 65536;
    msgs.emplace_back(off, n);
    off += n + rng() % 64;
  }
  size_t sent = 0;
  uint64_t syncs = 0;  // wait_for_grant's messages (which may go through a ring too)
  for (size_t chunk = 0; sent < msgs.size(); ++chunk) {
    const size_t end = std::min(msgs.size(), sent + 16);
    std::vector<Future> sends, recvs;
    auto post_recvs = [&] {
      for (size_t i = sent; i < end; ++i) recvs.push_back(peer->recv(hb, msgs[i].first, msgs[i].second));
    };
    if (chunk % 2 == 0) post_recvs();  // posted first: straight into the recv; else stashed
    const uint64_t served = detail::shm::test_ring_messages_served();
    for (size_t i = sent; i < end; ++i) sends.push_back(ep.send(ha, msgs[i].first, msgs[i].second));
    if (chunk % 2 == 1) {
      // Let the receiver take the chunk's ring messages before any recv is posted, so that
      // they stay in the ring and the recvs copy them out (copy_held); bounded, as some of
      // them may have gone in their frames or as rendezvous.
      for (auto until = std::chrono::steady_clock::now() + 200ms;
           detail::shm::test_ring_messages_served() - served < end - sent && std::chrono::steady_clock::now() < until;)
        std::this_thread::sleep_for(1ms);
      post_recvs();
    }
    for (size_t i = 0; i < sends.size(); ++i)
      ASSERT_TRUE(sends[i].wait().ok()) << "send " << sent + i << ": " << sends[i].status().to_string();
    for (size_t i = 0; i < recvs.size(); ++i) {
      ASSERT_TRUE(recvs[i].wait().ok()) << "recv " << sent + i << ": " << recvs[i].status().to_string();
      ASSERT_EQ(recvs[i].bytes(), msgs[sent + i].second) << "recv " << sent + i;
    }
    // A message back on the same socket, after the CREDIT frame the recvs sent: once it is in,
    // the sender holds that credit and the ring position with it.
    wait_for_grant(ep, *peer, ha, hb, 0);
    ++syncs;
    sent = end;
  }
  for (size_t i = 0; i < msgs.size(); ++i)
    ASSERT_EQ(0, std::memcmp(lb.data() + msgs[i].first, la.data() + msgs[i].first, msgs[i].second))
        << "message " << i << " (" << msgs[i].second << " bytes at " << msgs[i].first << ")";
  const uint64_t ring = detail::shm::test_ring_messages_served() - start - syncs;
  EXPECT_GT(ring, msgs.size() / 2) << "only " << ring << " of " << msgs.size() << " messages went through the ring";
  // About half the messages come before their recvs; most of those must have waited in the ring.
  const uint64_t held = detail::shm::test_ring_messages_held() - held_before;
  EXPECT_GT(held, msgs.size() / 8) << "only " << held << " of " << msgs.size() << " messages waited in the ring for their recv";
}

TEST(ShmEager, RingCarriesMessagesOfEverySizeAcrossItsWrap) { ring_carries_every_size(nullptr); }

TEST(ShmEager, RingCarriesMessagesOfEverySizeAcrossItsWrapStreamingEveryCopy) { ring_carries_every_size("1"); }

// An eager SEND to a peer that has closed must fail, not complete: its frame goes nowhere.
// Sent at once after the peer's close, before this side may have seen the close on its
// socket: the write tried at post() fails (EPIPE), and that alone must fail the send.
TEST(ShmEager, SendToAClosedPeerFails) {
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Engine a(engine_config("shm", 1, 5s));
    auto b = std::make_unique<Engine>(engine_config("shm", 1, 5s));
    std::vector<uint8_t> la(4096, 1), lb(4096, 0);
    auto ha = a.register_memory(la.data(), la.size());
    auto hb = b->register_memory(lb.data(), lb.size());
    Endpoint ep = a.connect(b->local_info());
    auto peer = b->accept(5s);
    ASSERT_TRUE(peer.has_value());
    wait_for_grant(ep, *peer, ha, hb, 0);
    b->close();
    bool completed = false;
    try {
      completed = ep.send(ha, 0, 1024).wait().ok();
    } catch (const Error&) {
      // refused at submission: this side already saw the close
    }
    EXPECT_FALSE(completed) << "an eager send to a closed peer completed";
  }
}

// An eager SEND completes once queued, possibly before the socket took it: a local close
// right after must still deliver it. The receiver takes every message slowly (the test knob:
// 1 ms per copy), so most of the 40 MiB the grant allows wait in the sender's queue when it
// closes; every receive must still complete with the sender's bytes.
TEST(ShmEager, MessagesQueuedAtALocalCloseStillArrive) {
  constexpr int kMessages = 640;
  constexpr uint64_t kSize = 64 * 1024;
  EngineConfig c = engine_config("shm", 2, 20s);
  c.options["shm.eager_credit"] = std::to_string(48ull << 20);
  Engine a(c);
  Engine b(c);
  std::vector<uint8_t> la(kMessages * kSize), lb(kMessages * kSize, 0);
  std::mt19937_64 rng(31);
  fill_random(la.data(), la.size(), rng);
  auto ha = a.register_memory(la.data(), la.size());
  auto hb = b.register_memory(lb.data(), lb.size());
  ::setenv("SLUICE_SHM_TEST_COPY_DELAY_MS", "1", 1);
  Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ::unsetenv("SLUICE_SHM_TEST_COPY_DELAY_MS");  // read as the endpoints were made
  ASSERT_TRUE(peer.has_value());
  wait_for_grant(ep, *peer, ha, hb, 0);
  fill_random(la.data(), 8, rng);
  std::vector<Future> recvs;
  for (int i = 0; i < kMessages; ++i) recvs.push_back(peer->recv(hb, i * kSize, kSize));
  for (int i = 0; i < kMessages; ++i) ASSERT_TRUE(ep.send(ha, i * kSize, kSize).wait().ok()) << "send " << i;
  ep.close();
  for (int i = 0; i < kMessages; ++i) ASSERT_TRUE(recvs[i].wait().ok()) << "recv " << i << ": " << recvs[i].status().to_string();
  EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), la.size()));
}

// shm's eager SENDs: a small SEND completes once queued, within the buffer space the receiver
// granted (shm.eager_credit, each message counted with its 56-byte header). The receiver
// holds such messages past max_unexpected_bytes (refusing one would tell nobody), and only
// up to its grant: past it the sender falls back to the rendezvous, which waits for the
// receiver and is refused at the bound as before. Nothing is lost or reordered either way.
TEST(ShmEager, SendsWithinTheGrantCompleteBeforeAnyRecvAndPastItWaitForTheReceiver) {
  EngineConfig cb = engine_config("shm", 2, 10s);
  cb.max_unexpected_bytes = 64 * 1024;
  cb.options["shm.eager_credit"] = std::to_string(3 * (32768 + 56));  // three 32 KiB messages
  Engine a(engine_config("shm", 2, 10s));
  Engine b(cb);
  std::vector<uint8_t> la(512 * 1024), lb(512 * 1024, 0);
  std::mt19937_64 rng(11);
  fill_random(la.data(), la.size(), rng);
  auto ha = a.register_memory(la.data(), la.size());
  auto hb = b.register_memory(lb.data(), lb.size());
  Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  auto sync = [&] { wait_for_grant(ep, *peer, ha, hb, 500 * 1024); };
  sync();
  // 0 and 1 would fit the 64 KiB stash either way; 2 only as an eager message (the grant
  // holds three); 3 is past both: a rendezvous, refused at the bound.
  std::vector<Future> sends;
  for (int i = 0; i < 4; ++i) sends.push_back(ep.send(ha, i * 32768, 32768));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(sends[i].wait().ok()) << "send " << i << ": " << sends[i].status().to_string();
  Status fourth = sends[3].wait();
  EXPECT_EQ(fourth.code, ErrorCode::kRemoteError) << "a send past the grant and the stash bound: " << fourth.to_string();
  std::vector<Future> recvs;
  for (int i = 0; i < 4; ++i) recvs.push_back(peer->recv(hb, i * 32768, 32768));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(recvs[i].wait().ok()) << "recv " << i;
  EXPECT_FALSE(recvs[3].wait().ok());
  EXPECT_EQ(0, std::memcmp(lb.data(), la.data(), 3 * 32768));
  // The recvs gave the grant back: three more go eager with no recv posted, past the stash
  // bound of a rendezvous (64 KiB) again.
  sync();
  std::vector<Future> more;
  for (int i = 0; i < 3; ++i) more.push_back(ep.send(ha, (4 + i) * 32768, 32768));
  for (auto& f : more) EXPECT_TRUE(f.wait().ok()) << f.status().to_string();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(peer->recv(hb, (4 + i) * 32768, 32768).wait().ok());
  EXPECT_EQ(0, std::memcmp(lb.data() + 4 * 32768, la.data() + 4 * 32768, 3 * 32768));
  // A message larger than its recv: the eager send has completed; the recv gets the first
  // bytes and kTruncated, and nothing lands past its buffer.
  std::fill(lb.begin(), lb.end(), 0);
  ASSERT_TRUE(ep.send(ha, 0, 4000).wait().ok());
  auto small = peer->recv(hb, 0, 1000);
  EXPECT_EQ(small.wait().code, ErrorCode::kTruncated);
  EXPECT_EQ(0, std::memcmp(lb.data(), la.data(), 1000));
  EXPECT_EQ(lb[1000], 0);
  EXPECT_TRUE(ep.connected());
}

INSTANTIATE_TEST_SUITE_P(Conformance, LoopbackTest, ::testing::ValuesIn(transports_under_test()), transport_name);
