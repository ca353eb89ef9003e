// The thin post path (Endpoint::post_write / post_signal / flush) on every transport under
// test: bytes land, a signal is never visible before the writes posted ahead of it, caller
// errors throw at once, the depth limit holds posters back without losing anything, and a
// lost peer fails posts and flush in bounded time. Instantiated as Conformance/Post/<transport>.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "loopback.hpp"
#include "transports_under_test.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {

class Post : public LoopbackTest {
 protected:
  void SetUp() override {
    LoopbackTest::SetUp();
    if (HasFatalFailure()) return;
    ASSERT_TRUE(ep_.capabilities().rma_post) << GetParam() << " has no thin post path (Capabilities::rma_post)";
  }
  // The peer's 64-bit counter at `offset` of lb_, read as a waiter would.
  uint64_t counter(uint64_t offset) {
    return __atomic_load_n(reinterpret_cast<uint64_t*>(lb_.data() + offset), __ATOMIC_ACQUIRE);
  }
  void zero(uint64_t offset) { __atomic_store_n(reinterpret_cast<uint64_t*>(lb_.data() + offset), 0, __ATOMIC_RELEASE); }
};

TEST_P(Post, WritesLandAfterFlush) {
  // Sizes from one byte to past the striping threshold, at odd offsets.
  const uint64_t sizes[] = {1, 7, 4096, 65536 + 3, 300000};
  uint64_t off = 1;
  for (uint64_t n : sizes) {
    ep_.post_write(ha_, off, rb_, off, n);
    off += n + 5;
  }
  ep_.flush();
  // The posted ranges hold the source's bytes and nothing around them changed.
  std::vector<uint8_t> expect(kBytes);
  fill_pattern(expect.data(), expect.size(), 22);
  off = 1;
  for (uint64_t n : sizes) {
    std::memcpy(expect.data() + off, la_.data() + off, n);
    off += n + 5;
  }
  for (uint64_t i = 0; i < kBytes; ++i)
    ASSERT_EQ(expect[i], lb_[i]) << "byte " << i << " of the target after the posts";
}

TEST_P(Post, SignalIsNeverSeenBeforeTheWritesAheadOfIt) {
  constexpr uint64_t kSem = kBytes - 8, kChunk = 8192;
  constexpr int kRounds = 100;  // chunks 0..99 cover 800 KiB below the counter
  zero(kSem);
  for (int k = 0; k < kRounds; ++k) std::memset(la_.data() + k * kChunk, k + 1, kChunk);
  std::atomic<bool> stop{false};
  std::atomic<int> bad{-1};
  std::thread waiter([&] {
    uint64_t seen = 0;
    while (!stop.load() && seen < kRounds) {
      uint64_t v = counter(kSem);
      if (v == seen) continue;
      // Every chunk up to v must already be complete.
      for (uint64_t k = seen; k < v && k < kRounds; ++k)
        for (uint64_t i = 0; i < kChunk; i += 511)
          if (lb_[k * kChunk + i] != uint8_t(k + 1)) {
            bad = static_cast<int>(k);
            return;
          }
      seen = v;
    }
  });
  for (int k = 0; k < kRounds; ++k) {
    ep_.post_write(ha_, k * kChunk, rb_, k * kChunk, kChunk);
    ep_.post_signal(rb_, kSem, 1);
  }
  ep_.flush();
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (counter(kSem) < kRounds && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  stop = true;
  waiter.join();
  EXPECT_EQ(-1, bad.load()) << "the counter said chunk " << bad.load() << " had landed before its bytes were there";
  EXPECT_EQ(uint64_t(kRounds), counter(kSem)) << "flush returned before every signal was applied";
}

TEST_P(Post, SignalAddsItsValueAndFlushWaitsForIt) {
  constexpr uint64_t kSem = 64;
  zero(kSem);
  ep_.post_signal(rb_, kSem, 5);
  ep_.post_signal(rb_, kSem, 37);
  ep_.flush();
  EXPECT_EQ(42u, counter(kSem));
  // A signal with nothing before it, and one behind a large write.
  ep_.post_write(ha_, 4096, rb_, 4096, 512 << 10);
  ep_.post_signal(rb_, kSem, 1);
  ep_.flush();
  EXPECT_EQ(43u, counter(kSem));
  EXPECT_EQ(0, std::memcmp(la_.data() + 4096, lb_.data() + 4096, 512 << 10));
}

TEST_P(Post, CallerErrorsThrowAtOnce) {
  EXPECT_EQ(ErrorCode::kUnknownHandle, code_of([&] { ep_.post_write(ha_, 0, RemoteHandle{999999}, 0, 8); }));
  EXPECT_EQ(ErrorCode::kUnknownHandle, code_of([&] { ep_.post_write(MemoryHandle{999999}, 0, rb_, 0, 8); }));
  EXPECT_EQ(ErrorCode::kOutOfRange, code_of([&] { ep_.post_write(ha_, 0, rb_, kBytes - 4, 8); }));
  EXPECT_EQ(ErrorCode::kOutOfRange, code_of([&] { ep_.post_write(ha_, kBytes - 4, rb_, 0, 8); }));
  EXPECT_EQ(ErrorCode::kOutOfRange, code_of([&] { ep_.post_write(ha_, 0, rb_, ~0ull - 3, 8); }));
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { ep_.post_write(ha_, 0, rb_, 0, 0); }));
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { ep_.post_signal(rb_, 4, 1); }));
  EXPECT_EQ(ErrorCode::kOutOfRange, code_of([&] { ep_.post_signal(rb_, kBytes, 1); }));
  EXPECT_EQ(ErrorCode::kUnknownHandle, code_of([&] { ep_.post_signal(RemoteHandle{999999}, 0, 1); }));
  // Nothing was posted by the refused calls: flush has nothing to report.
  EXPECT_EQ(ErrorCode::kOk, code_of([&] { ep_.flush(); }));
}

TEST_P(Post, ManySmallPostsWithSignals) {
  constexpr uint64_t kSem = kBytes - 8;
  constexpr int kN = 20000;
  zero(kSem);
  for (int i = 0; i < kN; ++i) {
    uint64_t off = (uint64_t(i) * 8) % (kBytes - 4096);
    ep_.post_write(ha_, off, rb_, off, 8);
    ep_.post_signal(rb_, kSem, 1);
  }
  ep_.flush();
  EXPECT_EQ(uint64_t(kN), counter(kSem));
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), std::min<uint64_t>(kN * 8, kBytes - 4096)));
}

TEST_P(Post, LostPeerFailsPostsAndFlushInBoundedTime) {
  ep_.post_write(ha_, 0, rb_, 0, 4096);
  ep_.flush();
  peer_.close();
  b_->close();
  auto t0 = std::chrono::steady_clock::now();
  // Posts either throw at once or their failure reaches flush; nothing waits forever.
  ErrorCode c = code_of([&] {
    for (int i = 0; i < 1000; ++i) {
      ep_.post_write(ha_, 0, rb_, 0, 65536);
      ep_.post_signal(rb_, 0, 1);
    }
    ep_.flush(5000ms);
  });
  EXPECT_NE(ErrorCode::kOk, c) << "posts to a closed peer all succeeded";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  // That first error may be a post the peer refused while closing (its regions went first);
  // the endpoint itself fails once the peer's close is seen, within the timeout, and from
  // then on every call says so.
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (ep_.connected() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_FALSE(ep_.connected()) << "the endpoint never noticed its peer closed";
  EXPECT_NE(ErrorCode::kOk, code_of([&] { ep_.post_write(ha_, 0, rb_, 0, 8); }));
  EXPECT_NE(ErrorCode::kOk, code_of([&] { ep_.flush(1000ms); }));
}

class PostDepth : public ::testing::TestWithParam<std::string> {};

TEST_P(PostDepth, ASmallDepthHoldsPostersBackWithoutLosingAny) {
  EngineConfig ca = engine_config(GetParam(), 2, 10s), cb = ca;
  ca.set("post.depth", "4");
  Engine a(ca), b(cb);
  std::vector<uint8_t> src(1 << 20), dst(1 << 20, 0);
  fill_pattern(src.data(), src.size(), 3);
  auto hs = a.register_memory(src.data(), src.size());
  b.register_memory(dst.data(), dst.size(), Location::host(), "dst");
  Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  ASSERT_TRUE(ep.capabilities().rma_post);
  RemoteHandle rd = *ep.remote_region("dst");
  for (int round = 0; round < 4; ++round)
    for (uint64_t off = 0; off < src.size(); off += 4096) ep.post_write(hs, off, rd, off, 4096);
  ep.flush();
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { EngineConfig c; c.set("post.depth", "0"); }));
}

TEST(PostCapability, TransportsWithoutItRefuseClearly) {
  // Every transport of this build declares the capability it implements; a caller that
  // checks capabilities() never gets a surprise, and one that does not gets kUnsupported.
  for (const std::string& t : transports_under_test()) {
    EngineConfig c = engine_config(t, 1, 5s);
    Engine a(c), b(c);
    std::vector<uint8_t> m(4096);
    auto h = a.register_memory(m.data(), m.size());
    b.register_memory(m.data(), m.size(), Location::host(), "m");
    Endpoint ep = a.connect(b.local_info());
    RemoteHandle r = *ep.remote_region("m");
    if (ep.capabilities().rma_post) {
      ep.post_write(h, 0, r, 0, 8);
      EXPECT_EQ(ErrorCode::kOk, code_of([&] { ep.flush(); })) << t;
    } else {
      std::string msg;
      EXPECT_EQ(ErrorCode::kUnsupported, code_of([&] { ep.post_write(h, 0, r, 0, 8); }, &msg)) << t;
      EXPECT_NE(std::string::npos, msg.find("rma_post")) << msg;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Conformance, Post, ::testing::ValuesIn(transports_under_test()), transport_name);
INSTANTIATE_TEST_SUITE_P(Conformance, PostDepth, ::testing::ValuesIn(transports_under_test()), transport_name);

}  // namespace
