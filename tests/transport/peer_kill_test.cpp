// Class 6 of issue 18: a tcp peer killed mid-traffic must be reported as kPeerLost. With 8
// channels most failed futures used to say CancelledError("channel closed"): a channel's
// writer hit EPIPE, set the stop flag, and its reader took that flag for a local close.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <thread>

#include "harness.hpp"
#include "test_util.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {


TEST(PeerKill, KilledTcpPeerIsPeerLostOnEveryChannel) {
  ChildConfig cfg;
  cfg.transport = "tcp";
  cfg.channels = 8;
  cfg.heap_bytes = 32 * kMiB;
  cfg.alloc_bytes = 4 * kMiB;
  auto child = std::make_unique<Child>(cfg);
  ASSERT_FALSE(child->blob().empty());
  Engine engine(engine_config("tcp", 8, 30s));
  Endpoint ep = engine.connect(child->blob());
  RemoteHandle heap = *ep.remote_region("heap");
  std::vector<uint8_t> local(32 * kMiB, 1), in(32 * kMiB, 0);
  auto hl = engine.register_memory(local.data(), local.size());
  auto hin = engine.register_memory(in.data(), in.size());
  ASSERT_TRUE(ep.write({{hl, 0, heap, 0, 32 * kMiB}}).wait().ok());
  // Keep every channel busy both ways, then kill the peer in the middle of it.
  std::vector<Future> fs;
  std::atomic<bool> stop{false};
  std::thread killer([&] {
    std::this_thread::sleep_for(300ms);
    child->kill(SIGKILL);
    stop = true;
  });
  while (!stop.load() || fs.size() < 64) {
    if (fs.size() >= 4000) break;
    try {
      for (int i = 0; i < 8; ++i) {
        fs.push_back(ep.write({{hl, i * 4 * kMiB, heap, i * 4 * kMiB, 4 * kMiB}}));
        fs.push_back(ep.read({{hin, i * 4 * kMiB, heap, i * 4 * kMiB, 4 * kMiB}}));
      }
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
      break;
    }
    if (stop.load()) std::this_thread::sleep_for(1ms);
  }
  killer.join();
  child->reap_killed();
  std::map<ErrorCode, int> codes;
  for (size_t i = 0; i < fs.size(); ++i) {
    ASSERT_TRUE(fs[i].wait_for(10s)) << "future " << i << " still pending after the peer was killed";
    Status st = fs[i].status();
    if (st.ok()) continue;
    codes[st.code]++;
    EXPECT_EQ(st.code, ErrorCode::kPeerLost) << "future " << i << ": " << st.to_string();
  }
  EXPECT_GT(codes[ErrorCode::kPeerLost], 0) << "no future failed: the peer was killed too late";
  EXPECT_EQ(codes[ErrorCode::kCancelled], 0) << "a killed peer was reported as a local close";
  EXPECT_FALSE(ep.connected());
}

// shm recv offers (shm_offer.cpp): a sender killed while it holds a recv's offer (it took it,
// and the test knob shm.test_put_delay_ms keeps it from copying for 3 s) leaves nothing
// pending: the receiver's recv fails as soon as the peer is found gone, with kPeerLost and a
// note that its buffer may still be written (a dead sender writes nothing more).
TEST(PeerKill, SenderKilledHoldingARecvOfferFailsTheRecv) {
  ChildConfig cfg;
  cfg.transport = "shm";
  ::setenv("SLUICE_SHM_TEST_PUT_DELAY_MS", "3000", 1);
  auto child = std::make_unique<Child>(cfg);  // forked with the knob; its endpoint reads it
  ::unsetenv("SLUICE_SHM_TEST_PUT_DELAY_MS");
  ASSERT_FALSE(child->blob().empty());
  // op_timeout 3 s: the dead sender died inside our region's lease, which the engine's close
  // then waits for that long (Leases.*), as for any same-host peer killed mid-copy.
  Engine engine(engine_config("shm", 2, 3s));
  auto mem = engine.allocate(1 << 20, Location::host(), "recvs");
  Endpoint ep = engine.connect(child->blob());
  constexpr uint64_t kMsg = 300000;  // past shm.eager_max: a rendezvous SEND
  // Until a SEND takes its offer (the sender maps our ring, then describes our region, in the
  // background): that one is held 3 s.
  bool held = false;
  for (int i = 0; i < 200 && !held; ++i) {
    std::this_thread::sleep_for(5ms);
    auto r = ep.recv(mem.handle, 0, kMsg);
    const auto t0 = std::chrono::steady_clock::now();
    auto out = child->call(Cmd::kSend, 1, 0, kMsg, 0, 20s);
    ASSERT_EQ(out.size(), 1u);
    ASSERT_EQ(out[0], 0u) << "child send " << i;
    held = std::chrono::steady_clock::now() - t0 > 2500ms;
    ASSERT_TRUE(r.wait_for(10s));
    ASSERT_TRUE(r.status().ok()) << r.status().to_string();
  }
  ASSERT_TRUE(held) << "no SEND ever took its recv's offer";
  auto r = ep.recv(mem.handle, 0, kMsg);
  std::thread sender([&] { (void)child->call(Cmd::kSend, 1, 0, kMsg, 0, 10s); });
  std::this_thread::sleep_for(800ms);
  child->kill(SIGKILL);
  sender.join();
  child->reap_killed();
  ASSERT_TRUE(r.wait_for(10s)) << "a recv whose offer a dead sender held is still pending";
  EXPECT_EQ(r.status().code, ErrorCode::kPeerLost) << r.status().to_string();
  EXPECT_NE(r.status().message.find("may still write"), std::string::npos) << r.status().message;
  EXPECT_FALSE(ep.connected());
}

}  // namespace
