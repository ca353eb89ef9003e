// Hostile and broken peers against the engine's listener and a tcp data channel: garbage,
// truncated handshakes, forged bootstrap messages, forged and malformed frames, writes
// outside any region. The engine must refuse them, leave memory alone and keep serving.
#include <gtest/gtest.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <random>
#include <thread>

#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "loopback.hpp"
#include "raw_peer.hpp"
#include "test_util.hpp"
#include "sluice/version.hpp"
#include "transport/common/frame.hpp"

using namespace sluice;
using namespace sluice_test;
using sluice::detail::EngineInfo;
using sluice::detail::FrameHeader;
using sluice::detail::FrameType;
using sluice::detail::make_frame;
using nlohmann::json;
namespace boot = sluice::bootstrap;

namespace {


struct Frame {
  FrameHeader h{};
  std::string payload;
  bool ok = false;
};

Frame read_frame(int fd, std::chrono::milliseconds timeout = 5s) {
  Frame f;
  if (!read_all(fd, &f.h, sizeof(f.h), timeout)) return f;
  if (f.h.length > (64u << 20)) return f;
  f.payload.resize(f.h.length);
  if (f.h.length && !read_all(fd, f.payload.data(), f.h.length, timeout)) return f;
  f.ok = true;
  return f;
}

void send_frame(int fd, const FrameHeader& h, const void* payload = nullptr, size_t n = 0) {
  ASSERT_TRUE(write_all(fd, &h, sizeof(h)));
  if (n) {
    ASSERT_TRUE(write_all(fd, payload, n));
  }
}

class Hostile : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineConfig c = engine_config("tcp", 1, 10s);
    c.connect_timeout = 1000ms;  // truncated handshakes are dropped after this
    victim_ = std::make_unique<Engine>(c);
    mem_.assign(3 * kPage, 0);
    fill_pattern(mem_.data(), mem_.size(), 77);
    snap_ = mem_;
    // Only the middle page is registered; the pages around it are guards.
    hv_ = victim_->register_memory(mem_.data() + kPage, kPage, Location::host(), "victim");
    auto [host, port] = detail::split_host_port(victim_->listen_address());
    host_ = host;
    port_ = port;
  }
  void TearDown() override {
    if (victim_) victim_->close();
  }

  net::Socket dial() { return net::connect_tcp(host_, port_, 2s); }

  // A fresh, honest engine can still connect and move bytes both ways.
  void expect_still_serving() {
    Engine good(engine_config("tcp", 2, 10s));
    std::vector<uint8_t> buf(kPage);
    fill_pattern(buf.data(), buf.size(), 5);
    auto h = good.register_memory(buf.data(), buf.size());
    Endpoint ep = good.connect(victim_->local_info());
    auto rh = ep.remote_region("victim");
    ASSERT_TRUE(rh.has_value());
    ASSERT_TRUE(ep.write({{h, 0, *rh, 0, 512}}).wait().ok());
    EXPECT_EQ(0, std::memcmp(mem_.data() + kPage, buf.data(), 512));
    std::memcpy(snap_.data() + kPage, buf.data(), 512);
    std::vector<uint8_t> back(kPage);
    auto hb = good.register_memory(back.data(), back.size());
    ASSERT_TRUE(ep.read({{hb, 0, *rh, 0, kPage}}).wait().ok());
    EXPECT_EQ(0, std::memcmp(back.data(), mem_.data() + kPage, kPage));
    ep.close();
    expect_guards_intact();
  }

  void expect_guards_intact() {
    EXPECT_EQ(0, std::memcmp(mem_.data(), snap_.data(), kPage)) << "guard page before the region changed";
    EXPECT_EQ(0, std::memcmp(mem_.data() + 2 * kPage, snap_.data() + 2 * kPage, kPage))
        << "guard page after the region changed";
  }

  // Sends a well-framed bootstrap message and returns the code of the error reply (kOk if
  // the peer replied normally).
  ErrorCode bootstrap_code(boot::MsgKind kind, const json& body) {
    net::Socket s = dial();
    net::set_io_timeout(s.fd(), 5s);
    boot::send_msg(s.fd(), kind, body);
    return code_of([&] { boot::expect_reply(s.fd(), "forged"); });
  }

  json fake_info() {
    EngineInfo e;
    e.wire_version = kWireVersion;
    e.engine_id = "evil000000000000";
    e.host_id = "evil-host";
    e.listen_host = "127.0.0.1";
    e.listen_port = 1;
    e.transports["tcp"] = json::object();
    return e.to_json();
  }

  // Opens an endpoint to the victim by hand; returns its one tcp data channel.
  net::Socket forged_channel(uint64_t token) {
    {
      net::Socket s = dial();
      net::set_io_timeout(s.fd(), 5s);
      boot::send_msg(s.fd(), boot::MsgKind::kHello,
                     {{"info", fake_info()}, {"token", token}, {"transport", "tcp"}, {"channels", 1}});
      boot::expect_reply(s.fd(), "hello");
    }
    net::Socket s = dial();
    net::set_io_timeout(s.fd(), 5s);
    boot::send_msg(s.fd(), boot::MsgKind::kChannel, {{"token", token}, {"index", 0}, {"transport", "tcp"}});
    boot::expect_reply(s.fd(), "channel");
    return s;
  }

  uint64_t victim_id() { return hv_.id; }

  std::unique_ptr<Engine> victim_;
  std::vector<uint8_t> mem_, snap_;
  MemoryHandle hv_;
  std::string host_;
  uint16_t port_ = 0;
};

TEST_F(Hostile, GarbageOnTheListener) {
  std::mt19937_64 rng(1);
  std::vector<std::string> garbage;
  std::string rnd(4096, '\0');
  for (auto& c : rnd) c = static_cast<char>(rng());
  garbage.push_back(rnd);
  garbage.push_back("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  garbage.push_back(std::string(16, '\0'));
  garbage.push_back(std::string(1 << 20, '\xff'));
  BootHeader bad_check = boot_header(1, 2);
  bad_check.check ^= 1;
  garbage.push_back(std::string(reinterpret_cast<char*>(&bad_check), sizeof(bad_check)) + "{}");
  for (auto& g : garbage) {
    net::Socket s = dial();
    ::send(s.fd(), g.data(), g.size(), MSG_NOSIGNAL);
    EXPECT_TRUE(closed_by_peer(s.fd(), 5s)) << "the listener kept a garbage connection open";
  }
  expect_still_serving();
}

TEST_F(Hostile, TruncatedHandshakes) {
  // Half a header, then hang up.
  {
    net::Socket s = dial();
    BootHeader h = boot_header(1, 0);
    ASSERT_TRUE(write_all(s.fd(), &h, 10));
  }
  // A header that promises a body that never comes: the connection is dropped after the
  // handshake timeout, and meanwhile the listener keeps serving others.
  net::Socket slow = dial();
  BootHeader h = boot_header(2, 100);
  ASSERT_TRUE(write_all(slow.fd(), &h, sizeof(h)));
  ASSERT_TRUE(write_all(slow.fd(), "{\"info\":", 8));
  // A silent connection that sends nothing at all.
  net::Socket silent = dial();
  expect_still_serving();
  EXPECT_TRUE(closed_by_peer(slow.fd(), 5s)) << "a truncated handshake was never timed out";
  EXPECT_TRUE(closed_by_peer(silent.fd(), 5s)) << "a silent connection was never timed out";
  // A hello whose channels never arrive leaves nothing to accept.
  while (victim_->accept(0ms)) {
  }
  {
    net::Socket s = dial();
    net::set_io_timeout(s.fd(), 5s);
    boot::send_msg(s.fd(), boot::MsgKind::kHello,
                   {{"info", fake_info()}, {"token", 99}, {"transport", "tcp"}, {"channels", 2}});
    boot::expect_reply(s.fd(), "hello");
  }
  EXPECT_FALSE(victim_->accept(200ms).has_value());
  expect_still_serving();
}

TEST_F(Hostile, ForgedBootstrapMessages) {
  using K = boot::MsgKind;
  EXPECT_EQ(bootstrap_code(K::kReply, json::object()), ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kError, {{"code", 1}}), ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kHello, json::object()), ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", 5}, {"token", 1}, {"transport", "tcp"}, {"channels", 1}}),
            ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", json::object()}, {"token", 1}, {"transport", "tcp"}, {"channels", 1}}),
            ErrorCode::kProtocol);
  json wrong_version = fake_info();
  wrong_version["sluice"] = 999;
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", wrong_version}, {"token", 1}, {"transport", "tcp"}, {"channels", 1}}),
            ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", fake_info()}, {"token", "x"}, {"transport", "tcp"}, {"channels", 1}}),
            ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", fake_info()}, {"token", 2}, {"transport", "tcp"}, {"channels", 0}}),
            ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", fake_info()}, {"token", 3}, {"transport", "tcp"}, {"channels", 100000}}),
            ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", fake_info()}, {"token", 4}, {"transport", "teleport"}, {"channels", 1}}),
            ErrorCode::kUnsupported);
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", fake_info()}, {"token", 5}, {"transport", 7}, {"channels", 1}}),
            ErrorCode::kProtocol);
  // Reusing a live token.
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", fake_info()}, {"token", 6}, {"transport", "tcp"}, {"channels", 1}}),
            ErrorCode::kOk);
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", fake_info()}, {"token", 6}, {"transport", "tcp"}, {"channels", 1}}),
            ErrorCode::kProtocol);
  // Channels for unknown endpoints, bad indexes, a channel attached twice.
  EXPECT_EQ(bootstrap_code(K::kChannel, json::object()), ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kChannel, {{"token", 12345}, {"index", 0}}), ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kChannel, {{"token", "abc"}, {"index", 0}}), ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kChannel, {{"token", 6}, {"index", 1}}), ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kChannel, {{"token", 6}, {"index", -1}}), ErrorCode::kProtocol);
  EXPECT_EQ(bootstrap_code(K::kChannel, {{"token", 6}, {"index", "0"}}), ErrorCode::kProtocol);
  // The same channel index attached twice (the transport refuses; the refusal reaches us).
  EXPECT_EQ(bootstrap_code(K::kHello, {{"info", fake_info()}, {"token", 7}, {"transport", "tcp"}, {"channels", 2}}),
            ErrorCode::kOk);
  net::Socket first = dial();
  net::set_io_timeout(first.fd(), 5s);
  boot::send_msg(first.fd(), K::kChannel, {{"token", 7}, {"index", 0}, {"transport", "tcp"}});
  EXPECT_EQ(code_of([&] { boot::expect_reply(first.fd(), "first"); }), ErrorCode::kOk);
  EXPECT_EQ(bootstrap_code(K::kChannel, {{"token", 7}, {"index", 0}, {"transport", "tcp"}}), ErrorCode::kProtocol);
  // Hand-made headers: unknown kind, wrong version, oversized body, body not an object.
  auto raw = [&](BootHeader h, const std::string& body) {
    net::Socket s = dial();
    net::set_io_timeout(s.fd(), 5s);
    write_all(s.fd(), &h, sizeof(h));
    if (!body.empty()) write_all(s.fd(), body.data(), body.size());
    return code_of([&] { boot::expect_reply(s.fd(), "raw"); });
  };
  EXPECT_EQ(raw(boot_header(77, 2), "{}"), ErrorCode::kProtocol);
  EXPECT_EQ(raw(boot_header(0, 2), "{}"), ErrorCode::kProtocol);
  EXPECT_EQ(raw(boot_header(1, 2, kWireVersion + 1), "{}"), ErrorCode::kProtocol);
  EXPECT_EQ(raw(boot_header(1, 0xffffffffu), ""), ErrorCode::kProtocol);
  EXPECT_EQ(raw(boot_header(1, 5), "[1,2]"), ErrorCode::kProtocol);
  EXPECT_EQ(raw(boot_header(1, 5), "{{{{{"), ErrorCode::kProtocol);
  // The info query still answers honestly.
  EXPECT_EQ(bootstrap_code(K::kInfo, json::object()), ErrorCode::kOk);
  expect_still_serving();
}

TEST_F(Hostile, ForgedFramesOnADataChannel) {
  net::Socket ch = forged_channel(1001);
  int fd = ch.fd();
  uint8_t payload[256];
  std::memset(payload, 0x5A, sizeof(payload));
  auto nack_code = [&](uint64_t op) {
    Frame f = read_frame(fd);
    EXPECT_TRUE(f.ok) << "no response frame";
    EXPECT_EQ(f.h.op_id, op);
    EXPECT_EQ(f.h.type, static_cast<uint8_t>(FrameType::kNack));
    return static_cast<ErrorCode>(f.h.status);
  };
  using sluice::detail::kLaneEnd;
  // Writes to unknown regions and outside the region (plain and overflowing).
  send_frame(fd, make_frame(FrameType::kWrite, 1, 9999, 0, 64, kLaneEnd), payload, 64);
  EXPECT_EQ(nack_code(1), ErrorCode::kUnknownHandle);
  send_frame(fd, make_frame(FrameType::kWrite, 2, 0, 0, 64, kLaneEnd), payload, 64);
  EXPECT_EQ(nack_code(2), ErrorCode::kUnknownHandle);
  send_frame(fd, make_frame(FrameType::kWrite, 3, victim_id(), kPage - 10, 64, kLaneEnd), payload, 64);
  EXPECT_EQ(nack_code(3), ErrorCode::kOutOfRange);
  send_frame(fd, make_frame(FrameType::kWrite, 4, victim_id(), UINT64_MAX - 10, 64, kLaneEnd), payload, 64);
  EXPECT_EQ(nack_code(4), ErrorCode::kOutOfRange);
  send_frame(fd, make_frame(FrameType::kWrite, 5, victim_id(), kPage, 1, kLaneEnd), payload, 1);
  EXPECT_EQ(nack_code(5), ErrorCode::kOutOfRange);
  // Region-relative negative offset (wraps): must not reach the guard page before it.
  send_frame(fd, make_frame(FrameType::kWrite, 6, victim_id(), static_cast<uint64_t>(-64), 64, kLaneEnd), payload, 64);
  EXPECT_EQ(nack_code(6), ErrorCode::kOutOfRange);
  // Reads outside, of unknown regions, and of absurd length.
  send_frame(fd, make_frame(FrameType::kReadReq, 7, victim_id(), 4000, 0, kLaneEnd, 200, 0));
  EXPECT_EQ(nack_code(7), ErrorCode::kOutOfRange);
  send_frame(fd, make_frame(FrameType::kReadReq, 8, 4242, 0, 0, kLaneEnd, 16, 0));
  EXPECT_EQ(nack_code(8), ErrorCode::kUnknownHandle);
  send_frame(fd, make_frame(FrameType::kReadReq, 9, victim_id(), 0, 0, kLaneEnd, 16, 1));
  EXPECT_EQ(nack_code(9), ErrorCode::kOutOfRange);
  EXPECT_EQ(mem_, snap_) << "a refused frame changed memory";

  // Positive controls on the same channel: a valid write lands exactly, a valid read answers.
  send_frame(fd, make_frame(FrameType::kWrite, 10, victim_id(), 100, 64, kLaneEnd), payload, 64);
  Frame ack = read_frame(fd);
  ASSERT_TRUE(ack.ok);
  EXPECT_EQ(ack.h.type, static_cast<uint8_t>(FrameType::kAck));
  EXPECT_EQ(ack.h.op_id, 10u);
  std::memset(snap_.data() + kPage + 100, 0x5A, 64);
  EXPECT_EQ(mem_, snap_);
  send_frame(fd, make_frame(FrameType::kReadReq, 11, victim_id(), kPage - 256, 0, kLaneEnd, 256, 0));
  Frame resp = read_frame(fd);
  ASSERT_TRUE(resp.ok);
  EXPECT_EQ(resp.h.type, static_cast<uint8_t>(FrameType::kReadResp));
  ASSERT_EQ(resp.payload.size(), 256u);
  EXPECT_EQ(0, std::memcmp(resp.payload.data(), mem_.data() + 2 * kPage - 256, 256));

  // Acks for operations that do not exist: the victim drops the channel (kError frame).
  send_frame(fd, make_frame(FrameType::kAck, 555, 0, 0, 0, kLaneEnd));
  Frame err = read_frame(fd);
  if (err.ok) {
    EXPECT_EQ(err.h.type, static_cast<uint8_t>(FrameType::kError));
  }
  EXPECT_TRUE(closed_by_peer(fd, 5s));
  EXPECT_EQ(mem_, snap_);
  expect_still_serving();
}

TEST_F(Hostile, MalformedFramesCloseTheChannel) {
  struct Case {
    const char* what;
    FrameHeader h;
  };
  FrameHeader bad_check = make_frame(FrameType::kWrite, 1, victim_id(), 0, 8, 1);
  bad_check.check ^= 0x100;
  FrameHeader bad_magic = make_frame(FrameType::kWrite, 1, victim_id(), 0, 8, 1);
  bad_magic.magic = 0x12345678;
  bad_magic.check = sluice::detail::frame_check(bad_magic);
  FrameHeader bad_type = make_frame(FrameType::kWrite, 1, victim_id(), 0, 8, 1);
  bad_type.type = 200;
  bad_type.check = sluice::detail::frame_check(bad_type);
  FrameHeader zero_type = make_frame(FrameType::kWrite, 1, victim_id(), 0, 8, 1);
  zero_type.type = 0;
  zero_type.check = sluice::detail::frame_check(zero_type);
  FrameHeader huge = make_frame(FrameType::kWrite, 1, victim_id(), 0, sluice::detail::kMaxFramePayload + 1, 1);
  FrameHeader imm_on_tcp = make_frame(FrameType::kImm, 1, 0, 0, 0, 0, 5);
  FrameHeader stray_resp = make_frame(FrameType::kReadResp, 1, 0, 0, 8, 1);
  FrameHeader stray_sendack = make_frame(FrameType::kSendAck, 1, 0, 0, 0);
  FrameHeader stray_nack = make_frame(FrameType::kNack, 77, 0, 0, 0, 1, 0, 0, 3);
  FrameHeader out_of_order_send = make_frame(FrameType::kSend, 5, 0, 0, 8);
  Case cases[] = {{"bad checksum", bad_check},       {"bad magic", bad_magic},
                  {"unknown type", bad_type},        {"type 0", zero_type},
                  {"oversized payload", huge},       {"imm frame on tcp", imm_on_tcp},
                  {"unsolicited read response", stray_resp}, {"unsolicited send ack", stray_sendack},
                  {"unsolicited nack", stray_nack},  {"send out of sequence", out_of_order_send}};
  uint64_t token = 2000;
  for (auto& c : cases) {
    SCOPED_TRACE(c.what);
    net::Socket ch = forged_channel(token++);
    uint8_t junk[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    send_frame(ch.fd(), c.h, junk, sizeof(junk));
    Frame f = read_frame(ch.fd());
    if (f.ok) {
      EXPECT_EQ(f.h.type, static_cast<uint8_t>(FrameType::kError)) << c.what;
    }
    EXPECT_TRUE(closed_by_peer(ch.fd(), 5s)) << c.what << ": channel stayed open";
  }
  EXPECT_EQ(mem_, snap_);
  expect_still_serving();
}

TEST_F(Hostile, ForgedSendsReachOnlyPostedRecvsAndPeerDeathFailsThem) {
  net::Socket ch = forged_channel(3001);
  auto ep = victim_->accept(5s);
  ASSERT_TRUE(ep.has_value());
  // A valid message lands in the posted recv.
  auto r0 = ep->recv(hv_, 0, 64);
  const char msg[] = "hello from a forged peer";
  send_frame(ch.fd(), make_frame(FrameType::kSend, 0, 0, 0, sizeof(msg)), msg, sizeof(msg));
  Frame ack = read_frame(ch.fd());
  ASSERT_TRUE(ack.ok);
  EXPECT_EQ(ack.h.type, static_cast<uint8_t>(FrameType::kSendAck));
  EXPECT_EQ(ack.h.status, 0);
  ASSERT_TRUE(r0.wait_for(5s));
  EXPECT_TRUE(r0.status().ok());
  EXPECT_EQ(r0.bytes(), sizeof(msg));
  EXPECT_EQ(0, std::memcmp(mem_.data() + kPage, msg, sizeof(msg)));
  std::memcpy(snap_.data() + kPage, msg, sizeof(msg));
  // A message larger than its recv: only the recv's bytes are written.
  auto r1 = ep->recv(hv_, 100, 10);
  std::string big(300, 'Q');
  send_frame(ch.fd(), make_frame(FrameType::kSend, 1, 0, 0, big.size()), big.data(), big.size());
  ack = read_frame(ch.fd());
  ASSERT_TRUE(ack.ok);
  EXPECT_EQ(ack.h.status, static_cast<uint16_t>(ErrorCode::kTruncated));
  ASSERT_TRUE(r1.wait_for(5s));
  EXPECT_EQ(r1.status().code, ErrorCode::kTruncated);
  std::memset(snap_.data() + kPage + 100, 'Q', 10);
  EXPECT_EQ(mem_, snap_);
  // The peer dies in the middle of a message whose recv is posted: the recv completes with
  // an error instead of waiting forever.
  auto r2 = ep->recv(hv_, 1000, 2048);
  auto imm = ep->imm_recv();
  std::vector<uint8_t> part(100, 'P');
  send_frame(ch.fd(), make_frame(FrameType::kSend, 2, 0, 0, 2048), part.data(), part.size());
  std::this_thread::sleep_for(100ms);
  ch.close();
  ASSERT_TRUE(r2.wait_for(5s)) << "a recv whose message was cut off never completed";
  EXPECT_FALSE(r2.status().ok());
  ASSERT_TRUE(imm.wait_for(5s));
  EXPECT_FALSE(imm.status().ok());
  EXPECT_FALSE(ep->connected());
  expect_guards_intact();
  expect_still_serving();
}

TEST_F(Hostile, HalfOpenEndpointFloodIsBoundedAndExpires) {
  // Hellos whose channels never come: each one makes the victim build a passive endpoint
  // (for shm, with worker threads). A flood of them must neither pile up without bound nor
  // stop honest peers from connecting, and they must be dropped after the handshake timeout.
  EngineConfig c = engine_config("tcp", 1, 10s);
  c.transports = {"tcp", "shm"};
  c.connect_timeout = 1000ms;
  Engine victim(c);
  auto [host, port] = detail::split_host_port(victim.listen_address());
  json info = fake_info();
  info["transports"]["shm"] = {{"pid", static_cast<int>(::getpid())}, {"probe_addr", 0}, {"probe_value", 0}};
  const int base = thread_count();
  int refused = 0;
  for (int i = 0; i < 300; ++i) {
    net::Socket s = net::connect_tcp(host, port, 2s);
    net::set_io_timeout(s.fd(), 5s);
    boot::send_msg(s.fd(), boot::MsgKind::kHello,
                   {{"info", info}, {"token", 50000 + i}, {"transport", "shm"}, {"channels", 64}});
    if (code_of([&] { boot::expect_reply(s.fd(), "hello"); }) != ErrorCode::kOk) ++refused;
  }
  const int peak = thread_count();
  EXPECT_LT(peak - base, 2000) << "half-open endpoints grew the victim to " << peak << " threads";
  // Honest peers still get through.
  {
    Engine good(engine_config("tcp", 2, 10s));
    std::vector<uint8_t> buf(4096, 1);
    auto h = good.register_memory(buf.data(), buf.size());
    std::vector<uint8_t> vbuf(4096, 0);
    victim.register_memory(vbuf.data(), vbuf.size(), Location::host(), "v");
    Endpoint ep = good.connect(victim.local_info());
    ASSERT_TRUE(ep.write({{h, 0, *ep.remote_region("v"), 0, 4096}}).wait().ok());
    EXPECT_EQ(vbuf, buf);
  }
  // After the handshake timeout the half-open endpoints are gone.
  auto deadline = std::chrono::steady_clock::now() + 6s;
  while (thread_count() > base + 20 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(50ms);
  EXPECT_LE(thread_count(), base + 20) << "half-open endpoints were never dropped (" << thread_count() << " threads, "
                                       << base << " before the flood; " << refused << " hellos refused)";
}

}  // namespace
