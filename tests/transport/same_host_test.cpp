// The same-host shortcut against peers that lie about themselves (issue class: a peer made the
// engine read and write its own unregistered memory by claiming shm with the victim's pid,
// lease table and regions). shm must be chosen only after the kernel has named the peer process
// on the engine's Unix socket, must take descriptors only as SCM_RIGHTS memfds, and must let a
// peer touch nothing but registered regions, through the owner's own description of them.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "core/memfd.hpp"
#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "transport/common/lease_table.hpp"
#include "loopback.hpp"
#include "test_util.hpp"
#include "transport/common/frame.hpp"
#include "transport/common/same_host.hpp"
#include "transport/common/same_host_wire.hpp"
#include "transport/shm/shm_ring.hpp"

using namespace sluice;
using namespace sluice_test;
using sluice::detail::FrameHeader;
using sluice::detail::FrameType;
using sluice::detail::make_frame;
using nlohmann::json;
namespace boot = sluice::bootstrap;
namespace sh = sluice::detail::same_host;


namespace {


struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// The type of the next frame the victim sends a raw peer (its payload read and dropped), or
// FrameType{} if none came within 5 s.
FrameType next_type(int fd) {
  FrameHeader a{};
  if (!read_all(fd, &a, sizeof(a), 5s)) return FrameType{};
  std::string text(a.length, '\0');
  if (a.length && !read_all(fd, text.data(), a.length, 5s)) return FrameType{};
  return static_cast<FrameType>(a.type);
}

class SameHost : public ::testing::Test {
 protected:
  void SetUp() override {
    ::signal(SIGPIPE, SIG_IGN);  // a refused raw peer's socket may be closed under our writes
    EngineConfig c = engine_config("shm", 1, 10s);
    c.transports = {"tcp", "shm"};
    c.op_timeout = 1000ms;  // also how long unregister waits for a peer inside its lease
    c.options["shm.eager_credit"] = std::to_string(4u << 20);  // the grant the raw peers below expect
    victim_ = std::make_unique<Engine>(c);
    mem_.assign(3 * kPage, 0);
    fill_pattern(mem_.data(), mem_.size(), 77);
    snap_ = mem_;
    hv_ = victim_->register_memory(mem_.data() + kPage, kPage, Location::host(), "victim");
    secret_.assign(kPage, 0x5e);  // never registered
    auto [host, port] = detail::split_host_port(victim_->listen_address());
    host_ = host;
    port_ = port;
    info_ = json::parse(victim_->local_info());
    socket_ = info_["transports"]["shm"]["socket"].get<std::string>();
  }
  void TearDown() override {
    if (victim_) victim_->close();
  }

  net::Socket dial() {
    net::Socket s = net::connect_tcp(host_, port_, 2s);
    net::set_io_timeout(s.fd(), 5s);
    return s;
  }
  void hello(uint64_t token, const json& info) {
    net::Socket s = dial();
    boot::send_msg(s.fd(), boot::MsgKind::kHello, {{"info", info}, {"token", token}, {"transport", "shm"}, {"channels", 1}});
    boot::expect_reply(s.fd(), "hello");
  }
  ErrorCode attach(uint64_t token, std::string* why = nullptr) {
    net::Socket s = dial();
    boot::send_msg(s.fd(), boot::MsgKind::kChannel, {{"token", token}, {"index", 0}, {"transport", "shm"}});
    return code_of([&] { boot::expect_reply(s.fd(), "channel"); }, why);
  }
  // A raw peer proven on the victim's same-host socket (token `token`), its control channel
  // in *ctl past the victim's eager grant (64 KiB messages, 4 MiB), which it checks.
  void prove_eager_peer(uint64_t token, net::Socket* ctl) {
    hello(token, info_);
    Fd my_table{detail::sealed_memfd("test-leases", 16 * 16)};
    ASSERT_GE(my_table.fd, 0);
    *ctl = sh::connect(socket_);
    sh::send(ctl->fd(), {{"op", "auth"}, {"token", token}}, my_table.fd);
    Fd their_table;
    json r = sh::recv(ctl->fd(), sh::Clock::now() + 5s, &their_table.fd);
    ASSERT_FALSE(r.contains("error")) << r.dump();
    ASSERT_EQ(attach(token), ErrorCode::kOk);
    FrameHeader g = read_credit_grant(ctl->fd());
    ASSERT_EQ(g.type, static_cast<uint8_t>(FrameType::kCredit));
    ASSERT_EQ(g.region, 64u * 1024);
    ASSERT_EQ(g.op_id, 4u << 20);
  }
  void expect_memory_intact() {
    EXPECT_EQ(0, std::memcmp(mem_.data(), snap_.data(), mem_.size())) << "victim memory changed";
    for (uint8_t b : secret_) ASSERT_EQ(b, 0x5e);
  }

  std::unique_ptr<Engine> victim_;
  std::vector<uint8_t> mem_, snap_, secret_;
  MemoryHandle hv_;
  std::string host_;
  uint16_t port_ = 0;
  json info_;
  std::string socket_;
};

// The original attack: a TCP peer says hello claiming shm with the victim's own pid, lease
// table and regions (all published by INFO). It must never get a channel.
TEST_F(SameHost, ShmHelloOverTcpWithTheVictimsOwnInfoIsRefused) {
  hello(4242, info_);
  std::string why;
  EXPECT_EQ(attach(4242, &why), ErrorCode::kProtocol);
  EXPECT_NE(why.find("proven"), std::string::npos) << why;
  EXPECT_FALSE(victim_->accept(300ms).has_value()) << "an unproven shm peer got an endpoint";
  // A hello without a same-host socket in its shm address is refused outright.
  json no_socket = info_;
  no_socket["transports"]["shm"] = {{"pid", static_cast<int>(::getpid())}, {"probe_addr", 1}, {"probe_value", 1}};
  net::Socket s = dial();
  boot::send_msg(s.fd(), boot::MsgKind::kHello, {{"info", no_socket}, {"token", 4243}, {"transport", "shm"}, {"channels", 1}});
  EXPECT_EQ(code_of([&] { boot::expect_reply(s.fd(), "hello"); }), ErrorCode::kProtocol);
  expect_memory_intact();
}

// Requests on the engine's Unix socket that do not come from a proven peer are refused, and
// descriptors must be memfds: a readable regular file must never be taken as a lease table.
TEST_F(SameHost, SocketRefusesStrangersAndNonMemfdDescriptors) {
  auto ask = [&](const json& req, int pass = -1) {
    net::Socket s = sh::connect(socket_);
    sh::send(s.fd(), req, pass);
    Fd got;
    json r = sh::recv(s.fd(), sh::Clock::now() + 5s, &got.fd);
    return r;
  };
  EXPECT_TRUE(ask({{"op", "describe"}, {"token", 1}, {"to_passive", true}, {"region", hv_.id}}).contains("error"));
  EXPECT_TRUE(ask({{"op", "auth"}, {"token", 777}}).contains("error")) << "auth for no waiting endpoint";
  EXPECT_TRUE(ask({{"op", "teleport"}}).contains("error"));
  EXPECT_TRUE(ask({{"op", "auth"}, {"token", -1}}).contains("error"));
  hello(5151, info_);
  char path[] = "/tmp/sluice-not-a-memfd-XXXXXX";
  Fd file{::mkstemp(path)};
  ASSERT_GE(file.fd, 0);
  ::unlink(path);
  ASSERT_EQ(::ftruncate(file.fd, 1 << 20), 0);
  json r = ask({{"op", "auth"}, {"token", 5151}}, file.fd);
  EXPECT_TRUE(r.contains("error")) << "a regular file was accepted as a lease table: " << r.dump();
  // A memfd its owner can still shrink: truncated under our mapping, it would raise SIGBUS in
  // the victim on its next lease access.
  Fd loose{::memfd_create("loose-leases", MFD_CLOEXEC | MFD_ALLOW_SEALING)};
  ASSERT_EQ(::ftruncate(loose.fd, 16 * 16), 0);
  ASSERT_EQ(::fcntl(loose.fd, F_ADD_SEALS, F_SEAL_GROW), 0);
  EXPECT_FALSE(sh::is_memfd(loose.fd, 16));
  r = ask({{"op", "auth"}, {"token", 5151}}, loose.fd);
  EXPECT_TRUE(r.contains("error")) << "a shrinkable memfd was accepted as a lease table: " << r.dump();
  r = ask({{"op", "auth"}, {"token", 5151}});
  EXPECT_TRUE(r.contains("error")) << "auth without a lease table was accepted";
  EXPECT_EQ(attach(5151), ErrorCode::kProtocol);
  expect_memory_intact();
}

// A proven same-host peer (this process, authenticated the way the engine does it) speaking
// raw frames: it reaches registered regions only, by the owner's description; the owner
// executes writes; a reader's copy counts only if the owner's lease still holds afterwards,
// and unregister returns within the op timeout even while a peer sits inside the lease.
TEST_F(SameHost, ProvenPeerReachesOnlyRegisteredRegions) {
  hello(6161, info_);
  Fd my_table{detail::sealed_memfd("test-leases", 16 * 16)};
  ASSERT_GE(my_table.fd, 0);
  net::Socket ctl = sh::connect(socket_);
  sh::send(ctl.fd(), {{"op", "auth"}, {"token", 6161}}, my_table.fd);
  Fd their_table;
  json r = sh::recv(ctl.fd(), sh::Clock::now() + 5s, &their_table.fd);
  ASSERT_FALSE(r.contains("error")) << r.dump();
  ASSERT_TRUE(sh::is_memfd(their_table.fd, 16)) << "the victim's lease table did not come as a memfd";
  ASSERT_EQ(attach(6161), ErrorCode::kOk);
  auto acc = victim_->accept(2s);
  ASSERT_TRUE(acc.has_value());
  FrameHeader grant = read_credit_grant(ctl.fd());
  ASSERT_EQ(grant.type, static_cast<uint8_t>(FrameType::kCredit));
  EXPECT_EQ(grant.region, 64u * 1024) << "the largest eager SEND (shm.eager_max)";
  EXPECT_EQ(grant.op_id, 4u << 20) << "the eager bytes granted (shm.eager_credit)";

  auto pull = [&](const std::vector<sh::PullPiece>& pieces) {
    FrameHeader h = make_frame(FrameType::kPullWrite, 99, 0, 0, pieces.size() * sizeof(sh::PullPiece), 0);
    EXPECT_TRUE(write_all(ctl.fd(), &h, sizeof(h)));
    EXPECT_TRUE(write_all(ctl.fd(), pieces.data(), pieces.size() * sizeof(sh::PullPiece)));
    FrameHeader a{};
    EXPECT_TRUE(read_all(ctl.fd(), &a, sizeof(a), 5s));
    std::string text(a.length, '\0');
    if (a.length) {
      EXPECT_TRUE(read_all(ctl.fd(), text.data(), a.length, 5s));
    }
    return std::make_pair(static_cast<FrameType>(a.type), static_cast<ErrorCode>(a.status));
  };
  std::vector<uint8_t> src(kPage, 0xab);
  auto src_addr = reinterpret_cast<uint64_t>(src.data());
  // Out of range, unknown region, a source region whose lease is not held: refused, untouched.
  EXPECT_EQ(pull({{hv_.id, kPage - 8, 16, src_addr, 0, detail::kNoLease, 0}}),
            std::make_pair(FrameType::kNack, ErrorCode::kOutOfRange));
  EXPECT_EQ(pull({{hv_.id + 1000, 0, 16, src_addr, 0, detail::kNoLease, 0}}),
            std::make_pair(FrameType::kNack, ErrorCode::kUnknownHandle));
  // A source region whose slot in our (the requester's) lease table does not hold it.
  EXPECT_EQ(pull({{hv_.id, 0, 16, src_addr, 5, 3, 0}}), std::make_pair(FrameType::kNack, ErrorCode::kUnknownHandle));
  expect_memory_intact();
  // In range: the owner copies it in.
  EXPECT_EQ(pull({{hv_.id, 100, 64, src_addr, 0, detail::kNoLease, 0}}), std::make_pair(FrameType::kAck, ErrorCode::kOk));
  std::memset(snap_.data() + kPage + 100, 0xab, 64);
  expect_memory_intact();

  // Describe: only for this endpoint's proven peer, only registered regions, by the owner.
  auto describe = [&](uint64_t region) {
    net::Socket s = sh::connect(socket_);
    sh::send(s.fd(), {{"op", "describe"}, {"token", 6161}, {"to_passive", true}, {"region", region}});
    Fd fd;
    return sh::recv(s.fd(), sh::Clock::now() + 5s, &fd.fd);
  };
  EXPECT_TRUE(describe(hv_.id + 1000).contains("error"));
  json d = describe(hv_.id);
  ASSERT_FALSE(d.contains("error")) << d.dump();
  EXPECT_EQ(d["addr"].get<uint64_t>(), reinterpret_cast<uint64_t>(mem_.data() + kPage));
  EXPECT_EQ(d["length"].get<uint64_t>(), kPage);

  // Sit inside the region's lease like a reader that was stopped mid-copy: unregister still
  // returns within the op timeout, and the reader then sees its copy must be discarded.
  detail::PeerLeases leases;
  ASSERT_TRUE(leases.map_fd(their_table.fd));
  uint32_t slot = static_cast<uint32_t>(d["slot"].get<uint64_t>());
  ASSERT_TRUE(leases.enter(slot, hv_.id));
  auto t0 = std::chrono::steady_clock::now();
  victim_->unregister_memory(hv_);
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, 5s) << "unregister waited for a stalled peer past the bound";
  EXPECT_FALSE(leases.still(slot, hv_.id)) << "a copy made across unregister would have been kept";
  leases.leave(slot);
  // The region is gone for writes too.
  EXPECT_EQ(pull({{hv_.id, 0, 16, src_addr, 0, detail::kNoLease, 0}}),
            std::make_pair(FrameType::kNack, ErrorCode::kUnknownHandle));
  expect_memory_intact();

  // A malformed PULL_WRITE (not a whole number of pieces) closes the channel.
  FrameHeader bad = make_frame(FrameType::kPullWrite, 1, 0, 0, 47, 0);
  std::vector<uint8_t> junk(sizeof(bad) + 47, 1);  // one write: the victim may close right after the header
  std::memcpy(junk.data(), &bad, sizeof(bad));
  ASSERT_TRUE(write_all(ctl.fd(), junk.data(), junk.size()));
  FrameHeader e{};
  ASSERT_TRUE(read_all(ctl.fd(), &e, sizeof(e), 5s));
  EXPECT_EQ(static_cast<FrameType>(e.type), FrameType::kError);
}

// The connecting side: a hostile listener answers INFO with a copy of our own info (our own
// same-host socket and pid, its own port). shm must not be chosen: the socket is our own.
TEST_F(SameHost, ListenerThatCopiedOurInfoDoesNotGetShm) {
  net::Socket lsock = net::listen_tcp("127.0.0.1", 0);
  uint16_t fake_port = net::local_port(lsock.fd());
  json forged = info_;
  forged["listen_port"] = fake_port;
  forged["engine_id"] = "feedfacefeedface";
  std::atomic<bool> stop{false};
  std::vector<net::Socket> kept;
  std::thread fake([&] {
    while (!stop.load()) {
      pollfd p{lsock.fd(), POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      net::Socket c = net::accept_tcp(lsock.fd());
      if (!c.valid()) continue;
      net::set_io_timeout(c.fd(), 2s);
      try {
        auto [kind, body] = boot::recv_msg(c.fd());
        if (kind == boot::MsgKind::kChannel) boot::send_msg(c.fd(), boot::MsgKind::kReply, json::object());
        else boot::send_msg(c.fd(), boot::MsgKind::kReply, {{"info", forged}});
      } catch (const Error&) {
      }
      kept.push_back(std::move(c));
    }
  });
  std::string transport;
  ErrorCode code = code_of([&] {
    Endpoint ep = victim_->connect("127.0.0.1:" + std::to_string(fake_port));
    transport = ep.transport();
  });
  stop = true;
  fake.join();
  EXPECT_EQ(code, ErrorCode::kOk);
  EXPECT_EQ(transport, "tcp") << "a peer that named our own same-host socket must be reached over tcp";
  expect_memory_intact();
}

// Local clients that connect to the engine's Unix socket and say nothing (any local process
// can) must not hold up an honest peer's proof behind them.
TEST_F(SameHost, SilentLocalClientsDoNotStallTheSocket) {
  std::vector<net::Socket> silent;
  for (int i = 0; i < 40; ++i) silent.push_back(sh::connect(socket_));
  EngineConfig c = engine_config("shm", 1, 10s);
  c.connect_timeout = 3000ms;
  Engine other(c);
  auto t0 = std::chrono::steady_clock::now();
  Endpoint ep = other.connect(victim_->local_info());
  EXPECT_EQ(ep.transport(), "shm");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s) << "the proof waited behind silent clients";
  ep.close();
}

// Eager SENDs (shm.eager_max, shm.eager_credit) against a proven peer that ignores the rules:
// a message the grant covers lands in its recv and its credit comes back; one larger than
// shm.eager_max, or past the bytes granted and not yet taken, closes the channel (never an
// unbounded stash); and the victim's own eager SENDs to the peer stay within the victim's
// shm.eager_credit however much the peer grants (a peer that grants much and reads nothing
// holds the victim to its own bound).
TEST_F(SameHost, EagerSendsStayWithinTheGrant) {
  auto eager = [&](int fd, uint64_t seq, const std::vector<uint8_t>& bytes) {
    FrameHeader h = make_frame(FrameType::kSend, seq, 0, 0, bytes.size());
    std::vector<uint8_t> out(sizeof(h) + bytes.size());
    std::memcpy(out.data(), &h, sizeof(h));
    if (!bytes.empty()) std::memcpy(out.data() + sizeof(h), bytes.data(), bytes.size());
    return write_all(fd, out.data(), out.size());
  };
  auto next_frame = [&](int fd) {
    FrameHeader a{};
    if (!read_all(fd, &a, sizeof(a), 5s)) return FrameHeader{};
    std::string text(a.length, '\0');
    if (a.length && !read_all(fd, text.data(), a.length, 5s)) return FrameHeader{};
    return a;
  };

  // (1) Within the grant: into the posted recv; the credit comes back an eighth of the grant
  // (512 KiB) at a time.
  {
    net::Socket ctl;
    ASSERT_NO_FATAL_FAILURE(prove_eager_peer(8181, &ctl));
    auto acc = victim_->accept(2s);
    ASSERT_TRUE(acc.has_value());
    std::vector<uint8_t> msg(60000);
    fill_pattern(msg.data(), msg.size(), 41);
    auto r = acc->recv(hv_, 0, 1000);  // smaller than the message: the first 1000 bytes, kTruncated
    ASSERT_TRUE(eager(ctl.fd(), 0, msg));
    ASSERT_TRUE(r.wait_for(5s));
    EXPECT_EQ(r.status().code, ErrorCode::kTruncated);
    std::memcpy(snap_.data() + kPage, msg.data(), 1000);
    expect_memory_intact();
    std::vector<uint8_t> sink(64 * 1024);
    auto hs = victim_->register_memory(sink.data(), sink.size());
    for (uint64_t seq = 1; seq < 9; ++seq) {
      auto rs = acc->recv(hs, 0, sink.size());
      ASSERT_TRUE(eager(ctl.fd(), seq, msg));
      ASSERT_TRUE(rs.wait_for(5s));
      ASSERT_TRUE(rs.status().ok()) << rs.status().to_string();
    }
    EXPECT_EQ(0, std::memcmp(sink.data(), msg.data(), msg.size()));
    FrameHeader c = next_frame(ctl.fd());
    EXPECT_EQ(c.type, static_cast<uint8_t>(FrameType::kCredit));
    EXPECT_EQ(c.op_id, 9 * (60000u + sizeof(FrameHeader))) << "the credit of the nine messages comes back";
    // (2) Larger than shm.eager_max: refused, the channel closes.
    ASSERT_TRUE(eager(ctl.fd(), 9, std::vector<uint8_t>(64 * 1024 + 1, 7)));
    EXPECT_EQ(next_frame(ctl.fd()).type, static_cast<uint8_t>(FrameType::kError));
    expect_memory_intact();
  }
  // (3) Past the bytes granted, no recv taking them: refused at the grant, not stashed on.
  {
    net::Socket ctl;
    ASSERT_NO_FATAL_FAILURE(prove_eager_peer(8282, &ctl));
    auto acc = victim_->accept(2s);
    ASSERT_TRUE(acc.has_value());
    std::vector<uint8_t> msg(64 * 1024, 9);
    const uint64_t fit = (4u << 20) / (msg.size() + sizeof(FrameHeader));  // 63
    bool closed = false;
    uint64_t seq = 0;
    for (; seq <= fit && !closed; ++seq) closed = !eager(ctl.fd(), seq, msg);
    FrameHeader e = next_frame(ctl.fd());
    EXPECT_EQ(e.type, static_cast<uint8_t>(FrameType::kError)) << "message " << fit + 1 << " was past the grant";
    // The endpoint fails as the channel goes down (the ERROR frame is written first).
    for (auto until = std::chrono::steady_clock::now() + 5s; acc->connected() && std::chrono::steady_clock::now() < until;)
      std::this_thread::sleep_for(5ms);
    EXPECT_FALSE(acc->connected());
    expect_memory_intact();
  }
  // (4) The victim's eager SENDs to a peer that grants far more than the victim's own
  // shm.eager_credit and reads nothing: 63 of 64 KiB complete (4 MiB with their headers), the
  // 64th waits (a rendezvous the peer never answers).
  {
    net::Socket ctl;
    ASSERT_NO_FATAL_FAILURE(prove_eager_peer(8383, &ctl));
    auto acc = victim_->accept(2s);
    ASSERT_TRUE(acc.has_value());
    FrameHeader g = make_frame(FrameType::kCredit, 1ull << 62, 64 * 1024);
    ASSERT_TRUE(write_all(ctl.fd(), &g, sizeof(g)));
    std::vector<uint8_t> src(64 * 1024, 5);
    auto hs = victim_->register_memory(src.data(), src.size());
    // Frames are served in order: once the victim answered a signal sent after the grant, it
    // holds the grant.
    FrameHeader probe = make_frame(FrameType::kSignal, 77, hv_.id + 1000, 0, 0, detail::kLaneEnd, 1, 0);
    ASSERT_TRUE(write_all(ctl.fd(), &probe, sizeof(probe)));
    FrameHeader nack = next_frame(ctl.fd());
    ASSERT_EQ(nack.type, static_cast<uint8_t>(FrameType::kNack));
    ASSERT_EQ(nack.op_id, 77u);
    for (int i = 0; i < 63; ++i) {
      auto f = acc->send(hs, 0, src.size());
      ASSERT_TRUE(f.wait_for(5s)) << "eager send " << i << " of 63 did not complete";
      ASSERT_TRUE(f.status().ok()) << f.status().to_string();
    }
    auto last = acc->send(hs, 0, src.size());
    EXPECT_FALSE(last.wait_for(300ms)) << "a send past the victim's own shm.eager_credit completed unanswered";
    victim_->unregister_memory(hs);
  }
}

// The eager ring against a proven peer that writes raw frames: the victim hands its ring
// (a sealed memfd of eager_credit + eager_max bytes) to this endpoint's peer alone; a
// SEND_RING frame is taken only at the position that follows the last message, within
// shm.eager_max, and only once the ring was handed out. Anything else closes the channel;
// the victim's memory outside the recv is never touched.
TEST_F(SameHost, EagerRingTakesOnlyTheNextPositionOfItsOwnRing) {
  constexpr uint64_t kRing = (4u << 20) + 64 * 1024;  // the data area: the grant plus a message
  // ...then the 64 recv offer slots of the default shm.recv_offers.
  constexpr uint64_t kRingTotal = detail::shm::ring_total_bytes(kRing, 1024, 64);
  auto ring_of = [&](uint64_t token, Fd* fd) {
    net::Socket s = sh::connect(socket_);
    sh::send(s.fd(), {{"op", "describe"}, {"token", token}, {"to_passive", true}, {"region", ~uint64_t{0}}});
    return sh::recv(s.fd(), sh::Clock::now() + 5s, &fd->fd);
  };
  auto frame = [&](int fd, uint64_t seq, uint64_t len, uint64_t pos) {
    FrameHeader h = make_frame(FrameType::kSendRing, seq, len, pos);
    return write_all(fd, &h, sizeof(h));
  };
  // (1) A SEND_RING before the ring was handed out: refused.
  {
    net::Socket ctl;
    ASSERT_NO_FATAL_FAILURE(prove_eager_peer(8484, &ctl));
    auto acc = victim_->accept(2s);
    ASSERT_TRUE(acc.has_value());
    auto r = acc->recv(hv_, 0, kPage);
    ASSERT_TRUE(frame(ctl.fd(), 0, 100, 0));
    EXPECT_EQ(next_type(ctl.fd()), FrameType::kError);
    EXPECT_FALSE(r.wait_for(5s) && r.status().ok());
    expect_memory_intact();
  }
  // (2) The ring goes to the endpoint's proven peer only (another token's peer is refused),
  // as a sealed memfd of the announced size. Messages at the right positions land, into a
  // posted recv and stashed (held in the ring until a recv takes it); then one at any other
  // position is refused.
  {
    net::Socket ctl;
    ASSERT_NO_FATAL_FAILURE(prove_eager_peer(8585, &ctl));
    auto acc = victim_->accept(2s);
    ASSERT_TRUE(acc.has_value());
    Fd stranger;
    EXPECT_TRUE(ring_of(999999, &stranger).contains("error"));
    Fd fd;
    json d = ring_of(8585, &fd);
    ASSERT_FALSE(d.contains("error")) << d.dump();
    ASSERT_EQ(d["data"].get<uint64_t>(), kRing);
    ASSERT_EQ(d["slots"].get<uint64_t>(), 1024u);
    ASSERT_EQ(d["length"].get<uint64_t>(), kRingTotal);
    ASSERT_TRUE(sh::is_memfd(fd.fd, kRingTotal));
    auto* ring = static_cast<uint8_t*>(::mmap(nullptr, kRingTotal, PROT_READ | PROT_WRITE, MAP_SHARED, fd.fd, 0));
    ASSERT_NE(ring, MAP_FAILED);
    std::vector<uint8_t> msg(3000);
    fill_pattern(msg.data(), msg.size(), 51);
    std::vector<uint8_t> sink(2 * kPage, 0);
    auto hs = victim_->register_memory(sink.data(), sink.size());
    auto r0 = acc->recv(hs, 0, kPage);  // posted first
    std::memcpy(ring, msg.data(), msg.size());
    ASSERT_TRUE(frame(ctl.fd(), 0, msg.size(), 0));
    ASSERT_TRUE(r0.wait_for(5s));
    ASSERT_TRUE(r0.status().ok()) << r0.status().to_string();
    EXPECT_EQ(r0.bytes(), msg.size());
    std::memcpy(ring + msg.size(), msg.data() + 1, msg.size() - 1);
    ASSERT_TRUE(frame(ctl.fd(), 1, msg.size() - 1, msg.size()));  // stashed: no recv yet
    // Frames are served in order: the answer to a signal sent after it means it was taken.
    FrameHeader probe = make_frame(FrameType::kSignal, 77, hv_.id + 1000, 0, 0, detail::kLaneEnd, 1, 0);
    ASSERT_TRUE(write_all(ctl.fd(), &probe, sizeof(probe)));
    ASSERT_EQ(next_type(ctl.fd()), FrameType::kNack);
    auto r1 = acc->recv(hs, kPage, kPage);
    ASSERT_TRUE(r1.wait_for(5s));
    ASSERT_TRUE(r1.status().ok()) << r1.status().to_string();
    EXPECT_EQ(0, std::memcmp(sink.data(), msg.data(), msg.size()));
    EXPECT_EQ(0, std::memcmp(sink.data() + kPage, msg.data() + 1, msg.size() - 1));
    // The next message goes at 5999; one claimed at the ring's start (over bytes the victim
    // may not have copied out) is refused.
    auto r2 = acc->recv(hs, 0, kPage);
    ASSERT_TRUE(frame(ctl.fd(), 2, 100, 0));
    EXPECT_EQ(next_type(ctl.fd()), FrameType::kError);
    EXPECT_FALSE(r2.wait_for(5s) && r2.status().ok());
    ::munmap(ring, kRingTotal);
    victim_->unregister_memory(hs);
    expect_memory_intact();
  }
  // (3) Larger than shm.eager_max, or past the ring's end: refused.
  for (auto [len, pos] : {std::pair<uint64_t, uint64_t>{64 * 1024 + 1, 0}, {64 * 1024, kRing - 100}}) {
    net::Socket ctl;
    const uint64_t token = 8686 + pos;
    ASSERT_NO_FATAL_FAILURE(prove_eager_peer(token, &ctl));
    auto acc = victim_->accept(2s);
    ASSERT_TRUE(acc.has_value());
    Fd fd;
    ASSERT_FALSE(ring_of(token, &fd).contains("error"));
    ASSERT_TRUE(frame(ctl.fd(), 0, len, pos));
    EXPECT_EQ(next_type(ctl.fd()), FrameType::kError) << len << " bytes at " << pos;
    expect_memory_intact();
  }
}

// The eager ring's descriptor queue against a raw proven peer: a message announced by a
// descriptor is taken after a RING_BELL (and the victim says it went back to sleep), into a
// posted recv or held for a later one; a descriptor whose turn has not come (a SEND frame
// with an earlier sequence is still to come) waits for that frame; a stale stamp is not a
// message; a descriptor at a wrong position, or too long, closes the channel with the
// victim's memory intact.
TEST_F(SameHost, EagerRingQueueTakesDescriptorsInSequenceOrder) {
  using detail::shm::RingControl;
  using detail::shm::RingDesc;
  constexpr uint64_t kRing = (4u << 20) + 64 * 1024;
  constexpr uint64_t kSlots = 1024;
  constexpr uint64_t kRingTotal = detail::shm::ring_total_bytes(kRing, kSlots, 64);  // and the default recv offers
  struct Peer {
    net::Socket ctl;
    Fd fd;
    uint8_t* ring = nullptr;
    RingDesc* desc = nullptr;
    RingControl* rc = nullptr;
    ~Peer() {
      if (ring) ::munmap(ring, kRingTotal);
    }
    // Message `seq` of `bytes` at data position `pos`, announced by descriptor `index`.
    void put(uint64_t index, uint64_t seq, uint64_t pos, const std::vector<uint8_t>& bytes, uint64_t stamp = 0) {
      std::memcpy(ring + pos, bytes.data(), bytes.size());
      RingDesc& d = desc[index % kSlots];
      d.seq = seq;
      d.length = bytes.size();
      d.pos = pos;
      std::atomic_ref<uint64_t>(d.stamp).store(stamp ? stamp : index + 1, std::memory_order_release);
    }
    bool bell() {
      FrameHeader h = make_frame(FrameType::kRingBell, 0, 0, 0);
      return write_all(ctl.fd(), &h, sizeof(h));
    }
  };
  auto open_peer = [&](uint64_t token, Peer* p) {
    ASSERT_NO_FATAL_FAILURE(prove_eager_peer(token, &p->ctl));
    net::Socket s = sh::connect(socket_);
    sh::send(s.fd(), {{"op", "describe"}, {"token", token}, {"to_passive", true}, {"region", ~uint64_t{0}}});
    json d = sh::recv(s.fd(), sh::Clock::now() + 5s, &p->fd.fd);
    ASSERT_FALSE(d.contains("error")) << d.dump();
    ASSERT_EQ(d["length"].get<uint64_t>(), kRingTotal);
    p->ring = static_cast<uint8_t*>(::mmap(nullptr, kRingTotal, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd.fd, 0));
    ASSERT_NE(p->ring, MAP_FAILED);
    p->desc = reinterpret_cast<RingDesc*>(p->ring + kRing);
    p->rc = reinterpret_cast<RingControl*>(p->desc + kSlots);
  };
  auto consumed = [](Peer& p, uint64_t want) {
    for (auto until = std::chrono::steady_clock::now() + 5s; std::chrono::steady_clock::now() < until;) {
      if (std::atomic_ref<uint64_t>(p.rc->consumed).load(std::memory_order_acquire) == want) return true;
      std::this_thread::sleep_for(1ms);
    }
    return false;
  };
  std::vector<uint8_t> m0(3000), m1(4096), m2(777), m3(100);
  fill_pattern(m0.data(), m0.size(), 61);
  fill_pattern(m1.data(), m1.size(), 62);
  fill_pattern(m2.data(), m2.size(), 63);
  fill_pattern(m3.data(), m3.size(), 64);
  {
    Peer p;
    ASSERT_NO_FATAL_FAILURE(open_peer(9191, &p));
    auto acc = victim_->accept(2s);
    ASSERT_TRUE(acc.has_value());
    std::vector<uint8_t> sink(4 * kPage, 0);
    auto hs = victim_->register_memory(sink.data(), sink.size());
    // Into a posted recv; the victim looked, found nothing more, and asks for a bell again.
    auto r0 = acc->recv(hs, 0, kPage);
    p.put(0, 0, 0, m0);
    ASSERT_TRUE(p.bell());
    ASSERT_TRUE(r0.wait_for(5s));
    ASSERT_TRUE(r0.status().ok()) << r0.status().to_string();
    EXPECT_EQ(0, std::memcmp(sink.data(), m0.data(), m0.size()));
    ASSERT_TRUE(consumed(p, 1));
    EXPECT_EQ(std::atomic_ref<uint64_t>(p.rc->awake).load(), 0u);
    // No recv yet: held in the ring, read by the recv posted later.
    p.put(1, 1, m0.size(), m1);
    ASSERT_TRUE(p.bell());
    ASSERT_TRUE(consumed(p, 2));
    auto r1 = acc->recv(hs, kPage, kPage);
    ASSERT_TRUE(r1.wait_for(5s));
    ASSERT_TRUE(r1.status().ok()) << r1.status().to_string();
    EXPECT_EQ(0, std::memcmp(sink.data() + kPage, m1.data(), m1.size()));
    // Message 3 queued before message 2's SEND frame: it waits for that frame, then follows it.
    auto r2 = acc->recv(hs, 2 * kPage, kPage);
    auto r3 = acc->recv(hs, 3 * kPage, kPage);
    p.put(2, 3, m0.size() + m1.size(), m3);
    ASSERT_TRUE(p.bell());
    EXPECT_FALSE(r2.wait_for(200ms));
    EXPECT_FALSE(r3.wait_for(0ms)) << "a queued message was taken before the one sent before it";
    FrameHeader h = make_frame(FrameType::kSend, 2, 0, 0, m2.size());
    std::vector<uint8_t> out(sizeof(h) + m2.size());
    std::memcpy(out.data(), &h, sizeof(h));
    std::memcpy(out.data() + sizeof(h), m2.data(), m2.size());
    ASSERT_TRUE(write_all(p.ctl.fd(), out.data(), out.size()));
    ASSERT_TRUE(r2.wait_for(5s));
    ASSERT_TRUE(r3.wait_for(5s));
    ASSERT_TRUE(r2.status().ok() && r3.status().ok()) << r2.status().to_string() << " / " << r3.status().to_string();
    EXPECT_EQ(0, std::memcmp(sink.data() + 2 * kPage, m2.data(), m2.size()));
    EXPECT_EQ(0, std::memcmp(sink.data() + 3 * kPage, m3.data(), m3.size()));
    ASSERT_TRUE(consumed(p, 3));
    // A stale stamp (the slot's previous message) is no message; the right one is.
    auto r4 = acc->recv(hs, 0, kPage);
    const uint64_t pos4 = m0.size() + m1.size() + m3.size();
    p.put(3, 4, pos4, m2, /*stamp=*/3);
    ASSERT_TRUE(p.bell());
    EXPECT_FALSE(r4.wait_for(200ms)) << "a descriptor with a stale stamp was taken";
    p.put(3, 4, pos4, m2);
    ASSERT_TRUE(p.bell());
    ASSERT_TRUE(r4.wait_for(5s));
    EXPECT_TRUE(r4.status().ok()) << r4.status().to_string();
    victim_->unregister_memory(hs);
    expect_memory_intact();
  }
  // A descriptor at a position other than the next one, or longer than shm.eager_max: refused.
  for (auto [len, pos] : {std::pair<uint64_t, uint64_t>{100, 64}, {64 * 1024 + 1, 0}, {64 * 1024, kRing - 100}}) {
    Peer p;
    ASSERT_NO_FATAL_FAILURE(open_peer(9292 + pos + len, &p));
    auto acc = victim_->accept(2s);
    ASSERT_TRUE(acc.has_value());
    auto r = acc->recv(hv_, 0, kPage);
    RingDesc& d = p.desc[0];
    d.seq = 0;
    d.length = len;
    d.pos = pos;
    std::atomic_ref<uint64_t>(d.stamp).store(1, std::memory_order_release);
    ASSERT_TRUE(p.bell());
    EXPECT_EQ(next_type(p.ctl.fd()), FrameType::kError) << len << " bytes at " << pos;
    EXPECT_FALSE(r.wait_for(5s) && r.status().ok());
    expect_memory_intact();
  }
}

// Recv offers (shm_offer.cpp) against a raw proven peer that maps the victim's ring: a recv in
// engine memory waiting for message 0 is offered in the ring's first offer slot (its region,
// offset and capacity, word = offered). A SEND_PUT for a message whose offer the peer did not
// take (or turned to taken for another message of the slot), for a message not offered, or
// longer than the buffer offered, closes the channel and fails the recv, with the victim's
// memory intact; a SEND_PUT after taking the offer completes the recv with the length it names.
TEST_F(SameHost, RecvOffersTakeOnlyTakenOffersWithinTheirBuffer) {
  using detail::shm::RecvOfferSlot;
  constexpr uint64_t kRing = (4u << 20) + 64 * 1024;
  constexpr uint64_t kSlots = 1024, kOffers = 64;
  constexpr uint64_t kRingTotal = detail::shm::ring_total_bytes(kRing, kSlots, kOffers);
  auto put_frame = [](int fd, uint64_t seq, uint64_t n) {
    FrameHeader h = make_frame(FrameType::kSendPut, seq, 0, 0, 0, 0, static_cast<uint32_t>(n),
                               static_cast<uint32_t>(n >> 32));
    return write_all(fd, &h, sizeof(h));
  };
  auto recv_mem = victim_->allocate(kPage, Location::host(), "offered");
  auto* rp = static_cast<uint8_t*>(recv_mem.ptr);
  // 0: offer not taken; 1: too long; 2: taken, honest; 3: the word turned to taken for the
  // slot's next message (64); 4: the offer taken, the SEND_PUT names message 1 (not offered).
  for (int mode = 0; mode < 5; ++mode) {
    SCOPED_TRACE("mode " + std::to_string(mode));
    std::memset(rp, 0xa5, kPage);
    net::Socket ctl;
    ASSERT_NO_FATAL_FAILURE(prove_eager_peer(9393 + mode, &ctl));
    Fd fd;
    net::Socket s = sh::connect(socket_);
    sh::send(s.fd(), {{"op", "describe"}, {"token", 9393 + mode}, {"to_passive", true}, {"region", ~uint64_t{0}}});
    json d = sh::recv(s.fd(), sh::Clock::now() + 5s, &fd.fd);
    ASSERT_FALSE(d.contains("error")) << d.dump();
    ASSERT_EQ(d["offers"].get<uint64_t>(), kOffers);
    ASSERT_EQ(d["length"].get<uint64_t>(), kRingTotal);
    auto* ring = static_cast<uint8_t*>(::mmap(nullptr, kRingTotal, PROT_READ | PROT_WRITE, MAP_SHARED, fd.fd, 0));
    ASSERT_NE(ring, MAP_FAILED);
    struct Unmap {
      uint8_t* p;
      ~Unmap() { ::munmap(p, kRingTotal); }
    } unmap{ring};
    RecvOfferSlot* offers = detail::shm::ring_offers(ring, kRing, kSlots);
    auto acc = victim_->accept(2s);
    ASSERT_TRUE(acc.has_value());
    auto r = acc->recv(recv_mem.handle, 100, 1000);
    std::atomic_ref<uint64_t> word(offers[0].word);
    EXPECT_EQ(word.load(), detail::shm::offer_word(0, detail::shm::kOffered));
    EXPECT_EQ(offers[0].region, recv_mem.handle.id);
    EXPECT_EQ(offers[0].offset, 100u);
    EXPECT_EQ(offers[0].capacity, 1000u);
    if (mode == 0) {
      ASSERT_TRUE(put_frame(ctl.fd(), 0, 10));
    } else {
      uint64_t open = detail::shm::offer_word(0, detail::shm::kOffered);
      ASSERT_TRUE(word.compare_exchange_strong(open, detail::shm::offer_word(mode == 3 ? 64 : 0, detail::shm::kTaken)));
      ASSERT_TRUE(put_frame(ctl.fd(), mode == 4 ? 1 : 0, mode == 1 ? 1001 : 600));
    }
    if (mode != 2) {
      EXPECT_EQ(next_type(ctl.fd()), FrameType::kError);
      ASSERT_TRUE(r.wait_for(5s));
      EXPECT_FALSE(r.status().ok());
    } else {
      ASSERT_TRUE(r.wait_for(5s));
      EXPECT_TRUE(r.status().ok()) << r.status().to_string();
      EXPECT_EQ(r.bytes(), 600u);
    }
    for (uint64_t i = 0; i < kPage; ++i) ASSERT_EQ(rp[i], 0xa5) << "byte " << i << " of the recv's memory";
    expect_memory_intact();
  }
}

// Two engines in one process that really are distinct engines still use shm, and it works.
TEST_F(SameHost, HonestPeersStillUseShm) {
  EngineConfig c = engine_config("shm", 2, 10s);
  Engine other(c);
  std::vector<uint8_t> buf(kPage);
  fill_pattern(buf.data(), buf.size(), 3);
  auto h = other.register_memory(buf.data(), buf.size());
  Endpoint ep = other.connect(victim_->local_info());
  ASSERT_EQ(ep.transport(), "shm");
  auto rv = *ep.remote_region("victim");
  ASSERT_TRUE(ep.write({{h, 0, rv, 0, kPage}}).wait().ok());
  EXPECT_EQ(0, std::memcmp(mem_.data() + kPage, buf.data(), kPage));
  std::vector<uint8_t> back(kPage);
  auto hb = other.register_memory(back.data(), back.size());
  ASSERT_TRUE(ep.read({{hb, 0, rv, 0, kPage}}).wait().ok());
  EXPECT_EQ(back, buf);
  ep.close();
}

// Engine::region_descriptor / Endpoint::import_region: a region registered after the peer
// connected becomes addressable in-band; descriptors of another engine and malformed ones are
// refused; a forged length reaches nothing beyond what the owner registered, and a descriptor
// of a region the owner withdrew gets kUnknownHandle from the owner.
TEST(ImportRegion, InBandDescriptorsAndForgedOnes) {
  for (const std::string t : {"shm", "tcp"}) {
    EngineConfig c = engine_config(t, 1, 10s);
    Engine a(c), b(c), other(c);
    std::vector<uint8_t> mem(3 * kPage, 0x11), back(2 * kPage, 0);
    fill_pattern(mem.data() + kPage, kPage, 5);
    auto hback = a.register_memory(back.data(), back.size());
    Endpoint ep = a.connect(b.local_info());
    auto hb = b.register_memory(mem.data() + kPage, kPage);  // after the connect
    std::string msg;
    EXPECT_EQ(ErrorCode::kUnknownHandle, code_of([&] { ep.read({{hback, 0, RemoteHandle{hb.id}, 0, kPage}}); }, &msg))
        << t << ": " << msg;
    const std::string desc = b.region_descriptor(hb);
    RemoteHandle r = ep.import_region(desc);
    EXPECT_EQ(r.id, hb.id);
    ASSERT_TRUE(ep.read({{hback, 0, r, 0, kPage}}).wait().ok()) << t;
    EXPECT_EQ(0, std::memcmp(back.data(), mem.data() + kPage, kPage)) << t;
    ep.refresh_remote_regions();  // kept across a refresh of the same peer
    EXPECT_TRUE(ep.read({{hback, 0, r, 0, kPage}}).wait().ok()) << t;
    // Another engine's descriptor, garbage, and a region id nobody registered.
    auto ho = other.register_memory(mem.data(), kPage);
    EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { ep.import_region(other.region_descriptor(ho)); }, &msg)) << t;
    EXPECT_NE(std::string::npos, msg.find("peer is")) << msg;
    EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { ep.import_region("{not json"); })) << t;
    EXPECT_EQ(ErrorCode::kInvalidArgument, code_of([&] { ep.import_region(R"({"engine_id":"x"})"); })) << t;
    EXPECT_EQ(ErrorCode::kUnknownHandle, code_of([&] { b.region_descriptor(MemoryHandle{987654}); })) << t;
    // Forged: the same region claimed twice as long. The owner's registry decides: the read
    // of the second page fails and `back` keeps what it had.
    auto j = nlohmann::json::parse(desc);
    j["region"]["length"] = 2 * kPage;
    RemoteHandle forged = ep.import_region(j.dump());
    std::fill(back.begin(), back.end(), 0x77);
    EXPECT_FALSE(ep.read({{hback, 0, forged, kPage, kPage}}).wait().ok()) << t << ": read beyond the owner's region";
    EXPECT_EQ(back, std::vector<uint8_t>(back.size(), 0x77)) << t;
    // Withdrawn by the owner: the imported handle fails at the owner.
    b.unregister_memory(hb);
    EXPECT_FALSE(ep.read({{hback, 0, r, 0, kPage}}).wait().ok()) << t << ": read of a withdrawn region";
    EXPECT_EQ(back, std::vector<uint8_t>(back.size(), 0x77)) << t;
  }
}

// ConnectOptions::avoid: the engine skips those transports when it chooses, says so when
// nothing else is left, and a forced transport wins over it.
TEST(ConnectAvoid, SkipsTheAvoidedTransportUnlessForced) {
  EngineConfig c = engine_config("shm", 1, 10s);
  c.transports = {"shm", "tcp"};
  Engine a(c), b(c);
  std::vector<uint8_t> m(4096, 7), back(4096);
  b.register_memory(m.data(), m.size(), Location::host(), "m");
  auto hb = a.register_memory(back.data(), back.size());
  ConnectOptions co;
  ASSERT_EQ(a.connect(b.local_info(), co).transport(), "shm");
  co.avoid = {"shm"};
  Endpoint ep = a.connect(b.local_info(), co);
  EXPECT_EQ(ep.transport(), "tcp");
  ASSERT_TRUE(ep.read({{hb, 0, *ep.remote_region("m"), 0, m.size()}}).wait().ok());
  EXPECT_EQ(back, m);
  co.avoid = {"shm", "tcp"};
  std::string msg;
  EXPECT_EQ(ErrorCode::kUnsupported, code_of([&] { a.connect(b.local_info(), co); }, &msg));
  EXPECT_NE(std::string::npos, msg.find("shm: avoided for this endpoint")) << msg;
  co.transport = "shm";
  EXPECT_EQ(a.connect(b.local_info(), co).transport(), "shm");
}

}  // namespace

namespace {

// The lease mechanism itself: an owner withdrawing a region while a peer is inside waits at
// most its timeout, and the peer can tell afterwards that its copy straddled the withdrawal.
TEST(Leases, WithdrawalIsBoundedAndVisibleToAPeerInside) {
  detail::LeaseTable owner(16);
  ASSERT_TRUE(owner.ok());
  uint32_t slot = owner.open(42);
  detail::PeerLeases peer;
  ASSERT_TRUE(peer.map_fd(owner.memfd()));
  ASSERT_TRUE(peer.enter(slot, 42));
  EXPECT_FALSE(peer.enter(slot, 43)) << "entered a slot under the wrong region id";
  EXPECT_TRUE(peer.still(slot, 42));
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(owner.close(slot, 42, 100ms));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_FALSE(peer.still(slot, 42));
  peer.leave(slot);
  EXPECT_FALSE(peer.enter(slot, 42)) << "entered a withdrawn region";
  // A descriptor that is not a whole table is refused.
  Fd odd{::memfd_create("odd", MFD_CLOEXEC)};
  ASSERT_EQ(::ftruncate(odd.fd, 17), 0);
  detail::PeerLeases bad;
  EXPECT_FALSE(bad.map_fd(odd.fd));
}

}  // namespace
