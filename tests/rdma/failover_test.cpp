// rdma queue-pair and rail failover (docs/cluster.md, "Failover of rdma queue pairs and
// rails"), against a real verbs stack: tests/rdma/guest-suite.sh runs it inside the SoftRoCE
// guest, whose two rxe devices (rxe0 on dummy0, rxe1 on dummy1) are the rails; taking a dummy
// netdev down makes its port report IBV_EVENT_PORT_ERR as a NIC losing its link does. Without
// an RDMA device every test skips; the rail tests also need the guest's netdevs (root).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "sluice/sluice.hpp"

using namespace std::chrono_literals;
using namespace sluice;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kBytes = 16ull << 20;

EngineConfig cfg(int channels) {
  EngineConfig c;
  c.transports = {"rdma"};
  c.channels = channels;
  c.op_timeout = 20s;
  c.connect_timeout = 10s;
  // Loopback for the handshakes: the rail tests take the rails' netdevs down.
  c.listen_host = "127.0.0.1";
  return c;
}

void fill(uint8_t* p, uint64_t n, std::mt19937_64& rng) {
  for (uint64_t i = 0; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// Sets a variable for the scope (test-only knobs are read when an endpoint is created).
struct EnvScope {
  std::string name;
  EnvScope(const char* n, const char* v) : name(n) { ::setenv(n, v, 1); }
  ~EnvScope() { ::unsetenv(name.c_str()); }
};

std::vector<std::string> words(const char* env) {
  std::vector<std::string> out;
  const char* v = std::getenv(env);
  if (!v) return out;
  std::string s(v), w;
  for (char ch : s + " ") {
    if (ch == ' ') {
      if (!w.empty()) out.push_back(w);
      w.clear();
    } else {
      w += ch;
    }
  }
  return out;
}

uint64_t sent_packets(const std::string& dev) {
  std::this_thread::sleep_for(30ms);  // SoftRoCE caches hw counters for 12 ms
  std::ifstream in("/sys/class/infiniband/" + dev + "/ports/1/hw_counters/sent_pkts");
  uint64_t v = 0;
  in >> v;
  return v;
}

void set_link(const std::string& netdev, bool up) {
  const std::string cmd = "ip link set " + netdev + (up ? " up" : " down");
  ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
}

class RdmaFailover : public ::testing::Test {
 protected:
  void open(int channels) {
    try {
      a_ = std::make_unique<Engine>(cfg(channels));
      b_ = std::make_unique<Engine>(cfg(channels));
    } catch (const Error& e) {
      GTEST_SKIP() << "rdma unavailable: " << e.what();
    }
    la_.assign(kBytes, 0);
    lb_.assign(kBytes, 0);
    ha_ = a_->register_memory(la_.data(), la_.size(), Location::host(), "a");
    hb_ = b_->register_memory(lb_.data(), lb_.size(), Location::host(), "b");
    ep_ = a_->connect(b_->local_info());
    ASSERT_EQ(ep_.transport(), "rdma");
    auto acc = b_->accept(10s);
    ASSERT_TRUE(acc.has_value());
    peer_ = *acc;
    rb_ = *ep_.remote_region("b");
  }
  void TearDown() override {
    ep_ = {};
    peer_ = {};
    if (a_) a_->close();
    if (b_) b_->close();
  }
  int rails() const {
    return static_cast<int>(nlohmann::json::parse(a_->local_info())["transports"]["rdma"]["rails"].size());
  }
  // A striped write of `len` bytes at `off` and a read back into the upper half, both checked.
  Status round(uint64_t off, uint64_t len, std::mt19937_64& rng) {
    try {
      return round_once(off, len, rng);
    } catch (const Error& e) {  // an endpoint that failed and cannot reconnect throws
      return e.status();
    }
  }
  Status round_once(uint64_t off, uint64_t len, std::mt19937_64& rng) {
    fill(la_.data() + off, len, rng);
    Status st = ep_.write({{ha_, off, rb_, off, len}}).wait();
    if (!st.ok()) return st;
    if (std::memcmp(lb_.data() + off, la_.data() + off, len) != 0) return {ErrorCode::kInternal, "write: bytes differ"};
    const uint64_t back = kBytes / 2 + off;
    st = ep_.read({{ha_, back, rb_, off, len}}).wait();
    if (!st.ok()) return st;
    if (std::memcmp(la_.data() + back, la_.data() + off, len) != 0) return {ErrorCode::kInternal, "read: bytes differ"};
    return Status::Ok();
  }
  bool wait_replaced(uint64_t n, std::chrono::milliseconds limit) {
    const auto end = Clock::now() + limit;
    while (Clock::now() < end) {
      if (ep_.metrics().channels_replaced >= n) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }
  std::unique_ptr<Engine> a_, b_;
  std::vector<uint8_t> la_, lb_;
  MemoryHandle ha_, hb_;
  RemoteHandle rb_;
  Endpoint ep_, peer_;
};

// A queue pair fails under traffic (moved to the error state, as a broken link leaves it):
// its lanes go to the other channels, it is replaced, and no operation fails.
TEST_F(RdmaFailover, BrokenQueuePairIsReplacedWhileTheOthersCarryTheTraffic) {
  EnvScope fault("SLUICE_RDMA_TEST_BREAK_QP", "1:6");
  open(4);
  if (!a_) return;
  std::mt19937_64 rng(1);
  const auto t0 = Clock::now();
  for (int i = 0; i < 16; ++i) {
    // Many batches in flight at once, so that the break catches some mid-way.
    std::vector<Future> fs;
    for (int k = 0; k < 4; ++k) {
      const uint64_t off = uint64_t(k) * (1 << 20);
      fill(la_.data() + off, 1 << 20, rng);
      fs.push_back(ep_.write({{ha_, off, rb_, off, 1 << 20}}));
    }
    for (auto& f : fs) ASSERT_TRUE(f.wait().ok()) << "batch " << i << ": " << f.status().to_string();
    ASSERT_EQ(0, std::memcmp(lb_.data(), la_.data(), 4 << 20)) << "batch " << i;
    ASSERT_TRUE(round(0, 4 << 20, rng).ok()) << "round " << i;
  }
  ASSERT_TRUE(wait_replaced(1, 10s)) << "channel 1 was never replaced";
  auto m = ep_.metrics();
  std::printf("      replaced %llu channel(s), sent %llu lane(s) again, %.0f ms for 16 rounds\n",
              (unsigned long long)m.channels_replaced, (unsigned long long)m.retries, ms_since(t0));
  EXPECT_EQ(m.channels_replaced, 1u);
  EXPECT_GE(peer_.metrics().channels_replaced, 1u) << "the accepting side installed no replacement";
  // The replacement carries lanes again (4 channels, 4 MiB batches: every channel has one).
  ASSERT_TRUE(round(0, 8 << 20, rng).ok());
}

// With rdma.retry_rma off, what was in flight on the broken queue pair fails by name (it may
// have been partly done), and the endpoint stays usable.
TEST_F(RdmaFailover, WithRetryOffTheCaughtOperationsFailAndTheEndpointStays) {
  EnvScope fault("SLUICE_RDMA_TEST_BREAK_QP", "1:3");
  EnvScope off("SLUICE_RDMA_RETRY_RMA", "0");
  open(2);
  if (!a_) return;
  std::mt19937_64 rng(2);
  int failed = 0, ok = 0;
  for (int i = 0; i < 8; ++i) {
    std::vector<Future> fs;
    for (int k = 0; k < 4; ++k) fs.push_back(ep_.write({{ha_, uint64_t(k) << 22, rb_, uint64_t(k) << 22, 4 << 20}}));
    for (auto& f : fs) {
      Status st = f.wait();
      if (st.ok()) {
        ++ok;
        continue;
      }
      ++failed;
      EXPECT_EQ(st.code, ErrorCode::kPeerLost) << st.to_string();
      EXPECT_NE(st.message.find("rdma.retry_rma is off"), std::string::npos) << st.message;
      EXPECT_NE(st.message.find("channel 1"), std::string::npos) << st.message;
    }
  }
  std::printf("      %d write(s) caught on the broken queue pair failed, %d completed\n", failed, ok);
  EXPECT_GE(failed, 1) << "the fault caught no write in flight";
  ASSERT_TRUE(wait_replaced(1, 10s));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(round(0, 4 << 20, rng).ok()) << "the endpoint did not stay usable";
}

// write_with_imm batches striped over the channels: their data lanes are sent again after the
// break, and each imm still arrives exactly once, after its bytes.
TEST_F(RdmaFailover, ImmArrivesExactlyOnceAcrossABreak) {
  EnvScope fault("SLUICE_RDMA_TEST_BREAK_QP", "1:4");
  open(4);
  if (!a_) return;
  std::mt19937_64 rng(3);
  const int n = 16;
  fill(la_.data(), kBytes, rng);
  // Batches on the same bytes carry the same data: any order of landing leaves them right.
  std::vector<Future> fs;
  for (int i = 0; i < n; ++i)
    fs.push_back(ep_.write_with_imm({{ha_, uint64_t(i % 4) << 22, rb_, uint64_t(i % 4) << 22, 4 << 20}}, 100 + i));
  std::vector<int> seen(n, 0);
  for (int i = 0; i < n; ++i) {
    auto imm = peer_.imm_recv();
    ASSERT_TRUE(imm.wait_for(20s)) << "imm " << i << " never arrived";
    ASSERT_TRUE(imm.status().ok()) << imm.status().to_string();
    const uint32_t k = imm.imm() - 100;
    ASSERT_LT(k, uint32_t(n));
    ASSERT_EQ(seen[k]++, 0) << "imm " << k << " arrived twice";
    EXPECT_EQ(0, std::memcmp(lb_.data() + (uint64_t(k % 4) << 22), la_.data() + (uint64_t(k % 4) << 22), 4 << 20))
        << "imm " << k << " before its bytes";
  }
  for (auto& f : fs) ASSERT_TRUE(f.wait().ok()) << f.status().to_string();
  EXPECT_FALSE(peer_.imm_recv().wait_for(300ms)) << "an extra imm arrived";
  EXPECT_TRUE(wait_replaced(1, 10s));
}

// The guest's second rail loses its link for 2 s under traffic: the queue pairs on it move to
// rail 0 without a failed operation, and come back once the link is up.
TEST_F(RdmaFailover, RailDownMovesTrafficToTheHealthyRailAndBack) {
  const auto devs = words("RXE_DEVS"), netdevs = words("RXE_NETDEVS");
  if (devs.size() < 2 || netdevs.size() < 2) GTEST_SKIP() << "needs the SoftRoCE guest's two rails (RXE_DEVS, RXE_NETDEVS)";
  open(4);
  if (!a_) return;
  ASSERT_EQ(rails(), 2);
  std::atomic<bool> stop{false};
  std::atomic<int> rounds{0}, failures{0};
  std::string first_failure;
  std::thread traffic([&] {
    std::mt19937_64 rng(4);
    while (!stop.load()) {
      Status st = round(0, 4 << 20, rng);
      if (!st.ok() && failures.fetch_add(1) == 0) first_failure = st.to_string();
      rounds.fetch_add(1);
    }
  });
  while (rounds.load() < 3) std::this_thread::sleep_for(5ms);
  const uint64_t rail1_before = sent_packets(devs[1]);
  EXPECT_GT(rail1_before, 0u);
  const auto down = Clock::now();
  set_link(netdevs[1], false);
  // Channels 1 and 3 live on rail 1.
  const bool moved = wait_replaced(2, 10s);
  const double moved_ms = ms_since(down);
  const int rounds_at_move = rounds.load();
  const uint64_t rail1_moved = sent_packets(devs[1]);
  std::this_thread::sleep_for(2s - (Clock::now() - down));
  const int rounds_down = rounds.load() - rounds_at_move;
  const uint64_t rail1_quiet = sent_packets(devs[1]) - rail1_moved;
  const auto up = Clock::now();
  set_link(netdevs[1], true);
  const bool back = wait_replaced(4, 10s);
  const double back_ms = ms_since(up);
  const uint64_t rail1_back = sent_packets(devs[1]);
  const int rounds_back = rounds.load();
  while (rounds.load() < rounds_back + 3) std::this_thread::sleep_for(5ms);
  const uint64_t rail1_after = sent_packets(devs[1]) - rail1_back;
  stop.store(true);
  traffic.join();
  std::printf("      measured: rail 1 down -> queue pairs moved in %.0f ms; rail 1 up -> back in %.0f ms; "
              "%d rounds while it was down; rail 1 sent %llu packets while down, %llu after\n",
              moved_ms, back_ms, rounds_down, (unsigned long long)rail1_quiet, (unsigned long long)rail1_after);
  EXPECT_TRUE(moved) << "the queue pairs on rail 1 were not moved";
  EXPECT_TRUE(back) << "the queue pairs did not return to rail 1";
  EXPECT_EQ(failures.load(), 0) << first_failure;
  EXPECT_GT(rounds_down, 0) << "no traffic while rail 1 was down";
  EXPECT_EQ(rail1_quiet, 0u) << "rail 1 still carried packets while down";
  EXPECT_GT(rail1_after, 0u) << "rail 1 carries nothing after it came back";
}

// Rail 0 carries QP 0 (control): losing it fails the endpoint, naming the rail, and the next
// operation reconnects over rail 1; when rail 0 is back, the channels that belong there return.
TEST_F(RdmaFailover, RailOfTheControlQueuePairDownReconnectsOverTheOther) {
  const auto devs = words("RXE_DEVS"), netdevs = words("RXE_NETDEVS");
  if (devs.size() < 2 || netdevs.size() < 2) GTEST_SKIP() << "needs the SoftRoCE guest's two rails (RXE_DEVS, RXE_NETDEVS)";
  open(4);
  if (!a_) return;
  std::mt19937_64 rng(5);
  ASSERT_TRUE(round(0, 4 << 20, rng).ok());
  const auto down = Clock::now();
  set_link(netdevs[0], false);
  // The first operation after the event fails (kPeerLost, naming the rail) or already runs on
  // the reconnected endpoint; within a few tries one succeeds.
  Status first;
  bool recovered = false;
  for (int i = 0; i < 50 && !recovered; ++i) {
    Status st = round(0, 4 << 20, rng);
    if (st.ok()) {
      recovered = true;
      break;
    }
    if (first.ok()) first = st;
    std::this_thread::sleep_for(20ms);
  }
  const double recovered_ms = ms_since(down);
  std::this_thread::sleep_for(500ms);
  const uint64_t rail0_before = sent_packets(devs[0]);
  ASSERT_TRUE(round(0, 4 << 20, rng).ok());
  const uint64_t rail0_while_down = sent_packets(devs[0]) - rail0_before;
  set_link(netdevs[0], true);
  const auto up = Clock::now();
  // The reconnected endpoint's channel 2 belongs on rail 0: it moves back (its replacement
  // count rises); channel 0 stays on rail 1.
  bool back = false;
  while (ms_since(up) < 10000 && !back) {
    back = ep_.metrics().channels_replaced >= 1;
    std::this_thread::sleep_for(5ms);
  }
  const double back_ms = ms_since(up);
  ASSERT_TRUE(round(0, 8 << 20, rng).ok());
  std::printf("      measured: rail 0 down -> first successful round after %.0f ms (%s); rail 0 up -> "
              "channel 2 home in %.0f ms\n",
              recovered_ms, first.ok() ? "no operation failed" : first.to_string().c_str(), back_ms);
  EXPECT_TRUE(recovered);
  if (!first.ok()) {
    EXPECT_EQ(first.code, ErrorCode::kPeerLost) << first.to_string();
    EXPECT_NE(first.message.find("rail 0"), std::string::npos) << first.to_string();
  }
  EXPECT_GE(ep_.metrics().reconnects, 1u);
  EXPECT_EQ(rail0_while_down, 0u) << "rail 0 carried packets while down";
  EXPECT_TRUE(back) << "channel 2 did not move back to rail 0";
}

}  // namespace
