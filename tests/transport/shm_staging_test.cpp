// shm behind the CUDA staging adapter (StagingEndpoint), on a CPU-only machine: a fake stager
// declares one host region of engine A "staged", and that region is kept PROT_NONE except
// while the stager copies, so the shm endpoint (and the peer's process_vm_readv) can never
// touch it directly. Writes (PULL_WRITEs the owner executes, and mapped copies into engine-
// allocated memory), write_with_imm, reads (process_vm_readv and mapped) and sends from that
// region, and recvs into it, must move the right bytes end to end between two real engines.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/memfd.hpp"
#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "loopback.hpp"
#include "test_util.hpp"
#include "transport/common/frame.hpp"
#include "transport/common/same_host.hpp"
#include "transport/common/same_host_wire.hpp"
#include "transport/shm/shm_test_stager.hpp"

using namespace sluice;
using namespace sluice_test;
using sluice::detail::FrameHeader;
using sluice::detail::FrameType;
using sluice::detail::make_frame;
using sluice::detail::RegionEntry;
using sluice::detail::Stager;
using nlohmann::json;
namespace boot = sluice::bootstrap;
namespace sh = sluice::detail::same_host;

namespace {

constexpr uint64_t kBytes = 1 << 20;

// The pretend device: `base`..+kBytes, unreadable except inside download()/upload().
class FakeStager final : public Stager {
 public:
  explicit FakeStager(uint8_t* base) : base_(base) {}
  bool stages(const RegionEntry& r) const override { return r.base == base_; }
  std::shared_ptr<uint8_t> buffer(uint64_t n) override {
    return std::shared_ptr<uint8_t>(new uint8_t[n](), std::default_delete<uint8_t[]>());
  }
  void download(void* host, const void* device, uint64_t n) override {
    copy(host, device, n, device);
    downloads++;
  }
  void upload(void* device, const void* host, uint64_t n) override {
    copy(device, host, n, device);
    uploads++;
  }
  std::atomic<int> downloads{0}, uploads{0}, outside{0};

 private:
  void copy(void* dst, const void* src, uint64_t n, const void* device) {
    auto* d = static_cast<const uint8_t*>(device);
    if (d < base_ || d + n > base_ + kBytes) {
      outside++;
      return;
    }
    std::lock_guard<std::mutex> lk(mu_);
    ::mprotect(base_, kBytes, PROT_READ | PROT_WRITE);
    std::memcpy(dst, src, n);
    ::mprotect(base_, kBytes, PROT_NONE);
  }
  uint8_t* const base_;
  std::mutex mu_;
};

class ShmStagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    void* p = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(p, MAP_FAILED);
    staged_ = static_cast<uint8_t*>(p);
    fill_pattern(staged_, kBytes, 1);
    stager_ = std::make_shared<FakeStager>(staged_);
    detail::shm::set_test_stager(stager_);
    a_ = std::make_unique<Engine>(engine_config("shm", 2, 10s));
    b_ = std::make_unique<Engine>(engine_config("shm", 2, 10s));
    plain_.assign(kBytes, 0);
    fill_pattern(plain_.data(), kBytes, 2);
    hs_ = a_->register_memory(staged_, kBytes, Location::host(), "staged");
    hp_ = a_->register_memory(plain_.data(), kBytes, Location::host(), "plain");
    heap_.assign(kBytes, 0);
    fill_pattern(heap_.data(), kBytes, 3);
    hheap_ = b_->register_memory(heap_.data(), kBytes, Location::host(), "heap");
    mem_ = b_->allocate(kBytes, Location::host(), "memfd");
    ASSERT_GE(mem_.fd, 0);
    fill_pattern(static_cast<uint8_t*>(mem_.ptr), kBytes, 4);
    ::mprotect(staged_, kBytes, PROT_NONE);  // from here on only the stager touches it
    ep_ = a_->connect(b_->local_info());
    ASSERT_EQ(ep_.transport(), "shm");
    auto acc = b_->accept(5s);
    ASSERT_TRUE(acc.has_value());
    peer_ = *acc;
    rheap_ = *ep_.remote_region("heap");
    rmem_ = *ep_.remote_region("memfd");
  }
  void TearDown() override {
    detail::shm::set_test_stager(nullptr);
    ep_ = {};
    peer_ = {};
    if (a_) a_->close();
    if (b_) b_->close();
    EXPECT_EQ(stager_->outside.load(), 0) << "a staged copy left the staged region";
    if (staged_) ::munmap(staged_, kBytes);
  }
  // The staged region's bytes (readable only for this copy).
  std::vector<uint8_t> staged(uint64_t off, uint64_t n) {
    ::mprotect(staged_, kBytes, PROT_READ);
    std::vector<uint8_t> v(staged_ + off, staged_ + off + n);
    ::mprotect(staged_, kBytes, PROT_NONE);
    return v;
  }
  static std::vector<uint8_t> bytes(const uint8_t* p, uint64_t n) { return {p, p + n}; }
  uint8_t* mem() { return static_cast<uint8_t*>(mem_.ptr); }

  uint8_t* staged_ = nullptr;
  std::shared_ptr<FakeStager> stager_;
  std::unique_ptr<Engine> a_, b_;
  std::vector<uint8_t> plain_, heap_;
  Allocation mem_;
  MemoryHandle hs_, hp_, hheap_;
  RemoteHandle rheap_, rmem_;
  Endpoint ep_, peer_;
};

// Into the owner's heap region: PULL_WRITEs whose staged pieces name no region of ours (the
// owner reads the adapter's host copies by address); in one batch with unstaged pieces.
TEST_F(ShmStagingTest, WritesFromStagedMemoryToAHeapRegion) {
  ASSERT_TRUE(ep_.write({{hs_, 100, rheap_, 5000, 70000}}).wait().ok());
  EXPECT_EQ(bytes(heap_.data() + 5000, 70000), staged(100, 70000));
  EXPECT_GE(stager_->downloads.load(), 1);
  // Mixed: staged and plain pieces, several lanes (a batch is split over the channels).
  Batch mixed;
  for (uint64_t i = 0; i < 16; ++i)
    mixed.push_back({i % 2 ? hp_ : hs_, 200000 + i * 8192, rheap_, 300000 + i * 8192, 8192});
  ASSERT_TRUE(ep_.write(mixed).wait().ok());
  for (uint64_t i = 0; i < 16; ++i) {
    auto want = i % 2 ? bytes(plain_.data() + 200000 + i * 8192, 8192) : staged(200000 + i * 8192, 8192);
    EXPECT_EQ(bytes(heap_.data() + 300000 + i * 8192, 8192), want) << "piece " << i;
  }
}

// Into engine-allocated memory, which this side maps once described: plain memcpys from the
// adapter's host copies on the copy workers.
TEST_F(ShmStagingTest, WritesFromStagedMemoryToMappedMemory) {
  ASSERT_TRUE(ep_.write({{hs_, 0, rmem_, 0, 4096}}).wait().ok());  // learns the region
  std::this_thread::sleep_for(200ms);
  const int before = stager_->downloads.load();
  ASSERT_TRUE(ep_.write({{hs_, 12345, rmem_, 8193, 300000}, {hs_, 600000, rmem_, 400000, 1000}}).wait().ok());
  EXPECT_EQ(bytes(mem(), 4096), staged(0, 4096));
  EXPECT_EQ(bytes(mem() + 8193, 300000), staged(12345, 300000));
  EXPECT_EQ(bytes(mem() + 400000, 1000), staged(600000, 1000));
  EXPECT_GE(stager_->downloads.load() - before, 2);  // the planner may cut a piece
}

TEST_F(ShmStagingTest, WriteWithImmFromStagedMemory) {
  for (RemoteHandle r : {rheap_, rmem_}) {
    auto imm = peer_.imm_recv();
    ASSERT_TRUE(ep_.write_with_imm({{hs_, 4096, r, 64, 50000}, {hp_, 0, r, 60000, 3000}}, 0xBEEF).wait().ok());
    ASSERT_TRUE(imm.wait_for(5s));
    ASSERT_TRUE(imm.status().ok());
    EXPECT_EQ(imm.imm(), 0xBEEFu);
    const uint8_t* d = r == rheap_ ? heap_.data() : mem();
    EXPECT_EQ(bytes(d + 64, 50000), staged(4096, 50000));
    EXPECT_EQ(bytes(d + 60000, 3000), bytes(plain_.data(), 3000));
  }
}

// Reads land in the adapter's host copies (process_vm_readv from the heap region, memcpy
// from the mapped one) and reach the staged region only through upload().
TEST_F(ShmStagingTest, ReadsIntoStagedMemory) {
  ASSERT_TRUE(ep_.read({{hs_, 1000, rheap_, 2000, 100000}, {hp_, 0, rheap_, 500000, 4096}}).wait().ok());
  EXPECT_EQ(staged(1000, 100000), bytes(heap_.data() + 2000, 100000));
  EXPECT_EQ(bytes(plain_.data(), 4096), bytes(heap_.data() + 500000, 4096));
  ASSERT_TRUE(ep_.read({{hs_, 200000, rmem_, 3, 250000}}).wait().ok());
  EXPECT_EQ(staged(200000, 250000), bytes(mem() + 3, 250000));
  EXPECT_GE(stager_->uploads.load(), 2);
}

// A send from the staged region: the receiver reads the adapter's host copy (no region, no
// lease). A recv into it is the target side: the peer's bytes land there directly.
TEST_F(ShmStagingTest, SendsFromAndRecvsIntoStagedMemory) {
  MemoryHandle hh = hheap_;
  auto r = peer_.recv(hh, 10, 200000);
  ASSERT_TRUE(ep_.send(hs_, 4000, 150000).wait().ok());
  ASSERT_TRUE(r.wait().ok());
  EXPECT_EQ(r.bytes(), 150000u);
  EXPECT_EQ(bytes(heap_.data() + 10, 150000), staged(4000, 150000));
  // Unexpected (no recv posted yet): stashed by the receiver, then delivered.
  ASSERT_TRUE(ep_.send(hs_, 0, 3000).wait().ok());
  auto r2 = peer_.recv(hh, 300000, 3000);
  ASSERT_TRUE(r2.wait().ok());
  EXPECT_EQ(bytes(heap_.data() + 300000, 3000), staged(0, 3000));
  EXPECT_GE(stager_->downloads.load(), 2);

  ::mprotect(staged_, kBytes, PROT_READ | PROT_WRITE);  // written by the peer's message
  auto r3 = ep_.recv(hs_, 8000, 5000);
  ASSERT_TRUE(peer_.send(hh, 700000, 5000).wait().ok());
  ASSERT_TRUE(r3.wait().ok());
  EXPECT_EQ(bytes(staged_ + 8000, 5000), bytes(heap_.data() + 700000, 5000));
}

// The thin post path is not staged: a post from the staged region is refused, others pass.
TEST_F(ShmStagingTest, PostsFromStagedMemoryAreRefused) {
  EXPECT_EQ(code_of([&] { ep_.post_write(hs_, 0, rheap_, 0, 64); }), ErrorCode::kUnsupported);
  ep_.post_write(hp_, 0, rheap_, 0, 64);
  ep_.flush();
  EXPECT_EQ(bytes(heap_.data(), 64), bytes(plain_.data(), 64));
}


// A SEND_RTS that names no source region (what a staged send sends) is read by address from
// the sender, and only ever into the recv buffer: a proven raw peer announcing more than the
// recv holds, or an address it does not map, changes nothing outside that buffer.
TEST(ShmStagingHostile, RtsWithoutARegionWritesOnlyTheRecvBuffer) {
  ::signal(SIGPIPE, SIG_IGN);
  EngineConfig c = engine_config("shm", 1, 10s);
  c.transports = {"tcp", "shm"};
  Engine victim(c);
  constexpr uint64_t kPage = 4096;
  alignas(64) static uint8_t mem[3 * kPage];
  alignas(64) static uint8_t src[2 * kPage];  // the "sender's" bytes (this process is the peer)
  fill_pattern(mem, sizeof(mem), 5);
  fill_pattern(src, sizeof(src), 6);
  std::vector<uint8_t> snap(mem, mem + sizeof(mem));
  MemoryHandle hv = victim.register_memory(mem + kPage, kPage, Location::host(), "victim");
  json info = json::parse(victim.local_info());
  const std::string socket = info["transports"]["shm"]["socket"].get<std::string>();
  auto [host, port] = detail::split_host_port(victim.listen_address());
  auto dial = [&, h = host, p = port] {
    net::Socket s = net::connect_tcp(h, p, 2s);
    net::set_io_timeout(s.fd(), 5s);
    return s;
  };
  {
    net::Socket s = dial();
    boot::send_msg(s.fd(), boot::MsgKind::kHello, {{"info", info}, {"token", 7272}, {"transport", "shm"}, {"channels", 1}});
    boot::expect_reply(s.fd(), "hello");
  }
  Fd my_table{detail::sealed_memfd("test-leases", 16 * 16)};
  ASSERT_GE(my_table.fd, 0);
  net::Socket ctl = sh::connect(socket);
  sh::send(ctl.fd(), {{"op", "auth"}, {"token", 7272}}, my_table.fd);
  Fd their_table;
  json r = sh::recv(ctl.fd(), sh::Clock::now() + 5s, &their_table.fd);
  ASSERT_FALSE(r.contains("error")) << r.dump();
  {
    net::Socket s = dial();
    boot::send_msg(s.fd(), boot::MsgKind::kChannel, {{"token", 7272}, {"index", 0}, {"transport", "shm"}});
    boot::expect_reply(s.fd(), "channel");
  }
  ASSERT_EQ(read_credit_grant(ctl.fd()).type, static_cast<uint8_t>(FrameType::kCredit));
  auto acc = victim.accept(2s);
  ASSERT_TRUE(acc.has_value());
  Endpoint ep = *acc;

  // Sends message `seq` of `length` bytes at `addr` (no region); returns the SEND_ACK's status.
  auto rts = [&](uint64_t seq, uint64_t addr, uint64_t length) {
    detail::same_host::RtsSource none{0, detail::kNoLease, 0};
    FrameHeader h = make_frame(FrameType::kSendRts, seq, addr, 0, sizeof(none), 0, static_cast<uint32_t>(length),
                               static_cast<uint32_t>(length >> 32));
    EXPECT_TRUE(write_all(ctl.fd(), &h, sizeof(h)));
    EXPECT_TRUE(write_all(ctl.fd(), &none, sizeof(none)));
    FrameHeader a{};
    EXPECT_TRUE(read_all(ctl.fd(), &a, sizeof(a), 5s));
    std::string text(a.length, '\0');
    if (a.length) {
      EXPECT_TRUE(read_all(ctl.fd(), text.data(), a.length, 5s));
    }
    EXPECT_EQ(static_cast<FrameType>(a.type), FrameType::kSendAck);
    EXPECT_EQ(a.op_id, seq);
    return static_cast<ErrorCode>(a.status);
  };

  // An honest one: exactly its bytes, into the recv buffer.
  auto r0 = ep.recv(hv, 100, 1000);
  EXPECT_EQ(rts(0, reinterpret_cast<uint64_t>(src), 1000), ErrorCode::kOk);
  ASSERT_TRUE(r0.wait_for(5s));
  EXPECT_TRUE(r0.status().ok());
  std::memcpy(snap.data() + kPage + 100, src, 1000);
  EXPECT_EQ(0, std::memcmp(mem, snap.data(), sizeof(mem)));
  // More than the recv holds: the recv's bytes only, both sides told kTruncated.
  auto r1 = ep.recv(hv, 2000, 500);
  EXPECT_EQ(rts(1, reinterpret_cast<uint64_t>(src), 2 * kPage), ErrorCode::kTruncated);
  ASSERT_TRUE(r1.wait_for(5s));
  EXPECT_EQ(r1.status().code, ErrorCode::kTruncated);
  std::memcpy(snap.data() + kPage + 2000, src, 500);
  EXPECT_EQ(0, std::memcmp(mem, snap.data(), sizeof(mem))) << "bytes landed outside the recv buffer";
  // An address the sender does not map: the recv fails, the victim lives on.
  auto r2 = ep.recv(hv, 0, 1000);
  EXPECT_NE(rts(2, 8, 1000), ErrorCode::kOk);
  ASSERT_TRUE(r2.wait_for(5s));
  EXPECT_FALSE(r2.status().ok());
  // Unexpected (no recv posted) and huge: the stash follows the bytes that really arrive.
  EXPECT_NE(rts(3, 8, 1ull << 40), ErrorCode::kOk);
  EXPECT_EQ(0, std::memcmp(mem, snap.data(), kPage));
  EXPECT_EQ(0, std::memcmp(mem + 2 * kPage, snap.data() + 2 * kPage, kPage));
  victim.close();
}

}  // namespace
