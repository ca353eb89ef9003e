// Class 2 of issue 18: Endpoint::close() from several threads at once, racing the watchdog
// timing the endpoint out, the peer failing and Engine::close(). It used to hang (two threads
// joining the same channel threads) and later crash (a stuck joiner joining a reused thread
// handle). No fork: runs under TSan, which must report nothing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <random>
#include <thread>

#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "loopback.hpp"
#include "sluice/version.hpp"

using namespace sluice;
using namespace sluice_test;
using nlohmann::json;
namespace boot = sluice::bootstrap;

namespace {

// A peer that opens a 2-channel tcp endpoint to `victim`, advertises region 7 and then
// never answers anything: the victim's operations time out.
std::vector<net::Socket> silent_peer(Engine& victim, uint64_t token) {
  auto [host, port] = detail::split_host_port(victim.listen_address());
  detail::EngineInfo e;
  e.wire_version = kWireVersion;
  e.engine_id = "silent0000000000";
  e.host_id = "silent-host";
  e.listen_host = "127.0.0.1";
  e.listen_port = 1;
  e.transports["tcp"] = json::object();
  detail::PeerRegion r;
  r.info.id = 7;
  r.info.addr = 0x10000;
  r.info.length = 1 << 20;
  r.info.location = Location::host();
  e.regions.push_back(r);
  {
    net::Socket s = net::connect_tcp(host, port, 2s);
    net::set_io_timeout(s.fd(), 5s);
    boot::send_msg(s.fd(), boot::MsgKind::kHello,
                   {{"info", e.to_json()}, {"token", token}, {"transport", "tcp"}, {"channels", 2}});
    boot::expect_reply(s.fd(), "hello");
  }
  std::vector<net::Socket> chans;
  for (int i = 0; i < 2; ++i) {
    net::Socket s = net::connect_tcp(host, port, 2s);
    net::set_io_timeout(s.fd(), 5s);
    boot::send_msg(s.fd(), boot::MsgKind::kChannel, {{"token", token}, {"index", i}, {"transport", "tcp"}});
    boot::expect_reply(s.fd(), "channel");
    chans.push_back(std::move(s));
  }
  return chans;
}

TEST(CloseRace, ConcurrentClosesWatchdogPeerFailureAndEngineClose) {
  ::signal(SIGPIPE, SIG_IGN);
  std::mt19937 rng(18);
  for (int round = 0; round < 12; ++round) {
    EngineConfig c = engine_config("tcp", 2, 300ms);
    c.connect_timeout = 2000ms;
    auto victim = std::make_unique<Engine>(c);
    std::vector<uint8_t> mem(1 << 20);
    auto h = victim->register_memory(mem.data(), mem.size());
    auto chans = silent_peer(*victim, 9000 + round);
    auto ep = victim->accept(5s);
    ASSERT_TRUE(ep.has_value());
    std::vector<Future> fs;
    for (int i = 0; i < 8; ++i) fs.push_back(ep->write({{h, 0, RemoteHandle{7}, 0, 300000}}));
    fs.push_back(ep->read({{h, 0, RemoteHandle{7}, 0, 4096}}));
    // Everything lands around the watchdog's deadline (op_timeout 300 ms).
    const int base = 250 + static_cast<int>(rng() % 100);
    std::atomic<int> closes{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t)
      ts.emplace_back([&, t] {
        std::this_thread::sleep_for(std::chrono::milliseconds(base + 10 * t));
        Endpoint copy = *ep;
        copy.close();
        copy.close();  // idempotent
        closes++;
      });
    ts.emplace_back([&] {  // the peer fails
      std::this_thread::sleep_for(std::chrono::milliseconds(base + 5));
      for (auto& s : chans) s.shutdown();
    });
    ts.emplace_back([&] {  // and the engine closes
      std::this_thread::sleep_for(std::chrono::milliseconds(base + 15));
      victim->close();
    });
    for (auto& t : ts) t.join();
    EXPECT_EQ(closes.load(), 4);
    for (auto& f : fs) {
      ASSERT_TRUE(f.wait_for(5s)) << "round " << round << ": an operation never completed";
      EXPECT_FALSE(f.status().ok());
    }
    EXPECT_FALSE(ep->connected());
    ep.reset();
    victim.reset();
  }
}

// A completion callback (on a channel thread) closing its own endpoint while the watchdog
// closes it too: the channel thread must neither join itself nor wait for a closer that is
// joining it.
TEST(CloseRace, CloseFromACompletionCallback) {
  ::signal(SIGPIPE, SIG_IGN);
  EngineConfig c = engine_config("tcp", 2, 300ms);
  c.connect_timeout = 2000ms;
  Engine victim(c);
  std::vector<uint8_t> mem(1 << 20);
  auto h = victim.register_memory(mem.data(), mem.size());
  auto chans = silent_peer(victim, 9900);
  auto ep = victim.accept(5s);
  ASSERT_TRUE(ep.has_value());
  std::atomic<int> called{0};
  Endpoint copy = *ep;
  Future f = ep->write({{h, 0, RemoteHandle{7}, 0, 4096}});
  f.on_complete([copy, &called](const Status&) mutable {
    copy.close();
    called++;
  });
  ASSERT_TRUE(f.wait_for(5s));
  for (auto& s : chans) s.shutdown();
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (called.load() == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(called.load(), 1);
  ep->close();
  victim.close();
}

}  // namespace
