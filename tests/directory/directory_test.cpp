// The directories on their own: the in-memory one (publish, lookup, withdraw, deadlines) and
// the listener one (an INFO query to "host:port"), and two engines that connect through a
// shared in-memory directory by engine id.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "core/engine_impl.hpp"
#include "directory/in_memory_directory.hpp"
#include "directory/listener_directory.hpp"
#include "sluice/sluice.hpp"

namespace sluice::detail {
namespace {

using namespace std::chrono_literals;
using Clock = PeerDirectory::Clock;

EngineInfo info_named(const std::string& id, uint16_t port) {
  EngineInfo e;
  e.wire_version = kWireVersion;
  e.engine_id = id;
  e.host_id = "h";
  e.listen_host = "127.0.0.1";
  e.listen_port = port;
  return e;
}

EngineConfig tcp_config() {
  EngineConfig c;
  c.transports = {"tcp"};
  c.connect_timeout = 5s;
  return c;
}

ErrorCode code_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode::kOk;
}

TEST(InMemoryDirectory, PublishLookupWithdraw) {
  InMemoryDirectory dir;
  dir.publish(info_named("e1", 1000));
  dir.publish(info_named("e2", 2000));
  EXPECT_EQ(dir.size(), 2u);
  EngineInfo got = dir.lookup("e2", Clock::now() + 1s);
  EXPECT_EQ(got.engine_id, "e2");
  EXPECT_EQ(got.listen_port, 2000);
  // A second publish replaces the first (the engine's regions changed).
  dir.publish(info_named("e2", 2001));
  EXPECT_EQ(dir.lookup("e2", Clock::now() + 1s).listen_port, 2001);
  dir.withdraw("e2");
  EXPECT_EQ(dir.size(), 1u);
  EXPECT_EQ(code_of([&] { dir.lookup("e2", Clock::now() + 20ms); }), ErrorCode::kTimeout);
}

TEST(InMemoryDirectory, LookupWaitsForALatePublish) {
  InMemoryDirectory dir;
  std::thread late([&] {
    std::this_thread::sleep_for(50ms);
    dir.publish(info_named("late", 7));
  });
  auto start = Clock::now();
  EngineInfo got = dir.lookup("late", start + 5s);
  late.join();
  EXPECT_EQ(got.engine_id, "late");
  EXPECT_GE(Clock::now() - start, 40ms);
}

TEST(InMemoryDirectory, MissingPeerTimesOutAtTheDeadline) {
  InMemoryDirectory dir;
  auto start = Clock::now();
  EXPECT_EQ(code_of([&] { dir.lookup("nobody", start + 100ms); }), ErrorCode::kTimeout);
  EXPECT_GE(Clock::now() - start, 90ms);
  EXPECT_LT(Clock::now() - start, 3s);
}

TEST(ListenerDirectory, LooksUpAnEngineThroughItsListener) {
  Engine e(tcp_config());
  const std::string id = e.impl().info().engine_id;
  ListenerDirectory dir;
  EXPECT_FALSE(dir.wants_updates());
  uint64_t before = e.impl().listener_connections();
  EngineInfo got = dir.lookup(e.listen_address(), Clock::now() + 5s);
  EXPECT_EQ(got.engine_id, id);
  // The address returned is the one asked, not whatever the reply claims.
  EXPECT_EQ(got.listen_address(), e.listen_address());
  EXPECT_EQ(dir.ref_for(got), e.listen_address());
  EXPECT_EQ(e.impl().listener_connections(), before + 1);
}

TEST(ListenerDirectory, RefusesWhatIsNotHostPort) {
  ListenerDirectory dir;
  EXPECT_EQ(code_of([&] { dir.lookup("no-port-here", Clock::now() + 1s); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { dir.lookup("127.0.0.1:1", Clock::now() - 1ms); }), ErrorCode::kTimeout);
}

TEST(ListenerDirectory, NothingListeningFails) {
  ListenerDirectory dir;
  // Port 1 on loopback: nothing listens there in a test environment.
  EXPECT_NE(code_of([&] { dir.lookup("127.0.0.1:1", Clock::now() + 2s); }), ErrorCode::kOk);
}

TEST(EngineDirectory, TwoEnginesConnectByIdThroughASharedDirectory) {
  auto dir = std::make_shared<InMemoryDirectory>();
  Engine a(tcp_config()), b(tcp_config());
  a.impl().use_directory(dir);
  b.impl().use_directory(dir);
  EXPECT_EQ(dir->size(), 2u);
  std::vector<uint8_t> src(4096, 0x5a), dst(4096, 0);
  auto hs = a.register_memory(src.data(), src.size());
  b.register_memory(dst.data(), dst.size(), Location::host(), "dst");
  const std::string b_id = b.impl().info().engine_id;

  uint64_t b_before = b.impl().listener_connections();
  Endpoint ep = a.connect(b_id);
  // No INFO query: the hello and one tcp channel are all that reached b's listener.
  EXPECT_EQ(b.impl().listener_connections(), b_before + 1 + static_cast<uint64_t>(a.config().channels));
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  auto rd = ep.remote_region("dst");
  ASSERT_TRUE(rd.has_value());
  ASSERT_TRUE(ep.write({{hs, 0, *rd, 0, src.size()}}).wait().ok());
  EXPECT_EQ(dst, src);

  // A closed engine leaves the directory.
  b.close();
  EXPECT_EQ(dir->size(), 1u);
  EXPECT_EQ(code_of([&] { a.connect(b_id, ConnectOptions{"", 50ms}); }), ErrorCode::kTimeout);
}

TEST(EngineDirectory, UnknownIdTimesOut) {
  auto dir = std::make_shared<InMemoryDirectory>();
  Engine a(tcp_config());
  a.impl().use_directory(dir);
  EXPECT_EQ(code_of([&] { a.connect("0123456789abcdef", ConnectOptions{"", 50ms}); }), ErrorCode::kTimeout);
}

}  // namespace
}  // namespace sluice::detail
