// Hostile peers on the data path (issue 18): a peer that chatters but never answers, that
// stops reading, that announces huge messages or floods tiny ones. No fork: runs under TSan.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <thread>

#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "loopback.hpp"
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

constexpr uint64_t kForgedRegion = 7;  // the region the forged peer advertises

// Resident set size of this process, from /proc/self/statm.
uint64_t rss_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<uint64_t>(resident) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

// Reads and drops whatever arrives until `stop` or the victim closes the connection.
void drain(int fd, const std::atomic<bool>& stop) {
  char buf[65536];
  while (!stop.load()) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    if (::recv(fd, buf, sizeof(buf), 0) <= 0) return;
  }
}

class DatapathHostile : public ::testing::Test {
 protected:
  void SetUp() override { ::signal(SIGPIPE, SIG_IGN); }
  void TearDown() override {
    if (victim_) victim_->close();
  }

  void start(EngineConfig c, uint64_t region_bytes) {
    victim_ = std::make_unique<Engine>(c);
    mem_.assign(region_bytes, 0);
    hv_ = victim_->register_memory(mem_.data(), mem_.size(), Location::host(), "victim");
    auto [host, port] = detail::split_host_port(victim_->listen_address());
    host_ = host;
    port_ = port;
  }

  static EngineConfig config(std::chrono::milliseconds op_timeout) {
    EngineConfig c = engine_config("tcp", 1, op_timeout);
    c.connect_timeout = 2000ms;
    return c;
  }

  // Opens an endpoint to the victim by hand, advertising one region (kForgedRegion) the
  // victim may target; returns its one tcp data channel.
  net::Socket forged_channel(uint64_t token) {
    EngineInfo e;
    e.wire_version = kWireVersion;
    e.engine_id = "evil000000000000";
    e.host_id = "evil-host";
    e.listen_host = "127.0.0.1";
    e.listen_port = 1;
    e.transports["tcp"] = json::object();
    detail::PeerRegion r;
    r.info.id = kForgedRegion;
    r.info.addr = 0x10000;
    r.info.length = kMiB;
    r.info.location = Location::host();
    r.info.name = "forged";
    e.regions.push_back(r);
    {
      net::Socket s = net::connect_tcp(host_, port_, 2s);
      net::set_io_timeout(s.fd(), 5s);
      boot::send_msg(s.fd(), boot::MsgKind::kHello,
                     {{"info", e.to_json()}, {"token", token}, {"transport", "tcp"}, {"channels", 1}});
      boot::expect_reply(s.fd(), "hello");
    }
    net::Socket s = net::connect_tcp(host_, port_, 2s);
    net::set_io_timeout(s.fd(), 5s);
    boot::send_msg(s.fd(), boot::MsgKind::kChannel, {{"token", token}, {"index", 0}, {"transport", "tcp"}});
    boot::expect_reply(s.fd(), "channel");
    net::set_io_timeout(s.fd(), std::chrono::milliseconds(0));
    return s;
  }

  std::unique_ptr<Engine> victim_;
  std::vector<uint8_t> mem_;
  MemoryHandle hv_;
  std::string host_;
  uint16_t port_ = 0;
};

// Class 4: a zero-length WRITE every 0.5 s used to count as progress for the whole endpoint,
// so a write the peer never acknowledges stayed pending forever. Deadlines are per operation.
TEST_F(DatapathHostile, UnansweredWriteTimesOutDespiteChatter) {
  start(config(1000ms), 4096);
  net::Socket ch = forged_channel(4001);
  auto ep = victim_->accept(5s);
  ASSERT_TRUE(ep.has_value());
  std::atomic<bool> stop{false};
  std::thread reader([&] { drain(ch.fd(), stop); });
  std::thread chatter([&] {
    while (!stop.load()) {
      FrameHeader h = make_frame(FrameType::kWrite, 1, hv_.id, 0, 0);  // valid, zero-length, no ack wanted
      if (!send_all(ch.fd(), &h, sizeof(h))) return;
      for (int i = 0; i < 10 && !stop.load(); ++i) std::this_thread::sleep_for(50ms);
    }
  });
  auto t0 = std::chrono::steady_clock::now();
  Future f = ep->write({{hv_, 0, RemoteHandle{kForgedRegion}, 0, 512}});
  bool done = f.wait_for(1000ms + 4s);
  auto took = std::chrono::steady_clock::now() - t0;
  stop = true;
  ch.shutdown();
  reader.join();
  chatter.join();
  ASSERT_TRUE(done) << "a write the peer never acknowledged was still pending past op_timeout + 4 s";
  EXPECT_EQ(f.status().code, ErrorCode::kTimeout) << f.status().to_string();
  EXPECT_LT(took, 1000ms + 4s);
  EXPECT_FALSE(ep->connected()) << "a timed-out operation declares the silent peer lost";
}

// Class 5: a SEND header claiming 200 MiB used to allocate (and zero) 200 MiB before any
// payload arrived. Memory now follows the bytes that really arrive.
TEST_F(DatapathHostile, HugeAnnouncedSendAllocatesOnlyWhatArrives) {
  start(config(10s), 4096);
  net::Socket ch = forged_channel(4002);
  auto ep = victim_->accept(5s);
  ASSERT_TRUE(ep.has_value());
  const uint64_t before = rss_bytes();
  std::vector<uint8_t> part(kMiB, 'x');
  FrameHeader h = make_frame(FrameType::kSend, 0, 0, 0, 200 * kMiB);
  ASSERT_TRUE(send_all(ch.fd(), &h, sizeof(h)));
  ASSERT_TRUE(send_all(ch.fd(), part.data(), part.size()));
  std::this_thread::sleep_for(500ms);  // let the victim take in what was sent
  const uint64_t grew = rss_bytes() > before ? rss_bytes() - before : 0;
  EXPECT_LT(grew, 32 * kMiB) << "a stalled 200 MiB announcement grew the victim by " << grew / kMiB << " MiB";
  EXPECT_TRUE(ep->connected());
}

// Class 5: zero-length sends that no recv matches used to pile up without a count limit.
TEST_F(DatapathHostile, ZeroLengthSendFloodIsRefusedAtTheBound) {
  EngineConfig c = config(10s);
  c.max_unexpected_messages = 1000;
  start(c, 4096);
  net::Socket ch = forged_channel(4003);
  // The victim stops reading once it failed the endpoint and keeps its socket until the
  // endpoint is closed, so a burst in flight then can fill the socket buffers: bound our own
  // sends (a blocking send here hung this test about once in a few hundred runs).
  const timeval send_limit{2, 0};
  ASSERT_EQ(::setsockopt(ch.fd(), SOL_SOCKET, SO_SNDTIMEO, &send_limit, sizeof send_limit), 0);
  auto ep = victim_->accept(5s);
  ASSERT_TRUE(ep.has_value());
  std::atomic<bool> stop{false};
  std::thread reader([&] { drain(ch.fd(), stop); });
  std::vector<FrameHeader> burst;
  uint64_t seq = 0;
  for (int b = 0; b < 100 && ep->connected(); ++b) {  // 100 bursts of 1000: 100k sends
    burst.clear();
    for (int i = 0; i < 1000; ++i) burst.push_back(make_frame(FrameType::kSend, seq++, 0, 0, 0));
    if (!send_all(ch.fd(), burst.data(), burst.size() * sizeof(FrameHeader))) break;
  }
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (ep->connected() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
  stop = true;
  reader.join();
  ASSERT_FALSE(ep->connected()) << "100k unmatched zero-length sends were all buffered";
  std::string msg;
  EXPECT_EQ(code_of([&] { ep->recv(hv_, 0, 1); }, &msg), ErrorCode::kProtocol);
  EXPECT_NE(msg.find("max_unexpected_messages (1000)"), std::string::npos) << msg;
}

// unregister_memory on a thread, bounded by `limit`: true if it returned (*error: what it
// threw, empty if nothing). On a hang the thread is left behind (the test has failed).
bool unregister_within(Engine& e, MemoryHandle h, std::chrono::milliseconds limit, std::string* error) {
  auto state = std::make_shared<std::pair<std::atomic<bool>, std::string>>();
  state->first = false;
  std::thread([&e, h, state] {
    try {
      e.unregister_memory(h);
    } catch (const Error& err) {
      state->second = err.what();
    }
    state->first = true;
  }).detach();
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!state->first.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  if (!state->first.load()) return false;
  *error = state->second;
  return true;
}

// Class 3 (tcp): 10000 READ requests for a 4 MiB region and never a byte read. The queued
// READ_RESP frames pinned the region and unregister_memory blocked forever.
TEST_F(DatapathHostile, ReadFloodWithoutReadingCannotPinARegion) {
  start(config(1000ms), 4 * kMiB);
  net::Socket ch = forged_channel(4004);
  auto ep = victim_->accept(5s);
  ASSERT_TRUE(ep.has_value());
  const uint64_t before = rss_bytes();
  std::vector<FrameHeader> reqs;
  for (int i = 0; i < 10000; ++i)
    reqs.push_back(make_frame(FrameType::kReadReq, 100 + i, hv_.id, 0, 0, detail::kLaneEnd,
                              static_cast<uint32_t>(4 * kMiB), 0));
  send_all(ch.fd(), reqs.data(), reqs.size() * sizeof(FrameHeader));  // may be cut off: fine
  std::this_thread::sleep_for(200ms);  // the victim has served what it read
  std::string error;
  ASSERT_TRUE(unregister_within(*victim_, hv_, 1000ms + 6s, &error))
      << "unregister_memory still blocked by a peer that never reads its responses";
  EXPECT_EQ(error, "") << "pins were still held";
  EXPECT_FALSE(ep->connected());
  std::string msg;
  EXPECT_NE(code_of([&] { ep->recv(hv_, 0, 1); }, &msg), ErrorCode::kOk);
  EXPECT_NE(msg.find("max_queued_responses"), std::string::npos) << msg;
  const uint64_t grew = rss_bytes() > before ? rss_bytes() - before : 0;
  EXPECT_LT(grew, 64 * kMiB) << "the victim grew by " << grew / kMiB << " MiB";
}

// Class 3 (tcp): a few READ requests (under max_queued_responses) and the peer reads nothing:
// the writer stalls with the responses queued; after op_timeout the endpoint fails and drops them.
TEST_F(DatapathHostile, PeerThatReadsNothingCannotPinARegion) {
  start(config(1000ms), 4 * kMiB);
  net::Socket ch = forged_channel(4005);
  std::vector<FrameHeader> reqs;
  for (int i = 0; i < 32; ++i)
    reqs.push_back(make_frame(FrameType::kReadReq, 100 + i, hv_.id, 0, 0, detail::kLaneEnd,
                              static_cast<uint32_t>(4 * kMiB), 0));
  ASSERT_TRUE(send_all(ch.fd(), reqs.data(), reqs.size() * sizeof(FrameHeader)));
  std::this_thread::sleep_for(200ms);  // the responses are queued and the socket is full
  std::string error;
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(unregister_within(*victim_, hv_, 1000ms + 6s, &error))
      << "unregister_memory still blocked by a peer that reads nothing";
  EXPECT_EQ(error, "") << "pins were still held";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1000ms + 6s);
}

// Class 4: recv and imm_recv on a connected peer that sends nothing complete with kTimeout
// after recv_timeout; the endpoint stays usable; the timed-out recv keeps its sequence slot,
// so its late message is refused to the sender and the next message reaches the next recv.
TEST(RecvDeadlines, UnmatchedRecvAndImmRecvTimeOutAndLateMessagesAreRefused) {
  EngineConfig c = engine_config("tcp", 2, 10s);
  c.recv_timeout = 1000ms;
  Engine a(c), b(c);
  std::vector<uint8_t> la(4096), lb(4096, 0);
  fill_pattern(la.data(), la.size(), 3);
  auto ha = a.register_memory(la.data(), la.size());
  auto hb = b.register_memory(lb.data(), lb.size(), Location::host(), "b");
  Endpoint ep = a.connect(b.local_info());
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  Future r0 = peer->recv(hb, 0, 100);
  Future i0 = peer->imm_recv();
  ASSERT_TRUE(r0.wait_for(1000ms + 4s)) << "a recv nothing matched never completed";
  ASSERT_TRUE(i0.wait_for(1000ms + 4s)) << "an imm_recv nothing matched never completed";
  EXPECT_EQ(r0.status().code, ErrorCode::kTimeout) << r0.status().to_string();
  EXPECT_EQ(i0.status().code, ErrorCode::kTimeout) << i0.status().to_string();
  EXPECT_TRUE(peer->connected());
  EXPECT_TRUE(ep.connected());
  // The late message for r0 is drained; its sender hears that the receiver gave up.
  Status late = ep.send(ha, 0, 100).wait();
  EXPECT_EQ(late.code, ErrorCode::kRemoteError) << late.to_string();
  EXPECT_NE(late.message.find("timed out"), std::string::npos) << late.message;
  EXPECT_TRUE(std::all_of(lb.begin(), lb.end(), [](uint8_t v) { return v == 0; }))
      << "a late message landed in a recv that had given up";
  // Later messages match later recvs, and imms still arrive.
  Future r1 = peer->recv(hb, 0, 200);
  ASSERT_TRUE(ep.send(ha, 100, 200).wait().ok());
  ASSERT_TRUE(r1.wait_for(5s));
  EXPECT_TRUE(r1.status().ok()) << r1.status().to_string();
  EXPECT_EQ(0, std::memcmp(lb.data(), la.data() + 100, 200));
  Future i1 = peer->imm_recv();
  ASSERT_TRUE(ep.write_with_imm({{ha, 0, *ep.remote_region("b"), 1000, 16}}, 42).wait().ok());
  ASSERT_TRUE(i1.wait_for(5s));
  EXPECT_TRUE(i1.status().ok());
  EXPECT_EQ(i1.imm(), 42u);
  ep.close();
  peer->close();
}

}  // namespace

namespace {

// Per-op deadlines must not fail honest work queued behind a long backlog: ops waiting on a
// channel that keeps answering are not overdue, even when their own turn comes after
// op_timeout (here: 3 GiB of reads and writes on one channel, op_timeout 300 ms; 1200 ms sanitized).
TEST(OpDeadlines, WorkQueuedBehindAMovingBacklogIsNotTimedOut) {
  // Reads and writes use disjoint halves on both sides (no data race on the buffers), and
  // the buffers outlive the engines.
  std::vector<uint8_t> la(8 * kMiB, 1), lb(8 * kMiB, 2);
  // Sanitized builds run several times slower: on a loaded host a reactor starved for 300 ms
  // looks like a peer that stopped reading (seen once under TSan). The backlog still outlasts
  // the longer deadline there (about 15 s under TSan).
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  constexpr auto kOpTimeout = 1200ms;
#else
  constexpr auto kOpTimeout = 300ms;
#endif
  EngineConfig c = engine_config("tcp", 1, kOpTimeout);
  Engine a(c), b(c);
  auto ha = a.register_memory(la.data(), la.size());
  b.register_memory(lb.data(), lb.size(), Location::host(), "b");
  Endpoint ep = a.connect(b.local_info());
  RemoteHandle rb = *ep.remote_region("b");
  std::vector<Future> fs;
  for (int i = 0; i < 384; ++i) {
    fs.push_back(ep.read({{ha, 4 * kMiB, rb, 0, 4 * kMiB}}));
    fs.push_back(ep.write({{ha, 0, rb, 4 * kMiB, 4 * kMiB}}));
  }
  for (auto& s : {0, 1, 2, 3}) fs.push_back(ep.send(ha, s, 1));  // acked by b's stash
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < fs.size(); ++i) {
    ASSERT_TRUE(fs[i].wait_for(60s)) << "op " << i;
    EXPECT_TRUE(fs[i].status().ok()) << "op " << i << ": " << fs[i].status().to_string();
  }
  EXPECT_TRUE(ep.connected());
  // Only meaningful if the backlog outlasted op_timeout (it does on the build hosts: about
  // 1 s, 15 s under TSan); a faster host is not a failure.
  if (std::chrono::steady_clock::now() - t0 < kOpTimeout)
    std::printf("note: the backlog drained within op_timeout; nothing was tested\n");
}

}  // namespace
