// Class 6 of issue 18: a tcp peer killed mid-traffic must be reported as kPeerLost. With 8
// channels most failed futures used to say CancelledError("channel closed"): a channel's
// writer hit EPIPE, set the stop flag, and its reader took that flag for a local close.
#include <gtest/gtest.h>

#include <map>

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

}  // namespace
