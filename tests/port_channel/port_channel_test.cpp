// The port channel through the proxy over real transports (tcp and shm loopback, two engines
// in one process), with host threads standing in for GPU threads: bytes land, a signal is
// never seen before the puts ahead of it, many producers share a small FIFO, a full FIFO
// holds producers back, caller errors name what was wrong, and a lost peer or a stopped proxy
// turns wait() / flush() into kFailed instead of a hang. Instantiated as
// Conformance/PortChannel/<transport>.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "../transport/loopback.hpp"
#include "../transport/transports_under_test.hpp"
#include "sluice/port_channel.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {

constexpr uint64_t kSemA = (1ull << 20) - 8;   // a's counter, raised by b's signals
constexpr uint64_t kSemB = (1ull << 20) - 8;   // b's counter, raised by a's signals
constexpr uint64_t kData = (1ull << 20) - 4096;  // bytes below the counters

class PortChannelTest : public LoopbackTest {
 protected:
  void SetUp() override {
    LoopbackTest::SetUp();
    if (HasFatalFailure()) return;
    static_assert(kBytes == (1ull << 20), "the counters sit at the end of the loopback regions");
    for (uint64_t i = kData; i < kBytes; ++i) la_[i] = lb_[i] = 0;
  }
  void TearDown() override {
    proxy_.reset();
    LoopbackTest::TearDown();
  }
  // A proxy on engine a with one channel a -> b.
  PortChannel make(ProxyOptions opt = {}, bool start = true) {
    proxy_ = std::make_unique<ProxyService>(*a_, opt);
    dst_ = proxy_->add_memory(ep_, rb_);
    src_ = proxy_->add_memory(ha_);
    PortChannel ch = proxy_->add_channel(ep_, dst_, src_, {rb_, kSemB}, {ha_, kSemA});
    if (start) proxy_->start();
    return ch;
  }
  uint64_t counter_b(uint64_t off = kSemB) {
    return __atomic_load_n(reinterpret_cast<uint64_t*>(lb_.data() + off), __ATOMIC_ACQUIRE);
  }

  std::unique_ptr<ProxyService> proxy_;
  MemoryId dst_ = 0, src_ = 0;
};

TEST_P(PortChannelTest, PutSignalFlushMovesTheBytes) {
  auto h = make().device_handle();
  ASSERT_EQ(PortResult::kOk, h.put(0, 0, 300000));
  ASSERT_EQ(PortResult::kOk, h.put(400001, 300001, 7));
  ASSERT_EQ(PortResult::kOk, h.put_with_signal(500000, 500000, 4096));
  ASSERT_EQ(PortResult::kOk, h.flush());
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), 300000));
  EXPECT_EQ(0, std::memcmp(la_.data() + 300001, lb_.data() + 400001, 7));
  EXPECT_EQ(0, std::memcmp(la_.data() + 500000, lb_.data() + 500000, 4096));
  EXPECT_EQ(1u, counter_b()) << "flush returned before the signal was applied";
  ASSERT_EQ(PortResult::kOk, h.put_with_signal_and_flush(600000, 600000, 100));
  EXPECT_EQ(2u, counter_b());
  EXPECT_EQ(0, std::memcmp(la_.data() + 600000, lb_.data() + 600000, 100));
  auto s = proxy_->stats();
  EXPECT_EQ(4u, s.puts);
  EXPECT_EQ(2u, s.signals);
  EXPECT_EQ(2u, s.flushes);
  EXPECT_EQ(0u, s.dropped);
}

TEST_P(PortChannelTest, SignalIsNeverSeenBeforeThePutsAheadOfIt) {
  constexpr uint64_t kChunk = 8192;
  constexpr int kRounds = 100;
  auto h = make().device_handle();
  for (int k = 0; k < kRounds; ++k) std::memset(la_.data() + k * kChunk, k + 1, kChunk);
  std::atomic<int> bad{-1};
  std::atomic<bool> stop{false};
  std::thread waiter([&] {
    uint64_t seen = 0;
    while (!stop.load() && seen < kRounds) {
      uint64_t v = counter_b();
      if (v == seen) {
        std::this_thread::yield();
        continue;
      }
      for (uint64_t k = seen; k < v && k < kRounds; ++k)
        for (uint64_t i = 0; i < kChunk; i += 511)
          if (lb_[k * kChunk + i] != uint8_t(k + 1)) {
            bad = int(k);
            return;
          }
      seen = v;
    }
  });
  for (int k = 0; k < kRounds; ++k) {
    // Half as a put followed by a signal, half as one put_with_signal request.
    if (k % 2) {
      ASSERT_EQ(PortResult::kOk, h.put(k * kChunk, k * kChunk, kChunk));
      ASSERT_EQ(PortResult::kOk, h.signal());
    } else {
      ASSERT_EQ(PortResult::kOk, h.put_with_signal(k * kChunk, k * kChunk, kChunk));
    }
  }
  ASSERT_EQ(PortResult::kOk, h.flush());
  stop = true;
  waiter.join();
  EXPECT_EQ(-1, bad.load()) << "the counter said chunk " << bad.load() << " had landed before its bytes";
  EXPECT_EQ(uint64_t(kRounds), counter_b());
}

TEST_P(PortChannelTest, SixtyFourProducersShareASixteenEntryFifo) {
  ProxyOptions opt;
  opt.fifo_depth = 16;
  auto h = make(opt).device_handle();
  constexpr int kThreads = 64, kEach = 40;
  constexpr uint64_t kSlice = 64;  // bytes per put; thread p owns [p*kEach*kSlice, ...)
  std::vector<std::thread> producers;
  std::atomic<int> failures{0};
  for (int p = 0; p < kThreads; ++p)
    producers.emplace_back([&, p] {
      for (int i = 0; i < kEach; ++i) {
        uint64_t off = (uint64_t(p) * kEach + i) * kSlice;
        if (h.put_with_signal(off, off, kSlice) != PortResult::kOk) failures++;
      }
    });
  for (auto& t : producers) t.join();
  ASSERT_EQ(0, failures.load());
  ASSERT_EQ(PortResult::kOk, h.flush());
  EXPECT_EQ(uint64_t(kThreads) * kEach, counter_b());
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), uint64_t(kThreads) * kEach * kSlice));
  EXPECT_EQ(uint64_t(kThreads) * kEach + 1, proxy_->stats().requests);
}

TEST_P(PortChannelTest, FullFifoHoldsProducersBackUntilTheProxyRuns) {
  ProxyOptions opt;
  opt.fifo_depth = 4;
  auto h = make(opt, /*start=*/false).device_handle();
  for (int i = 0; i < 4; ++i) ASSERT_EQ(PortResult::kOk, h.put(i * 1000, i * 1000, 1000));
  std::atomic<int> fifth{-1};
  std::thread t([&] { fifth = int(h.put(4000, 4000, 1000)); });
  // The fifth producer has its ticket, but its slot is taken: it must still be waiting.
  while (__atomic_load_n(h.fifo.head, __ATOMIC_ACQUIRE) < 5) std::this_thread::yield();
  EXPECT_EQ(-1, fifth.load()) << "a push into a full FIFO returned while nothing was consumed";
  proxy_->start();
  t.join();
  EXPECT_EQ(int(PortResult::kOk), fifth.load());
  ASSERT_EQ(PortResult::kOk, h.flush());
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), 5000)) << "a queued request was lost or overwritten";
}

TEST_P(PortChannelTest, PushTimeoutOnAStalledProxyFailsTheChannel) {
  ProxyOptions opt;
  opt.fifo_depth = 2;
  opt.push_spin_ns = 20'000'000;  // 20 ms
  PortChannel ch = make(opt, /*start=*/false);
  auto h = ch.device_handle();
  ASSERT_EQ(PortResult::kOk, h.put(0, 0, 8));
  ASSERT_EQ(PortResult::kOk, h.put(8, 8, 8));
  EXPECT_EQ(PortResult::kTimeout, h.put(16, 16, 8));
  EXPECT_EQ(PortResult::kFailed, h.signal()) << "a FIFO with a lost ticket accepted more requests";
  proxy_->start();
  EXPECT_EQ(PortResult::kFailed, h.flush(5'000'000'000ull));
  for (int i = 0; i < 1000 && ch.status().ok(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(ErrorCode::kTimeout, ch.status().code) << ch.status().to_string();
}

TEST_P(PortChannelTest, PingPongBetweenTwoProxies) {
  PortChannel ab = make();
  // The mirror channel on b: b's proxy puts into a's region and raises a's counter.
  ProxyService pb(*b_, {});
  auto ra = peer_.remote_region("a");
  ASSERT_TRUE(ra.has_value());
  PortChannel ba = pb.add_channel(peer_, pb.add_memory(peer_, *ra), pb.add_memory(hb_), {*ra, kSemA}, {hb_, kSemB});
  pb.start();
  auto ha = ab.device_handle(), hb = ba.device_handle();
  constexpr int kRounds = 200;
  std::atomic<int> b_bad{0};
  std::thread pong([&] {
    for (int i = 0; i < kRounds; ++i) {
      if (hb.wait() != PortResult::kOk) return void(b_bad++);
      if (lb_[i * 8] != uint8_t(i + 1)) b_bad++;
      lb_[i * 8 + 4] = uint8_t(i + 101);
      if (hb.put_with_signal(i * 8 + 4, i * 8 + 4, 1) != PortResult::kOk) return void(b_bad++);
    }
  });
  for (int i = 0; i < kRounds; ++i) {
    la_[i * 8] = uint8_t(i + 1);
    ASSERT_EQ(PortResult::kOk, ha.put_with_signal(i * 8, i * 8, 1));
    ASSERT_EQ(PortResult::kOk, ha.wait()) << "round " << i;
    ASSERT_EQ(uint8_t(i + 101), la_[i * 8 + 4]) << "round " << i << ": the pong's byte was not there after wait()";
  }
  pong.join();
  EXPECT_EQ(0, b_bad.load());
  EXPECT_FALSE(ha.poll()) << "poll() saw a signal nobody sent";
}

TEST_P(PortChannelTest, ManyChannelsOnSeveralWorkers) {
  ProxyOptions opt;
  opt.workers = 3;
  opt.fifo_depth = 32;
  proxy_ = std::make_unique<ProxyService>(*a_, opt);
  MemoryId dst = proxy_->add_memory(ep_, rb_), src = proxy_->add_memory(ha_);
  constexpr int kChannels = 24, kEach = 50;
  std::vector<PortChannelDeviceHandle> hs;
  for (int c = 0; c < kChannels; ++c)
    hs.push_back(proxy_->add_channel(ep_, dst, src, {rb_, kData + c * 8}, {ha_, kData + c * 8}).device_handle());
  proxy_->start();
  std::vector<std::thread> ts;
  std::atomic<int> failures{0};
  for (int c = 0; c < kChannels; ++c)
    ts.emplace_back([&, c] {
      for (int i = 0; i < kEach; ++i) {
        uint64_t off = (uint64_t(c) * kEach + i) * 128;
        if (hs[c].put_with_signal(off, off, 128) != PortResult::kOk) failures++;
      }
      if (hs[c].flush() != PortResult::kOk) failures++;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(0, failures.load());
  for (int c = 0; c < kChannels; ++c) EXPECT_EQ(uint64_t(kEach), counter_b(kData + c * 8)) << "channel " << c;
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), uint64_t(kChannels) * kEach * 128));
  EXPECT_EQ(size_t(kChannels), proxy_->channels());
}

TEST_P(PortChannelTest, CallerErrorsNameWhatWasWrong) {
  proxy_ = std::make_unique<ProxyService>(*a_, ProxyOptions{});
  MemoryId dst = proxy_->add_memory(ep_, rb_), src = proxy_->add_memory(ha_);
  EXPECT_EQ(ErrorCode::kUnknownHandle, code_of([&] { proxy_->add_memory(MemoryHandle{999999}); }));
  EXPECT_EQ(ErrorCode::kUnknownHandle, code_of([&] { proxy_->add_memory(ep_, RemoteHandle{999999}); }));
  // Roles swapped, unknown ids, misaligned or out-of-range semaphores, a bad worker.
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { proxy_->add_channel(ep_, src, dst, {rb_, 0}, {ha_, 0}); }));
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { proxy_->add_channel(ep_, 77, src, {rb_, 0}, {ha_, 0}); }));
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { proxy_->add_channel(ep_, dst, src, {rb_, 4}, {ha_, 0}); }));
  EXPECT_EQ(ErrorCode::kOutOfRange, code_of([&] { proxy_->add_channel(ep_, dst, src, {rb_, kBytes}, {ha_, 0}); }));
  EXPECT_EQ(ErrorCode::kOutOfRange, code_of([&] { proxy_->add_channel(ep_, dst, src, {rb_, 0}, {ha_, kBytes}); }));
  EXPECT_EQ(ErrorCode::kUnknownHandle,
            code_of([&] { proxy_->add_channel(ep_, dst, src, {RemoteHandle{999999}, 0}, {ha_, 0}); }));
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { proxy_->add_channel(ep_, dst, src, {rb_, 0}, {ha_, 0}, 5); }));
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { ProxyService bad(*a_, ProxyOptions{.fifo_depth = 12}); }));
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { ProxyService bad(*a_, ProxyOptions{.workers = 0}); }));
  // A request the proxy cannot carry out fails its channel (and only it) with the reason.
  PortChannel bad = proxy_->add_channel(ep_, dst, src, {rb_, kSemB}, {ha_, kSemA});
  PortChannel good = proxy_->add_channel(ep_, dst, src, {rb_, kSemB - 8}, {ha_, kSemA - 8});
  proxy_->start();
  auto hb = bad.device_handle();
  ASSERT_EQ(PortResult::kOk, hb.put(dst, 0, 12345, 0, 8));             // memory id never added
  EXPECT_EQ(PortResult::kFailed, hb.flush());
  EXPECT_EQ(ErrorCode::kInvalidArgument, bad.status().code);
  EXPECT_NE(std::string::npos, bad.status().message.find("memory id 12345")) << bad.status().message;
  EXPECT_EQ(PortResult::kFailed, hb.put(0, 0, 8)) << "a failed channel accepted a request";
  auto hg = good.device_handle();
  ASSERT_EQ(PortResult::kOk, hg.put(kBytes - 4, 0, 8));  // out of range at the peer: the engine's check
  EXPECT_EQ(PortResult::kFailed, hg.flush());
  EXPECT_EQ(ErrorCode::kOutOfRange, good.status().code) << good.status().to_string();
}

TEST_P(PortChannelTest, LostPeerTurnsWaitAndFlushIntoFailures) {
  PortChannel ch = make();
  auto h = ch.device_handle();
  ASSERT_EQ(PortResult::kOk, h.put_with_signal_and_flush(0, 0, 4096));
  std::atomic<int> waited{-1};
  std::thread waiter([&] { waited = int(h.wait(30'000'000'000ull)); });  // nobody will signal
  peer_ = {};
  b_->close();
  waiter.join();
  EXPECT_EQ(int(PortResult::kFailed), waited.load()) << "wait() did not learn that the peer was lost";
  EXPECT_EQ(PortResult::kFailed, h.flush());
  Status st = ch.status();
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(st.code == ErrorCode::kPeerLost || st.code == ErrorCode::kCancelled) << st.to_string();
}

TEST_P(PortChannelTest, StoppedProxyFailsProducersAtOnce) {
  PortChannel ch = make();
  auto h = ch.device_handle();
  ASSERT_EQ(PortResult::kOk, h.put_with_signal_and_flush(0, 0, 64));
  proxy_->stop();
  EXPECT_EQ(PortResult::kFailed, h.put(0, 0, 8));
  EXPECT_EQ(PortResult::kFailed, h.wait());
  EXPECT_EQ(ErrorCode::kClosed, ch.status().code);
  EXPECT_EQ(ErrorCode::kClosed, code_of([&] { proxy_->start(); }));
}

// Offsets past 4 GiB on both sides: sparse 5 GiB regions (untouched pages cost nothing).
TEST_P(PortChannelTest, OffsetsBeyondFourGiB) {
  constexpr uint64_t kBig = 5ull << 30;
  void* pa = ::mmap(nullptr, kBig, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* pb = ::mmap(nullptr, kBig, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (pa == MAP_FAILED || pb == MAP_FAILED) GTEST_SKIP() << "cannot reserve 2 x 5 GiB of address space here";
  auto* a = static_cast<uint8_t*>(pa);
  auto* b = static_cast<uint8_t*>(pb);
  MemoryHandle big_a = a_->register_memory(a, kBig, Location::host(), "big_a");
  b_->register_memory(b, kBig, Location::host(), "big_b");
  ep_.refresh_remote_regions();
  auto rbig = ep_.remote_region("big_b");
  ASSERT_TRUE(rbig.has_value());
  proxy_ = std::make_unique<ProxyService>(*a_, ProxyOptions{});
  MemoryId dst = proxy_->add_memory(ep_, *rbig), src = proxy_->add_memory(big_a);
  PortChannel ch = proxy_->add_channel(ep_, dst, src, {*rbig, kBig - 8}, {big_a, kBig - 8});
  proxy_->start();
  const uint64_t src_off = (4ull << 30) + 777, dst_off = kBig - 4096 - (1 << 20) + 3;
  fill_pattern(a + src_off, 1 << 20, 5);
  auto h = ch.device_handle();
  ASSERT_EQ(PortResult::kOk, h.put_with_signal_and_flush(dst_off, src_off, 1 << 20)) << ch.status().to_string();
  EXPECT_EQ(0, std::memcmp(a + src_off, b + dst_off, 1 << 20));
  EXPECT_EQ(1u, __atomic_load_n(reinterpret_cast<uint64_t*>(b + kBig - 8), __ATOMIC_ACQUIRE));
  proxy_.reset();
  ep_ = {};
  peer_ = {};
  a_->close();
  b_->close();
  ::munmap(pa, kBig);
  ::munmap(pb, kBig);
}

INSTANTIATE_TEST_SUITE_P(Conformance, PortChannelTest, ::testing::ValuesIn(transports_under_test()), transport_name);

}  // namespace
