// A peer process killed while the port channel is in use: a producer blocked in wait() and
// the producers' flush() return kFailed (the channel says kPeerLost) in bounded time, and
// pushes never hang. Over tcp and shm, against a forked child (tests/transport/harness.hpp).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "../transport/harness.hpp"
#include "sluice/port_channel.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {

class PortChannelKill : public ::testing::TestWithParam<std::string> {};

TEST_P(PortChannelKill, KilledPeerFailsWaitAndFlush) {
  ChildConfig cfg;
  cfg.transport = GetParam();
  auto child = std::make_unique<Child>(cfg);
  ASSERT_FALSE(child->blob().empty()) << "the child engine did not start";
  Engine engine(engine_config(GetParam(), 2, 10s));
  std::vector<uint8_t> local(1 << 20, 7);
  MemoryHandle hl = engine.register_memory(local.data(), local.size());
  Endpoint ep = engine.connect(child->blob());
  RemoteHandle heap = *ep.remote_region("heap");
  for (uint64_t i = local.size() - 64; i < local.size(); ++i) local[i] = 0;
  ProxyService proxy(engine, {});
  PortChannel ch =
      proxy.add_channel(ep, proxy.add_memory(ep, heap), proxy.add_memory(hl), {heap, 0}, {hl, local.size() - 8});
  // A second channel that only ever waits: nothing of it is pending when the peer dies, so
  // only the proxy's liveness check can tell its waiter.
  PortChannel idle = proxy.add_channel(ep, proxy.add_memory(ep, heap), proxy.add_memory(hl), {heap, 8},
                                       {hl, local.size() - 16});
  proxy.start();
  auto h = ch.device_handle();
  ASSERT_EQ(PortResult::kOk, h.put_with_signal_and_flush(4096, 0, 1 << 20)) << ch.status().to_string();
  ASSERT_EQ(fnv(local.data(), 1 << 20), child->checksum(0, 4096, 1 << 20)) << "the put did not land in the child";

  // One producer waits for a signal the child never sends; another keeps pushing puts.
  std::atomic<int> waited{-1};
  std::atomic<bool> stop{false};
  std::atomic<int> push_failed{0};
  std::atomic<int> idle_waited{-1};
  std::thread waiter([&] { waited = int(h.wait(60'000'000'000ull)); });
  std::thread idle_waiter([&] { idle_waited = int(idle.device_handle().wait(60'000'000'000ull)); });
  std::thread pusher([&] {
    while (!stop.load())
      if (h.put(4096, 0, 65536) != PortResult::kOk) {
        push_failed++;
        return;
      }
  });
  std::this_thread::sleep_for(100ms);
  child->kill(SIGKILL);
  child->reap_killed();
  waiter.join();
  idle_waiter.join();
  // The pusher may be between two pushes when the waiters return: give it a bounded time to
  // make the push that must fail, rather than stopping it first.
  for (auto until = std::chrono::steady_clock::now() + 10s;
       push_failed.load() == 0 && std::chrono::steady_clock::now() < until;)
    std::this_thread::sleep_for(1ms);
  stop = true;
  pusher.join();
  EXPECT_EQ(int(PortResult::kFailed), waited.load()) << "wait() did not return kFailed after the peer died";
  EXPECT_EQ(1, push_failed.load()) << "pushes kept succeeding on a channel whose peer is dead";
  EXPECT_EQ(PortResult::kFailed, h.flush());
  EXPECT_EQ(ErrorCode::kPeerLost, ch.status().code) << ch.status().to_string();
  EXPECT_EQ(int(PortResult::kFailed), idle_waited.load()) << "an idle channel's wait() missed the lost peer";
  EXPECT_EQ(ErrorCode::kPeerLost, idle.status().code) << idle.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(Transports, PortChannelKill, ::testing::Values("tcp", "shm"), transport_name);

}  // namespace
