// RDMA conformance: every operation over the rdma transport (or the one named by
// SLUICE_TEST_TRANSPORT, so the checks themselves can be validated over tcp on any host).
// Needs an RDMA device: tests/rdma/run.sh runs it inside a SoftRoCE guest. Without one every
// test is skipped.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fstream>
#include <map>
#include <utility>

#include <nlohmann/json.hpp>

#include "sluice/sluice.hpp"

using namespace std::chrono_literals;
using namespace sluice;

namespace {

std::string g_transport = "rdma";
std::string g_self;

EngineConfig cfg(int channels = 2, std::chrono::milliseconds op_timeout = 20s) {
  EngineConfig c;
  c.transports = {g_transport};
  c.channels = channels;
  c.op_timeout = op_timeout;
  c.connect_timeout = 10s;
  if (const char* ip = std::getenv("SLUICE_TEST_LISTEN_HOST")) c.listen_host = ip;
  return c;
}

void fill(uint8_t* p, uint64_t n, std::mt19937_64& rng) {
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

bool rdma_available(std::string* why) {
  try {
    Engine e(cfg());
    return true;
  } catch (const Error& e) {
    *why = e.what();
    return false;
  }
}

class Rdma : public ::testing::TestWithParam<int> {
 protected:
  static constexpr uint64_t kBytes = 8ull << 20;
  void SetUp() override {
    std::string why;
    if (!rdma_available(&why)) GTEST_SKIP() << "transport " << g_transport << " unavailable: " << why;
    a_ = std::make_unique<Engine>(cfg(GetParam()));
    b_ = std::make_unique<Engine>(cfg(GetParam()));
    la_.assign(kBytes, 0);
    lb_.assign(kBytes, 0);
    ha_ = a_->register_memory(la_.data(), la_.size(), Location::host(), "a");
    hb_ = b_->register_memory(lb_.data(), lb_.size(), Location::host(), "b");
    ep_ = a_->connect(b_->local_info());
    ASSERT_EQ(ep_.transport(), g_transport);
    ASSERT_EQ(ep_.channels(), GetParam());
    auto acc = b_->accept(10s);
    ASSERT_TRUE(acc.has_value());
    peer_ = *acc;
    rb_ = *ep_.remote_region("b");
    ra_ = *peer_.remote_region("a");
  }
  void TearDown() override {
    ep_ = {};
    peer_ = {};
    if (a_) a_->close();
    if (b_) b_->close();
  }
  std::unique_ptr<Engine> a_, b_;
  std::vector<uint8_t> la_, lb_;
  MemoryHandle ha_, hb_;
  RemoteHandle rb_, ra_;
  Endpoint ep_, peer_;
};

TEST_P(Rdma, RandomWritesReadsWithOffsets) {
  std::mt19937_64 rng(1 + GetParam());
  for (int i = 0; i < 60; ++i) {
    uint64_t len = 1 + rng() % ((i % 3 == 0) ? 64 : (i % 3 == 1) ? 8192 : (1 << 20));
    uint64_t lo = rng() % (kBytes / 2 - len + 1), ro = rng() % (kBytes - len + 1);
    fill(la_.data() + lo, len, rng);
    std::vector<uint8_t> before = lb_;
    auto f = ep_.write({{ha_, lo, rb_, ro, len}});
    ASSERT_TRUE(f.wait().ok()) << f.status().to_string();
    ASSERT_EQ(0, std::memcmp(lb_.data() + ro, la_.data() + lo, len)) << "len " << len;
    ASSERT_EQ(0, std::memcmp(lb_.data(), before.data(), ro));
    ASSERT_EQ(0, std::memcmp(lb_.data() + ro + len, before.data() + ro + len, kBytes - ro - len));
    uint64_t back = kBytes / 2 + rng() % (kBytes / 2 - len + 1);
    auto r = ep_.read({{ha_, back, rb_, ro, len}});
    ASSERT_TRUE(r.wait().ok()) << r.status().to_string();
    ASSERT_EQ(0, std::memcmp(la_.data() + back, lb_.data() + ro, len));
  }
}

TEST_P(Rdma, MultiAssignmentBatchesStripeOverQps) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 8; ++round) {
    Batch batch;
    uint64_t at = 0;
    int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      uint64_t len = 1 + rng() % (256 << 10);
      if (at + len > kBytes / 2) break;
      batch.push_back({ha_, at, rb_, kBytes / 2 + at, len});
      at += len + rng() % 100;
    }
    fill(la_.data(), kBytes / 2, rng);
    auto f = round % 2 ? ep_.write(batch) : ep_.write_with_imm(batch, 1000 + round);
    ASSERT_TRUE(f.wait().ok()) << f.status().to_string();
    if (round % 2 == 0) {
      auto imm = peer_.imm_recv();
      ASSERT_TRUE(imm.wait_for(10s));
      EXPECT_EQ(imm.imm(), 1000u + round);
    }
    for (auto& a : batch) ASSERT_EQ(0, std::memcmp(lb_.data() + a.remote_offset, la_.data() + a.local_offset, a.length));
    // and back with one read batch
    Batch rd;
    for (auto& a : batch) rd.push_back({ha_, kBytes / 2 + a.local_offset, rb_, a.remote_offset, a.length});
    ASSERT_TRUE(ep_.read(rd).wait().ok());
    for (auto& a : batch)
      ASSERT_EQ(0, std::memcmp(la_.data() + kBytes / 2 + a.local_offset, la_.data() + a.local_offset, a.length));
  }
}

TEST_P(Rdma, WriteWithImmDataVisibleAndOrdered) {
  std::mt19937_64 rng(9);
  // Single-lane batches: imms arrive in submission order.
  const int n = 300;
  std::vector<Future> fs;
  for (int i = 0; i < n; ++i) {
    uint64_t off = uint64_t(i) * 4096;
    fill(la_.data() + off, 4096, rng);
    fs.push_back(ep_.write_with_imm({{ha_, off, rb_, off, uint64_t(1 + (i * 37) % 4096)}}, i));
  }
  // rdma promises submission order for single-lane batches (their imm rides on QP 0);
  // other transports only exactly-once.
  std::vector<bool> seen(n, false);
  for (int i = 0; i < n; ++i) {
    auto imm = peer_.imm_recv();
    ASSERT_TRUE(imm.wait_for(20s)) << i;
    ASSERT_TRUE(imm.status().ok()) << imm.status().to_string();
    uint32_t k = imm.imm();
    if (g_transport == "rdma") ASSERT_EQ(k, uint32_t(i));
    ASSERT_LT(k, uint32_t(n));
    ASSERT_FALSE(seen[k]) << "imm " << k << " twice";
    seen[k] = true;
    uint64_t off = uint64_t(k) * 4096, len = 1 + (k * 37) % 4096;
    ASSERT_EQ(0, std::memcmp(lb_.data() + off, la_.data() + off, len)) << "imm " << k << " before its bytes";
  }
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok());
  // Striped batches (2 MiB > stripe threshold): exactly one imm each, after every byte.
  for (int i = 0; i < 6; ++i) {
    fill(la_.data(), 2 << 20, rng);
    auto f = ep_.write_with_imm({{ha_, 0, rb_, 4 << 20, 2 << 20}}, 7000 + i);
    auto imm = peer_.imm_recv();
    ASSERT_TRUE(imm.wait_for(20s));
    EXPECT_EQ(imm.imm(), 7000u + i);
    ASSERT_EQ(0, std::memcmp(lb_.data() + (4 << 20), la_.data(), 2 << 20));
    ASSERT_TRUE(f.wait().ok());
  }
  auto extra = peer_.imm_recv();
  EXPECT_FALSE(extra.wait_for(300ms)) << "an extra imm arrived";
}

TEST_P(Rdma, ImmOrderHoldsAcrossStripedAndSingleLaneBatches) {
  // Striped batches post their imm after their data completes; single-lane ones chain it on
  // QP 0. Interleaved without waiting, the imms must still arrive in submission order.
  std::mt19937_64 rng(17);
  fill(la_.data(), kBytes, rng);
  const int n = 60;
  std::vector<Future> fs;
  for (int i = 0; i < n; ++i) {
    uint64_t len = i % 3 == 0 ? (1 << 20) + 4096 * (i % 7) : 1 + rng() % 2048;
    uint64_t off = (uint64_t(i) * (1 << 20) + 8192 * (i % 5)) % (kBytes - (2 << 20));
    fs.push_back(ep_.write_with_imm({{ha_, off, rb_, off, len}}, 100 + i));
  }
  for (int i = 0; i < n; ++i) {
    auto imm = peer_.imm_recv();
    ASSERT_TRUE(imm.wait_for(20s)) << i;
    ASSERT_TRUE(imm.status().ok()) << imm.status().to_string();
    if (g_transport == "rdma") ASSERT_EQ(imm.imm(), uint32_t(100 + i)) << "imm out of submission order";
  }
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok()) << f.status().to_string();
  auto extra = peer_.imm_recv();
  EXPECT_FALSE(extra.wait_for(200ms)) << "an extra imm arrived";
}

// Packets a device has sent (SoftRoCE: hw_counters/sent_pkts; others: port counters). The
// kernel caches hw counters for `hw_counters/lifespan` ms (12 on SoftRoCE), so wait that out
// first, or two reads around a short transfer see the same value.
uint64_t sent_packets(const std::string& dev, int port) {
  std::this_thread::sleep_for(30ms);
  std::string base = "/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port);
  for (const char* f : {"/hw_counters/sent_pkts", "/counters/port_xmit_packets"}) {
    std::ifstream in(base + f);
    uint64_t v;
    if (in >> v) return v;
  }
  return 0;
}

TEST_P(Rdma, StripedBatchesUseEveryRail) {
  if (g_transport != "rdma") GTEST_SKIP() << "rdma only";
  auto info = nlohmann::json::parse(a_->local_info());
  auto rails = info["transports"]["rdma"]["rails"];
  if (rails.size() < 2) GTEST_SKIP() << "one rail (select several devices with SLUICE_IB_HCA to test striping)";
  if (GetParam() < static_cast<int>(rails.size())) GTEST_SKIP() << GetParam() << " channel(s) for " << rails.size() << " rails";
  std::vector<uint64_t> before;
  for (auto& r : rails) before.push_back(sent_packets(r["dev"], r["port"]));
  std::mt19937_64 rng(23);
  for (int i = 0; i < 4; ++i) {
    fill(la_.data(), 4 << 20, rng);
    ASSERT_TRUE(ep_.write({{ha_, 0, rb_, 0, 4 << 20}}).wait().ok());
    ASSERT_EQ(0, std::memcmp(lb_.data(), la_.data(), 4 << 20));
  }
  uint64_t total = 0;
  std::vector<uint64_t> delta;
  for (size_t r = 0; r < rails.size(); ++r) {
    delta.push_back(sent_packets(rails[r]["dev"], rails[r]["port"]) - before[r]);
    total += delta.back();
  }
  ASSERT_GT(total, 0u) << "no packet counters on these devices";
  for (size_t r = 0; r < rails.size(); ++r) {
    std::printf("      rail %s: %llu packets of %llu\n", rails[r]["dev"].get<std::string>().c_str(),
                (unsigned long long)delta[r], (unsigned long long)total);
    EXPECT_GE(delta[r] * rails.size() * 2, total) << "rail " << rails[r]["dev"] << " carried less than half its share";
  }
}

// Pieces that continue each other on the remote side share work requests: as gather entries
// when they are scattered locally, as one entry when they are contiguous locally too. Counted
// in packets on the device (every WR is at least one packet and one ACK), against an endpoint
// created with SLUICE_RDMA_MAX_SGE=1, which may only merge locally contiguous pieces.
TEST_P(Rdma, ContiguousRemotePiecesShareWorkRequests) {
  if (g_transport != "rdma") GTEST_SKIP() << "rdma only";
  auto info = nlohmann::json::parse(a_->local_info());
  auto rail = info["transports"]["rdma"]["rails"][0];
  if (GetParam() != 1) GTEST_SKIP() << "runs once, at 1 channel";
  ::setenv("SLUICE_RDMA_MAX_SGE", "1", 1);
  Endpoint one_sge = a_->connect(b_->local_info());
  auto peer1 = b_->accept(10s);
  ::unsetenv("SLUICE_RDMA_MAX_SGE");
  ASSERT_TRUE(peer1.has_value());
  constexpr int kPieces = 64;
  constexpr uint64_t kPiece = 200;  // 64 x 200 B: 12.5 KiB, contiguous at the target
  std::mt19937_64 rng(41);
  // Writes kPieces pieces scattered in reverse order locally (4 KiB apart) to one contiguous
  // remote range (or reads them back); checks the bytes; returns the packets the device sent.
  auto run = [&](Endpoint& ep, bool read) -> uint64_t {
    fill(la_.data(), kPieces * 4096, rng);
    fill(lb_.data(), kPieces * kPiece, rng);
    Batch b;
    for (int i = 0; i < kPieces; ++i) b.push_back({ha_, uint64_t(kPieces - 1 - i) * 4096, rb_, 1000 + i * kPiece, kPiece});
    uint64_t before = sent_packets(rail["dev"], rail["port"]);
    Status st = read ? ep.read(b).wait() : ep.write(b).wait();
    EXPECT_TRUE(st.ok()) << st.to_string();
    uint64_t packets = sent_packets(rail["dev"], rail["port"]) - before;
    for (int i = 0; i < kPieces; ++i)
      EXPECT_EQ(0, std::memcmp(la_.data() + (kPieces - 1 - i) * 4096, lb_.data() + 1000 + i * kPiece, kPiece))
          << (read ? "read" : "write") << " piece " << i;
    return packets;
  };
  for (bool read : {false, true}) {
    uint64_t separate = run(one_sge, read), gathered = run(ep_, read);
    std::printf("      %s of %d scattered pieces: %llu packets with 1 gather entry per WR, %llu with several\n",
                read ? "read" : "write", kPieces, (unsigned long long)separate, (unsigned long long)gathered);
    if (separate == 0) GTEST_SKIP() << "no packet counters on " << rail["dev"];
    EXPECT_GE(separate, uint64_t(kPieces)) << "one WR per piece is at least a packet each";
    EXPECT_LT(gathered * 2, separate) << "contiguous remote pieces did not share work requests";
  }
  // Contiguous on both sides: one entry grows, even with SLUICE_RDMA_MAX_SGE=1.
  Batch b;
  fill(la_.data(), kPieces * kPiece, rng);
  for (int i = 0; i < kPieces; ++i) b.push_back({ha_, uint64_t(i) * kPiece, rb_, 3000 + i * kPiece, kPiece});
  uint64_t before = sent_packets(rail["dev"], rail["port"]);
  ASSERT_TRUE(one_sge.write(b).wait().ok());
  uint64_t packets = sent_packets(rail["dev"], rail["port"]) - before;
  ASSERT_EQ(0, std::memcmp(lb_.data() + 3000, la_.data(), kPieces * kPiece));
  EXPECT_LT(packets, uint64_t(kPieces)) << "locally and remotely contiguous pieces were not merged";
}

TEST_P(Rdma, PiecesSplitAtTheMessageSizeLimit) {
  if (g_transport != "rdma") GTEST_SKIP() << "rdma only";
  // Endpoints created while SLUICE_RDMA_MAX_WR_BYTES is set split every piece into WRs of at
  // most that size (as for a port whose max_msg_sz is smaller than a piece).
  ::setenv("SLUICE_RDMA_MAX_WR_BYTES", "4096", 1);
  Endpoint ep = a_->connect(b_->local_info());
  auto peer = b_->accept(10s);
  ::unsetenv("SLUICE_RDMA_MAX_WR_BYTES");
  ASSERT_TRUE(peer.has_value());
  std::mt19937_64 rng(31);
  fill(la_.data(), 3 << 20, rng);
  // 3 MiB + 5 bytes in one piece: 769 WRs; back-pressure holds the ones beyond the queue.
  const uint64_t len = (3 << 20) + 5;
  auto w = ep.write_with_imm({{ha_, 0, rb_, 1 << 20, len}}, 77);
  ASSERT_TRUE(w.wait().ok()) << w.status().to_string();
  auto imm = peer->imm_recv();
  ASSERT_TRUE(imm.wait_for(10s));
  EXPECT_EQ(imm.imm(), 77u);
  ASSERT_EQ(0, std::memcmp(lb_.data() + (1 << 20), la_.data(), len));
  auto r = ep.read({{ha_, 4 << 20, rb_, 1 << 20, len}});
  ASSERT_TRUE(r.wait().ok()) << r.status().to_string();
  ASSERT_EQ(0, std::memcmp(la_.data() + (4 << 20), la_.data(), len));
  // and a message: the receiver's RDMA READ is split too
  auto rv = peer->recv(hb_, 0, len);
  auto sd = ep.send(ha_, 0, len);
  ASSERT_TRUE(sd.wait().ok()) << sd.status().to_string();
  ASSERT_TRUE(rv.wait().ok()) << rv.status().to_string();
  ASSERT_EQ(0, std::memcmp(lb_.data(), la_.data(), len));
}

TEST_P(Rdma, SendRecvRandomSizesBothOrders) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 60; ++i) {
    uint64_t len = rng() % ((i % 2) ? 100 : (2 << 20));
    if (len == 0) len = 1;
    fill(la_.data(), len, rng);
    uint64_t ro = rng() % (kBytes - len + 1);
    Future r, s;
    if (i % 3 == 0) {  // unexpected: send first
      s = ep_.send(ha_, 0, len);
      std::this_thread::sleep_for(1ms);
      r = peer_.recv(hb_, ro, len);
    } else {
      r = peer_.recv(hb_, ro, len + rng() % 100);
      s = ep_.send(ha_, 0, len);
    }
    ASSERT_TRUE(s.wait().ok()) << s.status().to_string();
    ASSERT_TRUE(r.wait().ok()) << r.status().to_string();
    ASSERT_EQ(r.bytes(), len);
    ASSERT_EQ(0, std::memcmp(lb_.data() + ro, la_.data(), len));
  }
  // The other direction, many in flight.
  std::vector<Future> rs, ss;
  for (int i = 0; i < 500; ++i) rs.push_back(ep_.recv(ha_, uint64_t(i) * 1024, 1024));
  for (int i = 0; i < 500; ++i) {
    lb_[uint64_t(i) * 512] = static_cast<uint8_t>(i);
    ss.push_back(peer_.send(hb_, uint64_t(i) * 512, 512));
  }
  for (int i = 0; i < 500; ++i) {
    ASSERT_TRUE(ss[i].wait().ok());
    ASSERT_TRUE(rs[i].wait().ok());
    ASSERT_EQ(la_[uint64_t(i) * 1024], static_cast<uint8_t>(i));
  }
}

TEST_P(Rdma, SendTruncatedFailsBothSides) {
  auto r = peer_.recv(hb_, 0, 100);
  auto s = ep_.send(ha_, 0, 1000);
  EXPECT_EQ(r.wait().code, ErrorCode::kTruncated);
  EXPECT_EQ(s.wait().code, ErrorCode::kTruncated);
  // and the endpoint still works
  auto r2 = peer_.recv(hb_, 0, 100);
  ASSERT_TRUE(ep_.send(ha_, 0, 50).wait().ok());
  ASSERT_TRUE(r2.wait().ok());
}

TEST_P(Rdma, SixtyFourMiBMessages) {
  const uint64_t big = 64ull << 20;
  std::vector<uint8_t> src(big), dst(big);
  std::mt19937_64 rng(4);
  fill(src.data(), big, rng);
  auto hs = a_->register_memory(src.data(), big);
  auto hd = b_->register_memory(dst.data(), big, Location::host(), "big");
  ep_.refresh_remote_regions();
  auto rd = *ep_.remote_region("big");
  auto w = ep_.write({{hs, 0, rd, 0, big}});
  ASSERT_TRUE(w.wait().ok()) << w.status().to_string();
  ASSERT_EQ(0, std::memcmp(src.data(), dst.data(), big));
  std::memset(src.data(), 0, big);
  auto r = ep_.read({{hs, 0, rd, 0, big}});
  ASSERT_TRUE(r.wait().ok()) << r.status().to_string();
  ASSERT_EQ(0, std::memcmp(src.data(), dst.data(), big));
  fill(src.data(), big, rng);
  auto rv = peer_.recv(hd, 0, big);
  auto sd = ep_.send(hs, 0, big);
  ASSERT_TRUE(sd.wait().ok()) << sd.status().to_string();
  ASSERT_TRUE(rv.wait().ok());
  ASSERT_EQ(0, std::memcmp(src.data(), dst.data(), big));
  b_->unregister_memory(hd);
  a_->unregister_memory(hs);
}

TEST_P(Rdma, ThousandsOfOutstandingWrs) {
  // Far more WRs than the send queues hold: the backlog must post them as slots free up.
  const int n = 6000;
  std::vector<Future> fs;
  fs.reserve(n);
  for (int i = 0; i < n; ++i) {
    uint64_t off = uint64_t(i) * 64;
    la_[off] = static_cast<uint8_t>(i * 7);
    fs.push_back(i % 2 ? ep_.write({{ha_, off, rb_, off, 64}}) : ep_.write({{ha_, off, rb_, off, 64}, {ha_, off + 1, rb_, off + 1, 8}}));
  }
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok()) << f.status().to_string();
  for (int i = 0; i < n; ++i) ASSERT_EQ(lb_[uint64_t(i) * 64], static_cast<uint8_t>(i * 7));
  // one batch with thousands of pieces
  Batch b;
  for (int i = 0; i < 5000; ++i) b.push_back({ha_, uint64_t(i) * 100, rb_, uint64_t(i) * 100, 50});
  ASSERT_TRUE(ep_.read(b).wait().ok());
}

TEST_P(Rdma, RegionRegisteredAfterConnectAndCache) {
  std::vector<uint8_t> late(1 << 20, 0);
  auto hl = b_->register_memory(late.data(), late.size(), Location::host(), "late");
  ep_.refresh_remote_regions();
  auto rl = ep_.remote_region("late");
  ASSERT_TRUE(rl.has_value());
  std::memset(la_.data(), 0x5A, 4096);
  auto f = ep_.write({{ha_, 0, *rl, 100, 4096}});
  ASSERT_TRUE(f.wait().ok()) << f.status().to_string();
  EXPECT_EQ(late[100], 0x5A);
  EXPECT_EQ(late[4195], 0x5A);
  // Registering the same range again (a second handle) reuses the registration.
  auto h2 = a_->register_memory(la_.data(), la_.size());
  ASSERT_TRUE(ep_.write({{h2, 0, rb_, 0, 100}}).wait().ok());
  a_->unregister_memory(h2);
  b_->unregister_memory(hl);
}

TEST_P(Rdma, StaleRegionIsRefusedAndEndpointStaysUsable) {
  std::vector<uint8_t> victim(1 << 20, 0);
  auto snap = victim;
  auto hv = b_->register_memory(victim.data(), victim.size(), Location::host(), "victim");
  ep_.refresh_remote_regions();
  auto rv = *ep_.remote_region("victim");
  ASSERT_TRUE(ep_.read({{ha_, 0, rv, 0, 4096}}).wait().ok());
  // unregister_memory returns only once the peer dropped the rkey and the MR is gone.
  b_->unregister_memory(hv);
  std::memset(la_.data(), 0x42, 4096);
  auto f = ep_.write({{ha_, 0, rv, 0, 4096}});
  Status st = f.wait();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(victim, snap);
  std::printf("      stale region -> %s\n", st.to_string().c_str());
  ASSERT_TRUE(ep_.write({{ha_, 0, rb_, 0, 100}}).wait().ok()) << "endpoint broken by a stale region";
}

TEST_P(Rdma, BadRkeyRemoteAccessErrorReachesCallerEngineKeepsRunning) {
  if (g_transport != "rdma") GTEST_SKIP();
  // Fault injection: every rkey of the next endpoint is corrupted, so the target's NIC
  // answers with a remote access NAK; the QP goes to the error state.
  ::setenv("SLUICE_RDMA_FAULT_RKEY_XOR", "0x5a5a5a5a", 1);
  auto bad = a_->connect(b_->local_info());
  ::unsetenv("SLUICE_RDMA_FAULT_RKEY_XOR");
  auto acc = b_->accept(10s);
  ASSERT_TRUE(acc.has_value());
  auto f = bad.write({{ha_, 0, rb_, 0, 4096}});
  Status st = f.wait();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message.find("remote access"), std::string::npos) << st.message;
  std::printf("      bad rkey -> %s\n", st.to_string().c_str());
  // that endpoint is dead; later ops fail at once, the engines and other endpoints work
  try {
    EXPECT_FALSE(bad.write({{ha_, 0, rb_, 0, 16}}).wait().ok());
  } catch (const Error&) {  // refused at once: the endpoint is already marked failed
  }
  ASSERT_TRUE(ep_.write({{ha_, 0, rb_, 0, 1000}}).wait().ok());
  auto ep2 = a_->connect(b_->local_info());
  ASSERT_TRUE(b_->accept(10s).has_value());
  std::memset(la_.data(), 0x77, 1000);
  ASSERT_TRUE(ep2.write({{ha_, 0, rb_, 0, 1000}}).wait().ok());
  EXPECT_EQ(lb_[999], 0x77);
}

TEST_P(Rdma, UnregisterdLocalGpuLikeRegionFailsCleanly) {
  // A "cuda" region the device cannot register (a bogus device pointer, no GPU here): the op
  // fails with the registration error and the endpoint stays usable.
  if (g_transport != "rdma") GTEST_SKIP();
  void* bogus = reinterpret_cast<void*>(uintptr_t(0x7f0000000000ull));
  MemoryHandle hg;
  try {
    hg = a_->register_memory(bogus, 1 << 20, Location::cuda(0));
  } catch (const Error& e) {
    GTEST_SKIP() << "engine refuses cuda regions here: " << e.what();
  }
  Future f;
  try {
    f = ep_.write({{hg, 0, rb_, 0, 4096}});
  } catch (const Error& e) {
    std::printf("      refused at submit: %s\n", e.what());
    return;
  }
  Status st = f.wait();
  EXPECT_FALSE(st.ok());
  std::printf("      gpu registration failure -> %s\n", st.to_string().c_str());
  ASSERT_TRUE(ep_.write({{ha_, 0, rb_, 0, 100}}).wait().ok());
}

// Runs this binary as a peer process (--peer-target: an engine with a 32 MiB region "sink")
// and returns its pid; *addr gets its listen address, empty if it did not start.
pid_t spawn_peer_target(int channels, std::string* addr) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) return -1;
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(pipefd[1], 1);
    std::string ch = std::to_string(channels);
    ::execl(g_self.c_str(), g_self.c_str(), "--peer-target", ch.c_str(), (char*)nullptr);
    ::_exit(127);
  }
  ::close(pipefd[1]);
  char c;
  while (::read(pipefd[0], &c, 1) == 1 && c != '\n') *addr += c;
  ::close(pipefd[0]);
  return pid;
}

// A peer target process and an endpoint to its region "sink", proven by one 4 KiB write.
struct SpawnedTarget {
  pid_t pid = -1;
  std::unique_ptr<Engine> engine;
  std::vector<uint8_t> buf;
  MemoryHandle h;
  Endpoint ep;
  RemoteHandle rt;
};

void connect_spawned(int channels, std::chrono::milliseconds op_timeout, size_t bytes, SpawnedTarget* t) {
  std::string addr;
  t->pid = spawn_peer_target(channels, &addr);
  ASSERT_FALSE(addr.empty()) << "child did not start";
  t->engine = std::make_unique<Engine>(cfg(channels, op_timeout));
  t->buf.assign(bytes, 1);
  t->h = t->engine->register_memory(t->buf.data(), t->buf.size());
  t->ep = t->engine->connect(addr);
  t->rt = *t->ep.remote_region("sink");
  ASSERT_TRUE(t->ep.write({{t->h, 0, t->rt, 0, 4096}}).wait().ok());
}

// Receive-not-ready NAKs this host's devices received (SoftRoCE hw counter; -1: none).
int64_t rnr_naks_received() {
  int64_t total = -1;
  for (const char* dev : {"rxe0", "rxe1", "rxe2", "rxe3"}) {
    std::ifstream in(std::string("/sys/class/infiniband/") + dev + "/ports/1/hw_counters/rcvd_rnr_err");
    int64_t v;
    if (in >> v) total = (total < 0 ? 0 : total) + v;
  }
  return total;
}

TEST_P(Rdma, ImmFloodAgainstAStoppedReceiverNeverMeetsRnr) {
  if (g_self.empty() || g_transport != "rdma") GTEST_SKIP();
  if (GetParam() != 2) GTEST_SKIP() << "run with 2 channels only (one stopped process per suite is enough)";
  // The receiver process is stopped (SIGSTOP): its NIC keeps acking imm writes and consuming
  // receive slots, but nothing reposts them. The sender must stop at the receiver's credit
  // instead of running into receiver-not-ready NAKs, and finish once the receiver runs again.
  SpawnedTarget t;
  ASSERT_NO_FATAL_FAILURE(connect_spawned(GetParam(), 30s, 1 << 20, &t));
  const pid_t pid = t.pid;
  Endpoint& ep = t.ep;
  const MemoryHandle h = t.h;
  const RemoteHandle rt = t.rt;
  const int64_t rnr_before = rnr_naks_received();
  ASSERT_EQ(0, ::kill(pid, SIGSTOP));
  const int n = 2000;  // more imm writes than the receiver has receive slots (1024)
  std::vector<Future> fs;
  for (int i = 0; i < n; ++i) fs.push_back(ep.write_with_imm({{h, uint64_t(i) * 8, rt, uint64_t(i) * 8, 8}}, i));
  std::this_thread::sleep_for(1500ms);
  int done_while_stopped = 0;
  for (auto& f : fs) done_while_stopped += f.test();
  const int64_t rnr_stopped = rnr_naks_received();
  ASSERT_EQ(0, ::kill(pid, SIGCONT));
  for (auto& f : fs) {
    ASSERT_TRUE(f.wait_for(30s)) << "an imm write never completed after the receiver resumed";
    ASSERT_TRUE(f.status().ok()) << f.status().to_string();
  }
  const int64_t rnr_after = rnr_naks_received();
  std::printf("      %d of %d imm writes done while the receiver was stopped; RNR NAKs received: %lld -> %lld -> %lld\n",
              done_while_stopped, n, (long long)rnr_before, (long long)rnr_stopped, (long long)rnr_after);
  EXPECT_LT(done_while_stopped, 1024) << "more imm writes completed than the receiver has slots";
  EXPECT_GT(done_while_stopped, 0);
  if (rnr_before >= 0) EXPECT_EQ(rnr_after, rnr_before) << "the sender met receiver-not-ready NAKs";
  ::kill(pid, SIGKILL);
  int status;
  ::waitpid(pid, &status, 0);
}

TEST_P(Rdma, PeerKilledMidTransferFailsPendingOps) {
  if (g_self.empty()) GTEST_SKIP();
  SpawnedTarget t;
  ASSERT_NO_FATAL_FAILURE(connect_spawned(GetParam(), 5s, 32 << 20, &t));
  const pid_t pid = t.pid;
  Engine& e = *t.engine;
  Endpoint& ep = t.ep;
  const MemoryHandle h = t.h;
  const RemoteHandle rt = t.rt;
  auto recv = ep.recv(h, 0, 100);  // a recv the dead peer will never satisfy
  std::vector<Future> fs;
  auto t0 = std::chrono::steady_clock::now();
  std::atomic<bool> killing{false}, killed{false};
  std::thread killer([&] {
    std::this_thread::sleep_for(300ms);
    killing = true;
    ::kill(pid, SIGKILL);
    killed = true;
  });
  // Keep operations in flight until well after the kill (under emulation one submission
  // can take long, so the loop is not bounded by wall time alone).
  auto t_end = std::chrono::steady_clock::time_point::max();
  // Under emulation the ops submitted before the kill may all finish before it (a 4-channel
  // write of 32 MiB can take the whole 300 ms); the dead peer then shows as a refused
  // submission, which counts as a failure as much as a failed future does.
  int refused = 0;
  while (std::chrono::steady_clock::now() < t_end) {
    if (killed && t_end == std::chrono::steady_clock::time_point::max())
      t_end = std::chrono::steady_clock::now() + 300ms;
    try {
      fs.push_back(ep.write({{h, 0, rt, 0, 32 << 20}}));
      fs.push_back(ep.read({{h, 0, rt, 0, 1 << 20}}));
    } catch (const Error& err) {
      EXPECT_TRUE(killing.load()) << "a submission was refused before the peer was killed: " << err.what();
      ++refused;  // endpoint already failed
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  killer.join();
  int failed = 0;
  for (auto& f : fs) {
    ASSERT_TRUE(f.wait_for(15s)) << "a pending op outlived the dead peer";
    failed += !f.status().ok();
  }
  ASSERT_TRUE(recv.wait_for(15s));
  EXPECT_FALSE(recv.status().ok());
  auto dt = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  std::printf("      %zu ops, %d failed, %d submission refused, all done %lld ms after start; last: %s\n", fs.size(),
              failed, refused, (long long)dt, fs.empty() ? "-" : fs.back().status().to_string().c_str());
  EXPECT_GT(failed + refused, 0) << "every op succeeded and no submission was refused after the peer died";
  int status;
  ::waitpid(pid, &status, 0);
  // and the engine still connects elsewhere
  Engine other(cfg(GetParam()));
  std::vector<uint8_t> ob(4096);
  other.register_memory(ob.data(), ob.size(), Location::host(), "o");
  auto ep2 = e.connect(other.local_info());
  ASSERT_TRUE(ep2.write({{h, 0, *ep2.remote_region("o"), 0, 4096}}).wait().ok());
}

// The thin post path's rdma specifics (the shared Conformance/Post suite covers the
// contract): signals are remote atomics, posts share QP 0 with transfers, a NIC error reaches
// flush.
template <class F>
ErrorCode code_of(F&& fn, std::string* message = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.code();
  }
  return ErrorCode::kOk;
}

uint64_t load_counter(const std::vector<uint8_t>& mem, uint64_t offset) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(mem.data() + offset), __ATOMIC_ACQUIRE);
}

TEST_P(Rdma, PostSignalsFromTwoEndpointsAddAtomically) {
  if (g_transport != "rdma") GTEST_SKIP() << "rdma only";
  ASSERT_TRUE(ep_.capabilities().rma_post && ep_.capabilities().signal);
  // Two endpoints raise one counter at once: a read-modify-write done by anything but the
  // responder's atomic unit would lose increments.
  constexpr uint64_t kSem = 128;
  constexpr int kN = 3000;
  auto ep2 = a_->connect(b_->local_info());
  ASSERT_TRUE(b_->accept(10s).has_value());
  auto rb2 = *ep2.remote_region("b");
  std::thread t([&] {
    for (int i = 0; i < kN; ++i) ep2.post_signal(rb2, kSem, 1);
    ep2.flush();
  });
  for (int i = 0; i < kN; ++i) ep_.post_signal(rb_, kSem, 2);
  ep_.flush();
  t.join();
  EXPECT_EQ(uint64_t(3 * kN), load_counter(lb_, kSem));
}

TEST_P(Rdma, PostsAndTransfersShareTheEndpoint) {
  if (g_transport != "rdma") GTEST_SKIP() << "rdma only";
  // Futures (striped over every channel, some behind QP 0's posts) and posts at once: each
  // completes, the posts' counter covers their bytes, flush waits for posts only.
  constexpr uint64_t kSem = kBytes - 8, kChunk = 16384, kHalf = kBytes / 2;
  std::mt19937_64 rng(7);
  fill(la_.data(), kBytes - 64, rng);
  std::vector<Future> fs;
  for (int k = 0; k < 64; ++k) {
    const uint64_t off = uint64_t(k) * kChunk;
    ep_.post_write(ha_, off, rb_, off, kChunk);
    ep_.post_signal(rb_, kSem, 1);
    fs.push_back(ep_.write({{ha_, kHalf + off, rb_, kHalf + off, kChunk / 2},
                            {ha_, kHalf + off + kChunk / 2, rb_, kHalf + off + kChunk / 2, kChunk / 2}}));
  }
  ep_.flush();
  EXPECT_EQ(64u, load_counter(lb_, kSem));
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), 64 * kChunk));
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok()) << f.status().to_string();
  EXPECT_EQ(0, std::memcmp(la_.data() + kHalf, lb_.data() + kHalf, 64 * kChunk));
}

TEST_P(Rdma, PostSignalRefusesACounterAtAnUnalignedAddress) {
  if (g_transport != "rdma") GTEST_SKIP() << "rdma only";
  // Offset 0 passes the core's alignment check, but the region itself starts 4 bytes into an
  // aligned buffer: an atomic there would break the QP, so it is refused before posting.
  std::vector<uint8_t> odd(4096 + 8, 0);
  b_->register_memory(odd.data() + 4, 4096, Location::host(), "odd");
  ep_.refresh_remote_regions();
  auto ro = *ep_.remote_region("odd");
  std::string msg;
  EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { ep_.post_signal(ro, 0, 1); }, &msg));
  EXPECT_NE(std::string::npos, msg.find("aligned")) << msg;
  // Nothing was posted: flush is clean and the endpoint still posts.
  EXPECT_EQ(ErrorCode::kOk, code_of([&] { ep_.flush(); }));
  ep_.post_write(ha_, 0, rb_, 0, 64);
  ep_.post_signal(rb_, 64, 1);
  ep_.flush();
  EXPECT_EQ(1u, load_counter(lb_, 64));
}

TEST_P(Rdma, PostToABadRkeyFailsFlushAndTheEndpoint) {
  if (g_transport != "rdma") GTEST_SKIP() << "rdma only";
  if (GetParam() != 1) GTEST_SKIP() << "runs once, at 1 channel";
  // The target's NIC NAKs the write: the poster does not wait for that, flush reports it, and
  // from then on every call on that endpoint fails; the engines and other endpoints go on.
  ::setenv("SLUICE_RDMA_FAULT_RKEY_XOR", "0x5a5a5a5a", 1);
  auto bad = a_->connect(b_->local_info());
  ::unsetenv("SLUICE_RDMA_FAULT_RKEY_XOR");
  ASSERT_TRUE(b_->accept(10s).has_value());
  auto rbad = *bad.remote_region("b");
  std::memset(lb_.data(), 0, 8192);
  std::memset(la_.data(), 0x5c, 8192);
  ErrorCode posted = code_of([&] {
    bad.post_write(ha_, 0, rbad, 0, 4096);
    bad.post_signal(rbad, 4096, 1);
  });
  EXPECT_TRUE(posted == ErrorCode::kOk || posted == ErrorCode::kRemoteError) << int(posted);
  std::string msg;
  EXPECT_NE(ErrorCode::kOk, code_of([&] { bad.flush(5000ms); }, &msg));
  EXPECT_NE(std::string::npos, msg.find("remote access")) << msg;
  EXPECT_NE(ErrorCode::kOk, code_of([&] { bad.flush(1000ms); }));
  EXPECT_NE(ErrorCode::kOk, code_of([&] { bad.post_write(ha_, 0, rbad, 0, 16); }));
  for (int i = 0; i < 4096 + 8; ++i) ASSERT_EQ(0, lb_[i]) << "byte " << i << " written through a bad rkey";
  ep_.post_write(ha_, 0, rb_, 0, 4096);
  ep_.post_signal(rb_, 4096, 1);
  ep_.flush();
  EXPECT_EQ(1u, load_counter(lb_, 4096));
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), 4096));
}

INSTANTIATE_TEST_SUITE_P(Channels, Rdma, ::testing::Values(1, 2, 4),
                         [](const testing::TestParamInfo<int>& i) { return "ch" + std::to_string(i.param); });

TEST(RdmaDevice, HcaFilterExcludingEveryDeviceMeansNoDevice) {
  std::string why;
  if (g_transport != "rdma" || !rdma_available(&why)) GTEST_SKIP() << why;
  // The suite may run with a device selection (one rail or several): put it back after.
  const char* was = std::getenv("SLUICE_IB_HCA");
  struct Restore {
    std::string value;
    bool set;
    ~Restore() { set ? ::setenv("SLUICE_IB_HCA", value.c_str(), 1) : ::unsetenv("SLUICE_IB_HCA"); }
  } restore{was ? was : "", was != nullptr};
  ::setenv("SLUICE_IB_HCA", "^=rxe0,mlx5_0,mlx5_1,mlx5_2,mlx5_3,irdma0,bnxt_re0,efa_0", 1);
  ::setenv("SLUICE_IB_HCA", "^", 1);  // parse error also means no engine
  try {
    Engine e(cfg());
    ADD_FAILURE() << "engine created with a malformed SLUICE_IB_HCA";
  } catch (const Error& e) {
    std::printf("      SLUICE_IB_HCA=^ -> %s\n", e.what());
  }
  ::setenv("SLUICE_IB_HCA", "=no_such_dev", 1);
  try {
    Engine e(cfg());
    ADD_FAILURE() << "engine created with SLUICE_IB_HCA=no_such_dev";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNoDevice);
    EXPECT_NE(std::string(e.what()).find("no RDMA device"), std::string::npos) << e.what();
  }
  const char* dev = std::getenv("RXE_DEV");
  ::setenv("SLUICE_IB_HCA", (std::string("=") + (dev ? dev : "rxe0") + ":1").c_str(), 1);
  EXPECT_NO_THROW(Engine e(cfg()));
  // The same selection from code: the option rdma.hca (the variable overrides it).
  ::unsetenv("SLUICE_IB_HCA");
  EngineConfig c = cfg();
  c.options["rdma.hca"] = "=no_such_dev";
  try {
    Engine e(c);
    ADD_FAILURE() << "engine created with rdma.hca=no_such_dev";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNoDevice) << e.what();
  }
  c.options["rdma.hca"] = std::string("=") + (dev ? dev : "rxe0");
  Engine one(c);
  auto info = nlohmann::json::parse(one.local_info());
  ASSERT_EQ(info["transports"]["rdma"]["rails"].size(), 1u);
  EXPECT_EQ(info["transports"]["rdma"]["rails"][0]["dev"], dev ? dev : "rxe0");
}

// The handshake's negotiation against the real device (the logic itself is unit-tested in
// tests/transport/rdma/negotiate_test.cpp): a deliberate mismatch is a named error at
// connect (or engine creation), never a connected endpoint whose first operation hangs.
std::string dev_under_test() {
  const char* dev = std::getenv("RXE_DEV");
  return dev ? dev : "rxe0";
}

std::string sysfs_line(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

// GID table entry N of port 1 of the device under test, as sysfs prints it ("" past its end).
std::string sysfs_gid(int n) {
  return sysfs_line("/sys/class/infiniband/" + dev_under_test() + "/ports/1/gids/" + std::to_string(n));
}

// Connects a to b and returns the error (kOk if it connected).
Error connect_error(Engine& a, Engine& b) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    Endpoint ep = a.connect(b.local_info());
    return Error(ErrorCode::kOk, "connected over " + ep.transport());
  } catch (const Error& e) {
    std::printf("      refused after %.2f s: [%s] %s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                std::string(to_string(e.code())).c_str(), e.what());
    return e;
  }
}

class RdmaNegotiation : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (g_transport != "rdma" || !rdma_available(&why)) GTEST_SKIP() << why;
    // One rail, so the device named in the errors is the one whose sysfs we read.
    sel_ = "=" + dev_under_test() + ":1";
  }
  EngineConfig one_rail(std::map<std::string, std::string> options = {}) {
    EngineConfig c = cfg(1);
    c.options["rdma.hca"] = sel_;
    for (auto& [k, v] : options) c.options[k] = v;
    return c;
  }
  std::string sel_;
};

TEST_F(RdmaNegotiation, PathMtuBelowRdmaMinMtuIsRefusedNamingBothPorts) {
  Engine b(one_rail());
  const int mtu = nlohmann::json::parse(b.local_info())["transports"]["rdma"]["rails"][0]["mtu"].get<int>();
  if (mtu >= 5) GTEST_SKIP() << "active MTU is already 4096: no larger minimum to refuse";
  const std::string above = std::to_string(256 << mtu), exact = std::to_string(128 << mtu);
  const std::string port = dev_under_test() + ":1";
  // The active side refuses the peer's reply ...
  Engine strict(one_rail({{"rdma.min_mtu", above}}));
  Error e = connect_error(strict, b);
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
  EXPECT_NE(std::string(e.what()).find("below rdma.min_mtu " + above), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("ours " + port), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("the peer's " + port), std::string::npos) << e.what();
  // ... the passive side refuses the hello, and the active side gets its reason.
  Engine plain(one_rail());
  e = connect_error(plain, strict);
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
  EXPECT_NE(std::string(e.what()).find("below rdma.min_mtu " + above), std::string::npos) << e.what();
  // A minimum that the path meets connects, and the endpoint moves bytes.
  Engine met(one_rail({{"rdma.min_mtu", exact}}));
  std::vector<uint8_t> src(4096, 7), dst(4096, 0);
  auto hs = met.register_memory(src.data(), src.size(), Location::host(), "src");
  b.register_memory(dst.data(), dst.size(), Location::host(), "dst");
  Endpoint ep = met.connect(b.local_info());
  ASSERT_TRUE(ep.write({{hs, 0, *ep.remote_region("dst"), 0, src.size()}}).wait().ok());
  EXPECT_EQ(src, dst);
  // A value that is not an MTU is refused when the engine starts, naming the option.
  try {
    Engine bad(one_rail({{"rdma.min_mtu", "1500"}}));
    ADD_FAILURE() << "engine created with rdma.min_mtu=1500";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument) << err.what();
    EXPECT_NE(std::string(err.what()).find("rdma.min_mtu"), std::string::npos) << err.what();
  }
}

TEST_F(RdmaNegotiation, GidsOfDifferentFamiliesAreRefusedNamingBoth) {
  // An IPv6 GID of the device (the link-local one of its netdev) against the default
  // IPv4-mapped RoCE v2 GID of the other engine.
  int v6 = -1;
  for (int i = 0; i < 16 && v6 < 0; ++i) {
    std::string g = sysfs_gid(i);
    if (!g.empty() && g.rfind("0000:0000:0000:0000:0000:ffff:", 0) != 0 && g != "0000:0000:0000:0000:0000:0000:0000:0000")
      v6 = i;
  }
  if (v6 < 0) GTEST_SKIP() << "no IPv6 GID on " << dev_under_test();
  Engine ipv6(one_rail({{"rdma.gid_index", std::to_string(v6)}}));
  Engine ipv4(one_rail());
  for (auto [a, b] : {std::pair<Engine*, Engine*>{&ipv6, &ipv4}, {&ipv4, &ipv6}}) {
    Error e = connect_error(*a, *b);
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("GID families differ"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("GID index " + std::to_string(v6) + " fe80:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("::ffff:"), std::string::npos) << e.what();
  }
}

TEST_F(RdmaNegotiation, AnEmptyOrMissingGidIndexIsRefusedWhenTheEngineStarts) {
  const std::string zero = "0000:0000:0000:0000:0000:0000:0000:0000";
  int empty = -1;
  for (int i = 0; i < 256 && empty < 0; ++i) {
    std::string g = sysfs_gid(i);
    if (g.empty()) break;
    if (g == zero) empty = i;
  }
  const std::string port = dev_under_test() + ":1";
  if (empty >= 0) {
    try {
      Engine e(one_rail({{"rdma.gid_index", std::to_string(empty)}}));
      ADD_FAILURE() << "engine created on the empty GID index " << empty;
    } catch (const Error& err) {
      std::printf("      rdma.gid_index=%d -> %s\n", empty, err.what());
      EXPECT_EQ(err.code(), ErrorCode::kNoDevice) << err.what();
      EXPECT_NE(std::string(err.what()).find(port + "(GID index " + std::to_string(empty) + " is empty: all-zero GID)"),
                std::string::npos) << err.what();
    }
  }
  try {
    Engine e(one_rail({{"rdma.gid_index", "65535"}}));
    ADD_FAILURE() << "engine created on GID index 65535";
  } catch (const Error& err) {
    std::printf("      rdma.gid_index=65535 -> %s\n", err.what());
    EXPECT_EQ(err.code(), ErrorCode::kNoDevice) << err.what();
    EXPECT_NE(std::string(err.what()).find(port + "(GID index 65535 is beyond its table of "), std::string::npos)
        << err.what();
  }
}

}  // namespace

int peer_target(int channels) {
  Engine e(cfg(channels));
  std::vector<uint8_t> sink(32 << 20);
  e.register_memory(sink.data(), sink.size(), Location::host(), "sink");
  std::printf("%s\n", e.listen_address().c_str());
  std::fflush(stdout);
  for (;;) std::this_thread::sleep_for(1s);
}

int main(int argc, char** argv) {
  if (const char* t = std::getenv("SLUICE_TEST_TRANSPORT")) g_transport = t;
  if (argc >= 3 && std::string(argv[1]) == "--peer-target") return peer_target(std::atoi(argv[2]));
  if (argc >= 2 && std::string(argv[1]) == "--expect-unavailable") {
    // Run with SLUICE_IBVERBS_LIB=/nonexistent or no device: the transport must say why.
    try {
      Engine e(cfg());
      std::printf("FAIL: rdma engine created\n");
      return 1;
    } catch (const Error& e) {
      std::printf("rdma unavailable as expected: %s\n", e.what());
      std::string want = argc >= 3 ? argv[2] : "";
      return std::string(e.what()).find(want) != std::string::npos ? 0 : 1;
    }
  }
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n > 0) g_self.assign(buf, n);
  ::signal(SIGPIPE, SIG_IGN);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
