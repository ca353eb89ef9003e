// Hostile peers against the bootstrap protocol (issue 18, classes 4-6), on both sides: raw
// sockets that trickle, flood, oversize, nest, mistype and misdirect handshake messages
// against an engine's listener, and raw listeners that do the same to Engine::connect.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>

#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/device_hooks.hpp"
#include "core/engine_info.hpp"
#include "loopback.hpp"
#include "raw_peer.hpp"
#include "sluice/version.hpp"

using namespace sluice;
using namespace sluice_test;
using sluice::detail::EngineInfo;
using nlohmann::json;
namespace boot = sluice::bootstrap;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kHandshake = 1000ms;  // the victim's connect_timeout
// Generous bound for "cut off at the deadline, not later": the deadline plus scheduling slack.
constexpr auto kCutOff = kHandshake + 2500ms;

json fake_info(uint16_t listen_port = 1, const std::string& id = "evil000000000000") {
  EngineInfo e;
  e.wire_version = kWireVersion;
  e.engine_id = id;
  e.host_id = "evil-host";
  e.listen_host = "127.0.0.1";
  e.listen_port = listen_port;
  e.transports["tcp"] = json::object();
  return e.to_json();
}

template <typename D>
long long ms(D d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

class HostileBootstrap : public ::testing::Test {
 protected:
  void start(EngineConfig c) {
    victim_ = std::make_unique<Engine>(c);
    std::tie(host_, port_) = detail::split_host_port(victim_->listen_address());
  }
  void SetUp() override {
    EngineConfig c = engine_config("tcp", 1, 10s);
    c.connect_timeout = kHandshake;
    config_ = c;
  }
  void TearDown() override {
    if (victim_) victim_->close();
  }
  // Our side of every exchange gives up after 5 s (the old calls, for the old code too).
  net::Socket dial() {
    net::Socket s = net::connect_tcp(host_, port_, 2s);
    net::set_io_timeout(s.fd(), 5s);
    return s;
  }

  // Sends a header and raw body text; returns the error code of the reply (kOk: a reply).
  ErrorCode raw_request(boot::MsgKind kind, const std::string& text, std::string* message = nullptr) {
    net::Socket s = dial();
    BootHeader h = boot_header(static_cast<uint16_t>(kind), static_cast<uint32_t>(text.size()));
    EXPECT_TRUE(write_all(s.fd(), &h, sizeof(h)));
    EXPECT_TRUE(write_all(s.fd(), text.data(), text.size()));
    return code_of([&] { boot::expect_reply(s.fd(), "raw"); }, message);
  }

  // Opens a 1-channel tcp endpoint to the victim by hand; returns its data channel.
  net::Socket forged_endpoint(uint64_t token, ErrorCode* hello_code = nullptr, std::string* why = nullptr) {
    {
      net::Socket s = dial();
      boot::send_msg(s.fd(), boot::MsgKind::kHello,
                     {{"info", fake_info()}, {"token", token}, {"transport", "tcp"}, {"channels", 1}});
      ErrorCode c = code_of([&] { boot::expect_reply(s.fd(), "hello"); }, why);
      if (hello_code) *hello_code = c;
      if (c != ErrorCode::kOk) return {};
    }
    net::Socket s = dial();
    boot::send_msg(s.fd(), boot::MsgKind::kChannel, {{"token", token}, {"index", 0}, {"transport", "tcp"}});
    boot::expect_reply(s.fd(), "channel");
    return s;
  }

  void expect_still_serving() {
    Engine good(engine_config("tcp", 2, 10s));
    std::vector<uint8_t> buf(4096, 7), vbuf(4096, 0);
    auto h = good.register_memory(buf.data(), buf.size());
    auto hv = victim_->register_memory(vbuf.data(), vbuf.size(), Location::host(), "still-serving");
    {
      Endpoint ep = good.connect(victim_->listen_address());
      auto rh = ep.remote_region("still-serving");
      EXPECT_TRUE(rh.has_value());
      if (rh) {
        EXPECT_TRUE(ep.write({{h, 0, *rh, 0, 4096}}).wait().ok());
      }
      ep.close();
    }
    victim_->unregister_memory(hv);
    EXPECT_EQ(vbuf, buf);
  }

  EngineConfig config_;
  std::unique_ptr<Engine> victim_;
  std::string host_;
  uint16_t port_ = 0;
};

// Sends `h` and then the body one byte per 250 ms (well under the per-recv timeout the old
// code applied) until the peer hangs up or `limit` passes. Returns when the peer hung up.
std::optional<Clock::duration> trickle(int fd, const BootHeader& h, std::chrono::milliseconds limit) {
  auto t0 = Clock::now();
  if (!write_all(fd, &h, sizeof(h))) return Clock::now() - t0;
  while (Clock::now() - t0 < limit) {
    if (::send(fd, " ", 1, MSG_NOSIGNAL) != 1) return Clock::now() - t0;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 250) > 0) {
      char c;
      if (::recv(fd, &c, 1, MSG_DONTWAIT) <= 0) return Clock::now() - t0;
    }
  }
  return std::nullopt;
}

// A raw listener on 127.0.0.1 that serves each connection with `serve` on its own thread.
class RawListener {
 public:
  explicit RawListener(std::function<void(net::Socket)> serve) : serve_(std::move(serve)) {
    sock_ = net::listen_tcp("127.0.0.1", 0);
    port_ = net::local_port(sock_.fd());
    thread_ = std::thread([this] {
      while (!stop_) {
        pollfd p{sock_.fd(), POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) continue;
        net::Socket c = net::accept_tcp(sock_.fd());
        if (!c.valid()) continue;
        ++accepted_;
        workers_.emplace_back([this, c = std::move(c)]() mutable { serve_(std::move(c)); });
      }
    });
  }
  ~RawListener() {
    stop_ = true;
    thread_.join();
    for (auto& w : workers_) w.join();
  }
  uint16_t port() const { return port_; }
  int accepted() const { return accepted_; }
  bool stopping() const { return stop_; }

 private:
  std::function<void(net::Socket)> serve_;
  net::Socket sock_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::thread thread_;
  std::vector<std::thread> workers_;
};

}  // namespace

TEST_F(HostileBootstrap, ListenerCutsOffATricklingRequestAtTheHandshakeDeadline) {
  start(config_);
  net::Socket s = dial();
  auto took = trickle(s.fd(), boot_header(2, 100), 8s);
  ASSERT_TRUE(took.has_value()) << "a peer trickling one byte per 250 ms kept its handshake open for 8 s";
  EXPECT_LT(ms(*took), ms(kCutOff)) << "cut off only after " << ms(*took) << " ms (connect_timeout "
                                     << ms(kHandshake) << " ms)";
  expect_still_serving();
}

TEST_F(HostileBootstrap, ConnectCutsOffATricklingListener) {
  // stage 0: the INFO reply trickles; stage 1: the INFO reply is fine, the HELLO reply trickles.
  for (int stage = 0; stage < 2; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    uint16_t self_port = 0;
    RawListener hostile([&](net::Socket c) {
      try {
        net::set_io_timeout(c.fd(), 5s);
        auto [kind, body] = boot::recv_msg(c.fd());
        if (kind == boot::MsgKind::kInfo && stage == 1) {
          boot::send_msg(c.fd(), boot::MsgKind::kReply, {{"info", fake_info(self_port)}});
          return;
        }
        trickle(c.fd(), boot_header(static_cast<uint16_t>(boot::MsgKind::kReply), 100), 8s);
      } catch (const Error&) {
      }
    });
    self_port = hostile.port();
    EngineConfig c = engine_config("tcp", 1, 10s);
    c.connect_timeout = kHandshake;
    Engine client(c);
    auto t0 = Clock::now();
    std::string why;
    ErrorCode code = code_of([&] { client.connect("127.0.0.1:" + std::to_string(hostile.port())); }, &why);
    auto took = Clock::now() - t0;
    EXPECT_EQ(code, ErrorCode::kTimeout) << why;
    EXPECT_LT(ms(took), ms(kCutOff)) << "connect returned only after " << ms(took) << " ms: " << why;
  }
}

TEST_F(HostileBootstrap, OversizedHandshakeBodyIsRefusedFromItsHeader) {
  config_.max_handshake_bytes = 64 << 10;
  start(config_);
  net::Socket s = dial();
  BootHeader h = boot_header(2, 1 << 20);  // claims 1 MiB, sends nothing more
  ASSERT_TRUE(write_all(s.fd(), &h, sizeof(h)));
  std::string why;
  auto t0 = Clock::now();
  EXPECT_EQ(code_of([&] { boot::expect_reply(s.fd(), "oversized"); }, &why), ErrorCode::kProtocol)
      << why;
  EXPECT_NE(why.find("max_handshake_bytes"), std::string::npos) << why;
  EXPECT_LT(ms(Clock::now() - t0), ms(kHandshake)) << "refused only at the deadline, not from the header";
  // A body at the limit is still read (and refused for what it is, not for its size).
  std::string body(60 << 10, ' ');
  body[0] = '{';
  body.back() = '}';
  EXPECT_EQ(raw_request(boot::MsgKind::kHello, body, &why), ErrorCode::kProtocol);
  EXPECT_NE(why.find("missing field 'info'"), std::string::npos) << why;
}

TEST_F(HostileBootstrap, DeeplyNestedBodyIsRefusedBeforeParsing) {
  start(config_);
  std::string why;
  EXPECT_EQ(raw_request(boot::MsgKind::kHello, std::string(1 << 20, '['), &why), ErrorCode::kProtocol);
  EXPECT_NE(why.find("deeper than the limit of 64"), std::string::npos) << why;
  // Well-formed but deep: {"info": [[[...]]]}, 100 levels.
  std::string deep = "{\"info\":" + std::string(100, '[') + std::string(100, ']') + "}";
  EXPECT_EQ(raw_request(boot::MsgKind::kHello, deep, &why), ErrorCode::kProtocol);
  EXPECT_NE(why.find("deeper than the limit of 64"), std::string::npos) << why;
  // Brackets inside strings are not nesting.
  std::string quoted = "{\"x\":\"" + std::string(1000, '[') + "\"}";
  EXPECT_EQ(raw_request(boot::MsgKind::kHello, quoted, &why), ErrorCode::kProtocol);
  EXPECT_NE(why.find("missing field 'info'"), std::string::npos) << why;
  // An info blob handed to connect() is bounded the same way.
  EXPECT_EQ(code_of([&] { EngineInfo::parse(std::string(100000, '[')); }, &why), ErrorCode::kProtocol);
  EXPECT_NE(why.find("deeper"), std::string::npos) << why;
}

TEST_F(HostileBootstrap, HandshakeThreadsAreBounded) {
  // Silent connections wait in the listener's epoll set: a descriptor each, no thread; an
  // honest peer still gets through while they are held, and they go at the idle deadline.
  config_.max_handshakes = 4;
  config_.connect_timeout = 3000ms;
  ::setenv("SLUICE_LISTEN_IDLE_MS", "1500", 1);
  start(config_);
  ::unsetenv("SLUICE_LISTEN_IDLE_MS");
  const int base = thread_count();
  std::vector<net::Socket> silent;
  for (int i = 0; i < 32; ++i) silent.push_back(dial());
  std::this_thread::sleep_for(300ms);
  EXPECT_LE(thread_count() - base, 2) << "32 silent connections made " << thread_count() - base << " threads";
  expect_still_serving();
  // Past the idle deadline every silent connection is closed by the listener.
  std::this_thread::sleep_for(1500ms);
  int dropped = 0;
  for (auto& s : silent) dropped += closed_by_peer(s.fd(), 500ms);
  EXPECT_EQ(dropped, 32) << "silent connections outlived the idle deadline";
  silent.clear();
  auto deadline = Clock::now() + 5s;
  while (Clock::now() < deadline && thread_count() > base) std::this_thread::sleep_for(50ms);
  expect_still_serving();
}

TEST_F(HostileBootstrap, IdleFloodCannotExhaustTheListener) {
  // More idle connections than the listener holds: the oldest silent ones make room, so a
  // real peer connects at once rather than after the flood's deadline.
  ::setenv("SLUICE_LISTEN_MAX_CONNECTIONS", "8", 1);
  ::setenv("SLUICE_LISTEN_IDLE_MS", "60000", 1);
  start(config_);
  ::unsetenv("SLUICE_LISTEN_MAX_CONNECTIONS");
  ::unsetenv("SLUICE_LISTEN_IDLE_MS");
  const int base = thread_count();
  std::vector<net::Socket> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(dial());
  std::this_thread::sleep_for(300ms);
  EXPECT_LE(thread_count() - base, 2) << "64 idle connections made " << thread_count() - base << " threads";
  int dropped = 0;
  for (auto& s : idle) dropped += closed_by_peer(s.fd(), 10ms);
  EXPECT_GE(dropped, 64 - 8) << "the listener held more idle connections than its bound";
  auto t0 = Clock::now();
  expect_still_serving();
  EXPECT_LT(ms(Clock::now() - t0), 5000) << "a real peer waited behind the idle flood";
}

TEST_F(HostileBootstrap, PassiveEngineReleasesClosedPeersWithoutAccept) {
  start(config_);
  expect_still_serving();  // warm up: the engines and threads a first connect creates
  while (victim_->accept(0ms)) {
  }
  const int base = fd_count();
  for (int i = 0; i < 150; ++i) {
    net::Socket ch = forged_endpoint(1000 + i);
    ASSERT_TRUE(ch.valid());
  }  // each channel closes right away; the victim never calls accept()
  auto deadline = Clock::now() + 5s;
  while (Clock::now() < deadline && fd_count() > base + 2) std::this_thread::sleep_for(50ms);
  std::this_thread::sleep_for(200ms);  // the watchdog's last pass
  EXPECT_LE(fd_count(), base + 10) << "closed peers kept " << fd_count() - base << " descriptors";
  // Nothing is left to accept but the live endpoint a new peer opens.
  EXPECT_FALSE(victim_->accept(0ms).has_value());
  expect_still_serving();
}

TEST_F(HostileBootstrap, FailedAcceptedEndpointsAreReleasedWithoutClose) {
  // The engine closes the transport of an endpoint that failed and stops holding it, so a
  // user that drops a failed endpoint without close() leaks nothing.
  start(config_);
  expect_still_serving();  // warm up: the shared progress reactors' descriptors, made once per process
  while (victim_->accept(0ms)) {
  }
  const int base = fd_count();
  std::vector<Endpoint> held;
  {
    std::vector<net::Socket> peers;
    for (int i = 0; i < 20; ++i) {
      peers.push_back(forged_endpoint(2000 + i));
      auto ep = victim_->accept(5s);
      ASSERT_TRUE(ep.has_value());
      held.push_back(*ep);
    }
  }  // all peers hang up
  auto deadline = Clock::now() + 5s;
  auto all_failed = [&] {
    for (auto& ep : held)
      if (ep.connected()) return false;
    return true;
  };
  while (Clock::now() < deadline && !all_failed()) std::this_thread::sleep_for(20ms);
  ASSERT_TRUE(all_failed());
  std::this_thread::sleep_for(200ms);  // the watchdog's pass
  EXPECT_NE(code_of([&] { held[0].send({}, 0, 0); }), ErrorCode::kOk);
  held[0].close();  // still safe after the engine closed its transport
  held.clear();     // dropped without close()
  deadline = Clock::now() + 5s;
  while (Clock::now() < deadline && fd_count() > base + 2) std::this_thread::sleep_for(50ms);
  EXPECT_LE(fd_count(), base + 2) << "failed endpoints dropped by the user kept " << fd_count() - base
                                  << " descriptors";
}

TEST_F(HostileBootstrap, PendingAcceptsAreBounded) {
  config_.max_pending_accepts = 4;
  start(config_);
  std::vector<net::Socket> peers;
  for (int i = 0; i < 4; ++i) peers.push_back(forged_endpoint(3000 + i));
  ErrorCode code = ErrorCode::kOk;
  std::string why;
  net::Socket extra = forged_endpoint(3100, &code, &why);
  EXPECT_EQ(code, ErrorCode::kRemoteError) << why;
  EXPECT_NE(why.find("too many endpoints waiting for accept()"), std::string::npos) << why;
  // Accepting one makes room for one.
  ASSERT_TRUE(victim_->accept(1s).has_value());
  net::Socket next = forged_endpoint(3101, &code, &why);
  EXPECT_EQ(code, ErrorCode::kOk) << why;
}

TEST_F(HostileBootstrap, HandshakeFieldsAreCheckedForPresenceTypeAndRange) {
  start(config_);
  using K = boot::MsgKind;
  const std::string info = fake_info().dump();
  auto hello = [&](const std::string& token, const std::string& channels = "1") {
    return "{\"info\":" + info + ",\"token\":" + token + ",\"transport\":\"tcp\",\"channels\":" + channels + "}";
  };
  std::string why;
  for (const char* bad : {"18446744073709551616", "-1", "1.5", "\"7\"", "null"}) {
    EXPECT_EQ(raw_request(K::kHello, hello(bad), &why), ErrorCode::kProtocol) << bad;
    EXPECT_NE(why.find("hello: field 'token' must be an unsigned integer"), std::string::npos) << why;
  }
  for (const char* bad : {"1.0", "65", "0", "-3", "4294967297"}) {
    EXPECT_EQ(raw_request(K::kHello, hello("41", bad), &why), ErrorCode::kProtocol) << bad;
    EXPECT_NE(why.find("hello: field 'channels' must be an integer 1..64"), std::string::npos) << why;
  }
  for (const char* field : {"info", "token", "transport", "channels"}) {
    json body = json::parse(hello("42"));
    body.erase(field);
    EXPECT_EQ(raw_request(K::kHello, body.dump(), &why), ErrorCode::kProtocol) << field;
    EXPECT_NE(why.find(std::string("hello: missing field '") + field + "'"), std::string::npos) << why;
  }
  // A channel index of 2^63 must not become 0 (the one channel this endpoint has).
  ASSERT_EQ(raw_request(K::kHello, hello("43"), &why), ErrorCode::kOk) << why;
  for (const char* bad : {"9223372036854775808", "4294967296", "-1", "0.0", "1"}) {
    EXPECT_EQ(raw_request(K::kChannel, std::string("{\"token\":43,\"transport\":\"tcp\",\"index\":") + bad + "}", &why),
              ErrorCode::kProtocol)
        << bad;
    EXPECT_NE(why.find("channel attach: field 'index'"), std::string::npos) << why;
  }
  EXPECT_EQ(raw_request(K::kChannel, "{\"token\":-43,\"index\":0}", &why), ErrorCode::kProtocol);
  EXPECT_NE(why.find("channel attach: field 'token'"), std::string::npos) << why;
  // A bad region in the hello's info names the region field.
  json bad_info = fake_info();
  bad_info["regions"] = json::array({{{"id", 1}, {"addr", 4096}, {"length", 4096}, {"location", "cuda:99999"}, {"name", "x"}}});
  EXPECT_EQ(raw_request(K::kHello, "{\"info\":" + bad_info.dump() + ",\"token\":44,\"transport\":\"tcp\",\"channels\":1}", &why),
            ErrorCode::kProtocol);
  EXPECT_NE(why.find("field 'location'"), std::string::npos) << why;
  expect_still_serving();
}

TEST(HostileEngineInfo, RegionsAndFieldsAreRangeChecked) {
  auto with_region = [](json region) {
    json j = fake_info();
    j["regions"] = json::array({region});
    return j;
  };
  json good = {{"id", 1}, {"addr", 4096}, {"length", 4096}, {"location", "host"}, {"name", "r"}};
  EXPECT_NO_THROW(EngineInfo::from_json(with_region(good)));
  for (const char* loc : {"cpu", "cuda:0", "cuda:1023"}) {
    json r = good;
    r["location"] = loc;
    EXPECT_NO_THROW(EngineInfo::from_json(with_region(r))) << loc;
  }
  struct Case {
    const char* field;
    json value;
  };
  std::vector<Case> cases = {
      {"location", "cuda:99999"}, {"location", "cuda:1024"}, {"location", "cuda:-1"}, {"location", "cuda"},
      {"location", "gpu"},        {"location", " host"},     {"location", 7},         {"id", -1},
      {"id", 1.5},                {"addr", "0x1000"},        {"length", UINT64_MAX},  {"name", std::string(5000, 'n')},
      {"shareable", "yes"},       {"shareable", 1},
  };
  for (const auto& c : cases) {
    json r = good;
    r[c.field] = c.value;
    std::string why;
    EXPECT_EQ(code_of([&] { EngineInfo::from_json(with_region(r)); }, &why), ErrorCode::kProtocol)
        << c.field << " = " << c.value.dump().substr(0, 40);
    EXPECT_NE(why.find(std::string("field '") + c.field + "'"), std::string::npos) << why;
  }
  for (auto [field, value] : std::vector<std::pair<const char*, json>>{
           {"sluice", 1.0}, {"engine_id", 5}, {"listen", "nohost"}, {"transports", 3}}) {
    json j = fake_info();
    j[field] = value;
    std::string why;
    EXPECT_EQ(code_of([&] { EngineInfo::from_json(j); }, &why), ErrorCode::kProtocol) << field;
    EXPECT_NE(why.find(std::string("field '") + field + "'"), std::string::npos) << why;
  }
}

TEST(HostileEngineInfo, ErrorRepliesWithMistypedFieldsAreStillReported) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  net::Socket a(sv[0]), b(sv[1]);
  net::set_io_timeout(b.fd(), 1s);
  for (json body : {json{{"code", "x"}, {"message", 5}}, json{{"code", 1e300}}, json{{"code", -7}, {"message", json::array()}}}) {
    boot::send_msg(a.fd(), boot::MsgKind::kError, body);
    std::string why;
    try {
      EXPECT_EQ(code_of([&] { boot::expect_reply(b.fd(), "probe"); }, &why), ErrorCode::kRemoteError)
          << why;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "an error reply " << body.dump() << " escaped as a non-sluice exception: " << e.what();
    }
  }
}

TEST(HostileEngineInfo, RegisteringDeviceMemoryWithoutDeviceSupportIsUnsupported) {
  if (detail::device_memory_hooks()) GTEST_SKIP() << "this build has device support";
  Engine e(engine_config("tcp", 1, 10s));
  std::vector<uint8_t> buf(4096);
  std::string why;
  EXPECT_EQ(code_of([&] { e.register_memory(buf.data(), buf.size(), Location::cuda(99), "gpu"); }, &why),
            ErrorCode::kUnsupported);
  EXPECT_NE(why.find("cuda:99"), std::string::npos) << why;
}

TEST(HostileConnect, ConnectByAddressNeverFollowsTheAdvertisedListenAddress) {
  // The third party a hostile INFO reply points at: it must never hear from us.
  RawListener third([](net::Socket) {});
  std::atomic<int> hellos{0};
  RawListener hostile([&](net::Socket c) {
    try {
      net::set_io_timeout(c.fd(), 5s);
      auto [kind, body] = boot::recv_msg(c.fd());
      if (kind == boot::MsgKind::kInfo) {
        boot::send_msg(c.fd(), boot::MsgKind::kReply, {{"info", fake_info(third.port())}});
      } else if (kind == boot::MsgKind::kHello) {
        ++hellos;
        boot::send_error(c.fd(), static_cast<int>(ErrorCode::kRemoteError), "test ends here");
      }
    } catch (const Error&) {
    }
  });
  EngineConfig cfg = engine_config("tcp", 1, 10s);
  cfg.connect_timeout = kHandshake;
  Engine client(cfg);
  std::string why;
  EXPECT_EQ(code_of([&] { client.connect("127.0.0.1:" + std::to_string(hostile.port())); }, &why),
            ErrorCode::kRemoteError)
      << why;
  EXPECT_EQ(hellos.load(), 1) << "the hello did not go to the address we dialed";
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(third.accepted(), 0) << "connect followed the peer's advertised listen address to a third party";
}

TEST_F(HostileBootstrap, PortProbesDoNotWarn) {
  config_.log_level = LogLevel::kWarn;
  start(config_);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 20; ++i) {
    net::Socket s = dial();
  }
  std::this_thread::sleep_for(300ms);
  std::string probes = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(probes, "") << "port probes were logged";
  // A genuine refusal still warns (once: the rest of a burst is rate limited).
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 20; ++i) raw_request(boot::MsgKind::kHello, "{}");
  std::this_thread::sleep_for(100ms);
  std::string log = ::testing::internal::GetCapturedStderr();
  size_t lines = 0;
  for (size_t p = log.find("listener:"); p != std::string::npos; p = log.find("listener:", p + 1)) ++lines;
  EXPECT_NE(log.find("missing field 'info'"), std::string::npos) << "a genuine refusal was not logged:\n" << log;
  EXPECT_LE(lines, 2u) << "refusals were not rate limited:\n" << log;
}

namespace {
// Copies bytes both ways between a and b until either side closes or `stop` is set.
void pipe_both_ways(int a, int b, const std::atomic<bool>& stop) {
  char buf[64 << 10];
  while (!stop) {
    pollfd p[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    if (::poll(p, 2, 50) <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t n = ::recv(p[i].fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return;
      if (n > 0 && !write_all(p[1 - i].fd, buf, static_cast<size_t>(n))) return;
    }
  }
}
}  // namespace

TEST_F(HostileBootstrap, ConnectAndRefreshUseTheDialedAddress) {
  // The peer is reached through a front address (a relay); its INFO replies name a third
  // party as its listen address. Hello, channels and refresh_remote_regions() must all go
  // through the address we dialed, and the third party must never hear from us.
  start(config_);
  std::vector<uint8_t> vbuf(4096, 0);
  victim_->register_memory(vbuf.data(), vbuf.size(), Location::host(), "v");
  RawListener third([](net::Socket) {});
  std::atomic<bool> stop{false};
  RawListener front([&](net::Socket c) {
    try {
      net::Socket up = dial();
      net::set_io_timeout(c.fd(), 5s);
      auto [kind, body] = boot::recv_msg(c.fd());
      boot::send_msg(up.fd(), kind, body);
      if (kind != boot::MsgKind::kInfo) {
        pipe_both_ways(c.fd(), up.fd(), stop);
        return;
      }
      json reply = boot::expect_reply(up.fd(), "relay");
      reply["info"]["listen"] = "127.0.0.1:" + std::to_string(third.port());
      boot::send_msg(c.fd(), boot::MsgKind::kReply, reply);
    } catch (const Error&) {
    }
  });
  {
    Engine client(engine_config("tcp", 2, 10s));
    std::vector<uint8_t> buf(4096, 9);
    auto h = client.register_memory(buf.data(), buf.size());
    Endpoint ep = client.connect("127.0.0.1:" + std::to_string(front.port()));
    auto rv = ep.remote_region("v");
    ASSERT_TRUE(rv.has_value());
    ASSERT_TRUE(ep.write({{h, 0, *rv, 0, 4096}}).wait().ok());
    EXPECT_EQ(vbuf, buf);
    std::vector<uint8_t> wbuf(4096, 0);
    victim_->register_memory(wbuf.data(), wbuf.size(), Location::host(), "w");
    ep.refresh_remote_regions();
    EXPECT_TRUE(ep.remote_region("w").has_value());
    ep.close();
  }
  stop = true;
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(third.accepted(), 0) << "connect or refresh followed the peer's advertised listen address";
  victim_->close();  // before vbuf and wbuf go away
}

// tcp channel failover: a channel "replace" names a live endpoint the listener accepted by its
// token (64 random bits only the two engines know) and a channel index. A wrong token or an
// index out of range is refused with an error saying which, and the live endpoint keeps its
// channel; the right token and index stop the old channel (it is hung up) and install the new.
TEST_F(HostileBootstrap, ChannelReplaceNeedsTheLiveEndpointsTokenAndAValidIndex) {
  start(config_);
  const uint64_t token = 0x5eed'f00d'1234'5678ull;
  net::Socket live = forged_endpoint(token);
  ASSERT_TRUE(live.valid());
  // Live (in the engine's list) once accept() returns it; the reply may come a little before.
  auto accepted = victim_->accept(5s);
  ASSERT_TRUE(accepted.has_value());
  auto replace = [&](uint64_t t, uint64_t index, std::string* why) {
    net::Socket s = dial();
    boot::send_msg(s.fd(), boot::MsgKind::kChannel,
                   {{"token", t}, {"index", index}, {"transport", "tcp"}, {"replace", true}});
    ErrorCode c = code_of([&] { boot::expect_reply(s.fd(), "replace"); }, why);
    return std::make_pair(c, std::move(s));
  };
  auto hung_up = [](int fd) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 300) <= 0) return false;  // still open and silent
    char c;
    return ::recv(fd, &c, 1, MSG_DONTWAIT) == 0 || (p.revents & (POLLHUP | POLLERR));
  };
  std::string why;
  auto [c1, s1] = replace(token ^ 1, 0, &why);
  EXPECT_EQ(c1, ErrorCode::kProtocol);
  EXPECT_NE(why.find("channel replace: field 'token' names no live endpoint"), std::string::npos) << why;
  auto [c2, s2] = replace(token, 1, &why);
  EXPECT_EQ(c2, ErrorCode::kProtocol);
  EXPECT_NE(why.find("field 'index' must be 0..0, got 1"), std::string::npos) << why;
  EXPECT_FALSE(hung_up(live.fd())) << "a refused replace stopped the live endpoint's channel";
  expect_still_serving();
  // The real one: the old connection is hung up, the new one is the channel now.
  auto [c3, s3] = replace(token, 0, &why);
  EXPECT_EQ(c3, ErrorCode::kOk) << why;
  EXPECT_TRUE(hung_up(live.fd())) << "the replaced channel's connection is still open";
  EXPECT_FALSE(hung_up(s3.fd()));
}
