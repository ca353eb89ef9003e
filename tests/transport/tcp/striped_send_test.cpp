// tcp striped SENDs (tcp.send_stripe_min, docs/wire-protocol.md "Striped SENDs"): a lone
// SEND of 1 MiB or more goes with its first 1/channels on channel 0, in order, and the
// receiver reads the rest from the sender's message over the other channels (SEND_PULL,
// answered like READ_REQ). Engine to engine: every byte lands once, nothing is written past a
// recv (truncated ones included), messages before their recv are stashed, a pull caught on a
// stalled channel is asked again. A hand-written peer: the receiver's side of the wire format
// as documented, and what a hostile peer can and cannot get (a striped SEND anywhere but on
// channel 0, or whose frame holds it all, ends the connection; a pull of a message not in
// flight, or past its end, is refused; a peer that did not ask for striping never gets it).
// Two engines in one process: runs under TSan.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "../loopback.hpp"
#include "../raw_peer.hpp"
#include "../test_util.hpp"
#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "sluice/version.hpp"
#include "transport/common/frame.hpp"

using namespace sluice;
using namespace sluice_test;
using sluice::detail::FrameHeader;
using sluice::detail::FrameType;
using sluice::detail::make_frame;
using nlohmann::json;
namespace boot = sluice::bootstrap;

namespace striped_send_test {

// ---- engine to engine ----

struct Pair {
  std::unique_ptr<Engine> a, b;
  Endpoint ep, peer;  // a's (dialed) and b's (accepted)
  Pair(int channels, const char* stripe_min = nullptr) {
    EngineConfig c = engine_config("tcp", channels, 20s);
    if (stripe_min) c.set("tcp.send_stripe_min", stripe_min);
    a = std::make_unique<Engine>(c);
    b = std::make_unique<Engine>(c);
    ep = a->connect(b->local_info());
    auto acc = b->accept(5s);
    EXPECT_TRUE(acc.has_value());
    if (acc) peer = *acc;
  }
  ~Pair() {
    ep = {};
    peer = {};
    a->close();
    b->close();
  }
};

// Lone SENDs of sizes around the threshold and the page, into exact, larger and truncated
// recvs, over 2 and 3 channels: the bytes land once, in place, and nothing past the recv.
TEST(TcpStripedSend, LoneSendsLandWholeAndNothingPastTheRecv) {
  for (int channels : {2, 3}) {
    SCOPED_TRACE(std::to_string(channels) + " channels");
    Pair p(channels);
    ASSERT_EQ(p.ep.transport(), "tcp");
    constexpr uint64_t kMax = (16 << 20) + 3;
    std::vector<uint8_t> src(kMax), dst(kMax + 8192);
    auto hs = p.a->register_memory(src.data(), src.size());
    auto hd = p.b->register_memory(dst.data(), dst.size());
    int seed = channels * 100;
    for (uint64_t n : {uint64_t(1 << 20), uint64_t((1 << 20) + 1), uint64_t((4 << 20) + 4095), kMax}) {
      for (uint64_t cap : {n, n + 5000, n / 3 + 1}) {
        fill_pattern(src.data(), n, ++seed);
        std::fill(dst.begin(), dst.end(), 0xEE);
        auto r = p.peer.recv(hd, 0, cap);
        auto s = p.ep.send(hs, 0, n);
        ASSERT_TRUE(r.wait_for(30s) && s.wait_for(30s)) << n << " into " << cap;
        const uint64_t got = std::min(n, cap);
        if (cap >= n) {
          EXPECT_TRUE(r.status().ok()) << r.status().to_string();
          EXPECT_TRUE(s.status().ok()) << s.status().to_string();
          EXPECT_EQ(r.bytes(), n);
        } else {
          EXPECT_EQ(r.status().code, ErrorCode::kTruncated) << r.status().to_string();
          EXPECT_EQ(s.status().code, ErrorCode::kTruncated) << s.status().to_string();
        }
        EXPECT_EQ(0, std::memcmp(dst.data(), src.data(), got)) << n << " into " << cap;
        EXPECT_TRUE(std::all_of(dst.begin() + got, dst.end(), [](uint8_t v) { return v == 0xEE; }))
            << "bytes written past " << got << " (" << n << " into " << cap << ")";
      }
    }
    // Before its recv: stashed (its head from the frame, the rest pulled into the stash).
    const uint64_t n = (8 << 20) + 17;
    fill_pattern(src.data(), n, 999);
    auto s = p.ep.send(hs, 0, n);
    ASSERT_TRUE(s.wait_for(30s) && s.status().ok()) << s.status().to_string();
    auto r = p.peer.recv(hd, 0, n);
    ASSERT_TRUE(r.wait_for(30s) && r.status().ok()) << r.status().to_string();
    EXPECT_EQ(0, std::memcmp(dst.data(), src.data(), n));
    // Small ones between large ones keep their order (channel 0 carries every header).
    std::vector<Future> rs, ss;
    std::vector<uint64_t> sizes = {3 << 20, 100, 2 << 20, 1, (1 << 20) + 7};
    uint64_t off = 0;
    fill_pattern(src.data(), kMax, 4242);
    std::fill(dst.begin(), dst.end(), 0);
    for (uint64_t k : sizes) rs.push_back(p.peer.recv(hd, off, k)), off += k;
    off = 0;
    for (uint64_t k : sizes) ss.push_back(p.ep.send(hs, off, k)), off += k;
    for (size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_TRUE(rs[i].wait_for(30s) && ss[i].wait_for(30s)) << "message " << i;
      EXPECT_TRUE(rs[i].status().ok()) << rs[i].status().to_string();
    }
    EXPECT_EQ(0, std::memcmp(dst.data(), src.data(), off));
  }
}

// tcp.send_stripe_min 0: the same messages go whole on channel 0 and land the same.
TEST(TcpStripedSend, OffSendsWholeMessages) {
  Pair p(2, "0");
  std::vector<uint8_t> src(4 << 20), dst(4 << 20);
  fill_pattern(src.data(), src.size(), 5);
  auto hs = p.a->register_memory(src.data(), src.size());
  auto hd = p.b->register_memory(dst.data(), dst.size());
  auto r = p.peer.recv(hd, 0, dst.size());
  ASSERT_TRUE(p.ep.send(hs, 0, src.size()).wait().ok());
  ASSERT_TRUE(r.wait().ok());
  EXPECT_EQ(src, dst);
}

// The sender's channel 1 reads the receiver's SEND_PULLs and never answers them (its first
// connection, tcp.test_mute_channel): the receiver, which dialed, replaces the channel and
// asks again; the message lands whole.
TEST(TcpStripedSend, APullOnAStalledChannelIsAskedAgain) {
  EngineConfig ca = engine_config("tcp", 2, 20s);
  ca.set("tcp.failover_ms", "200");
  Engine a(ca), b(engine_config("tcp", 2, 20s));
  ::setenv("SLUICE_TCP_TEST_MUTE_CHANNEL", "1", 1);  // read as b's endpoint is made
  Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ::unsetenv("SLUICE_TCP_TEST_MUTE_CHANNEL");
  ASSERT_TRUE(acc.has_value());
  Endpoint sender = *acc;
  std::vector<uint8_t> src(2 << 20), dst(2 << 20, 0);
  fill_pattern(src.data(), src.size(), 77);
  auto hs = b.register_memory(src.data(), src.size());
  auto hd = a.register_memory(dst.data(), dst.size());
  auto r = ep.recv(hd, 0, dst.size());
  auto s = sender.send(hs, 0, src.size());
  ASSERT_TRUE(r.wait_for(20s)) << "the recv never completed";
  ASSERT_TRUE(r.status().ok()) << r.status().to_string();
  ASSERT_TRUE(s.wait_for(20s) && s.status().ok()) << s.status().to_string();
  EXPECT_EQ(src, dst);
  EndpointMetrics m = ep.metrics();
  EXPECT_EQ(m.channels_replaced, 1u);
  EXPECT_EQ(m.retries, 1u);
  EXPECT_TRUE(ep.connected());
  ep = {};
  sender = {};
  a.close();
  b.close();
}

// Nothing is left pending once striped SENDs completed: an endpoint idle for longer than
// op_timeout afterwards is still up. (The head of a message that the receiver read while its
// rest was pulled once counted as a part of the pull's read op, which then stayed pending
// whenever the pull finished first, and failed the endpoint op_timeout later.)
TEST(TcpStripedSend, NothingIsLeftPendingAfterwards) {
  EngineConfig c = engine_config("tcp", 2, 1500ms);
  Engine a(c), b(c);
  Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  Endpoint peer = *acc;
  std::vector<uint8_t> src(4 << 20), dst(4 << 20);
  fill_pattern(src.data(), src.size(), 9);
  auto hs = a.register_memory(src.data(), src.size());
  auto hd = b.register_memory(dst.data(), dst.size());
  for (int i = 0; i < 30; ++i) {
    auto r = peer.recv(hd, 0, dst.size());
    ASSERT_TRUE(ep.send(hs, 0, src.size()).wait().ok()) << i;
    ASSERT_TRUE(r.wait().ok()) << i;
  }
  EXPECT_EQ(src, dst);
  std::this_thread::sleep_for(2500ms);  // past op_timeout, idle
  EXPECT_TRUE(ep.connected());
  EXPECT_TRUE(peer.connected());
  auto r = peer.recv(hd, 0, dst.size());
  Status s = ep.send(hs, 0, src.size()).wait();
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_TRUE(r.wait().ok());
  ep = {};
  peer = {};
  a.close();
  b.close();
}

// ---- a hand-written peer ----

struct Frame {
  FrameHeader h{};
  std::vector<uint8_t> payload;
};

std::optional<Frame> read_frame(int fd) {
  Frame f;
  if (!recv_all(fd, &f.h, sizeof(f.h))) return std::nullopt;
  if (f.h.length > (64u << 20)) return std::nullopt;
  f.payload.resize(f.h.length);
  if (f.h.length && !recv_all(fd, f.payload.data(), f.payload.size())) return std::nullopt;
  return f;
}

bool send_frame(int fd, const FrameHeader& h, const void* payload = nullptr) {
  return send_all(fd, &h, sizeof(h)) && (h.length == 0 || send_all(fd, payload, h.length));
}

// The victim engine accepts an endpoint of 2 channels from a peer that speaks frames by hand
// and says (or does not say) in channel 0's hello that it takes striped SENDs.
class TcpStripedSendRaw : public ::testing::Test {
 protected:
  static constexpr uint64_t kBytes = 8 << 20;
  void start(bool ask) {
    ::signal(SIGPIPE, SIG_IGN);
    EngineConfig c = engine_config("tcp", 2, 5000ms);
    c.connect_timeout = 2000ms;
    victim_ = std::make_unique<Engine>(c);
    mem_.assign(kBytes, 0);
    hv_ = victim_->register_memory(mem_.data(), kBytes, Location::host(), "victim");
    auto [host, port] = detail::split_host_port(victim_->listen_address());
    detail::EngineInfo e;
    e.wire_version = kWireVersion;
    e.engine_id = "evil000000000000";
    e.host_id = "evil-host";
    e.listen_host = "127.0.0.1";
    e.listen_port = 1;
    e.transports["tcp"] = json::object();
    const uint64_t token = 7001;
    {
      net::Socket s = net::connect_tcp(host, port, 2s);
      net::set_io_timeout(s.fd(), 5s);
      boot::send_msg(s.fd(), boot::MsgKind::kHello,
                     {{"info", e.to_json()}, {"token", token}, {"transport", "tcp"}, {"channels", 2}});
      boot::expect_reply(s.fd(), "hello");
    }
    for (int i = 0; i < 2; ++i) {
      ch_[i] = net::connect_tcp(host, port, 2s);
      net::set_io_timeout(ch_[i].fd(), 5s);
      json body = {{"token", token}, {"index", i}, {"transport", "tcp"}};
      if (i == 0 && ask) body["send_pull"] = 1;
      boot::send_msg(ch_[i].fd(), boot::MsgKind::kChannel, body);
      json reply = boot::expect_reply(ch_[i].fd(), "channel");
      if (i == 0) EXPECT_EQ(ask, reply.value("send_pull", 0) == 1) << reply.dump();
      net::set_io_timeout(ch_[i].fd(), std::chrono::milliseconds(0));
    }
    ep_ = victim_->accept(5s);
    ASSERT_TRUE(ep_.has_value());
  }
  void TearDown() override {
    for (auto& c : ch_) c.shutdown();
    ep_.reset();
    if (victim_) victim_->close();
  }
  int fd(int i) const { return ch_[i].fd(); }

  std::unique_ptr<Engine> victim_;
  std::vector<uint8_t> mem_;
  MemoryHandle hv_;
  net::Socket ch_[2];
  std::optional<Endpoint> ep_;
};

constexpr uint8_t kNack = static_cast<uint8_t>(FrameType::kNack);
constexpr uint8_t kReadResp = static_cast<uint8_t>(FrameType::kReadResp);
constexpr uint8_t kSendAck = static_cast<uint8_t>(FrameType::kSendAck);

// The receiver's side as docs/wire-protocol.md has it: a SEND with kPullRest on channel 0
// carries the head; the victim asks for the rest with SEND_PULL on channel 1 (token, sequence,
// offset, length), takes the READ_RESPs, and acks on channel 0 once every byte landed.
TEST_F(TcpStripedSendRaw, AHandWrittenStripedSendLandsWhole) {
  start(/*ask=*/true);
  constexpr uint64_t n = (3 << 20) + 5, head = 1 << 20;
  std::vector<uint8_t> msg(n);
  fill_pattern(msg.data(), n, 12);
  auto r = ep_->recv(hv_, 0, kBytes);
  ASSERT_TRUE(send_frame(fd(0), make_frame(FrameType::kSend, 0, 0, 0, head, sluice::detail::kPullRest,
                                           static_cast<uint32_t>(n), 0),
                         msg.data()));
  uint64_t pulled = head;
  while (pulled < n) {
    auto f = read_frame(fd(1));
    ASSERT_TRUE(f.has_value()) << "no SEND_PULL for the rest";
    ASSERT_EQ(f->h.type, static_cast<uint8_t>(FrameType::kSendPull));
    ASSERT_EQ(f->h.region, 0u) << "the message's sequence";
    const uint64_t len = (uint64_t(f->h.aux) << 32) | f->h.imm;
    ASSERT_EQ(f->h.offset, pulled) << "pulls in order on one channel";
    ASSERT_LE(f->h.offset + len, n);
    ASSERT_TRUE(send_frame(fd(1), make_frame(FrameType::kReadResp, f->h.op_id, 0, 0, len, f->h.flags),
                           msg.data() + f->h.offset));
    pulled += len;
  }
  auto ack = read_frame(fd(0));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->h.type, kSendAck);
  EXPECT_EQ(ack->h.status, 0) << std::string(ack->payload.begin(), ack->payload.end());
  ASSERT_TRUE(r.wait_for(5s));
  ASSERT_TRUE(r.status().ok()) << r.status().to_string();
  EXPECT_EQ(r.bytes(), n);
  EXPECT_EQ(0, std::memcmp(mem_.data(), msg.data(), n));
  EXPECT_TRUE(std::all_of(mem_.begin() + n, mem_.end(), [](uint8_t v) { return v == 0; }));
}

// A striped SEND on channel 1 (only channel 0 keeps messages in order) ends the connection.
TEST_F(TcpStripedSendRaw, AStripedSendOffChannelZeroEndsTheConnection) {
  start(/*ask=*/true);
  auto r = ep_->recv(hv_, 0, kBytes);
  std::vector<uint8_t> head(4096, 1);
  ASSERT_TRUE(send_frame(fd(1), make_frame(FrameType::kSend, 0, 0, 0, head.size(), sluice::detail::kPullRest, 1 << 20, 0),
                         head.data()));
  EXPECT_TRUE(closed_by_peer(fd(1), 5s)) << "a striped SEND on channel 1 was taken";
  ASSERT_TRUE(r.wait_for(5s));
  EXPECT_FALSE(r.status().ok());
}

// A striped SEND whose frame holds the whole message (or more) is malformed.
TEST_F(TcpStripedSendRaw, AStripedSendWithNothingToPullEndsTheConnection) {
  start(/*ask=*/true);
  auto r = ep_->recv(hv_, 0, kBytes);
  std::vector<uint8_t> head(8192, 1);
  ASSERT_TRUE(send_frame(fd(0), make_frame(FrameType::kSend, 0, 0, 0, head.size(), sluice::detail::kPullRest, 8192, 0),
                         head.data()));
  EXPECT_TRUE(closed_by_peer(fd(0), 5s)) << "a striped SEND with nothing to pull was taken";
  ASSERT_TRUE(r.wait_for(5s));
  EXPECT_FALSE(r.status().ok());
  EXPECT_TRUE(std::all_of(mem_.begin(), mem_.end(), [](uint8_t v) { return v == 0; }));
}

// The victim sends to a peer that asked: striped (head with the frame on channel 0). The peer
// may pull only bytes of that message while it is in flight: a pull of another sequence, one
// past its end, or one after the ack are refused; the right ones get the message's bytes.
TEST_F(TcpStripedSendRaw, PullsReachOnlyTheMessageInFlight) {
  start(/*ask=*/true);
  constexpr uint64_t n = 4 << 20;
  fill_pattern(mem_.data(), kBytes, 3);
  auto s = ep_->send(hv_, 0, n);
  auto f = read_frame(fd(0));
  ASSERT_TRUE(f.has_value());
  ASSERT_EQ(f->h.type, static_cast<uint8_t>(FrameType::kSend));
  ASSERT_TRUE(f->h.flags & sluice::detail::kPullRest) << "a lone 4 MiB SEND to a peer that asked is striped";
  EXPECT_EQ((uint64_t(f->h.aux) << 32) | f->h.imm, n);
  const uint64_t head = f->h.length;
  EXPECT_EQ(head, n / 2);
  EXPECT_EQ(0, std::memcmp(f->payload.data(), mem_.data(), head));
  auto pull = [&](uint64_t token, uint64_t seq, uint64_t off, uint64_t len) {
    EXPECT_TRUE(send_frame(fd(1), make_frame(FrameType::kSendPull, token, seq, off, 0, sluice::detail::kLaneEnd,
                                             static_cast<uint32_t>(len), static_cast<uint32_t>(len >> 32))));
    return read_frame(fd(1));
  };
  auto bad = pull(1, 5, head, 4096);  // no message 5 in flight
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->h.type, kNack);
  EXPECT_EQ(bad->h.op_id, 1u);
  bad = pull(2, 0, n - 4096, 8192);  // past the message's end (the region goes on)
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->h.type, kNack);
  bad = pull(3, 0, ~0ull - 100, 4096);  // offset + length overflows
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->h.type, kNack);
  auto good = pull(4, 0, head, n - head);
  ASSERT_TRUE(good.has_value());
  ASSERT_EQ(good->h.type, kReadResp);
  EXPECT_EQ(good->h.op_id, 4u);
  ASSERT_EQ(good->payload.size(), n - head);
  EXPECT_EQ(0, std::memcmp(good->payload.data(), mem_.data() + head, n - head));
  ASSERT_TRUE(send_frame(fd(0), make_frame(FrameType::kSendAck, 0)));
  ASSERT_TRUE(s.wait_for(5s));
  EXPECT_TRUE(s.status().ok()) << s.status().to_string();
  bad = pull(5, 0, head, 4096);  // acked: no longer in flight
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->h.type, kNack);
  EXPECT_TRUE(ep_->connected());
}

// A peer that did not ask in its hello gets every SEND whole on channel 0.
TEST_F(TcpStripedSendRaw, APeerThatDidNotAskGetsWholeSends) {
  start(/*ask=*/false);
  constexpr uint64_t n = 2 << 20;
  fill_pattern(mem_.data(), n, 8);
  auto s = ep_->send(hv_, 0, n);
  auto f = read_frame(fd(0));
  ASSERT_TRUE(f.has_value());
  ASSERT_EQ(f->h.type, static_cast<uint8_t>(FrameType::kSend));
  EXPECT_EQ(f->h.flags & sluice::detail::kPullRest, 0);
  ASSERT_EQ(f->h.length, n);
  EXPECT_EQ(0, std::memcmp(f->payload.data(), mem_.data(), n));
  ASSERT_TRUE(send_frame(fd(0), make_frame(FrameType::kSendAck, 0)));
  ASSERT_TRUE(s.wait_for(5s));
  EXPECT_TRUE(s.status().ok()) << s.status().to_string();
}

}  // namespace striped_send_test
