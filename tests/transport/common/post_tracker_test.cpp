// PostTracker (depth, flush, failure) and SignalSequencer (a signal waits for the writes
// posted before it, however they finish), and PendingOps completing posts.
#include "transport/common/post_tracker.hpp"

#include <gtest/gtest.h>

#include <thread>

#include "transport/common/pending_ops.hpp"

using namespace sluice;
using namespace sluice::detail;
using namespace std::chrono_literals;

namespace {

PostSignal sig(uint64_t add) {
  PostSignal s;
  s.add = add;
  return s;
}

TEST(PostTracker, DepthHoldsPostersAndTimesOut) {
  PostTracker t(2);
  ASSERT_TRUE(t.admit(10ms).ok());
  ASSERT_TRUE(t.admit(10ms).ok());
  Status st = t.admit(20ms);
  EXPECT_EQ(ErrorCode::kTimeout, st.code) << st.message;
  std::thread done([&] {
    std::this_thread::sleep_for(20ms);
    t.done(Status::Ok());
  });
  EXPECT_TRUE(t.admit(5s).ok()) << "a finished post did not make room";
  done.join();
  EXPECT_EQ(2u, t.outstanding());
}

// nvlink's batch kernel finishes a run of posts as one op: done(st, n).
TEST(PostTracker, ARunFinishesManyPostsAtOnceAndWakesAHeldPoster) {
  PostTracker t(4);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(t.admit(10ms).ok());
  std::thread run([&] {
    std::this_thread::sleep_for(20ms);
    t.done(Status::Ok(), 3);
  });
  EXPECT_TRUE(t.admit(5s).ok()) << "a finished run did not make room";
  run.join();
  EXPECT_EQ(2u, t.outstanding());
  t.done({ErrorCode::kInternal, "run failed"}, 5);  // more than outstanding: stops at zero
  EXPECT_EQ(0u, t.outstanding());
  Status st = t.flush(10ms);
  EXPECT_EQ(ErrorCode::kInternal, st.code) << "the run's error is the flush's";
  EXPECT_TRUE(t.flush(10ms).ok());
}

TEST(PostTracker, FlushReportsTheFirstErrorOnceThenForgetsIt) {
  PostTracker t(8);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(t.admit(1s).ok());
  EXPECT_EQ(ErrorCode::kTimeout, t.flush(10ms).code);
  t.done(Status::Ok());
  t.done({ErrorCode::kOutOfRange, "first"});
  t.done({ErrorCode::kRemoteError, "second"});
  Status st = t.flush(1s);
  EXPECT_EQ(ErrorCode::kOutOfRange, st.code);
  EXPECT_EQ("first", st.message);
  EXPECT_TRUE(t.flush(1s).ok());
}

TEST(PostTracker, FailureWakesEveryWaiterAndSticks) {
  PostTracker t(1);
  ASSERT_TRUE(t.admit(1s).ok());
  std::thread poster([&] { EXPECT_EQ(ErrorCode::kPeerLost, t.admit(10s).code); });
  std::thread flusher([&] { EXPECT_EQ(ErrorCode::kPeerLost, t.flush(10s).code); });
  std::this_thread::sleep_for(20ms);
  t.fail({ErrorCode::kPeerLost, "gone"});
  poster.join();
  flusher.join();
  EXPECT_TRUE(t.failed());
  EXPECT_EQ(ErrorCode::kPeerLost, t.admit(1s).code);
}

TEST(SignalSequencer, SignalWithNothingOutstandingGoesAtOnce) {
  SignalSequencer s;
  EXPECT_TRUE(s.signal(sig(1)));
  uint64_t e = s.write_posted();
  std::vector<PostSignal> ready;
  s.write_done(e, &ready);
  EXPECT_TRUE(ready.empty());
  EXPECT_TRUE(s.signal(sig(2)));
}

TEST(SignalSequencer, SignalsWaitForEarlierWritesInAnyCompletionOrder) {
  SignalSequencer s;
  uint64_t w1 = s.write_posted(), w2 = s.write_posted();
  EXPECT_FALSE(s.signal(sig(10)));
  uint64_t w3 = s.write_posted();
  EXPECT_FALSE(s.signal(sig(20)));
  EXPECT_FALSE(s.signal(sig(30)));  // no write between: due together with 20
  std::vector<PostSignal> ready;
  s.write_done(w3, &ready);  // later epoch finishes first: nothing is due yet
  EXPECT_TRUE(ready.empty());
  s.write_done(w1, &ready);
  EXPECT_TRUE(ready.empty());
  s.write_done(w2, &ready);  // epoch 0 done: 10, then epoch 1 (already done): 20, then 30
  ASSERT_EQ(3u, ready.size());
  EXPECT_EQ(10u, ready[0].add);
  EXPECT_EQ(20u, ready[1].add);
  EXPECT_EQ(30u, ready[2].add);
  EXPECT_TRUE(s.signal(sig(40)));
}

TEST(SignalSequencer, ASignalWaitsForEveryWriteOfARun) {
  SignalSequencer s;
  uint64_t run = s.write_posted(3);
  EXPECT_FALSE(s.signal(sig(7)));
  std::vector<PostSignal> ready;
  s.write_done(run, &ready, 2);
  EXPECT_TRUE(ready.empty()) << "one write of the run is still outstanding";
  s.write_done(run, &ready, 1);
  ASSERT_EQ(1u, ready.size());
  EXPECT_EQ(7u, ready[0].add);
  uint64_t dropped = s.write_posted(4);
  s.write_dropped(dropped, 4);
  EXPECT_TRUE(s.signal(sig(8))) << "a dropped run leaves nothing outstanding";
}

TEST(SignalSequencer, ClearDropsQueuedSignalsAndIgnoresStaleWrites) {
  SignalSequencer s;
  uint64_t w = s.write_posted();
  EXPECT_FALSE(s.signal(sig(1)));
  EXPECT_EQ(1u, s.clear());
  std::vector<PostSignal> ready;
  s.write_done(w, &ready);
  EXPECT_TRUE(ready.empty());
  EXPECT_TRUE(s.signal(sig(2)));
}

TEST(PendingOpsPosts, PostsCompleteThroughTheHandlerOnEveryPath) {
  PendingOps p;
  std::vector<Status> seen;
  p.set_post_handler([&](const std::shared_ptr<TransferOp>& op, const Status& st) { seen.push_back(st); });
  auto post = [] {
    auto op = std::make_shared<TransferOp>();
    op->lanes.resize(1);
    return op;
  };
  uint64_t a = p.add(post());
  EXPECT_TRUE(p.lane_done(a, Status::Ok()));
  uint64_t b = p.add(post());
  EXPECT_TRUE(p.note_error(b, {ErrorCode::kOutOfRange, "nack"}));
  EXPECT_TRUE(p.lane_done(b, Status::Ok()));
  p.add(post());
  EXPECT_EQ(1u, p.expire(std::chrono::steady_clock::now() + 1h, 1s));
  p.add(post());
  p.fail_all({ErrorCode::kPeerLost, "gone"});
  p.add(post());  // after the failure: completed at once
  ASSERT_EQ(5u, seen.size());
  EXPECT_TRUE(seen[0].ok());
  EXPECT_EQ(ErrorCode::kOutOfRange, seen[1].code);
  EXPECT_EQ(ErrorCode::kTimeout, seen[2].code);
  EXPECT_EQ(ErrorCode::kPeerLost, seen[3].code);
  EXPECT_EQ(ErrorCode::kPeerLost, seen[4].code);
  EXPECT_EQ(0u, p.size());
}

}  // namespace
