#include "transport/common/pending_ops.hpp"

#include <gtest/gtest.h>

#include <set>
#include <thread>
#include <vector>

namespace sluice::detail {
namespace {

std::shared_ptr<TransferOp> make_op(int parts) {
  auto op = std::make_shared<TransferOp>();
  op->future = std::make_shared<FutureState>(OpKind::kWrite, parts);
  return op;
}

TEST(PendingOps, CompletesAfterTheLastLaneAndForgetsTheToken) {
  PendingOps p;
  auto op = make_op(2);
  auto f = op->future;
  uint64_t t = p.add(op);
  ASSERT_NE(t, 0u);
  EXPECT_EQ(p.size(), 1u);
  EXPECT_TRUE(p.lane_done(t, Status::Ok()));
  EXPECT_FALSE(f->done());
  EXPECT_TRUE(p.lane_done(t, Status::Ok()));
  EXPECT_TRUE(f->done());
  EXPECT_TRUE(f->status().ok());
  EXPECT_EQ(p.size(), 0u);
  EXPECT_FALSE(p.lane_done(t, Status::Ok())) << "a finished op's token must be unknown";
  EXPECT_EQ(p.find(t), nullptr);
}

TEST(PendingOps, AReusedSlotNeverAnswersAnOldToken) {
  PendingOps p;
  uint64_t first = p.add(make_op(1));
  ASSERT_TRUE(p.lane_done(first, Status::Ok()));
  auto next = make_op(1);
  uint64_t second = p.add(next);  // takes the freed slot
  EXPECT_NE(first, second);
  EXPECT_FALSE(p.lane_done(first, Status::Ok())) << "stale token completed a later op";
  EXPECT_FALSE(next->future->done());
  EXPECT_TRUE(p.lane_done(second, Status::Ok()));
  EXPECT_TRUE(next->future->done());
}

TEST(PendingOps, ForgedTokensAreRejected) {
  PendingOps p;
  auto op = make_op(1);
  uint64_t t = p.add(op);
  for (uint64_t forged : std::vector<uint64_t>{0, t + 1, t ^ (1ull << 32), t | (0xffffull << 40), ~0ull, 12345}) {
    if (forged == t) continue;
    EXPECT_FALSE(p.lane_done(forged, Status::Ok())) << forged;
    EXPECT_FALSE(p.note_error(forged, {ErrorCode::kRemoteError, "x"})) << forged;
  }
  EXPECT_FALSE(op->future->done());
  EXPECT_LT(t, 1ull << 62) << "tokens must leave the rdma wr_id tag bits free";
}

TEST(PendingOps, ErrorsReachTheFutureAndFailAllEndsEverything) {
  PendingOps p;
  auto a = make_op(1), b = make_op(2);
  uint64_t ta = p.add(a);
  p.add(b);
  EXPECT_TRUE(p.note_error(ta, {ErrorCode::kRemoteError, "bad rkey"}));
  EXPECT_TRUE(p.lane_done(ta, Status::Ok()));
  EXPECT_TRUE(a->future->done());
  p.fail_all({ErrorCode::kPeerLost, "gone"});
  EXPECT_EQ(a->future->status().code, ErrorCode::kRemoteError) << "a noted error is the op's status";
  EXPECT_EQ(b->future->status().code, ErrorCode::kPeerLost);
  EXPECT_EQ(p.size(), 0u);
  auto late = make_op(1);
  EXPECT_EQ(p.add(late), 0u);
  EXPECT_EQ(late->future->status().code, ErrorCode::kPeerLost);
}

TEST(PendingOps, ConcurrentAddAndCompleteKeepsTokensUnique) {
  PendingOps p;
  constexpr int kThreads = 4, kEach = 2000;
  std::vector<std::thread> ts;
  std::vector<std::vector<uint64_t>> seen(kThreads);
  for (int i = 0; i < kThreads; ++i)
    ts.emplace_back([&, i] {
      for (int k = 0; k < kEach; ++k) {
        auto op = make_op(1);
        uint64_t t = p.add(op);
        seen[i].push_back(t);
        ASSERT_TRUE(p.lane_done(t, Status::Ok()));
        ASSERT_TRUE(op->future->done());
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(p.size(), 0u);
  std::set<uint64_t> all;
  for (auto& v : seen) all.insert(v.begin(), v.end());
  EXPECT_EQ(all.size(), static_cast<size_t>(kThreads * kEach)) << "a token was handed out twice";
}

// Issue 18 class 4: deadlines are per operation. An op that saw progress of its own stays;
// one that saw none for the timeout fails with kTimeout, however busy the endpoint is.
TEST(PendingOps, ExpireFailsOnlyOpsWithoutProgressOfTheirOwn) {
  PendingOps p;
  auto quiet = make_op(2), busy = make_op(2);
  uint64_t tq = p.add(quiet), tb = p.add(busy);
  auto send = std::make_shared<MessageOp>();
  send->seq = 5;
  send->future = std::make_shared<FutureState>(OpKind::kSend);
  ASSERT_TRUE(p.add_send(send));
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  p.touch();  // endpoint-level activity keeps nobody alive
  p.progress(tb);
  ASSERT_TRUE(p.lane_done(tb, Status::Ok()));
  std::string what;
  EXPECT_EQ(p.expire(PendingOps::Clock::now(), std::chrono::milliseconds(50), &what), 2u);
  EXPECT_NE(what.find("op_timeout 50 ms"), std::string::npos) << what;
  ASSERT_TRUE(quiet->future->done());
  EXPECT_EQ(quiet->future->status().code, ErrorCode::kTimeout);
  ASSERT_TRUE(send->future->done());
  EXPECT_EQ(send->future->status().code, ErrorCode::kTimeout);
  EXPECT_FALSE(busy->future->done());
  EXPECT_FALSE(p.lane_done(tq, Status::Ok())) << "an expired op's token still resolved";
  EXPECT_EQ(p.size(), 1u);
  EXPECT_TRUE(p.lane_done(tb, Status::Ok()));
  EXPECT_TRUE(busy->future->status().ok());
}

// The tcp watchdog's start of silence: the earliest submission among what a lane owes (sends
// count on lane 0), not its last progress; nothing owed is time_point::max().
TEST(PendingOps, OwedSinceIsTheOldestOpenSubmissionOnTheLane) {
  using Clock = PendingOps::Clock;
  PendingOps p;
  EXPECT_EQ(p.owed_since(0), Clock::time_point::max());
  EXPECT_EQ(p.owed_since(-1), Clock::time_point::max());
  EXPECT_EQ(p.owed_since(64), Clock::time_point::max());
  const auto t0 = Clock::now();
  auto first = make_op(2);
  first->posted_lanes = 0b11;
  uint64_t tf = p.add(first);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto t1 = Clock::now();
  auto second = make_op(1);
  second->posted_lanes = 0b10;
  uint64_t ts = p.add(second);
  auto unposted = make_op(1);  // added, not yet on any lane
  p.add(unposted);
  EXPECT_GE(p.owed_since(0), t0);
  EXPECT_LT(p.owed_since(0), t1);
  EXPECT_EQ(p.owed_since(1), p.owed_since(0));
  EXPECT_EQ(p.owed_since(2), Clock::time_point::max());
  p.progress(tf);  // progress does not move when the work became owed
  EXPECT_LT(p.owed_since(1), t1);
  ASSERT_TRUE(p.lane_done(tf, Status::Ok(), 1));  // lane 1 of the first op done
  EXPECT_GE(p.owed_since(1), t1) << "a finished lane still counted";
  EXPECT_LT(p.owed_since(0), t1);
  ASSERT_TRUE(p.lane_done(tf, Status::Ok(), 0));
  EXPECT_EQ(p.owed_since(0), Clock::time_point::max());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto t2 = Clock::now();
  auto send = std::make_shared<MessageOp>();
  send->seq = 9;
  send->future = std::make_shared<FutureState>(OpKind::kSend);
  ASSERT_TRUE(p.add_send(send));
  EXPECT_GE(p.owed_since(0), t2) << "a send is owed on lane 0";
  EXPECT_GE(p.owed_since(1), t1);
  EXPECT_LT(p.owed_since(1), t2) << "sends are owed on lane 0 only";
  ASSERT_TRUE(p.take_send(9));
  EXPECT_EQ(p.owed_since(0), Clock::time_point::max());
  ASSERT_TRUE(p.lane_done(ts, Status::Ok(), 1));
  EXPECT_EQ(p.owed_since(1), Clock::time_point::max());
}

}  // namespace
}  // namespace sluice::detail
