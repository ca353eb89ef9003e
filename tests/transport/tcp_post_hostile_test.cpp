// A hostile peer's SIGNAL frames (the tcp thin post path's target side): a signal aimed at an
// unknown region, out of range, misaligned or overflowing is refused with a NACK and changes
// nothing; a well-formed one adds its 64-bit value; a malformed frame (with a payload) ends
// the connection. Speaks the wire format by hand; no fork.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

#include <cstring>

#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "loopback.hpp"
#include "raw_peer.hpp"
#include "sluice/version.hpp"
#include "test_util.hpp"
#include "transport/common/frame.hpp"

using namespace sluice;
using namespace sluice_test;
using sluice::detail::FrameHeader;
using sluice::detail::FrameType;
using sluice::detail::make_frame;
using nlohmann::json;
namespace boot = sluice::bootstrap;

namespace {

constexpr uint64_t kBytes = 4096;

class TcpPostHostile : public ::testing::Test {
 protected:
  void SetUp() override {
    ::signal(SIGPIPE, SIG_IGN);
    EngineConfig c = engine_config("tcp", 1, 5000ms);
    c.connect_timeout = 2000ms;
    victim_ = std::make_unique<Engine>(c);
    mem_.assign(kBytes / 8, 0);  // uint64_t: the counters' addresses are 8-byte aligned
    hv_ = victim_->register_memory(mem_.data(), kBytes, Location::host(), "victim");
    auto [host, port] = detail::split_host_port(victim_->listen_address());
    detail::EngineInfo e;
    e.wire_version = kWireVersion;
    e.engine_id = "evil000000000000";
    e.host_id = "evil-host";
    e.listen_host = "127.0.0.1";
    e.listen_port = 1;
    e.transports["tcp"] = json::object();
    const uint64_t token = 5001;
    {
      net::Socket s = net::connect_tcp(host, port, 2s);
      net::set_io_timeout(s.fd(), 5s);
      boot::send_msg(s.fd(), boot::MsgKind::kHello,
                     {{"info", e.to_json()}, {"token", token}, {"transport", "tcp"}, {"channels", 1}});
      boot::expect_reply(s.fd(), "hello");
    }
    ch_ = net::connect_tcp(host, port, 2s);
    net::set_io_timeout(ch_.fd(), 5s);
    boot::send_msg(ch_.fd(), boot::MsgKind::kChannel, {{"token", token}, {"index", 0}, {"transport", "tcp"}});
    boot::expect_reply(ch_.fd(), "channel");
    net::set_io_timeout(ch_.fd(), std::chrono::milliseconds(0));
    ep_ = victim_->accept(5s);
    ASSERT_TRUE(ep_.has_value());
  }
  void TearDown() override {
    ch_.shutdown();
    if (victim_) victim_->close();
  }

  // Sends a SIGNAL adding `add` at (region, offset) and returns the answer's type (0: none).
  uint8_t signal(uint64_t op_id, uint64_t region, uint64_t offset, uint64_t add) {
    FrameHeader h = make_frame(FrameType::kSignal, op_id, region, offset, 0, sluice::detail::kLaneEnd,
                               static_cast<uint32_t>(add), static_cast<uint32_t>(add >> 32));
    if (!send_all(ch_.fd(), &h, sizeof(h))) return 0;
    FrameHeader r{};
    if (!recv_all(ch_.fd(), &r, sizeof(r))) return 0;
    std::vector<char> text(r.length);
    if (r.length > 4096 || !recv_all(ch_.fd(), text.data(), text.size())) return 0;
    EXPECT_EQ(op_id, r.op_id) << "the answer names another request";
    EXPECT_TRUE(r.flags & sluice::detail::kLaneEnd);
    return r.type;
  }

  std::unique_ptr<Engine> victim_;
  std::vector<uint64_t> mem_;
  MemoryHandle hv_;
  net::Socket ch_;
  std::optional<Endpoint> ep_;
};

constexpr uint8_t kAck = static_cast<uint8_t>(FrameType::kAck);
constexpr uint8_t kNack = static_cast<uint8_t>(FrameType::kNack);

TEST_F(TcpPostHostile, BadSignalsAreRefusedAndChangeNothing) {
  EXPECT_EQ(kNack, signal(1, hv_.id + 1000, 0, 1)) << "unknown region";
  EXPECT_EQ(kNack, signal(2, hv_.id, kBytes, 1)) << "offset at the region's end";
  EXPECT_EQ(kNack, signal(3, hv_.id, kBytes - 4, 1)) << "counter straddles the region's end";
  EXPECT_EQ(kNack, signal(4, hv_.id, 4, 1)) << "misaligned offset";
  EXPECT_EQ(kNack, signal(5, hv_.id, ~0ull - 7, 1)) << "offset + 8 overflows";
  for (uint64_t i = 0; i < mem_.size(); ++i) ASSERT_EQ(0u, mem_[i]) << "a refused signal changed word " << i;
  // The connection survived the refusals: a good signal lands (both halves of the value).
  EXPECT_EQ(kAck, signal(6, hv_.id, 8, 0x100000005ull));
  EXPECT_EQ(kAck, signal(7, hv_.id, kBytes - 8, 3));
  EXPECT_EQ(0x100000005ull, __atomic_load_n(&mem_[1], __ATOMIC_ACQUIRE));
  EXPECT_EQ(3u, __atomic_load_n(&mem_.back(), __ATOMIC_ACQUIRE));
  EXPECT_TRUE(ep_->connected());
}

TEST_F(TcpPostHostile, SignalWithAPayloadEndsTheConnection) {
  struct {
    FrameHeader h;
    uint64_t junk;
  } f{make_frame(FrameType::kSignal, 1, hv_.id, 8, 8, sluice::detail::kLaneEnd, 1, 0), 7};
  ASSERT_TRUE(send_all(ch_.fd(), &f, sizeof(f)));
  EXPECT_TRUE(closed_by_peer(ch_.fd(), 5s)) << "a malformed signal frame was accepted";
  EXPECT_EQ(0u, mem_[1]);
}

}  // namespace

namespace {

// The initiator's side of a refusal: posts to a region the peer has since unregistered are
// NACKed (a write and a signal behind it); flush reports it once, and the endpoint stays up.
TEST(TcpPostRefused, RefusedPostsReachFlushAndTheEndpointStaysUp) {
  Engine a(engine_config("tcp", 2, 5000ms)), b(engine_config("tcp", 2, 5000ms));
  std::vector<uint64_t> la(512, 7), lb(512, 0), gone(512, 0);
  auto ha = a.register_memory(la.data(), 4096, Location::host(), "a");
  b.register_memory(lb.data(), 4096, Location::host(), "b");
  auto hg = b.register_memory(gone.data(), 4096, Location::host(), "gone");
  Endpoint ep = a.connect(b.local_info());
  ASSERT_EQ("tcp", ep.transport());
  auto rb = *ep.remote_region("b");
  auto rg = *ep.remote_region("gone");
  b.unregister_memory(hg);  // our copy of the peer's regions still names it
  ep.post_write(ha, 0, rg, 0, 64);
  ep.post_signal(rg, 8, 1);
  ErrorCode c = ErrorCode::kOk;
  try {
    ep.flush();
  } catch (const Error& e) {
    c = e.code();
  }
  EXPECT_NE(ErrorCode::kOk, c) << "posts into an unregistered region all succeeded";
  EXPECT_EQ(0u, gone[0]);
  EXPECT_EQ(0u, gone[1]);
  // The error was reported once; the endpoint still works.
  EXPECT_TRUE(ep.connected());
  ep.post_write(ha, 0, rb, 0, 64);
  ep.post_signal(rb, 4088, 9);
  ep.flush();
  EXPECT_EQ(7u, lb[0]);
  EXPECT_EQ(9u, __atomic_load_n(&lb[511], __ATOMIC_ACQUIRE));
}

}  // namespace
