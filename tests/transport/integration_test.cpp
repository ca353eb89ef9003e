// Multi-process integration tests over tcp and shm: a forked child runs its own engine and
// accepts the parent's endpoints; the parent drives every operation with random sizes and
// offsets and checks the bytes on both sides.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>

#include <nlohmann/json.hpp>

#include "harness.hpp"
#include "test_util.hpp"
#include "transports_under_test.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {


class Integration : public ::testing::TestWithParam<std::string> {
 protected:
  // Forks the child first (this process has no engine threads yet), then starts our engine.
  void start(ChildConfig cfg = {}, int channels = 2) {
    cfg.transport = GetParam();
    child_ = std::make_unique<Child>(cfg);
    blob_ = child_->blob();
    ASSERT_FALSE(blob_.empty()) << "child failed to start";
    engine_ = std::make_unique<Engine>(engine_config(GetParam(), channels));
    ep_ = engine_->connect(blob_);
    ASSERT_EQ(ep_.transport(), GetParam());
    auto heap = ep_.remote_region("heap");
    auto alloc = ep_.remote_region("alloc");
    ASSERT_TRUE(heap && alloc);
    remote_[0] = *heap;
    remote_[1] = *alloc;
    for (const auto& r : ep_.remote_regions()) {
      if (r.id == heap->id) remote_len_[0] = r.length;
      if (r.id == alloc->id) remote_len_[1] = r.length;
    }
    ASSERT_GE(remote_len_[0], cfg.heap_bytes);
    ASSERT_GE(remote_len_[1], cfg.alloc_bytes);
    // What the child's regions hold, kept up to date as we write.
    for (int r = 0; r < 2; ++r) {
      mirror_[r].resize(remote_len_[r]);
      fill_pattern(mirror_[r].data(), mirror_[r].size(), cfg.seed + r);
    }
  }
  void TearDown() override {
    ep_ = {};
    if (engine_) engine_->close();
    if (child_) {
      int st = child_->quit();
      EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "child exited with status " << st;
    }
  }

  void expect_child_matches(int region, uint64_t off, uint64_t len) {
    EXPECT_EQ(child_->checksum(region, off, len), fnv(mirror_[region].data() + off, len))
        << "child region " << region << " [" << off << ", +" << len << ") differs";
  }
  void expect_child_matches_all() {
    for (int r = 0; r < 2; ++r) expect_child_matches(r, 0, remote_len_[r]);
  }

  // Random batches of reads and writes between (local, lptr, llen) and child region `region`,
  // with random sizes (log-uniform up to max_len) and random offsets; checked byte for byte.
  void random_ops(MemoryHandle local, uint8_t* lptr, uint64_t llen, int region, int iters, uint64_t max_len,
                  uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t>& mir = mirror_[region];
    const uint64_t rlen = remote_len_[region];
    for (int it = 0; it < iters; ++it) {
      double lg = std::uniform_real_distribution<double>(0, std::log2(static_cast<double>(max_len)))(rng);
      uint64_t total = std::clamp<uint64_t>(static_cast<uint64_t>(std::exp2(lg)), 1, std::min({max_len, llen, rlen}));
      uint64_t lo = rng() % (llen - total + 1);
      uint64_t ro = rng() % (rlen - total + 1);
      // Split into 1..6 assignments, submitted in shuffled order.
      int k = 1 + static_cast<int>(rng() % std::min<uint64_t>(6, total));
      std::vector<uint64_t> cuts{0, total};
      for (int i = 1; i < k; ++i) cuts.push_back(1 + rng() % (total - 1));
      std::sort(cuts.begin(), cuts.end());
      cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
      Batch batch;
      for (size_t i = 0; i + 1 < cuts.size(); ++i)
        batch.push_back({local, lo + cuts[i], remote_[region], ro + cuts[i], cuts[i + 1] - cuts[i]});
      std::shuffle(batch.begin(), batch.end(), rng);
      const bool write = rng() % 2;
      SCOPED_TRACE(std::string(write ? "write" : "read") + " of " + std::to_string(total) + " bytes in " +
                   std::to_string(batch.size()) + " pieces, local " + std::to_string(lo) + " remote " +
                   std::to_string(ro) + " region " + std::to_string(region) + " iteration " + std::to_string(it));
      if (write) {
        fill_random(lptr + lo, total, rng);
        auto f = ep_.write(batch);
        Status st = f.wait();
        ASSERT_TRUE(st.ok()) << st.to_string();
        EXPECT_EQ(f.bytes(), total);
        std::memcpy(mir.data() + ro, lptr + lo, total);
        expect_child_matches(region, ro, total);
      } else {
        std::vector<uint8_t> before(lptr, lptr + llen);
        std::memset(lptr + lo, 0xEE, total);
        auto f = ep_.read(batch);
        Status st = f.wait();
        ASSERT_TRUE(st.ok()) << st.to_string();
        EXPECT_EQ(f.bytes(), total);
        ASSERT_EQ(0, std::memcmp(lptr + lo, mir.data() + ro, total)) << "read returned wrong bytes";
        ASSERT_EQ(0, std::memcmp(lptr, before.data(), lo)) << "read wrote before its destination";
        ASSERT_EQ(0, std::memcmp(lptr + lo + total, before.data() + lo + total, llen - lo - total))
            << "read wrote past its destination";
      }
    }
    // Nothing outside the targeted ranges changed in the child.
    expect_child_matches_all();
  }

  std::unique_ptr<Child> child_;
  std::string blob_;
  std::unique_ptr<Engine> engine_;
  Endpoint ep_;
  RemoteHandle remote_[2];
  uint64_t remote_len_[2] = {0, 0};
  std::vector<uint8_t> mirror_[2];
};

TEST_P(Integration, RandomReadsAndWritesOnRegisteredHeap) {
  ChildConfig cfg;
  cfg.heap_bytes = 24 * kMiB;
  cfg.alloc_bytes = 1 * kMiB;
  start(cfg);
  std::vector<uint8_t> local(20 * kMiB);
  auto h = engine_->register_memory(local.data(), local.size());
  random_ops(h, local.data(), local.size(), 0, 40, 16 * kMiB, 1234);
}

TEST_P(Integration, SixtyFourMiBWriteAndRead) {
  ChildConfig cfg;
  cfg.heap_bytes = 64 * kMiB + 8192;
  cfg.alloc_bytes = 4096;
  start(cfg);
  std::vector<uint8_t> local(64 * kMiB + 4096);
  auto h = engine_->register_memory(local.data(), local.size());
  std::mt19937_64 rng(64);
  const uint64_t n = 64 * kMiB;
  uint64_t lo = 1 + rng() % 4095, ro = 1 + rng() % 8191;
  fill_random(local.data() + lo, n, rng);
  ASSERT_TRUE(ep_.write({{h, lo, remote_[0], ro, n}}).wait().ok());
  std::memcpy(mirror_[0].data() + ro, local.data() + lo, n);
  expect_child_matches(0, 0, remote_len_[0]);
  std::memset(local.data(), 0, local.size());
  uint64_t lo2 = rng() % 4096;
  ASSERT_TRUE(ep_.read({{h, lo2, remote_[0], ro, n}}).wait().ok());
  ASSERT_EQ(0, std::memcmp(local.data() + lo2, mirror_[0].data() + ro, n));
}

TEST_P(Integration, EngineAllocatedMemoryOnBothSides) {
  ChildConfig cfg;
  cfg.heap_bytes = 1 * kMiB;
  cfg.alloc_bytes = 12 * kMiB;
  start(cfg);
  auto a = engine_->allocate(10 * kMiB);
  random_ops(a.handle, static_cast<uint8_t*>(a.ptr), a.length, 1, 30, 8 * kMiB, 99);
  // Mixed: allocated local memory against the child's registered heap, and back.
  random_ops(a.handle, static_cast<uint8_t*>(a.ptr), a.length, 0, 10, 1 * kMiB, 100);
  engine_->free(a);
}

TEST_P(Integration, WriteWithImmIsVisibleWhenTheImmArrives) {
  ChildConfig cfg;
  cfg.heap_bytes = 16 * kMiB;
  start(cfg);
  std::vector<uint8_t> local(16 * kMiB);
  auto h = engine_->register_memory(local.data(), local.size());
  std::mt19937_64 rng(5);
  for (int i = 0; i < 12; ++i) {
    uint64_t total = 1 + rng() % (i % 3 == 0 ? 8 * kMiB : 64 * 1024);
    uint64_t ro = rng() % (remote_len_[0] - total + 1);
    fill_random(local.data(), total, rng);
    Batch b;
    uint64_t half = total / 2;
    if (half) b.push_back({h, 0, remote_[0], ro, half});
    b.push_back({h, half, remote_[0], ro + half, total - half});
    const uint32_t imm = 0xA0000000u + i;
    auto f = ep_.write_with_imm(b, imm);
    std::memcpy(mirror_[0].data() + ro, local.data(), total);
    // The child waits for the imm and checksums the target range the moment it arrives.
    auto r = child_->call(Cmd::kImmRecv, 0, ro, total);
    ASSERT_EQ(r.size(), 3u);
    EXPECT_EQ(static_cast<ErrorCode>(r[0]), ErrorCode::kOk);
    EXPECT_EQ(r[1], imm);
    EXPECT_EQ(r[2], fnv(mirror_[0].data() + ro, total)) << "imm arrived before all the bytes were visible";
    ASSERT_TRUE(f.wait().ok());
  }
  // Several in flight at once: exactly one imm each.
  std::vector<Future> fs;
  for (uint32_t i = 0; i < 8; ++i) fs.push_back(ep_.write_with_imm({{h, 0, remote_[0], i * 4096, 4096}}, 100 + i));
  std::vector<uint64_t> got;
  for (int i = 0; i < 8; ++i) {
    auto r = child_->call(Cmd::kImmRecv, 0, 0, 0);
    ASSERT_EQ(r.size(), 3u);
    EXPECT_EQ(r[0], 0u);
    got.push_back(r[1]);
  }
  for (auto& f : fs) EXPECT_TRUE(f.wait().ok());
  std::sort(got.begin(), got.end());
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(got[i], 100 + i);
  for (uint32_t i = 0; i < 8; ++i) std::memcpy(mirror_[0].data() + i * 4096, local.data(), 4096);
  expect_child_matches_all();
}

TEST_P(Integration, SendRecvMatchingBufferingAndTruncation) {
  ChildConfig cfg;
  cfg.heap_bytes = 16 * kMiB;
  start(cfg);
  std::vector<uint8_t> local(16 * kMiB);
  auto h = engine_->register_memory(local.data(), local.size());
  std::mt19937_64 rng(77);
  fill_random(local.data(), local.size(), rng);

  // (1) Recvs posted first: the k-th send lands in the k-th recv whatever the sizes.
  const uint64_t slot = 256 * 1024;
  const int n = 12;
  ASSERT_EQ(child_->call(Cmd::kPostRecvs, 0, n, slot, 0).size(), 1u);
  std::vector<uint64_t> sizes, offs;
  std::vector<Future> sends;
  for (int i = 0; i < n; ++i) {
    sizes.push_back(i == 0 ? 0 : 1 + rng() % slot);
    offs.push_back(rng() % (local.size() - slot));
    sends.push_back(ep_.send(h, offs.back(), sizes.back()));
  }
  for (auto& f : sends) ASSERT_TRUE(f.wait().ok());
  auto r = child_->call(Cmd::kWaitRecvs);
  ASSERT_EQ(r.size(), 2u * n);
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(r[2 * i], 0u) << "recv " << i;
    EXPECT_EQ(r[2 * i + 1], sizes[i]) << "recv " << i << " got the wrong message";
    EXPECT_EQ(child_->checksum(0, i * slot, sizes[i]), fnv(local.data() + offs[i], sizes[i])) << "recv " << i;
  }
  // (2) Unexpected messages: sent before any recv, buffered, then matched in order.
  sends.clear();
  sizes.clear();
  offs.clear();
  for (int i = 0; i < 6; ++i) {
    sizes.push_back(1 + rng() % (2 * kMiB));
    offs.push_back(rng() % (local.size() - sizes.back()));
    sends.push_back(ep_.send(h, offs.back(), sizes.back()));
  }
  for (auto& f : sends) ASSERT_TRUE(f.wait().ok());
  for (int i = 0; i < 6; ++i) {
    auto rr = child_->call(Cmd::kRecv, 0, 8 * kMiB, 2 * kMiB);
    ASSERT_EQ(rr.size(), 3u);
    EXPECT_EQ(rr[0], 0u);
    EXPECT_EQ(rr[1], sizes[i]);
    EXPECT_EQ(child_->checksum(0, 8 * kMiB, sizes[i]), fnv(local.data() + offs[i], sizes[i])) << "message " << i;
  }
  // (3) Truncation: a message larger than the posted recv fails both sides with kTruncated,
  // delivering the first `length` bytes and nothing past them.
  ASSERT_EQ(child_->call(Cmd::kFill, 0, 4242).size(), 1u);
  fill_pattern(mirror_[0].data(), mirror_[0].size(), 4242);
  ASSERT_EQ(child_->call(Cmd::kPostRecvs, 0, 1, 1000, 5000).size(), 1u);
  auto big = ep_.send(h, 0, 300000);
  auto tr = child_->call(Cmd::kWaitRecvs);
  ASSERT_EQ(tr.size(), 2u);
  EXPECT_EQ(static_cast<ErrorCode>(tr[0]), ErrorCode::kTruncated);
  EXPECT_EQ(tr[1], 1000u);
  Status bs = big.wait();
  EXPECT_EQ(bs.code, ErrorCode::kTruncated) << bs.to_string();
  std::memcpy(mirror_[0].data() + 5000, local.data(), 1000);
  expect_child_matches(0, 0, remote_len_[0]);
  // (4) The other direction: the child sends, we receive on our side of the endpoint.
  std::vector<uint8_t> in(4 * kMiB, 0);
  auto hin = engine_->register_memory(in.data(), in.size());
  std::vector<Future> recvs;
  recvs.push_back(ep_.recv(hin, 0, 2 * kMiB));
  recvs.push_back(ep_.recv(hin, 2 * kMiB, 100));
  auto s1 = child_->call(Cmd::kSend, 0, 12345, 2 * kMiB - 3);
  auto s2 = child_->call(Cmd::kSend, 0, 7, 50);
  ASSERT_EQ(s1.size(), 1u);
  ASSERT_EQ(s2.size(), 1u);
  EXPECT_EQ(s1[0], 0u);
  EXPECT_EQ(s2[0], 0u);
  ASSERT_TRUE(recvs[0].wait().ok());
  ASSERT_TRUE(recvs[1].wait().ok());
  EXPECT_EQ(recvs[0].bytes(), 2 * kMiB - 3);
  EXPECT_EQ(recvs[1].bytes(), 50u);
  EXPECT_EQ(0, std::memcmp(in.data(), mirror_[0].data() + 12345, 2 * kMiB - 3));
  EXPECT_EQ(0, std::memcmp(in.data() + 2 * kMiB, mirror_[0].data() + 7, 50));
}

TEST_P(Integration, TenThousandOutstandingSmallOps) {
  ChildConfig cfg;
  cfg.heap_bytes = 8 * kMiB;
  start(cfg);
  constexpr int kOps = 10000;
  constexpr uint64_t kSlot = 512;
  std::vector<uint8_t> local(kOps * kSlot);
  auto h = engine_->register_memory(local.data(), local.size());
  std::mt19937_64 rng(10000);
  fill_random(local.data(), local.size(), rng);
  std::vector<Future> fs;
  fs.reserve(kOps);
  std::vector<uint64_t> lens(kOps);
  for (int i = 0; i < kOps; ++i) {
    lens[i] = 1 + rng() % kSlot;
    uint64_t ro = static_cast<uint64_t>(kOps - 1 - i) * kSlot;
    fs.push_back(ep_.write({{h, i * kSlot, remote_[0], ro, lens[i]}}));
    std::memcpy(mirror_[0].data() + ro, local.data() + i * kSlot, lens[i]);
  }
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok());
  expect_child_matches_all();
  // And 10,000 outstanding reads back into a zeroed buffer.
  std::memset(local.data(), 0, local.size());
  fs.clear();
  for (int i = 0; i < kOps; ++i)
    fs.push_back(ep_.read({{h, i * kSlot, remote_[0], static_cast<uint64_t>(i) * kSlot, kSlot}}));
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok());
  ASSERT_EQ(0, std::memcmp(local.data(), mirror_[0].data(), local.size()));
}

TEST_P(Integration, SeveralEndpointsFromSeveralThreads) {
  ChildConfig cfg;
  cfg.heap_bytes = 16 * kMiB;
  cfg.alloc_bytes = 16 * kMiB;
  start(cfg);
  constexpr int kEndpoints = 3, kThreadsPer = 2, kThreads = kEndpoints * kThreadsPer;
  std::vector<Endpoint> eps{ep_};
  for (int i = 1; i < kEndpoints; ++i) eps.push_back(engine_->connect(blob_));
  // Each thread owns a window of one of the child's regions.
  const uint64_t window = 16 * kMiB / (kThreads / 2 + 1);
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      try {
      Endpoint ep = eps[t % kEndpoints];
      int region = t % 2;
      uint64_t base = (t / 2) * window;
      std::mt19937_64 rng(500 + t);
      std::vector<uint8_t> src(window), dst(window);
      auto hs = engine_->register_memory(src.data(), src.size());
      auto hd = engine_->register_memory(dst.data(), dst.size());
      for (int i = 0; i < 15; ++i) {
        uint64_t len = 1 + rng() % (i % 4 == 0 ? window : 65536);
        uint64_t off = rng() % (window - len + 1);
        fill_random(src.data() + off, len, rng);
        auto w = ep.write({{hs, off, remote_[region], base + off, len}});
        if (!w.wait().ok()) failures++;
        std::memset(dst.data(), 0, len);
        auto r = ep.read({{hd, 0, remote_[region], base + off, len}});
        if (!r.wait().ok()) failures++;
        if (std::memcmp(dst.data(), src.data() + off, len) != 0) failures++;
        std::memcpy(mirror_[region].data() + base + off, src.data() + off, len);  // disjoint windows
      }
      engine_->unregister_memory(hs);
      engine_->unregister_memory(hd);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "thread " << t << ": " << e.what();
        failures++;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
  expect_child_matches_all();
  auto n = child_->call(Cmd::kEndpoints);
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0], static_cast<uint64_t>(kEndpoints)) << "the child did not accept every endpoint";
}

TEST_P(Integration, ConnectByListenAddressAndRefresh) {
  ChildConfig cfg;
  start(cfg);
  auto info = nlohmann::json::parse(blob_);
  std::string addr = info["listen"].get<std::string>();
  auto ep2 = engine_->connect(addr);
  EXPECT_EQ(ep2.peer_engine_id(), ep_.peer_engine_id());
  ASSERT_TRUE(ep2.remote_region("heap").has_value());
  std::vector<uint8_t> local(4096, 0x42);
  auto h = engine_->register_memory(local.data(), local.size());
  ASSERT_TRUE(ep2.write({{h, 0, remote_[0], 100, 4096}}).wait().ok());
  std::memcpy(mirror_[0].data() + 100, local.data(), 4096);
  expect_child_matches_all();
}

INSTANTIATE_TEST_SUITE_P(Conformance, Integration, ::testing::ValuesIn(transports_under_test()), transport_name);

}  // namespace
