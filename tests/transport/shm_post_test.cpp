// shm specifics of the thin post path and of failure: posts into engine-allocated (memfd)
// memory, which this side maps and writes itself; SIGNAL frames from a hostile proven peer;
// and a failed endpoint never writing into an op's memory after the op failed.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "core/memfd.hpp"
#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "loopback.hpp"
#include "test_util.hpp"
#include "transport/common/frame.hpp"
#include "transport/common/same_host.hpp"

using namespace sluice;
using namespace sluice_test;
using sluice::detail::FrameHeader;
using sluice::detail::FrameType;
using sluice::detail::make_frame;
using nlohmann::json;
namespace boot = sluice::bootstrap;
namespace sh = sluice::detail::same_host;

namespace {

// Posts into a peer's engine-allocated memory go through this side's mapping of it (once the
// region is described); signals then are atomic adds on the mapping. Same guarantees.
TEST(ShmPost, MappedMemoryWritesAndSignalsInOrder) {
  Engine a(engine_config("shm", 2, 10s)), b(engine_config("shm", 2, 10s));
  constexpr uint64_t kBytes = 1 << 20, kSem = kBytes - 8, kChunk = 8192;
  constexpr int kRounds = 100;
  std::vector<uint8_t> src(kBytes);
  auto hs = a.register_memory(src.data(), src.size());
  Allocation dst = b.allocate(kBytes, Location::host(), "dst");
  ASSERT_GE(dst.fd, 0) << "host allocations are memfd backed";
  auto* d = static_cast<uint8_t*>(dst.ptr);
  Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  ASSERT_EQ(ep.transport(), "shm");
  RemoteHandle rd = *ep.remote_region("dst");
  // The first post learns the region in the background; later ones use the mapping.
  ep.post_write(hs, 0, rd, 0, 8);
  ep.flush();
  std::this_thread::sleep_for(200ms);
  for (int k = 0; k < kRounds; ++k) std::memset(src.data() + k * kChunk, k + 1, kChunk);
  auto counter = [&] { return __atomic_load_n(reinterpret_cast<uint64_t*>(d + kSem), __ATOMIC_ACQUIRE); };
  std::atomic<bool> stop{false};
  std::atomic<int> bad{-1};
  std::thread waiter([&] {
    uint64_t seen = 0;
    while (!stop.load() && seen < kRounds) {
      uint64_t v = counter();
      if (v == seen) continue;
      for (uint64_t k = seen; k < v && k < kRounds; ++k)
        for (uint64_t i = 0; i < kChunk; i += 511)
          if (d[k * kChunk + i] != uint8_t(k + 1)) {
            bad = static_cast<int>(k);
            return;
          }
      seen = v;
    }
  });
  for (int k = 0; k < kRounds; ++k) {
    ep.post_write(hs, k * kChunk, rd, k * kChunk, kChunk);
    ep.post_signal(rd, kSem, 1);
  }
  ep.flush();
  stop = true;
  waiter.join();
  EXPECT_EQ(-1, bad.load()) << "the counter said chunk " << bad.load() << " had landed before its bytes";
  EXPECT_EQ(uint64_t(kRounds), counter()) << "flush returned before every signal was applied";
  EXPECT_EQ(0, std::memcmp(src.data(), d, kRounds * kChunk));
  // A 64-bit add (the high half travels separately in a SIGNAL frame) on the mapping too.
  ep.post_signal(rd, 0, 0x100000001ull);
  ep.flush();
  uint64_t first = 0;
  std::memcpy(&first, d, 8);
  uint64_t expect = 0;
  std::memcpy(&expect, src.data(), 8);
  EXPECT_EQ(expect + 0x100000001ull, first);
}

// A proven same-host peer speaking raw SIGNAL frames: only a counter inside a registered
// region, 8-byte aligned, is ever raised; anything else is answered NACK and changes nothing.
TEST(ShmPost, HostileSignalFramesChangeNothing) {
  ::signal(SIGPIPE, SIG_IGN);
  EngineConfig c = engine_config("shm", 1, 10s);
  c.transports = {"tcp", "shm"};
  Engine victim(c);
  constexpr uint64_t kPage = 4096;
  alignas(64) static uint8_t mem[3 * kPage];
  fill_pattern(mem, sizeof(mem), 5);
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
    boot::send_msg(s.fd(), boot::MsgKind::kHello, {{"info", info}, {"token", 7171}, {"transport", "shm"}, {"channels", 1}});
    boot::expect_reply(s.fd(), "hello");
  }
  Fd my_table{detail::sealed_memfd("test-leases", 16 * 16)};
  ASSERT_GE(my_table.fd, 0);
  net::Socket ctl = sh::connect(socket);
  sh::send(ctl.fd(), {{"op", "auth"}, {"token", 7171}}, my_table.fd);
  Fd their_table;
  json r = sh::recv(ctl.fd(), sh::Clock::now() + 5s, &their_table.fd);
  ASSERT_FALSE(r.contains("error")) << r.dump();
  {
    net::Socket s = dial();
    boot::send_msg(s.fd(), boot::MsgKind::kChannel, {{"token", 7171}, {"index", 0}, {"transport", "shm"}});
    boot::expect_reply(s.fd(), "channel");
  }
  ASSERT_EQ(read_credit_grant(ctl.fd()).type, static_cast<uint8_t>(FrameType::kCredit));
  ASSERT_TRUE(victim.accept(2s).has_value());

  auto signal = [&](uint64_t region, uint64_t offset, uint64_t add, uint64_t op_id) {
    FrameHeader h = make_frame(FrameType::kSignal, op_id, region, offset, 0, detail::kLaneEnd,
                               static_cast<uint32_t>(add), static_cast<uint32_t>(add >> 32));
    EXPECT_TRUE(write_all(ctl.fd(), &h, sizeof(h)));
    FrameHeader a{};
    EXPECT_TRUE(read_all(ctl.fd(), &a, sizeof(a), 5s));
    std::string text(a.length, '\0');
    if (a.length) {
      EXPECT_TRUE(read_all(ctl.fd(), text.data(), a.length, 5s));
    }
    EXPECT_EQ(a.op_id, op_id) << "the answer names the signal it answers";
    return std::make_pair(static_cast<FrameType>(a.type), static_cast<ErrorCode>(a.status));
  };
  EXPECT_EQ(signal(hv.id + 1000, 0, 1, 1), std::make_pair(FrameType::kNack, ErrorCode::kUnknownHandle));
  EXPECT_EQ(signal(hv.id, kPage, 1, 2), std::make_pair(FrameType::kNack, ErrorCode::kOutOfRange));
  EXPECT_EQ(signal(hv.id, kPage - 4, 1, 3), std::make_pair(FrameType::kNack, ErrorCode::kInvalidArgument));
  EXPECT_EQ(signal(hv.id, 12, 1, 4), std::make_pair(FrameType::kNack, ErrorCode::kInvalidArgument));
  EXPECT_EQ(signal(hv.id, ~0ull - 3, 1, 5), std::make_pair(FrameType::kNack, ErrorCode::kInvalidArgument));
  EXPECT_EQ(signal(hv.id, ~0ull - 7, 1, 6), std::make_pair(FrameType::kNack, ErrorCode::kOutOfRange));
  EXPECT_EQ(0, std::memcmp(mem, snap.data(), sizeof(mem))) << "a refused signal changed memory";
  // A well-formed one raises exactly its counter by the full 64-bit value.
  EXPECT_EQ(signal(hv.id, 16, 0x500000003ull, 7), std::make_pair(FrameType::kAck, ErrorCode::kOk));
  uint64_t v = 0;
  std::memcpy(&v, snap.data() + kPage + 16, 8);
  v += 0x500000003ull;
  std::memcpy(snap.data() + kPage + 16, &v, 8);
  EXPECT_EQ(0, std::memcmp(mem, snap.data(), sizeof(mem)));
  // A SIGNAL with a payload is malformed: the victim closes the channel.
  FrameHeader bad = make_frame(FrameType::kSignal, 8, hv.id, 0, 8, detail::kLaneEnd, 1, 0);
  std::vector<uint8_t> junk(sizeof(bad) + 8, 0);
  std::memcpy(junk.data(), &bad, sizeof(bad));
  ASSERT_TRUE(write_all(ctl.fd(), junk.data(), junk.size()));
  FrameHeader e{};
  ASSERT_TRUE(read_all(ctl.fd(), &e, sizeof(e), 5s));
  EXPECT_EQ(static_cast<FrameType>(e.type), FrameType::kError);
  EXPECT_EQ(0, std::memcmp(mem, snap.data(), sizeof(mem)));
  victim.close();
}

// The copy workers are not joined when an endpoint fails on its own (peer lost, watchdog),
// and a read's copy may be in flight then: the read must not complete (failed) before that
// copy ended, or its destination changes under a caller who already saw the failure. A
// test-only delay holds the copy between its start and its first byte.
TEST(ShmFailure, NoCopyIntoAReadAfterItFailed) {
  EnvScope delay("SLUICE_SHM_TEST_COPY_DELAY_MS", "600");
  Engine a(engine_config("shm", 1, 10s)), b(engine_config("shm", 1, 10s));
  constexpr uint64_t kBytes = 256 << 10;
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0);
  fill_pattern(src.data(), src.size(), 9);
  auto hd = a.register_memory(dst.data(), dst.size());
  b.register_memory(src.data(), src.size(), Location::host(), "src");
  Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  ASSERT_EQ(ep.transport(), "shm");
  RemoteHandle rs = *ep.remote_region("src");
  Future f = ep.read({{hd, 0, rs, 0, kBytes}});
  // The copy has begun (it is counted) and sleeps; the peer goes away meanwhile.
  std::this_thread::sleep_for(150ms);
  Endpoint peer = *acc;
  peer.close();
  Status st = f.wait();
  std::vector<uint8_t> at_failure = dst;  // what the caller sees once the read failed
  std::this_thread::sleep_for(900ms);     // past the copy's delay
  EXPECT_EQ(0, std::memcmp(at_failure.data(), dst.data(), kBytes))
      << "a copy wrote into the read's destination after the read completed (" << st.to_string() << ")";
  ep.close();
}

}  // namespace
