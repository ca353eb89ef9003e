// MessageMatcher: k-th send to k-th recv, unexpected messages buffered, truncation, imm queue.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <thread>

#include "core/device_hooks.hpp"
#include "core/message_matcher.hpp"

using namespace sluice;
using namespace sluice::detail;

namespace {

std::shared_ptr<MessageOp> recv_op(uint8_t* p, uint64_t n) {
  auto op = std::make_shared<MessageOp>();
  op->ptr = p;
  op->length = n;
  op->future = std::make_shared<FutureState>(OpKind::kRecv);
  return op;
}

// Simulates a transport delivering message `seq` with the given bytes.
Status arrive(MessageMatcher& m, uint64_t seq, const std::string& data, Status transfer = Status::Ok()) {
  auto c = m.claim(seq, data.size());
  if (c.dest) std::memcpy(c.dest, data.data(), std::min<uint64_t>(data.size(), c.capacity));
  return m.deliver(c, transfer);
}

}  // namespace

TEST(MessageMatcher, KthSendMatchesKthRecvWhateverTheSizes) {
  MessageMatcher m(1 << 20);
  std::vector<std::vector<uint8_t>> bufs(4, std::vector<uint8_t>(64, 0xAA));
  std::vector<std::shared_ptr<MessageOp>> ops;
  for (auto& b : bufs) {
    ops.push_back(recv_op(b.data(), b.size()));
    m.post_recv(ops.back());
  }
  std::string msgs[] = {"first", "", "the third message", std::string(64, 'z')};
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(arrive(m, i, msgs[i]).ok());
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(ops[i]->future->done());
    EXPECT_TRUE(ops[i]->future->status().ok());
    EXPECT_EQ(ops[i]->future->bytes(), msgs[i].size());
    EXPECT_EQ(std::string(bufs[i].begin(), bufs[i].begin() + msgs[i].size()), msgs[i]);
    if (msgs[i].size() < 64) {
      EXPECT_EQ(bufs[i][msgs[i].size()], 0xAA) << "bytes past the message were written";
    }
  }
}

TEST(MessageMatcher, UnexpectedMessagesAreBufferedInOrder) {
  MessageMatcher m(1 << 20);
  EXPECT_TRUE(arrive(m, 0, "alpha").ok());
  EXPECT_TRUE(arrive(m, 1, "beta").ok());
  uint8_t a[16] = {}, b[16] = {}, c[16] = {};
  auto ra = recv_op(a, sizeof(a));
  m.post_recv(ra);
  ASSERT_TRUE(ra->future->done());
  EXPECT_EQ(ra->future->bytes(), 5u);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(a), 5), "alpha");
  // A mix: one recv posted before its message, one after.
  auto rb = recv_op(b, sizeof(b));
  m.post_recv(rb);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(b), 4), "beta");
  auto rc = recv_op(c, sizeof(c));
  m.post_recv(rc);
  EXPECT_FALSE(rc->future->done());
  EXPECT_TRUE(arrive(m, 2, "gamma").ok());
  ASSERT_TRUE(rc->future->done());
  EXPECT_EQ(std::string(reinterpret_cast<char*>(c), 5), "gamma");
}

TEST(MessageMatcher, RecvPostedWhileStashedMessageIsStillLanding) {
  MessageMatcher m(1 << 20);
  auto claim = m.claim(0, 6);
  ASSERT_NE(claim.dest, nullptr);
  ASSERT_TRUE(claim.stash);
  uint8_t buf[8] = {};
  auto r = recv_op(buf, sizeof(buf));
  m.post_recv(r);
  EXPECT_FALSE(r->future->done()) << "recv completed before the message's bytes landed";
  std::memcpy(claim.dest, "landed", 6);
  EXPECT_TRUE(m.deliver(claim, Status::Ok()).ok());
  ASSERT_TRUE(r->future->done());
  EXPECT_TRUE(r->future->status().ok());
  EXPECT_EQ(std::string(reinterpret_cast<char*>(buf), 6), "landed");
}

TEST(MessageMatcher, TruncationFailsBothSidesAndDeliversThePrefix) {
  MessageMatcher m(1 << 20);
  uint8_t small[4] = {9, 9, 9, 9};
  uint8_t guard[4] = {7, 7, 7, 7};
  (void)guard;
  auto r = recv_op(small, 3);
  m.post_recv(r);
  Status sender = arrive(m, 0, "abcdef");
  EXPECT_EQ(sender.code, ErrorCode::kTruncated);
  ASSERT_TRUE(r->future->done());
  EXPECT_EQ(r->future->status().code, ErrorCode::kTruncated);
  EXPECT_EQ(r->future->bytes(), 3u);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(small), 3), "abc");
  EXPECT_EQ(small[3], 9) << "wrote past the receive buffer";

  // Truncation of a buffered (unexpected) message: the sender already succeeded.
  EXPECT_TRUE(arrive(m, 1, "0123456789").ok());
  uint8_t b2[5] = {};
  auto r2 = recv_op(b2, 4);
  m.post_recv(r2);
  ASSERT_TRUE(r2->future->done());
  EXPECT_EQ(r2->future->status().code, ErrorCode::kTruncated);
  EXPECT_EQ(r2->future->bytes(), 4u);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(b2), 4), "0123");
  EXPECT_EQ(b2[4], 0);
}

TEST(MessageMatcher, OutOfOrderSequenceIsProtocolError) {
  MessageMatcher m(1 << 20);
  auto c = m.claim(1, 4);
  EXPECT_EQ(c.error.code, ErrorCode::kProtocol);
  EXPECT_EQ(c.dest, nullptr);
  // The expected sequence still works afterwards.
  EXPECT_TRUE(arrive(m, 0, "ok").ok());
}

TEST(MessageMatcher, UnexpectedBufferIsBounded) {
  MessageMatcher m(10);
  EXPECT_TRUE(arrive(m, 0, "12345678").ok());
  auto c = m.claim(1, 8);  // 16 > 10
  EXPECT_FALSE(c.error.ok());
  EXPECT_EQ(c.dest, nullptr);
  EXPECT_FALSE(m.deliver(c, Status::Ok()).ok());
  // The refused message kept its sequence number: the next one is 2.
  EXPECT_TRUE(arrive(m, 2, "ab").ok());
  uint8_t b[16];
  auto r0 = recv_op(b, 16);
  m.post_recv(r0);
  EXPECT_TRUE(r0->future->status().ok());
  auto r1 = recv_op(b, 16);
  m.post_recv(r1);
  ASSERT_TRUE(r1->future->done());
  EXPECT_FALSE(r1->future->status().ok()) << "the recv matched with the refused message must fail";
  auto r2 = recv_op(b, 16);
  m.post_recv(r2);
  ASSERT_TRUE(r2->future->done());
  EXPECT_TRUE(r2->future->status().ok());
  EXPECT_EQ(std::string(reinterpret_cast<char*>(b), 2), "ab");
  // Consumed messages free their budget.
  EXPECT_TRUE(arrive(m, 3, "123456789").ok());
}

TEST(MessageMatcher, ImmQueueInArrivalOrder) {
  MessageMatcher m(1 << 20);
  m.push_imm(1);
  m.push_imm(2);
  auto f1 = m.imm_recv();
  auto f2 = m.imm_recv();
  auto f3 = m.imm_recv();
  auto f4 = m.imm_recv();
  ASSERT_TRUE(f1->done());
  ASSERT_TRUE(f2->done());
  EXPECT_EQ(f1->imm(), 1u);
  EXPECT_EQ(f2->imm(), 2u);
  EXPECT_FALSE(f3->done());
  m.push_imm(3);
  m.push_imm(4);
  m.push_imm(5);
  ASSERT_TRUE(f3->done());
  ASSERT_TRUE(f4->done());
  EXPECT_EQ(f3->imm(), 3u);
  EXPECT_EQ(f4->imm(), 4u);
  auto f5 = m.imm_recv();
  ASSERT_TRUE(f5->done());
  EXPECT_EQ(f5->imm(), 5u);
  EXPECT_TRUE(f5->status().ok());
}

TEST(MessageMatcher, FailAllFailsPendingAndLater) {
  MessageMatcher m(1 << 20);
  uint8_t b[8];
  auto r = recv_op(b, 8);
  m.post_recv(r);
  auto imm = m.imm_recv();
  // A recv waiting on a stashed message that is still landing.
  auto claim = m.claim(0, 4);
  (void)claim;
  auto r_wait = recv_op(b, 8);
  // r is matched to seq 0; post another for a second in-flight message.
  auto claim2 = m.claim(1, 4);
  m.post_recv(r_wait);
  Status why{ErrorCode::kPeerLost, "gone"};
  m.fail_all(why);
  EXPECT_TRUE(imm->done());
  EXPECT_EQ(imm->status().code, ErrorCode::kPeerLost);
  EXPECT_TRUE(r_wait->future->done());
  EXPECT_EQ(r_wait->future->status().code, ErrorCode::kPeerLost);
  auto later = recv_op(b, 8);
  m.post_recv(later);
  EXPECT_TRUE(later->future->done());
  EXPECT_EQ(later->future->status().code, ErrorCode::kPeerLost);
  auto imm2 = m.imm_recv();
  EXPECT_TRUE(imm2->done());
  EXPECT_EQ(imm2->status().code, ErrorCode::kPeerLost);
}

TEST(MessageMatcher, ConcurrentPostAndArrive) {
  MessageMatcher m(1 << 30);
  constexpr int kN = 2000;
  std::vector<uint64_t> bufs(kN, 0);
  std::vector<std::shared_ptr<MessageOp>> ops(kN);
  std::thread poster([&] {
    for (int i = 0; i < kN; ++i) {
      ops[i] = recv_op(reinterpret_cast<uint8_t*>(&bufs[i]), 8);
      m.post_recv(ops[i]);
    }
  });
  for (uint64_t i = 0; i < kN; ++i) {
    std::string data(reinterpret_cast<const char*>(&i), 8);
    EXPECT_TRUE(arrive(m, i, data).ok());
  }
  poster.join();
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(ops[i]->future->wait_for(std::chrono::seconds(5)));
    EXPECT_TRUE(ops[i]->future->status().ok());
    EXPECT_EQ(bufs[i], static_cast<uint64_t>(i));
  }
}

// Issue 18 class 5: a lazy claim gives an unexpected message no buffer until its bytes
// arrive; the buffer then grows with them and the recv still gets the whole message.
TEST(MessageMatcher, LazyClaimAllocatesAsBytesArrive) {
  MessageMatcher m(1ull << 30);
  auto c = m.claim(0, 200ull << 20, /*lazy=*/true);
  ASSERT_TRUE(c.error.ok());
  ASSERT_TRUE(c.stash);
  EXPECT_EQ(c.dest, nullptr);
  EXPECT_LT(c.stash->data.capacity(), 1u << 20) << "a 200 MiB announcement allocated before any byte arrived";
  // Only a 3-byte message this time (the rest of the test: the buffer follows real bytes).
  auto c2 = m.claim(1, 3, /*lazy=*/true);
  uint8_t* p = MessageMatcher::stash_room(c2, 3);
  std::memcpy(p, "xyz", 3);
  EXPECT_TRUE(m.deliver(c2, Status::Ok()).ok());
  EXPECT_TRUE(m.deliver(c, {ErrorCode::kPeerLost, "cut off"}).code == ErrorCode::kPeerLost);
  uint8_t a[8] = {}, b[8] = {};
  auto ra = recv_op(a, sizeof(a));
  m.post_recv(ra);
  EXPECT_EQ(ra->future->status().code, ErrorCode::kPeerLost);
  auto rb = recv_op(b, sizeof(b));
  m.post_recv(rb);
  ASSERT_TRUE(rb->future->status().ok());
  EXPECT_EQ(std::string(reinterpret_cast<char*>(b), 3), "xyz");
}

// Issue 18 class 5: unmatched messages are bounded in count, zero-length ones included.
TEST(MessageMatcher, UnexpectedMessageCountIsBounded) {
  MessageMatcher m(1 << 20, 100);
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(arrive(m, i, "").ok()) << i;
  auto c = m.claim(100, 0);
  EXPECT_EQ(c.error.code, ErrorCode::kProtocol);
  EXPECT_NE(c.error.message.find("max_unexpected_messages (100)"), std::string::npos) << c.error.message;
  // A posted recv drains one, and the next message is taken again.
  uint8_t a[1];
  m.post_recv(recv_op(a, 1));
  EXPECT_TRUE(arrive(m, 100, "").ok());
}

// Issue 18 class 4: recv / imm_recv deadlines. A recv that timed out keeps its sequence slot:
// its late message is refused (to the sender) and the next message reaches the next recv.
TEST(MessageMatcher, ExpiredRecvKeepsItsSlotAndRefusesItsLateMessage) {
  MessageMatcher m(1 << 20);
  uint8_t a[8] = {}, b[8] = {};
  auto ra = recv_op(a, sizeof(a));
  m.post_recv(ra);
  auto imm = m.imm_recv();
  auto now = std::chrono::steady_clock::now();
  EXPECT_EQ(m.expire(now, std::chrono::milliseconds(1000)), 0u);
  EXPECT_EQ(m.expire(now + std::chrono::seconds(2), std::chrono::milliseconds(1000)), 2u);
  ASSERT_TRUE(ra->future->done());
  EXPECT_EQ(ra->future->status().code, ErrorCode::kTimeout);
  ASSERT_TRUE(imm->done());
  EXPECT_EQ(imm->status().code, ErrorCode::kTimeout);
  auto rb = recv_op(b, sizeof(b));
  m.post_recv(rb);
  Status late = arrive(m, 0, "late");
  EXPECT_EQ(late.code, ErrorCode::kRemoteError) << late.to_string();
  EXPECT_EQ(std::string(reinterpret_cast<char*>(a), 4), std::string(4, '\0')) << "a late message landed";
  EXPECT_TRUE(arrive(m, 1, "next").ok());
  ASSERT_TRUE(rb->future->status().ok());
  EXPECT_EQ(std::string(reinterpret_cast<char*>(b), 4), "next");
  // A late imm goes to the next imm_recv.
  m.push_imm(9);
  auto imm2 = m.imm_recv();
  ASSERT_TRUE(imm2->done());
  EXPECT_EQ(imm2->imm(), 9u);
}

// A message stashed in place (shm's eager ring): the recv that takes it copies straight from
// the transport's memory, and only then is that memory handed back (release_held), before the
// credit; a truncated recv takes the prefix; a recv posted while the message is still landing
// gets it from deliver(), in the same order.
TEST(MessageMatcher, HeldStashIsReadInPlaceAndHandedBackAfterTheCopy) {
  struct Sink : CreditSink {
    std::vector<std::string> calls;
    std::string* watched = nullptr;  // the held bytes, overwritten once handed back
    void release_credit(uint64_t bytes) override { calls.push_back("credit " + std::to_string(bytes)); }
    void release_held(uint64_t end) override {
      calls.push_back("held " + std::to_string(end));
      if (watched) watched->assign(watched->size(), '#');
    }
  };
  auto sink = std::make_shared<Sink>();
  MessageMatcher m(16);  // far below the messages: in-place ones are eager (credit), never refused
  std::string ring = "first-message|second|third";
  sink->watched = &ring;
  auto hold = [&](uint64_t seq, uint64_t off, uint64_t len, uint64_t credit) {
    auto c = m.claim(seq, len, /*lazy=*/true, credit, sink);
    EXPECT_TRUE(c.stash);
    EXPECT_EQ(c.dest, nullptr);
    c.stash->held = reinterpret_cast<const uint8_t*>(ring.data()) + off;
    c.stash->held_end = off + len;
    return c;
  };
  auto c0 = hold(0, 0, 13, 100);
  EXPECT_TRUE(m.deliver(c0, Status::Ok()).ok());
  auto c1 = hold(1, 14, 6, 200);
  EXPECT_TRUE(m.deliver(c1, Status::Ok()).ok());
  EXPECT_TRUE(sink->calls.empty()) << "handed back before any recv took the message";
  char a[32] = {};
  auto ra = recv_op(reinterpret_cast<uint8_t*>(a), sizeof(a));
  m.post_recv(ra);
  ASSERT_TRUE(ra->future->done());
  EXPECT_TRUE(ra->future->status().ok());
  EXPECT_EQ(std::string(a, 13), "first-message");
  ASSERT_EQ(sink->calls, (std::vector<std::string>{"held 13", "credit 100"}));
  sink->watched = nullptr;
  ring = "first-message|second|third";
  char b[4] = {};
  auto rb = recv_op(reinterpret_cast<uint8_t*>(b), sizeof(b));
  m.post_recv(rb);
  ASSERT_TRUE(rb->future->done());
  EXPECT_EQ(rb->future->status().code, ErrorCode::kTruncated);
  EXPECT_EQ(std::string(b, 4), "seco");
  EXPECT_EQ(sink->calls.back(), "credit 200");
  EXPECT_EQ(sink->calls[2], "held 20");
  // Posted while the message lands: deliver() copies it and hands it back.
  char c[8] = {};
  auto c2 = hold(2, 21, 5, 300);
  auto rc = recv_op(reinterpret_cast<uint8_t*>(c), sizeof(c));
  m.post_recv(rc);
  EXPECT_FALSE(rc->future->done());
  EXPECT_EQ(sink->calls.size(), 4u) << "handed back before the bytes were copied";
  EXPECT_TRUE(m.deliver(c2, Status::Ok()).ok());
  ASSERT_TRUE(rc->future->done());
  EXPECT_EQ(std::string(c, 5), "third");
  EXPECT_EQ(sink->calls[4], "held 26");
  EXPECT_EQ(sink->calls[5], "credit 300");
}

namespace {
int g_uploads = 0;
void fake_upload(void* device, const void* host, uint64_t n) {
  ++g_uploads;
  std::memcpy(device, host, n);
}
// Installs `h` as the device module's hooks for the scope (the real ones, if this build has
// them, come back after).
struct HooksScope {
  const DeviceMemoryHooks* saved = device_memory_hooks();
  explicit HooksScope(const DeviceMemoryHooks* h) { device_memory_hooks() = h; }
  ~HooksScope() { device_memory_hooks() = saved; }
};
}  // namespace

// A message that arrived before its recv waits in host memory; a recv into device memory
// (a region whose location is cuda) takes it through the device module's upload, never with a
// host memcpy into device memory (on a GPU host that was a segfault: the tcp recv of a CUDA
// tensor whose message came first). Without a device module the recv fails, its buffer untouched.
TEST(MessageMatcher, StashedMessageIntoDeviceMemoryGoesThroughTheDeviceModule) {
  uint8_t fake_device[32];  // host memory standing in for a cuda:0 region
  auto entry = std::make_shared<RegionEntry>();
  entry->id = 7;
  entry->base = fake_device;
  entry->length = sizeof(fake_device);
  entry->location = Location::cuda(0);
  for (bool with_module : {false, true}) {
    SCOPED_TRACE(with_module ? "device module" : "no device module");
    DeviceMemoryHooks hooks;
    hooks.upload = fake_upload;
    HooksScope scope(with_module ? &hooks : nullptr);
    g_uploads = 0;
    std::memset(fake_device, 0xAA, sizeof(fake_device));
    MessageMatcher m(1 << 20);
    EXPECT_TRUE(arrive(m, 0, "stashed before its recv").ok());
    auto r = recv_op(fake_device, sizeof(fake_device));
    r->pin = RegionPin(entry);
    m.post_recv(r);
    ASSERT_TRUE(r->future->done());
    if (with_module) {
      EXPECT_TRUE(r->future->status().ok()) << r->future->status().to_string();
      EXPECT_EQ(g_uploads, 1);
      EXPECT_EQ(std::string(reinterpret_cast<char*>(fake_device), 23), "stashed before its recv");
      EXPECT_EQ(r->future->bytes(), 23u);
    } else {
      EXPECT_EQ(r->future->status().code, ErrorCode::kUnsupported) << r->future->status().to_string();
      EXPECT_EQ(r->future->bytes(), 0u);
      EXPECT_EQ(fake_device[0], 0xAA) << "host memcpy into device memory";
    }
  }
}
