// The torch backend's progress queue (src/torch/progress_queue.hpp): tasks run one at a time
// on whichever thread is at hand, a caller's request runs on the caller when nothing runs, a
// driving waiter runs what completions post, quiet tasks wait for the next runner, and close()
// hands everything left to drain(). Torch-free, so it runs here and under TSan.
#include "torch/progress_queue.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace sluice::torch_backend {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Generous bounds: they only keep a broken queue from hanging the suite, never time it.
constexpr auto kLong = 10s;

bool eventually(const std::function<bool()>& f) {
  const auto end = Clock::now() + kLong;
  while (Clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return f();
}

TEST(ProgressQueue, SubmitRunsOnTheCallerWhenNothingRuns) {
  ProgressQueue q([] {}, 1000ms, "pq-test");
  std::thread::id ran_on;
  q.submit([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());  // it ran inside submit()
}

TEST(ProgressQueue, SubmitWhileATaskRunsQueuesItForThatThread) {
  ProgressQueue q([] {}, 1000ms, "pq-test");
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, blocked = false;
  std::thread::id runner, second;
  std::thread t([&] {
    q.submit([&] {
      runner = std::this_thread::get_id();
      std::unique_lock<std::mutex> lk(mu);
      blocked = true;
      cv.notify_all();
      cv.wait(lk, [&] { return release; });
    });
  });
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return blocked; });
  }
  std::atomic<bool> ran{false};
  q.submit([&] {
    second = std::this_thread::get_id();
    ran = true;
  });
  EXPECT_FALSE(ran.load());  // not run here: a task is running elsewhere
  {
    std::lock_guard<std::mutex> lk(mu);
    release = true;
  }
  cv.notify_all();
  t.join();
  ASSERT_TRUE(eventually([&] { return ran.load(); }));
  EXPECT_EQ(second, runner);  // the running thread took it before it let go
}

// Another thread posts a task 20 ms into the driver's wait: the driver runs it itself.
void expect_driver_runs_a_later_post(ProgressQueue& q) {
  std::atomic<bool> done{false};
  std::thread::id ran_on;
  std::thread poster([&] {
    std::this_thread::sleep_for(20ms);
    q.post([&] {
      ran_on = std::this_thread::get_id();
      done = true;
    });
  });
  EXPECT_TRUE(q.drive_until([&] { return done.load(); }, Clock::now() + kLong));
  poster.join();
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

TEST(ProgressQueue, ADriverRunsWhatIsPostedWhileItWaits) {
  ProgressQueue q([] {}, 1000ms, "pq-test");
  expect_driver_runs_a_later_post(q);
}

TEST(ProgressQueue, WithoutADriverTheQueuesThreadRunsPostedTasks) {
  ProgressQueue q([] {}, 1000ms, "pq-test");
  std::atomic<bool> done{false};
  std::thread::id ran_on;
  q.post([&] {
    ran_on = std::this_thread::get_id();
    done = true;
  });
  ASSERT_TRUE(eventually([&] { return done.load(); }));
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(ProgressQueue, DriveUntilGivesUpAtItsDeadline) {
  ProgressQueue q([] {}, 1000ms, "pq-test");
  const auto start = Clock::now();
  EXPECT_FALSE(q.drive_until([] { return false; }, start + 30ms));
  EXPECT_GE(Clock::now() - start, 30ms);
}

TEST(ProgressQueue, WakeMakesADriverLookAgain) {
  ProgressQueue q([] {}, 1000ms, "pq-test");
  std::atomic<bool> flag{false};
  std::thread t([&] {
    std::this_thread::sleep_for(20ms);
    flag = true;  // changed outside any task
    q.wake();
  });
  EXPECT_TRUE(q.drive_until([&] { return flag.load(); }, Clock::now() + kLong));
  t.join();
}

// A driver that polls (spin) before sleeping: its poll must see what is posted and what
// wake() signals, or it would only notice at its deadline. The spin outlasts the deadline here,
// so a poll that missed the change makes drive_until return false.
TEST(ProgressQueue, APollingDriverRunsWhatIsPostedWhileItPolls) {
  ProgressQueue q([] {}, 1000ms, "pq-test", true, std::chrono::microseconds(std::chrono::seconds(60)));
  expect_driver_runs_a_later_post(q);
}

TEST(ProgressQueue, WakeEndsAPollingDriversPoll) {
  ProgressQueue q([] {}, 1000ms, "pq-test", true, std::chrono::microseconds(std::chrono::seconds(60)));
  std::atomic<bool> flag{false};
  std::thread t([&] {
    std::this_thread::sleep_for(20ms);
    flag = true;
    q.wake();
  });
  EXPECT_TRUE(q.drive_until([&] { return flag.load(); }, Clock::now() + kLong));
  t.join();
}

TEST(ProgressQueue, APollingDriverGivesUpAtItsDeadline) {
  ProgressQueue q([] {}, 1000ms, "pq-test", true, std::chrono::microseconds(std::chrono::seconds(60)));
  const auto start = Clock::now();
  EXPECT_FALSE(q.drive_until([] { return false; }, start + 30ms));
  EXPECT_GE(Clock::now() - start, 30ms);
}

// Polls once per drive_until: after its poll it sleeps, and a post still wakes it.
TEST(ProgressQueue, APollingDriverThatSleptIsStillWokenByAPost) {
  ProgressQueue q([] {}, 1000ms, "pq-test", true, std::chrono::microseconds(1000));
  std::atomic<bool> done{false};
  std::thread poster([&] {
    std::this_thread::sleep_for(50ms);  // well past the 1 ms poll
    q.post([&] { done = true; });
  });
  EXPECT_TRUE(q.drive_until([&] { return done.load(); }, Clock::now() + kLong));
  poster.join();
}

TEST(ProgressQueue, AQuietTaskRunsWithTheNextRunner) {
  ProgressQueue q([] {}, 1000ms, "pq-test");  // the tick is far off
  std::atomic<int> order{0};
  int quiet_at = -1, loud_at = -1;
  q.post([&] { quiet_at = order++; }, /*wake=*/false);
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(order.load(), 0);  // nobody was woken for it
  q.submit([&] { loud_at = order++; });
  EXPECT_EQ(quiet_at, 0);  // ran first, on this caller, inside submit()
  EXPECT_EQ(loud_at, 1);
}

TEST(ProgressQueue, AQuietTaskRunsAtTheLatestWithTheTick) {
  ProgressQueue q([] {}, 20ms, "pq-test");
  std::atomic<bool> done{false};
  q.post([&] { done = true; }, /*wake=*/false);
  EXPECT_TRUE(eventually([&] { return done.load(); }));
}

TEST(ProgressQueue, TheTickRunsAndNeverBesideATask) {
  std::atomic<int> inside{0}, overlap{0}, ticks{0};
  ProgressQueue q(
      [&] {
        if (inside.fetch_add(1) != 0) ++overlap;
        ++ticks;
        inside.fetch_sub(1);
      },
      2ms, "pq-test");
  // Three callers keep the queue busy, each submitting its next request as soon as its last
  // one ran (so there is always a task to run, and whoever runs them must still tick).
  std::atomic<bool> stop{false};
  std::vector<std::thread> ts;
  for (int i = 0; i < 3; ++i)
    ts.emplace_back([&] {
      while (!stop) {
        std::atomic<bool> ran{false};
        q.submit([&] {
          if (inside.fetch_add(1) != 0) ++overlap;
          std::this_thread::yield();
          inside.fetch_sub(1);
          ran = true;
        });
        q.drive_until([&] { return ran.load(); }, Clock::now() + kLong);
      }
    });
  const bool ticked = eventually([&] { return ticks.load() >= 5; });
  stop = true;
  for (auto& t : ts) t.join();
  EXPECT_TRUE(ticked);
  EXPECT_EQ(overlap.load(), 0);
}

// A long batch (a flood of tasks queued while one ran) still lets the tick in between its
// tasks.
TEST(ProgressQueue, TheTickComesInsideALongBatch) {
  std::atomic<int> ran{0}, mid_batch_ticks{0};
  constexpr int kFlood = 2000;
  ProgressQueue q(
      [&] {
        const int r = ran.load();
        if (r > 0 && r < kFlood) ++mid_batch_ticks;
      },
      1ms, "pq-test");
  std::atomic<bool> release{false};
  std::thread runner([&] {
    q.submit([&] {
      while (!release) std::this_thread::yield();  // holds the queue while the flood is queued
    });
  });
  std::this_thread::sleep_for(5ms);  // set-up only: the first task is likely running
  for (int i = 0; i < kFlood; ++i)
    q.post(
        [&] {
          std::this_thread::sleep_for(50us);
          ++ran;
        },
        /*wake=*/false);
  release = true;
  runner.join();  // its submit() ran the flood too: it was queued before the first task ended
  ASSERT_TRUE(eventually([&] { return ran.load() == kFlood; }));
  // >= 100 ms of tasks in one batch with a tick due every 1 ms: some ran between them (the
  // queue's thread stays away while a runner runs, so only the runner can have run them).
  EXPECT_GT(mid_batch_ticks.load(), 0);
}

// Posters, submitters and drivers together: every task runs exactly once, never two at a time,
// and every driver sees its own tasks done.
TEST(ProgressQueue, ManyThreadsOneTaskAtATime) {
  ProgressQueue q([] {}, 5ms, "pq-test");
  constexpr int kThreads = 6, kEach = 2000;
  std::atomic<int> inside{0}, overlap{0};
  long long plain_count = 0;  // touched only by tasks: TSan reports a second runner
  std::vector<std::thread> ts;
  for (int i = 0; i < kThreads; ++i)
    ts.emplace_back([&, i] {
      auto done = std::make_shared<std::atomic<int>>(0);
      for (int k = 0; k < kEach; ++k) {
        auto task = [&, done] {
          if (inside.fetch_add(1) != 0) ++overlap;
          ++plain_count;
          inside.fetch_sub(1);
          done->fetch_add(1);
        };
        if (i % 3 == 0)
          q.submit(task);
        else
          q.post(task, /*wake=*/(k % 4) != 0);
        if (i % 3 == 1 && k % 100 == 99)
          ASSERT_TRUE(q.drive_until([&] { return done->load() == k + 1; }, Clock::now() + kLong));
      }
      ASSERT_TRUE(q.drive_until([&] { return done->load() == kEach; }, Clock::now() + kLong));
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(overlap.load(), 0);
  q.submit([&] { EXPECT_EQ(plain_count, kThreads * kEach); });
}

// Two drivers; a task for driver B is posted just as driver A's own op completes. If the post
// wakes A, A leaves without running it: it must reach B (the queue's thread stays away while
// drivers wait, and the tick here never comes).
TEST(ProgressQueue, ATaskADriverLeavesBehindReachesAnotherDriver) {
  ProgressQueue q([] {}, 3600s, "pq-test");
  for (int round = 0; round < 50; ++round) {
    std::atomic<bool> a{false}, b{false};
    std::atomic<bool> b_done{false};
    std::thread driver_b([&] { b_done = q.drive_until([&] { return b.load(); }, Clock::now() + kLong); });
    std::thread driver_a([&] { q.drive_until([&] { return a.load(); }, Clock::now() + kLong); });
    std::this_thread::sleep_for(1ms);  // set-up only: both are likely waiting by now
    a = true;                          // A's op completed elsewhere...
    q.post([&] { b = true; });         // ...as B's completion is posted
    driver_a.join();
    driver_b.join();
    ASSERT_TRUE(b_done.load()) << "round " << round;
  }
}

TEST(ProgressQueue, CloseWaitsForTheRunningTaskAndLeavesTheRestToDrain) {
  ProgressQueue q([] {}, 1000ms, "pq-test");
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, blocked = false;
  std::atomic<bool> first_done{false};
  std::thread runner([&] {
    q.submit([&] {
      std::unique_lock<std::mutex> lk(mu);
      blocked = true;
      cv.notify_all();
      cv.wait(lk, [&] { return release; });
      first_done = true;
    });
  });
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return blocked; });
  }
  std::atomic<bool> closed{false};
  std::thread closer([&] {
    q.close();
    closed = true;
  });
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(closed.load());  // the running task holds it
  {
    std::lock_guard<std::mutex> lk(mu);
    release = true;
  }
  cv.notify_all();
  closer.join();
  runner.join();
  EXPECT_TRUE(first_done.load());

  // Closed: nothing runs anywhere until drain(); a driver only waits.
  std::atomic<bool> later{false};
  q.post([&] { later = true; });
  q.submit([&] { later = true; });
  std::thread drainer([&] {
    std::this_thread::sleep_for(20ms);
    EXPECT_FALSE(later.load());
    q.drain();
  });
  EXPECT_TRUE(q.drive_until([&] { return later.load(); }, Clock::now() + kLong));
  drainer.join();

  q.seal();
  std::atomic<bool> dropped_ran{false};
  q.post([&] { dropped_ran = true; });
  q.drain();
  EXPECT_FALSE(dropped_ran.load());
}

TEST(ProgressQueue, ATaskThatThrowsDoesNotStopTheQueue) {
  ProgressQueue q([] {}, 1000ms, "pq-test");
  bool after = false;
  q.submit([] { throw std::runtime_error("a bug in a task"); });
  q.submit([&] { after = true; });
  EXPECT_TRUE(after);
}

}  // namespace
}  // namespace sluice::torch_backend
