// The batched thin post path and the proxy's batching, over tcp and shm (which post a batch
// with TransportEndpoint's default loop): Endpoint::post_batch posts in order and a signal is
// never seen before the writes ahead of it; an error inside a batch stops it there with the
// message the single call gives, and what came before still lands; a proxy pops at most
// batch_max requests per batch; a request that fails inside a batch fails only its channel,
// and the other channels' requests after it still go out. Instantiated as
// Conformance/PostBatchTest/<transport>.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "../transport/loopback.hpp"
#include "../transport/transports_under_test.hpp"
#include "sluice/port_channel.hpp"

using namespace sluice;
using namespace sluice_test;

namespace post_batch_test {  // named: the unity build joins this file with port_channel_test.cpp

constexpr uint64_t kSem = (1ull << 20) - 8;
constexpr uint64_t kSem2 = (1ull << 20) - 16;
constexpr uint64_t kData = (1ull << 20) - 4096;  // nothing below the counters is data here

class PostBatchTest : public LoopbackTest {
 protected:
  void SetUp() override {
    LoopbackTest::SetUp();
    if (HasFatalFailure()) return;
    for (uint64_t i = kData; i < kBytes; ++i) la_[i] = lb_[i] = 0;
  }
  void TearDown() override {
    proxy_.reset();
    LoopbackTest::TearDown();
  }
  uint64_t counter_b(uint64_t off = kSem) {
    return __atomic_load_n(reinterpret_cast<uint64_t*>(lb_.data() + off), __ATOMIC_ACQUIRE);
  }
  std::unique_ptr<ProxyService> proxy_;
};

TEST_P(PostBatchTest, PostsInOrderAndSignalsFollowTheirWrites) {
  constexpr uint64_t kChunk = 4096;
  constexpr int kRounds = 150;
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
        for (uint64_t i = 0; i < kChunk; i += 509)
          if (lb_[k * kChunk + i] != uint8_t(k + 1)) {
            bad = int(k);
            return;
          }
      seen = v;
    }
  });
  // Three batches of 100 requests: a write and its signal per chunk.
  std::vector<PostRequest> reqs;
  for (int k = 0; k < kRounds; ++k) {
    reqs.push_back(PostRequest::write(ha_, k * kChunk, rb_, k * kChunk, kChunk));
    reqs.push_back(PostRequest::signal(rb_, kSem));
  }
  for (size_t at = 0; at < reqs.size(); at += 100) {
    auto part = std::span<const PostRequest>(reqs).subspan(at, std::min<size_t>(100, reqs.size() - at));
    PostBatchResult r = ep_.post_batch(part);
    ASSERT_TRUE(r.error.ok()) << r.error.to_string();
    ASSERT_EQ(part.size(), r.posted);
  }
  ep_.flush();
  stop = true;
  waiter.join();
  EXPECT_EQ(-1, bad.load()) << "the counter said chunk " << bad.load() << " had landed before its bytes";
  EXPECT_EQ(uint64_t(kRounds), counter_b());
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), kRounds * kChunk));
  EXPECT_EQ(0u, ep_.post_batch({}).posted);
}

TEST_P(PostBatchTest, AnErrorStopsTheBatchThereWithTheSingleCallsMessage) {
  std::memset(la_.data(), 7, 3 * 4096);
  std::string single;
  ASSERT_EQ(ErrorCode::kOutOfRange, code_of([&] { ep_.post_write(ha_, 0, rb_, kBytes - 4, 8); }, &single));
  ep_.flush();
  std::vector<PostRequest> reqs = {
      PostRequest::write(ha_, 0, rb_, 0, 4096),
      PostRequest::write(ha_, 4096, rb_, 4096, 4096),
      PostRequest::write(ha_, 0, rb_, kBytes - 4, 8),  // out of range at the peer
      PostRequest::write(ha_, 8192, rb_, 8192, 4096),
      PostRequest::signal(rb_, kSem),
  };
  PostBatchResult r = ep_.post_batch(reqs);
  EXPECT_EQ(2u, r.posted);
  EXPECT_EQ(ErrorCode::kOutOfRange, r.error.code);
  EXPECT_NE(std::string::npos, single.find(r.error.message)) << "batch: " << r.error.message << "\nsingle: " << single;
  EXPECT_EQ(0u, r.error.message.rfind("post_write: ", 0)) << r.error.message;
  ep_.flush();
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), 2 * 4096)) << "the writes before the bad one did not land";
  EXPECT_NE(0, std::memcmp(la_.data() + 8192, lb_.data() + 8192, 4096)) << "a write after the bad one was posted";
  EXPECT_EQ(0u, counter_b()) << "the signal after the bad write was posted";

  // A bad local handle and a misaligned signal are caller errors the same way.
  std::vector<PostRequest> more = {PostRequest::signal(rb_, kSem), PostRequest::write(MemoryHandle{999999}, 0, rb_, 0, 8)};
  r = ep_.post_batch(more);
  EXPECT_EQ(1u, r.posted);
  EXPECT_EQ(ErrorCode::kUnknownHandle, r.error.code) << r.error.to_string();
  more = {PostRequest::signal(rb_, 4)};
  r = ep_.post_batch(more);
  EXPECT_EQ(0u, r.posted);
  EXPECT_EQ(ErrorCode::kInvalidArgument, r.error.code);
  EXPECT_EQ(0u, r.error.message.rfind("post_signal: ", 0)) << r.error.message;
  ep_.flush();
  EXPECT_EQ(1u, counter_b());
}

TEST_P(PostBatchTest, AProxyPopsAtMostBatchMaxRequestsABatch) {
  for (uint32_t bound : {4u, 256u}) {
    ProxyOptions opt;
    opt.batch_max = bound;
    opt.fifo_depth = 16;
    proxy_ = std::make_unique<ProxyService>(*a_, opt);
    EXPECT_EQ(bound == 4 ? 4u : 16u, proxy_->options().batch_max) << "the bound is at most one FIFO";
    PortChannel ch = proxy_->add_channel(ep_, proxy_->add_memory(ep_, rb_), proxy_->add_memory(ha_), {rb_, kSem},
                                         {ha_, kSem});
    auto h = ch.device_handle();
    const uint64_t before = counter_b();
    // Twelve requests queued before the worker runs: it finds them all at once.
    for (int i = 0; i < 12; ++i) ASSERT_EQ(PortResult::kOk, h.put_with_signal(i * 512, i * 512 + 1, 512));
    proxy_->start();
    for (int i = 0; i < 5000 && counter_b() < before + 12; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_EQ(before + 12, counter_b()) << ch.status().to_string();
    // The worker counts a batch once post_batch returned, and a signal can land at the peer
    // before that (rdma: the NIC delivers it while the worker is still in the call). The
    // flush behind the twelve is served after they were posted and counted.
    ASSERT_EQ(PortResult::kOk, h.flush());
    ProxyStats s = proxy_->stats();
    EXPECT_EQ(12u, s.puts);
    EXPECT_EQ(12u, s.signals);
    EXPECT_EQ(bound == 4 ? 3u : 1u, s.batches) << "bound " << bound;
    EXPECT_EQ(0, std::memcmp(la_.data() + 1, lb_.data(), 12 * 512));
    proxy_.reset();
  }
}

TEST_P(PostBatchTest, AFailedRequestInsideABatchFailsOnlyItsChannel) {
  ProxyOptions opt;
  opt.fifo_depth = 32;
  proxy_ = std::make_unique<ProxyService>(*a_, opt);
  MemoryId dst = proxy_->add_memory(ep_, rb_), src = proxy_->add_memory(ha_);
  PortChannel good = proxy_->add_channel(ep_, dst, src, {rb_, kSem}, {ha_, kSem});
  PortChannel bad = proxy_->add_channel(ep_, dst, src, {rb_, kSem2}, {ha_, kSem2});
  PortChannel bad_id = proxy_->add_channel(ep_, dst, src, {rb_, kSem2}, {ha_, kSem2});
  auto hg = good.device_handle(), hb = bad.device_handle(), hi = bad_id.device_handle();
  std::memset(la_.data(), 3, 64 * 1024);
  // All queued before the worker runs, so they are served as one batch (same FIFO).
  ASSERT_EQ(PortResult::kOk, hb.put_with_signal(0, 0, 1024));           // bad's own earlier request: lands
  ASSERT_EQ(PortResult::kOk, hg.put_with_signal(4096, 4096, 1024));
  ASSERT_EQ(PortResult::kOk, hi.put(dst, 8192, 12345, 0, 8));          // memory id never added
  ASSERT_EQ(PortResult::kOk, hb.put(kBytes - 4, 0, 8));                // out of range at the peer
  ASSERT_EQ(PortResult::kOk, hg.put_with_signal(16384, 16384, 1024));
  ASSERT_EQ(PortResult::kOk, hb.put_with_signal(20480, 20480, 1024));  // after bad failed: dropped
  ASSERT_EQ(PortResult::kOk, hi.put_with_signal(24576, 24576, 1024));  // after bad_id failed: dropped
  ASSERT_EQ(PortResult::kOk, hg.put_with_signal(28672, 28672, 1024));
  proxy_->start();
  ASSERT_EQ(PortResult::kOk, hg.flush()) << good.status().to_string();
  EXPECT_TRUE(good.status().ok()) << good.status().to_string();
  EXPECT_EQ(3u, counter_b(kSem));
  for (uint64_t off : {4096, 16384, 28672})
    EXPECT_EQ(0, std::memcmp(la_.data() + off, lb_.data() + off, 1024)) << "good channel's put at " << off;
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), 1024)) << "the bad channel's request before its failure";
  EXPECT_EQ(1u, counter_b(kSem2)) << "only the bad channel's first signal may land";
  for (uint64_t off : {20480, 24576})
    EXPECT_NE(0, std::memcmp(la_.data() + off, lb_.data() + off, 1024)) << "a failed channel's later put landed at " << off;

  EXPECT_EQ(PortResult::kFailed, hb.flush());
  EXPECT_EQ(ErrorCode::kOutOfRange, bad.status().code) << bad.status().to_string();
  const std::string channel = "channel " + std::to_string(bad.id()) + ": post_write: ";
  EXPECT_EQ(0u, bad.status().message.rfind(channel, 0)) << bad.status().message;
  EXPECT_EQ(PortResult::kFailed, hi.flush());
  EXPECT_EQ(ErrorCode::kInvalidArgument, bad_id.status().code);
  EXPECT_NE(std::string::npos, bad_id.status().message.find("memory id 12345")) << bad_id.status().message;
  EXPECT_EQ(2u, proxy_->stats().dropped);
}

INSTANTIATE_TEST_SUITE_P(Conformance, PostBatchTest, ::testing::ValuesIn(transports_under_test()), transport_name);

}  // namespace post_batch_test
